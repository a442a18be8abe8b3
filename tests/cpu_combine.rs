//! [`candle_flash::combine`]: attention over keys split into disjoint parts, merged from each
//! part's (out, lse), equals attention over all the keys; rows no part reaches stay zero with
//! lse -inf; bad parts are refused by name.

mod common;

use candle::{DType, Device, IndexOp, Result, Tensor};
use candle_flash::{attention_slow, combine, FlashAttn};
use common::{assert_close, assert_fails, assert_within_budget, max_abs, randn};

/// (batch, seqlen_q, seqlen_k, heads, kv heads, head_dim, key split points).
type Split = (usize, usize, usize, usize, usize, usize, &'static [usize]);

const CASES: &[Split] = &[
    (1, 1, 2, 2, 2, 8, &[1]),
    (2, 17, 45, 4, 2, 40, &[20]),
    (1, 33, 128, 4, 1, 64, &[1, 64, 127]),
    (2, 5, 300, 2, 2, 96, &[100, 200]),
];

/// The parts' `(out, lse)` for keys cut at `cuts`, and the whole attention's.
#[allow(clippy::type_complexity)]
fn parts_and_whole(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cuts: &[usize],
) -> Result<(Vec<(Tensor, Tensor)>, (Tensor, Tensor))> {
    let attn = FlashAttn::new();
    let sk = k.dim(1)?;
    let mut bounds = vec![0];
    bounds.extend_from_slice(cuts);
    bounds.push(sk);
    let mut parts = vec![];
    for w in bounds.windows(2) {
        let (a, b) = (w[0], w[1]);
        let kp = k.narrow(1, a, b - a)?.contiguous()?;
        let vp = v.narrow(1, a, b - a)?.contiguous()?;
        parts.push(attn.forward_with_lse(q, &kp, &vp)?);
    }
    Ok((parts, attn.forward_with_lse(q, k, v)?))
}

#[test]
fn combined_parts_equal_the_whole_attention() -> Result<()> {
    for &(b, sq, sk, h, hk, d, cuts) in CASES {
        let q = randn((b, sq, h, d), DType::F32)?;
        let k = randn((b, sk, hk, d), DType::F32)?;
        let v = randn((b, sk, hk, d), DType::F32)?;
        let (parts, (out, lse)) = parts_and_whole(&q, &k, &v, cuts)?;
        let (merged, merged_lse) = combine(&parts)?;
        let what = format!("b={b} sq={sq} sk={sk} h={h}/{hk} d={d} cuts={cuts:?}");
        assert_close(&format!("{what}: out"), &merged, &out, 1e-5)?;
        assert_close(&format!("{what}: lse"), &merged_lse, &lse, 1e-5)?;
        // Parts in any order.
        let reversed: Vec<_> = parts.iter().rev().cloned().collect();
        assert_close(
            &format!("{what}: reversed"),
            &combine(&reversed)?.0,
            &out,
            1e-5,
        )?;
    }
    Ok(())
}

/// bf16 and f16 parts (each rounded once to its dtype, then merged in f32 and rounded again)
/// within the FlashAttention rule: at most 2x the error of the same math done in the low
/// precision, against the whole attention in f32.
#[test]
fn low_precision_parts_stay_within_the_error_budget() -> Result<()> {
    for dtype in [DType::BF16, DType::F16] {
        let (b, sq, sk, h, d) = (2, 33, 257, 4, 64);
        let q = randn((b, sq, h, d), dtype)?;
        let k = randn((b, sk, h, d), dtype)?;
        let v = randn((b, sk, h, d), dtype)?;
        let (parts, _) = parts_and_whole(&q, &k, &v, &[100])?;
        let merged = combine(&parts)?.0;
        assert_eq!(merged.dtype(), dtype);
        let f32 = |t: &Tensor| t.to_dtype(DType::F32);
        let scale = 1.0 / (d as f32).sqrt();
        let exact = attention_slow(&f32(&q)?, &f32(&k)?, &f32(&v)?, scale, false)?;
        let low = attention_slow(&q, &k, &v, scale, false)?;
        assert_within_budget(
            &format!("{dtype:?}"),
            &f32(&merged)?,
            &f32(&low)?,
            &exact,
            2.0,
        )?;
    }
    Ok(())
}

/// A row that sees no key in any part (its lse -inf everywhere) merges to zeros and -inf; a
/// row that sees keys in one part only takes that part's result.
#[test]
fn rows_without_keys_stay_zero() -> Result<()> {
    let (b, s, h, d) = (1, 3, 2, 8);
    let o1 = randn((b, s, h, d), DType::F32)?;
    let o2 = randn((b, s, h, d), DType::F32)?;
    let inf = f32::NEG_INFINITY;
    // Row 0: no keys anywhere; row 1: part 1 only; row 2: both.
    let l1 = Tensor::new(&[[[inf, 0.5, 1.0], [inf, -2.0, 0.0]]], &Device::Cpu)?;
    let l2 = Tensor::new(&[[[inf, inf, 1.0], [inf, inf, 0.0]]], &Device::Cpu)?;
    let (o, lse) = combine(&[(o1.clone(), l1), (o2.clone(), l2)])?;
    assert_eq!(max_abs(&o.i((.., 0))?)?, 0.0);
    let lse = lse.to_vec3::<f32>()?;
    assert!(lse[0].iter().all(|r| r[0] == f32::NEG_INFINITY), "{lse:?}");
    assert_close("part 1 alone", &o.i((.., 1))?, &o1.i((.., 1))?, 1e-6)?;
    assert!((lse[0][0][1] - 0.5).abs() < 1e-6 && (lse[0][1][1] + 2.0).abs() < 1e-6);
    // Equal LSEs: the mean, and lse + ln 2.
    let mean = ((o1.i((.., 2))? + o2.i((.., 2))?)? * 0.5)?;
    assert_close("equal weights", &o.i((.., 2))?, &mean, 1e-6)?;
    assert!((lse[0][0][2] - (1.0 + 2f32.ln())).abs() < 1e-6);
    assert!(o
        .flatten_all()?
        .to_vec1::<f32>()?
        .iter()
        .all(|x| x.is_finite()));
    Ok(())
}

#[test]
fn one_part_is_itself() -> Result<()> {
    let o = randn((1, 4, 2, 8), DType::F32)?;
    let lse = randn((1, 2, 4), DType::F32)?;
    let (out, l) = combine(&[(o.clone(), lse.clone())])?;
    assert_eq!(max_abs(&(out - o)?)?, 0.0);
    assert_eq!(max_abs(&(l - lse)?)?, 0.0);
    Ok(())
}

#[test]
fn bad_parts_are_refused_by_name() -> Result<()> {
    let o = randn((1, 4, 2, 8), DType::F32)?;
    let lse = randn((1, 2, 4), DType::F32)?;
    assert_fails(combine(&[]), &["combine: parts is empty"]);
    let other = randn((1, 5, 2, 8), DType::F32)?;
    assert_fails(
        combine(&[(o.clone(), lse.clone()), (other, lse.clone())]),
        &["parts[1].0", "[1, 5, 2, 8]", "[1, 4, 2, 8]"],
    );
    let bf16 = o.to_dtype(DType::BF16)?;
    assert_fails(
        combine(&[(o.clone(), lse.clone()), (bf16, lse.clone())]),
        &["parts[1].0", "BF16"],
    );
    let wrong_lse = randn((1, 4, 2), DType::F32)?;
    assert_fails(
        combine(&[(o.clone(), lse.clone()), (o.clone(), wrong_lse)]),
        &["parts[1].1 (lse)", "[1, 2, 4]"],
    );
    let f16_lse = lse.to_dtype(DType::F16)?;
    assert_fails(
        combine(&[(o.clone(), f16_lse)]),
        &["parts[0].1 (lse)", "F16", "f32"],
    );
    assert_fails(
        combine(&[(randn((4, 2, 8), DType::F32)?, lse)]),
        &["parts[0].0", "(batch, seqlen_q, num_heads, head_dim)"],
    );
    Ok(())
}
