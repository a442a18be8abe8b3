//! What the bench asks of the device (addresses, name, copy bandwidth); stubs without `cuda`.

#[allow(unused_imports)]
use super::*;

/// The device address of `t`'s first element, for `CANDLE_FLASH_BENCH_ADDRS=1` (None on the
/// CPU or without the cuda feature).
#[cfg(feature = "cuda")]
pub(crate) fn device_addr(t: &Tensor) -> Option<u64> {
    use candle::cuda_backend::cudarc::driver::DevicePtr;
    use candle::Storage;
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else {
        return None;
    };
    let stream = cs.device.cuda_stream();
    let elem = t.dtype().size_in_bytes() as u64;
    let base = match t.dtype() {
        DType::BF16 => cs.as_cuda_slice::<half::bf16>().ok()?.device_ptr(&stream).0,
        DType::F16 => cs.as_cuda_slice::<half::f16>().ok()?.device_ptr(&stream).0,
        DType::F32 => cs.as_cuda_slice::<f32>().ok()?.device_ptr(&stream).0,
        _ => return None,
    };
    Some(base + layout.start_offset() as u64 * elem)
}

#[cfg(not(feature = "cuda"))]
pub(crate) fn device_addr(_: &Tensor) -> Option<u64> {
    None
}

#[cfg(feature = "cuda")]
pub(crate) fn gpu_name(dev: &Device) -> Option<String> {
    let Device::Cuda(d) = dev else { return None };
    d.cuda_stream().context().name().ok()
}

#[cfg(not(feature = "cuda"))]
pub(crate) fn gpu_name(_: &Device) -> Option<String> {
    None
}

/// Times `cuMemcpyDtoDAsync` of `COPY_ELEMS` 2-byte elements into a second buffer.
#[cfg(feature = "cuda")]
pub(crate) fn memcpy_timing(dev: &Device) -> Result<Timed> {
    let stream = dev.as_cuda_device()?.cuda_stream();
    let src = stream
        .alloc_zeros::<u16>(COPY_ELEMS)
        .map_err(candle::Error::wrap)?;
    let mut dst = stream
        .alloc_zeros::<u16>(COPY_ELEMS)
        .map_err(candle::Error::wrap)?;
    time_ms_with(dev, PREFILL_TIMING, |_| {
        stream
            .memcpy_dtod(&src, &mut dst)
            .map_err(candle::Error::wrap)
    })
}

#[cfg(not(feature = "cuda"))]
pub(crate) fn memcpy_timing(_dev: &Device) -> Result<Timed> {
    candle::bail!("the copy bandwidth needs the cuda feature")
}
