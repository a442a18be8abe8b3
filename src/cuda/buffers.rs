//! Device buffers the launchers hand the kernels besides the inputs: read locks on the
//! option tensors (ALiBi slopes, block masks) kept until the launches are queued, and small
//! host arrays uploaded as i32 (sequence offsets, block tables), shared between launches
//! where they repeat.

use std::sync::{Arc, Mutex};

use candle::cuda_backend::cudarc::driver::sys::CUdeviceptr;
use candle::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, SyncOnDrop};
use candle::cuda_backend::CudaDType;
use candle::{bail, Layout, Result, Tensor};

use super::abi::AttnParams;
use super::abi::{rows_i32, to_i32};
use super::runtime::{stream_key, StreamKey};
use crate::params::{Indices, Paging, Problem};
use crate::score_mod::ScoreMods;

/// Read-locks a tensor the kernels read besides the inputs, for [`locked_ptr`].
pub(crate) fn lock_tensor(
    t: Option<&Tensor>,
) -> Option<(impl std::ops::Deref<Target = candle::Storage> + '_, &Layout)> {
    t.map(|t| t.storage_and_layout())
}

/// The device address of a tensor locked by [`lock_tensor`] (0 for none) and the stream
/// ordering of that read, kept until the launches are queued. `name` is the option's.
pub(crate) fn locked_ptr<
    'a,
    T: CudaDType + 'static,
    G: std::ops::Deref<Target = candle::Storage>,
>(
    guard: &'a Option<(G, &Layout)>,
    stream: &'a CudaStream,
    name: &str,
) -> Result<(CUdeviceptr, Option<SyncOnDrop<'a>>)> {
    let Some((storage, layout)) = guard else {
        return Ok((0, None));
    };
    let candle::Storage::Cuda(cs) = &**storage else {
        bail!("{name}: expected a CUDA tensor (the inputs' device)")
    };
    let view = cs.as_cuda_slice::<T>()?.slice(layout.start_offset()..);
    let (ptr, sync) = view.view_ptr(stream);
    Ok((ptr, Some(sync)))
}

/// The block mask's states, element mask and skip tables, locked while the kernels that read
/// them are queued; see [`sparse_ptrs`].
pub(crate) type SparseLocks<'a, G> = [Option<(G, &'a Layout)>; 5];

pub(crate) fn lock_sparse(
    mods: &ScoreMods,
) -> SparseLocks<'_, impl std::ops::Deref<Target = candle::Storage> + '_> {
    let m = mods.sparse.as_ref();
    [
        lock_tensor(m.map(crate::BlockMask::states)),
        lock_tensor(m.and_then(crate::BlockMask::dense)),
        lock_tensor(m.and_then(|m| m.skips()).map(|s| s.0)),
        lock_tensor(m.and_then(|m| m.skips()).map(|s| s.1)),
        lock_tensor(m.and_then(|m| m.skips()).map(|s| s.2)),
    ]
}

/// Sets the block mask's pointers from [`lock_sparse`]'s locks; the syncs returned are kept
/// until the launches are queued. Also returns the `next_col` skip table, which only the
/// deterministic warp-specialized backward reads (`BwdTmaParams::block_next_col`, kept out
/// of `AttnParams`: a field there cost the d 128 `_sparse` backward 12 bytes of spill).
pub(crate) fn sparse_ptrs<'a, G: std::ops::Deref<Target = candle::Storage>>(
    params: &mut AttnParams,
    locks: &'a SparseLocks<'a, G>,
    stream: &'a CudaStream,
) -> Result<([Option<SyncOnDrop<'a>>; 5], CUdeviceptr)> {
    let (blocks, blocks_sync) = locked_ptr::<u8, G>(&locks[0], stream, "block_mask")?;
    let (dense, dense_sync) = locked_ptr::<u8, G>(&locks[1], stream, "block_mask")?;
    let (prev, prev_sync) = locked_ptr::<u32, G>(&locks[2], stream, "block_mask")?;
    let (next, next_sync) = locked_ptr::<u32, G>(&locks[3], stream, "block_mask")?;
    let (next_col, next_col_sync) = locked_ptr::<u32, G>(&locks[4], stream, "block_mask")?;
    (params.block_mask, params.block_dense) = (blocks, dense);
    if blocks != 0 && (prev == 0 || next == 0 || next_col == 0) {
        bail!("block_mask: has no skip tables (it was not made on a CUDA device)")
    }
    (params.block_prev_col, params.block_next_row) = (prev, next);
    let syncs = [blocks_sync, dense_sync, prev_sync, next_sync, next_col_sync];
    Ok((syncs, next_col))
}

/// Read-locks the ALiBi slopes of `mods`, if any, for [`locked_ptr`].
pub(crate) fn lock_slopes(
    mods: &ScoreMods,
) -> Option<(impl std::ops::Deref<Target = candle::Storage> + '_, &Layout)> {
    lock_tensor(mods.alibi.as_ref().map(|a| &a.slopes))
}

/// `xs` on the device as the i32 the kernels read (offsets, lengths, block tables).
pub(crate) fn to_device_i32(dev: &candle::CudaDevice, xs: &[u32]) -> Result<CudaSlice<i32>> {
    let xs: Vec<i32> = xs.iter().map(|&x| x as i32).collect();
    dev.clone_htod(&xs)
}

/// Read-only host arrays uploaded recently (the append's start rows, block tables), per
/// stream. A decoding step sends the same arrays for every layer, and each upload (an
/// allocation and a copy from pageable memory) cost tens of microseconds of host time per
/// launch: at batch 1 on the H100, 0.5 ms per token of a 16-layer model with a contiguous
/// cache and 1.5 ms with a paged one (the table goes to the append and the decode).
static UPLOADS: Mutex<Vec<Upload>> = Mutex::new(Vec::new());
/// One kept upload: its stream, device, host values and device copy.
type Upload = (
    StreamKey,
    candle::cuda_backend::DeviceId,
    Vec<u32>,
    SharedI32,
);
/// A device array that several launches read.
pub(crate) type SharedI32 = Arc<CudaSlice<i32>>;
/// Distinct arrays kept per stream: a step of a batch uses two (start rows, block table); a
/// few more cover several caches or devices used in turn.
const KEPT_UPLOADS: usize = 8;

/// `xs` as i32 on `dev`, reusing an identical upload made on the same stream (so the copy is
/// ordered before every launch that reads it). The kernels only read these buffers; each is
/// freed in its stream's order when evicted (by its own thread) and no longer used.
pub(crate) fn to_device_i32_shared(dev: &candle::CudaDevice, xs: &[u32]) -> Result<SharedI32> {
    let mut kept = UPLOADS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let (key, id) = (stream_key(&dev.cuda_stream()), dev.id());
    let mine = |(k, d, _, _): &Upload| *k == key && *d == id;
    if let Some(i) = kept.iter().position(|e| mine(e) && e.2 == xs) {
        let hit = kept.remove(i);
        let buf = hit.3.clone();
        kept.push(hit);
        return Ok(buf);
    }
    let buf = Arc::new(to_device_i32(dev, xs)?);
    kept.push((key, id, xs.to_vec(), buf.clone()));
    if kept.iter().filter(|e| mine(e)).count() > KEPT_UPLOADS {
        let oldest = kept.iter().position(mine).expect("one was just pushed");
        kept.remove(oldest);
    }
    Ok(buf)
}

/// The device pointer of an optional buffer (0 when absent); the guard that orders the
/// stream's use of it goes to `syncs`, which must outlive the launch.
pub(crate) fn device_ptr_opt<'a>(
    x: Option<&'a CudaSlice<i32>>,
    stream: &'a Arc<CudaStream>,
    syncs: &mut Vec<SyncOnDrop<'a>>,
) -> CUdeviceptr {
    match x {
        Some(x) => {
            let (ptr, sync) = x.device_ptr(stream);
            syncs.push(sync);
            ptr
        }
        None => 0,
    }
}

/// Per-sequence numbers for a kernel: the address of a locked device tensor (from
/// [`locked_ptr`], nonzero) or else that of the host values' upload, whose sync goes to
/// `syncs` (0 when neither).
pub(crate) fn device_or_upload<'a>(
    device: CUdeviceptr,
    upload: Option<&'a CudaSlice<i32>>,
    stream: &'a Arc<CudaStream>,
    syncs: &mut Vec<SyncOnDrop<'a>>,
) -> CUdeviceptr {
    match device {
        0 => device_ptr_opt(upload, stream, syncs),
        ptr => ptr,
    }
}

/// Device copies of a packed batch's cumulative offsets `(cu_q, cu_k)`; `None` for fixed
/// length. Freed in stream order, after the launches that use them.
pub(crate) type SeqOffsets = (Option<CudaSlice<i32>>, Option<CudaSlice<i32>>);

pub(crate) fn seq_offsets(problem: &Problem, dev: &candle::CudaDevice) -> Result<SeqOffsets> {
    Ok(match &problem.varlen {
        Some(o) => (
            Some(to_device_i32(dev, &o.cu_q)?),
            Some(to_device_i32(dev, &o.cu_k)?),
        ),
        None => (None, None),
    })
}

/// Fills the pointers of the packed-batch offsets into `params`.
pub(crate) fn set_seq_offsets<'a>(
    params: &mut AttnParams,
    (cu_q, cu_k): &'a SeqOffsets,
    stream: &'a Arc<CudaStream>,
) -> Vec<SyncOnDrop<'a>> {
    let mut syncs = vec![];
    params.cu_seqlens_q = device_ptr_opt(cu_q.as_ref(), stream, &mut syncs);
    params.cu_seqlens_k = device_ptr_opt(cu_k.as_ref(), stream, &mut syncs);
    syncs
}

/// A cache's paging as the kernels take it: `(block_table, max_pages, page_size, num_pages)`.
/// A host block table is uploaded (shared between launches); a device one is not (`None`:
/// see [`device_table`]); a contiguous cache has no table and its capacity as `page_size`.
pub(crate) fn paging_args(
    dev: &candle::CudaDevice,
    paging: &Paging,
) -> Result<(Option<SharedI32>, i32, i32, i32)> {
    Ok(match paging {
        Paging::Contiguous { capacity } => (None, 0, rows_i32(*capacity, "capacity")?, 0),
        Paging::Paged {
            page_size,
            max_pages,
            num_pages,
            block_table,
        } => {
            // Page numbers and in-page rows travel as i32; a sequence's capacity is a row count.
            let pages = to_i32(*num_pages, "num_pages")?;
            rows_i32(
                page_size.saturating_mul(*max_pages),
                "max_pages * page_size",
            )?;
            let table = match block_table {
                Indices::Host(t) => Some(to_device_i32_shared(dev, t)?),
                Indices::Device(_) => None,
            };
            (
                table,
                to_i32(*max_pages, "max_pages")?,
                to_i32(*page_size, "page_size")?,
                pages,
            )
        }
    })
}

/// A paged cache's block table when it is a device tensor (lock it with [`lock_tensor`]).
pub(crate) fn device_table(paging: &Paging) -> Option<&Tensor> {
    match paging {
        Paging::Paged {
            block_table: Indices::Device(t),
            ..
        } => Some(t),
        _ => None,
    }
}

/// Per-sequence numbers given as a device tensor (lock it with [`lock_tensor`]).
pub(crate) fn device_indices(x: &Indices) -> Option<&Tensor> {
    match x {
        Indices::Device(t) => Some(t),
        Indices::Host(_) => None,
    }
}
