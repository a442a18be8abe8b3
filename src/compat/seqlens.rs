//! The cumulative `seqlens_q` / `seqlens_k` tensors of a varlen call, read to the host and
//! checked against q, k and v.

use candle::{bail, Result, Tensor};

/// Checks the ranks, dtypes and devices of a varlen call's q `(total_q, h, d)`, k and v
/// (rank `k_rank`, `k_what`; v shaped like k). Returns q's and k's first dimensions.
pub(super) fn check_packed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    k_rank: usize,
    k_what: &str,
) -> Result<(usize, usize)> {
    if q.rank() != 3 {
        bail!(
            "q: expected rank 3 (total_q, num_heads, head_dim), got shape {:?}",
            q.dims()
        )
    }
    if k.rank() != k_rank {
        bail!(
            "k: expected rank {k_rank} {k_what}, got shape {:?}",
            k.dims()
        )
    }
    crate::params::check_like_q(q, k, "k")?;
    crate::params::check_like_q(q, v, "v")?;
    if v.dims() != k.dims() {
        bail!("v: expected k's shape {:?}, got {:?}", k.dims(), v.dims())
    }
    Ok((q.dim(0)?, k.dim(0)?))
}

/// The offsets of `seqlens_q` and `seqlens_k`, checked against q's rows and `max_seqlen_q`.
pub(super) fn offsets(
    seqlens_q: &Tensor,
    seqlens_k: &Tensor,
    total_q: usize,
    max_seqlen_q: usize,
) -> Result<(Vec<u32>, Vec<u32>)> {
    let cu_q = host_offsets(seqlens_q, "seqlens_q")?;
    let cu_k = host_offsets(seqlens_k, "seqlens_k")?;
    if cu_k.len() != cu_q.len() {
        bail!(
            "seqlens_k: expected {} entries like seqlens_q (batch + 1), got {}",
            cu_q.len(),
            cu_k.len()
        )
    }
    if cu_q[0] != 0 {
        bail!(
            "seqlens_q: expected the first offset to be 0, got {}",
            cu_q[0]
        )
    }
    let last = cu_q[cu_q.len() - 1] as usize;
    if last != total_q {
        bail!("seqlens_q: last offset {last} differs from q's total rows {total_q}")
    }
    let longest = cu_q.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0) as usize;
    if max_seqlen_q < longest {
        bail!(
            "max_seqlen_q: expected at least the longest query sequence, {longest}, got \
             {max_seqlen_q}"
        )
    }
    Ok((cu_q, cu_k))
}

/// A rank-1 U32 tensor of at least 2 non-decreasing offsets, read to the host (`seqlens_k`
/// may start past 0, so the first offset is not checked here).
fn host_offsets(t: &Tensor, name: &str) -> Result<Vec<u32>> {
    let cu = crate::varlen::host_offsets(t, name)?;
    crate::varlen::check_run(&cu, name)?;
    Ok(cu)
}
