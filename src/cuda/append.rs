//! The KV-cache append launcher: new rows written in place into a contiguous or paged cache
//! (`flash_append` in `cuda/decode/decode.cu`).

use candle::backend::BackendStorage;
use candle::cuda_backend::cudarc::driver::sys::CUdeviceptr;
use candle::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr};
use candle::cuda_backend::CudaDType;
use candle::{bail, CudaStorage, DType, Layout, Result};
use half::{bf16, f16};

use super::abi::strides3;
use super::buffers::{device_ptr_opt, paging_args, to_device_i32_shared};
use super::catalogue::{Family, Kernel};
use super::runtime::Launch;
use crate::params::AppendProblem;

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
    let dtype = cache.dtype();
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
    // One thread per 8 columns of a row, whole warps.
    let threads = problem.d.div_ceil(8).next_multiple_of(32) as u32;
    let Some(kernel) = Kernel::of(Family::Append, 0, |_| true) else {
        bail!("kv-cache append: no append kernel")
    };
    Launch::new(kernel, dtype, (problem.s_new, problem.hk, problem.b))
        .threads(threads)
        .run(&dev, &params)?;
    drop((cache_sync, src_sync, syncs));
    Ok(())
}
