//! Helpers for packed (variable-length) batches: random packed inputs and the oracle, a loop
//! over the sequences of `attention_slow`.

use candle::{DType, Result, Tensor};
use candle_flash::VarLen;

use super::randn;

/// Fresh standard-normal packed q `(total_q, h, d)`, k and v `(total_k, hk, d)` of `dtype`.
pub fn packed_qkv(
    varlen: &VarLen,
    h: usize,
    hk: usize,
    d: usize,
    dtype: DType,
) -> Result<(Tensor, Tensor, Tensor)> {
    let q = randn((varlen.total_q(), h, d), dtype)?;
    let k = randn((varlen.total_k(), hk, d), dtype)?;
    let v = randn((varlen.total_k(), hk, d), dtype)?;
    Ok((q, k, v))
}

/// Rows `cu[b]..cu[b + 1]` of a packed tensor as a batch of one: `(1, len, heads, d)`.
pub fn sequence(x: &Tensor, cu: &[u32], b: usize) -> Result<Tensor> {
    let (start, end) = (cu[b] as usize, cu[b + 1] as usize);
    x.narrow(0, start, end - start)?.unsqueeze(0)
}

/// The packed output of `attn(b, q_b, k_b, v_b)` run on every sequence `b` as a batch of one
/// (`(1, len, heads, d)` in and out), concatenated: `(total_q, h, d)`.
pub fn per_sequence<F>(
    varlen: &VarLen,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    attn: F,
) -> Result<Tensor>
where
    F: Fn(usize, &Tensor, &Tensor, &Tensor) -> Result<Tensor>,
{
    let (cu_q, cu_k) = (varlen.cu_seqlens_q(), varlen.cu_seqlens_k());
    let mut outs = Vec::new();
    for b in 0..varlen.num_seqs() {
        if cu_q[b + 1] == cu_q[b] {
            continue; // no query row: nothing to output
        }
        let (k_b, v_b) = (sequence(k, cu_k, b)?, sequence(v, cu_k, b)?);
        outs.push(attn(b, &sequence(q, cu_q, b)?, &k_b, &v_b)?.squeeze(0)?);
    }
    Tensor::cat(&outs, 0)
}
