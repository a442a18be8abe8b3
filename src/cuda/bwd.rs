//! The backward's launcher: the parameter block and gradient buffer, then the path
//! `plan_bwd` chose (see `plan::bwd` for which runs where): dsum and the separate, fused or
//! wgmma kernels here, the warp-specialized ones in [`super::bwd_ws`].

use candle::backend::BackendStorage;
use candle::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr};
use candle::cuda_backend::CudaDType;
use candle::{bail, CudaStorage, DType, Layout, Result, Tensor};
use half::{bf16, f16};

use super::abi::{mods_level, AttnParams, BwdParams};
use super::buffers::{
    lock_slopes, lock_sparse, locked_ptr, seq_offsets, set_seq_offsets, sparse_ptrs,
};
use super::bwd_ws::{self, BwdWsBuffers};
use super::catalogue::{Family, Kernel};
use super::plan::{plan_bwd, BwdPlan, BwdQuery};
use super::runtime::{device_facts, poison, Launch};
use crate::params::Problem;

fn cuda_storage<'a>(storage: &'a candle::Storage, name: &str) -> Result<&'a CudaStorage> {
    match storage {
        candle::Storage::Cuda(s) => Ok(s),
        _ => bail!("flash-attn backward: {name} is not on the CUDA device like q"),
    }
}

/// Backward pass: returns one buffer `[dq | dk | dv]` in q's dtype, dq `(b, sq, h, d)` and
/// dk, dv `(b, sk, hk, d)`, all contiguous. `out`, `grad_out` and `lse` are contiguous.
/// With `deterministic`, no floating-point atomics (dQ has a pass of its own); otherwise dQ's
/// summation order over key blocks varies from run to run where the fused kernel exists.
#[allow(clippy::too_many_arguments)]
pub(crate) fn bwd(
    problem: &Problem,
    deterministic: bool,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    out: &Tensor,
    grad_out: &Tensor,
    lse: &Tensor,
) -> Result<CudaStorage> {
    match q.0.dtype() {
        DType::F16 => bwd_typed::<f16>(problem, deterministic, q, k, v, out, grad_out, lse),
        DType::BF16 => bwd_typed::<bf16>(problem, deterministic, q, k, v, out, grad_out, lse),
        dt => bail!("q: dtype {dt:?} is not supported on CUDA, expected F16 or BF16"),
    }
}

#[allow(clippy::too_many_arguments)]
fn bwd_typed<T: CudaDType + DeviceRepr>(
    problem: &Problem,
    deterministic: bool,
    (q, ql): (&CudaStorage, &Layout),
    (k, kl): (&CudaStorage, &Layout),
    (v, vl): (&CudaStorage, &Layout),
    out: &Tensor,
    grad_out: &Tensor,
    lse: &Tensor,
) -> Result<CudaStorage> {
    let s = problem.shape;
    let dev = q.device.clone();
    let stream = dev.cuda_stream();
    let facts = device_facts(&dev)?;
    let dtype = q.dtype();

    let (o_storage, o_layout) = out.storage_and_layout();
    let (do_storage, do_layout) = grad_out.storage_and_layout();
    let (lse_storage, lse_layout) = lse.storage_and_layout();
    let o = cuda_storage(&o_storage, "out")?.as_cuda_slice::<T>()?;
    let d_o = cuda_storage(&do_storage, "grad_out")?.as_cuda_slice::<T>()?;
    let lse_in = cuda_storage(&lse_storage, "lse")?.as_cuda_slice::<f32>()?;
    let o_view = o.slice(o_layout.start_offset()..);
    let do_view = d_o.slice(do_layout.start_offset()..);
    let lse_view = lse_in.slice(lse_layout.start_offset()..);
    let q_view = q.as_cuda_slice::<T>()?.slice(ql.start_offset()..);
    let k_view = k.as_cuda_slice::<T>()?.slice(kl.start_offset()..);
    let v_view = v.as_cuda_slice::<T>()?.slice(vl.start_offset()..);

    let (nq, nkv) = (s.q_elems(), s.kv_elems());
    // SAFETY: the kernels write every element of dq, dk, dv (rows < seqlen, cols < d).
    let mut grads = unsafe { dev.alloc::<T>(nq + 2 * nkv)? };
    poison(&stream, &mut grads)?;

    let packed = problem.varlen.is_some();
    let totals = packed.then_some((s.total_q, s.total_k));
    let mut params = BwdParams {
        a: AttnParams::new(problem, ql, kl, vl)?,
        dk_batch_stride: if packed {
            0
        } else {
            (s.sk * s.hk * s.d) as i64
        },
        dk_row_stride: (s.hk * s.d) as i64,
        dk_head_stride: s.d as i64,
        dq_accum_len: nq as i64,
        ..BwdParams::default()
    };
    let mods = mods_level(&problem.mods);
    let (ws_plan, plan) = plan_bwd(
        &BwdQuery {
            d: s.d,
            deterministic,
            dropout: params.a.drop_threshold != 0,
            mods,
            cap_alone: params.a.softcap_pre != 0.0
                && params.a.softcap_pre <= 1.0
                && problem.mods.alibi.is_none(),
            packed,
        },
        &facts,
    )?;
    let offsets = seq_offsets(problem, &dev)?;
    {
        let _offset_syncs = set_seq_offsets(&mut params.a, &offsets, &stream);
        let (q_ptr, _q_sync) = q_view.device_ptr(&stream);
        let (k_ptr, _k_sync) = k_view.device_ptr(&stream);
        let (v_ptr, _v_sync) = v_view.device_ptr(&stream);
        let (o_ptr, _o_sync) = o_view.device_ptr(&stream);
        let (do_ptr, _do_sync) = do_view.device_ptr(&stream);
        let (lse_ptr, _lse_sync) = lse_view.device_ptr(&stream);
        let (grads_ptr, _grads_sync) = grads.device_ptr_mut(&stream);
        let elem = std::mem::size_of::<T>() as u64;
        (params.a.q, params.a.k, params.a.v, params.a.o, params.a.lse) =
            (q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr);
        params.dout = do_ptr;
        params.dq = grads_ptr;
        params.dk = grads_ptr + nq as u64 * elem;
        params.dv = grads_ptr + (nq + nkv) as u64 * elem;
        let slopes = lock_slopes(&problem.mods);
        let (alibi, _slopes_sync) = locked_ptr::<f32, _>(&slopes, &stream, "alibi_slopes")?;
        params.a.alibi_slopes = alibi;
        let sparse = lock_sparse(&problem.mods);
        let (_sparse_syncs, next_col) = sparse_ptrs(&mut params.a, &sparse, &stream)?;
        let ws = match ws_plan {
            Some(BwdPlan::Ws {
                prep,
                main,
                convert,
            }) if bwd_ws::supported(&params, main, dtype, totals) => Some((prep, main, convert)),
            // Tensors TMA cannot address, or a grid past its index range: what runs there
            // without the warp-specialized kernels.
            _ => None,
        };
        match ws {
            Some(kernels) => {
                let mut buffers = BwdWsBuffers::new(&dev, kernels.1, s.b, s.h, s.sq)?;
                bwd_ws::run(
                    &dev,
                    facts.sms,
                    kernels,
                    dtype,
                    &params,
                    totals,
                    deterministic,
                    next_col,
                    &mut buffers,
                )?;
            }
            None => run_path(&dev, plan, problem, dtype, &mut params)?,
        }
    }
    Ok(CudaStorage::wrap_cuda_slice(grads, dev))
}

/// dsum, then the kernels of `plan` (not `Ws`) on `params` (every pointer but dsum and
/// dq_accum set).
fn run_path(
    dev: &candle::CudaDevice,
    plan: BwdPlan,
    problem: &Problem,
    dtype: DType,
    params: &mut BwdParams,
) -> Result<()> {
    let s = problem.shape;
    let stream = dev.cuda_stream();
    let nq = s.q_elems();
    // SAFETY: the dsum kernel writes every row before the others read it.
    let mut dsum = unsafe { dev.alloc::<f32>(s.h * s.total_q)? };
    // The fused kernels add into it; rows that no key reaches keep their zeros. The mma.sync
    // ones tile it (`dq_tile_offset` in cuda/common/bwd_dq_accum.cuh): per query head,
    // total_q rows plus one tile of rows per sequence, of the kernel's head dim.
    let mut dq_accum = match plan {
        BwdPlan::Fused { dkdvq, .. } => {
            let rows = s.total_q + dkdvq.geometry().bm as usize * s.b;
            params.dq_tile_rows = rows as i64;
            let d = usize::from(dkdvq.variant().d);
            Some(dev.alloc_zeros::<f32>(s.h * rows * d)?)
        }
        BwdPlan::Sm90 { .. } => Some(dev.alloc_zeros::<f32>(nq)?),
        BwdPlan::Separate { .. } => None,
        BwdPlan::Ws { .. } => {
            bail!("flash-attn backward: the warp-specialized path is run by bwd_ws")
        }
    };
    let (dsum_ptr, _dsum_sync) = dsum.device_ptr_mut(&stream);
    let dq_accum_ptr = dq_accum.as_mut().map(|b| b.device_ptr_mut(&stream));
    params.dsum = dsum_ptr;
    params.dq_accum = dq_accum_ptr.as_ref().map_or(0, |(ptr, _)| *ptr);
    let params = &*params;
    // One warp per row, 256 threads.
    let rows_per_block = 8;
    let Some(dsum_kernel) = Kernel::of(Family::BwdDsum, 0, |_| true) else {
        bail!("flash-attn backward: no dsum kernel")
    };
    Launch::new(
        dsum_kernel,
        dtype,
        (s.sq.div_ceil(rows_per_block), s.h, s.b),
    )
    .threads(32 * rows_per_block as u32)
    .run(dev, params)?;
    match plan {
        BwdPlan::Separate { dkdv, dq } => {
            let g = dkdv.geometry();
            let grid = (s.sk.div_ceil(g.bn as usize), s.hk * g.splits as usize, s.b);
            Launch::new(dkdv, dtype, grid).run(dev, params)?;
            let grid = (s.sq.div_ceil(dq.geometry().bm as usize), s.h, s.b);
            Launch::new(dq, dtype, grid).run(dev, params)?;
        }
        BwdPlan::Sm90 { dkdvq, convert } => {
            let grid = (s.sk.div_ceil(dkdvq.geometry().bn as usize), s.hk, s.b);
            Launch::new(dkdvq, dtype, grid).run(dev, params)?;
            let (threads, per_thread) = (256, 8);
            Launch::new(convert, dtype, (nq.div_ceil(threads * per_thread), 1, 1))
                .threads(threads as u32)
                .run(dev, params)?;
        }
        BwdPlan::Fused { dkdvq, convert } => {
            let g = dkdvq.geometry();
            let grid = (s.sk.div_ceil(g.bn as usize), s.hk, s.b);
            Launch::new(dkdvq, dtype, grid).run(dev, params)?;
            let grid = (s.sq.div_ceil(convert.geometry().bm as usize), s.h, s.b);
            Launch::new(convert, dtype, grid).run(dev, params)?;
        }
        BwdPlan::Ws { .. } => {} // refused above
    }
    Ok(())
}
