//! Backward launchers: dsum, the dK/dV kernel and the dQ kernel (`cuda/bwd.cu`).

use candle::backend::BackendStorage;
use candle::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr};
use candle::cuda_backend::CudaDType;
use candle::{bail, CudaStorage, DType, Layout, Result, Tensor};
use half::{bf16, f16};

use super::{
    dtype_name, launch, poison, seq_offsets, set_seq_offsets, AttnParams, BwdParams, FwdTile,
};
use crate::params::Problem;

/// Backward tile shapes for one compiled head dim; mirror of `BwdConfig` in
/// `cuda/bwd_traits.cuh`.
#[derive(Clone, Copy, Debug)]
struct BwdTile {
    d: usize,
    /// dK/dV output columns per block.
    d_out: usize,
    kv_bn: usize,
    kv_bm: usize,
    q_bm: usize,
    q_bn: usize,
}

impl BwdTile {
    fn for_head_dim(d: usize) -> Self {
        let d = FwdTile::for_head_dim(d).d;
        Self {
            d,
            d_out: if d <= 128 { d } else { d / 2 },
            kv_bn: 64,
            kv_bm: if d <= 96 { 64 } else { 32 },
            q_bm: 64,
            q_bn: if d <= 128 { 64 } else { 32 },
        }
    }
    const THREADS: u32 = 128;
    fn splits(&self) -> usize {
        self.d / self.d_out
    }
    fn kv_smem_bytes(&self) -> u32 {
        ((2 * self.kv_bn + 2 * self.kv_bm) * (self.d + 8) * 2 + 2 * self.kv_bm * 4) as u32
    }
    fn q_smem_bytes(&self) -> u32 {
        ((2 * self.q_bm + 2 * self.q_bn) * (self.d + 8) * 2) as u32
    }
}

fn cuda_storage<'a>(storage: &'a candle::Storage, name: &str) -> Result<&'a CudaStorage> {
    match storage {
        candle::Storage::Cuda(s) => Ok(s),
        _ => bail!("flash-attn backward: {name} is not on the CUDA device like q"),
    }
}

/// Backward pass: returns one buffer `[dq | dk | dv]` in q's dtype, dq `(b, sq, h, d)` and
/// dk, dv `(b, sk, hk, d)`, all contiguous. `out`, `grad_out` and `lse` are contiguous.
/// Deterministic: no floating-point atomics (dQ has a pass of its own).
#[allow(clippy::too_many_arguments)]
pub(crate) fn bwd(
    problem: &Problem,
    _deterministic: bool,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    out: &Tensor,
    grad_out: &Tensor,
    lse: &Tensor,
) -> Result<CudaStorage> {
    match q.0.dtype() {
        DType::F16 => bwd_typed::<f16>(problem, q, k, v, out, grad_out, lse),
        DType::BF16 => bwd_typed::<bf16>(problem, q, k, v, out, grad_out, lse),
        dt => bail!("q: dtype {dt:?} is not supported on CUDA, expected F16 or BF16"),
    }
}

fn bwd_typed<T: CudaDType + DeviceRepr>(
    problem: &Problem,
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
    let tile = BwdTile::for_head_dim(s.d);
    let dtype = dtype_name(q.dtype())?;

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
    // SAFETY: the kernels write every element of dq, dk, dv (rows < seqlen, cols < d) and
    // every row of dsum before it is read.
    let mut grads = unsafe { dev.alloc::<T>(nq + 2 * nkv)? };
    let mut dsum = unsafe { dev.alloc::<f32>(s.h * s.total_q)? };
    poison(&stream, &mut grads)?;

    let packed = problem.varlen.is_some();
    let mut params = BwdParams {
        a: AttnParams::new(problem, ql, kl, vl)?,
        dk_batch_stride: if packed {
            0
        } else {
            (s.sk * s.hk * s.d) as i64
        },
        dk_row_stride: (s.hk * s.d) as i64,
        dk_head_stride: s.d as i64,
        ..BwdParams::default()
    };
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
        let (dsum_ptr, _dsum_sync) = dsum.device_ptr_mut(&stream);
        let elem = std::mem::size_of::<T>() as u64;
        (params.a.q, params.a.k, params.a.v, params.a.o, params.a.lse) =
            (q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr);
        params.dout = do_ptr;
        params.dsum = dsum_ptr;
        params.dq = grads_ptr;
        params.dk = grads_ptr + nq as u64 * elem;
        params.dv = grads_ptr + (nq + nkv) as u64 * elem;

        let rows_per_block = 8; // one warp per row, 256 threads
        launch(
            &dev,
            &format!("flash_bwd_dsum_{dtype}"),
            (s.sq.div_ceil(rows_per_block), s.h, s.b),
            32 * rows_per_block as u32,
            0,
            &params,
        )?;
        launch(
            &dev,
            &format!("flash_bwd_dkdv_{dtype}_d{}", tile.d),
            (s.sk.div_ceil(tile.kv_bn), s.hk * tile.splits(), s.b),
            BwdTile::THREADS,
            tile.kv_smem_bytes(),
            &params,
        )?;
        launch(
            &dev,
            &format!("flash_bwd_dq_{dtype}_d{}", tile.d),
            (s.sq.div_ceil(tile.q_bm), s.h, s.b),
            BwdTile::THREADS,
            tile.q_smem_bytes(),
            &params,
        )?;
    }
    Ok(CudaStorage::wrap_cuda_slice(grads, dev))
}
