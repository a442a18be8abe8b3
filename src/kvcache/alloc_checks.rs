//! The sizes, dtype and device given to the cache constructors, checked before anything is
//! allocated.

use candle::{bail, DType, Device, Result};

use crate::params;

/// Checks a cache size given to a constructor.
pub(super) fn check_fits_u32(value: usize, name: &str) -> Result<()> {
    if u32::try_from(value).is_err() {
        bail!("{name}: {value} tokens do not fit the u32 sequence lengths")
    }
    Ok(())
}

/// What a constructor is given, checked as the first call would check it: the cache
/// `(outer, rows, num_heads_k, head_dim)` of `dtype` (q's, or F8E4M3) on `device` (rows:
/// capacity or page size). Absurd sizes are an error here rather than an aborted allocation.
pub(super) fn check_cache_args(
    dims: [(usize, &str); 4],
    dtype: DType,
    device: &Device,
) -> Result<()> {
    let [_, _, (hk, _), (d, _)] = dims;
    if hk == 0 {
        bail!("num_heads_k: must be > 0")
    }
    params::check_head_dim(device, d, "head_dim:")?;
    if dtype == DType::F8E4M3 {
        // The FP8 cache's own rule (see FlashAttn::kv_cache_scales): q stays in its dtype.
        if device.is_cuda() && !d.is_multiple_of(16) {
            bail!("head_dim: an F8E4M3 cache on CUDA needs head_dim a multiple of 16, got {d}")
        }
    } else {
        params::check_dtype(device, dtype, "dtype:")?;
    }
    // Both caches at once, tried on the CPU before candle's allocation (which aborts).
    let sizes = dims.map(|(n, _)| n);
    let names = dims.map(|(_, name)| name).join(" x ");
    params::alloc_elems_on(&sizes, 2 * dtype.size_in_bytes(), &names, device)?;
    Ok(())
}
