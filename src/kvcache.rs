//! KV-cache decoding: token-by-token generation, where a few query tokens per sequence attend
//! to a long, growing cache of keys and values.
//!
//! - [`flash_attn_with_kvcache`]: a preallocated `(batch, capacity, num_heads_k, head_dim)`
//!   cache; new keys and values are appended in place, then the queries attend to each
//!   sequence's prefix.
//! - [`flash_attn_with_paged_kvcache`]: the same over a vLLM-style paged cache
//!   `(num_pages, page_size, num_heads_k, head_dim)` and a block table.
//! - [`KvCache`] and [`PagedKvCache`]: the cache of one layer with its per-sequence lengths,
//!   for model authors (append + attend in one call, reset, a clear error on overflow).
//!
//! The lengths live on the host (`&[u32]`): every bound is checked before anything is
//! written, without a device synchronisation. Decoding is inference only: the result carries
//! no gradient (a backward pass through it is Candle's "no backward" error).

use candle::{bail, DType, Device, Result, Tensor};

use crate::decode::{AppendOp, DecodeOp};
use crate::layout::aligned;
use crate::options::FlashAttn;
use crate::params::{self, AppendProblem, AttnShape, DecodeProblem, Paging};

mod append_varlen;

/// Shape of the new keys and values, in messages.
const NEW_KV_DIMS: &str = "(batch, seqlen_new, num_heads_k, head_dim)";

/// How the user laid out the cache (before its shape is read).
#[derive(Clone, Copy)]
enum CacheKind<'a> {
    Contiguous,
    Paged {
        block_table: &'a [u32],
        max_pages: usize,
        /// The table comes from a [`PagedKvCache`], whose free list never hands out a page
        /// twice: the aliasing check can be skipped on the decoding hot path.
        owned: bool,
    },
}

impl CacheKind<'_> {
    /// Names of the two cache tensors and their expected shape, for messages.
    fn names(&self) -> (&'static str, &'static str, &'static str) {
        match self {
            CacheKind::Contiguous => (
                "k_cache",
                "v_cache",
                "(batch, capacity, num_heads_k, head_dim)",
            ),
            CacheKind::Paged { .. } => (
                "k_pages",
                "v_pages",
                "(num_pages, page_size, num_heads_k, head_dim)",
            ),
        }
    }
}

/// One validated call: the append (if there are new tokens) and the attention. Nothing has
/// been written when [`Call::new`] returns, so an error leaves the cache untouched.
struct Call {
    append: Option<(AppendOp, Tensor, Tensor)>,
    decode: DecodeProblem,
}

impl Call {
    fn new(
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
        new_kv: Option<(&Tensor, &Tensor)>,
        cache_seqlens: &[u32],
        kind: CacheKind,
        opts: &FlashAttn,
    ) -> Result<Self> {
        if opts.dropout_p != 0.0 {
            bail!(
                "dropout_p: dropout is not supported in KV-cache decoding (inference only), got {}",
                opts.dropout_p
            )
        }
        let (b, s_q, h, d) = params::dims4(q, "q", "(batch, seqlen_q, num_heads, head_dim)")?;
        let (kn, vn, what) = kind.names();
        let k_dims = params::dims4(k_cache, kn, what)?;
        if params::dims4(v_cache, vn, what)? != k_dims {
            bail!(
                "{vn}: shape {:?} differs from {kn}'s {:?}",
                v_cache.dims(),
                k_cache.dims()
            )
        }
        params::check_like_q(q, k_cache, kn)?;
        params::check_like_q(q, v_cache, vn)?;
        let (outer, rows, hk, dk) = k_dims;
        if dk != d {
            bail!("{kn}: head_dim {dk} differs from q's head_dim {d}")
        }
        if hk == 0 || h % hk != 0 {
            bail!("{kn}: num_heads_k {hk} must divide q's num_heads {h} (MQA/GQA)")
        }
        check_cache_storage(k_cache, v_cache, kn, vn, new_kv.is_some())?;
        let shape = AttnShape::fixed(b, s_q, rows, h, hk, d);
        params::check_supported(q, k_cache, v_cache, &shape)?;
        let paging = match kind {
            CacheKind::Contiguous => {
                if outer != b {
                    bail!("{kn}: batch size {outer} differs from q's {b}")
                }
                Paging::Contiguous { capacity: rows }
            }
            CacheKind::Paged {
                block_table,
                max_pages,
                ..
            } => {
                if rows == 0 {
                    bail!(
                        "{kn}: page_size (dimension 1) must be > 0, got shape {:?}",
                        k_cache.dims()
                    )
                }
                if b.checked_mul(max_pages) != Some(block_table.len()) {
                    bail!(
                        "block_table: expected batch * max_pages = {b} * {max_pages} = {} entries, got {}",
                        b as u128 * max_pages as u128,
                        block_table.len()
                    )
                }
                Paging::Paged {
                    page_size: rows,
                    num_pages: outer,
                    max_pages,
                    block_table: block_table.to_vec(),
                }
            }
        };
        if cache_seqlens.len() != b {
            bail!(
                "cache_seqlens: expected {b} entries (one per sequence of q), got {}",
                cache_seqlens.len()
            )
        }
        if let Some((k_new, v_new)) = new_kv {
            check_new_kv_apart(
                [(k_new, "k_new"), (v_new, "v_new")],
                [(k_cache, kn), (v_cache, vn)],
            )?;
        }
        let new_kv = new_kv
            .map(|(k_new, v_new)| check_new_kv(q, k_new, v_new, (b, hk, d)))
            .transpose()?;
        let s_new = new_kv.as_ref().map_or(0, |&(_, _, s_new)| s_new);
        let seqlens = lengths_after(cache_seqlens, s_new, &paging)?;
        check_block_table(&paging, &seqlens, kn)?;
        if let (CacheKind::Paged { owned: false, .. }, true) = (kind, s_new > 0) {
            check_pages_not_shared(&paging, cache_seqlens, &seqlens)?;
        }
        let scale = opts.softmax_scale.unwrap_or(1.0 / (d as f32).sqrt());
        params::check_scale(scale)?;
        if opts.block_mask.is_some() {
            bail!(
                "block_mask: block-sparse attention is not supported by KV-cache decoding; \
                 use FlashAttn::forward"
            )
        }
        let mods = opts.score_mods(&shape, q.device())?;
        let append = new_kv.map(|(k_new, v_new, _)| {
            let problem = AppendProblem {
                b,
                s_new,
                hk,
                d,
                start: cache_seqlens.to_vec(),
                paging: paging.clone(),
            };
            (AppendOp(problem), k_new, v_new)
        });
        let decode = DecodeProblem {
            b,
            s_q,
            h,
            hk,
            d,
            scale,
            causal: opts.causal,
            mods,
            seqlens,
            paging,
        };
        Ok(Self { append, decode })
    }

    /// Tokens per sequence once the new ones are appended.
    fn lengths(&self) -> &[u32] {
        &self.decode.seqlens
    }

    /// Writes the new keys and values into the caches, in place.
    fn append(&self, k_cache: &Tensor, v_cache: &Tensor) -> Result<()> {
        if let Some((op, k_new, v_new)) = &self.append {
            op.run(k_cache, k_new)?;
            crate::failpoint::check("kvcache: between the K and V appends")?;
            op.run(v_cache, v_new)?;
        }
        Ok(())
    }

    /// The attention of `q` over the (appended) caches.
    fn attend(self, q: &Tensor, k_cache: &Tensor, v_cache: &Tensor) -> Result<Tensor> {
        crate::failpoint::check("kvcache: attention")?;
        DecodeOp(self.decode).run(&aligned(q)?, k_cache, v_cache)
    }

    /// Validates, appends, attends.
    fn run(self, q: &Tensor, k_cache: &Tensor, v_cache: &Tensor) -> Result<Tensor> {
        self.append(k_cache, v_cache)?;
        self.attend(q, k_cache, v_cache)
    }
}

/// The caches are written in place, so they cannot be copied into a layout that suits the
/// kernels: each must be contiguous (on CUDA starting at a multiple of 8 elements, for the
/// kernels' 16-byte loads), and when the call `writes` new rows the two must not overlap
/// (they may be two halves of one allocation).
fn check_cache_storage(
    k_cache: &Tensor,
    v_cache: &Tensor,
    kn: &str,
    vn: &str,
    writes: bool,
) -> Result<()> {
    for (name, t) in [(kn, k_cache), (vn, v_cache)] {
        if !t.is_contiguous() {
            bail!(
                "{name}: expected a contiguous tensor (the cache is written in place), got strides {:?}",
                t.stride()
            )
        }
        let offset = t.layout().start_offset();
        if t.device().is_cuda() && !offset.is_multiple_of(8) {
            bail!("{name}: on CUDA the cache must start at a multiple of 8 elements, got offset {offset}")
        }
    }
    let range = |t: &Tensor| {
        let start = t.layout().start_offset();
        start..start + t.elem_count()
    };
    let (rk, rv) = (range(k_cache), range(v_cache));
    let overlap = rk.start < rv.end && rv.start < rk.end;
    if writes && overlap && same_storage(k_cache, v_cache) {
        bail!("{vn}: shares its memory with {kn}; keys and values need separate caches")
    }
    Ok(())
}

/// Whether two tensors are views of one storage (a cheap pointer comparison).
fn same_storage(a: &Tensor, b: &Tensor) -> bool {
    let storage = |t: &Tensor| &*t.storage_and_layout().0 as *const candle::Storage;
    std::ptr::eq(storage(a), storage(b))
}

/// The new keys and values are read while the caches are written: neither may be a view of
/// either cache (Candle refuses such a copy, and the first write would already have landed
/// when the second failed). Checked before anything is written.
fn check_new_kv_apart(news: [(&Tensor, &str); 2], caches: [(&Tensor, &str); 2]) -> Result<()> {
    for (new, nn) in news {
        for (cache, cn) in caches {
            if same_storage(new, cache) {
                bail!(
                    "{nn}: shares its memory with {cn} (a view of the cache); the new tokens \
                     must live in a tensor of their own"
                )
            }
        }
    }
    Ok(())
}

/// Every page a sequence uses (after the append) must exist: entries
/// `0..ceil(seqlens[b] / page_size)` of row `b` of a paged cache's block table are
/// `< num_pages`.
fn check_block_table(paging: &Paging, seqlens: &[u32], kn: &str) -> Result<()> {
    let Paging::Paged {
        page_size,
        num_pages,
        max_pages,
        block_table,
    } = paging
    else {
        return Ok(());
    };
    for (s, &len) in seqlens.iter().enumerate() {
        for p in 0..(len as usize).div_ceil(*page_size) {
            let page = block_table[s * max_pages + p];
            if page as usize >= *num_pages {
                bail!(
                    "block_table: entry [{s}, {p}] (sequence {s}, page {p}) is {page}, \
                     but {kn} has {num_pages} pages"
                )
            }
        }
    }
    Ok(())
}

/// A page that an append writes must belong to its sequence alone: named once among the
/// pages every sequence uses (after the append). Otherwise the append overwrites another
/// sequence's keys and values (two rows naming one page, a shared prefix page that is only
/// partly filled, the unallocated zero entries of a table), and on CUDA the append blocks
/// race.
fn check_pages_not_shared(paging: &Paging, starts: &[u32], lengths: &[u32]) -> Result<()> {
    let Paging::Paged {
        page_size,
        max_pages,
        block_table,
        ..
    } = paging
    else {
        return Ok(());
    };
    let row = |s: usize| &block_table[s * max_pages..][..*max_pages];
    let mut written = std::collections::HashMap::new();
    for (s, (&start, &len)) in starts.iter().zip(lengths).enumerate() {
        let first = start as usize / page_size;
        for p in first..(len as usize).div_ceil(*page_size) {
            if let Some((s0, p0)) = written.insert(row(s)[p], (s, p)) {
                bail!(
                    "block_table: entries [{s0}, {p0}] and [{s}, {p}] both name page {}, which \
                     this call's append writes; appended pages must not be shared",
                    row(s)[p]
                )
            }
        }
    }
    for (s, &len) in lengths.iter().enumerate() {
        for (p, page) in row(s)[..(len as usize).div_ceil(*page_size)]
            .iter()
            .enumerate()
        {
            if let Some(&(s0, p0)) = written.get(page) {
                if (s0, p0) != (s, p) {
                    bail!(
                        "block_table: entry [{s}, {p}] names page {page}, which this call's \
                         append writes for entry [{s0}, {p0}]; appended pages must not be shared"
                    )
                }
            }
        }
    }
    Ok(())
}

/// Checks the new keys and values `(b, s_new, hk, d)`; returns them ready for the kernels,
/// and `s_new`.
fn check_new_kv(
    q: &Tensor,
    k_new: &Tensor,
    v_new: &Tensor,
    (b, hk, d): (usize, usize, usize),
) -> Result<(Tensor, Tensor, usize)> {
    let dims = params::dims4(k_new, "k_new", NEW_KV_DIMS)?;
    if params::dims4(v_new, "v_new", NEW_KV_DIMS)? != dims {
        bail!(
            "v_new: shape {:?} differs from k_new's {:?}",
            v_new.dims(),
            k_new.dims()
        )
    }
    let (nb, s_new, nh, nd) = dims;
    if (nb, nh, nd) != (b, hk, d) {
        bail!(
            "k_new: expected shape {NEW_KV_DIMS} = ({b}, seqlen_new, {hk}, {d}) like q and the cache, got {:?}",
            k_new.dims()
        )
    }
    for (name, t) in [("k_new", k_new), ("v_new", v_new)] {
        params::check_like_q(q, t, name)?;
        params::check_last_dim_contiguous(t, name)?;
    }
    Ok((aligned(k_new)?, aligned(v_new)?, s_new))
}

/// The length of every sequence after appending `s_new` tokens, checked against the
/// capacity of the cache.
fn lengths_after(cache_seqlens: &[u32], s_new: usize, paging: &Paging) -> Result<Vec<u32>> {
    let capacity = paging.capacity();
    let how = match paging {
        Paging::Contiguous { .. } => String::new(),
        Paging::Paged {
            page_size,
            max_pages,
            ..
        } => format!(" (max_pages {max_pages} x page_size {page_size})"),
    };
    cache_seqlens
        .iter()
        .enumerate()
        .map(|(b, &len)| {
            match (len as usize)
                .checked_add(s_new)
                .map(|t| (t, u32::try_from(t)))
            {
                Some((total, Ok(t))) if total <= capacity => Ok(t),
                _ => bail!(
                    "cache_seqlens: sequence {b} would hold {len} + {s_new} = {} tokens, more \
                     than the cache capacity of {capacity}{how}",
                    len as u128 + s_new as u128
                ),
            }
        })
        .collect()
}

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
/// - `cache_seqlens`: tokens already in the cache, one per sequence (before the append).
///   Sequences may have different lengths; rows past a sequence's length are never read.
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
///   in f32); `head_dim` in `1..=256`. All tensors share dtype and device.
///
/// Returns `(batch, seqlen_q, num_heads, head_dim)` in q's dtype; the attention runs over the
/// first `cache_seqlens[b] + seqlen_new` tokens of sequence `b`. It has no gradient
/// (inference only).
///
/// Errors (each names the argument; the cache is untouched when one is returned): ranks and
/// shapes of `q`, the caches and `k_new`/`v_new`; dtypes and devices; `head_dim` and
/// `num_heads_k` rules; a non-contiguous cache; `k_new` or `v_new` a view of either cache;
/// `cache_seqlens` of the wrong length or a sequence that would exceed `capacity`;
/// `dropout_p > 0` (not supported in decoding); a bad `softmax_scale`, `window_size`,
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
pub fn flash_attn_with_kvcache(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    new_kv: Option<(&Tensor, &Tensor)>,
    cache_seqlens: &[u32],
    opts: &FlashAttn,
) -> Result<Tensor> {
    let kind = CacheKind::Contiguous;
    Call::new(q, k_cache, v_cache, new_kv, cache_seqlens, kind, opts)?.run(q, k_cache, v_cache)
}

/// [`flash_attn_with_kvcache`] over a paged cache (vLLM's PagedAttention layout), for
/// serving many sequences of unknown length without fragmentation.
///
/// - `k_pages`, `v_pages`: `(num_pages, page_size, num_heads_k, head_dim)`, contiguous;
///   `page_size > 0`.
/// - `block_table`: row-major `(batch, max_pages)`: token `j` of sequence `b` lives in page
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
pub fn flash_attn_with_paged_kvcache(
    q: &Tensor,
    k_pages: &Tensor,
    v_pages: &Tensor,
    new_kv: Option<(&Tensor, &Tensor)>,
    cache_seqlens: &[u32],
    block_table: &[u32],
    max_pages: usize,
    opts: &FlashAttn,
) -> Result<Tensor> {
    let kind = CacheKind::Paged {
        block_table,
        max_pages,
        owned: false,
    };
    Call::new(q, k_pages, v_pages, new_kv, cache_seqlens, kind, opts)?.run(q, k_pages, v_pages)
}

/// Checks a cache size given to a constructor.
fn check_fits_u32(value: usize, name: &str) -> Result<()> {
    if u32::try_from(value).is_err() {
        bail!("{name}: {value} tokens do not fit the u32 sequence lengths")
    }
    Ok(())
}

/// What a constructor is given, checked as the first call would check it: the cache
/// `(outer, rows, num_heads_k, head_dim)` of `dtype` on `device` (rows: capacity or page
/// size). Absurd sizes are an error here rather than an aborted allocation.
fn check_cache_args(dims: [(usize, &str); 4], dtype: DType, device: &Device) -> Result<()> {
    let [_, _, (hk, _), (d, _)] = dims;
    if hk == 0 {
        bail!("num_heads_k: must be > 0")
    }
    params::check_head_dim(device, d, "head_dim:")?;
    params::check_dtype(device, dtype, "dtype:")?;
    let mut elems: usize = 1;
    for (n, name) in dims {
        elems = match elems.checked_mul(n) {
            Some(e) if e.saturating_mul(dtype.size_in_bytes()) <= isize::MAX as usize => e,
            _ => bail!("{name}: the cache of {dims:?} elements does not fit in memory"),
        };
    }
    // Both caches at once, tried on the CPU before candle's allocation (which aborts).
    let sizes = dims.map(|(n, _)| n);
    params::alloc_elems_on(&sizes, 2 * dtype.size_in_bytes(), "cache", device)?;
    Ok(())
}

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
#[derive(Debug)]
pub struct KvCache {
    k: Tensor,
    v: Tensor,
    lengths: Vec<u32>,
}

impl KvCache {
    /// A zero-filled cache `(batch, capacity, num_heads_k, head_dim)` of `dtype` on `device`
    /// (f16/bf16 on CUDA; f32/f16/bf16 on the CPU), every sequence empty.
    ///
    /// Errors: a `capacity` that does not fit u32, a `batch` past i32, and allocation errors.
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
        })
    }

    /// Appends `k_new`, `v_new` `(batch, seqlen_new, num_heads_k, head_dim)` to every
    /// sequence, then returns the attention of `q` `(batch, seqlen_q, num_heads, head_dim)`
    /// over each sequence's tokens, old and new: [`flash_attn_with_kvcache`] with this
    /// cache's lengths, which then grow by `seqlen_new`. `seqlen_q` may differ from
    /// `seqlen_new`; a `q` with `seqlen_q = 0` only appends (and returns an empty tensor).
    ///
    /// Errors: those of [`flash_attn_with_kvcache`], notably `cache_seqlens` when a sequence
    /// would exceed the capacity. On error nothing is written and the lengths are unchanged.
    pub fn append_and_attend(
        &mut self,
        q: &Tensor,
        k_new: &Tensor,
        v_new: &Tensor,
        opts: &FlashAttn,
    ) -> Result<Tensor> {
        let new_kv = Some((k_new, v_new));
        let kind = CacheKind::Contiguous;
        let call = Call::new(q, &self.k, &self.v, new_kv, &self.lengths, kind, opts)?;
        let lengths = call.lengths().to_vec();
        call.append(&self.k, &self.v)?;
        // Committed only once the attention ran: after a failed launch the rows written past
        // the old lengths are never read, and a retry writes them again.
        let out = call.attend(q, &self.k, &self.v)?;
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

/// A paged KV cache for one attention layer: a pool of `num_pages` pages of `page_size`
/// tokens shared by `batch` sequences, handed out as sequences grow (a free list) and
/// returned by [`PagedKvCache::reset_sequence`]. Memory follows the tokens actually held
/// rather than `batch × capacity`.
///
/// The same interface as [`KvCache`]; attention runs through
/// [`flash_attn_with_paged_kvcache`] with this cache's block table.
#[derive(Debug)]
pub struct PagedKvCache {
    k: Tensor,
    v: Tensor,
    lengths: Vec<u32>,
    page_size: usize,
    max_pages: usize,
    /// `(batch, max_pages)`; sequence `b` holds pages `block_table[b * max_pages + p]` for
    /// `p < ceil(lengths[b] / page_size)`; the other entries are 0 and unused.
    block_table: Vec<u32>,
    /// Free pages; the next one handed out is the last.
    free: Vec<u32>,
}

impl PagedKvCache {
    /// A zero-filled pool `(num_pages, page_size, num_heads_k, head_dim)` of `dtype` on
    /// `device` for `batch` sequences of up to `max_pages_per_seq * page_size` tokens each,
    /// every sequence empty and every page free.
    ///
    /// Errors: `page_size == 0`, a `num_pages` or capacity that does not fit u32, a `batch`
    /// past i32, a block table that cannot fit in memory, and allocation errors.
    #[allow(clippy::too_many_arguments)] // the sizes of a pool; each is one plain number
    pub fn new(
        batch: usize,
        num_pages: usize,
        page_size: usize,
        max_pages_per_seq: usize,
        num_heads_k: usize,
        head_dim: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        if page_size == 0 {
            bail!("page_size: must be > 0")
        }
        check_fits_u32(num_pages, "num_pages")?;
        let Some(capacity) = page_size.checked_mul(max_pages_per_seq) else {
            bail!("max_pages_per_seq * page_size: {max_pages_per_seq} * {page_size} overflows")
        };
        check_fits_u32(capacity, "max_pages_per_seq * page_size")?;
        check_cache_args(
            [
                (num_pages, "num_pages"),
                (page_size, "page_size"),
                (num_heads_k, "num_heads_k"),
                (head_dim, "head_dim"),
            ],
            dtype,
            device,
        )?;
        params::check_batch(batch)?;
        params::alloc_elems(
            &[batch, max_pages_per_seq.saturating_add(1)],
            4,
            "block_table and lengths",
        )?;
        let shape = (num_pages, page_size, num_heads_k, head_dim);
        Ok(Self {
            k: Tensor::zeros(shape, dtype, device)?,
            v: Tensor::zeros(shape, dtype, device)?,
            lengths: vec![0; batch],
            page_size,
            max_pages: max_pages_per_seq,
            block_table: vec![0; batch * max_pages_per_seq],
            free: all_pages(num_pages),
        })
    }

    /// Pages held by sequence `b`.
    fn held(&self, b: usize) -> usize {
        (self.lengths[b] as usize).div_ceil(self.page_size)
    }

    /// The block table and free list after giving every sequence the pages it needs for
    /// `s_new` more tokens. Errors: a sequence over capacity, or too few free pages.
    fn allocate(&self, s_new: usize) -> Result<(Vec<u32>, Vec<u32>)> {
        let paging = Paging::Paged {
            page_size: self.page_size,
            num_pages: self.num_pages(),
            max_pages: self.max_pages,
            block_table: Vec::new(),
        };
        let lengths = lengths_after(&self.lengths, s_new, &paging)?;
        self.allocate_for(&lengths)
    }

    /// The block table and free list once every sequence `b` holds `lengths[b]` tokens
    /// (at least as many as now). Errors: too few free pages.
    fn allocate_for(&self, lengths: &[u32]) -> Result<(Vec<u32>, Vec<u32>)> {
        let (mut table, mut free) = (self.block_table.clone(), self.free.clone());
        for (b, &len) in lengths.iter().enumerate() {
            let (held, needed) = (self.held(b), (len as usize).div_ceil(self.page_size));
            for p in held..needed {
                let Some(page) = free.pop() else {
                    bail!(
                        "PagedKvCache: out of pages: sequence {b} needs {} more page(s) for \
                         {} + {} tokens (page_size {}), but only {} were left \
                         ({} of {} pages were free before this call)",
                        needed - held,
                        self.lengths[b],
                        len - self.lengths[b],
                        self.page_size,
                        p - held,
                        self.free.len(),
                        self.num_pages()
                    )
                };
                table[b * self.max_pages + p] = page;
            }
        }
        Ok((table, free))
    }

    /// Like [`KvCache::append_and_attend`]: takes pages from the free list for the new
    /// tokens, appends `k_new`, `v_new` `(batch, seqlen_new, num_heads_k, head_dim)`, returns
    /// the attention of `q` `(batch, seqlen_q, num_heads, head_dim)` over each sequence.
    ///
    /// Errors: those of [`flash_attn_with_paged_kvcache`]; `cache_seqlens` when a sequence
    /// would exceed `max_pages_per_seq * page_size` tokens; "out of pages" when the pool has
    /// too few free pages. On error nothing is written, no page is taken and the lengths are
    /// unchanged.
    pub fn append_and_attend(
        &mut self,
        q: &Tensor,
        k_new: &Tensor,
        v_new: &Tensor,
        opts: &FlashAttn,
    ) -> Result<Tensor> {
        // A k_new of the wrong rank allocates nothing; the call below reports it.
        let s_new = match k_new.dims() {
            &[_, s_new, _, _] => s_new,
            _ => 0,
        };
        let (table, free) = self.allocate(s_new)?;
        let kind = CacheKind::Paged {
            block_table: &table,
            max_pages: self.max_pages,
            owned: true,
        };
        let new_kv = Some((k_new, v_new));
        let call = Call::new(q, &self.k, &self.v, new_kv, &self.lengths, kind, opts)?;
        let lengths = call.lengths().to_vec();
        call.append(&self.k, &self.v)?;
        // As in KvCache: pages and lengths are committed after the attention ran (the pages
        // written by a failed call are still free).
        let out = call.attend(q, &self.k, &self.v)?;
        self.lengths = lengths;
        self.block_table = table;
        self.free = free;
        Ok(out)
    }

    /// Tokens held by each sequence.
    pub fn lengths(&self) -> &[u32] {
        &self.lengths
    }

    /// Tokens each sequence can hold: `max_pages_per_seq * page_size` (if pages are free).
    pub fn capacity(&self) -> usize {
        self.max_pages * self.page_size
    }

    /// Empties every sequence and returns every page to the pool.
    pub fn reset(&mut self) {
        self.lengths.fill(0);
        self.block_table.fill(0);
        self.free = all_pages(self.num_pages());
    }

    /// Empties sequence `b` and returns its pages to the pool. Errors: `b` out of range.
    pub fn reset_sequence(&mut self, b: usize) -> Result<()> {
        if b >= self.lengths.len() {
            bail!(
                "reset_sequence: sequence {b} is out of range for a batch of {}",
                self.lengths.len()
            )
        }
        let row = &mut self.block_table[b * self.max_pages..][..self.max_pages];
        let held = (self.lengths[b] as usize).div_ceil(self.page_size);
        self.free.extend(row[..held].iter().rev());
        row.fill(0);
        self.lengths[b] = 0;
        Ok(())
    }

    /// The key pages, `(num_pages, page_size, num_heads_k, head_dim)`.
    pub fn k(&self) -> &Tensor {
        &self.k
    }

    /// The value pages, shaped like [`PagedKvCache::k`].
    pub fn v(&self) -> &Tensor {
        &self.v
    }

    /// The block table, row-major `(batch, max_pages_per_seq)`, in the layout
    /// [`flash_attn_with_paged_kvcache`] takes; entries past a sequence's pages are 0.
    pub fn block_table(&self) -> &[u32] {
        &self.block_table
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Pages one sequence may hold (the block table's row length).
    pub fn max_pages_per_seq(&self) -> usize {
        self.max_pages
    }

    /// Pages in the pool.
    pub fn num_pages(&self) -> usize {
        self.k.dim(0).unwrap_or(0)
    }

    /// Pages not held by any sequence.
    pub fn free_pages(&self) -> usize {
        self.free.len()
    }
}

/// Every page of a pool of `num_pages`, as a free list that hands out page 0 first.
fn all_pages(num_pages: usize) -> Vec<u32> {
    (0..num_pages as u32).rev().collect()
}
