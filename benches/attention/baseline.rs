//! Candle's own attention, the baseline of the grid.

#[allow(unused_imports)]
use super::*;

/// Candle's own attention, written as a Candle model would: heads-first copies, K/V heads
/// repeated for GQA, q·kᵀ, additive causal mask, softmax, ·v, back to (b, s, h, d).
pub(crate) fn naive_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    train: bool,
) -> Result<Tensor> {
    let (_, _, heads, hd) = q.dims4()?;
    let n_rep = heads / k.dim(2)?;
    let q = (q.transpose(1, 2)?.contiguous()? * (1.0 / (hd as f64).sqrt()))?;
    let k = repeat_kv(&k.transpose(1, 2)?.contiguous()?, n_rep)?;
    let v = repeat_kv(&v.transpose(1, 2)?.contiguous()?, n_rep)?;
    let mut scores = q.matmul(&k.t()?)?;
    if let Some(mask) = mask {
        scores = scores.broadcast_add(mask)?;
    }
    // The fused softmax is what inference uses, but it has no backward; training needs the
    // composite one.
    let probs = if train {
        candle_nn::ops::softmax(&scores, D::Minus1)?
    } else {
        candle_nn::ops::softmax_last_dim(&scores)?
    };
    probs.matmul(&v)?.transpose(1, 2)?.contiguous()
}

/// (b, hk, s, d) -> (b, hk·n_rep, s, d), query head h reading K/V head h / n_rep
/// (candle-transformers' `repeat_kv`).
pub(crate) fn repeat_kv(x: &Tensor, n_rep: usize) -> Result<Tensor> {
    if n_rep == 1 {
        return Ok(x.clone());
    }
    let (b, hk, s, d) = x.dims4()?;
    Tensor::cat(&vec![x; n_rep], 2)?.reshape((b, hk * n_rep, s, d))
}

/// (s, s) additive mask: 0 where key <= query, -inf above the diagonal.
pub(crate) fn causal_mask(s: usize, dtype: DType, dev: &Device) -> Result<Tensor> {
    let idx = Tensor::arange(0u32, s as u32, dev)?;
    let above = idx.unsqueeze(0)?.broadcast_gt(&idx.unsqueeze(1)?)?;
    let neg_inf = Tensor::new(f32::NEG_INFINITY, dev)?
        .to_dtype(dtype)?
        .broadcast_as((s, s))?;
    above.where_cond(&neg_inf, &Tensor::zeros((s, s), dtype, dev)?)
}
