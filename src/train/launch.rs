//! Launching the kernels of `cuda/train/train.cu` (by the names `super::kernels` finds): raw
//! device pointers of contiguous storages (their start offsets applied), fresh outputs, and
//! one launch per call with a 1-D grid.

use std::sync::Arc;

use candle::backend::BackendStorage;
use candle::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, PushKernelArg, SyncOnDrop,
    ValidAsZeroBits,
};
use candle::cuda_backend::{CudaDType, CudaStorageSlice, WrapErr};
use candle::{bail, CudaDevice, CudaStorage, DType, Layout, Result};
use half::{bf16, f16};

use crate::cuda::Source;

/// The device address of element `start` of a storage, with the guard that orders the
/// stream's use of it (keep it alive until the launch is queued).
fn addr<'a, T: DeviceRepr>(
    x: &'a CudaSlice<T>,
    start: usize,
    stream: &'a Arc<CudaStream>,
) -> (u64, SyncOnDrop<'a>) {
    let (p, sync) = x.device_ptr(stream);
    (p + (start * std::mem::size_of::<T>()) as u64, sync)
}

/// The device address of a slice's first element, with its guard (as [`ptr`]).
pub(super) fn slice_ptr<'a, T: DeviceRepr>(
    x: &'a CudaSlice<T>,
    stream: &'a Arc<CudaStream>,
) -> (u64, SyncOnDrop<'a>) {
    addr(x, 0, stream)
}

/// The device address of a contiguous storage's first element (its layout's start offset
/// applied), for reading.
pub(crate) fn ptr<'a>(
    s: &'a CudaStorage,
    l: &Layout,
    stream: &'a Arc<CudaStream>,
) -> Result<(u64, SyncOnDrop<'a>)> {
    let start = l.start_offset();
    Ok(match &s.slice {
        CudaStorageSlice::BF16(x) => addr(x, start, stream),
        CudaStorageSlice::F16(x) => addr(x, start, stream),
        CudaStorageSlice::F32(x) => addr(x, start, stream),
        CudaStorageSlice::U32(x) => addr(x, start, stream),
        _ => bail!("train: unsupported storage dtype {:?}", s.dtype()),
    })
}

/// The same for writing: a fresh output (`start` 0) or an in-place operand (its layout's
/// start offset).
pub(crate) fn ptr_mut<'a>(
    s: &'a mut CudaStorage,
    start: usize,
    stream: &'a Arc<CudaStream>,
) -> Result<(u64, SyncOnDrop<'a>)> {
    fn at<'a, T: DeviceRepr>(
        x: &'a mut CudaSlice<T>,
        start: usize,
        stream: &'a Arc<CudaStream>,
    ) -> (u64, SyncOnDrop<'a>) {
        let (p, sync) = x.device_ptr_mut(stream);
        (p + (start * std::mem::size_of::<T>()) as u64, sync)
    }
    let dtype = s.dtype();
    Ok(match &mut s.slice {
        CudaStorageSlice::BF16(x) => at(x, start, stream),
        CudaStorageSlice::F16(x) => at(x, start, stream),
        CudaStorageSlice::F32(x) => at(x, start, stream),
        CudaStorageSlice::U32(x) => at(x, start, stream),
        _ => bail!("train: unsupported output dtype {dtype:?}"),
    })
}

/// A fresh device buffer of `n` elements of `dtype`: zeroed when `zero` (the kernel adds into
/// it), otherwise filled with NaN under `CANDLE_FLASH_POISON=1` like the attention's outputs,
/// so that an element a kernel fails to write shows in the tests.
pub(crate) fn alloc(dev: &CudaDevice, dtype: DType, n: usize, zero: bool) -> Result<CudaStorage> {
    // Inside graph::CapturedGraph::capture, a root of the graph (see `unchained`).
    crate::graph::unchained(&dev.cuda_stream(), || alloc_as(dev, dtype, n, zero))
}

fn alloc_as(dev: &CudaDevice, dtype: DType, n: usize, zero: bool) -> Result<CudaStorage> {
    fn make<T: CudaDType + DeviceRepr + ValidAsZeroBits>(
        dev: &CudaDevice,
        n: usize,
        zero: bool,
    ) -> Result<CudaStorage> {
        let s = if zero {
            dev.alloc_zeros::<T>(n)?
        } else {
            // SAFETY: every element is written by the kernel the buffer is made for.
            let mut s = unsafe { dev.alloc::<T>(n)? };
            crate::cuda::poison(&dev.cuda_stream(), &mut s)?;
            s
        };
        Ok(T::wrap_cuda_slice(s, dev.clone()))
    }
    match dtype {
        DType::BF16 => make::<bf16>(dev, n.max(1), zero),
        DType::F16 => make::<f16>(dev, n.max(1), zero),
        DType::F32 => make::<f32>(dev, n.max(1), zero),
        DType::U32 => make::<u32>(dev, n.max(1), zero),
        dt => bail!("train: cannot allocate dtype {dt:?}"),
    }
}

/// One kernel argument: a device address or a scalar.
#[derive(Clone, Copy)]
pub(crate) enum Arg {
    Ptr(u64),
    I64(i64),
    I32(i32),
    F32(f32),
}

/// [`launch`] programmatically on Hopper (`crate::cuda::launch_args_programmatic`): for the
/// kernels that call `pdl_wait` before they read what the kernel ahead of them writes or
/// write anything, so that their dispatch overlaps that kernel's last blocks.
pub(crate) fn launch_programmatic(
    dev: &CudaDevice,
    name: &str,
    blocks: usize,
    threads: u32,
    smem: u32,
    args: &[Arg],
) -> Result<()> {
    // Fixed arrays, not vectors: this runs several times a layer in a decoding step.
    const MAX_ARGS: usize = 16;
    if args.len() > MAX_ARGS {
        bail!(
            "train: {name} takes {} arguments, more than {MAX_ARGS}",
            args.len()
        )
    }
    let mut values = [Arg::I32(0); MAX_ARGS];
    values[..args.len()].copy_from_slice(args);
    let mut ptrs = [std::ptr::null_mut::<std::ffi::c_void>(); MAX_ARGS];
    for (p, a) in ptrs.iter_mut().zip(values.iter_mut()) {
        *p = match a {
            Arg::Ptr(p) => p as *mut u64 as *mut std::ffi::c_void,
            Arg::I64(x) => x as *mut i64 as *mut std::ffi::c_void,
            Arg::I32(x) => x as *mut i32 as *mut std::ffi::c_void,
            Arg::F32(x) => x as *mut f32 as *mut std::ffi::c_void,
        };
    }
    // SAFETY: each pointer points into `values`, alive until the call returns (the driver
    // copies the parameters at launch), holding the kernel's parameter types in order; the
    // callers pass live buffers of the sizes the kernel indexes, as for `launch`.
    unsafe {
        crate::cuda::launch_args_programmatic(
            dev,
            Source::Train,
            name,
            (blocks, 1, 1),
            threads,
            smem,
            &mut ptrs[..args.len()],
        )
    }
}

/// Launches `name` from the training module with `blocks` x `threads` and `args` in order
/// (grid limits, module choice and loading as for the attention kernels: `prepare_launch`).
pub(crate) fn launch(
    dev: &CudaDevice,
    name: &str,
    blocks: usize,
    threads: u32,
    args: &[Arg],
) -> Result<()> {
    launch_grid(dev, name, (blocks, 1, 1), threads, args)
}

/// [`launch`] on a grid of up to three dimensions.
pub(crate) fn launch_grid(
    dev: &CudaDevice,
    name: &str,
    grid: (usize, usize, usize),
    threads: u32,
    args: &[Arg],
) -> Result<()> {
    let Some((func, cfg)) =
        crate::cuda::prepare_launch(dev, Source::Train, name, grid, threads, 0)?
    else {
        return Ok(());
    };
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
    // SAFETY: the callers pass the addresses of live, contiguous buffers of the sizes the
    // kernel indexes (checked by the ops' validation) and scalars of the kernel's types.
    unsafe { builder.launch(cfg) }.w()?;
    Ok(())
}

/// Launches `name` from the training module with `blocks` x `threads` and one argument
/// passed by value: a `#[repr(C)]` parameter block, the C struct the kernel takes (whose
/// layout both sides assert), for kernels with more operands than plain arguments carry well.
pub(crate) fn launch_params<P: DeviceRepr>(
    dev: &CudaDevice,
    name: &str,
    blocks: usize,
    threads: u32,
    params: &P,
) -> Result<()> {
    let Some((func, cfg)) =
        crate::cuda::prepare_launch(dev, Source::Train, name, (blocks, 1, 1), threads, 0)?
    else {
        return Ok(());
    };
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&func);
    builder.arg(params);
    // SAFETY: `P` is the kernel's parameter block (same layout, asserted on both sides) and
    // holds the addresses of live buffers of the sizes and strides the kernel indexes.
    unsafe { builder.launch(cfg) }.w()?;
    Ok(())
}

/// Blocks of `threads` for a grid-stride loop over `n` elements: at most 16 per SM (the loops
/// cover the rest).
pub(crate) fn stride_blocks(dev: &CudaDevice, n: usize, threads: u32) -> Result<usize> {
    Ok(n.div_ceil(threads as usize)
        .clamp(1, max_stride_blocks(dev)?))
}

/// The most blocks [`stride_blocks`] gives on `dev`.
pub(crate) fn max_stride_blocks(dev: &CudaDevice) -> Result<usize> {
    Ok(stride_cap(crate::cuda::device_facts(dev)?.sms))
}

/// [`max_stride_blocks`] on a device of `sms` multiprocessors.
pub(crate) fn stride_cap(sms: usize) -> usize {
    sms * 16
}

/// Loads `name` (and its module) on `dev` ahead of its launches, so that they cannot fail
/// for that reason later.
pub(super) fn preload(dev: &CudaDevice, name: &str) -> Result<()> {
    crate::cuda::prepare_launch(dev, Source::Train, name, (1, 1, 1), 256, 0).map(|_| ())
}
