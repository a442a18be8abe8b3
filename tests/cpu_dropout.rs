//! CPU dropout: the mask's statistics, the op against `attention_slow_dropout` given the same
//! mask (outputs and gradients; fixed length, causal, GQA, packed), reproducibility.

mod common;

use candle::{DType, Device, IndexOp, Result, Tensor};
use candle_flash::{attention_slow_dropout, dropout_mask, FlashAttn, VarLen};
use common::varlen::{packed_qkv, per_sequence};
use common::{assert_close, assert_within_budget, grads, max_abs_diff, randn, with_causal, Case};

/// f32 inputs: both sides do f32 math in a different order.
const F32_TOL: f32 = 1e-5;
const NAMES: [&str; 3] = ["dq", "dk", "dv"];
const SEED: u64 = 0x1234_5678_9abc_def0;

/// Output and gradients (of `sum(out * w)`) of `ours` and `reference` agree within the f32
/// tolerance.
fn outputs_and_grads_close(
    what: &str,
    ours: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
    reference: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
    [q, k, v]: [&Tensor; 3],
    w: &Tensor,
) -> Result<()> {
    assert_close(what, &ours(q, k, v)?, &reference(q, k, v)?, F32_TOL)?;
    let ours = grads(ours, q, k, v, w)?;
    let expected = grads(reference, q, k, v, w)?;
    for ((name, a), b) in NAMES.iter().zip(&ours).zip(&expected) {
        assert_close(&format!("{name} {what}"), a, b, F32_TOL)?;
    }
    Ok(())
}

/// MHA, GQA, MQA; seqlen_q != seqlen_k both ways (causal 113/17 has rows that see no key);
/// odd lengths, so the 2x2 blocks of one Philox call are cut at the edges.
const SHAPES: &[Case] = &[
    Case::new(2, 17, 17, 4, 2, 16),
    Case::new(1, 17, 113, 4, 1, 40),
    Case::new(1, 113, 17, 4, 4, 64),
    Case::new(2, 64, 65, 8, 2, 32),
];

fn flash(p: f32, offset: u64, causal: bool) -> FlashAttn {
    FlashAttn::new()
        .causal(causal)
        .dropout(p)
        .seed(SEED)
        .rng_offset(offset)
}

fn fraction_dropped(mask: &Tensor) -> Result<f64> {
    let kept = mask.to_dtype(DType::U32)?.sum_all()?.to_scalar::<u32>()?;
    Ok(1.0 - kept as f64 / mask.elem_count() as f64)
}

#[test]
fn fraction_dropped_is_within_001_of_p() -> Result<()> {
    for (p, offset) in [(0.1, 0), (0.17, 1), (0.5, 2)] {
        // 2 · 4 · 512 · 256 = 1,048,576 entries.
        let mask = dropout_mask(p, SEED, offset, 2, 4, 512, 256)?;
        assert_eq!(mask.dims(), &[2, 4, 512, 256]);
        assert_eq!(mask.dtype(), DType::U8);
        let dropped = fraction_dropped(&mask)?;
        assert!(
            (dropped - p as f64).abs() <= 0.01,
            "p = {p}: dropped {dropped}"
        );
    }
    // p = 0 keeps everything.
    assert_eq!(
        fraction_dropped(&dropout_mask(0.0, SEED, 0, 1, 2, 33, 17)?)?,
        0.0
    );
    Ok(())
}

/// With q = 0 every visible probability is `1 / seqlen_k`; with v the identity the output
/// row `i` of head `h` is then `keep[h, i, :] / ((1 - p) · seqlen_k)`: the op's mask, read
/// back exactly.
#[test]
fn op_drops_the_entries_of_dropout_mask() -> Result<()> {
    let (b, sq, h, hk, sk, p) = (2, 37, 4, 2, 64, 0.3f32);
    let q = Tensor::zeros((b, sq, h, sk), DType::F32, &Device::Cpu)?;
    let eye = Tensor::eye(sk, DType::F32, &Device::Cpu)?;
    let v = eye
        .reshape((1, sk, 1, sk))?
        .broadcast_as((b, sk, hk, sk))?
        .contiguous()?;
    let k = v.zeros_like()?;
    let out = flash(p, 7, false).forward(&q, &k, &v)?; // (b, sq, h, sk)
    let read_back =
        ((out.transpose(1, 2)? * ((1.0 - p as f64) * sk as f64))?.round()?).to_dtype(DType::U8)?;
    let mask = dropout_mask(p, SEED, 7, b, h, sq, sk)?;
    assert_eq!(max_abs_diff(&read_back, &mask)?, 0.0);

    // Packed: sequence b uses the top-left corner of row b of the mask.
    let lens = [5, 37, 1];
    let varlen = VarLen::from_seqlens(&lens, &[sk; 3])?;
    let q = Tensor::zeros((varlen.total_q(), h, sk), DType::F32, &Device::Cpu)?;
    let v = eye
        .reshape((1, sk, 1, sk))?
        .broadcast_as((3, sk, hk, sk))?
        .flatten_to(1)?
        .contiguous()?;
    let k = v.zeros_like()?;
    let out = flash(p, 8, false).forward_varlen(&q, &k, &v, &varlen)?;
    let mask = dropout_mask(p, SEED, 8, 3, h, 37, sk)?;
    let mut row = 0;
    for (seq, &len) in lens.iter().enumerate() {
        let out = out.narrow(0, row, len)?.transpose(0, 1)?; // (h, len, sk)
        let read_back = ((out * ((1.0 - p as f64) * sk as f64))?.round()?).to_dtype(DType::U8)?;
        let expected = mask.i(seq)?.narrow(1, 0, len)?;
        assert_eq!(max_abs_diff(&read_back, &expected)?, 0.0, "sequence {seq}");
        row += len;
    }
    Ok(())
}

#[test]
fn output_and_grads_match_reference_given_the_mask() -> Result<()> {
    for (n, case) in with_causal(SHAPES).into_iter().enumerate() {
        let p = [0.17, 0.5][n % 2];
        let offset = 100 + n as u64;
        let (q, k, v) = case.qkv(DType::F32)?;
        let w = case.out_weight(DType::F32)?;
        let keep = dropout_mask(p, SEED, offset, case.b, case.h, case.sq, case.sk)?;
        let ours_fn =
            |q: &Tensor, k: &Tensor, v: &Tensor| flash(p, offset, case.causal).forward(q, k, v);
        let reference = |q: &Tensor, k: &Tensor, v: &Tensor| {
            attention_slow_dropout(q, k, v, case.scale(), case.causal, &keep, p)
        };
        let what = format!("p={p} {case:?}");
        outputs_and_grads_close(&what, ours_fn, reference, [&q, &k, &v], &w)?;
    }
    Ok(())
}

/// bf16: the low-precision rule (2x outputs, 3x gradients) against `attention_slow_dropout`
/// in bf16, with the same mask.
#[test]
fn bf16_within_budget_of_bf16_reference() -> Result<()> {
    let f32 = |t: &Tensor| t.to_dtype(DType::F32);
    for case in with_causal(&SHAPES[1..3]) {
        let (p, offset) = (0.17, 3);
        let (q, k, v) = case.qkv(DType::BF16)?;
        let w = case.out_weight(DType::BF16)?;
        let keep = dropout_mask(p, SEED, offset, case.b, case.h, case.sq, case.sk)?;
        let ours_fn =
            |q: &Tensor, k: &Tensor, v: &Tensor| flash(p, offset, case.causal).forward(q, k, v);
        let reference = |q: &Tensor, k: &Tensor, v: &Tensor| {
            attention_slow_dropout(q, k, v, case.scale(), case.causal, &keep, p)
        };
        let exact = reference(&f32(&q)?, &f32(&k)?, &f32(&v)?)?;
        let what = format!("{case:?}");
        assert_within_budget(
            &what,
            &ours_fn(&q, &k, &v)?,
            &reference(&q, &k, &v)?,
            &exact,
            2.0,
        )?;
        let ours = grads(ours_fn, &q, &k, &v, &w)?;
        let baseline = grads(reference, &q, &k, &v, &w)?;
        let exact = grads(reference, &f32(&q)?, &f32(&k)?, &f32(&v)?, &f32(&w)?)?;
        for i in 0..3 {
            let what = format!("{} {what}", NAMES[i]);
            assert_within_budget(&what, &ours[i], &baseline[i], &exact[i], 3.0)?;
        }
    }
    Ok(())
}

/// Packed batches (lengths 1, 17, 64, 113 and a sequence with no key), causal and GQA:
/// sequence b's mask is the top-left corner of row b of `dropout_mask`.
#[test]
fn varlen_output_and_grads_match_reference() -> Result<()> {
    let (lens_q, lens_k) = ([1, 17, 64, 113, 9], [17, 1, 64, 100, 0]);
    let varlen = VarLen::from_seqlens(&lens_q, &lens_k)?;
    let (h, hk, d, p, offset) = (4, 2, 32, 0.17, 11);
    let mask = dropout_mask(
        p,
        SEED,
        offset,
        5,
        h,
        varlen.max_seqlen_q(),
        varlen.max_seqlen_k(),
    )?;
    for causal in [false, true] {
        let (q, k, v) = packed_qkv(&varlen, h, hk, d, DType::F32)?;
        let w = randn((varlen.total_q(), h, d), DType::F32)?;
        let scale = 1.0 / (d as f32).sqrt();
        let ours_fn = |q: &Tensor, k: &Tensor, v: &Tensor| {
            flash(p, offset, causal).forward_varlen(q, k, v, &varlen)
        };
        let reference = |q: &Tensor, k: &Tensor, v: &Tensor| {
            per_sequence(&varlen, q, k, v, |b, q, k, v| {
                let keep = mask
                    .i(b)?
                    .narrow(1, 0, q.dim(1)?)?
                    .narrow(2, 0, k.dim(1)?)?;
                attention_slow_dropout(q, k, v, scale, causal, &keep.unsqueeze(0)?, p)
            })
        };
        let what = format!("causal={causal}");
        outputs_and_grads_close(&what, ours_fn, reference, [&q, &k, &v], &w)?;
    }
    Ok(())
}

#[test]
fn same_seed_and_offset_reproduce_bitwise() -> Result<()> {
    let case = Case::new(2, 33, 47, 4, 2, 32).causal(true);
    let (q, k, v) = case.qkv(DType::F32)?;
    let w = case.out_weight(DType::F32)?;
    let run = |attn: FlashAttn| grads(move |q, k, v| attn.forward(q, k, v), &q, &k, &v, &w);
    let out = |attn: FlashAttn| attn.forward(&q, &k, &v);
    let fixed = FlashAttn::new()
        .causal(true)
        .dropout(0.2)
        .seed(9)
        .rng_offset(4);
    assert_eq!(
        max_abs_diff(&out(fixed.clone())?, &out(fixed.clone())?)?,
        0.0
    );
    for (a, b) in run(fixed.clone())?.iter().zip(&run(fixed.clone())?) {
        assert_eq!(max_abs_diff(a, b)?, 0.0);
    }
    // Another offset, another seed, or no explicit offset (the counter advances): other masks.
    let differ = |a: FlashAttn, b: FlashAttn| -> Result<bool> {
        Ok(max_abs_diff(&out(a)?, &out(b)?)? > 0.0)
    };
    assert!(differ(fixed.clone(), fixed.clone().rng_offset(5))?);
    assert!(differ(fixed.clone(), fixed.clone().seed(10))?);
    let auto = FlashAttn::new().causal(true).dropout(0.2);
    assert!(differ(auto.clone(), auto)?);
    Ok(())
}

#[test]
fn zero_dropout_is_no_dropout() -> Result<()> {
    let case = Case::new(2, 33, 47, 4, 1, 32).causal(true);
    let (q, k, v) = case.qkv(DType::F32)?;
    let w = case.out_weight(DType::F32)?;
    let (plain, with_zero) = (
        FlashAttn::new().causal(true),
        FlashAttn::new().causal(true).dropout(0.0),
    );
    let (a, lse_a) = plain.forward_with_lse(&q, &k, &v)?;
    let (b, lse_b) = with_zero.forward_with_lse(&q, &k, &v)?;
    assert_eq!(max_abs_diff(&a, &b)?, 0.0);
    assert_eq!(max_abs_diff(&lse_a, &lse_b)?, 0.0);
    let ga = grads(|q, k, v| plain.forward(q, k, v), &q, &k, &v, &w)?;
    let gb = grads(|q, k, v| with_zero.forward(q, k, v), &q, &k, &v, &w)?;
    for (a, b) in ga.iter().zip(&gb) {
        assert_eq!(max_abs_diff(a, b)?, 0.0);
    }
    Ok(())
}

/// The LSE is that of the probabilities before dropout, as in FlashAttention.
#[test]
fn lse_ignores_dropout() -> Result<()> {
    let case = Case::new(1, 40, 40, 2, 2, 16).causal(true);
    let (q, k, v) = case.qkv(DType::F32)?;
    let (_, plain) = FlashAttn::new().causal(true).forward_with_lse(&q, &k, &v)?;
    let (_, dropped) = flash(0.5, 0, true).forward_with_lse(&q, &k, &v)?;
    assert_eq!(max_abs_diff(&plain, &dropped)?, 0.0);
    Ok(())
}
