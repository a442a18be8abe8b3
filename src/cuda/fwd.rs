//! The forward's launcher: the parameter block, the outputs, and the kernel `plan_fwd` chose
//! (the warp-specialized one with its tensor maps and tile schedule, else a kernel of one
//! block per query tile).

use std::sync::Mutex;

use candle::backend::BackendStorage;
use candle::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr};
use candle::cuda_backend::CudaDType;
use candle::{bail, CudaStorage, DType, Layout, Result};
use half::{bf16, f16};

use super::abi::{mods_level, AttnParams};
use super::buffers::{
    lock_slopes, lock_sparse, locked_ptr, seq_offsets, set_seq_offsets, sparse_ptrs,
};
use super::catalogue::Kernel;
use super::lpt_tail::Tail;
use super::plan::{plan_fwd, FwdQuery};
use super::runtime::{device_facts, poison, stream_counters, Launch, StreamCounters};
use super::tma;
use crate::params::Problem;

/// Forward pass: returns `(out, lse)` storages, out `(b, sq, h, d)` contiguous in q's dtype,
/// lse `(b, h, sq)` f32.
pub(crate) fn fwd(
    problem: &Problem,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
) -> Result<(CudaStorage, CudaStorage)> {
    match q.0.dtype() {
        DType::F16 => fwd_typed::<f16>(problem, q, k, v),
        DType::BF16 => fwd_typed::<bf16>(problem, q, k, v),
        dt => bail!("q: dtype {dt:?} is not supported on CUDA, expected F16 or BF16"),
    }
}

fn fwd_typed<T: CudaDType + DeviceRepr>(
    problem: &Problem,
    (q, ql): (&CudaStorage, &Layout),
    (k, kl): (&CudaStorage, &Layout),
    (v, vl): (&CudaStorage, &Layout),
) -> Result<(CudaStorage, CudaStorage)> {
    let s = problem.shape;
    let dev = q.device.clone();
    let stream = dev.cuda_stream();
    let q_view = q.as_cuda_slice::<T>()?.slice(ql.start_offset()..);
    let k_view = k.as_cuda_slice::<T>()?.slice(kl.start_offset()..);
    let v_view = v.as_cuda_slice::<T>()?.slice(vl.start_offset()..);
    // SAFETY: every element of out and lse is written by the kernel (rows < sq, cols < d).
    let mut out = unsafe { dev.alloc::<T>(s.q_elems())? };
    let mut lse = unsafe { dev.alloc::<f32>(s.h * s.total_q)? };
    poison(&stream, &mut out)?;
    poison(&stream, &mut lse)?;

    let mut params = AttnParams::new(problem, ql, kl, vl)?;
    let facts = device_facts(&dev)?;
    let plan = plan_fwd(
        &FwdQuery {
            d: s.d,
            sq: s.sq,
            sk: s.sk,
            causal: problem.causal,
            mods: mods_level(&problem.mods),
            packed: problem.varlen.is_some(),
            // Dropout has kernels of its own (its Philox code costs registers in the loop).
            dropout: params.drop_threshold != 0,
            pairs: s.h * s.b,
        },
        &facts,
    )?;
    let offsets = seq_offsets(problem, &dev)?;
    {
        let _offset_syncs = set_seq_offsets(&mut params, &offsets, &stream);
        let (q_ptr, _q_sync) = q_view.device_ptr(&stream);
        let (k_ptr, _k_sync) = k_view.device_ptr(&stream);
        let (v_ptr, _v_sync) = v_view.device_ptr(&stream);
        let (o_ptr, _o_sync) = out.device_ptr_mut(&stream);
        let (lse_ptr, _lse_sync) = lse.device_ptr_mut(&stream);
        (params.q, params.k, params.v, params.o, params.lse) =
            (q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr);
        let slopes = lock_slopes(&problem.mods);
        let (alibi, _slopes_sync) = locked_ptr::<f32, _>(&slopes, &stream, "alibi_slopes")?;
        params.alibi_slopes = alibi;
        let sparse = lock_sparse(&problem.mods);
        let (_sparse_syncs, _) = sparse_ptrs(&mut params, &sparse, &stream)?;
        let dtype = q.dtype();
        // Warp-specialized where TMA can address the tensors (tma::TileSource::encode).
        let packed = problem.varlen.as_ref().map(|_| (s.total_q, s.total_k));
        let ws = plan
            .ws
            .and_then(|k| tma::fwd_params(&params, dtype, dtype, k, packed, None).map(|p| (k, p)));
        if let Some((kernel, ws_params)) = ws {
            // Tiles of unequal work (a mask, or packed sequences of different lengths) are
            // handed out from a counter.
            let masked = params.window_left >= 0
                || params.window_right >= 0
                || params.block_q != 0
                || problem.varlen.is_some();
            launch_ws(kernel, dtype, ws_params, problem, masked, &dev, facts.sms)?;
        } else {
            let kernel = plan.fallback;
            let grid = (s.sq.div_ceil(kernel.geometry().bm as usize), s.h, s.b);
            Launch::new(kernel, dtype, grid).run(&dev, &params)?;
        }
    }
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev.clone()),
        CudaStorage::wrap_cuda_slice(lse, dev),
    ))
}

/// Launches a warp-specialized forward kernel (16-bit or FP8, whose kernels are named by
/// `out_dtype`) with its parameter block: persistent blocks over the query tiles, under a
/// mask or with packed sequences (`masked`) taking their tiles from a per-stream counter,
/// programmatically (its barrier set-up overlaps the last blocks of the kernel before, and it
/// waits in `pdl_wait` before touching memory).
pub(super) fn launch_ws(
    kernel: Kernel,
    out_dtype: DType,
    mut ws: tma::FwdTmaParams,
    problem: &Problem,
    masked: bool,
    dev: &candle::CudaDevice,
    sms: usize,
) -> Result<()> {
    let s = problem.shape;
    let m_blocks = s.sq.div_ceil(kernel.geometry().bm as usize);
    let tiles = m_blocks * s.h * s.b;
    if tiles > i32::MAX as usize {
        bail!("q: {tiles} query tiles exceed the kernel's 32-bit tile index")
    }
    let (blocks, dynamic) = tma::ws_grid(tiles, sms, masked);
    // Locked (only for the dynamic schedule) until the launch is queued: see StreamCounters.
    // Only the counter needs the zero it keeps.
    static COUNTERS: Mutex<StreamCounters> = Mutex::new(Vec::new());
    let mut cache = dynamic.then(|| {
        COUNTERS
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    });
    let slots = tma::tile_slots(kernel, blocks);
    let counter = match cache.as_deref_mut() {
        Some(cache) => Some(stream_counters(cache, dev, slots)?),
        None => None,
    };
    let stream = dev.cuda_stream();
    let _counter_sync = counter.map(|c| {
        let (ptr, sync) = c.device_ptr_mut(&stream);
        ws.tile_counter = ptr;
        sync
    });
    if dynamic {
        ws.tail_heads = Tail::Forward.pairs(s.h * s.b, m_blocks, blocks);
    }
    Launch::new(kernel, out_dtype, (blocks, 1, 1)).run_programmatic(dev, &ws)
}
