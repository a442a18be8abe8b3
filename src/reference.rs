//! `attention_slow`: attention in plain Candle ops, the oracle the tests compare against.

use candle::{bail, DType, Result, Tensor, D};

use crate::params;

/// Attention computed the obvious way, `softmax(scale · q kᵀ + mask) v`, in plain Candle ops:
/// the reference that [`crate::flash_attn`] is tested against.
///
/// Same contract as [`crate::FlashAttn::forward`]:
/// - `q`: `(batch, seqlen_q, num_heads, head_dim)`;
/// - `k`, `v`: `(batch, seqlen_k, num_heads_k, head_dim)` with `num_heads % num_heads_k == 0`
///   (query head `h` reads K/V head `h / (num_heads / num_heads_k)`);
/// - `causal`: query `i` sees key `j` iff `j <= i + seqlen_k - seqlen_q` (bottom-right);
///   query rows that see no key give zeros, not NaN;
/// - returns `(batch, seqlen_q, num_heads, head_dim)` in the input dtype.
///
/// Unlike the fast op it accepts any float dtype on any device, head_dims above 256 and any strides,
/// and it computes in the input dtype, so in f16/bf16 it is also "the same math at low
/// precision" that the tests' error budgets are measured against. It materialises the
/// `(batch, num_heads, seqlen_q, seqlen_k)` score matrix. It is differentiable with Candle's
/// autograd, including through fully masked rows.
///
/// Errors: the shape, dtype and device mismatches that [`crate::flash_attn`] reports, and a
/// `softmax_scale` that is not finite and positive.
pub fn attention_slow(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    slow(q, k, v, softmax_scale, causal, None)
}

/// [`attention_slow`] with dropout given as a mask: the probabilities are multiplied by
/// `keep / (1 - dropout_p)` after the softmax. With `keep` from [`crate::dropout_mask`] and
/// the same `dropout_p`, seed and offset, this is what [`crate::FlashAttn::forward`] with
/// [`crate::FlashAttn::dropout`] computes: the oracle for dropout tests.
///
/// - `keep`: `(batch, num_heads, seqlen_q, seqlen_k)` on q's device, any dtype, 1 (or any
///   nonzero value) keeps an entry, 0 drops it; it is used as a constant (no gradient);
/// - `dropout_p` in `[0, 1)`;
/// - the rest as in [`attention_slow`]; differentiable with Candle's autograd.
///
/// Errors: those of [`attention_slow`], a `keep` of another shape or device, `dropout_p`
/// outside `[0, 1)`.
pub fn attention_slow_dropout(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    causal: bool,
    keep: &Tensor,
    dropout_p: f32,
) -> Result<Tensor> {
    slow(q, k, v, softmax_scale, causal, Some((keep, dropout_p)))
}

fn slow(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    causal: bool,
    dropout: Option<(&Tensor, f32)>,
) -> Result<Tensor> {
    let shape = params::validate_shapes(q, k, v)?;
    params::check_scale(softmax_scale)?;
    if let Some((keep, p)) = dropout {
        params::check_dropout(p)?;
        let expected = [shape.b, shape.h, shape.sq, shape.sk];
        if keep.dims() != expected {
            bail!(
                "keep: expected shape (batch, num_heads, seqlen_q, seqlen_k) = {expected:?}, got {:?}",
                keep.dims()
            )
        }
        if !keep.device().same_device(q.device()) {
            bail!(
                "keep: expected the same device as q ({:?}), got {:?}",
                q.device().location(),
                keep.device().location()
            )
        }
    }
    let (b, sq, sk, h, d) = (shape.b, shape.sq, shape.sk, shape.h, shape.d);
    let (dev, dtype) = (q.device(), q.dtype());
    if b * sq * h == 0 || sk == 0 {
        // No query, or no key to attend to: every row is empty or fully masked.
        return Tensor::zeros((b, sq, h, d), dtype, dev);
    }
    let q = q.transpose(1, 2)?.contiguous()?; // (b, h, sq, d)
    let k = repeat_kv(k, shape.group())?.transpose(1, 2)?.contiguous()?; // (b, h, sk, d)
    let v = repeat_kv(v, shape.group())?.transpose(1, 2)?.contiguous()?; // (b, h, sk, d)
    let mut scores = (q.matmul(&k.t()?)? * softmax_scale as f64)?; // (b, h, sq, sk)

    // Rows that see no key (causal with seqlen_q > seqlen_k), as 0/1 in the input dtype.
    let mut dead = Tensor::zeros((sq, 1), dtype, dev)?;
    if causal {
        // Written from the definition, not from the kernels' `Problem::key_end`, so that a
        // wrong rule there cannot agree with itself here: bottom-right alignment, query i sees
        // key j iff j <= i + sk - sq (in signed arithmetic).
        let sees = |i: usize, j: usize| j as i64 <= i as i64 + sk as i64 - sq as i64;
        let visible: Vec<u8> = (0..sq)
            .flat_map(|i| (0..sk).map(move |j| u8::from(sees(i, j))))
            .collect();
        let visible = Tensor::from_vec(visible, (sq, sk), dev)?.broadcast_as(scores.shape())?;
        let neg_inf = Tensor::new(f32::NEG_INFINITY, dev)?
            .to_dtype(dtype)?
            .broadcast_as(scores.shape())?;
        scores = visible.where_cond(&scores, &neg_inf)?;
        let dead_rows: Vec<f32> = (0..sq).map(|i| f32::from(u8::from(!sees(i, 0)))).collect();
        dead = Tensor::from_vec(dead_rows, (sq, 1), dev)?.to_dtype(dtype)?;
    }

    // Softmax with the row max subtracted for range. The max is detached (softmax does not
    // depend on it, so no gradient is lost) and 0 on dead rows instead of -inf, so that
    // exp(-inf - max) is 0 rather than NaN; adding 1 to dead rows' (zero) denominator then
    // gives p = 0 with finite gradients.
    let row_max = scores.max_keepdim(D::Minus1)?.detach();
    let is_dead = dead.to_dtype(DType::U8)?.broadcast_as(row_max.shape())?;
    let row_max = is_dead.where_cond(&row_max.zeros_like()?, &row_max)?;
    let exp = scores.broadcast_sub(&row_max)?.exp()?;
    let denom = exp.sum_keepdim(D::Minus1)?.broadcast_add(&dead)?;
    let mut probs = exp.broadcast_div(&denom)?;
    if let Some((keep, p)) = dropout {
        let keep = keep.ne(&keep.zeros_like()?)?.to_dtype(dtype)?.detach();
        probs = ((probs * keep)? * (1.0 / (1.0 - p as f64)))?;
    }
    probs.matmul(&v)?.transpose(1, 2)?.contiguous() // (b, sq, h, d)
}

/// `(b, s, hk, d)` → `(b, s, hk · group, d)`, K/V head `j` repeated as query heads
/// `j · group .. (j + 1) · group`. Its gradient sums over each group.
fn repeat_kv(x: &Tensor, group: usize) -> Result<Tensor> {
    if group == 1 {
        return Ok(x.clone());
    }
    let (b, s, hk, d) = x.dims4()?;
    x.unsqueeze(3)?
        .broadcast_as((b, s, hk, group, d))?
        .reshape((b, s, hk * group, d))
}
