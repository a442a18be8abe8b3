//! FP8 (e4m3) KV caches: the checks that let a call's caches be `DType::F8E4M3` while q and
//! the new rows stay in q's dtype, and those of the per-head scales that go with them
//! ([`crate::FlashAttn::kv_cache_scales`], [`super::KvCache::with_scales`]).

use std::borrow::Cow;

use candle::{bail, DType, Result, Tensor};

use crate::options::{FlashAttn, KvCacheScales};
use crate::params::{self, KvScales};
use crate::quant::{quantize_fp8, Fp8Scaling};

/// Checks the caches' dtype and device against q: both on q's device, of one dtype, which is
/// q's or F8E4M3. Returns whether the caches are FP8. On CUDA an FP8 cache needs a head_dim
/// that is a multiple of 16 (the decode kernel reads e4m3 rows in 16-byte chunks).
pub(super) fn check_cache_dtypes(
    q: &Tensor,
    (k_cache, kn): (&Tensor, &str),
    (v_cache, vn): (&Tensor, &str),
    d: usize,
) -> Result<bool> {
    if k_cache.dtype() != DType::F8E4M3 {
        params::check_like_q(q, k_cache, kn)?;
        if v_cache.dtype() == DType::F8E4M3 {
            bail!(
                "{vn}: dtype F8E4M3 differs from {kn}'s {:?}; both caches share one dtype",
                k_cache.dtype()
            )
        }
        params::check_like_q(q, v_cache, vn)?;
        return Ok(false);
    }
    if v_cache.dtype() != DType::F8E4M3 {
        bail!(
            "{vn}: dtype {:?} differs from {kn}'s F8E4M3; both caches share one dtype",
            v_cache.dtype()
        )
    }
    for (t, name) in [(k_cache, kn), (v_cache, vn)] {
        if !t.device().same_device(q.device()) {
            bail!(
                "{name}: expected the same device as q ({:?}), got {:?}",
                q.device().location(),
                t.device().location()
            )
        }
    }
    if q.device().is_cuda() && !d.is_multiple_of(16) {
        bail!("{kn}: an F8E4M3 cache on CUDA needs head_dim a multiple of 16, got {d}")
    }
    Ok(true)
}

/// The scales of `opts` for caches that are FP8 or not (`fp8`), checked: present exactly
/// when the caches are FP8, each F32 `(hk,)` on q's device; returned contiguous.
pub(super) fn call_scales(
    opts: &FlashAttn,
    fp8: bool,
    q: &Tensor,
    hk: usize,
    kn: &str,
) -> Result<Option<KvScales>> {
    match (&opts.kv_cache_scales, fp8) {
        (None, false) => Ok(None),
        (None, true) => bail!(
            "kv_cache_scales: {kn} is F8E4M3, so the call needs its per-head dequantization \
             scales (FlashAttn::kv_cache_scales(k_scale, v_scale), each F32 ({hk},))"
        ),
        (Some(_), false) => bail!(
            "kv_cache_scales: scales are for F8E4M3 caches, but {kn} is {:?}; leave the option \
             unset",
            q.dtype()
        ),
        (Some(s), true) => Ok(Some(KvScales {
            k: check_scale(&s.k, hk, q, "kv_cache_scales: k")?,
            v: check_scale(&s.v, hk, q, "kv_cache_scales: v")?,
        })),
    }
}

/// Checks one cache's scales: F32 `(hk,)` on `like`'s device. Returns them detached and
/// contiguous (the kernels read them as a plain array).
pub(super) fn check_scale(t: &Tensor, hk: usize, like: &Tensor, name: &str) -> Result<Tensor> {
    if t.dtype() != DType::F32 {
        bail!("{name}: expected dtype F32, got {:?}", t.dtype())
    }
    if t.dims() != [hk] {
        bail!(
            "{name}: expected shape ({hk},) (one scale per KV head), got {:?}",
            t.dims()
        )
    }
    if !t.device().same_device(like.device()) {
        bail!(
            "{name}: expected the caches' device ({:?}), got {:?}",
            like.device().location(),
            t.device().location()
        )
    }
    t.detach().contiguous()
}

/// [`super::KvCache::with_scales`] and its paged twin: `k_scale` and `v_scale` checked for
/// the cache `k` (F8E4M3, `num_heads_k` heads). `what` names the cache type in messages.
pub(super) fn cache_scales(
    k: &Tensor,
    k_scale: &Tensor,
    v_scale: &Tensor,
    what: &str,
) -> Result<KvCacheScales> {
    if k.dtype() != DType::F8E4M3 {
        bail!(
            "{what}::with_scales: scales are for an F8E4M3 cache, this one is {:?}",
            k.dtype()
        )
    }
    let hk = k.dim(2)?;
    Ok(KvCacheScales {
        k: check_scale(k_scale, hk, k, "k_scale")?,
        v: check_scale(v_scale, hk, k, "v_scale")?,
    })
}

/// The options a cache type's call runs with: `opts` and the cache's own scales. The scales
/// live with the cache, so `opts` must carry none; an FP8 cache must hold them.
pub(super) fn cache_opts<'a>(
    opts: &'a FlashAttn,
    cache: &Tensor,
    scales: Option<&KvCacheScales>,
    what: &str,
) -> Result<Cow<'a, FlashAttn>> {
    if opts.kv_cache_scales.is_some() {
        bail!(
            "kv_cache_scales: {what} keeps its scales itself ({what}::with_scales); leave the \
             option unset"
        )
    }
    match scales {
        Some(s) => Ok(Cow::Owned(FlashAttn {
            kv_cache_scales: Some(s.clone()),
            ..opts.clone()
        })),
        None if cache.dtype() == DType::F8E4M3 => bail!(
            "kv_cache_scales: this {what} is F8E4M3 and holds no scales; set them with \
             {what}::with_scales(k_scale, v_scale) before the first append"
        ),
        None => Ok(Cow::Borrowed(opts)),
    }
}

/// The new rows of a ragged append `(total, num_heads_k, head_dim)` as the cache stores
/// them: quantized per head with its scales when it is FP8 (the bytes the decoding append
/// writes), as given otherwise. Called once the rows are checked.
pub(super) fn cache_rows(
    cache: &Tensor,
    scales: Option<&KvCacheScales>,
    k_new: &Tensor,
    v_new: &Tensor,
    what: &str,
) -> Result<(Tensor, Tensor)> {
    if cache.dtype() != DType::F8E4M3 {
        return Ok((k_new.clone(), v_new.clone()));
    }
    let Some(s) = scales else {
        bail!(
            "{what}: the cache is F8E4M3 and holds no scales; set them with \
             {what}::with_scales(k_scale, v_scale) before the first append"
        )
    };
    let q = |x: &Tensor, scale: &Tensor| -> Result<Tensor> {
        quantize_fp8(&x.unsqueeze(0)?, scale, Fp8Scaling::PerHead)?.squeeze(0)
    };
    Ok((q(k_new, &s.k)?, q(v_new, &s.v)?))
}
