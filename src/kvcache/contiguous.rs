//! [`KvCache`]: a preallocated contiguous cache of one layer and its per-sequence lengths.

use candle::{bail, DType, Device, Result, Tensor};

use super::alloc_checks::{check_cache_args, check_fits_u32};
use super::args::HostOrDevice;
use super::call::{CacheKind, Call};
use super::fp8;
use crate::options::{FlashAttn, KvCacheScales};
use crate::params;

/// The KV cache of one attention layer: preallocated keys and values for `batch` sequences of
/// up to `capacity` tokens, and the length of each sequence (on the host).
///
/// ```
/// # fn main() -> candle::Result<()> {
/// use candle::{DType, Device, Tensor};
/// use candle_flash::{FlashAttn, KvCache};
/// let dev = Device::Cpu;
/// let (b, h, hk, d) = (2, 8, 2, 32);
/// let mut cache = KvCache::new(b, 128, hk, d, DType::F32, &dev)?;
/// let opts = FlashAttn::new().causal(true);
/// // prefill a 10-token prompt, then decode token by token
/// for s in [10, 1, 1, 1] {
///     let q = Tensor::randn(0f32, 1.0, (b, s, h, d), &dev)?;
///     let k = Tensor::randn(0f32, 1.0, (b, s, hk, d), &dev)?;
///     let v = Tensor::randn(0f32, 1.0, (b, s, hk, d), &dev)?;
///     let out = cache.append_and_attend(&q, &k, &v, &opts)?; // (b, s, h, d)
///     assert_eq!(out.dims(), &[b, s, h, d]);
/// }
/// assert_eq!(cache.lengths(), &[13, 13]);
/// cache.reset_sequence(1)?; // sequence 1 starts a new request
/// assert_eq!(cache.lengths(), &[13, 0]);
/// # Ok(()) }
/// ```
///
/// An FP8 cache (`DType::F8E4M3`) halves the memory of a bf16 one: give it per-head scales
/// with [`KvCache::with_scales`] (for instance [`crate::quant::fp8_scales`] of the prompt's
/// keys and values with [`crate::quant::Fp8Scaling::PerHead`]); q and the new rows stay in
/// their dtype and are quantized as they are appended.
///
/// ```
/// # fn main() -> candle::Result<()> {
/// use candle::{DType, Device, Tensor};
/// use candle_flash::quant::{fp8_scales, Fp8Scaling};
/// use candle_flash::{FlashAttn, KvCache};
/// let dev = Device::Cpu;
/// let (b, h, hk, d) = (1, 4, 2, 32);
/// let (k, v) = (
///     Tensor::randn(0f32, 1.0, (b, 8, hk, d), &dev)?,
///     Tensor::randn(0f32, 1.0, (b, 8, hk, d), &dev)?,
/// );
/// let (k_scale, v_scale) = (fp8_scales(&k, Fp8Scaling::PerHead)?, fp8_scales(&v, Fp8Scaling::PerHead)?);
/// let mut cache = KvCache::new(b, 64, hk, d, DType::F8E4M3, &dev)?.with_scales(k_scale, v_scale)?;
/// let q = Tensor::randn(0f32, 1.0, (b, 8, h, d), &dev)?;
/// let out = cache.append_and_attend(&q, &k, &v, &FlashAttn::new().causal(true))?;
/// assert_eq!(out.dtype(), DType::F32);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct KvCache {
    pub(super) k: Tensor,
    pub(super) v: Tensor,
    pub(super) lengths: Vec<u32>,
    /// An FP8 cache's per-head scales ([`KvCache::with_scales`]).
    pub(super) scales: Option<KvCacheScales>,
}

impl KvCache {
    /// A zero-filled cache `(batch, capacity, num_heads_k, head_dim)` of `dtype` on `device`
    /// (f16/bf16 on CUDA; f32/f16/bf16 on the CPU; F8E4M3 on both, which then needs
    /// [`KvCache::with_scales`]), every sequence empty.
    ///
    /// Errors: a `capacity` that does not fit u32, a `batch` past i32, an F8E4M3 cache on
    /// CUDA whose head_dim is not a multiple of 16, and allocation errors.
    pub fn new(
        batch: usize,
        capacity: usize,
        num_heads_k: usize,
        head_dim: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        params::check_batch(batch)?;
        params::alloc_elems(&[batch], 4, "lengths")?;
        check_fits_u32(capacity, "capacity")?;
        check_cache_args(
            [
                (batch, "batch"),
                (capacity, "capacity"),
                (num_heads_k, "num_heads_k"),
                (head_dim, "head_dim"),
            ],
            dtype,
            device,
        )?;
        let shape = (batch, capacity, num_heads_k, head_dim);
        Ok(Self {
            k: Tensor::zeros(shape, dtype, device)?,
            v: Tensor::zeros(shape, dtype, device)?,
            lengths: vec![0; batch],
            scales: None,
        })
    }

    /// Gives an F8E4M3 cache its per-head dequantization scales, each F32
    /// `(num_heads_k,)` on the cache's device (see [`FlashAttn::kv_cache_scales`] for what
    /// they mean): appends divide the new rows by them, the attention multiplies the cached
    /// bytes by them. Set them before the first append; new scales reinterpret what the cache
    /// already holds. The tensors are kept as they are (contiguous ones are not copied), so
    /// values written into them in place (a calibration after the prompt) reach later calls,
    /// also those replayed from a captured CUDA graph.
    ///
    /// Errors: a cache that is not F8E4M3; scales of another dtype, shape or device.
    pub fn with_scales(mut self, k_scale: Tensor, v_scale: Tensor) -> Result<Self> {
        self.scales = Some(fp8::cache_scales(&self.k, &k_scale, &v_scale, "KvCache")?);
        Ok(self)
    }

    /// The K and V scales of an FP8 cache ([`KvCache::with_scales`]); `None` otherwise.
    pub fn scales(&self) -> Option<(&Tensor, &Tensor)> {
        self.scales.as_ref().map(|s| (&s.k, &s.v))
    }

    /// Appends `k_new`, `v_new` `(batch, seqlen_new, num_heads_k, head_dim)` to every
    /// sequence, then returns the attention of `q` `(batch, seqlen_q, num_heads, head_dim)`
    /// over each sequence's tokens, old and new: [`flash_attn_with_kvcache`] with this
    /// cache's lengths, which then grow by `seqlen_new`. `seqlen_q` may differ from
    /// `seqlen_new`; a `q` with `seqlen_q = 0` only appends (and returns an empty tensor).
    ///
    /// An FP8 cache quantizes `k_new`, `v_new` (q's dtype) with its scales and attends with
    /// them; `opts.kv_cache_scales` must be unset (the cache has its own).
    ///
    /// Errors: those of [`flash_attn_with_kvcache`], notably `cache_seqlens` when a sequence
    /// would exceed the capacity; `kv_cache_scales` set in `opts`, or an FP8 cache without
    /// scales. On error nothing is written and the lengths are unchanged.
    ///
    /// [`flash_attn_with_kvcache`]: super::flash_attn_with_kvcache
    pub fn append_and_attend(
        &mut self,
        q: &Tensor,
        k_new: &Tensor,
        v_new: &Tensor,
        opts: &FlashAttn,
    ) -> Result<Tensor> {
        let opts = &*fp8::cache_opts(opts, &self.k, self.scales.as_ref(), "KvCache")?;
        let new_kv = Some((k_new, v_new));
        let kind = CacheKind::Contiguous;
        let lens = HostOrDevice::Host(&self.lengths);
        let call = Call::new(q, &self.k, &self.v, new_kv, lens, kind, opts, false, None)?;
        let lengths = call.lengths()?.to_vec();
        // Committed only once the attention ran: after a failed launch the rows written past
        // the old lengths are never read, and a retry writes them again.
        let (out, _) = call.run(q, &self.k, &self.v)?;
        self.lengths = lengths;
        Ok(out)
    }

    /// Tokens held by each sequence.
    pub fn lengths(&self) -> &[u32] {
        &self.lengths
    }

    /// Tokens each sequence can hold.
    pub fn capacity(&self) -> usize {
        self.k.dim(1).unwrap_or(0)
    }

    /// Empties every sequence (the memory is kept, not cleared: rows past a sequence's
    /// length are never read).
    pub fn reset(&mut self) {
        self.lengths.fill(0);
    }

    /// Empties sequence `b`, for instance when its request finished and a new one takes its
    /// slot. Errors: `b` out of range.
    pub fn reset_sequence(&mut self, b: usize) -> Result<()> {
        match self.lengths.get_mut(b) {
            Some(len) => *len = 0,
            None => bail!(
                "reset_sequence: sequence {b} is out of range for a batch of {}",
                self.lengths.len()
            ),
        }
        Ok(())
    }

    /// The keys, `(batch, capacity, num_heads_k, head_dim)`; sequence `b` owns rows
    /// `0..lengths()[b]`.
    pub fn k(&self) -> &Tensor {
        &self.k
    }

    /// The values, shaped like [`KvCache::k`].
    pub fn v(&self) -> &Tensor {
        &self.v
    }
}
