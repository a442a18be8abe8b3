//! CPU direct backward ([`FlashAttn::backward`]): the same gradients as `backward()` through
//! [`FlashAttn::forward`] (bitwise: the same kernel on the same inputs), no graph recorded,
//! and one test per bad input.

mod common;

use candle::{DType, Result, Tensor, Var};
use candle_flash::{attention_slow, FlashAttn};
use common::{assert_close, assert_fails, grads, max_abs_diff, randn, with_causal, Case};

const NAMES: [&str; 3] = ["dq", "dk", "dv"];
const SEED: u64 = 0x0bad_cafe_f00d_d00d;

/// MHA, GQA and MQA; seqlen_q != seqlen_k both ways (causal 33/9 has rows that see no key);
/// odd lengths.
const SHAPES: &[Case] = &[
    Case::new(1, 1, 1, 2, 2, 8),
    Case::new(2, 17, 17, 4, 2, 16),
    Case::new(1, 17, 45, 4, 1, 40),
    Case::new(1, 33, 9, 4, 4, 64),
    Case::new(2, 24, 31, 8, 2, 32),
];

/// The direct backward of `attn` on `(q, k, v)` with output gradient `w`.
fn direct(attn: &FlashAttn, q: &Tensor, k: &Tensor, v: &Tensor, w: &Tensor) -> Result<[Tensor; 3]> {
    let (out, lse) = attn.forward_with_lse(q, k, v)?;
    let (dq, dk, dv) = attn.backward(q, k, v, &out, &lse, w)?;
    Ok([dq, dk, dv])
}

/// Autograd's gradients of `sum(forward(q, k, v) · w)` through `attn`.
fn autograd(
    attn: &FlashAttn,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    w: &Tensor,
) -> Result<[Tensor; 3]> {
    grads(|q, k, v| attn.forward(q, k, v), q, k, v, w)
}

/// Direct and autograd gradients are bitwise equal, with the inputs' shapes and dtype.
fn assert_same_grads(
    what: &str,
    attn: &FlashAttn,
    [q, k, v]: [&Tensor; 3],
    w: &Tensor,
) -> Result<()> {
    let ours = direct(attn, q, k, v, w)?;
    let expected = autograd(attn, q, k, v, w)?;
    for (i, name) in NAMES.iter().enumerate() {
        let input = [q, k, v][i];
        assert_eq!(ours[i].dims(), input.dims(), "{name} {what}");
        assert_eq!(ours[i].dtype(), input.dtype(), "{name} {what}");
        let diff = max_abs_diff(&ours[i], &expected[i])?;
        assert_eq!(
            diff, 0.0,
            "{name} {what}: differs from autograd by {diff:e}"
        );
    }
    Ok(())
}

fn matches_autograd(dtype: DType) -> Result<()> {
    for case in with_causal(SHAPES) {
        let (q, k, v) = case.qkv(dtype)?;
        let w = case.out_weight(dtype)?;
        assert_same_grads(
            &format!("{dtype:?} {case:?}"),
            &case.flash(),
            [&q, &k, &v],
            &w,
        )?;
    }
    Ok(())
}

#[test]
fn f32_matches_autograd() -> Result<()> {
    matches_autograd(DType::F32)
}

#[test]
fn bf16_matches_autograd() -> Result<()> {
    matches_autograd(DType::BF16)
}

#[test]
fn f16_matches_autograd() -> Result<()> {
    matches_autograd(DType::F16)
}

/// With a fixed seed and offset the backward drops the forward's entries: the same gradients
/// as autograd (which keeps the forward's mask in the op), and not those of another offset.
#[test]
fn dropout_matches_autograd() -> Result<()> {
    for case in with_causal(SHAPES) {
        for dtype in [DType::F32, DType::BF16] {
            let (q, k, v) = case.qkv(dtype)?;
            let w = case.out_weight(dtype)?;
            let attn = case.flash().dropout(0.25).seed(SEED).rng_offset(11);
            assert_same_grads(
                &format!("dropout {dtype:?} {case:?}"),
                &attn,
                [&q, &k, &v],
                &w,
            )?;
        }
    }
    // A backward told another offset regenerates another mask.
    let case = Case::new(1, 32, 32, 2, 2, 16);
    let (q, k, v) = case.qkv(DType::F32)?;
    let w = case.out_weight(DType::F32)?;
    let attn = case.flash().dropout(0.25).seed(SEED);
    let (out, lse) = attn.clone().rng_offset(3).forward_with_lse(&q, &k, &v)?;
    let (same, _, _) = attn
        .clone()
        .rng_offset(3)
        .backward(&q, &k, &v, &out, &lse, &w)?;
    let (other, _, _) = attn.rng_offset(4).backward(&q, &k, &v, &out, &lse, &w)?;
    assert!(max_abs_diff(&same, &other)? > 0.0);
    Ok(())
}

/// Independent of the autograd path: close to autograd through `attention_slow`.
#[test]
fn f32_matches_reference() -> Result<()> {
    for case in with_causal(SHAPES) {
        let (q, k, v) = case.qkv(DType::F32)?;
        let w = case.out_weight(DType::F32)?;
        let attn = case.flash().softmax_scale(0.3);
        let ours = direct(&attn, &q, &k, &v, &w)?;
        let reference =
            |q: &Tensor, k: &Tensor, v: &Tensor| attention_slow(q, k, v, 0.3, case.causal);
        let expected = grads(reference, &q, &k, &v, &w)?;
        for ((name, a), b) in NAMES.iter().zip(&ours).zip(&expected) {
            assert_close(&format!("{name} {case:?}"), a, b, 1e-5)?;
        }
    }
    Ok(())
}

/// Strided q, k, v, out, grad_out and a transposed (non-contiguous) lse give the same
/// gradients as their contiguous copies.
#[test]
fn strided_inputs_give_the_same_grads() -> Result<()> {
    let attn = FlashAttn::new().causal(true);
    let q = randn((2, 4, 31, 64), DType::F32)?.transpose(1, 2)?;
    let k = randn((2, 50, 2, 64), DType::F32)?.narrow(1, 5, 45)?;
    let v = randn((2, 2, 45, 64), DType::F32)?.transpose(1, 2)?;
    let w = randn((2, 4, 31, 64), DType::F32)?.transpose(1, 2)?;
    let (out, lse) = attn.forward_with_lse(&q, &k, &v)?;
    let out_strided = out.transpose(1, 2)?.contiguous()?.transpose(1, 2)?;
    let lse_strided = lse.transpose(1, 2)?.contiguous()?.transpose(1, 2)?;
    assert!(!out_strided.is_contiguous() && !lse_strided.is_contiguous());
    let (dq, dk, dv) = attn.backward(&q, &k, &v, &out_strided, &lse_strided, &w)?;
    let c = |t: &Tensor| t.contiguous();
    let expected = attn.backward(&c(&q)?, &c(&k)?, &c(&v)?, &out, &lse, &c(&w)?)?;
    for ((name, a), b) in
        NAMES
            .iter()
            .zip([&dq, &dk, &dv])
            .zip([&expected.0, &expected.1, &expected.2])
    {
        assert_eq!(max_abs_diff(a, b)?, 0.0, "{name}");
    }
    Ok(())
}

/// On variables, the results are plain tensors: no graph back to q, k, v.
#[test]
fn records_no_graph() -> Result<()> {
    let case = Case::new(1, 16, 16, 2, 1, 16).causal(true);
    let (q, k, v) = case.qkv(DType::F32)?;
    let (q, k, v) = (
        Var::from_tensor(&q)?,
        Var::from_tensor(&k)?,
        Var::from_tensor(&v)?,
    );
    let w = case.out_weight(DType::F32)?;
    let attn = case.flash();
    let (out, lse) = attn.forward_with_lse(&q, &k, &v)?;
    assert!(out.track_op(), "the forward is differentiable");
    let (dq, dk, dv) = attn.backward(&q, &k, &v, &out, &lse, &w)?;
    for (name, g) in NAMES.iter().zip([&dq, &dk, &dv]) {
        assert!(!g.track_op(), "{name} records a graph");
        assert!(!g.is_variable(), "{name} is a variable");
    }
    Ok(())
}

/// seqlen_q = 0: zero gradients shaped like the inputs.
#[test]
fn empty_query_gives_zero_grads() -> Result<()> {
    let case = Case::new(2, 0, 7, 4, 2, 16);
    let (q, k, v) = case.qkv(DType::BF16)?;
    let w = case.out_weight(DType::BF16)?;
    let [dq, dk, dv] = direct(&case.flash(), &q, &k, &v, &w)?;
    assert_eq!(dq.dims(), q.dims());
    assert_eq!(dq.dtype(), DType::BF16);
    for (g, x) in [(&dk, &k), (&dv, &v)] {
        assert_eq!(g.dims(), x.dims());
        assert_eq!(common::max_abs(g)?, 0.0);
    }
    Ok(())
}

// Bad inputs: each error names the argument and what was expected.

/// q, k, v, out, lse and grad_out of a valid f32 problem (batch 2, seqlen_q 8, seqlen_k 12,
/// 4/2 heads, head_dim 16).
struct Valid {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    grad_out: Tensor,
}

impl Valid {
    fn new() -> Self {
        let (q, k, v) = Case::new(2, 8, 12, 4, 2, 16).qkv(DType::F32).unwrap();
        let (out, lse) = FlashAttn::new().forward_with_lse(&q, &k, &v).unwrap();
        let grad_out = randn(out.shape(), DType::F32).unwrap();
        Self {
            q,
            k,
            v,
            out,
            lse,
            grad_out,
        }
    }

    fn backward_with(
        &self,
        attn: &FlashAttn,
        out: &Tensor,
        lse: &Tensor,
        grad_out: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        attn.backward(&self.q, &self.k, &self.v, out, lse, grad_out)
    }
}

#[test]
fn valid_inputs_pass() {
    let t = Valid::new();
    assert!(t
        .backward_with(&FlashAttn::new(), &t.out, &t.lse, &t.grad_out)
        .is_ok());
}

#[test]
fn out_of_wrong_shape() {
    let t = Valid::new();
    let out = t.out.narrow(1, 0, 7).unwrap();
    assert_fails(
        t.backward_with(&FlashAttn::new(), &out, &t.lse, &t.grad_out),
        &["out:", "q's shape [2, 8, 4, 16]", "[2, 7, 4, 16]"],
    );
}

#[test]
fn out_of_wrong_dtype() {
    let t = Valid::new();
    let out = t.out.to_dtype(DType::BF16).unwrap();
    assert_fails(
        t.backward_with(&FlashAttn::new(), &out, &t.lse, &t.grad_out),
        &["out:", "dtype as q (F32)", "BF16"],
    );
}

#[test]
fn grad_out_of_wrong_dtype() {
    let t = Valid::new();
    let grad_out = t.grad_out.to_dtype(DType::F16).unwrap();
    assert_fails(
        t.backward_with(&FlashAttn::new(), &t.out, &t.lse, &grad_out),
        &["grad_out:", "dtype as q (F32)", "F16"],
    );
}

#[test]
fn grad_out_of_wrong_shape() {
    let t = Valid::new();
    let grad_out = t.grad_out.reshape((2, 8, 2, 32)).unwrap();
    assert_fails(
        t.backward_with(&FlashAttn::new(), &t.out, &t.lse, &grad_out),
        &["grad_out:", "q's shape [2, 8, 4, 16]", "[2, 8, 2, 32]"],
    );
}

#[test]
fn lse_of_wrong_shape() {
    let t = Valid::new();
    // (batch, seqlen_q, num_heads) instead of (batch, num_heads, seqlen_q).
    let lse = t.lse.transpose(1, 2).unwrap();
    assert_fails(
        t.backward_with(&FlashAttn::new(), &t.out, &lse, &t.grad_out),
        &[
            "lse:",
            "[2, 4, 8] (batch, num_heads, seqlen_q)",
            "[2, 8, 4]",
        ],
    );
    let lse = t.lse.flatten_all().unwrap();
    assert_fails(
        t.backward_with(&FlashAttn::new(), &t.out, &lse, &t.grad_out),
        &["lse:", "[2, 4, 8]", "[64]"],
    );
}

#[test]
fn lse_of_wrong_dtype() {
    let t = Valid::new();
    let lse = t.lse.to_dtype(DType::BF16).unwrap();
    assert_fails(
        t.backward_with(&FlashAttn::new(), &t.out, &lse, &t.grad_out),
        &["lse:", "F32", "BF16"],
    );
}

#[test]
fn dropout_without_rng_offset() {
    let t = Valid::new();
    assert_fails(
        t.backward_with(&FlashAttn::new().dropout(0.1), &t.out, &t.lse, &t.grad_out),
        &[
            "rng_offset",
            "dropout_p 0.1",
            "FlashAttn::rng_offset",
            "forward_with_lse and backward",
        ],
    );
    // With the offset set, the same call runs.
    let attn = FlashAttn::new().dropout(0.1).rng_offset(0);
    assert!(t.backward_with(&attn, &t.out, &t.lse, &t.grad_out).is_ok());
}

#[test]
fn bad_dropout_p_and_scale() {
    let t = Valid::new();
    assert_fails(
        t.backward_with(
            &FlashAttn::new().dropout(1.5).rng_offset(0),
            &t.out,
            &t.lse,
            &t.grad_out,
        ),
        &["dropout_p:", "[0, 1)", "1.5"],
    );
    assert_fails(
        t.backward_with(
            &FlashAttn::new().softmax_scale(-1.0),
            &t.out,
            &t.lse,
            &t.grad_out,
        ),
        &["softmax_scale:", "-1"],
    );
}

#[test]
fn bad_qkv_are_reported_like_forward() {
    let t = Valid::new();
    let k = t.k.narrow(3, 0, 8).unwrap();
    assert_fails(
        FlashAttn::new().backward(&t.q, &k, &t.v, &t.out, &t.lse, &t.grad_out),
        &["k:", "head_dim 8", "q's head_dim 16"],
    );
}
