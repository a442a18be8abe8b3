//! Where a decoding call's per-sequence numbers come from: host slices, checked before the
//! first write, or U32 tensors on the device, which only the kernels read. The device form
//! makes a call free of uploads and synchronisation, so that it can be captured in a CUDA
//! graph and replayed while the lengths change.

use candle::{bail, DType, Result, Tensor};

use crate::params::Indices;

/// Per-sequence numbers of a decoding call, from the host or the device: the type behind
/// [`CacheSeqlens`] and [`BlockTable`].
///
/// - `Host` (`&[u32]`, also from `&Vec<u32>` and `&[u32; N]`): checked on the host before
///   anything is written.
/// - `Device`: a U32 tensor on q's device, read by the kernels (no upload, no
///   synchronisation; the call can run inside a CUDA graph, and the caller advances the
///   numbers between calls). They cannot be checked on the host: the kernels clamp them (a
///   sequence attends to at most `capacity` tokens and rows past the capacity are not
///   written; a block-table entry past the pool reads the last page), so a bad value gives
///   wrong rows, never an out-of-bounds access. On the CPU a device tensor is simply read and
///   checked like a slice.
#[derive(Clone, Copy, Debug)]
pub enum HostOrDevice<'a> {
    /// The numbers on the host.
    Host(&'a [u32]),
    /// A U32 tensor on q's device.
    Device(&'a Tensor),
}

/// The tokens already in each sequence's cache before the call's append: `(batch,)`. On the
/// device, the key range is split for the cache's capacity, so the launch does not depend on
/// the lengths (see [`HostOrDevice`]).
pub type CacheSeqlens<'a> = HostOrDevice<'a>;

/// A paged cache's block table, row-major `(batch, max_pages)` (see [`HostOrDevice`]; pages
/// the append writes must not be shared).
pub type BlockTable<'a> = HostOrDevice<'a>;

impl<'a> From<&'a [u32]> for HostOrDevice<'a> {
    fn from(x: &'a [u32]) -> Self {
        HostOrDevice::Host(x)
    }
}

impl<'a> From<&'a Vec<u32>> for HostOrDevice<'a> {
    fn from(x: &'a Vec<u32>) -> Self {
        HostOrDevice::Host(x)
    }
}

impl<'a, const N: usize> From<&'a [u32; N]> for HostOrDevice<'a> {
    fn from(x: &'a [u32; N]) -> Self {
        HostOrDevice::Host(x)
    }
}

impl<'a> From<&'a Tensor> for HostOrDevice<'a> {
    fn from(x: &'a Tensor) -> Self {
        HostOrDevice::Device(x)
    }
}

/// Checks a device tensor of per-sequence numbers: U32 of shape `dims` on q's device. A CPU
/// tensor comes back as host values (the CPU path checks them like a slice); a CUDA one as
/// a contiguous tensor for the kernels.
pub(super) fn device_indices(
    t: &Tensor,
    dims: &[usize],
    q: &Tensor,
    name: &str,
) -> Result<Indices> {
    if t.dtype() != DType::U32 {
        bail!("{name}: expected dtype U32, got {:?}", t.dtype())
    }
    if t.dims() != dims {
        bail!("{name}: expected shape {dims:?}, got {:?}", t.dims())
    }
    if !t.device().same_device(q.device()) {
        bail!(
            "{name}: on {:?}, expected q's device {:?}",
            t.device().location(),
            q.device().location()
        )
    }
    if t.device().is_cpu() {
        return Ok(Indices::Host(t.flatten_all()?.to_vec1::<u32>()?));
    }
    Ok(Indices::Device(t.detach().contiguous()?))
}
