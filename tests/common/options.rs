//! Checks of `FlashAttn` with options (window, softcap, ALiBi, block mask) against the oracle
//! `attention_slow_with`, shared by the CPU option tests (cpu_mods, cpu_block_sparse).

use candle::{DType, Result, Tensor};
use candle_flash::{attention_slow_with, FlashAttn, VarLen};

use super::varlen::{packed_qkv, per_sequence};
use super::{
    assert_close, assert_within_budget, assert_within_rounding, grads, max_abs_diff, randn, Case,
};

/// f32 inputs: both sides do f32 math in a different order.
pub const F32_TOL: f32 = 1e-5;
pub const NAMES: [&str; 3] = ["dq", "dk", "dv"];

/// The natural-log LSE of the final scores, `(b, h, sq)` flattened, in f64 host loops from
/// the definition: scale, cap, bias, then the window and the block mask's dense form (`-inf`
/// for rows that see no key).
pub fn lse_host(q: &Tensor, k: &Tensor, opts: &FlashAttn) -> Result<Vec<f32>> {
    let (b, sq, h, d) = q.dims4()?;
    let (_, sk, hk, _) = k.dims4()?;
    let flat =
        |t: &Tensor| -> Result<Vec<f32>> { t.to_dtype(DType::F32)?.flatten_all()?.to_vec1() };
    let (q, k) = (flat(q)?, flat(k)?);
    let scale = opts.softmax_scale.unwrap_or(1.0 / (d as f32).sqrt()) as f64;
    let slopes = match &opts.alibi_slopes {
        Some(s) => Some((flat(s)?, s.rank() == 2)),
        None => None,
    };
    let blocks = match &opts.block_mask {
        Some(m) => {
            let dense = m.to_dense(sq, sk)?;
            let heads = dense.dim(0)?;
            Some((dense.flatten_all()?.to_vec1::<u8>()?, heads))
        }
        None => None,
    };
    // A side of -1, or at or past the keys (FlashAttention 2's rule), is open; i128 sums, as
    // sides reach i64::MAX.
    let open = |w: i64| w == -1 || w as i128 >= sk as i128;
    let (left, right) = opts.window_size;
    let right = if opts.causal { 0 } else { right };
    let mut out = Vec::with_capacity(b * h * sq);
    for bi in 0..b {
        for hi in 0..h {
            let kh = hi / (h / hk);
            for i in 0..sq {
                let diag = i as i64 + sk as i64 - sq as i64;
                let mut sum = 0f64;
                for j in 0..sk {
                    let jj = j as i64;
                    let (di, ji) = (diag as i128, jj as i128);
                    if (!open(left) && ji < di - left as i128)
                        || (!open(right) && ji > di + right as i128)
                    {
                        continue;
                    }
                    if let Some((m, heads)) = &blocks {
                        let mh = if *heads == 1 { 0 } else { hi };
                        if m[(mh * sq + i) * sk + j] == 0 {
                            continue;
                        }
                    }
                    let q_i = &q[((bi * sq + i) * h + hi) * d..][..d];
                    let k_j = &k[((bi * sk + j) * hk + kh) * d..][..d];
                    let mut s: f64 = scale
                        * q_i
                            .iter()
                            .zip(k_j)
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum::<f64>();
                    if opts.softcap > 0.0 {
                        let c = opts.softcap as f64;
                        s = c * (s / c).tanh();
                    }
                    if let Some((slopes, per_batch)) = &slopes {
                        let slope = slopes[if *per_batch { bi * h + hi } else { hi }] as f64;
                        s -= slope * (diag - jj).abs() as f64;
                    }
                    sum += s.exp();
                }
                out.push(sum.ln() as f32);
            }
        }
    }
    Ok(out)
}

/// Asserts our LSE against [`lse_host`]: `-inf` exactly where the oracle's is, else within
/// 1e-5 relative.
pub fn check_lse(what: &str, lse: &Tensor, expected: &[f32]) -> Result<()> {
    let ours = lse.flatten_all()?.to_vec1::<f32>()?;
    assert_eq!(ours.len(), expected.len(), "{what}: lse length");
    for (i, (a, e)) in ours.iter().zip(expected).enumerate() {
        let same = if e.is_infinite() {
            a == e
        } else {
            (a - e).abs() <= 1e-5 * e.abs().max(1.0)
        };
        assert!(same, "{what}: lse[{i}] {a} vs {e}");
    }
    Ok(())
}

/// f32: output, LSE and the gradients of `sum(out · w)` against the oracle with `opts`.
/// Returns q, k, v and the output, for callers that compare them with other options.
pub fn check_f32(what: &str, case: &Case, opts: &FlashAttn) -> Result<[Tensor; 4]> {
    let what = format!("{what} {case:?}");
    let (q, k, v) = case.qkv(DType::F32)?;
    let (out, lse) = opts.forward_with_lse(&q, &k, &v)?;
    let expected = attention_slow_with(&q, &k, &v, opts)?;
    assert_close(&format!("out {what}"), &out, &expected, F32_TOL)?;
    check_lse(&what, &lse, &lse_host(&q, &k, opts)?)?;
    let w = case.out_weight(DType::F32)?;
    let ours = grads(|q, k, v| opts.forward(q, k, v), &q, &k, &v, &w)?;
    let reference = grads(|q, k, v| attention_slow_with(q, k, v, opts), &q, &k, &v, &w)?;
    for ((name, a), b) in NAMES.iter().zip(&ours).zip(&reference) {
        assert_close(&format!("{name} {what}"), a, b, F32_TOL)?;
    }
    Ok([q, k, v, out])
}

/// f16/bf16: the low-precision rule, 2x the oracle's own error for the output (and within one
/// ulp of the exact value: the CPU rounds once), 3x for the gradients.
pub fn check_low_precision(what: &str, case: &Case, opts: &FlashAttn, dtype: DType) -> Result<()> {
    let what = format!("{what} {dtype:?} {case:?}");
    let (q, k, v) = case.qkv(dtype)?;
    let w = case.out_weight(dtype)?;
    let f32 = |t: &Tensor| t.to_dtype(DType::F32);
    let (q32, k32, v32, w32) = (f32(&q)?, f32(&k)?, f32(&v)?, f32(&w)?);
    let ours = opts.forward(&q, &k, &v)?;
    let baseline = attention_slow_with(&q, &k, &v, opts)?;
    let exact = attention_slow_with(&q32, &k32, &v32, opts)?;
    assert_within_budget(&format!("out {what}"), &ours, &baseline, &exact, 2.0)?;
    assert_within_rounding(&format!("out {what}"), &ours, &exact, 1.0)?;
    let slow = |q: &Tensor, k: &Tensor, v: &Tensor| attention_slow_with(q, k, v, opts);
    let ours = grads(|q, k, v| opts.forward(q, k, v), &q, &k, &v, &w)?;
    let baseline = grads(slow, &q, &k, &v, &w)?;
    let exact = grads(slow, &q32, &k32, &v32, &w32)?;
    for (i, name) in NAMES.iter().enumerate() {
        assert_eq!(ours[i].dtype(), dtype);
        let what = format!("{name} {what}");
        assert_within_budget(&what, &ours[i], &baseline[i], &exact[i], 3.0)?;
    }
    Ok(())
}

/// The direct backward (`FlashAttn::backward`) gives the same bits as `backward()` through
/// the forward.
pub fn check_direct_backward(case: &Case, opts: &FlashAttn) -> Result<()> {
    let (q, k, v) = case.qkv(DType::F32)?;
    let w = case.out_weight(DType::F32)?;
    let (out, lse) = opts.forward_with_lse(&q, &k, &v)?;
    let (dq, dk, dv) = opts.backward(&q, &k, &v, &out, &lse, &w)?;
    let autograd = grads(|q, k, v| opts.forward(q, k, v), &q, &k, &v, &w)?;
    for ((name, a), b) in NAMES.iter().zip([&dq, &dk, &dv]).zip(&autograd) {
        assert_eq!(max_abs_diff(a, b)?, 0.0, "{name}");
    }
    Ok(())
}

/// A packed f32 batch through `opts.forward_varlen`, output and gradients, against
/// `attention_slow_with` on each sequence alone with `seq_opts(b)`. Returns q, k, v and the
/// output, for callers that check more.
pub fn check_varlen_f32(
    what: &str,
    varlen: &VarLen,
    (h, hk, d): (usize, usize, usize),
    opts: &FlashAttn,
    seq_opts: impl Fn(usize) -> Result<FlashAttn>,
) -> Result<[Tensor; 4]> {
    let (q, k, v) = packed_qkv(varlen, h, hk, d, DType::F32)?;
    let reference = |q: &Tensor, k: &Tensor, v: &Tensor| {
        per_sequence(varlen, q, k, v, |b, q, k, v| {
            attention_slow_with(q, k, v, &seq_opts(b)?)
        })
    };
    let flash = |q: &Tensor, k: &Tensor, v: &Tensor| opts.forward_varlen(q, k, v, varlen);
    let out = flash(&q, &k, &v)?;
    assert_close(what, &out, &reference(&q, &k, &v)?, F32_TOL)?;
    let w = randn((varlen.total_q(), h, d), DType::F32)?;
    let ours = grads(flash, &q, &k, &v, &w)?;
    let expected = grads(reference, &q, &k, &v, &w)?;
    for ((name, a), e) in NAMES.iter().zip(&ours).zip(&expected) {
        assert_close(&format!("{name} {what}"), a, e, F32_TOL)?;
    }
    Ok([q, k, v, out])
}
