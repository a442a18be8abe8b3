//! Ragged appends: a different number of new tokens for each sequence, packed the way
//! [`crate::FlashAttn::forward_varlen`] takes them. This is how a batch of prompts of
//! different lengths fills its caches after a packed (varlen) prefill, with no padding in
//! either.
//!
//! The rows are copied with Candle's `slice_set` (one copy per sequence and page run), on any
//! device and dtype: a prefill writes each cache row once, so a dedicated kernel would save
//! only launches.

use candle::{bail, DType, Result, Tensor};

use super::call::check_new_kv_apart;
use super::contiguous::KvCache;
use super::fp8;
use super::paged::PagedKvCache;
use crate::params;

/// The checked shape of a ragged append: the new length of every sequence.
fn check(
    cache: &Tensor,
    v_cache: &Tensor,
    k_new: &Tensor,
    v_new: &Tensor,
    seqlens_new: &[usize],
    lengths: &[u32],
    capacity: usize,
) -> Result<Vec<u32>> {
    let (_, _, hk, d) = cache.dims4()?;
    let Some(total) = seqlens_new
        .iter()
        .try_fold(0usize, |t, &n| t.checked_add(n))
    else {
        bail!("seqlens_new: the sum of {seqlens_new:?} overflows")
    };
    let want = [total, hk, d];
    for (t, name) in [(k_new, "k_new"), (v_new, "v_new")] {
        if t.dims() != want {
            bail!(
                "{name}: expected (total={total}, num_heads_k={hk}, head_dim={d}) for \
                 seqlens_new {seqlens_new:?}, got shape {:?}",
                t.dims()
            )
        }
        if cache.dtype() == DType::F8E4M3 {
            // An FP8 cache takes rows in a dtype its calls take for q (quantized on the way).
            params::check_dtype(cache.device(), t.dtype(), &format!("{name}: dtype"))?;
        } else if t.dtype() != cache.dtype() {
            bail!(
                "{name}: dtype {:?} differs from the cache's {:?}",
                t.dtype(),
                cache.dtype()
            )
        }
        if !t.device().same_device(cache.device()) {
            bail!("{name}: on another device than the cache")
        }
    }
    check_new_kv_apart(
        [(k_new, "k_new"), (v_new, "v_new")],
        [(cache, "the cache's keys"), (v_cache, "the cache's values")],
    )?;
    if seqlens_new.len() != lengths.len() {
        bail!(
            "seqlens_new: {} entries for a cache of {} sequences",
            seqlens_new.len(),
            lengths.len()
        )
    }
    lengths
        .iter()
        .zip(seqlens_new)
        .enumerate()
        .map(
            |(b, (&len, &n))| match (len as usize).checked_add(n).map(|a| (a, u32::try_from(a))) {
                Some((after, Ok(a))) if after <= capacity => Ok(a),
                _ => bail!(
                    "seqlens_new: sequence {b} would hold {len} + {n} = {} tokens, more than \
                     the cache capacity of {capacity}",
                    len as u128 + n as u128
                ),
            },
        )
        .collect()
}

/// `x` `(rows, ...)` viewed as one tall matrix of rows that shares its storage.
fn rows_view(x: &Tensor) -> Result<Tensor> {
    let (a, b, hk, d) = x.dims4()?;
    // A contiguous reshape is a view: slice_set on it writes into the cache itself.
    x.reshape((a * b, hk, d))
}

impl KvCache {
    /// Appends `seqlens_new[b]` tokens to sequence `b` (0 is fine): `k_new` and `v_new` are
    /// `(total, num_heads_k, head_dim)` with sequence 0's rows first, then sequence 1's, as
    /// [`crate::FlashAttn::forward_varlen`] takes them. No attention runs: this is the cache
    /// fill after a packed prefill of prompts of different lengths.
    ///
    /// An FP8 cache takes rows of any dtype its calls take for q and stores them quantized
    /// with its scales ([`KvCache::with_scales`]), the bytes [`KvCache::append_and_attend`]
    /// would write.
    ///
    /// Errors (nothing is written and the lengths are unchanged): shapes, dtype or device
    /// unlike the cache's, `seqlens_new` not one entry per sequence, a sequence over capacity,
    /// an FP8 cache without scales.
    ///
    /// ```
    /// # fn main() -> candle::Result<()> {
    /// use candle::{DType, Device, Tensor};
    /// use candle_flash::KvCache;
    /// let dev = Device::Cpu;
    /// let mut cache = KvCache::new(2, 64, 2, 32, DType::F32, &dev)?;
    /// let k = Tensor::randn(0f32, 1.0, (7, 2, 32), &dev)?; // 5 tokens, then 2
    /// cache.append_varlen(&k, &k, &[5, 2])?;
    /// assert_eq!(cache.lengths(), &[5, 2]);
    /// # Ok(()) }
    /// ```
    pub fn append_varlen(
        &mut self,
        k_new: &Tensor,
        v_new: &Tensor,
        seqlens_new: &[usize],
    ) -> Result<()> {
        let capacity = self.capacity();
        let lengths = check(
            &self.k,
            &self.v,
            k_new,
            v_new,
            seqlens_new,
            &self.lengths,
            capacity,
        )?;
        let (k_new, v_new) =
            &fp8::cache_rows(&self.k, self.scales.as_ref(), k_new, v_new, "KvCache")?;
        let (k_rows, v_rows) = (rows_view(&self.k)?, rows_view(&self.v)?);
        let mut start = 0;
        for (b, &n) in seqlens_new.iter().enumerate() {
            if n > 0 {
                let row = b * capacity + self.lengths[b] as usize;
                k_rows.slice_set(&k_new.narrow(0, start, n)?.contiguous()?, 0, row)?;
                crate::failpoint::check("append_varlen: between K and V")?;
                v_rows.slice_set(&v_new.narrow(0, start, n)?.contiguous()?, 0, row)?;
            }
            start += n;
        }
        self.lengths = lengths;
        Ok(())
    }
}

impl PagedKvCache {
    /// [`KvCache::append_varlen`] for a paged cache: takes the pages each sequence needs
    /// from the free list, then copies the rows into them.
    ///
    /// Errors: those of [`KvCache::append_varlen`] and "out of pages"; on error nothing is
    /// written, no page is taken and the lengths are unchanged.
    pub fn append_varlen(
        &mut self,
        k_new: &Tensor,
        v_new: &Tensor,
        seqlens_new: &[usize],
    ) -> Result<()> {
        let capacity = self.capacity();
        let lengths = check(
            &self.k,
            &self.v,
            k_new,
            v_new,
            seqlens_new,
            &self.lengths,
            capacity,
        )?;
        let (k_new, v_new) =
            &fp8::cache_rows(&self.k, self.scales.as_ref(), k_new, v_new, "PagedKvCache")?;
        let (table, free) = self.allocate_for(&lengths)?;
        let (k_rows, v_rows) = (rows_view(&self.k)?, rows_view(&self.v)?);
        let ps = self.page_size;
        let mut start = 0;
        for (b, &n) in seqlens_new.iter().enumerate() {
            let page_of = |pos: usize| table[b * self.max_pages + pos / ps] as usize;
            let mut pos = self.lengths[b] as usize;
            let end = pos + n;
            while pos < end {
                // One copy per run of pages that are adjacent in the pool (a fresh pool hands
                // them out in order, so a prefill is usually one copy per sequence).
                let row = page_of(pos) * ps + pos % ps;
                let mut run = (ps - pos % ps).min(end - pos);
                while pos + run < end && page_of(pos + run) * ps == row + run {
                    run += ps.min(end - pos - run);
                }
                k_rows.slice_set(&k_new.narrow(0, start, run)?.contiguous()?, 0, row)?;
                crate::failpoint::check("append_varlen: between K and V")?;
                v_rows.slice_set(&v_new.narrow(0, start, run)?.contiguous()?, 0, row)?;
                (pos, start) = (pos + run, start + run);
            }
        }
        self.lengths = lengths;
        self.block_table = table;
        self.free = free;
        Ok(())
    }
}
