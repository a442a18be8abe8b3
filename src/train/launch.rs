//! Launching the kernels of `cuda/train.cu`: raw device pointers of contiguous storages (their
//! start offsets applied), fresh outputs, and one launch per call with a 1-D grid.

use std::sync::Arc;

use candle::backend::BackendStorage;
use candle::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
    SyncOnDrop,
};
use candle::cuda_backend::{CudaDType, CudaStorageSlice, WrapErr};
use candle::{bail, CudaDevice, CudaStorage, DType, Layout, Result};
use half::{bf16, f16};

/// `bf16`, `f16` or `f32`: the suffix of a kernel instantiated for that dtype.
pub(super) fn suffix(dtype: DType, what: &str) -> Result<&'static str> {
    Ok(match dtype {
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        DType::F32 => "f32",
        dt => bail!("{what}: dtype {dt:?} is not supported, expected BF16, F16 or F32"),
    })
}

/// The device address of a contiguous storage's first element, with the guard that orders
/// the stream's use of it (keep it alive until the launch is queued).
pub(super) fn ptr<'a>(
    s: &'a CudaStorage,
    l: &Layout,
    stream: &'a Arc<CudaStream>,
) -> Result<(u64, SyncOnDrop<'a>)> {
    fn at<'a, T: DeviceRepr>(
        x: &'a CudaSlice<T>,
        off: usize,
        stream: &'a Arc<CudaStream>,
    ) -> (u64, SyncOnDrop<'a>) {
        let (p, sync) = x.device_ptr(stream);
        (p + (off * std::mem::size_of::<T>()) as u64, sync)
    }
    let off = l.start_offset();
    Ok(match &s.slice {
        CudaStorageSlice::BF16(x) => at(x, off, stream),
        CudaStorageSlice::F16(x) => at(x, off, stream),
        CudaStorageSlice::F32(x) => at(x, off, stream),
        CudaStorageSlice::U32(x) => at(x, off, stream),
        _ => bail!("train: unsupported storage dtype {:?}", s.dtype()),
    })
}

/// A fresh device buffer of `n` elements of `dtype`, zeroed when `zero`.
pub(super) fn alloc(dev: &CudaDevice, dtype: DType, n: usize, zero: bool) -> Result<CudaStorage> {
    fn make<T: CudaDType + DeviceRepr + candle::cuda_backend::cudarc::driver::ValidAsZeroBits>(
        dev: &CudaDevice,
        n: usize,
        zero: bool,
    ) -> Result<CudaStorage> {
        let s = if zero {
            dev.alloc_zeros::<T>(n)?
        } else {
            // SAFETY: every element is written by the kernel the buffer is made for.
            unsafe { dev.alloc::<T>(n)? }
        };
        Ok(T::wrap_cuda_slice(s, dev.clone()))
    }
    match dtype {
        DType::BF16 => make::<bf16>(dev, n.max(1), zero),
        DType::F16 => make::<f16>(dev, n.max(1), zero),
        DType::F32 => make::<f32>(dev, n.max(1), zero),
        dt => bail!("train: cannot allocate dtype {dt:?}"),
    }
}

/// The device address of a fresh output.
pub(super) fn ptr_mut<'a>(
    s: &'a mut CudaStorage,
    stream: &'a Arc<CudaStream>,
) -> Result<(u64, SyncOnDrop<'a>)> {
    let dtype = s.dtype();
    Ok(match &mut s.slice {
        CudaStorageSlice::BF16(x) => x.device_ptr_mut(stream),
        CudaStorageSlice::F16(x) => x.device_ptr_mut(stream),
        CudaStorageSlice::F32(x) => x.device_ptr_mut(stream),
        _ => bail!("train: unsupported output dtype {dtype:?}"),
    })
}

/// One kernel argument: a device address or a scalar.
#[derive(Clone, Copy)]
pub(super) enum Arg {
    Ptr(u64),
    I64(i64),
    I32(i32),
    F32(f32),
}

/// Launches `name` from the training module with `blocks` x `threads` and `args` in order.
pub(super) fn launch(
    dev: &CudaDevice,
    name: &str,
    blocks: usize,
    threads: u32,
    args: &[Arg],
) -> Result<()> {
    if blocks == 0 {
        return Ok(());
    }
    if blocks > i32::MAX as usize {
        bail!("{name}: {blocks} blocks exceed CUDA's grid limit")
    }
    let func = crate::cuda::load_func(dev, name, crate::cuda::PtxFile::Train)?;
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&func);
    for a in args {
        match a {
            Arg::Ptr(p) => builder.arg(p),
            Arg::I64(x) => builder.arg(x),
            Arg::I32(x) => builder.arg(x),
            Arg::F32(x) => builder.arg(x),
        };
    }
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the callers pass the addresses of live, contiguous buffers of the sizes the
    // kernel indexes (checked by the ops' validation) and scalars of the kernel's types.
    unsafe { builder.launch(cfg) }.w()?;
    Ok(())
}

/// Blocks of `threads` for a grid-stride loop over `n` elements (at most ~16 waves of an
/// H100's 132 SMs; the loops cover the rest).
pub(super) fn stride_blocks(n: usize, threads: u32) -> usize {
    n.div_ceil(threads as usize).clamp(1, 132 * 16)
}
