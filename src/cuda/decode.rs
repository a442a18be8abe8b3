//! KV-cache launchers: the in-place append and split-KV decoding (`cuda/decode/decode.cu`).

use std::sync::Mutex;

use candle::backend::BackendStorage;
use candle::cuda_backend::cudarc::driver::sys::{CUdeviceptr, CUfunction_attribute};
use candle::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr};
use candle::cuda_backend::{CudaDType, WrapErr};
use candle::{bail, CudaStorage, DType, Layout, Result};
use half::{bf16, f16};

use super::{
    device_ptr_opt, dtype_name, launch, launch_programmatic, lock_slopes, locked_ptr, poison,
    rows_i32, stream_counters, strides3, to_device_i32, to_device_i32_shared, to_i32, AttnParams,
    FwdTile, SharedI32, StreamCounters,
};
use crate::params::{AppendProblem, DecodeProblem, Paging};

/// `DECODE_INLINE_SEQLENS` in `cuda/common/params.cuh`: batches up to this size pass their lengths
/// inside the parameter block instead of through a host-to-device copy per call.
const INLINE_SEQLENS: usize = 128;

/// Mirror of `struct DecodeParams` in `cuda/common/params.cuh`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct DecodeParams {
    pub(super) a: AttnParams,
    pub(super) seqlens: CUdeviceptr,
    pub(super) block_table: CUdeviceptr,
    pub(super) max_pages: i32,
    pub(super) page_size: i32,
    pub(super) num_splits: i32,
    pub(super) o_partial: CUdeviceptr,
    pub(super) lse_partial: CUdeviceptr,
    pub(super) counters: CUdeviceptr,
    pub(super) seqlens_inline: [i32; INLINE_SEQLENS],
}

// SAFETY: plain-old-data with the C layout of `DecodeParams`, passed by value.
unsafe impl DeviceRepr for DecodeParams {}

/// Mirror of `struct AppendParams` in `cuda/common/params.cuh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct AppendParams {
    pub(super) cache: CUdeviceptr,
    pub(super) src: CUdeviceptr,
    pub(super) cache_page_stride: i64,
    pub(super) cache_row_stride: i64,
    pub(super) cache_head_stride: i64,
    pub(super) src_batch_stride: i64,
    pub(super) src_row_stride: i64,
    pub(super) src_head_stride: i64,
    pub(super) start: CUdeviceptr,
    pub(super) block_table: CUdeviceptr,
    pub(super) max_pages: i32,
    pub(super) page_size: i32,
    pub(super) d: i32,
}

// SAFETY: as above.
unsafe impl DeviceRepr for AppendParams {}

/// Decode block shape, mirror of `DecodeTraits` in `cuda/decode/decode.cu`: 4 warps (8 in split
/// launches, [`block_warps`]) share 16 packed query rows; each warp streams its own 16-key
/// tiles through a two-stage ring.
const DECODE_ROWS: usize = 16;
const DECODE_WARPS: usize = 4;
/// Warps of a split launch's blocks (`flash_decode_*_w8`), up to this head dim.
const SPLIT_WARPS: usize = 8;
const SPLIT_WARPS_MAX_D: usize = 128;
/// Warps of decode blocks where four do not fit in shared memory (`flash_decode_*_w2`).
const NARROW_WARPS: usize = 2;
const DECODE_KEYS_PER_TILE: usize = 16;
/// `MAX_SPLITS` in `cuda/decode/decode.cu` (the merge's weight buffer).
const MAX_SPLITS: usize = 128;
/// Fewest key tiles per warp worth a split of their own: each split also pays for loading Q,
/// filling its ring, merging its warps and writing a partial row.
const MIN_TILES_PER_WARP: usize = 4;

/// `DecodeTraits::SMEM_BYTES`: Q tile (rows padded by 8 elements), per warp 2 stages of K and
/// V tiles (swizzled rows of `d` rounded up to 64 elements, `SwizzledRows` in
/// `cuda/decode/decode_block.cuh`; the merge reuses them as f32), then the merge's arrival count.
fn decode_smem_bytes(d: usize, warps: usize) -> u32 {
    let q = DECODE_ROWS * (d + 8) * 2;
    let pitch = d.next_multiple_of(64);
    let rings = warps * 2 * 2 * DECODE_KEYS_PER_TILE * pitch * 2;
    let merge = warps * DECODE_ROWS * (d + 2) * 4;
    // The merge's arrival count.
    let arrived = 16;
    (q + rings.max(merge) + arrived) as u32
}

/// `(block_table, max_pages, page_size)` for the kernels; no table for a contiguous cache.
fn paging_args(dev: &candle::CudaDevice, paging: &Paging) -> Result<(Option<SharedI32>, i32, i32)> {
    Ok(match paging {
        Paging::Contiguous { capacity } => (None, 0, rows_i32(*capacity, "capacity")?),
        Paging::Paged {
            page_size,
            max_pages,
            num_pages,
            block_table,
        } => {
            // Page numbers and in-page rows travel as i32; a sequence's capacity is a row count.
            to_i32(*num_pages, "num_pages")?;
            rows_i32(
                page_size.saturating_mul(*max_pages),
                "max_pages * page_size",
            )?;
            (
                Some(to_device_i32_shared(dev, block_table)?),
                to_i32(*max_pages, "max_pages")?,
                to_i32(*page_size, "page_size")?,
            )
        }
    })
}

/// Writes `new` `(b, s_new, hk, d)` into the cache rows `start[b]..` of each sequence, in
/// place. The caller checked that every row fits (and, paged, that its page is mapped).
pub(crate) fn append(
    problem: &AppendProblem,
    cache: &mut CudaStorage,
    cache_layout: &Layout,
    new: &CudaStorage,
    new_layout: &Layout,
) -> Result<()> {
    match cache.dtype() {
        DType::F16 => append_typed::<f16>(problem, cache, cache_layout, new, new_layout),
        DType::BF16 => append_typed::<bf16>(problem, cache, cache_layout, new, new_layout),
        dt => bail!("k_cache: dtype {dt:?} is not supported on CUDA, expected F16 or BF16"),
    }
}

fn append_typed<T: CudaDType + DeviceRepr>(
    problem: &AppendProblem,
    cache: &mut CudaStorage,
    cache_layout: &Layout,
    new: &CudaStorage,
    new_layout: &Layout,
) -> Result<()> {
    if problem.b * problem.s_new * problem.hk == 0 {
        return Ok(());
    }
    let dev = cache.device.clone();
    let stream = dev.cuda_stream();
    let dtype = dtype_name(cache.dtype())?;
    let start = to_device_i32_shared(&dev, &problem.start)?;
    let (block_table, max_pages, page_size) = paging_args(&dev, &problem.paging)?;
    let [cache_page_stride, cache_row_stride, cache_head_stride] = strides3(cache_layout);
    let [src_batch_stride, src_row_stride, src_head_stride] = strides3(new_layout);
    let new_view = new.as_cuda_slice::<T>()?.slice(new_layout.start_offset()..);
    let mut cache_view = cache
        .as_cuda_slice_mut::<T>()?
        .slice_mut(cache_layout.start_offset()..);
    let mut syncs = vec![];
    let (cache_ptr, cache_sync) = cache_view.device_ptr_mut(&stream);
    let (src_ptr, src_sync) = new_view.device_ptr(&stream);
    let params = AppendParams {
        cache: cache_ptr,
        src: src_ptr,
        cache_page_stride,
        cache_row_stride,
        cache_head_stride,
        src_batch_stride,
        src_row_stride,
        src_head_stride,
        start: device_ptr_opt(Some(&start), &stream, &mut syncs),
        block_table: device_ptr_opt(block_table.as_deref(), &stream, &mut syncs),
        max_pages,
        page_size,
        d: problem.d as i32,
    };
    let threads = problem.d.div_ceil(8).next_multiple_of(32) as u32;
    launch(
        &dev,
        &format!("flash_append_{dtype}"),
        (problem.s_new, problem.hk, problem.b),
        threads,
        0,
        &params,
    )?;
    drop((cache_sync, src_sync, syncs));
    Ok(())
}

/// What the split heuristic needs to know about a device and 4-warp decode kernel: its
/// streaming multiprocessors, and how many blocks of the kernel one of them holds at once
/// (registers and shared memory, asked of the driver). Cached per (device, kernel).
fn residency(
    dev: &candle::CudaDevice,
    kernel: &str,
    warps: usize,
    smem: u32,
) -> Result<(usize, usize)> {
    type Known = Vec<(usize, String, (usize, usize))>;
    static KNOWN: Mutex<Known> = Mutex::new(Vec::new());
    let ordinal = dev.cuda_stream().context().ordinal();
    let mut known = KNOWN
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some((_, _, r)) = known.iter().find(|(o, k, _)| *o == ordinal && k == kernel) {
        return Ok(*r);
    }
    let sms = super::device_facts(dev)?.sms;
    let func = super::load_func(dev, kernel, super::PtxFile::Decode)?;
    // The occupancy calculator refuses more dynamic shared memory than the attribute allows.
    func.set_attribute(
        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        smem as i32,
    )
    .w()?;
    let per_sm = func
        .occupancy_max_active_blocks_per_multiprocessor(32 * warps as u32, smem as usize, None)
        .w()? as usize;
    let r = (sms, per_sm.max(1));
    known.push((ordinal, kernel.to_string(), r));
    Ok(r)
}

/// `CANDLE_FLASH_DECODE_SPLITS=n` forces n splits (capped by `MAX_SPLITS`): a tuning aid for
/// measuring the heuristic against its alternatives (overrides.rs).
fn forced_splits() -> Option<usize> {
    super::overrides::overrides().decode_splits
}

/// `CANDLE_FLASH_DECODE_WARPS=4` keeps split launches at 4-warp blocks (a tuning aid for
/// measuring [`block_warps`] against the alternative; overrides.rs).
fn four_warps_forced() -> bool {
    super::overrides::overrides().decode_four_warps
}

/// Warps per decode block, and the split count that goes with them. A split launch fills
/// the SMs once with one block each (see [`num_splits`]), so its blocks get 8 warps: twice
/// the K/V tiles in flight per SM (H200, hd 128: (8, 8k) 0.0670 ms against 0.0683 with 4
/// warps, same run; docs/archive/PERF.md). Unsplit grids fill the SMs with several 4-warp blocks
/// (6 warps measured no faster at (32, 4k)). Head dims above `SPLIT_WARPS_MAX_D` keep 4
/// warps: at 224 and 256 eight warps' rings do not fit in shared memory, and 160 and 192
/// (which would fit) were not measured.
fn block_warps(
    blocks: usize,
    key_tiles: usize,
    sms: usize,
    slots: usize,
    d: usize,
    (base, wide_fits): (usize, bool),
) -> (usize, usize) {
    let splits = num_splits(blocks, key_tiles, sms, slots, base);
    if splits == 1 || d > SPLIT_WARPS_MAX_D || four_warps_forced() || !wide_fits {
        return (base, splits);
    }
    match num_splits(blocks, key_tiles, sms, slots, SPLIT_WARPS) {
        1 => (base, splits),
        wide => (SPLIT_WARPS, wide),
    }
}

/// Warps of an unsplit decode block on a device allowing `smem` bytes per block: 4, or 2
/// where four warps' K/V rings do not fit (d > 128 on a 99 KB sm_86/89 device:
/// `flash_decode_*_w2`).
fn base_warps(d: usize, smem: usize) -> usize {
    if decode_smem_bytes(d, DECODE_WARPS) as usize <= smem {
        DECODE_WARPS
    } else {
        NARROW_WARPS
    }
}

/// Arrival counters of the merge, one `u32` per (sequence, K/V head, row tile) (see
/// [`StreamCounters`]). They are zero between launches because the last split of each tile
/// wraps its counter back to 0 (`atomicInc`), so a call needs no memset of its own, which
/// would cost a stream operation about as long as the launch gap of the separate combine
/// kernel this merge replaced.
static COUNTERS: Mutex<StreamCounters> = Mutex::new(Vec::new());

/// How many slices of each sequence's key range run in parallel (flash-decoding), for
/// `blocks` = batch x K/V heads x row tiles, `key_tiles` 16-key tiles in the longest
/// sequence, `sms` multiprocessors and `slots` = SMs x resident blocks per SM.
///
/// Measured (H200, GQA 32/8, hd 128, docs/archive/PERF.md): one block per SM streams K and V
/// as fast as three, and any grid a little past the SM count pays a tail (at (1, 64k): 16 splits =
/// 128 blocks 0.074 ms, 17 = 136 blocks 0.086 ms, 49 = 392 blocks, 0.080 ms). So the splits
/// fill the SMs once, never past them; a grid that fills half the slots on its own runs
/// unsplit ((32, 4k): 256 blocks, 0.134 ms against 0.147 ms with 3 splits). At least
/// `MIN_TILES_PER_WARP` key tiles per warp.
fn num_splits(blocks: usize, key_tiles: usize, sms: usize, slots: usize, warps: usize) -> usize {
    if let Some(n) = forced_splits() {
        return n.min(MAX_SPLITS);
    }
    if blocks * 2 >= slots {
        return 1;
    }
    let most = (key_tiles / (MIN_TILES_PER_WARP * warps)).clamp(1, MAX_SPLITS);
    (sms / blocks.max(1)).clamp(1, most)
}

/// Attention of `q` `(b, s_q, h, d)` over each sequence's first `seqlens[b]` cached tokens.
/// Returns the output `(b, s_q, h, d)`, contiguous, in q's dtype.
pub(crate) fn decode(
    problem: &DecodeProblem,
    q: (&CudaStorage, &Layout),
    k_cache: (&CudaStorage, &Layout),
    v_cache: (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    match q.0.dtype() {
        DType::F16 => decode_typed::<f16>(problem, q, k_cache, v_cache),
        DType::BF16 => decode_typed::<bf16>(problem, q, k_cache, v_cache),
        dt => bail!("q: dtype {dt:?} is not supported on CUDA, expected F16 or BF16"),
    }
}

fn decode_typed<T: CudaDType + DeviceRepr>(
    problem: &DecodeProblem,
    (q, ql): (&CudaStorage, &Layout),
    (kc, kl): (&CudaStorage, &Layout),
    (vc, vl): (&CudaStorage, &Layout),
) -> Result<CudaStorage> {
    let p = problem;
    let dev = q.device.clone();
    let stream = dev.cuda_stream();
    let dtype = dtype_name(q.dtype())?;
    let tile = FwdTile::for_head_dim(p.d);
    let group = p.h / p.hk;
    // decode.cu packs the query rows of a K/V head's group as seqlen_q * group rows.
    rows_i32(
        p.s_q.saturating_mul(group),
        "seqlen_q * (num_heads / num_heads_k)",
    )?;
    let row_tiles = (p.s_q * group).div_ceil(DECODE_ROWS);
    let max_len = p.seqlens.iter().copied().max().unwrap_or(0) as usize;
    let limit = super::device_facts(&dev)?.smem;
    let base = base_warps(tile.d, limit);
    let name = |warps: usize| match warps {
        DECODE_WARPS => format!("flash_decode_{dtype}_d{}", tile.d),
        w => format!("flash_decode_{dtype}_d{}_w{w}", tile.d),
    };
    let (sms, per_sm) = residency(&dev, &name(base), base, decode_smem_bytes(tile.d, base))?;
    let wide_fits = decode_smem_bytes(tile.d, SPLIT_WARPS) as usize <= limit;
    let (warps, splits) = block_warps(
        p.b * p.hk * row_tiles,
        max_len.div_ceil(DECODE_KEYS_PER_TILE),
        sms,
        sms * per_sm,
        tile.d,
        (base, wide_fits),
    );
    let kernel = name(warps);
    let smem = decode_smem_bytes(tile.d, warps);

    let out_elems = p.b * p.s_q * p.h * p.d;
    // SAFETY: the decode kernel (when split, the last split of each row tile) writes every
    // element.
    let mut out = unsafe { dev.alloc::<T>(out_elems)? };
    poison(&stream, &mut out)?;
    // Unsplit calls need no partial buffers; one element keeps the allocation legal (CUDA
    // rejects zero-byte allocations).
    let partial_rows = if splits > 1 {
        splits * p.b * p.h * p.s_q
    } else {
        1
    };
    // SAFETY: each split writes its rows of both buffers before it counts itself in; the last
    // to arrive reads them.
    let mut o_partial = unsafe { dev.alloc::<f32>(partial_rows * p.d)? };
    let mut lse_partial = unsafe { dev.alloc::<f32>(partial_rows)? };
    let mut seqlens_inline = [0i32; INLINE_SEQLENS];
    let seqlens = if p.b <= INLINE_SEQLENS {
        for (dst, &len) in seqlens_inline.iter_mut().zip(&p.seqlens) {
            *dst = len as i32;
        }
        None
    } else {
        Some(to_device_i32(&dev, &p.seqlens)?)
    };
    let (block_table, max_pages, page_size) = paging_args(&dev, &p.paging)?;
    // Held until the launch is queued: another thread's call on this stream must not grow
    // (and free) the counters in between.
    let mut counter_cache = if splits > 1 {
        Some(
            COUNTERS
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        )
    } else {
        None
    };
    let mut counters = match counter_cache.as_deref_mut() {
        Some(cache) => Some(stream_counters(cache, &dev, p.b * p.hk * row_tiles)?),
        None => None,
    };

    let [qb, qr, qh] = strides3(ql);
    let [kb, kr, kh] = strides3(kl);
    let [vb, vr, vh] = strides3(vl);
    let mut a = AttnParams {
        q_batch_stride: qb,
        q_row_stride: qr,
        q_head_stride: qh,
        k_batch_stride: kb,
        k_row_stride: kr,
        k_head_stride: kh,
        v_batch_stride: vb,
        v_row_stride: vr,
        v_head_stride: vh,
        o_batch_stride: (p.s_q * p.h * p.d) as i64,
        o_row_stride: (p.h * p.d) as i64,
        o_head_stride: p.d as i64,
        b: to_i32(p.b, "batch")?,
        h: to_i32(p.h, "num_heads")?,
        h_k: to_i32(p.hk, "num_heads_k")?,
        seqlen_q: rows_i32(p.s_q, "seqlen_q")?,
        seqlen_k: rows_i32(max_len, "cache_seqlens")?,
        d: p.d as i32,
        h_h_k_ratio: group as i32,
        ..AttnParams::default()
    };
    a.set_mods(&p.mods, p.scale, p.s_q, max_len);
    {
        let q_view = q.as_cuda_slice::<T>()?.slice(ql.start_offset()..);
        let k_view = kc.as_cuda_slice::<T>()?.slice(kl.start_offset()..);
        let v_view = vc.as_cuda_slice::<T>()?.slice(vl.start_offset()..);
        let mut syncs = vec![];
        let (q_ptr, q_sync) = q_view.device_ptr(&stream);
        let (k_ptr, k_sync) = k_view.device_ptr(&stream);
        let (v_ptr, v_sync) = v_view.device_ptr(&stream);
        let (o_ptr, o_sync) = out.device_ptr_mut(&stream);
        let (op_ptr, op_sync) = o_partial.device_ptr_mut(&stream);
        let (lp_ptr, lp_sync) = lse_partial.device_ptr_mut(&stream);
        let (counters_ptr, counters_sync) = match &mut counters {
            Some(c) => {
                let (ptr, sync) = c.device_ptr_mut(&stream);
                (ptr, Some(sync))
            }
            None => (0, None),
        };
        let slopes = lock_slopes(&p.mods);
        let (alibi, _slopes_sync) = locked_ptr::<f32, _>(&slopes, &stream, "alibi_slopes")?;
        a.alibi_slopes = alibi;
        let params = DecodeParams {
            a: AttnParams {
                q: q_ptr,
                k: k_ptr,
                v: v_ptr,
                o: o_ptr,
                ..a
            },
            seqlens: device_ptr_opt(seqlens.as_ref(), &stream, &mut syncs),
            block_table: device_ptr_opt(block_table.as_deref(), &stream, &mut syncs),
            max_pages,
            page_size,
            num_splits: splits as i32,
            o_partial: op_ptr,
            lse_partial: lp_ptr,
            counters: counters_ptr,
            seqlens_inline,
        };
        // A decode step is a few tens of microseconds, so the launch gap after the kernel
        // before it (the append, q's projection, the previous step) is a few percent of it;
        // launched programmatically the kernel waits in `pdl_wait` instead (H200, (8, 8k):
        // 0.0683 ms against 0.0707; docs/archive/PERF.md).
        launch_programmatic(
            &dev,
            &kernel,
            (p.hk * row_tiles, splits, p.b),
            32 * warps as u32,
            smem,
            &params,
        )?;
        drop((q_sync, k_sync, v_sync, o_sync, op_sync, lp_sync, syncs));
        drop(counters_sync);
    }
    drop(counter_cache);
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}
