//! One validated decoding call: every argument, aliasing, block-table and length check runs
//! before the first write, so that an error leaves the cache untouched.

use candle::{bail, Result, Tensor};

use crate::decode::{AppendOp, DecodeOp};
use crate::layout::aligned;
use crate::options::FlashAttn;
use crate::params::{
    self, AppendProblem, AttnShape, DecodeProblem, Indices, Paging, QuantScale, RotaryProblem,
};

use super::args::{device_indices, BlockTable, CacheSeqlens, HostOrDevice};
use super::fp8;
use super::rotary::{self, RotaryCall};

/// Shape of the new keys and values, in messages.
const NEW_KV_DIMS: &str = "(batch, seqlen_new, num_heads_k, head_dim)";

/// How the user laid out the cache (before its shape is read).
#[derive(Clone, Copy)]
pub(super) enum CacheKind<'a> {
    Contiguous,
    Paged {
        block_table: BlockTable<'a>,
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
    append: Option<Append>,
    decode: DecodeProblem,
}

/// The append half of a call: what both caches' appends share, with the new rows. The ops
/// are built only where the append runs apart from the decode launch.
struct Append {
    /// K's append (with the rotary embedding on CUDA) without its quantization.
    problem: AppendProblem,
    /// An FP8 cache: the K and V caches' scales, each append quantizing with its own.
    quant: Option<(QuantScale, QuantScale)>,
    k_new: Tensor,
    v_new: Tensor,
    /// Rotary embedding done with tensor ops before a plain append (the CPU), with the host
    /// starts; on CUDA it is inside `k`.
    cpu_rotary: Option<(RotaryProblem, Vec<u32>)>,
}

impl Call {
    #[allow(clippy::too_many_arguments)] // the public calls' arguments, passed through
    pub(super) fn new(
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
        new_kv: Option<(&Tensor, &Tensor)>,
        cache_seqlens: CacheSeqlens,
        kind: CacheKind,
        opts: &FlashAttn,
        want_lse: bool,
        seqlens_q: Option<CacheSeqlens>,
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
        let fp8 = fp8::check_cache_dtypes(q, (k_cache, kn), (v_cache, vn), d)?;
        let (outer, rows, hk, dk) = k_dims;
        if dk != d {
            bail!("{kn}: head_dim {dk} differs from q's head_dim {d}")
        }
        if hk == 0 || h % hk != 0 {
            bail!("{kn}: num_heads_k {hk} must divide q's num_heads {h} (MQA/GQA)")
        }
        let kv_scales = fp8::call_scales(opts, fp8, q, hk, kn)?;
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
                let block_table = match block_table {
                    HostOrDevice::Host(table) => {
                        if b.checked_mul(max_pages) != Some(table.len()) {
                            bail!(
                                "block_table: expected batch * max_pages = {b} * {max_pages} = {} entries, got {}",
                                b as u128 * max_pages as u128,
                                table.len()
                            )
                        }
                        Indices::Host(table.to_vec())
                    }
                    HostOrDevice::Device(t) => {
                        if outer == 0 {
                            // The kernels clamp unchecked entries to the last page.
                            bail!("{kn}: a device block_table needs at least one page, got shape {:?}", k_cache.dims())
                        }
                        device_indices(t, &[b, max_pages], q, "block_table")?
                    }
                };
                Paging::Paged {
                    page_size: rows,
                    num_pages: outer,
                    max_pages,
                    block_table,
                }
            }
        };
        let starts = match cache_seqlens {
            HostOrDevice::Host(lens) => {
                if lens.len() != b {
                    bail!(
                        "cache_seqlens: expected {b} entries (one per sequence of q), got {}",
                        lens.len()
                    )
                }
                Indices::Host(lens.to_vec())
            }
            HostOrDevice::Device(t) => device_indices(t, &[b], q, "cache_seqlens")?,
        };
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
        let q_lens = match seqlens_q {
            None => None,
            Some(HostOrDevice::Host(lens)) => {
                if lens.len() != b {
                    bail!(
                        "seqlens_q: expected {b} entries (one per sequence of q), got {}",
                        lens.len()
                    )
                }
                if let Some((i, &n)) = lens.iter().enumerate().find(|&(_, &n)| n as usize > s_q) {
                    bail!("seqlens_q: sequence {i} has {n} query tokens, more than q's seqlen_q {s_q}")
                }
                Some(Indices::Host(lens.to_vec()))
            }
            Some(HostOrDevice::Device(t)) => Some(device_indices(t, &[b], q, "seqlens_q")?),
        };
        if q_lens.is_some() && new_kv.is_some() && s_new != s_q {
            bail!(
                "k_new: with seqlens_q each sequence's new tokens are its query tokens, so \
                 seqlen_new ({s_new}) must equal q's seqlen_q ({s_q})"
            )
        }
        // What each sequence grows by: its own query count when ragged.
        let ragged_new = match (&q_lens, new_kv.is_some()) {
            (Some(lens), true) => Some(lens.clone()),
            _ => None,
        };
        let (seqlens, seqlens_add) = match &starts {
            Indices::Host(starts) => {
                let seqlens = match &ragged_new {
                    None => lengths_after(starts, s_new, &paging)?,
                    Some(Indices::Host(adds)) => {
                        lengths_after_each(starts, |b| adds[b] as usize, &paging)?
                    }
                    Some(Indices::Device(_)) => bail!(
                        "seqlens_q: a device tensor needs cache_seqlens on the device too (the \
                         lengths after the append are only known there)"
                    ),
                };
                check_block_table(&paging, &seqlens, kn)?;
                if let (CacheKind::Paged { owned: false, .. }, true) = (kind, s_new > 0) {
                    check_pages_not_shared(&paging, starts, &seqlens)?;
                }
                (Indices::Host(seqlens), 0)
            }
            Indices::Device(t) => {
                // The lengths are the kernels' to read; what the host knows is still checked.
                if s_new > paging.capacity() {
                    bail!(
                        "k_new: {s_new} new tokens per sequence do not fit the cache capacity \
                         of {}",
                        paging.capacity()
                    )
                }
                (Indices::Device(t.clone()), s_new as u32)
            }
        };
        let scale = opts.softmax_scale.unwrap_or(1.0 / (d as f32).sqrt());
        params::check_scale(scale)?;
        if opts.block_mask.is_some() {
            bail!(
                "block_mask: block-sparse attention is not supported by KV-cache decoding; \
                 use FlashAttn::forward"
            )
        }
        if opts.fp8_descales.is_some() || opts.out_dtype.is_some() {
            bail!(
                "fp8_descales / out_dtype: options of FP8 q, k and v in FlashAttn::forward; \
                 KV-cache decoding takes an FP8 cache through kv_cache_scales, with q in its \
                 own dtype; leave them unset"
            )
        }
        let mods = opts.score_mods(&shape, q.device())?;
        let sinks = match &opts.sinks {
            Some(t) => {
                crate::sinks::check(t, q, h)?;
                Some(crate::sinks::values(t)?)
            }
            None => None,
        };
        let rotary = match &opts.rotary {
            Some(r) => Some(rotary::check(
                r,
                &RotaryCall {
                    q,
                    s_q,
                    h,
                    d,
                    s_new,
                    has_new_kv: new_kv.is_some(),
                    q_causal: opts.causal || mods.left.is_some() || mods.right.is_some(),
                    starts: &starts,
                },
            )?),
            None => None,
        };
        let append = new_kv.map(|(k_new, v_new, _)| {
            let (rotary, cpu_rotary) = match (rotary.as_ref(), &starts) {
                (Some(r), Indices::Host(st)) if q.device().is_cpu() => {
                    (None, Some((r.clone(), st.clone())))
                }
                (r, _) => (r.cloned(), None),
            };
            Append {
                problem: AppendProblem {
                    b,
                    s_new,
                    hk,
                    d,
                    start: starts.clone(),
                    new_lens: ragged_new.clone(),
                    paging: paging.clone(),
                    rotary,
                    quant: None,
                },
                quant: kv_scales
                    .as_ref()
                    .map(|s| (QuantScale(s.k.clone()), QuantScale(s.v.clone()))),
                k_new,
                v_new,
                cpu_rotary,
            }
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
            seqlens_add,
            add_q_lens: ragged_new.is_some() && matches!(starts, Indices::Device(_)),
            q_lens,
            paging,
            want_lse,
            sinks,
            kv_scales,
            append: None,
        };
        Ok(Self { append, decode })
    }

    /// Tokens per sequence once the new ones are appended (host lengths only: the
    /// [`super::KvCache`] types track theirs on the host).
    pub(super) fn lengths(&self) -> Result<&[u32]> {
        self.decode.seqlens.host("cache_seqlens")
    }

    /// Writes the new keys and values into the caches, in place. Returns the queries the
    /// attention must use when rotary embedding rotated them.
    fn append(&self, q: &Tensor, k_cache: &Tensor, v_cache: &Tensor) -> Result<Option<Tensor>> {
        let Some(a) = &self.append else {
            return Ok(None);
        };
        let (q_rot, k_new) = match &a.cpu_rotary {
            Some((r, starts)) => (
                Some(rotary::rotate_cpu(q, r, starts, r.q_causal)?),
                rotary::rotate_cpu(&a.k_new, r, starts, true)?,
            ),
            None => (None, a.k_new.clone()),
        };
        // Both ops built before either writes, so an error leaves both caches untouched.
        let (k_quant, v_quant) = a.quant.clone().unzip();
        let k = AppendOp::new(AppendProblem {
            quant: k_quant,
            ..a.problem.clone()
        })?;
        let v = AppendOp::new(AppendProblem {
            rotary: None,
            quant: v_quant,
            ..a.problem.clone()
        })?;
        let q_rot = k.run(k_cache, &k_new)?.or(q_rot);
        crate::failpoint::check("kvcache: between the K and V appends")?;
        v.run(v_cache, &a.v_new)?;
        Ok(q_rot)
    }

    /// The attention of `q` over the (appended) caches, and its LSE when asked for.
    fn attend(
        self,
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
    ) -> Result<(Tensor, Option<Tensor>)> {
        crate::failpoint::check("kvcache: attention")?;
        DecodeOp::new(self.decode).run(&aligned(q)?, k_cache, v_cache)
    }

    /// Validates, appends, attends: on CUDA in one launch where [`Call::fuse_append`] can.
    pub(super) fn run(
        mut self,
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
    ) -> Result<(Tensor, Option<Tensor>)> {
        if self.fuse_append(q) {
            return self.attend(q, k_cache, v_cache);
        }
        let q_rot = self.append(q, k_cache, v_cache)?;
        self.attend(q_rot.as_ref().unwrap_or(q), k_cache, v_cache)
    }

    /// Hands the append to the decode launch (which writes the new rows and rotates q itself)
    /// where that launch has one row tile per K/V head: `s_q * (h / hk)` rows of at most 16,
    /// a decoding step's shape, so that one block per split reads each new key; and at most
    /// 16 new rows. Saves the two append launches of a step (`CANDLE_FLASH_FUSED_APPEND=0`
    /// keeps them).
    #[cfg(feature = "cuda")]
    fn fuse_append(&mut self, q: &Tensor) -> bool {
        let d = &self.decode;
        // Without query rows (a prefill through the cache) there is no decode launch; a long
        // append (a chunk of a prompt) is better spread over its own grid than written by the
        // few blocks whose key ranges hold it.
        let fusable = q.device().is_cuda()
            && !crate::cuda::overrides().fused_append_off
            && d.b * d.s_q > 0
            && d.s_q * (d.h / d.hk) <= DECODE_TILE_ROWS
            && self
                .append
                .as_ref()
                .is_some_and(|a| a.cpu_rotary.is_none() && a.problem.s_new <= DECODE_TILE_ROWS);
        let Some(a) = self.append.take_if(|_| fusable) else {
            return false;
        };
        self.decode.append = Some(crate::params::FusedAppend {
            s_new: a.problem.s_new,
            rotary: a.problem.rotary,
            k_new: a.k_new,
            v_new: a.v_new,
        });
        true
    }

    /// The CPU build appends separately, always.
    #[cfg(not(feature = "cuda"))]
    fn fuse_append(&mut self, _q: &Tensor) -> bool {
        false
    }
}

/// Query rows per decode block (`ROWS` in `cuda/decode/decode.cu`).
#[cfg(feature = "cuda")]
const DECODE_TILE_ROWS: usize = 16;

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
        block_table: Indices::Host(block_table),
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
        block_table: Indices::Host(block_table),
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
    lengths_after_each(cache_seqlens, |_| s_new, paging)
}

/// [`lengths_after`] with `adds(b)` new tokens in sequence `b`.
fn lengths_after_each(
    cache_seqlens: &[u32],
    adds: impl Fn(usize) -> usize,
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
            let s_new = adds(b);
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
