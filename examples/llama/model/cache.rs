//! The KV caches of every layer: candle-flash's contiguous or paged caches (optionally
//! F8E4M3), or the naive path's concatenating one.

use candle::{DType, Device, Result, Tensor};
use candle_flash::{KvCache, Padding, PagedKvCache};

use super::{AttnImpl, Config};

/// The KV cache of one layer, for the attention implementation that uses it.
#[derive(Debug)]
pub enum LayerCache {
    Flash(KvCache),
    Paged(PagedKvCache),
    Naive(NaiveCache),
}

/// The concatenating cache of the naive path: `(batch, kv_heads, keys, head_dim)` tensors
/// whose first `prompt_max` keys are the right-padded prompts (`prompt_lens[b]` real ones)
/// and whose later keys are one per generated token for every sequence.
#[derive(Debug, Default)]
pub struct NaiveCache {
    pub(super) kv: Option<(Tensor, Tensor)>,
    pub(super) prompt_lens: Vec<usize>,
    pub(super) prompt_max: usize,
}

/// The caches of every layer and the number of tokens each sequence holds.
#[derive(Debug)]
pub struct Cache {
    pub(super) layers: Vec<LayerCache>,
    pub(super) lengths: Vec<usize>,
    pub(super) capacity: usize,
    /// Set by [`super::Llama::forward_step_device`]: the lengths the kernels use are then on the
    /// device, and `lengths` is the caller's mirror of them ([`Cache::advance`]); the layers'
    /// own bookkeeping (the `KvCache` lengths, the paged block tables) is left behind, so
    /// eager steps are refused until [`Cache::reset`].
    pub(super) on_device: bool,
}

/// An F8E4M3 cache's per-head scales, allocated once (ones until the prefill calibrates them
/// in place, see [`fill_cache`], so that a CUDA graph captured over the cache keeps reading
/// the live values); `None` for a cache in the model's dtype.
fn unit_fp8_scales(dtype: DType, hk: usize, dev: &Device) -> Result<Option<(Tensor, Tensor)>> {
    if dtype != DType::F8E4M3 {
        return Ok(None);
    }
    let ones = || Tensor::ones(hk, DType::F32, dev);
    Ok(Some((ones()?, ones()?)))
}

/// Headroom of the FP8 scales over the prompt's largest |k| and |v| per head: later tokens
/// may be larger, and past 448 × scale e4m3 saturates.
const FP8_HEADROOM: f64 = 2.0;

/// Sets an FP8 layer cache's scales (in place) from the prompts' keys and values `(n, hk,
/// d)`: each head's largest magnitude times [`FP8_HEADROOM`] maps to e4m3's 448. The cache is
/// empty here, so nothing it holds is reinterpreted.
fn calibrate_fp8(scales: Option<(&Tensor, &Tensor)>, k: &Tensor, v: &Tensor) -> Result<()> {
    let Some((ks, vs)) = scales else {
        return Ok(());
    };
    for (scale, x) in [(ks, k), (vs, v)] {
        let per_head = candle_flash::quant::fp8_scales(
            &x.unsqueeze(0)?,
            candle_flash::quant::Fp8Scaling::PerHead,
        )?;
        scale.slice_set(&(per_head * FP8_HEADROOM)?, 0, 0)?;
    }
    Ok(())
}

/// How the KV cache is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheLayout {
    /// One `(batch, capacity, kv_heads, head_dim)` tensor per layer.
    Contiguous,
    /// A pool of pages of `page_size` tokens, enough for `batch * capacity` tokens.
    Paged { page_size: usize },
}

impl Cache {
    /// An empty cache for `batch` sequences of up to `capacity` tokens each.
    pub fn new(
        cfg: &Config,
        attn: AttnImpl,
        layout: CacheLayout,
        batch: usize,
        capacity: usize,
        dtype: DType,
        dev: &Device,
    ) -> Result<Self> {
        let (hk, d) = (cfg.num_kv_heads(), cfg.head_dim());
        let layers = (0..cfg.num_hidden_layers)
            .map(|_| -> Result<LayerCache> {
                Ok(match (attn, layout) {
                    (AttnImpl::Naive, _) => LayerCache::Naive(NaiveCache::default()),
                    (AttnImpl::Flash, CacheLayout::Contiguous) => {
                        let c = KvCache::new(batch, capacity, hk, d, dtype, dev)?;
                        LayerCache::Flash(match unit_fp8_scales(dtype, hk, dev)? {
                            Some((k, v)) => c.with_scales(k, v)?,
                            None => c,
                        })
                    }
                    (AttnImpl::Flash, CacheLayout::Paged { page_size }) => {
                        let per_seq = capacity.div_ceil(page_size);
                        let c = PagedKvCache::new(
                            batch,
                            batch * per_seq,
                            page_size,
                            per_seq,
                            hk,
                            d,
                            dtype,
                            dev,
                        )?;
                        LayerCache::Paged(match unit_fp8_scales(dtype, hk, dev)? {
                            Some((k, v)) => c.with_scales(k, v)?,
                            None => c,
                        })
                    }
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            layers,
            lengths: vec![0; batch],
            capacity,
            on_device: false,
        })
    }

    /// Tokens held by each sequence.
    pub fn lengths(&self) -> &[usize] {
        &self.lengths
    }

    /// Tokens each sequence can hold.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Empties every sequence, keeping the memory (and its addresses: a CUDA graph captured
    /// over this cache stays valid).
    pub fn reset(&mut self) {
        for layer in &mut self.layers {
            match layer {
                LayerCache::Flash(c) => c.reset(),
                LayerCache::Paged(c) => c.reset(),
                LayerCache::Naive(c) => *c = NaiveCache::default(),
            }
        }
        self.lengths.fill(0);
        self.on_device = false;
    }

    /// Counts one token more in every sequence after a step of
    /// [`super::Llama::forward_step_device`], whose lengths the caller advances on the device.
    pub fn advance(&mut self) {
        for l in &mut self.lengths {
            *l += 1;
        }
    }

    /// Paged caches: the block table `(batch, max_pages)` of a step whose lengths are on the
    /// device ([`DeviceStep::table`]), with its row length. Each sequence keeps the pages it
    /// holds and is given free pages for the rest of its capacity (the pool has exactly
    /// enough), so the table does not change while decoding. Every layer's cache holds the
    /// same pages (same allocations in the same order), which is checked. `None` for other
    /// caches.
    pub fn full_block_table(&self) -> Result<Option<(Vec<u32>, usize)>> {
        let mut out: Option<(Vec<u32>, usize)> = None;
        for layer in &self.layers {
            let LayerCache::Paged(c) = layer else {
                return Ok(None);
            };
            let (mp, ps, pages) = (c.max_pages_per_seq(), c.page_size(), c.num_pages());
            let mut table = c.block_table().to_vec();
            let held: Vec<usize> = c
                .lengths()
                .iter()
                .map(|&l| (l as usize).div_ceil(ps))
                .collect();
            let mut used = vec![false; pages];
            for (b, &n) in held.iter().enumerate() {
                for &page in &table[b * mp..][..n] {
                    used[page as usize] = true;
                }
            }
            let mut free = (0..pages as u32).filter(|&p| !used[p as usize]);
            for (b, &n) in held.iter().enumerate() {
                for entry in &mut table[b * mp + n..(b + 1) * mp] {
                    let Some(page) = free.next() else {
                        candle::bail!("cache: too few pages to give every sequence its capacity")
                    };
                    *entry = page;
                }
            }
            match &out {
                Some((first, _)) if *first != table => {
                    candle::bail!("cache: the layers' paged caches hold different pages")
                }
                Some(_) => {}
                None => out = Some((table, mp)),
            }
        }
        Ok(out)
    }
}

/// The per-sequence inputs of a decoding step kept on the device
/// ([`super::Llama::forward_step_device`]), so that the step uploads nothing and can be captured in
/// a CUDA graph.
#[derive(Clone, Debug)]
pub struct DeviceStep {
    /// `(batch,)` u32: the tokens each sequence's cache holds before the step, in every layer,
    /// which are also the new tokens' positions.
    pub lengths: Tensor,
    /// Paged caches: `(batch, max_pages)` u32, every layer's block table
    /// ([`Cache::full_block_table`]).
    pub table: Option<Tensor>,
}

/// Writes the prompts' keys and values `(n, hk, d)` (packed by `seqlens`) into an empty cache.
pub(super) fn fill_cache(
    cache: &mut LayerCache,
    k: &Tensor,
    v: &Tensor,
    seqlens: &[usize],
) -> Result<()> {
    match cache {
        LayerCache::Flash(c) => {
            calibrate_fp8(c.scales(), k, v)?;
            c.append_varlen(k, v, seqlens)
        }
        LayerCache::Paged(c) => {
            calibrate_fp8(c.scales(), k, v)?;
            c.append_varlen(k, v, seqlens)
        }
        LayerCache::Naive(c) => {
            let max = seqlens.iter().copied().max().unwrap_or(0);
            let pad = Padding::from_lengths(seqlens, max)?;
            let kp = pad.pad(&k.contiguous()?)?.transpose(1, 2)?.contiguous()?; // (b, hk, max, d)
            let vp = pad.pad(&v.contiguous()?)?.transpose(1, 2)?.contiguous()?;
            c.kv = Some((kp, vp));
            c.prompt_lens = seqlens.to_vec();
            c.prompt_max = max;
            Ok(())
        }
    }
}
