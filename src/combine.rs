//! Merging partial attentions: attention over a key set split into disjoint parts (split-KV,
//! cascade attention over a prompt shared by many sequences, ring attention) is recovered
//! exactly from each part's output and row log-sum-exp, the same merge the split-KV decode
//! kernels do on chip.

use candle::{bail, DType, Result, Tensor, D};

/// Merges attention results over disjoint key sets into the result over their union.
///
/// Each part is `(o_i, lse_i)` as [`crate::FlashAttn::forward_with_lse`] returns them: `o_i`
/// `(batch, seqlen_q, num_heads, head_dim)` (every part the same shape, dtype and device),
/// `lse_i` f32 `(batch, num_heads, seqlen_q)`. Returns `(o, lse)` in the same layouts, with
/// `lse = log sum_i exp(lse_i)` and `o = sum_i exp(lse_i - lse) o_i`, computed in f32 and
/// cast to the parts' dtype. Rows that no part's keys reach (every `lse_i` is `-inf`) come out
/// zero with `lse = -inf`, as a forward over no keys does. It carries gradients through
/// Candle's ops like any other.
pub fn combine(parts: &[(Tensor, Tensor)]) -> Result<(Tensor, Tensor)> {
    let Some((o0, _)) = parts.first() else {
        bail!("combine: parts is empty, expected at least one (out, lse) pair")
    };
    let (b, s, h, _) = o0.dims4().map_err(|_| {
        candle::Error::Msg(format!(
            "combine: parts[0].0 has shape {:?}, expected (batch, seqlen_q, num_heads, head_dim)",
            o0.dims()
        ))
    })?;
    for (i, (o, lse)) in parts.iter().enumerate() {
        if o.dims() != o0.dims() || o.dtype() != o0.dtype() || !o.device().same_device(o0.device())
        {
            bail!(
                "combine: parts[{i}].0 is {:?} {:?}, expected parts[0].0's shape {:?} and dtype \
                 {:?} on its device",
                o.dims(),
                o.dtype(),
                o0.dims(),
                o0.dtype()
            )
        }
        if lse.dims() != [b, h, s]
            || lse.dtype() != DType::F32
            || !lse.device().same_device(o0.device())
        {
            bail!(
                "combine: parts[{i}].1 (lse) is {:?} {:?}, expected f32 (batch, num_heads, \
                 seqlen_q) = {:?} on the outputs' device",
                lse.dims(),
                lse.dtype(),
                [b, h, s]
            )
        }
    }
    if parts.len() == 1 {
        return Ok((o0.clone(), parts[0].1.clone()));
    }
    let lses = Tensor::stack(&parts.iter().map(|(_, l)| l.clone()).collect::<Vec<_>>(), 0)?;
    // The largest part's LSE as the exponent's origin; 0 where every part is -inf, so that no
    // -inf - -inf appears (their weights are then exp(-inf) = 0).
    let max = lses.max(0)?;
    let finite = max.ne(f64::NEG_INFINITY)?;
    let origin = finite.where_cond(&max, &max.zeros_like()?)?;
    let weights = lses.broadcast_sub(&origin.unsqueeze(0)?)?.exp()?;
    let total = weights.sum(0)?;
    let lse = (origin + total.log()?)?;
    // 1 / total where some part has keys, else 0 (the row's output is zero).
    let any = total.gt(0f64)?;
    let inv = any.where_cond(&total.recip()?, &total.zeros_like()?)?;
    let mut out: Option<Tensor> = None;
    for (i, (o, _)) in parts.iter().enumerate() {
        // (batch, heads, seqlen_q) -> (batch, seqlen_q, heads, 1), beside o's layout.
        let w = (weights.get(i)? * &inv)?
            .transpose(1, 2)?
            .unsqueeze(D::Minus1)?;
        let term = o.to_dtype(DType::F32)?.broadcast_mul(&w)?;
        out = Some(match out {
            Some(acc) => (acc + term)?,
            None => term,
        });
    }
    let out = out.expect("at least two parts").to_dtype(o0.dtype())?;
    Ok((out, lse))
}
