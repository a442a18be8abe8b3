//! One validated decoding call: every argument, aliasing, block-table and length check runs
//! before the first write, so that an error leaves the cache untouched.

use candle::{bail, Result, Tensor};

use crate::decode::{AppendOp, DecodeOp};
use crate::layout::aligned;
use crate::options::FlashAttn;
use crate::params::{self, AppendProblem, AttnShape, DecodeProblem, Paging};

/// Shape of the new keys and values, in messages.
const NEW_KV_DIMS: &str = "(batch, seqlen_new, num_heads_k, head_dim)";

/// How the user laid out the cache (before its shape is read).
#[derive(Clone, Copy)]
pub(super) enum CacheKind<'a> {
    Contiguous,
    Paged {
        block_table: &'a [u32],
        max_pages: usize,
        /// The table comes from a [`PagedKvCache`], whose free list never hands out a page
        /// twice: the aliasing check can be skipped on the decoding hot path.
        ///
        /// [`PagedKvCache`]: super::PagedKvCache
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
pub(super) struct Call {
    append: Option<(AppendOp, Tensor, Tensor)>,
    decode: DecodeProblem,
}

impl Call {
    pub(super) fn new(
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
    pub(super) fn lengths(&self) -> &[u32] {
        &self.decode.seqlens
    }

    /// Writes the new keys and values into the caches, in place.
    pub(super) fn append(&self, k_cache: &Tensor, v_cache: &Tensor) -> Result<()> {
        if let Some((op, k_new, v_new)) = &self.append {
            op.run(k_cache, k_new)?;
            crate::failpoint::check("kvcache: between the K and V appends")?;
            op.run(v_cache, v_new)?;
        }
        Ok(())
    }

    /// The attention of `q` over the (appended) caches.
    pub(super) fn attend(self, q: &Tensor, k_cache: &Tensor, v_cache: &Tensor) -> Result<Tensor> {
        crate::failpoint::check("kvcache: attention")?;
        DecodeOp(self.decode).run(&aligned(q)?, k_cache, v_cache)
    }

    /// Validates, appends, attends.
    pub(super) fn run(self, q: &Tensor, k_cache: &Tensor, v_cache: &Tensor) -> Result<Tensor> {
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
pub(super) fn check_new_kv_apart(
    news: [(&Tensor, &str); 2],
    caches: [(&Tensor, &str); 2],
) -> Result<()> {
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
pub(super) fn lengths_after(
    cache_seqlens: &[u32],
    s_new: usize,
    paging: &Paging,
) -> Result<Vec<u32>> {
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
