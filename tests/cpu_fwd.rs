//! CPU forward pass against `attention_slow`: outputs, LSE, strides and edge cases.

mod common;

use candle::{DType, Device, IndexOp, Result, Tensor};
use candle_flash::{attention_slow, flash_attn, FlashAttn};
use common::{
    assert_close, assert_within_budget, assert_within_rounding, lse_slow, max_abs_diff, randn,
    slow, with_causal, Case,
};

/// Covers every head_dim in {8, 16, 40, 64, 96, 128, 256}, seqlens 1, 17, 113, 256 with
/// seqlen_q != seqlen_k both ways, MHA (4/4), GQA (8/2), MQA (4/1), batch 1 and 2.
const SHAPES: &[Case] = &[
    Case::new(1, 1, 1, 4, 4, 8),
    Case::new(2, 17, 17, 8, 2, 16),
    Case::new(1, 113, 113, 4, 1, 40),
    Case::new(2, 256, 256, 4, 4, 64),
    Case::new(1, 17, 113, 8, 2, 96),
    Case::new(2, 113, 17, 4, 1, 128),
    Case::new(1, 1, 256, 4, 4, 256),
    Case::new(1, 256, 1, 8, 2, 64),
    Case::new(2, 113, 256, 4, 4, 8),
    Case::new(1, 256, 113, 8, 2, 256),
];

/// f32 inputs: both sides do f32 math in a different order.
const F32_TOL: f32 = 1e-5;

#[test]
fn f32_matches_reference() -> Result<()> {
    for case in with_causal(SHAPES) {
        let (q, k, v) = case.qkv(DType::F32)?;
        let ours = case.flash().forward(&q, &k, &v)?;
        assert_eq!(ours.dims(), &[case.b, case.sq, case.h, case.d]);
        assert_eq!(ours.dtype(), DType::F32);
        assert_close(
            &format!("{case:?}"),
            &ours,
            &slow(&case, &q, &k, &v)?,
            F32_TOL,
        )?;
    }
    Ok(())
}

#[test]
fn flash_attn_is_forward_with_default_options() -> Result<()> {
    let case = Case::new(2, 17, 33, 4, 2, 40).causal(true);
    let (q, k, v) = case.qkv(DType::F32)?;
    let a = flash_attn(&q, &k, &v, true)?;
    let b = FlashAttn::new()
        .causal(true)
        .softmax_scale(case.scale())
        .forward(&q, &k, &v)?;
    assert_eq!(max_abs_diff(&a, &b)?, 0.0);
    Ok(())
}

/// f16/bf16 inputs: our error vs f32 math on the same (upcast) inputs is at most twice that of
/// the same attention computed in the low precision, plus 1e-5; and within one ulp of it.
fn low_precision_within_budget(dtype: DType) -> Result<()> {
    for case in with_causal(SHAPES) {
        let (q, k, v) = case.qkv(dtype)?;
        let ours = case.flash().forward(&q, &k, &v)?;
        assert_eq!(ours.dtype(), dtype);
        let baseline = slow(&case, &q, &k, &v)?;
        let f32 = |t: &Tensor| t.to_dtype(DType::F32);
        let exact = slow(&case, &f32(&q)?, &f32(&k)?, &f32(&v)?)?;
        assert_within_budget(
            &format!("{dtype:?} {case:?}"),
            &ours,
            &baseline,
            &exact,
            2.0,
        )?;
        // The CPU computes in f32 and rounds once: within one ulp, which a skipped tile of
        // keys is not (the rule above is loose at long rows).
        assert_within_rounding(&format!("{dtype:?} {case:?}"), &ours, &exact, 1.0)?;
    }
    Ok(())
}

#[test]
fn f16_within_2x_of_f16_reference() -> Result<()> {
    low_precision_within_budget(DType::F16)
}

#[test]
fn bf16_within_2x_of_bf16_reference() -> Result<()> {
    low_precision_within_budget(DType::BF16)
}

#[test]
fn lse_matches_logsumexp() -> Result<()> {
    let shapes = [
        Case::new(2, 17, 113, 8, 2, 64),
        Case::new(1, 113, 17, 4, 1, 40),
        Case::new(1, 1, 256, 4, 4, 128),
    ];
    for case in with_causal(&shapes) {
        let (q, k, v) = case.qkv(DType::F32)?;
        let (_, lse) = case.flash().forward_with_lse(&q, &k, &v)?;
        assert_eq!(lse.dims(), &[case.b, case.h, case.sq]);
        assert_eq!(lse.dtype(), DType::F32);
        let expected = lse_slow(&q, &k, case.scale(), case.causal)?;
        // Rows that see no key (causal, seqlen_q > seqlen_k) are -inf on both sides.
        let (ours, expected) = (
            lse.flatten_all()?.to_vec1::<f32>()?,
            expected.flatten_all()?.to_vec1::<f32>()?,
        );
        for (i, (a, b)) in ours.iter().zip(&expected).enumerate() {
            if b.is_infinite() {
                assert_eq!(a, b, "{case:?} row {i}");
            } else {
                assert!(
                    (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                    "{case:?} row {i}: {a} vs {b}"
                );
            }
        }
    }
    Ok(())
}

#[test]
fn strided_inputs_match_contiguous() -> Result<()> {
    let (b, sq, sk, h, hk, d) = (2, 33, 47, 4, 2, 64);
    // q built as (b, h, s, d) and transposed; k and v narrowed along seqlen and heads.
    let q = randn((b, h, sq, d), DType::F32)?.transpose(1, 2)?;
    let k = randn((b, sk + 9, hk + 1, d), DType::F32)?
        .narrow(1, 5, sk)?
        .narrow(2, 1, hk)?;
    let v = randn((b, hk, sk + 3, d), DType::F32)?
        .transpose(1, 2)?
        .narrow(1, 3, sk)?;
    for t in [&q, &k, &v] {
        assert!(!t.is_contiguous());
    }
    for causal in [false, true] {
        let flash = FlashAttn::new().causal(causal);
        let ours = flash.forward(&q, &k, &v)?;
        let contiguous = flash.forward(&q.contiguous()?, &k.contiguous()?, &v.contiguous()?)?;
        assert_eq!(max_abs_diff(&ours, &contiguous)?, 0.0, "causal={causal}");
        let reference = attention_slow(&q, &k, &v, 1.0 / (d as f32).sqrt(), causal)?;
        assert_close("strided", &ours, &reference, F32_TOL)?;
    }
    Ok(())
}

#[test]
fn causal_rows_without_keys_are_zero_with_neg_inf_lse() -> Result<()> {
    // Bottom-right alignment: query i sees keys j <= i + sk - sq, so queries 0..sq-sk see none.
    let case = Case::new(2, 20, 5, 4, 2, 16).causal(true);
    let (q, k, v) = case.qkv(DType::F32)?;
    let (out, lse) = case.flash().forward_with_lse(&q, &k, &v)?;
    let dead = case.sq - case.sk;
    let dead_out = out.i((.., ..dead))?.flatten_all()?.to_vec1::<f32>()?;
    assert!(
        dead_out.iter().all(|&x| x == 0.0),
        "fully masked rows must be exactly zero"
    );
    let dead_lse = lse.i((.., .., ..dead))?.flatten_all()?.to_vec1::<f32>()?;
    assert!(
        dead_lse.iter().all(|&x| x == f32::NEG_INFINITY),
        "fully masked LSE must be -inf"
    );
    let live_lse = lse.i((.., .., dead..))?.flatten_all()?.to_vec1::<f32>()?;
    assert!(live_lse.iter().all(|x| x.is_finite()));
    // The first visible row sees exactly key 0, so it outputs v[0] of its K/V head.
    let first = out.i((.., dead))?; // (b, h, d)
    let v0 = v.i((.., 0))?; // (b, hk, d)
    let v0 = Tensor::cat(
        &[
            v0.i((.., 0..1))?,
            v0.i((.., 0..1))?,
            v0.i((.., 1..2))?,
            v0.i((.., 1..2))?,
        ],
        1,
    )?;
    assert_close("row seeing one key", &first, &v0, 1e-6)?;
    assert_close("all rows", &out, &slow(&case, &q, &k, &v)?, F32_TOL)
}

#[test]
fn custom_softmax_scale() -> Result<()> {
    let case = Case::new(1, 65, 80, 4, 1, 32);
    let (q, k, v) = case.qkv(DType::F32)?;
    for (scale, causal) in [(0.05, false), (0.4, true), (1.0, false)] {
        let ours = FlashAttn::new()
            .softmax_scale(scale)
            .causal(causal)
            .forward(&q, &k, &v)?;
        let reference = attention_slow(&q, &k, &v, scale, causal)?;
        assert_close(&format!("scale {scale}"), &ours, &reference, F32_TOL)?;
    }
    Ok(())
}

#[test]
fn seqlen_k_zero_gives_zeros() -> Result<()> {
    let q = randn((2, 7, 4, 32), DType::F32)?;
    let kv = Tensor::zeros((2, 0, 2, 32), DType::F32, &Device::Cpu)?;
    for causal in [false, true] {
        let (out, lse) = FlashAttn::new()
            .causal(causal)
            .forward_with_lse(&q, &kv, &kv)?;
        assert_eq!(out.dims(), &[2, 7, 4, 32]);
        assert!(out
            .flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .all(|&x| x == 0.0));
        assert!(lse
            .flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .all(|&x| x == f32::NEG_INFINITY));
        let reference = attention_slow(&q, &kv, &kv, 0.5, causal)?;
        assert_eq!(max_abs_diff(&out, &reference)?, 0.0);
    }
    Ok(())
}

#[test]
fn empty_batch_or_seqlen_q_gives_empty_output() -> Result<()> {
    let dev = Device::Cpu;
    for (b, sq) in [(0, 9), (3, 0)] {
        let q = Tensor::zeros((b, sq, 4, 16), DType::BF16, &dev)?;
        let kv = randn((b, 9, 2, 16), DType::BF16)?;
        let (out, lse) = FlashAttn::new()
            .causal(true)
            .forward_with_lse(&q, &kv, &kv)?;
        assert_eq!(out.dims(), &[b, sq, 4, 16]);
        assert_eq!(out.dtype(), DType::BF16);
        assert_eq!(lse.dims(), &[b, 4, sq]);
        assert_eq!(
            attention_slow(&q, &kv, &kv, 0.25, true)?.dims(),
            &[b, sq, 4, 16]
        );
    }
    Ok(())
}

#[test]
fn repeated_runs_are_bitwise_equal() -> Result<()> {
    let case = Case::new(2, 113, 256, 8, 2, 64).causal(true);
    let (q, k, v) = case.qkv(DType::BF16)?;
    let first = case.flash().forward(&q, &k, &v)?;
    for _ in 0..5 {
        assert_eq!(
            max_abs_diff(&case.flash().forward(&q, &k, &v)?, &first)?,
            0.0
        );
    }
    Ok(())
}
