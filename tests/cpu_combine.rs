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

/// NaN propagates to its own row only: a NaN lse in one part makes that row's output and lse
/// NaN; a NaN element of a part's output makes that element of the merged output NaN.
#[test]
fn nan_stays_in_its_row() -> Result<()> {
    let (b, s, h, d) = (1, 3, 2, 4);
    let dev = &Device::Cpu;
    let o2 = randn((b, s, h, d), DType::F32)?;
    let l1 = randn((b, h, s), DType::F32)?;
    let mut o1 = randn((b, s, h, d), DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let mut l2 = randn((b, h, s), DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    // lse NaN at (head 0, query 1) of part 2; o NaN at (query 2, head 1, element 3) of part 1.
    l2[1] = f32::NAN;
    let bad_element = (2 * h + 1) * d + 3;
    o1[bad_element] = f32::NAN;
    let o1 = Tensor::from_vec(o1, (b, s, h, d), dev)?;
    let l2 = Tensor::from_vec(l2, (b, h, s), dev)?;
    let (o, lse) = combine(&[(o1, l1), (o2, l2)])?;
    let o = o.flatten_all()?.to_vec1::<f32>()?;
    for (i, x) in o.iter().enumerate() {
        let (query, head) = (i / (h * d), (i / d) % h);
        let nan_row = query == 1 && head == 0;
        assert_eq!(x.is_nan(), nan_row || i == bad_element, "out[{i}] = {x}");
    }
    let lse = lse.flatten_all()?.to_vec1::<f32>()?;
    for (i, x) in lse.iter().enumerate() {
        assert_eq!(x.is_nan(), i == 1, "lse[{i}] = {x}");
    }
    Ok(())
}

/// Parts of any strides (an output cut at an offset from a wider one, strided rows, a strided
/// head_dim, a transposed lse) merge as their contiguous copies do.
#[test]
fn strided_parts_merge_like_contiguous_ones() -> Result<()> {
    let (b, s, h, d) = (2, 5, 3, 8);
    let parts: Vec<(Tensor, Tensor)> = (0..3)
        .map(|_| {
            Ok((
                randn((b, s, h, d), DType::F32)?,
                randn((b, h, s), DType::F32)?,
            ))
        })
        .collect::<Result<_>>()?;
    let wide = Tensor::cat(&[&randn((b, s, h, 3), DType::F32)?, &parts[0].0], 3)?;
    let strided = vec![
        (
            wide.narrow(3, 3, d)?,
            parts[0].1.transpose(1, 2)?.contiguous()?.transpose(1, 2)?,
        ),
        (
            parts[1].0.transpose(1, 2)?.contiguous()?.transpose(1, 2)?,
            parts[1].1.clone(),
        ),
        (
            parts[2].0.transpose(2, 3)?.contiguous()?.transpose(2, 3)?,
            parts[2].1.clone(),
        ),
    ];
    assert!(strided.iter().all(|(o, _)| !o.is_contiguous()));
    let (o, lse) = combine(&strided)?;
    let (o_ref, lse_ref) = combine(&parts)?;
    assert_close("strided out", &o, &o_ref, 1e-6)?;
    assert_close("strided lse", &lse, &lse_ref, 1e-6)?;
    Ok(())
}

/// More parts than one CUDA launch takes (16, merged there in groups): 21 pieces of one
/// attention merge into the whole.
#[test]
fn many_parts_equal_the_whole_attention() -> Result<()> {
    let (b, sq, sk, h, d) = (1, 4, 84, 2, 16);
    let q = randn((b, sq, h, d), DType::F32)?;
    let k = randn((b, sk, h, d), DType::F32)?;
    let v = randn((b, sk, h, d), DType::F32)?;
    let cuts: Vec<usize> = (1..21).map(|i| 4 * i).collect();
    let (parts, (out, lse)) = parts_and_whole(&q, &k, &v, &cuts)?;
    assert_eq!(parts.len(), 21);
    let (merged, merged_lse) = combine(&parts)?;
    assert_close("21 parts: out", &merged, &out, 1e-5)?;
    assert_close("21 parts: lse", &merged_lse, &lse, 1e-5)?;
    Ok(())
}
