//! Tensor layouts the CUDA kernels can read in place, shared by every op: the forward, the
//! backward and KV-cache decoding.

use candle::{Result, Tensor};

/// The CUDA kernels read 16-byte chunks: every stride but the last, and the start offset, must
/// be a multiple of 8 elements. A tensor that is not is copied once into a contiguous one.
pub(crate) fn aligned(t: &Tensor) -> Result<Tensor> {
    aligned_to(t, 8)
}

/// [`aligned`] for elements of any size: on CUDA, every stride but the last and the start
/// offset a multiple of `elems` elements (16 bytes: 8 of f16/bf16, 16 of e4m3), else a
/// contiguous copy.
pub(crate) fn aligned_to(t: &Tensor, elems: usize) -> Result<Tensor> {
    if !t.device().is_cuda() {
        return Ok(t.clone());
    }
    let ok = t.layout().start_offset().is_multiple_of(elems)
        && t.stride()[..t.rank() - 1]
            .iter()
            .all(|s| s.is_multiple_of(elems));
    if ok {
        Ok(t.clone())
    } else {
        // Not `contiguous()`: it returns a contiguous tensor unchanged whatever its offset.
        contiguous_copy(t)
    }
}

/// `t` contiguous and, on CUDA, starting at a multiple of 8 elements, for the tensors the
/// kernels read with the output's contiguous layout (out, dO, LSE).
pub(crate) fn contiguous_aligned(t: &Tensor) -> Result<Tensor> {
    let placed = !t.device().is_cuda() || t.layout().start_offset().is_multiple_of(8);
    if t.is_contiguous() && placed {
        Ok(t.clone())
    } else {
        contiguous_copy(t)
    }
}

/// `Tensor::contiguous` for every dtype: see [`contiguous_copy`] (the CUDA FP8 casts').
#[cfg(feature = "cuda")]
pub(crate) fn contiguous(t: &Tensor) -> Result<Tensor> {
    if t.is_contiguous() {
        Ok(t.clone())
    } else {
        contiguous_copy(t)
    }
}

/// A fresh contiguous copy of `t` at offset 0 (`force_contiguous`). F8E4M3 on CUDA goes
/// through this crate's byte copy: candle-core 0.11.1's strided copy of it looks up a kernel
/// name its kernels do not have (`ucopy_f8e4m3` for `ucopy_f8_e4m3`).
pub(crate) fn contiguous_copy(t: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if crate::quant::e4m3_on_cuda(t) {
        return crate::quant::copy_e4m3(t);
    }
    t.force_contiguous()
}
