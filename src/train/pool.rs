//! Keeping freed device memory in CUDA's stream-ordered pool between training steps.
//!
//! Candle allocates with `cuMemAllocAsync` from the device's default memory pool, whose
//! release threshold is 0: at every synchronisation (a loss read to the host, a gradient
//! norm) the pool hands all freed memory back to the driver, and the next step maps it again.
//! In a training step that frees and re-allocates gigabytes, that costs 10-20 ms per step on an
//! H100 (the LLaMA-150M step of docs/archive/PERF.md). PyTorch's caching allocator keeps what it
//! freed; this does the same for the pool.

use candle::{Device, Result};

/// Lets the default memory pool of `dev` keep the memory freed into it (release threshold
/// `u64::MAX`) instead of returning it to the driver at each synchronisation. The memory stays
/// reserved by the process until it exits (other processes on the GPU see it as used). A
/// no-op on the CPU. Process-wide for that device: every later allocation on it benefits.
pub fn retain_freed_device_memory(dev: &Device) -> Result<()> {
    match dev {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => {
            use candle::cuda_backend::cudarc::driver::sys;
            use candle::cuda_backend::WrapErr;
            let ctx = d.cuda_stream().context().clone();
            ctx.bind_to_thread().w()?;
            let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
            // SAFETY: plain driver calls on the context's device, with valid out-pointers.
            unsafe {
                sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
                    .result()
                    .w()?;
                let mut threshold = u64::MAX;
                sys::cuMemPoolSetAttribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    &mut threshold as *mut u64 as *mut std::ffi::c_void,
                )
                .result()
                .w()?;
            }
            Ok(())
        }
        _ => Ok(()),
    }
}
