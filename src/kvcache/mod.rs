//! KV-cache decoding: token-by-token generation, where a few query tokens per sequence attend
//! to a long, growing cache of keys and values.
//!
//! - [`flash_attn_with_kvcache`]: a preallocated `(batch, capacity, num_heads_k, head_dim)`
//!   cache; new keys and values are appended in place, then the queries attend to each
//!   sequence's prefix.
//! - [`flash_attn_with_paged_kvcache`]: the same over a vLLM-style paged cache
//!   `(num_pages, page_size, num_heads_k, head_dim)` and a block table.
//! - [`flash_attn_with_kvcache_cascade`]: sequences sharing a prompt attend to it once for
//!   the whole batch (cascade attention), to their own caches apart.
//! - [`KvCache`] and [`PagedKvCache`]: the cache of one layer with its per-sequence lengths,
//!   for model authors (append + attend in one call, reset, a clear error on overflow).
//!
//! Lengths and block tables come from the host (`&[u32]`: every bound is checked before
//! anything is written, without a device synchronisation) or from U32 tensors on the device
//! ([`CacheSeqlens`], [`BlockTable`]: nothing is uploaded or synchronised, so a decoding step
//! can be captured in a CUDA graph). Decoding is inference only: the result carries no
//! gradient (a backward pass through it is Candle's "no backward" error).

use candle::{Result, Tensor};

use crate::options::FlashAttn;

mod alloc_checks;
mod append_varlen;
mod args;
mod call;
mod cascade;
mod contiguous;
mod fp8;
mod paged;
mod rotary;

pub use args::{BlockTable, CacheSeqlens, HostOrDevice};
use call::{CacheKind, Call};
pub use cascade::flash_attn_with_kvcache_cascade;
pub use contiguous::KvCache;
pub use paged::PagedKvCache;

/// Attention of a few new query tokens per sequence over a preallocated KV cache, appending
/// the new keys and values first (FlashAttention's `flash_attn_with_kvcache`).
///
/// - `q`: `(batch, seqlen_q, num_heads, head_dim)`; `seqlen_q` is small in decoding (1 per
///   step, a few for speculative decoding or chunked prefill) but any value works.
/// - `k_cache`, `v_cache`: `(batch, capacity, num_heads_k, head_dim)`, contiguous, with
///   `num_heads % num_heads_k == 0` (GQA/MQA: query head `h` reads cache head
///   `h / (num_heads / num_heads_k)`). Written in place when `new_kv` is given; two halves of
///   one allocation are fine, overlapping caches are not.
/// - `new_kv`: optional `(k_new, v_new)`, each `(batch, seqlen_new, num_heads_k, head_dim)`
///   (any strides but a contiguous last dimension). Token `i` of sequence `b` is written to
///   cache row `cache_seqlens[b] + i` of both caches before the attention.
/// - `cache_seqlens`: tokens already in the cache, one per sequence (before the append):
///   `&[u32]` on the host, or a `(batch,)` U32 tensor on q's device that only the kernels
///   read (graph-safe; see [`CacheSeqlens`] for what is then checked where). Sequences may
///   have different lengths; rows past a sequence's length are never read.
/// - `opts`: `softmax_scale` (default `1 / sqrt(head_dim)`), `causal`, `window_size`,
///   `softcap` and `alibi_slopes` are used (the rest is ignored, but `dropout_p` must be 0).
///   The mask and the window are bottom-right aligned per sequence: with
///   `seqlen_k = cache_seqlens[b] + seqlen_new`, query `i` sees cache token `j` iff
///   `j <= i + seqlen_k - seqlen_q` when causal, so new tokens attend causally among
///   themselves and to the whole prefix, and a window `(left, right)` keeps
///   `i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right` (a sliding
///   window over the newest tokens; a side `>= seqlen_k` is unbounded). ALiBi slopes are `(num_heads)` or
///   `(batch, num_heads)`, the bias `-slope · |i + seqlen_k - seqlen_q - j|`. Query rows
///   that see no key output zeros.
/// - dtypes: f16/bf16 on CUDA (head_dim a multiple of 8), f32/f16/bf16 on the CPU (computed
///   in f32); `head_dim` in `1..=256`. All tensors share dtype and device, except that the
///   two caches may be F8E4M3 (FP8 e4m3, half the memory of bf16) with their per-head
///   scales in `opts` ([`FlashAttn::kv_cache_scales`]): new rows are quantized as they are
///   appended, cached values dequantized as they are read (on CUDA head_dim must then be a
///   multiple of 16).
///
/// Returns `(batch, seqlen_q, num_heads, head_dim)` in q's dtype; the attention runs over the
/// first `cache_seqlens[b] + seqlen_new` tokens of sequence `b`. It has no gradient
/// (inference only).
///
/// Errors (each names the argument; the cache is untouched when one is returned): ranks and
/// shapes of `q`, the caches and `k_new`/`v_new`; dtypes and devices; `head_dim` and
/// `num_heads_k` rules; a non-contiguous cache; `k_new` or `v_new` a view of either cache;
/// `cache_seqlens` of the wrong length or a sequence that would exceed `capacity`;
/// `dropout_p > 0` (not supported in decoding); caches of two dtypes; `kv_cache_scales`
/// missing for F8E4M3 caches, given for others, or not F32 `(num_heads_k,)` on q's device;
/// a bad `softmax_scale`, `window_size`,
/// `softcap` or `alibi_slopes` (as in [`FlashAttn::forward`]). Every argument is checked
/// before the first write; only a failure of the device itself (a kernel launch, after the
/// checks) can leave rows at and past `cache_seqlens[b]` written, never the rows before.
///
/// ```
/// # fn main() -> candle::Result<()> {
/// use candle::{DType, Device, Tensor};
/// use candle_flash::{flash_attn_with_kvcache, FlashAttn};
/// let dev = Device::Cpu;
/// let k_cache = Tensor::zeros((2, 64, 2, 32), DType::F32, &dev)?; // capacity 64, 2 KV heads
/// let v_cache = Tensor::zeros((2, 64, 2, 32), DType::F32, &dev)?;
/// let q = Tensor::randn(0f32, 1.0, (2, 1, 8, 32), &dev)?; // one new token, 8 query heads
/// let k_new = Tensor::randn(0f32, 1.0, (2, 1, 2, 32), &dev)?;
/// let v_new = Tensor::randn(0f32, 1.0, (2, 1, 2, 32), &dev)?;
/// let lens = [5u32, 17]; // tokens already cached per sequence
/// let opts = FlashAttn::new().causal(true);
/// let out = flash_attn_with_kvcache(&q, &k_cache, &v_cache, Some((&k_new, &v_new)), &lens, &opts)?;
/// assert_eq!(out.dims(), &[2, 1, 8, 32]); // the caches now hold 6 and 18 tokens
/// # Ok(()) }
/// ```
pub fn flash_attn_with_kvcache<'a>(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    new_kv: Option<(&Tensor, &Tensor)>,
    cache_seqlens: impl Into<CacheSeqlens<'a>>,
    opts: &FlashAttn,
) -> Result<Tensor> {
    let kind = CacheKind::Contiguous;
    let lens = cache_seqlens.into();
    let call = Call::new(q, k_cache, v_cache, new_kv, lens, kind, opts, false, None)?;
    Ok(call.run(q, k_cache, v_cache)?.0)
}

/// [`flash_attn_with_kvcache`] that also returns the row log-sum-exp of the attention:
/// `(out, lse)` with `lse` `(batch, num_heads, seqlen_q)` in f32 (natural log of the sum of
/// `exp(score)` over the keys each row sees, the scores scaled and modified as the softmax
/// saw them; `-inf` for a row that sees no key), the layout of
/// [`FlashAttn::forward_with_lse`]. With [`crate::combine`] this merges attention over a
/// shared prefix, computed once, with each sequence's own cache (cascade attention).
pub fn flash_attn_with_kvcache_lse<'a>(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    new_kv: Option<(&Tensor, &Tensor)>,
    cache_seqlens: impl Into<CacheSeqlens<'a>>,
    opts: &FlashAttn,
) -> Result<(Tensor, Tensor)> {
    let kind = CacheKind::Contiguous;
    let lens = cache_seqlens.into();
    let call = Call::new(q, k_cache, v_cache, new_kv, lens, kind, opts, true, None)?;
    with_lse(call.run(q, k_cache, v_cache)?)
}

/// [`flash_attn_with_kvcache_lse`] with a different number of query tokens per sequence
/// (speculative decoding's draft tokens, chunked prefill): `q` `(batch, seqlen_q, ...)` is
/// padded, sequence `b` has `seqlens_q[b] <= seqlen_q` real query tokens (the first ones) and,
/// with `new_kv` (whose `seqlen_new` must equal `seqlen_q`), as many new keys and values;
/// the rest of its rows are padding. The causal mask is bottom-right aligned per sequence
/// (query `i` of sequence `b` sees cache token `j` iff `j <= i + seqlen_k[b] - seqlens_q[b]`
/// with `seqlen_k[b] = cache_seqlens[b] + seqlens_q[b]`). Padding rows output zeros and an
/// LSE of `-inf`, and their new rows are not written.
///
/// `seqlens_q` takes the forms of `cache_seqlens` ([`CacheSeqlens`]); a device tensor needs
/// `cache_seqlens` on the device too. One launch serves the whole batch at the decode
/// kernel's speed: a sequence's padding tiles read no keys.
pub fn flash_attn_with_kvcache_ragged<'a>(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    new_kv: Option<(&Tensor, &Tensor)>,
    cache_seqlens: impl Into<CacheSeqlens<'a>>,
    seqlens_q: impl Into<CacheSeqlens<'a>>,
    opts: &FlashAttn,
) -> Result<(Tensor, Tensor)> {
    let kind = CacheKind::Contiguous;
    let (lens, q_lens) = (cache_seqlens.into(), Some(seqlens_q.into()));
    let call = Call::new(q, k_cache, v_cache, new_kv, lens, kind, opts, true, q_lens)?;
    with_lse(call.run(q, k_cache, v_cache)?)
}

/// [`flash_attn_with_kvcache_ragged`] over a paged cache.
#[allow(clippy::too_many_arguments)] // FlashAttention's argument list; see PagedKvCache
pub fn flash_attn_with_paged_kvcache_ragged<'a>(
    q: &Tensor,
    k_pages: &Tensor,
    v_pages: &Tensor,
    new_kv: Option<(&Tensor, &Tensor)>,
    cache_seqlens: impl Into<CacheSeqlens<'a>>,
    seqlens_q: impl Into<CacheSeqlens<'a>>,
    block_table: impl Into<BlockTable<'a>>,
    max_pages: usize,
    opts: &FlashAttn,
) -> Result<(Tensor, Tensor)> {
    let kind = CacheKind::Paged {
        block_table: block_table.into(),
        max_pages,
        owned: false,
    };
    let (lens, q_lens) = (cache_seqlens.into(), Some(seqlens_q.into()));
    let call = Call::new(q, k_pages, v_pages, new_kv, lens, kind, opts, true, q_lens)?;
    with_lse(call.run(q, k_pages, v_pages)?)
}

fn with_lse((out, lse): (Tensor, Option<Tensor>)) -> Result<(Tensor, Tensor)> {
    match lse {
        Some(lse) => Ok((out, lse)),
        None => candle::bail!("kv-cache: the attention returned no LSE"),
    }
}

/// [`flash_attn_with_kvcache`] over a paged cache (vLLM's PagedAttention layout), for
/// serving many sequences of unknown length without fragmentation.
///
/// - `k_pages`, `v_pages`: `(num_pages, page_size, num_heads_k, head_dim)`, contiguous;
///   `page_size > 0`.
/// - `block_table`: row-major `(batch, max_pages)` (host `&[u32]` or a U32 device tensor,
///   see [`BlockTable`]): token `j` of sequence `b` lives in page
///   `block_table[b * max_pages + j / page_size]`, row `j % page_size`. Every page a sequence
///   uses after the append (`ceil((cache_seqlens[b] + seqlen_new) / page_size)` entries of
///   its row) must be `< num_pages`; the rest of the row is ignored. Sequences may share
///   pages they only read (a common prompt), but the pages the append writes must not be
///   shared.
/// - capacity per sequence: `max_pages * page_size` tokens.
/// - everything else as in [`flash_attn_with_kvcache`].
///
/// Errors: those of [`flash_attn_with_kvcache`] (naming `k_pages`/`v_pages`), a
/// `block_table` whose length is not `batch * max_pages` or which names a page
/// `>= num_pages`, a page the append writes that another used entry also names (two
/// sequences given one page, a shared prefix page that is only partly filled, the
/// unallocated zero entries of [`PagedKvCache::block_table`]), and `page_size == 0`.
#[allow(clippy::too_many_arguments)] // FlashAttention's argument list; see PagedKvCache
pub fn flash_attn_with_paged_kvcache<'a>(
    q: &Tensor,
    k_pages: &Tensor,
    v_pages: &Tensor,
    new_kv: Option<(&Tensor, &Tensor)>,
    cache_seqlens: impl Into<CacheSeqlens<'a>>,
    block_table: impl Into<BlockTable<'a>>,
    max_pages: usize,
    opts: &FlashAttn,
) -> Result<Tensor> {
    let kind = CacheKind::Paged {
        block_table: block_table.into(),
        max_pages,
        owned: false,
    };
    let lens = cache_seqlens.into();
    let call = Call::new(q, k_pages, v_pages, new_kv, lens, kind, opts, false, None)?;
    Ok(call.run(q, k_pages, v_pages)?.0)
}

/// [`flash_attn_with_paged_kvcache`] that also returns the row log-sum-exp, as
/// [`flash_attn_with_kvcache_lse`] does.
#[allow(clippy::too_many_arguments)] // FlashAttention's argument list; see PagedKvCache
pub fn flash_attn_with_paged_kvcache_lse<'a>(
    q: &Tensor,
    k_pages: &Tensor,
    v_pages: &Tensor,
    new_kv: Option<(&Tensor, &Tensor)>,
    cache_seqlens: impl Into<CacheSeqlens<'a>>,
    block_table: impl Into<BlockTable<'a>>,
    max_pages: usize,
    opts: &FlashAttn,
) -> Result<(Tensor, Tensor)> {
    let kind = CacheKind::Paged {
        block_table: block_table.into(),
        max_pages,
        owned: false,
    };
    let lens = cache_seqlens.into();
    let call = Call::new(q, k_pages, v_pages, new_kv, lens, kind, opts, true, None)?;
    with_lse(call.run(q, k_pages, v_pages)?)
}
