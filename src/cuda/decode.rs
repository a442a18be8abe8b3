//! The decode launcher: attention of a few query rows over a KV cache, its key range split
//! across the GPU when the batch is small (`flash_decode` in `cuda/decode/decode.cu`; the
//! split count and block shape come from `plan_decode`).

use std::sync::Mutex;

use candle::backend::BackendStorage;
use candle::cuda_backend::cudarc::driver::sys::CUdeviceptr;
use candle::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr};
use candle::cuda_backend::CudaDType;
use candle::{bail, CudaStorage, DType, Layout, Result};
use float8::F8E4M3;
use half::{bf16, f16};

use super::abi::{rows_i32, strides3, to_i32, AttnParams};
use super::buffers::{
    device_indices, device_or_upload, device_table, lock_slopes, lock_tensor, locked_ptr,
    paging_args, to_device_i32, to_device_i32_shared,
};
use super::catalogue::Kernel;
use super::plan::{plan_decode, DecodeQuery};
use super::runtime::{
    device_facts, poison, resident_blocks, resident_clusters, stream_buffer, stream_counters,
    Launch, Source, StreamBuffers, StreamCounters,
};
use crate::params::{DecodeProblem, Indices};

/// `DECODE_INLINE_SEQLENS` in `cuda/decode/params.cuh`: batches up to this size pass their lengths
/// inside the parameter block instead of through a host-to-device copy per call.
const INLINE_SEQLENS: usize = 128;

/// Mirror of `struct DecodeParams` in `cuda/decode/params.cuh`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct DecodeParams {
    pub(super) a: AttnParams,
    pub(super) seqlens: CUdeviceptr,
    pub(super) block_table: CUdeviceptr,
    pub(super) max_pages: i32,
    pub(super) page_size: i32,
    pub(super) num_pages: i32,
    pub(super) seqlens_add: i32,
    pub(super) q_lens: CUdeviceptr,
    pub(super) add_q_lens: i32,
    pub(super) num_splits: i32,
    pub(super) trigger_dependents: i32,
    pub(super) cluster: i32,
    pub(super) o_partial: CUdeviceptr,
    pub(super) lse_partial: CUdeviceptr,
    pub(super) lse: CUdeviceptr,
    pub(super) counters: CUdeviceptr,
    pub(super) k_scale: CUdeviceptr,
    pub(super) v_scale: CUdeviceptr,
    pub(super) append: DecodeAppend,
    pub(super) seqlens_inline: [i32; INLINE_SEQLENS],
}

/// Mirror of `struct DecodeAppend` in `cuda/decode/params.cuh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct DecodeAppend {
    pub(super) k_new: CUdeviceptr,
    pub(super) v_new: CUdeviceptr,
    pub(super) k_batch_stride: i64,
    pub(super) k_row_stride: i64,
    pub(super) k_head_stride: i64,
    pub(super) v_batch_stride: i64,
    pub(super) v_row_stride: i64,
    pub(super) v_head_stride: i64,
    pub(super) d: i32,
    pub(super) s_new: i32,
    pub(super) rot_cos: CUdeviceptr,
    pub(super) rot_sin: CUdeviceptr,
    pub(super) rot_rows: i32,
    pub(super) rot_half: i32,
    pub(super) rot_interleaved: i32,
    pub(super) q_causal: i32,
}

// SAFETY: plain-old-data with the C layout of `DecodeParams`, passed by value.
unsafe impl DeviceRepr for DecodeParams {}

/// How many clusters of `size` blocks of `kernel` the device runs at once (0 before sm_90),
/// for the cluster merge.
fn cluster_residency(
    dev: &candle::CudaDevice,
    kernel: Kernel,
    dtype: DType,
    size: usize,
) -> Result<usize> {
    let g = kernel.geometry();
    let source = Source::Attention(kernel.file());
    resident_clusters(
        dev,
        source,
        kernel.name(dtype)?,
        g.threads,
        g.smem,
        size as u32,
    )
}

/// How many blocks of `kernel` one multiprocessor of `dev` holds at once (registers and
/// shared memory, asked of the driver), for the split heuristic.
fn residency(dev: &candle::CudaDevice, kernel: Kernel, dtype: DType) -> Result<usize> {
    let g = kernel.geometry();
    resident_blocks(
        dev,
        Source::Attention(kernel.file()),
        kernel.name(dtype)?,
        g.threads,
        g.smem,
    )
}

/// Arrival counters of the merge, one `u32` per (sequence, K/V head, row tile) (see
/// [`StreamCounters`]). They are zero between launches because the last split of each tile
/// wraps its counter back to 0 (`atomicInc`), so a call needs no memset of its own, which
/// would cost a stream operation about as long as the launch gap of the separate combine
/// kernel this merge replaced.
static COUNTERS: Mutex<StreamCounters> = Mutex::new(Vec::new());

/// Split launches' partial results, `(splits, b, h, s_q, d)` then `(splits, b, h, s_q)` f32,
/// per stream (see [`StreamBuffers`]): scratch written and read within one launch, which as
/// an allocation of its own would add memory nodes to a captured decoding step.
static PARTIALS: Mutex<StreamBuffers<f32>> = Mutex::new(Vec::new());

/// Attention of `q` `(b, s_q, h, d)` over each sequence's first `seqlens[b]` cached tokens.
/// Returns the output `(b, s_q, h, d)`, contiguous, in q's dtype, and when the problem asks
/// for it the LSE `(b, h, s_q)` in f32.
pub(crate) fn decode(
    problem: &DecodeProblem,
    q: (&CudaStorage, &Layout),
    k_cache: (&CudaStorage, &Layout),
    v_cache: (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Option<CudaStorage>)> {
    match (q.0.dtype(), k_cache.0.dtype()) {
        (DType::F16, DType::F16) => decode_typed::<f16, f16>(problem, q, k_cache, v_cache),
        (DType::BF16, DType::BF16) => decode_typed::<bf16, bf16>(problem, q, k_cache, v_cache),
        (DType::F16, DType::F8E4M3) => decode_typed::<f16, F8E4M3>(problem, q, k_cache, v_cache),
        (DType::BF16, DType::F8E4M3) => decode_typed::<bf16, F8E4M3>(problem, q, k_cache, v_cache),
        (DType::F16 | DType::BF16, dt) => bail!(
            "k_cache: dtype {dt:?} is not supported with q in {:?} on CUDA, expected q's dtype \
             or F8E4M3",
            q.0.dtype()
        ),
        (dt, _) => bail!("q: dtype {dt:?} is not supported on CUDA, expected F16 or BF16"),
    }
}

/// `T`: q's (and the output's) element; `C`: the cache's, `T` or F8E4M3 (the `_fp8` kernels,
/// with the problem's scales).
fn decode_typed<T: CudaDType + DeviceRepr + 'static, C: CudaDType + DeviceRepr>(
    problem: &DecodeProblem,
    (q, ql): (&CudaStorage, &Layout),
    (kc, kl): (&CudaStorage, &Layout),
    (vc, vl): (&CudaStorage, &Layout),
) -> Result<(CudaStorage, Option<CudaStorage>)> {
    let p = problem;
    let dev = q.device.clone();
    let stream = dev.cuda_stream();
    let dtype = q.dtype();
    let group = p.h / p.hk;
    // decode.cu packs the query rows of a K/V head's group as seqlen_q * group rows.
    rows_i32(
        p.s_q.saturating_mul(group),
        "seqlen_q * (num_heads / num_heads_k)",
    )?;
    // Device lengths are not known here: the launch is planned for the capacity, so its
    // shape is the same for every length (a CUDA graph replays it as it was captured).
    let max_len = match &p.seqlens {
        Indices::Host(lens) => lens.iter().copied().max().unwrap_or(0) as usize,
        Indices::Device(_) => p.paging.capacity(),
    };
    let fp8_cache = kc.dtype() == DType::F8E4M3;
    let scales = match (&p.kv_scales, fp8_cache) {
        (Some(s), true) => Some(s),
        (None, false) => None,
        _ => bail!("kv_cache_scales: expected scales exactly when the cache is F8E4M3"),
    };
    let facts = device_facts(&dev)?;
    let plan = plan_decode(
        &DecodeQuery {
            d: p.d,
            rows: p.s_q * group,
            pairs: p.b * p.hk,
            max_len,
            fp8_cache,
        },
        facts.sms,
        facts.smem,
        |k| residency(&dev, k, dtype),
        |k, size| cluster_residency(&dev, k, dtype, size),
    )?;
    let (splits, row_tiles) = (plan.splits, plan.row_tiles);
    if p.append.is_some() && row_tiles != 1 {
        bail!(
            "kv-cache: the append fused into the decode launch needs one row tile per K/V head, \
             the plan has {row_tiles} (crate bug: the call should have appended separately)"
        )
    }

    let out_elems = p.b * p.s_q * p.h * p.d;
    // Inside graph::CapturedGraph::capture, roots of the graph (see `unchained`).
    let (mut out, mut lse_out) = crate::graph::unchained(&stream, || {
        // SAFETY: the decode kernel (when split, the last split of each row tile) writes
        // every element.
        let out = unsafe { dev.alloc::<T>(out_elems)? };
        // SAFETY: the kernel (or the merge) writes the LSE of every row with a query.
        let lse_out = match p.want_lse || p.sinks.is_some() {
            true => Some(unsafe { dev.alloc::<f32>(p.b * p.h * p.s_q)? }),
            false => None,
        };
        Ok((out, lse_out))
    })?;
    poison(&stream, &mut out)?;
    let mut seqlens_inline = [0i32; INLINE_SEQLENS];
    let seqlens = match &p.seqlens {
        Indices::Host(lens) if p.b <= INLINE_SEQLENS => {
            for (dst, &len) in seqlens_inline.iter_mut().zip(lens) {
                *dst = len as i32;
            }
            None
        }
        Indices::Host(lens) => Some(to_device_i32(&dev, lens)?),
        Indices::Device(_) => None,
    };
    let (block_table, max_pages, page_size, num_pages) = paging_args(&dev, &p.paging)?;
    let seqlens_lock = lock_tensor(device_indices(&p.seqlens));
    let q_lens_lock = lock_tensor(p.q_lens.as_ref().and_then(device_indices));
    let q_lens_host = match &p.q_lens {
        Some(Indices::Host(lens)) => Some(to_device_i32_shared(&dev, lens)?),
        _ => None,
    };
    let table_lock = lock_tensor(device_table(&p.paging));
    // A split launch's merge counters and partial results (o, then LSE), per stream: held
    // until the launch is queued, so that another thread's call on this stream cannot grow
    // (and retire) them in between.
    let mut workspace = if splits > 1 && !plan.cluster {
        Some((
            COUNTERS
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
            PARTIALS
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()),
        ))
    } else {
        None
    };
    let partial_rows = splits * p.b * p.h * p.s_q;
    let (mut counters, mut partials) = match workspace.as_mut() {
        Some((counters, partials)) => (
            Some(stream_counters(counters, &dev, p.b * p.hk * row_tiles)?),
            Some(stream_buffer(partials, &dev, partial_rows * (p.d + 1))?),
        ),
        None => (None, None),
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
        let k_view = kc.as_cuda_slice::<C>()?.slice(kl.start_offset()..);
        let v_view = vc.as_cuda_slice::<C>()?.slice(vl.start_offset()..);
        let mut syncs = vec![];
        let (q_ptr, q_sync) = q_view.device_ptr(&stream);
        let (k_ptr, k_sync) = k_view.device_ptr(&stream);
        let (v_ptr, v_sync) = v_view.device_ptr(&stream);
        let (o_ptr, o_sync) = out.device_ptr_mut(&stream);
        // SAFETY (the scratch's contents): each split writes its partial rows before it counts
        // itself in; the last to arrive reads them.
        let (op_ptr, lp_ptr, partial_syncs) = match &mut partials {
            Some(w) => {
                let (ptr, sync) = w.device_ptr_mut(&stream);
                let lse_at = (partial_rows * p.d * std::mem::size_of::<f32>()) as u64;
                (ptr, ptr + lse_at, Some(sync))
            }
            None => (0, 0, None),
        };
        let (counters_ptr, counters_sync) = match &mut counters {
            Some(c) => {
                let (ptr, sync) = c.device_ptr_mut(&stream);
                (ptr, Some(sync))
            }
            None => (0, None),
        };
        let scale_locks = [
            lock_tensor(scales.map(|s| &s.k)),
            lock_tensor(scales.map(|s| &s.v)),
        ];
        let (k_scale, _k_scale_sync) =
            locked_ptr::<f32, _>(&scale_locks[0], &stream, "kv_cache_scales")?;
        let (v_scale, _v_scale_sync) =
            locked_ptr::<f32, _>(&scale_locks[1], &stream, "kv_cache_scales")?;
        let slopes = lock_slopes(&p.mods);
        let (alibi, _slopes_sync) = locked_ptr::<f32, _>(&slopes, &stream, "alibi_slopes")?;
        a.alibi_slopes = alibi;
        let (lens_dev, _lens_sync) = locked_ptr::<u32, _>(&seqlens_lock, &stream, "cache_seqlens")?;
        let (table_dev, _table_sync) = locked_ptr::<u32, _>(&table_lock, &stream, "block_table")?;
        let (q_lens_dev, _q_lens_sync) = locked_ptr::<u32, _>(&q_lens_lock, &stream, "seqlens_q")?;
        let (lse_ptr, lse_sync) = match &mut lse_out {
            Some(l) => {
                let (ptr, sync) = l.device_ptr_mut(&stream);
                (ptr, Some(sync))
            }
            None => (0, None),
        };
        // The fused append's rows and rotary tables, read by the launch.
        let fused = p.append.as_ref();
        let rot = fused.and_then(|f| f.rotary.as_ref());
        let append_locks = [
            lock_tensor(fused.map(|f| &f.k_new)),
            lock_tensor(fused.map(|f| &f.v_new)),
        ];
        let rot_locks = [
            lock_tensor(rot.map(|r| &r.cos)),
            lock_tensor(rot.map(|r| &r.sin)),
        ];
        let (k_new, _k_new_sync) = locked_ptr::<T, _>(&append_locks[0], &stream, "k_new")?;
        let (v_new, _v_new_sync) = locked_ptr::<T, _>(&append_locks[1], &stream, "v_new")?;
        let (rot_cos, _cos_sync) = locked_ptr::<f32, _>(&rot_locks[0], &stream, "rotary cos")?;
        let (rot_sin, _sin_sync) = locked_ptr::<f32, _>(&rot_locks[1], &stream, "rotary sin")?;
        let new_strides = |i: usize| match &append_locks[i] {
            Some((_, layout)) => strides3(layout),
            None => [0; 3],
        };
        let ([k_nb, k_nr, k_nh], [v_nb, v_nr, v_nh]) = (new_strides(0), new_strides(1));
        let append = DecodeAppend {
            k_new,
            v_new,
            k_batch_stride: k_nb,
            k_row_stride: k_nr,
            k_head_stride: k_nh,
            v_batch_stride: v_nb,
            v_row_stride: v_nr,
            v_head_stride: v_nh,
            d: p.d as i32,
            s_new: fused.map_or(0, |f| f.s_new as i32),
            rot_cos,
            rot_sin,
            rot_rows: rot.map_or(0, |r| r.cos.dim(0).unwrap_or(0) as i32),
            rot_half: rot.map_or(0, |r| r.rot_half as i32),
            rot_interleaved: rot.is_some_and(|r| r.interleaved) as i32,
            q_causal: rot.is_some_and(|r| r.q_causal) as i32,
        };
        let grid = (p.hk * row_tiles, splits, p.b);
        let params = DecodeParams {
            a: AttnParams {
                q: q_ptr,
                k: k_ptr,
                v: v_ptr,
                o: o_ptr,
                ..a
            },
            seqlens: device_or_upload(lens_dev, seqlens.as_ref(), &stream, &mut syncs),
            block_table: device_or_upload(table_dev, block_table.as_deref(), &stream, &mut syncs),
            max_pages,
            page_size,
            num_pages,
            seqlens_add: p.seqlens_add as i32,
            q_lens: device_or_upload(q_lens_dev, q_lens_host.as_deref(), &stream, &mut syncs),
            add_q_lens: p.add_q_lens as i32,
            num_splits: splits as i32,
            // A grid of one partial wave (a small batch's decode) lets the kernel after it
            // in as it starts: that kernel's blocks take the idle multiprocessors and wait in
            // `pdl_wait`. Larger grids wait for their exit: a next decode's blocks beside
            // them upset their placement (see `flash_decode`).
            trigger_dependents: i32::from(
                !crate::cuda::overrides().decode_trigger_off
                    && grid.0 * grid.1 * grid.2 <= facts.sms,
            ),
            cluster: i32::from(plan.cluster),
            o_partial: op_ptr,
            lse_partial: lp_ptr,
            lse: lse_ptr,
            counters: counters_ptr,
            k_scale,
            v_scale,
            append,
            seqlens_inline,
        };
        // A decode step is a few tens of microseconds, so the launch gap after the kernel
        // before it (the append, q's projection, the previous step) is a few percent of it;
        // launched programmatically the kernel waits in `pdl_wait` instead (H200, (8, 8k):
        // 0.0683 ms against 0.0707; docs/archive/PERF.md).
        let launch = Launch::new(plan.kernel, dtype, grid);
        match plan.cluster {
            true => launch.cluster_y(splits as u32),
            false => launch,
        }
        .run_programmatic(&dev, &params)?;
        drop((q_sync, k_sync, v_sync, o_sync, partial_syncs, syncs));
        drop((counters_sync, lse_sync));
    }
    drop(workspace);
    let lse = lse_out.map(|l| CudaStorage::wrap_cuda_slice(l, dev.clone()));
    Ok((CudaStorage::wrap_cuda_slice(out, dev), lse))
}
