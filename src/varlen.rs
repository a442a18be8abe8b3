//! Variable-length (packed) batches: the cumulative sequence offsets that say which rows of a
//! packed `(total, num_heads, head_dim)` tensor belong to which sequence.

use std::sync::Arc;

use candle::{bail, DType, Device, Result, Tensor};

use crate::padding::Padding;
use crate::params::{cumulative, SeqOffsets};

/// The layout of a packed batch of `num_seqs` sequences, for [`crate::FlashAttn::forward_varlen`].
///
/// Sequence `b` owns query rows `cu_seqlens_q[b]..cu_seqlens_q[b + 1]` of q `(total_q,
/// num_heads, head_dim)` and key rows `cu_seqlens_k[b]..cu_seqlens_k[b + 1]` of k and v
/// `(total_k, num_heads_k, head_dim)`, like FlashAttention's `cu_seqlens_q` / `cu_seqlens_k`.
/// Sequences may have different query and key lengths, and a length may be 0 (a sequence
/// with no query produces no output row; one with queries but no key produces zero rows).
///
/// The offsets live on the host: the kernels are launched over exactly the rows that exist,
/// so no work is spent on padding. The maximum lengths are computed from the offsets.
///
/// ```
/// # fn main() -> candle::Result<()> {
/// let varlen = candle_flash::VarLen::from_seqlens(&[3, 1, 5], &[3, 1, 5])?;
/// assert_eq!(varlen.cu_seqlens_q(), &[0, 3, 4, 9]);
/// assert_eq!((varlen.num_seqs(), varlen.max_seqlen_q(), varlen.total_k()), (3, 5, 9));
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VarLen {
    offsets: Arc<SeqOffsets>,
    max_seqlen_q: usize,
    max_seqlen_k: usize,
}

impl VarLen {
    /// From the length of every sequence: `seqlens_q[b]` query rows and `seqlens_k[b]` key
    /// rows for sequence `b`.
    ///
    /// Errors: no sequence, `seqlens_k` of a different length than `seqlens_q`, or a total
    /// that does not fit the u32 offsets.
    pub fn from_seqlens(seqlens_q: &[usize], seqlens_k: &[usize]) -> Result<Self> {
        if seqlens_k.len() != seqlens_q.len() {
            bail!(
                "seqlens_k: expected {} lengths like seqlens_q, got {}",
                seqlens_q.len(),
                seqlens_k.len()
            )
        }
        Self::from_cu_seqlens(
            &cumulative(seqlens_q, "seqlens_q")?,
            &cumulative(seqlens_k, "seqlens_k")?,
        )
    }

    /// From cumulative offsets, `batch + 1` entries each: `cu_q[0] = 0`, sequence `b` has
    /// `cu_q[b + 1] - cu_q[b]` query rows, `cu_q[batch]` is q's total rows (the same for
    /// `cu_k` and k, v).
    ///
    /// Errors (naming `cu_seqlens_q` or `cu_seqlens_k`): fewer than 2 entries, lengths that
    /// differ between the two, a first entry other than 0, or a decreasing entry. That the
    /// last entries match the tensors' rows is checked by
    /// [`crate::FlashAttn::forward_varlen`].
    pub fn from_cu_seqlens(cu_q: &[u32], cu_k: &[u32]) -> Result<Self> {
        check_offsets(cu_q, "cu_seqlens_q")?;
        check_offsets(cu_k, "cu_seqlens_k")?;
        if cu_k.len() != cu_q.len() {
            bail!(
                "cu_seqlens_k: expected {} entries like cu_seqlens_q (batch + 1), got {}",
                cu_q.len(),
                cu_k.len()
            )
        }
        let max = |cu: &[u32]| cu.windows(2).map(|w| (w[1] - w[0]) as usize).max();
        Ok(Self {
            max_seqlen_q: max(cu_q).unwrap_or(0),
            max_seqlen_k: max(cu_k).unwrap_or(0),
            offsets: Arc::new(SeqOffsets {
                cu_q: cu_q.to_vec(),
                cu_k: cu_k.to_vec(),
            }),
        })
    }

    /// From rank-1 U32 tensors of cumulative offsets on any device, as in
    /// [`VarLen::from_cu_seqlens`]. The offsets are copied to the host, which **synchronises**
    /// with the device when they live on a GPU: build the `VarLen` once per batch, not once
    /// per layer.
    ///
    /// Errors: a tensor that is not rank-1 U32, and everything
    /// [`VarLen::from_cu_seqlens`] reports.
    pub fn from_tensors(cu_q: &Tensor, cu_k: &Tensor) -> Result<Self> {
        Self::from_cu_seqlens(
            &host_offsets(cu_q, "cu_seqlens_q")?,
            &host_offsets(cu_k, "cu_seqlens_k")?,
        )
    }

    /// From the padding masks of a padded batch: query sequence `b` is `q_pad`'s `b`-th
    /// sequence, key sequence `b` is `kv_pad`'s. Use the same [`Padding`] twice for
    /// self-attention.
    ///
    /// Errors: the two paddings have different batch sizes.
    pub fn from_padding(q_pad: &Padding, kv_pad: &Padding) -> Result<Self> {
        if kv_pad.batch() != q_pad.batch() {
            bail!(
                "kv_pad: batch size {} differs from q_pad's {}",
                kv_pad.batch(),
                q_pad.batch()
            )
        }
        Self::from_cu_seqlens(q_pad.cu_seqlens(), kv_pad.cu_seqlens())
    }

    /// Number of sequences (`batch`).
    pub fn num_seqs(&self) -> usize {
        self.offsets.cu_q.len() - 1
    }

    /// Length of the longest query sequence.
    pub fn max_seqlen_q(&self) -> usize {
        self.max_seqlen_q
    }

    /// Length of the longest key sequence.
    pub fn max_seqlen_k(&self) -> usize {
        self.max_seqlen_k
    }

    /// Query rows over all sequences: q's first dimension.
    pub fn total_q(&self) -> usize {
        self.offsets.cu_q[self.num_seqs()] as usize
    }

    /// Key rows over all sequences: the first dimension of k and v.
    pub fn total_k(&self) -> usize {
        self.offsets.cu_k[self.num_seqs()] as usize
    }

    /// Cumulative query offsets, `num_seqs + 1` entries starting at 0.
    pub fn cu_seqlens_q(&self) -> &[u32] {
        &self.offsets.cu_q
    }

    /// Cumulative key offsets, `num_seqs + 1` entries starting at 0.
    pub fn cu_seqlens_k(&self) -> &[u32] {
        &self.offsets.cu_k
    }

    /// The offsets, shared with the problem description of a call.
    pub(crate) fn offsets(&self) -> Arc<SeqOffsets> {
        self.offsets.clone()
    }
}

fn check_offsets(cu: &[u32], name: &str) -> Result<()> {
    check_run(cu, name)?;
    if cu[0] != 0 {
        bail!("{name}: expected the first offset to be 0, got {}", cu[0])
    }
    Ok(())
}

/// At least 2 offsets (batch + 1), none below the one before.
pub(crate) fn check_run(cu: &[u32], name: &str) -> Result<()> {
    if cu.len() < 2 {
        bail!(
            "{name}: expected at least 2 entries (batch + 1 cumulative offsets), got {}",
            cu.len()
        )
    }
    if let Some(b) = cu.windows(2).position(|w| w[1] < w[0]) {
        bail!(
            "{name}: offsets must be non-decreasing, got {} at index {} after {}",
            cu[b + 1],
            b + 1,
            cu[b]
        )
    }
    Ok(())
}

/// A rank-1 U32 tensor of offsets, read to the host.
pub(crate) fn host_offsets(t: &Tensor, name: &str) -> Result<Vec<u32>> {
    if t.rank() != 1 || t.dtype() != DType::U32 {
        bail!(
            "{name}: expected a rank-1 U32 tensor, got {:?} of shape {:?}",
            t.dtype(),
            t.dims()
        )
    }
    t.to_device(&Device::Cpu)?.to_vec1::<u32>()
}
