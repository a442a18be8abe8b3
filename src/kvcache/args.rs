//! Where a decoding call's per-sequence numbers come from: host slices, checked before the
//! first write, or U32 tensors on the device, which only the kernels read. The device form
//! makes a call free of uploads and synchronisation, so that it can be captured in a CUDA
//! graph and replayed while the lengths change.

use candle::{bail, DType, Result, Tensor};

use crate::params::Indices;

/// The tokens already in each sequence's cache, before the call's append.
///
/// - [`CacheSeqlens::Host`] (`&[u32]`, also from `&Vec<u32>` and `&[u32; N]`): every length
///   and every page is checked on the host before anything is written.
/// - [`CacheSeqlens::Device`]: a `(batch,)` U32 tensor on q's device, read by the kernels
///   (no upload, no synchronisation; the call can run inside a CUDA graph, and the caller
///   advances the lengths between calls). The key range is split for the cache's capacity, so
///   the launch does not depend on the lengths. Lengths cannot be checked on the host: the
///   kernels clamp them (a sequence attends to at most `capacity` tokens and rows past the
///   capacity are not written), so an overflow gives wrong rows, never an out-of-bounds
///   access. On the CPU a device tensor is simply read and checked like a slice.
#[derive(Clone, Copy, Debug)]
pub enum CacheSeqlens<'a> {
    /// One length per sequence, checked on the host.
    Host(&'a [u32]),
    /// A `(batch,)` U32 tensor on q's device, read by the kernels.
    Device(&'a Tensor),
}

impl<'a> From<&'a [u32]> for CacheSeqlens<'a> {
    fn from(x: &'a [u32]) -> Self {
        CacheSeqlens::Host(x)
    }
}

impl<'a> From<&'a Vec<u32>> for CacheSeqlens<'a> {
    fn from(x: &'a Vec<u32>) -> Self {
        CacheSeqlens::Host(x)
    }
}

impl<'a, const N: usize> From<&'a [u32; N]> for CacheSeqlens<'a> {
    fn from(x: &'a [u32; N]) -> Self {
        CacheSeqlens::Host(x)
    }
}

impl<'a> From<&'a Tensor> for CacheSeqlens<'a> {
    fn from(x: &'a Tensor) -> Self {
        CacheSeqlens::Device(x)
    }
}

/// A paged cache's block table, row-major `(batch, max_pages)`: host entries (`&[u32]`,
/// checked before the first write) or a U32 tensor of that shape on q's device, read by the
/// kernels (see [`CacheSeqlens::Device`]: entries are not checked on the host; the kernels
/// clamp a page number past the pool to the last page, which gives wrong rows but no
/// out-of-bounds access, and pages the append writes must not be shared).
#[derive(Clone, Copy, Debug)]
pub enum BlockTable<'a> {
    /// `batch * max_pages` entries, checked on the host.
    Host(&'a [u32]),
    /// A `(batch, max_pages)` U32 tensor on q's device, read by the kernels.
    Device(&'a Tensor),
}

impl<'a> From<&'a [u32]> for BlockTable<'a> {
    fn from(x: &'a [u32]) -> Self {
        BlockTable::Host(x)
    }
}

impl<'a> From<&'a Vec<u32>> for BlockTable<'a> {
    fn from(x: &'a Vec<u32>) -> Self {
        BlockTable::Host(x)
    }
}

impl<'a, const N: usize> From<&'a [u32; N]> for BlockTable<'a> {
    fn from(x: &'a [u32; N]) -> Self {
        BlockTable::Host(x)
    }
}

impl<'a> From<&'a Tensor> for BlockTable<'a> {
    fn from(x: &'a Tensor) -> Self {
        BlockTable::Device(x)
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
