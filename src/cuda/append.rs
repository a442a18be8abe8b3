//! The KV-cache append launcher: new rows written in place into a contiguous or paged cache
//! (`flash_append` in `cuda/decode/decode.cu`).

use candle::backend::BackendStorage;
use candle::cuda_backend::cudarc::driver::sys::CUdeviceptr;
use candle::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr};
use candle::cuda_backend::CudaDType;
use candle::{bail, CudaStorage, DType, Layout, Result};
use float8::F8E4M3;
use half::{bf16, f16};

use super::abi::strides3;
use super::buffers::{
    device_indices, device_or_upload, device_table, lock_tensor, locked_ptr, paging_args,
    to_device_i32_shared,
};
use super::catalogue::{Family, Kernel};
use super::runtime::Launch;
use crate::params::{AppendProblem, Indices};

/// Mirror of `struct AppendParams` in `cuda/decode/params.cuh`.
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
    pub(super) num_pages: i32,
    pub(super) d: i32,
    pub(super) s_new: i32,
    pub(super) h_k: i32,
    pub(super) new_lens: CUdeviceptr,
    pub(super) rot_cos: CUdeviceptr,
    pub(super) rot_sin: CUdeviceptr,
    pub(super) rot_rows: i32,
    pub(super) rot_half: i32,
    pub(super) rot_interleaved: i32,
    pub(super) s_q: i32,
    pub(super) h: i32,
    pub(super) q_causal: i32,
    pub(super) q: CUdeviceptr,
    pub(super) q_out: CUdeviceptr,
    pub(super) q_batch_stride: i64,
    pub(super) q_row_stride: i64,
    pub(super) q_head_stride: i64,
    pub(super) scale: CUdeviceptr,
}

// SAFETY: as above.
unsafe impl DeviceRepr for AppendParams {}

/// Writes `new` `(b, s_new, hk, d)` into the cache rows `start[b]..` of each sequence, in
/// place. With host starts the caller checked that every row fits (and, paged, that its
/// page is mapped); device starts and tables are clamped by the kernel. With rotary
/// embedding the rows are rotated on the way and the same launch returns the rotated
/// queries `(b, s_q, h, d)`.
pub(crate) fn append(
    problem: &AppendProblem,
    cache: &mut CudaStorage,
    cache_layout: &Layout,
    new: &CudaStorage,
    new_layout: &Layout,
) -> Result<Option<CudaStorage>> {
    let (p, c, cl, n, nl) = (problem, cache, cache_layout, new, new_layout);
    match (c.dtype(), n.dtype()) {
        (DType::F16, DType::F16) => append_typed::<f16, f16>(p, c, cl, n, nl),
        (DType::BF16, DType::BF16) => append_typed::<bf16, bf16>(p, c, cl, n, nl),
        (DType::F8E4M3, DType::F16) => append_typed::<f16, F8E4M3>(p, c, cl, n, nl),
        (DType::F8E4M3, DType::BF16) => append_typed::<bf16, F8E4M3>(p, c, cl, n, nl),
        (DType::F16 | DType::BF16 | DType::F8E4M3, dt) => bail!(
            "k_new: dtype {dt:?} cannot be appended to a {:?} cache on CUDA (expected the \
             cache's dtype, or F16/BF16 for an F8E4M3 cache)",
            c.dtype()
        ),
        (dt, _) => {
            bail!("k_cache: dtype {dt:?} is not supported on CUDA, expected F16, BF16 or F8E4M3")
        }
    }
}

/// `T`: the new rows' (and q's) element; `C`: the cache's, `T` or F8E4M3 (quantized with the
/// problem's scales).
fn append_typed<T: CudaDType + DeviceRepr + 'static, C: CudaDType + DeviceRepr + 'static>(
    problem: &AppendProblem,
    cache: &mut CudaStorage,
    cache_layout: &Layout,
    new: &CudaStorage,
    new_layout: &Layout,
) -> Result<Option<CudaStorage>> {
    let rot = problem.rotary.as_ref();
    let (s_q, h) = rot.map_or((0, 0), |r| (r.s_q, r.h));
    let q_rows = s_q * h;
    if problem.b * (problem.s_new * problem.hk + q_rows) == 0 {
        return Ok(None);
    }
    let dev = cache.device.clone();
    let stream = dev.cuda_stream();
    let dtype = new.dtype();
    let fp8_cache = cache.dtype() == DType::F8E4M3;
    if fp8_cache != problem.quant.is_some() {
        bail!("kv_cache_scales: expected scales exactly when the cache is F8E4M3")
    }
    let start = match &problem.start {
        Indices::Host(start) => Some(to_device_i32_shared(&dev, start)?),
        Indices::Device(_) => None,
    };
    let (block_table, max_pages, page_size, num_pages) = paging_args(&dev, &problem.paging)?;
    let start_lock = lock_tensor(device_indices(&problem.start));
    let new_lens_lock = lock_tensor(problem.new_lens.as_ref().and_then(device_indices));
    let new_lens_host = match &problem.new_lens {
        Some(Indices::Host(lens)) => Some(to_device_i32_shared(&dev, lens)?),
        _ => None,
    };
    let (new_lens_dev, _new_lens_sync) =
        locked_ptr::<u32, _>(&new_lens_lock, &stream, "seqlens_q")?;
    let table_lock = lock_tensor(device_table(&problem.paging));
    let (start_dev, _start_sync) = locked_ptr::<u32, _>(&start_lock, &stream, "cache_seqlens")?;
    let (table_dev, _table_sync) = locked_ptr::<u32, _>(&table_lock, &stream, "block_table")?;
    let [cache_page_stride, cache_row_stride, cache_head_stride] = strides3(cache_layout);
    let [src_batch_stride, src_row_stride, src_head_stride] = strides3(new_layout);
    let new_view = new.as_cuda_slice::<T>()?.slice(new_layout.start_offset()..);
    let mut cache_view = cache
        .as_cuda_slice_mut::<C>()?
        .slice_mut(cache_layout.start_offset()..);
    let mut syncs = vec![];
    let (cache_ptr, cache_sync) = cache_view.device_ptr_mut(&stream);
    let (src_ptr, src_sync) = new_view.device_ptr(&stream);
    // SAFETY: the launch writes every element of every query row (q_rows > 0).
    // Inside graph::CapturedGraph::capture, a root of the graph (see `unchained`).
    let mut q_out = match q_rows {
        0 => None,
        n => Some(crate::graph::unchained(&stream, || unsafe {
            dev.alloc::<T>(problem.b * n * problem.d)
        })?),
    };
    let scale_lock = lock_tensor(problem.quant.as_ref().map(|s| &s.0));
    let (scale_ptr, _scale_sync) = locked_ptr::<f32, _>(&scale_lock, &stream, "kv_cache_scales")?;
    let rot_locks = [
        lock_tensor(rot.map(|r| &r.cos)),
        lock_tensor(rot.map(|r| &r.sin)),
        lock_tensor(rot.map(|r| &r.q)),
    ];
    let (cos_ptr, _cos_sync) = locked_ptr::<f32, _>(&rot_locks[0], &stream, "rotary cos")?;
    let (sin_ptr, _sin_sync) = locked_ptr::<f32, _>(&rot_locks[1], &stream, "rotary sin")?;
    let (q_ptr, _q_sync) = locked_ptr::<T, _>(&rot_locks[2], &stream, "q")?;
    let (q_out_ptr, q_out_sync) = match &mut q_out {
        Some(q) => {
            let (ptr, sync) = q.device_ptr_mut(&stream);
            (ptr, Some(sync))
        }
        None => (0, None),
    };
    let [q_batch_stride, q_row_stride, q_head_stride] = match &rot_locks[2] {
        Some((_, layout)) => strides3(layout),
        None => [0; 3],
    };
    let params = AppendParams {
        cache: cache_ptr,
        src: src_ptr,
        cache_page_stride,
        cache_row_stride,
        cache_head_stride,
        src_batch_stride,
        src_row_stride,
        src_head_stride,
        start: device_or_upload(start_dev, start.as_deref(), &stream, &mut syncs),
        block_table: device_or_upload(table_dev, block_table.as_deref(), &stream, &mut syncs),
        max_pages,
        page_size,
        num_pages,
        d: problem.d as i32,
        s_new: problem.s_new as i32,
        h_k: problem.hk as i32,
        new_lens: device_or_upload(new_lens_dev, new_lens_host.as_deref(), &stream, &mut syncs),
        rot_cos: cos_ptr,
        rot_sin: sin_ptr,
        rot_rows: rot.map_or(0, |r| r.cos.dim(0).unwrap_or(0) as i32),
        rot_half: rot.map_or(0, |r| r.rot_half as i32),
        rot_interleaved: rot.is_some_and(|r| r.interleaved) as i32,
        s_q: s_q as i32,
        h: h as i32,
        q_causal: rot.is_some_and(|r| r.q_causal) as i32,
        q: if q_rows > 0 { q_ptr } else { 0 },
        q_out: q_out_ptr,
        q_batch_stride,
        q_row_stride,
        q_head_stride,
        scale: scale_ptr,
    };
    // One thread per 8 columns of a row, whole warps.
    let threads = problem.d.div_ceil(8).next_multiple_of(32) as u32;
    let Some(kernel) = Kernel::of(Family::Append, 0, |v| v.fp8 == fp8_cache) else {
        bail!("kv-cache append: no append kernel")
    };
    let heads = problem.hk + if q_rows > 0 { h } else { 0 };
    // Programmatically: a decoding step's append follows the projection that wrote its rows,
    // and inside a captured graph the kernels stay joined programmatically (crate::graph).
    Launch::new(kernel, dtype, (problem.s_new.max(s_q), heads, problem.b))
        .threads(threads)
        .run_programmatic(&dev, &params)?;
    drop((cache_sync, src_sync, syncs, q_out_sync));
    Ok(q_out.map(|q| CudaStorage::wrap_cuda_slice(q, dev)))
}
