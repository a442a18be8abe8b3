//! NaN in, NaN out (issue 21): a NaN among a row's scores makes that row's output, LSE and
//! gradients NaN on every device and path, distinct from a row that sees no key (zeros, LSE
//! -inf); rows that never meet the NaN stay finite. Shared by the CPU tests and the GPU
//! suite's reliability section.

use candle::{DType, Device, Result, Tensor};
use candle_flash::{FlashAttn, KvCache};

/// What one row must hold.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Row {
    Nan,
    Finite,
    Zero,
    NegInf,
    /// Either finite or NaN: see [`nan_key_causal`].
    Any,
}

/// Random bf16 `shape` on `dev` with a NaN at element `at` (row-major index).
fn with_nan(shape: &[usize], at: Option<usize>, dev: &Device) -> Result<Tensor> {
    let mut x = super::randn(shape, DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    if let Some(at) = at {
        x[at] = f32::NAN;
    }
    Tensor::from_vec(x, shape, &Device::Cpu)?
        .to_dtype(DType::BF16)?
        .to_device(dev)
}

/// Checks every row (the last dim) of `t` against `expect(index of the row's first element,
/// as a multi-index without the last dim)`.
fn check_rows(what: &str, t: &Tensor, expect: impl Fn(&[usize]) -> Row) -> Result<()> {
    let dims = t.dims().to_vec();
    let (outer, last) = dims.split_at(dims.len() - 1);
    let x = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let mut index = vec![0usize; outer.len()];
    for (r, row) in x.chunks(last[0].max(1)).enumerate() {
        let mut rest = r;
        for (i, &n) in outer.iter().enumerate().rev() {
            index[i] = rest % n;
            rest /= n;
        }
        let want = expect(&index);
        let ok = match want {
            Row::Nan => row.iter().all(|v| v.is_nan()),
            Row::Finite => row.iter().all(|v| v.is_finite()),
            Row::Zero => row.iter().all(|&v| v == 0.0),
            Row::NegInf => row.iter().all(|&v| v == f32::NEG_INFINITY),
            Row::Any => row.iter().all(|v| v.is_finite() || v.is_nan()),
        };
        if !ok {
            candle::bail!(
                "{what}: row {index:?} should be {want:?}, holds {:?}",
                &row[..row.len().min(4)]
            );
        }
    }
    Ok(())
}

/// An LSE `(b, h, sq)` as rows of one element.
fn lse_rows(lse: &Tensor) -> Result<Tensor> {
    lse.unsqueeze(lse.rank())
}

/// A NaN in one query row: that row's output, LSE and dq are NaN, and so are dK and dV of its
/// K/V head (every key it saw); every other row and head stays finite.
pub fn nan_query(dev: &Device) -> Result<()> {
    let (b, sq, sk, h, hk, d) = (2, 40, 40, 4, 2, 64);
    // q[0, 5, 1, 3] is NaN: batch 0, token 5, head 1 (K/V head 0).
    let q = with_nan(&[b, sq, h, d], Some(((5 * h) + 1) * d + 3), dev)?;
    let k = with_nan(&[b, sk, hk, d], None, dev)?;
    let v = with_nan(&[b, sk, hk, d], None, dev)?;
    let w = with_nan(&[b, sq, h, d], None, dev)?;
    let bad_row = |i: &[usize]| i[0] == 0 && i[1] == 5 && i[2] == 1;
    let bad_kv = |i: &[usize]| i[0] == 0 && i[2] == 0;
    let nan_if = |bad: bool| if bad { Row::Nan } else { Row::Finite };
    for deterministic in [false, true] {
        let attn = FlashAttn::new().deterministic(deterministic);
        let tag = format!("NaN query (deterministic={deterministic})");
        let (out, lse) = attn.forward_with_lse(&q, &k, &v)?;
        check_rows(&format!("{tag}: out"), &out, |i| nan_if(bad_row(i)))?;
        check_rows(&format!("{tag}: lse"), &lse_rows(&lse)?, |i| {
            nan_if(i[0] == 0 && i[1] == 1 && i[2] == 5)
        })?;
        let [dq, dk, dv] = super::grads(|q, k, v| attn.forward(q, k, v), &q, &k, &v, &w)?;
        check_rows(&format!("{tag}: dq"), &dq, |i| nan_if(bad_row(i)))?;
        check_rows(&format!("{tag}: dk"), &dk, |i| nan_if(bad_kv(i)))?;
        check_rows(&format!("{tag}: dv"), &dv, |i| nan_if(bad_kv(i)))?;
    }
    Ok(())
}

/// A NaN in one key under a causal mask with seqlen_q > seqlen_k: rows that see no key give
/// zeros and LSE -inf, rows that see keys before the NaN one stay finite, rows that see it
/// are NaN (output, LSE, dq). The dq of the NaN key's head in rows that mask it is left
/// open: the GPU kernels compute dQ = dS K over whole key tiles, where a masked entry's
/// dS = 0 times the NaN key is NaN (as in any dense matmul, PyTorch's math path included);
/// the CPU skips masked keys. Other heads and batches stay finite.
pub fn nan_key_causal(dev: &Device) -> Result<()> {
    let (b, sq, sk, h, hk, d) = (2, 40, 30, 4, 2, 64);
    // Bottom-right alignment: row i sees keys j <= i - 10. k[0, 20, 1, 7] is NaN.
    let k = with_nan(&[b, sk, hk, d], Some(((20 * hk) + 1) * d + 7), dev)?;
    let q = with_nan(&[b, sq, h, d], None, dev)?;
    let v = with_nan(&[b, sk, hk, d], None, dev)?;
    let w = with_nan(&[b, sq, h, d], None, dev)?;
    let row = |batch: usize, token: usize, head: usize| {
        if token < 10 {
            Row::Zero
        } else if batch == 0 && head / 2 == 1 && token >= 30 {
            Row::Nan
        } else {
            Row::Finite
        }
    };
    for deterministic in [false, true] {
        let attn = FlashAttn::new().causal(true).deterministic(deterministic);
        let tag = format!("NaN key, causal (deterministic={deterministic})");
        let (out, lse) = attn.forward_with_lse(&q, &k, &v)?;
        check_rows(&format!("{tag}: out"), &out, |i| row(i[0], i[1], i[2]))?;
        // lse is (b, h, sq); a row without keys holds -inf.
        check_rows(&format!("{tag}: lse"), &lse_rows(&lse)?, |i| {
            match row(i[0], i[2], i[1]) {
                Row::Zero => Row::NegInf,
                r => r,
            }
        })?;
        let [dq, ..] = super::grads(|q, k, v| attn.forward(q, k, v), &q, &k, &v, &w)?;
        check_rows(&format!("{tag}: dq"), &dq, |i| {
            match row(i[0], i[1], i[2]) {
                Row::Nan => Row::Nan,
                _ if i[0] == 0 && i[2] / 2 == 1 => Row::Any,
                other => other,
            }
        })?;
    }
    Ok(())
}

/// Decoding over a long cache (split across the GPU's SMs at batch 1) with one NaN key: the
/// heads that read it give NaN, the other K/V head's stay finite; the split merge must not
/// drop the NaN.
pub fn nan_in_cache(dev: &Device) -> Result<()> {
    let (len, h, hk, d) = (3000, 4, 2, 64);
    let mut cache = KvCache::new(1, len + 8, hk, d, DType::BF16, dev)?;
    // k[0, 1234, 0, 11] is NaN: K/V head 0, read by query heads 0 and 1.
    let k = with_nan(&[1, len, hk, d], Some((1234 * hk) * d + 11), dev)?;
    let v = with_nan(&[1, len, hk, d], None, dev)?;
    let none = Tensor::zeros((1, 0, h, d), DType::BF16, dev)?;
    let attn = FlashAttn::new().causal(true);
    cache.append_and_attend(&none, &k, &v, &attn)?;
    let q = with_nan(&[1, 1, h, d], None, dev)?;
    let k1 = with_nan(&[1, 1, hk, d], None, dev)?;
    let v1 = with_nan(&[1, 1, hk, d], None, dev)?;
    let out = cache.append_and_attend(&q, &k1, &v1, &attn)?;
    check_rows("decode with a NaN key", &out, |i| {
        if i[2] < 2 {
            Row::Nan
        } else {
            Row::Finite
        }
    })
}
