//! [`PagedKvCache`]: a pool of pages shared by the sequences of one layer, handed out from a
//! free list as they grow.

use candle::{bail, DType, Device, Result, Tensor};

use super::alloc_checks::{check_cache_args, check_fits_u32};
use super::args::HostOrDevice;
use super::call::{lengths_after, CacheKind, Call};
use super::fp8;
use crate::options::{FlashAttn, KvCacheScales};
use crate::params::{self, Paging};

/// A paged KV cache for one attention layer: a pool of `num_pages` pages of `page_size`
/// tokens shared by `batch` sequences, handed out as sequences grow (a free list) and
/// returned by [`PagedKvCache::reset_sequence`]. Memory follows the tokens actually held
/// rather than `batch × capacity`.
///
/// The same interface as [`KvCache`]; attention runs through
/// [`flash_attn_with_paged_kvcache`] with this cache's block table.
///
/// [`KvCache`]: super::KvCache
/// [`flash_attn_with_paged_kvcache`]: super::flash_attn_with_paged_kvcache
#[derive(Debug)]
pub struct PagedKvCache {
    pub(super) k: Tensor,
    pub(super) v: Tensor,
    pub(super) lengths: Vec<u32>,
    pub(super) page_size: usize,
    pub(super) max_pages: usize,
    /// `(batch, max_pages)`; sequence `b` holds pages `block_table[b * max_pages + p]` for
    /// `p < ceil(lengths[b] / page_size)`; the other entries are 0 and unused.
    pub(super) block_table: Vec<u32>,
    /// Free pages; the next one handed out is the last.
    pub(super) free: Vec<u32>,
    /// An FP8 pool's per-head scales ([`PagedKvCache::with_scales`]).
    pub(super) scales: Option<KvCacheScales>,
}

impl PagedKvCache {
    /// A zero-filled pool `(num_pages, page_size, num_heads_k, head_dim)` of `dtype` on
    /// `device` for `batch` sequences of up to `max_pages_per_seq * page_size` tokens each,
    /// every sequence empty and every page free. Dtypes as for [`KvCache::new`]: an F8E4M3
    /// pool needs [`PagedKvCache::with_scales`].
    ///
    /// Errors: `page_size == 0`, a `num_pages` or capacity that does not fit u32, a `batch`
    /// past i32, a block table that cannot fit in memory, an F8E4M3 pool on CUDA whose
    /// head_dim is not a multiple of 16, and allocation errors.
    ///
    /// [`KvCache::new`]: super::KvCache::new
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
            scales: None,
        })
    }

    /// Gives an F8E4M3 pool its per-head scales, as [`KvCache::with_scales`] does.
    ///
    /// Errors: a pool that is not F8E4M3; scales that are not F32 `(num_heads_k,)` on the
    /// pool's device.
    ///
    /// [`KvCache::with_scales`]: super::KvCache::with_scales
    pub fn with_scales(mut self, k_scale: Tensor, v_scale: Tensor) -> Result<Self> {
        self.scales = Some(fp8::cache_scales(
            &self.k,
            &k_scale,
            &v_scale,
            "PagedKvCache",
        )?);
        Ok(self)
    }

    /// The K and V scales of an FP8 pool ([`PagedKvCache::with_scales`]); `None` otherwise.
    pub fn scales(&self) -> Option<(&Tensor, &Tensor)> {
        self.scales.as_ref().map(|s| (&s.k, &s.v))
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
            block_table: params::Indices::Host(Vec::new()),
        };
        let lengths = lengths_after(&self.lengths, s_new, &paging)?;
        self.allocate_for(&lengths)
    }

    /// The block table and free list once every sequence `b` holds `lengths[b]` tokens
    /// (at least as many as now). Errors: too few free pages.
    pub(super) fn allocate_for(&self, lengths: &[u32]) -> Result<(Vec<u32>, Vec<u32>)> {
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
    /// too few free pages; `kv_cache_scales` set in `opts`, or an FP8 pool without scales
    /// (as for [`KvCache::append_and_attend`]). On error nothing is written, no page is taken
    /// and the lengths are unchanged.
    ///
    /// [`KvCache::append_and_attend`]: super::KvCache::append_and_attend
    /// [`flash_attn_with_paged_kvcache`]: super::flash_attn_with_paged_kvcache
    pub fn append_and_attend(
        &mut self,
        q: &Tensor,
        k_new: &Tensor,
        v_new: &Tensor,
        opts: &FlashAttn,
    ) -> Result<Tensor> {
        let opts = &*fp8::cache_opts(opts, &self.k, self.scales.as_ref(), "PagedKvCache")?;
        // A k_new of the wrong rank allocates nothing; the call below reports it.
        let s_new = match k_new.dims() {
            &[_, s_new, _, _] => s_new,
            _ => 0,
        };
        let (table, free) = self.allocate(s_new)?;
        let kind = CacheKind::Paged {
            block_table: HostOrDevice::Host(&table),
            max_pages: self.max_pages,
            owned: true,
        };
        let new_kv = Some((k_new, v_new));
        let lens = HostOrDevice::Host(&self.lengths);
        let call = Call::new(q, &self.k, &self.v, new_kv, lens, kind, opts, false, None)?;
        let lengths = call.lengths()?.to_vec();
        // As in KvCache: pages and lengths are committed after the attention ran (the pages
        // written by a failed call are still free).
        let (out, _) = call.run(q, &self.k, &self.v)?;
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
    ///
    /// [`flash_attn_with_paged_kvcache`]: super::flash_attn_with_paged_kvcache
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
