//! CUDA launchers: the `#[repr(C)]` twin of `cuda/params.cuh`, kernel selection per dtype and
//! head dim, and the launches themselves.

use std::sync::Arc;

use candle::backend::BackendStorage;
use candle::cuda_backend::cudarc::driver::result::memset_d8_async;
use candle::cuda_backend::cudarc::driver::sys::{CUdeviceptr, CUfunction_attribute};
use candle::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle::cuda_backend::{CudaDType, WrapErr};
use candle::{bail, CudaStorage, DType, Layout, Result, Tensor};
use half::{bf16, f16};

use crate::params::Problem;
use crate::ptx;

/// Mirror of `struct AttnParams` in `cuda/params.cuh`; same field order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct AttnParams {
    q: CUdeviceptr,
    k: CUdeviceptr,
    v: CUdeviceptr,
    o: CUdeviceptr,
    lse: CUdeviceptr,
    q_batch_stride: i64,
    q_row_stride: i64,
    q_head_stride: i64,
    k_batch_stride: i64,
    k_row_stride: i64,
    k_head_stride: i64,
    v_batch_stride: i64,
    v_row_stride: i64,
    v_head_stride: i64,
    o_batch_stride: i64,
    o_row_stride: i64,
    o_head_stride: i64,
    b: i32,
    h: i32,
    h_k: i32,
    seqlen_q: i32,
    seqlen_k: i32,
    d: i32,
    h_h_k_ratio: i32,
    scale: f32,
    scale_log2: f32,
    window_left: i32,
    window_right: i32,
}

// SAFETY: plain-old-data with the C layout of `AttnParams`, passed by value as a kernel argument.
unsafe impl DeviceRepr for AttnParams {}

/// Forward tile shape for one compiled head dim; mirror of `FwdConfig` in `cuda/traits.cuh`.
#[derive(Clone, Copy, Debug)]
struct FwdTile {
    d: usize,
    bm: usize,
    bn: usize,
    warps: usize,
}

impl FwdTile {
    /// The smallest compiled head dim >= d (d <= 256 was validated).
    fn for_head_dim(d: usize) -> Self {
        let (d, bm, bn, warps) = match d {
            0..=32 => (32, 128, 64, 4),
            33..=64 => (64, 128, 64, 4),
            65..=96 => (96, 128, 32, 4),
            97..=128 => (128, 128, 32, 4),
            129..=160 => (160, 128, 64, 8),
            161..=192 => (192, 128, 64, 8),
            193..=224 => (224, 128, 64, 8),
            _ => (256, 128, 64, 8),
        };
        Self { d, bm, bn, warps }
    }

    fn threads(&self) -> u32 {
        32 * self.warps as u32
    }

    /// Q tile plus one K and one V tile, rows padded by 8 elements (`SMEM_PAD`), 2-byte elements.
    fn smem_bytes(&self) -> u32 {
        ((self.bm + 2 * self.bn) * (self.d + 8) * 2) as u32
    }
}

/// Whether outputs are filled with NaN before each launch, so that elements a kernel fails to
/// write show up in tests (`CANDLE_FLASH_POISON=1`; read once).
fn poison_outputs() -> bool {
    static POISON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *POISON.get_or_init(|| std::env::var("CANDLE_FLASH_POISON").is_ok_and(|v| v == "1"))
}

/// Fills a fresh allocation with 0xFF bytes: NaN in f16, bf16 and f32.
fn poison<T: DeviceRepr>(stream: &Arc<CudaStream>, buf: &mut CudaSlice<T>) -> Result<()> {
    if poison_outputs() {
        let bytes = buf.len() * std::mem::size_of::<T>();
        let (ptr, _sync) = buf.device_ptr_mut(stream);
        // SAFETY: ptr is a live allocation of `bytes` bytes, written in stream order.
        unsafe { memset_d8_async(ptr, 0xff, bytes, stream.cu_stream()) }.w()?;
    }
    Ok(())
}

fn dtype_name(dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F16 => Ok("f16"),
        DType::BF16 => Ok("bf16"),
        dt => bail!("q: dtype {dt:?} is not supported on CUDA, expected F16 or BF16"),
    }
}

/// `(batch, row, head)` strides of a rank-4 layout whose last dim is contiguous.
fn strides3(layout: &Layout) -> [i64; 3] {
    let s = layout.stride();
    [s[0] as i64, s[1] as i64, s[2] as i64]
}

fn to_i32(x: usize, what: &str) -> Result<i32> {
    match i32::try_from(x) {
        Ok(v) => Ok(v),
        Err(_) => bail!("{what}: {x} is larger than the kernels' 32-bit index range"),
    }
}

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
    let tile = FwdTile::for_head_dim(s.d);

    let q_view = q.as_cuda_slice::<T>()?.slice(ql.start_offset()..);
    let k_view = k.as_cuda_slice::<T>()?.slice(kl.start_offset()..);
    let v_view = v.as_cuda_slice::<T>()?.slice(vl.start_offset()..);
    // SAFETY: every element of out and lse is written by the kernel (rows < sq, cols < d).
    let mut out = unsafe { dev.alloc::<T>(s.q_elems())? };
    let mut lse = unsafe { dev.alloc::<f32>(s.b * s.h * s.sq)? };
    poison(&stream, &mut out)?;
    poison(&stream, &mut lse)?;

    let [qb, qr, qh] = strides3(ql);
    let [kb, kr, kh] = strides3(kl);
    let [vb, vr, vh] = strides3(vl);
    {
        let (q_ptr, _q_sync) = q_view.device_ptr(&stream);
        let (k_ptr, _k_sync) = k_view.device_ptr(&stream);
        let (v_ptr, _v_sync) = v_view.device_ptr(&stream);
        let (o_ptr, _o_sync) = out.device_ptr_mut(&stream);
        let (lse_ptr, _lse_sync) = lse.device_ptr_mut(&stream);
        let params = AttnParams {
            q: q_ptr,
            k: k_ptr,
            v: v_ptr,
            o: o_ptr,
            lse: lse_ptr,
            q_batch_stride: qb,
            q_row_stride: qr,
            q_head_stride: qh,
            k_batch_stride: kb,
            k_row_stride: kr,
            k_head_stride: kh,
            v_batch_stride: vb,
            v_row_stride: vr,
            v_head_stride: vh,
            o_batch_stride: (s.sq * s.h * s.d) as i64,
            o_row_stride: (s.h * s.d) as i64,
            o_head_stride: s.d as i64,
            b: to_i32(s.b, "batch")?,
            h: to_i32(s.h, "num_heads")?,
            h_k: to_i32(s.hk, "num_heads_k")?,
            seqlen_q: to_i32(s.sq, "seqlen_q")?,
            seqlen_k: to_i32(s.sk, "seqlen_k")?,
            d: s.d as i32,
            h_h_k_ratio: s.group() as i32,
            scale: problem.scale,
            scale_log2: problem.scale * std::f32::consts::LOG2_E,
            window_left: -1,
            window_right: if problem.causal { 0 } else { -1 },
        };
        let name = format!("flash_fwd_{}_d{}", dtype_name(q.dtype())?, tile.d);
        let func = dev.get_or_load_custom_func(&name, "candle_flash_fwd", ptx::FWD)?;
        let smem = tile.smem_bytes();
        func.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .w()?;
        let m_blocks = s.sq.div_ceil(tile.bm);
        if m_blocks > i32::MAX as usize || s.h > 65535 || s.b > 65535 {
            bail!(
                "q: launch grid ({m_blocks}, {}, {}) exceeds CUDA's limits",
                s.h,
                s.b
            )
        }
        let cfg = LaunchConfig {
            grid_dim: (m_blocks as u32, s.h as u32, s.b as u32),
            block_dim: (tile.threads(), 1, 1),
            shared_mem_bytes: smem,
        };
        let mut launch = func.builder();
        launch.arg(&params);
        // SAFETY: params describe live allocations of the sizes the kernel indexes (checked by
        // `params::validate`); the kernel writes only `out` and `lse`.
        unsafe { launch.launch(cfg) }.w()?;
    }
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev.clone()),
        CudaStorage::wrap_cuda_slice(lse, dev),
    ))
}

/// Backward pass. The CUDA backward kernels are the next milestone; until they land this says
/// so instead of silently computing on another device.
#[allow(clippy::too_many_arguments)]
pub(crate) fn bwd(
    _problem: &Problem,
    _deterministic: bool,
    _q: (&CudaStorage, &Layout),
    _k: (&CudaStorage, &Layout),
    _v: (&CudaStorage, &Layout),
    _out: &Tensor,
    _grad_out: &Tensor,
    _lse: &Tensor,
) -> Result<CudaStorage> {
    bail!("flash-attn: the CUDA backward pass is not implemented yet (use the CPU device for training)")
}
