//! Padded batches: a `(batch, seqlen)` key-padding mask turned into the packed layout of
//! [`crate::VarLen`] and back, like FlashAttention's `unpad_input` / `pad_input`.

use candle::{bail, Device, Result, Tensor};

use crate::params::cumulative;

/// Which positions of a padded `(batch, seqlen, ...)` batch hold real tokens.
///
/// Real tokens need not be contiguous (left padding, or any mask works): the real tokens of
/// sequence `b` are packed in order of position, sequence after sequence. [`Padding::unpad`]
/// packs a padded tensor, [`Padding::pad`] scatters a packed one back with zeros in the
/// padded rows; both are differentiable.
///
/// ```
/// # fn main() -> candle::Result<()> {
/// use candle::{DType, Device, Tensor};
/// use candle_flash::{FlashAttn, Padding};
/// let dev = Device::Cpu;
/// let x = Tensor::randn(0f32, 1.0, (2, 4, 8, 16), &dev)?; // (batch, seqlen, heads, head_dim)
/// let mask = Tensor::new(&[[1u8, 1, 1, 0], [1, 1, 0, 0]], &dev)?;
/// let pad = Padding::from_mask(&mask)?;
/// assert_eq!((pad.cu_seqlens(), pad.max_seqlen(), pad.total()), (&[0u32, 3, 5][..], 3, 5));
/// assert_eq!(pad.unpad(&x)?.dims(), &[5, 8, 16]);
/// let out = FlashAttn::new().causal(true).forward_padded(&x, &x, &x, &pad, &pad)?;
/// assert_eq!(out.dims(), &[2, 4, 8, 16]); // padded query rows are zeros
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Padding {
    batch: usize,
    seqlen: usize,
    /// Flat positions `b * seqlen + s` of the real tokens, in packed order.
    indices: Vec<u32>,
    /// `batch + 1` cumulative counts of real tokens.
    cu_seqlens: Vec<u32>,
    max_seqlen: usize,
}

impl Padding {
    /// From a key-padding mask `(batch, seqlen)` of any dtype on any device: a nonzero entry
    /// is a real token, a zero one is padding. The mask is copied to the host (this
    /// synchronises with a GPU).
    ///
    /// Errors: a mask that is not rank 2, a batch of 0, or more than `u32::MAX` positions.
    pub fn from_mask(mask: &Tensor) -> Result<Self> {
        let (batch, seqlen) = match mask.dims() {
            &[b, s] => (b, s),
            dims => bail!("mask: expected rank 2 (batch, seqlen), got shape {dims:?}"),
        };
        check_size(batch, seqlen, "mask")?;
        let real = mask.ne(&mask.zeros_like()?)?.to_device(&Device::Cpu)?;
        let real = real.flatten_all()?.to_vec1::<u8>()?;
        let indices: Vec<u32> = (0..real.len() as u32)
            .filter(|&i| real[i as usize] != 0)
            .collect();
        let lengths: Vec<usize> = (0..batch)
            .map(|b| {
                real[b * seqlen..][..seqlen]
                    .iter()
                    .filter(|&&r| r != 0)
                    .count()
            })
            .collect();
        Self::new(batch, seqlen, indices, &lengths)
    }

    /// Right padding: sequence `b` holds real tokens at positions `0..lengths[b]` of
    /// `seqlen`.
    ///
    /// Errors: no sequence, a length above `seqlen`, or more than `u32::MAX` positions.
    pub fn from_lengths(lengths: &[usize], seqlen: usize) -> Result<Self> {
        check_size(lengths.len(), seqlen, "lengths")?;
        if let Some((b, &len)) = lengths.iter().enumerate().find(|(_, &l)| l > seqlen) {
            bail!("lengths: sequence {b} has length {len}, more than seqlen {seqlen}")
        }
        let indices = lengths
            .iter()
            .enumerate()
            .flat_map(|(b, &len)| (0..len).map(move |s| (b * seqlen + s) as u32))
            .collect();
        Self::new(lengths.len(), seqlen, indices, lengths)
    }

    fn new(batch: usize, seqlen: usize, indices: Vec<u32>, lengths: &[usize]) -> Result<Self> {
        Ok(Self {
            batch,
            seqlen,
            indices,
            cu_seqlens: cumulative(lengths, "lengths")?,
            max_seqlen: lengths.iter().copied().max().unwrap_or(0),
        })
    }

    /// Packs a padded tensor: `(batch, seqlen, ...)` → `(total, ...)`, the real tokens in
    /// order. Differentiable (an `index_select`).
    ///
    /// Errors: `x` whose first two dimensions are not `(batch, seqlen)`.
    pub fn unpad(&self, x: &Tensor) -> Result<Tensor> {
        self.unpad_named(x, "x")
    }

    pub(crate) fn unpad_named(&self, x: &Tensor, name: &str) -> Result<Tensor> {
        let dims = x.dims();
        if dims.len() < 2 || dims[0] != self.batch || dims[1] != self.seqlen {
            bail!(
                "{name}: expected shape (batch={}, seqlen={}, ...) like the padding mask, got {dims:?}",
                self.batch,
                self.seqlen
            )
        }
        let mut flat = dims[1..].to_vec();
        if x.elem_count() == 0 {
            // Nothing to gather, and Candle's index_select would read an empty view (a
            // narrow of a tensor with no heads) at its offset, past the end of its storage.
            flat[0] = self.total();
            return Tensor::zeros(flat, x.dtype(), x.device());
        }
        flat[0] = self.batch * self.seqlen;
        let x = x.reshape(flat)?;
        if x.dtype() == candle::DType::F8E4M3 && x.device().is_cuda() {
            // candle-core 0.11.1's CUDA index_select asks for `is_u32_f8e4m3`, which its
            // kernels name `is_u32_f8_e4m3` ("named symbol not found"); its copies of F8E4M3
            // work, so the real tokens go as one narrow per run of consecutive positions.
            return self.unpad_by_runs(&x);
        }
        x.index_select(&self.index_tensor(x.device())?, 0)
    }

    /// `x` `(batch * seqlen, ...)` packed by concatenating its runs of consecutive real rows.
    fn unpad_by_runs(&self, x: &Tensor) -> Result<Tensor> {
        let mut parts = vec![];
        let mut i = 0;
        while i < self.indices.len() {
            let start = self.indices[i] as usize;
            let mut len = 1;
            while i + len < self.indices.len() && self.indices[i + len] as usize == start + len {
                len += 1;
            }
            parts.push(x.narrow(0, start, len)?);
            i += len;
        }
        Tensor::cat(&parts, 0)
    }

    /// Scatters a packed tensor back: `(total, ...)` → `(batch, seqlen, ...)`, zeros in the
    /// padded positions. Differentiable (an `index_add` into zeros).
    ///
    /// Errors: `x` whose first dimension is not [`Padding::total`].
    pub fn pad(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims();
        if dims.is_empty() || dims[0] != self.total() {
            bail!(
                "x: expected shape (total={}, ...) of packed real tokens, got {dims:?}",
                self.total()
            )
        }
        let mut flat = dims.to_vec();
        flat[0] = self.batch * self.seqlen;
        let mut padded = dims.to_vec();
        padded.splice(0..1, [self.batch, self.seqlen]);
        let zeros = Tensor::zeros(flat, x.dtype(), x.device())?;
        if self.total() == 0 {
            return zeros.reshape(padded);
        }
        zeros
            .index_add(&self.index_tensor(x.device())?, x, 0)?
            .reshape(padded)
    }

    /// `batch + 1` cumulative counts of real tokens, starting at 0: the `cu_seqlens` of the
    /// packed batch.
    pub fn cu_seqlens(&self) -> &[u32] {
        &self.cu_seqlens
    }

    /// Real tokens of the longest sequence.
    pub fn max_seqlen(&self) -> usize {
        self.max_seqlen
    }

    /// Real tokens over the batch: the first dimension of a packed tensor.
    pub fn total(&self) -> usize {
        self.indices.len()
    }

    /// Number of sequences.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Padded length of every sequence.
    pub fn seqlen(&self) -> usize {
        self.seqlen
    }

    /// Flat positions `b * seqlen + s` of the real tokens, in packed order.
    pub fn indices(&self) -> &[u32] {
        &self.indices
    }

    fn index_tensor(&self, device: &Device) -> Result<Tensor> {
        Tensor::from_slice(&self.indices, self.indices.len(), device)
    }
}

fn check_size(batch: usize, seqlen: usize, name: &str) -> Result<()> {
    if batch == 0 {
        bail!("{name}: expected at least one sequence, got a batch of 0")
    }
    if batch
        .checked_mul(seqlen)
        .is_none_or(|n| n > u32::MAX as usize)
    {
        bail!("{name}: batch {batch} x seqlen {seqlen} exceeds u32::MAX positions")
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The runs path (FP8 on CUDA) packs what index_select packs, for right, left and holed
    /// padding.
    #[test]
    fn unpad_by_runs_equals_index_select() -> Result<()> {
        let dev = Device::Cpu;
        let mask = Tensor::new(
            &[
                [1u8, 1, 1, 0, 0],
                [0, 0, 1, 1, 1],
                [1, 0, 1, 0, 1],
                [1, 1, 1, 1, 1],
            ],
            &dev,
        )?;
        let pad = Padding::from_mask(&mask)?;
        let x = Tensor::arange(0f32, 4.0 * 5.0 * 3.0, &dev)?.reshape((20, 3))?;
        let by_runs = pad.unpad_by_runs(&x)?.to_vec2::<f32>()?;
        let selected = x
            .index_select(&pad.index_tensor(&dev)?, 0)?
            .to_vec2::<f32>()?;
        assert_eq!(by_runs, selected);
        assert_eq!(by_runs.len(), 3 + 3 + 3 + 5);
        Ok(())
    }
}
