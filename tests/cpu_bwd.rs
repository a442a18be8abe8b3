//! CPU backward pass: gradients through `flash_attn` against Candle's autograd of
//! `attention_slow`, against finite differences, and inside a small training loop.

mod common;

use candle::{DType, Device, IndexOp, Module, Result, Tensor, Var};
use candle_flash::{attention_slow, flash_attn, FlashAttn};
use candle_nn::{linear, AdamW, Linear, Optimizer, VarBuilder, VarMap};
use common::{
    assert_close, assert_within_budget, grads, max_abs_diff, randn, slow, with_causal, Case,
};

/// Every head_dim class, seqlen_q != seqlen_k both ways (causal 113/17 has rows that see no
/// key), MHA, GQA and MQA.
const SHAPES: &[Case] = &[
    Case::new(1, 1, 1, 2, 2, 8),
    Case::new(2, 17, 17, 4, 2, 16),
    Case::new(1, 17, 113, 4, 1, 40),
    Case::new(1, 113, 17, 4, 4, 64),
    Case::new(2, 64, 64, 4, 1, 96),
    Case::new(1, 113, 113, 8, 2, 128),
    Case::new(1, 33, 65, 2, 2, 256),
];

/// f32 gradients, relative to `max(1, max |reference gradient|)`.
const F32_TOL: f32 = 1e-5;
const NAMES: [&str; 3] = ["dq", "dk", "dv"];

fn flash(case: &Case) -> impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor> + '_ {
    move |q, k, v| case.flash().forward(q, k, v)
}

fn reference(case: &Case) -> impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor> + '_ {
    move |q, k, v| slow(case, q, k, v)
}

#[test]
fn f32_grads_match_autograd_of_reference() -> Result<()> {
    for case in with_causal(SHAPES) {
        let (q, k, v) = case.qkv(DType::F32)?;
        let w = case.out_weight(DType::F32)?;
        let ours = grads(flash(&case), &q, &k, &v, &w)?;
        let expected = grads(reference(&case), &q, &k, &v, &w)?;
        for ((name, a), b) in NAMES.iter().zip(&ours).zip(&expected) {
            assert_eq!(a.dims(), b.dims(), "{name} {case:?}");
            assert_close(&format!("{name} {case:?}"), a, b, F32_TOL)?;
        }
    }
    Ok(())
}

/// f16/bf16: our gradient error vs f32 autograd on the upcast inputs is at most 3x that of
/// autograd through `attention_slow` in the low precision, plus 1e-5.
fn low_precision_within_budget(dtype: DType) -> Result<()> {
    for case in with_causal(SHAPES) {
        let (q, k, v) = case.qkv(dtype)?;
        let w = case.out_weight(dtype)?;
        let ours = grads(flash(&case), &q, &k, &v, &w)?;
        let baseline = grads(reference(&case), &q, &k, &v, &w)?;
        let f32 = |t: &Tensor| t.to_dtype(DType::F32);
        let exact = grads(reference(&case), &f32(&q)?, &f32(&k)?, &f32(&v)?, &f32(&w)?)?;
        for (i, name) in NAMES.iter().enumerate() {
            assert_eq!(ours[i].dtype(), dtype);
            let what = format!("{name} {dtype:?} {case:?}");
            assert_within_budget(&what, &ours[i], &baseline[i], &exact[i], 3.0)?;
        }
    }
    Ok(())
}

#[test]
fn f16_grads_within_3x_of_f16_reference() -> Result<()> {
    low_precision_within_budget(DType::F16)
}

#[test]
fn bf16_grads_within_3x_of_bf16_reference() -> Result<()> {
    low_precision_within_budget(DType::BF16)
}

/// Central differences of `sum(attention_slow(q, k, v) · w)` computed in f64, against our f32
/// gradients on the same values.
#[test]
fn grads_match_finite_differences() -> Result<()> {
    const EPS: f64 = 1e-3;
    // sq < sk (every row sees a prefix) and sq > sk (rows 0 and 1 see no key when causal).
    for case in with_causal(&[Case::new(1, 3, 5, 2, 1, 8), Case::new(1, 5, 3, 2, 1, 8)]) {
        let (q, k, v) = case.qkv(DType::F32)?;
        let w = case.out_weight(DType::F32)?;
        let ours = grads(flash(&case), &q, &k, &v, &w)?;
        let f64 = |t: &Tensor| t.to_dtype(DType::F64);
        let (w64, mut inputs) = (f64(&w)?, [f64(&q)?, f64(&k)?, f64(&v)?]);
        let loss = |inputs: &[Tensor; 3]| -> Result<f64> {
            let out = slow(&case, &inputs[0], &inputs[1], &inputs[2])?;
            (out * &w64)?.sum_all()?.to_scalar::<f64>()
        };
        for (i, name) in NAMES.iter().enumerate() {
            let (shape, values) = (
                inputs[i].shape().clone(),
                inputs[i].flatten_all()?.to_vec1::<f64>()?,
            );
            let ours = ours[i].flatten_all()?.to_vec1::<f32>()?;
            for (j, &x) in values.iter().enumerate() {
                let mut at = |delta: f64| -> Result<f64> {
                    let mut moved = values.clone();
                    moved[j] = x + delta;
                    inputs[i] = Tensor::from_vec(moved, &shape, &Device::Cpu)?;
                    loss(&inputs)
                };
                let numeric = (at(EPS)? - at(-EPS)?) / (2.0 * EPS);
                let err = (ours[j] as f64 - numeric).abs();
                assert!(
                    err <= 1e-4 * numeric.abs().max(1.0),
                    "{name}[{j}] {case:?}: {} vs {numeric}",
                    ours[j]
                );
            }
            inputs[i] = Tensor::from_vec(values, &shape, &Device::Cpu)?;
        }
    }
    Ok(())
}

#[test]
fn rows_without_keys_get_zero_grads() -> Result<()> {
    let case = Case::new(1, 9, 4, 4, 2, 32).causal(true);
    let (q, k, v) = case.qkv(DType::F32)?;
    let w = case.out_weight(DType::F32)?;
    let [dq, dk, dv] = grads(flash(&case), &q, &k, &v, &w)?;
    let dead = case.sq - case.sk;
    let dq_dead = dq.i((.., ..dead))?.flatten_all()?.to_vec1::<f32>()?;
    assert!(dq_dead.iter().all(|&x| x == 0.0));
    for g in [&dq, &dk, &dv] {
        assert!(g
            .flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .all(|x| x.is_finite()));
    }
    Ok(())
}

#[test]
fn strided_inputs_give_the_same_grads() -> Result<()> {
    let case = Case::new(2, 31, 45, 4, 2, 64).causal(true);
    let q = randn((2, 4, 31, 64), DType::F32)?.transpose(1, 2)?;
    let k = randn((2, 50, 2, 64), DType::F32)?.narrow(1, 5, 45)?;
    let v = randn((2, 2, 45, 64), DType::F32)?.transpose(1, 2)?;
    let w = case.out_weight(DType::F32)?;
    let ours = grads(flash(&case), &q, &k, &v, &w)?;
    let contiguous = grads(
        flash(&case),
        &q.contiguous()?,
        &k.contiguous()?,
        &v.contiguous()?,
        &w,
    )?;
    for ((name, a), b) in NAMES.iter().zip(&ours).zip(&contiguous) {
        assert_eq!(max_abs_diff(a, b)?, 0.0, "{name}");
    }
    Ok(())
}

#[test]
fn repeated_backward_is_bitwise_equal() -> Result<()> {
    let case = Case::new(2, 64, 96, 8, 2, 64).causal(true);
    let (q, k, v) = case.qkv(DType::BF16)?;
    let w = case.out_weight(DType::BF16)?;
    let first = grads(flash(&case), &q, &k, &v, &w)?;
    for _ in 0..3 {
        let again = grads(flash(&case), &q, &k, &v, &w)?;
        for (a, b) in first.iter().zip(&again) {
            assert_eq!(max_abs_diff(a, b)?, 0.0);
        }
    }
    Ok(())
}

/// A one-layer attention block: q, k, v projections (GQA 4/2 heads of 8), causal attention,
/// output projection.
struct Block {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
}

const HIDDEN: usize = 32;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = HIDDEN / HEADS;

impl Block {
    fn new(vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            q: linear(HIDDEN, HEADS * HEAD_DIM, vb.pp("q"))?,
            k: linear(HIDDEN, KV_HEADS * HEAD_DIM, vb.pp("k"))?,
            v: linear(HIDDEN, KV_HEADS * HEAD_DIM, vb.pp("v"))?,
            o: linear(HEADS * HEAD_DIM, HIDDEN, vb.pp("o"))?,
        })
    }

    /// Mean squared error of the block's output on `x` `(batch, seq, HIDDEN)` against `y`.
    fn loss(&self, x: &Tensor, y: &Tensor, slow_attention: bool) -> Result<Tensor> {
        let (b, s, _) = x.dims3()?;
        let q = self.q.forward(x)?.reshape((b, s, HEADS, HEAD_DIM))?;
        let k = self.k.forward(x)?.reshape((b, s, KV_HEADS, HEAD_DIM))?;
        let v = self.v.forward(x)?.reshape((b, s, KV_HEADS, HEAD_DIM))?;
        let attn = if slow_attention {
            attention_slow(&q, &k, &v, 1.0 / (HEAD_DIM as f32).sqrt(), true)?
        } else {
            flash_attn(&q, &k, &v, true)?
        };
        let out = self.o.forward(&attn.reshape((b, s, HIDDEN))?)?;
        (out - y)?.sqr()?.mean_all()
    }
}

#[test]
fn training_steps_reduce_the_loss() -> Result<()> {
    let varmap = VarMap::new();
    let block = Block::new(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu))?;
    let x = randn((2, 16, HIDDEN), DType::F32)?;
    let y = randn((2, 16, HIDDEN), DType::F32)?;

    // The weights' gradients through flash_attn equal those through attention_slow.
    let ours = block.loss(&x, &y, false)?.backward()?;
    let expected = block.loss(&x, &y, true)?.backward()?;
    let vars: Vec<(String, Var)> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    assert_eq!(vars.len(), 8);
    for (name, var) in &vars {
        let (a, b) = (
            ours.get(var).expect("no gradient"),
            expected.get(var).expect("no gradient"),
        );
        assert_close(name, a, b, F32_TOL)?;
    }

    let mut opt = AdamW::new_lr(varmap.all_vars(), 1e-2)?;
    let initial = block.loss(&x, &y, false)?.to_scalar::<f32>()?;
    for _ in 0..30 {
        opt.backward_step(&block.loss(&x, &y, false)?)?;
    }
    let last = block.loss(&x, &y, false)?.to_scalar::<f32>()?;
    assert!(last < 0.8 * initial, "loss went from {initial} to {last}");
    Ok(())
}

#[test]
fn custom_scale_grads() -> Result<()> {
    let case = Case::new(1, 40, 40, 2, 1, 16);
    let (q, k, v) = case.qkv(DType::F32)?;
    let w = case.out_weight(DType::F32)?;
    let ours = grads(
        |q, k, v| FlashAttn::new().softmax_scale(0.7).forward(q, k, v),
        &q,
        &k,
        &v,
        &w,
    )?;
    let expected = grads(
        |q, k, v| attention_slow(q, k, v, 0.7, false),
        &q,
        &k,
        &v,
        &w,
    )?;
    for ((name, a), b) in NAMES.iter().zip(&ours).zip(&expected) {
        assert_close(name, a, b, F32_TOL)?;
    }
    Ok(())
}
