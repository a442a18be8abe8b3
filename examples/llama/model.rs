//! A LLaMA-style decoder (RMSNorm, rotary embeddings, GQA attention, SwiGLU MLP) whose
//! attention runs through candle-flash. Shared by the inference example (`examples/llama`),
//! the fine-tuning example (`examples/finetune`) and their tests.
//!
//! Every forward call works on a flat list of tokens `(n, hidden)` with one position each,
//! which is what lets one code path serve three cases without padding:
//! - a packed batch of prompts or training documents ([`Llama::forward_packed`]): the
//!   sequences of a [`candle_flash::VarLen`] one after another, attention by
//!   `forward_varlen` (causal), so no token sees another sequence and no work is spent on pad;
//! - a decoding step ([`Llama::forward_step`]): one new token per sequence, attention over
//!   each sequence's KV cache ([`candle_flash::KvCache`] or [`candle_flash::PagedKvCache`]),
//!   appended in place; [`Llama::forward_step_device`] is the same step with its lengths and
//!   positions on the device (no upload, no read-back), which graph.rs captures in a CUDA graph;
//! - the same two with [`AttnImpl::Naive`]: plain Candle attention (scores, mask, softmax,
//!   `repeat_kv`) and a cache grown by concatenation, for comparison.

use std::collections::HashMap;

use candle::{DType, Device, Module, Result, Tensor, D};
use candle_flash::{FlashAttn, KvCache, Padding, PagedKvCache, VarLen};
use candle_nn::VarBuilder;

#[path = "config.rs"]
mod config;
#[allow(unused_imports)] // normalized_json: the candle-transformers baseline and tests
pub use config::{normalized_json, Config, RopeScaling, TokenIds};

/// How attention is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttnImpl {
    /// candle-flash: `forward_varlen` for packed sequences, the KV-cache kernels for steps.
    Flash,
    /// Plain Candle ops: scores, additive mask, softmax in f32, `repeat_kv` for GQA, and a
    /// cache grown with `Tensor::cat` (what Candle models do without this crate).
    Naive,
}

/// Options of a training forward pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct TrainOpts {
    /// Dropout on the attention probabilities (flash: regenerated in its backward).
    pub attn_dropout: f32,
    /// Seed of that dropout; each layer uses `seed + layer`.
    pub seed: u64,
    /// Bitwise repeatable gradients: flash attention's `deterministic(true)` and the
    /// embedding's sorted backward (`train::embedding_deterministic`).
    pub deterministic: bool,
}

/// A linear map `x W^T (+ b)` with an optional low-rank adapter `+ scale * (x A^T) B^T`
/// (LoRA). Weights are kept in their stored dtype (f32 master weights when training) and
/// cast to the activations' dtype at use, the way mixed precision does it.
#[derive(Clone, Debug)]
pub struct Proj {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
    pub lora: Option<Lora>,
}

/// A LoRA adapter of one projection: `a` `(rank, in)`, `b` `(out, rank)`, `scale = alpha / rank`.
#[derive(Clone, Debug)]
pub struct Lora {
    pub a: Tensor,
    pub b: Tensor,
    pub scale: f64,
}

impl Proj {
    fn load(vb: &VarBuilder, out: usize, inp: usize, bias: bool) -> Result<Self> {
        let weight = vb.get_with_hints((out, inp), "weight", init_normal())?;
        let bias = if bias {
            Some(vb.get_with_hints(out, "bias", candle_nn::Init::Const(0.0))?)
        } else {
            None
        };
        Ok(Self {
            weight,
            bias,
            lora: None,
        })
    }

    /// `x` is `(n, in)`. A decoding step's few rows stream the weight in one kernel
    /// (`candle_flash::infer::linear`), which is Candle's matmul for everything else.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dt = x.dtype();
        let mut y = candle_flash::infer::linear(x, &self.weight.to_dtype(dt)?, None)?;
        if let Some(b) = &self.bias {
            y = y.broadcast_add(&b.to_dtype(dt)?)?;
        }
        if let Some(l) = &self.lora {
            let low = x.matmul(&l.a.to_dtype(dt)?.t()?)?;
            let delta = low.matmul(&l.b.to_dtype(dt)?.t()?)?;
            y = (y + (delta * l.scale)?)?;
        }
        Ok(y)
    }
}

impl Proj {
    /// `forward(norm(x))`: one launch for both at a decoding step's few rows
    /// (`candle_flash::infer::rms_norm_linear`), where the projection has no bias or adapter.
    fn forward_normed(&self, x: &Tensor, norm: Option<&RmsNorm>) -> Result<Tensor> {
        match norm {
            Some(n) if self.bias.is_none() && self.lora.is_none() => {
                let dt = x.dtype();
                let w = self.weight.to_dtype(dt)?;
                candle_flash::infer::rms_norm_linear(x, &n.weight.to_dtype(dt)?, n.eps as f32, &w)
            }
            Some(n) => self.forward(&n.forward(x, false)?),
            None => self.forward(x),
        }
    }

    /// `forward(x) + residual`, the add in the product's epilogue where it has no bias or
    /// adapter (`candle_flash::infer::linear`'s `add`).
    fn forward_add(&self, x: &Tensor, residual: Option<&Tensor>) -> Result<Tensor> {
        match residual {
            Some(r) if self.bias.is_none() && self.lora.is_none() => {
                candle_flash::infer::linear(x, &self.weight.to_dtype(x.dtype())?, Some(r))
            }
            Some(r) => self.forward(x)? + r,
            None => self.forward(x),
        }
    }
}

fn init_normal() -> candle_nn::Init {
    candle_nn::Init::Randn {
        mean: 0.0,
        stdev: 0.02,
    }
}

/// RMSNorm: Candle's fused kernel for inference (inside the projection after it at a
/// decoding step's few rows: `Proj::forward_normed`; fused with the residual add before it
/// otherwise: `add_forward`), `candle_flash::train::rms_norm` (which has a backward) for
/// training.
#[derive(Clone, Debug)]
pub struct RmsNorm {
    pub weight: Tensor,
    eps: f64,
}

impl RmsNorm {
    fn load(vb: &VarBuilder, size: usize, eps: f64) -> Result<Self> {
        let weight = vb.get_with_hints(size, "weight", candle_nn::Init::Const(1.0))?;
        Ok(Self { weight, eps })
    }

    fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        if train {
            // One op with its own backward, the f32 master weight read as it is.
            return candle_flash::train::rms_norm(x, &self.weight, self.eps as f32);
        }
        candle_nn::ops::rms_norm(x, &self.weight.to_dtype(x.dtype())?, self.eps as f32)
    }

    /// `(residual + x, the norm of that sum)` in one kernel, for inference.
    fn add_forward(&self, x: &Tensor, residual: &Tensor) -> Result<(Tensor, Tensor)> {
        let w = match self.weight.dtype() {
            DType::F32 => self.weight.clone(),
            _ => self.weight.to_dtype(x.dtype())?,
        };
        candle_flash::train::add_rms_norm(x, residual, &w, self.eps as f32)
    }
}

/// Rotary embedding tables `(max_positions, head_dim / 2)`, computed from the configured
/// inverse frequencies (LLaMA 3 scaling included), in f32 and, for inference, also in the
/// model dtype (gathered without a conversion per step).
#[derive(Clone, Debug)]
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
    /// The tables in the activations' dtype, when it is not the tables' own.
    cast: Option<(Tensor, Tensor)>,
}

impl Rope {
    pub fn new(cfg: &Config, max_positions: usize, dtype: DType, dev: &Device) -> Result<Self> {
        let inv = cfg.rope_inv_freq();
        let half = inv.len();
        let mut cos = Vec::with_capacity(max_positions * half);
        let mut sin = Vec::with_capacity(max_positions * half);
        for p in 0..max_positions {
            for f in &inv {
                // f32 angles, as Hugging Face computes them, then cos/sin.
                let angle = (p as f32 * *f as f32) as f64;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        let shape = (max_positions, half);
        Ok(Self {
            cos: Tensor::from_vec(cos, shape, dev)?.to_dtype(dtype)?,
            sin: Tensor::from_vec(sin, shape, dev)?.to_dtype(dtype)?,
            cast: None,
        })
    }

    /// Keeps a copy of the tables in `dtype` too (the same values: the conversion commutes
    /// with the gather), so that [`Rope::at`] in that dtype is one launch per table.
    fn with_cast(mut self, dtype: DType) -> Result<Self> {
        if dtype != self.cos.dtype() {
            self.cast = Some((self.cos.to_dtype(dtype)?, self.sin.to_dtype(dtype)?));
        }
        Ok(self)
    }

    pub fn max_positions(&self) -> usize {
        self.cos.dim(0).unwrap_or(0)
    }

    /// The tables at each token's position, `(n, head_dim / 2)` each in `dtype`.
    fn at(&self, positions: &Tensor, dtype: DType) -> Result<(Tensor, Tensor)> {
        if let Some((cos, sin)) = self.cast.as_ref().filter(|(c, _)| c.dtype() == dtype) {
            return Ok((
                cos.index_select(positions, 0)?,
                sin.index_select(positions, 0)?,
            ));
        }
        Ok((
            self.cos.index_select(positions, 0)?.to_dtype(dtype)?,
            self.sin.index_select(positions, 0)?.to_dtype(dtype)?,
        ))
    }

    /// Rotates `x` `(n, heads, head_dim)` (non-interleaved halves, as LLaMA checkpoints
    /// are stored) with the tables of [`Rope::at`]. Inference uses Candle's fused `rope_thd`
    /// (tables in the model dtype; no backward); training `candle_flash::train::rotary`
    /// (f32 tables; differentiable).
    fn apply(&self, x: &Tensor, cos: &Tensor, sin: &Tensor, train: bool) -> Result<Tensor> {
        if train {
            return candle_flash::train::rotary(x, cos, sin);
        }
        let x4 = x.unsqueeze(0)?.contiguous()?;
        candle_nn::rotary_emb::rope_thd(&x4, cos, sin)?.squeeze(0)
    }
}

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
    kv: Option<(Tensor, Tensor)>,
    prompt_lens: Vec<usize>,
    prompt_max: usize,
}

/// The caches of every layer and the number of tokens each sequence holds.
#[derive(Debug)]
pub struct Cache {
    layers: Vec<LayerCache>,
    lengths: Vec<usize>,
    capacity: usize,
    /// Set by [`Llama::forward_step_device`]: the lengths the kernels use are then on the
    /// device, and `lengths` is the caller's mirror of them ([`Cache::advance`]); the layers'
    /// own bookkeeping (the `KvCache` lengths, the paged block tables) is left behind, so
    /// eager steps are refused until [`Cache::reset`].
    on_device: bool,
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
    /// [`Llama::forward_step_device`], whose lengths the caller advances on the device.
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
/// ([`Llama::forward_step_device`]), so that the step uploads nothing and can be captured in
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

/// How the tokens of one forward call are grouped.
enum Pass<'a> {
    /// Whole sequences packed one after another, attending causally within each; with a
    /// cache, they are the prompts and fill it.
    Packed {
        varlen: &'a VarLen,
        seqlens: &'a [usize],
        train: Option<TrainOpts>,
    },
    /// One new token for every sequence of the cache, at the lengths the cache's layers keep
    /// on the host, or at those of a [`DeviceStep`].
    Step(Option<&'a DeviceStep>),
}

/// The projections of one forward call: q `(n, h, d)`, k and v `(n, hk, d)`. With stacked
/// weights they are views of one matmul's output (no copies), and `qk` `(n, h + hk, d)` views
/// q and k together, for one rotary launch.
struct Qkv {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    qk: Option<Tensor>,
}

#[derive(Clone, Debug)]
struct Attention {
    q: Proj,
    k: Proj,
    v: Proj,
    o: Proj,
    /// q, k and v weights stacked, for one matmul in inference.
    qkv: Option<Proj>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: f64,
}

impl Attention {
    fn load(vb: &VarBuilder, cfg: &Config) -> Result<Self> {
        let (h, hk, d) = (cfg.num_attention_heads, cfg.num_kv_heads(), cfg.head_dim());
        let e = cfg.hidden_size;
        Ok(Self {
            q: Proj::load(&vb.pp("q_proj"), h * d, e, cfg.qkv_bias())?,
            k: Proj::load(&vb.pp("k_proj"), hk * d, e, cfg.qkv_bias())?,
            v: Proj::load(&vb.pp("v_proj"), hk * d, e, cfg.qkv_bias())?,
            o: Proj::load(&vb.pp("o_proj"), e, h * d, cfg.o_bias())?,
            qkv: None,
            heads: h,
            kv_heads: hk,
            head_dim: d,
            scale: 1.0 / (d as f64).sqrt(),
        })
    }

    fn fuse(&mut self) -> Result<()> {
        let (q, k, v) = (&self.q, &self.k, &self.v);
        if q.lora.is_some() || k.lora.is_some() || v.lora.is_some() {
            self.qkv = None;
            return Ok(());
        }
        let weight = Tensor::cat(&[&q.weight, &k.weight, &v.weight], 0)?;
        let bias = match (&q.bias, &k.bias, &v.bias) {
            (Some(a), Some(b), Some(c)) => Some(Tensor::cat(&[a, b, c], 0)?),
            _ => None,
        };
        let fused = Proj {
            weight,
            bias,
            lora: None,
        };
        let (hq, hk) = (self.heads * self.head_dim, self.kv_heads * self.head_dim);
        [self.q, self.k, self.v] = split_rows(&fused, &[hq, hk, hk])?;
        self.qkv = Some(fused);
        Ok(())
    }

    /// q, k and v of `x`, normalised by `norm` first where given.
    fn project(&self, x: &Tensor, norm: Option<&RmsNorm>) -> Result<Qkv> {
        let n = x.dim(0)?;
        let (h, hk, d) = (self.heads, self.kv_heads, self.head_dim);
        let normed;
        let x = match (norm, &self.qkv) {
            (Some(_), Some(_)) | (None, _) => x,
            (Some(nm), None) => {
                normed = nm.forward(x, false)?;
                &normed
            }
        };
        Ok(match &self.qkv {
            Some(qkv) => {
                let y = qkv.forward_normed(x, norm)?.reshape((n, h + 2 * hk, d))?;
                Qkv {
                    q: y.narrow(1, 0, h)?,
                    k: y.narrow(1, h, hk)?,
                    v: y.narrow(1, h + hk, hk)?,
                    qk: Some(y.narrow(1, 0, h + hk)?),
                }
            }
            None => Qkv {
                q: self.q.forward(x)?.reshape((n, h, d))?,
                k: self.k.forward(x)?.reshape((n, hk, d))?,
                v: self.v.forward(x)?.reshape((n, hk, d))?,
                qk: None,
            },
        })
    }

    /// q and k rotated to their tokens' positions: in inference one launch over both where
    /// they are views of one projection (`rope_thd` rotates each head alike, so this is the
    /// two launches' result bit for bit), else one each.
    fn rotate(
        &self,
        p: &Qkv,
        rope: &Rope,
        (cos, sin): &(Tensor, Tensor),
        train: bool,
    ) -> Result<(Tensor, Tensor)> {
        match (&p.qk, train) {
            (Some(qk), false) => {
                let qk = rope.apply(qk, cos, sin, false)?;
                Ok((
                    qk.narrow(1, 0, self.heads)?,
                    qk.narrow(1, self.heads, self.kv_heads)?,
                ))
            }
            _ => Ok((
                rope.apply(&p.q, cos, sin, train)?,
                rope.apply(&p.k, cos, sin, train)?,
            )),
        }
    }

    /// A decoding step's attention, one token per sequence: q and k rotated, k and v appended
    /// to each sequence's cache at its length, q attending to the cache. Returns
    /// `(b, 1, h, d)`. The rotation is done here so that moving it into the cache append
    /// (FlashAttention's `rotary_cos`/`rotary_sin`, which take the whole tables and each
    /// sequence's length as its position) changes this function only.
    fn step(
        &self,
        p: &Qkv,
        rope: &Rope,
        cos_sin: Option<&(Tensor, Tensor)>,
        cache: &mut LayerCache,
        on_device: Option<&DeviceStep>,
    ) -> Result<Tensor> {
        let opts = FlashAttn::new()
            .causal(true)
            .softmax_scale(self.scale as f32);
        // On the device the rotation happens inside the cache append (the f32 tables, at each
        // sequence's cache length): q and k go in as projected.
        let (q, k, opts) = match on_device {
            Some(_) => (
                p.q.clone(),
                p.k.clone(),
                opts.rotary(&rope.cos, &rope.sin, false),
            ),
            None => {
                let Some(cos_sin) = cos_sin else {
                    candle::bail!("a host step needs the rotary rows of its positions")
                };
                let (q, k) = self.rotate(p, rope, cos_sin, false)?;
                (q, k, opts)
            }
        };
        // (b, 1, heads, d) views: the kernels read strided rows, nothing is copied.
        let (q, k, v) = (q.unsqueeze(1)?, k.unsqueeze(1)?, p.v.unsqueeze(1)?);
        let new_kv = Some((&k, &v));
        match (cache, on_device) {
            (LayerCache::Flash(c), None) => c.append_and_attend(&q, &k, &v, &opts),
            (LayerCache::Paged(c), None) => c.append_and_attend(&q, &k, &v, &opts),
            (LayerCache::Naive(c), None) => self.naive_step(c, &q, &k, &v),
            (LayerCache::Flash(c), Some(s)) => {
                let opts = match c.scales() {
                    Some((ks, vs)) => opts.kv_cache_scales(ks, vs),
                    None => opts,
                };
                candle_flash::flash_attn_with_kvcache(&q, c.k(), c.v(), new_kv, &s.lengths, &opts)
            }
            (LayerCache::Paged(c), Some(s)) => {
                let Some(table) = &s.table else {
                    candle::bail!("a device step over a paged cache needs its block table")
                };
                let pages = c.max_pages_per_seq();
                let opts = match c.scales() {
                    Some((ks, vs)) => opts.kv_cache_scales(ks, vs),
                    None => opts,
                };
                candle_flash::flash_attn_with_paged_kvcache(
                    &q,
                    c.k(),
                    c.v(),
                    new_kv,
                    &s.lengths,
                    table,
                    pages,
                    &opts,
                )
            }
            (LayerCache::Naive(_), Some(_)) => {
                candle::bail!("a device step needs flash attention (--attention flash)")
            }
        }
    }

    /// The attention of `x` (normalised by `norm` first where given; `residual` added to the
    /// output projection where given).
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        x: &Tensor,
        norm: Option<&RmsNorm>,
        residual: Option<&Tensor>,
        rope: &Rope,
        cos_sin: Option<&(Tensor, Tensor)>,
        pass: &Pass,
        attn: AttnImpl,
        cache: Option<&mut LayerCache>,
        layer: usize,
    ) -> Result<Tensor> {
        let n = x.dim(0)?;
        let p = self.project(x, norm)?;
        let y = match pass {
            Pass::Packed {
                varlen,
                seqlens,
                train,
            } => {
                let Some(cos_sin) = cos_sin else {
                    candle::bail!("a packed pass needs the rotary rows of its positions")
                };
                let (q, k) = self.rotate(&p, rope, cos_sin, train.is_some())?;
                let v = &p.v;
                let y = match attn {
                    AttnImpl::Flash => {
                        let mut opts = FlashAttn::new()
                            .causal(true)
                            .softmax_scale(self.scale as f32)
                            .deterministic(train.is_some_and(|t| t.deterministic));
                        if let Some(t) = train.filter(|t| t.attn_dropout > 0.0) {
                            opts = opts.dropout(t.attn_dropout).seed(t.seed + layer as u64);
                        }
                        opts.forward_varlen(&q, &k, v, varlen)?
                    }
                    AttnImpl::Naive => {
                        let p = train.map(|t| t.attn_dropout).unwrap_or(0.0);
                        self.naive_packed(&q, &k, v, seqlens, p)?
                    }
                };
                if let Some(cache) = cache {
                    fill_cache(cache, &k, v, seqlens)?;
                }
                y
            }
            Pass::Step(on_device) => {
                let Some(cache) = cache else {
                    candle::bail!("a decoding step needs a cache")
                };
                self.step(&p, rope, cos_sin, cache, *on_device)?
            }
        };
        self.o
            .forward_add(&y.reshape((n, self.heads * self.head_dim))?, residual)
    }

    /// `(b, s, hk, d)` → `(b, h, s, d)` with each K/V head copied for its query heads.
    fn repeat_kv(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.transpose(1, 2)?;
        let group = self.heads / self.kv_heads;
        if group == 1 {
            return x.contiguous();
        }
        let (b, hk, s, d) = x.dims4()?;
        x.unsqueeze(2)?
            .broadcast_as((b, hk, group, s, d))?
            .reshape((b, hk * group, s, d))
    }

    /// dropout(softmax(q k^T * scale + mask)) v in plain ops: q `(b, sq, h, d)`, k and v
    /// `(b, h, sk, d)` (heads repeated), mask broadcast to `(b, h, sq, sk)`. Returns
    /// `(b, sq, h, d)`.
    fn naive_core(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &Tensor,
        dropout: f32,
    ) -> Result<Tensor> {
        let dt = q.dtype();
        let q = q.transpose(1, 2)?.contiguous()?;
        let scores = (q.matmul(&k.t()?)? * self.scale)?.to_dtype(DType::F32)?;
        let scores = scores.broadcast_add(mask)?;
        let mut p = candle_nn::ops::softmax(&scores, D::Minus1)?.to_dtype(dt)?;
        if dropout > 0.0 {
            p = candle_nn::ops::dropout(&p, dropout)?;
        }
        p.matmul(v)?.transpose(1, 2)
    }

    fn naive_packed(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        seqlens: &[usize],
        dropout: f32,
    ) -> Result<Tensor> {
        let max = seqlens.iter().copied().max().unwrap_or(0);
        let pad = Padding::from_lengths(seqlens, max)?;
        // Padding scatters contiguous rows (q, k and v may be views of one projection).
        let pad_rows = |t: &Tensor| pad.pad(&t.contiguous()?);
        let (qp, kp, vp) = (pad_rows(q)?, pad_rows(k)?, pad_rows(v)?);
        let mask = packed_mask(seqlens, max, q.device())?;
        let (kr, vr) = (self.repeat_kv(&kp)?, self.repeat_kv(&vp)?);
        let y = self.naive_core(&qp, &kr, &vr, &mask, dropout)?;
        pad.unpad(&y.contiguous()?)
    }

    fn naive_step(
        &self,
        cache: &mut NaiveCache,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Tensor> {
        let (k, v) = (k.transpose(1, 2)?, v.transpose(1, 2)?); // (b, hk, 1, d)
        let (k, v) = match &cache.kv {
            Some((ck, cv)) => (Tensor::cat(&[ck, &k], 2)?, Tensor::cat(&[cv, &v], 2)?),
            None => (k.contiguous()?, v.contiguous()?),
        };
        cache.kv = Some((k.clone(), v.clone()));
        let keys = k.dim(2)?;
        let b = q.dim(0)?;
        // Key j of sequence b is real when it is one of its prompt tokens or a generated one.
        let mut mask = vec![0f32; b * keys];
        for (s, row) in mask.chunks_mut(keys).enumerate() {
            let plen = cache.prompt_lens.get(s).copied().unwrap_or(0);
            for (j, m) in row.iter_mut().enumerate() {
                if j >= plen && j < cache.prompt_max {
                    *m = f32::NEG_INFINITY;
                }
            }
        }
        let mask = Tensor::from_vec(mask, (b, 1, 1, keys), q.device())?;
        let k = self.repeat_kv(&k.transpose(1, 2)?)?;
        let v = self.repeat_kv(&v.transpose(1, 2)?)?;
        self.naive_core(q, &k, &v, &mask, 0.0)
    }
}

/// The additive mask of a right-padded batch `(b, 1, max, max)`: causal within each
/// sequence, padded keys hidden (padded query rows see key 0 so no row is empty).
fn packed_mask(seqlens: &[usize], max: usize, dev: &Device) -> Result<Tensor> {
    let mut m = vec![f32::NEG_INFINITY; seqlens.len() * max * max];
    for (b, &len) in seqlens.iter().enumerate() {
        for i in 0..max {
            let row = &mut m[(b * max + i) * max..][..max];
            let visible = if i < len { i + 1 } else { 1 };
            row[..visible].fill(0.0);
        }
    }
    Tensor::from_vec(m, (seqlens.len(), 1, max, max), dev)
}

/// Writes the prompts' keys and values `(n, hk, d)` (packed by `seqlens`) into an empty cache.
fn fill_cache(cache: &mut LayerCache, k: &Tensor, v: &Tensor, seqlens: &[usize]) -> Result<()> {
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

/// Views of consecutive row blocks of a stacked projection: the separate projections share
/// the stacked storage instead of keeping a second copy of the weights.
fn split_rows<const N: usize>(fused: &Proj, rows: &[usize; N]) -> Result<[Proj; N]> {
    let mut start = 0;
    let parts = rows
        .iter()
        .map(|&n| {
            let p = Proj {
                weight: fused.weight.narrow(0, start, n)?,
                bias: fused
                    .bias
                    .as_ref()
                    .map(|b| b.narrow(0, start, n))
                    .transpose()?,
                lora: None,
            };
            start += n;
            Ok(p)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(parts.try_into().expect("one part per row count"))
}

#[derive(Clone, Debug)]
struct Mlp {
    gate: Proj,
    up: Proj,
    down: Proj,
    /// gate and up stacked, for one matmul in inference.
    gate_up: Option<Proj>,
}

impl Mlp {
    fn load(vb: &VarBuilder, cfg: &Config) -> Result<Self> {
        let (e, i, bias) = (cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias);
        Ok(Self {
            gate: Proj::load(&vb.pp("gate_proj"), i, e, bias)?,
            up: Proj::load(&vb.pp("up_proj"), i, e, bias)?,
            down: Proj::load(&vb.pp("down_proj"), e, i, bias)?,
            gate_up: None,
        })
    }

    fn fuse(&mut self) -> Result<()> {
        if self.gate.lora.is_some() || self.up.lora.is_some() {
            self.gate_up = None;
            return Ok(());
        }
        let weight = Tensor::cat(&[&self.gate.weight, &self.up.weight], 0)?;
        let bias = match (&self.gate.bias, &self.up.bias) {
            (Some(a), Some(b)) => Some(Tensor::cat(&[a, b], 0)?),
            _ => None,
        };
        let fused = Proj {
            weight,
            bias,
            lora: None,
        };
        let i = self.gate.weight.dim(0)?;
        [self.gate, self.up] = split_rows(&fused, &[i, i])?;
        self.gate_up = Some(fused);
        Ok(())
    }

    /// The MLP of `x` (normalised by `norm` first where given; `residual` added to the down
    /// projection where given).
    fn forward(
        &self,
        x: &Tensor,
        norm: Option<&RmsNorm>,
        residual: Option<&Tensor>,
    ) -> Result<Tensor> {
        let h = match &self.gate_up {
            // Both halves and the SwiGLU in one pass over the stacked weight at a decoding
            // step's few rows, the norm too; the matmul and the fused SwiGLU of its halves
            // otherwise.
            Some(gu) if gu.bias.is_none() && gu.lora.is_none() => {
                let dt = x.dtype();
                let w = gu.weight.to_dtype(dt)?;
                match norm {
                    Some(n) => candle_flash::infer::rms_norm_linear_swiglu(
                        x,
                        &n.weight.to_dtype(dt)?,
                        n.eps as f32,
                        &w,
                    )?,
                    None => candle_flash::infer::linear_swiglu(x, &w)?,
                }
            }
            Some(gu) => {
                let y = gu.forward_normed(x, norm)?;
                let i = y.dim(1)? / 2;
                let (gate, up) = (y.narrow(1, 0, i)?, y.narrow(1, i, i)?);
                // The fused kernel reads the two strided halves in place.
                candle_flash::train::swiglu(&gate, &up)?
            }
            // One op with one backward kernel for both gradients.
            None => {
                let normed = match norm {
                    Some(n) => n.forward(x, false)?,
                    None => x.clone(),
                };
                candle_flash::train::swiglu(
                    &self.gate.forward(&normed)?,
                    &self.up.forward(&normed)?,
                )?
            }
        };
        self.down.forward_add(&h, residual)
    }
}

#[derive(Clone, Debug)]
struct Block {
    attn: Attention,
    mlp: Mlp,
    norm1: RmsNorm,
    norm2: RmsNorm,
}

/// The decoder: token embeddings, `num_hidden_layers` blocks, a final norm and the LM head.
#[derive(Clone, Debug)]
pub struct Llama {
    cfg: Config,
    embed: Tensor,
    blocks: Vec<Block>,
    norm: RmsNorm,
    /// `None` when tied to the embeddings.
    lm_head: Option<Tensor>,
    rope: Rope,
    attn: AttnImpl,
    dtype: DType,
    /// The KV cache's dtype: the activations', or F8E4M3 ([`Llama::set_kv_cache_dtype`]).
    kv_dtype: DType,
}

impl Llama {
    /// Loads (or, from a `VarMap`-backed builder, creates) the weights under their Hugging
    /// Face names. `dtype` is the dtype of the activations; the weights keep the builder's.
    /// `max_positions` bounds the positions the rotary tables cover.
    pub fn load(
        vb: VarBuilder,
        cfg: &Config,
        attn: AttnImpl,
        dtype: DType,
        max_positions: usize,
    ) -> Result<Self> {
        cfg.validate().map_err(candle::Error::wrap)?;
        let m = vb.pp("model");
        let embed = m.get_with_hints(
            (cfg.vocab_size, cfg.hidden_size),
            "embed_tokens.weight",
            init_normal(),
        )?;
        let blocks = (0..cfg.num_hidden_layers)
            .map(|i| {
                let b = m.pp(format!("layers.{i}"));
                Ok(Block {
                    attn: Attention::load(&b.pp("self_attn"), cfg)?,
                    mlp: Mlp::load(&b.pp("mlp"), cfg)?,
                    norm1: RmsNorm::load(
                        &b.pp("input_layernorm"),
                        cfg.hidden_size,
                        cfg.rms_norm_eps,
                    )?,
                    norm2: RmsNorm::load(
                        &b.pp("post_attention_layernorm"),
                        cfg.hidden_size,
                        cfg.rms_norm_eps,
                    )?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::load(&m.pp("norm"), cfg.hidden_size, cfg.rms_norm_eps)?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(vb.get_with_hints(
                (cfg.vocab_size, cfg.hidden_size),
                "lm_head.weight",
                init_normal(),
            )?)
        };
        let rope = Rope::new(cfg, max_positions, DType::F32, vb.device())?.with_cast(dtype)?;
        Ok(Self {
            cfg: cfg.clone(),
            embed,
            blocks,
            norm,
            lm_head,
            rope,
            attn,
            dtype,
            kv_dtype: dtype,
        })
    }

    /// Stacks q/k/v and gate/up weights for one matmul each (inference; projections with a
    /// LoRA adapter stay separate).
    pub fn fuse_projections(&mut self) -> Result<()> {
        for b in &mut self.blocks {
            b.attn.fuse()?;
            b.mlp.fuse()?;
        }
        Ok(())
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn attn_impl(&self) -> AttnImpl {
        self.attn
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The dtype the caches this model makes are in.
    pub fn kv_cache_dtype(&self) -> DType {
        self.kv_dtype
    }

    /// Keeps the KV cache in `dtype`: the model's, or F8E4M3 (flash attention only; per-head
    /// scales calibrated on each prefill's keys and values).
    pub fn set_kv_cache_dtype(&mut self, dtype: DType) -> Result<()> {
        if dtype != self.dtype && dtype != DType::F8E4M3 {
            candle::bail!(
                "kv cache dtype: expected the model's {:?} or F8E4M3, got {dtype:?}",
                self.dtype
            )
        }
        if dtype == DType::F8E4M3 && self.attn != AttnImpl::Flash {
            candle::bail!("an F8E4M3 KV cache needs --attention flash")
        }
        self.kv_dtype = dtype;
        Ok(())
    }

    pub fn device(&self) -> &Device {
        self.embed.device()
    }

    /// Every weight by its Hugging Face name (tied heads appear once, as the embeddings),
    /// LoRA adapters merged into their base weights when `merge_lora`, left out otherwise.
    pub fn named_weights(&self, merge_lora: bool) -> Result<HashMap<String, Tensor>> {
        let mut out = HashMap::new();
        let mut put = |name: String, p: &Proj| -> Result<()> {
            let mut w = p.weight.clone();
            if let (true, Some(l)) = (merge_lora, &p.lora) {
                let a = l.a.to_dtype(DType::F32)?;
                let b = l.b.to_dtype(DType::F32)?;
                let delta = (b.matmul(&a)? * l.scale)?;
                w = (w.to_dtype(DType::F32)? + delta)?.to_dtype(p.weight.dtype())?;
            }
            out.insert(format!("{name}.weight"), w);
            if let Some(bias) = &p.bias {
                out.insert(format!("{name}.bias"), bias.clone());
            }
            Ok(())
        };
        for (i, b) in self.blocks.iter().enumerate() {
            let pre = format!("model.layers.{i}");
            put(format!("{pre}.self_attn.q_proj"), &b.attn.q)?;
            put(format!("{pre}.self_attn.k_proj"), &b.attn.k)?;
            put(format!("{pre}.self_attn.v_proj"), &b.attn.v)?;
            put(format!("{pre}.self_attn.o_proj"), &b.attn.o)?;
            put(format!("{pre}.mlp.gate_proj"), &b.mlp.gate)?;
            put(format!("{pre}.mlp.up_proj"), &b.mlp.up)?;
            put(format!("{pre}.mlp.down_proj"), &b.mlp.down)?;
        }
        for (i, b) in self.blocks.iter().enumerate() {
            let pre = format!("model.layers.{i}");
            out.insert(
                format!("{pre}.input_layernorm.weight"),
                b.norm1.weight.clone(),
            );
            out.insert(
                format!("{pre}.post_attention_layernorm.weight"),
                b.norm2.weight.clone(),
            );
        }
        out.insert("model.embed_tokens.weight".into(), self.embed.clone());
        out.insert("model.norm.weight".into(), self.norm.weight.clone());
        if let Some(h) = &self.lm_head {
            out.insert("lm_head.weight".into(), h.clone());
        }
        Ok(out)
    }

    /// Freezes every weight the model holds (LoRA adapters excepted): detached copies that
    /// share storage, so a backward pass computes no gradient for them.
    pub fn detach_base(&mut self) {
        self.embed = self.embed.detach();
        self.lm_head = self.lm_head.as_ref().map(Tensor::detach);
        self.norm.weight = self.norm.weight.detach();
        for b in &mut self.blocks {
            b.norm1.weight = b.norm1.weight.detach();
            b.norm2.weight = b.norm2.weight.detach();
        }
        for (_, p) in self.projections_mut() {
            p.weight = p.weight.detach();
            p.bias = p.bias.as_ref().map(Tensor::detach);
        }
    }

    /// The projections of every layer by name (`layers.{i}.self_attn.q_proj`, ...), for
    /// attaching LoRA adapters.
    pub fn projections_mut(&mut self) -> Vec<(String, &mut Proj)> {
        let mut out = Vec::new();
        for (i, b) in self.blocks.iter_mut().enumerate() {
            let pre = format!("model.layers.{i}");
            let Block { attn, mlp, .. } = b;
            attn.qkv = None;
            mlp.gate_up = None;
            out.push((format!("{pre}.self_attn.q_proj"), &mut attn.q));
            out.push((format!("{pre}.self_attn.k_proj"), &mut attn.k));
            out.push((format!("{pre}.self_attn.v_proj"), &mut attn.v));
            out.push((format!("{pre}.self_attn.o_proj"), &mut attn.o));
            out.push((format!("{pre}.mlp.gate_proj"), &mut mlp.gate));
            out.push((format!("{pre}.mlp.up_proj"), &mut mlp.up));
            out.push((format!("{pre}.mlp.down_proj"), &mut mlp.down));
        }
        out
    }

    fn check_positions(&self, max_pos: usize) -> Result<()> {
        if max_pos > self.rope.max_positions() {
            candle::bail!(
                "position {} is past the {} positions this model was loaded for",
                max_pos - 1,
                self.rope.max_positions()
            )
        }
        Ok(())
    }

    fn run_blocks(
        &self,
        ids: &Tensor,
        positions: &Tensor,
        pass: &Pass,
        mut cache: Option<&mut Cache>,
    ) -> Result<Tensor> {
        let train_opts = match pass {
            Pass::Packed { train, .. } => *train,
            Pass::Step(_) => None,
        };
        let train = train_opts.is_some();
        let (mut x, cos_sin) = if let Some(t) = train_opts {
            // The lookup's backward is a scatter-add (Candle's `index_add` is slow on CUDA);
            // the rotary op takes f32 tables.
            let embed = match t.deterministic {
                true => candle_flash::train::embedding_deterministic(&self.embed, ids, self.dtype)?,
                false => candle_flash::train::embedding(&self.embed, ids, self.dtype)?,
            };
            (embed, Some(self.rope.at(positions, DType::F32)?))
        } else {
            // The device step rotates inside the cache append, from the whole tables.
            let cos_sin = match pass {
                Pass::Step(Some(_)) => None,
                _ => Some(self.rope.at(positions, self.dtype)?),
            };
            (
                self.embed.index_select(ids, 0)?.to_dtype(self.dtype)?,
                cos_sin,
            )
        };
        let cos_sin = cos_sin.as_ref();
        // Layer i's attention of x (normalised first, the residual added to its output, where
        // given): what differs between the passes below.
        let attend = |b: &Block,
                      x: &Tensor,
                      norm: Option<&RmsNorm>,
                      residual: Option<&Tensor>,
                      cache: Option<&mut LayerCache>,
                      i: usize| {
            b.attn.forward(
                x, norm, residual, &self.rope, cos_sin, pass, self.attn, cache, i,
            )
        };
        if train {
            for (i, b) in self.blocks.iter().enumerate() {
                let layer_cache = cache.as_mut().map(|c| &mut c.layers[i]);
                let h = b.norm1.forward(&x, train)?;
                let h = attend(b, &h, None, None, layer_cache, i)?;
                x = (x + h)?;
                let h = b.mlp.forward(&b.norm2.forward(&x, train)?, None, None)?;
                x = (x + h)?;
            }
            return self.norm.forward(&x, train);
        }
        // Inference at a decoding step's few rows (the few-row kernels' count): each norm
        // inside the projection after it, each residual add inside the one before it (one
        // launch each).
        if x.dim(0)? <= candle_flash::infer::fused_max_rows() {
            for (i, b) in self.blocks.iter().enumerate() {
                let layer_cache = cache.as_mut().map(|c| &mut c.layers[i]);
                x = attend(b, &x, Some(&b.norm1), Some(&x), layer_cache, i)?;
                x = b.mlp.forward(&x, Some(&b.norm2), Some(&x))?;
            }
            return self.norm.forward(&x, false);
        }
        // More rows go to the GEMM, which cannot take the add: each residual add fused with
        // the norm after it instead (`add_rms_norm`, the next block's first or the final one).
        let Some(first) = self.blocks.first() else {
            return self.norm.forward(&x, false);
        };
        let mut h = first.norm1.forward(&x, false)?;
        for (i, b) in self.blocks.iter().enumerate() {
            let layer_cache = cache.as_mut().map(|c| &mut c.layers[i]);
            let a = attend(b, &h, None, None, layer_cache, i)?;
            (x, h) = b.norm2.add_forward(&a, &x)?;
            let m = b.mlp.forward(&h, None, None)?;
            let next = self.blocks.get(i + 1).map_or(&self.norm, |n| &n.norm1);
            (x, h) = next.add_forward(&m, &x)?;
        }
        Ok(h)
    }

    /// The logits `(n, vocab)` in f32 of final hidden states `(n, hidden)`.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        self.logits_raw(hidden)?.to_dtype(DType::F32)
    }

    /// The logits in the hidden states' dtype (what a fused cross-entropy takes).
    pub fn logits_raw(&self, hidden: &Tensor) -> Result<Tensor> {
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        candle_flash::infer::linear(hidden, &head.to_dtype(hidden.dtype())?, None)
    }

    /// Runs packed sequences: `ids` `(n,)` u32 holds sequence 0's tokens, then sequence 1's,
    /// and so on (`seqlens`), each at positions `0..len`. Returns the final hidden states
    /// `(n, hidden)`. With `cache` (which must be empty) the sequences are prompts and their
    /// keys and values fill it; with `train` the pass is differentiable (dropout optional).
    pub fn forward_packed(
        &self,
        ids: &Tensor,
        seqlens: &[usize],
        cache: Option<&mut Cache>,
        train: Option<TrainOpts>,
    ) -> Result<Tensor> {
        let n: usize = seqlens.iter().sum();
        if ids.dims() != [n] {
            candle::bail!(
                "ids: expected ({n},) for sequences of {seqlens:?}, got {:?}",
                ids.dims()
            )
        }
        self.check_positions(seqlens.iter().copied().max().unwrap_or(0))?;
        if let Some(c) = &cache {
            if c.lengths.len() != seqlens.len() {
                candle::bail!(
                    "cache: made for {} sequences, the prompts are {}",
                    c.lengths.len(),
                    seqlens.len()
                )
            }
            if c.lengths.iter().any(|&l| l != 0) {
                candle::bail!("cache: a prompt must start from an empty cache")
            }
            if let Some(&l) = seqlens.iter().find(|&&l| l > c.capacity) {
                candle::bail!(
                    "prompt: {l} tokens do not fit the cache's {} per sequence",
                    c.capacity
                )
            }
        }
        let positions: Vec<u32> = seqlens.iter().flat_map(|&l| 0..l as u32).collect();
        let positions = Tensor::new(positions, ids.device())?;
        let varlen = VarLen::from_seqlens(seqlens, seqlens)?;
        let pass = Pass::Packed {
            varlen: &varlen,
            seqlens,
            train,
        };
        let mut cache = cache;
        let hidden = self.run_blocks(ids, &positions, &pass, cache.as_deref_mut())?;
        if let Some(c) = cache {
            c.lengths.copy_from_slice(seqlens);
        }
        Ok(hidden)
    }

    /// One decoding step: `ids` `(b,)` holds the next token of every sequence of `cache`,
    /// which is appended at each sequence's own position. Returns the final hidden states
    /// `(b, hidden)`.
    pub fn forward_step(&self, ids: &Tensor, cache: &mut Cache) -> Result<Tensor> {
        self.check_step(ids, cache)?;
        if cache.on_device {
            candle::bail!(
                "cache: its lengths are on the device (forward_step_device) until Cache::reset"
            )
        }
        let positions: Vec<u32> = cache.lengths.iter().map(|&l| l as u32).collect();
        let positions = Tensor::new(positions, ids.device())?;
        let hidden = self.run_blocks(ids, &positions, &Pass::Step(None), Some(cache))?;
        cache.advance();
        Ok(hidden)
    }

    /// The checks of a decoding step on the host, against the cache's lengths (for a
    /// [`Llama::forward_step_device`], the caller's mirror of the device lengths): `ids`
    /// `(b,)`, room in every sequence, rotary tables long enough.
    pub fn check_step(&self, ids: &Tensor, cache: &Cache) -> Result<()> {
        let b = cache.lengths.len();
        if ids.dims() != [b] {
            candle::bail!(
                "ids: expected ({b},), one token per sequence, got {:?}",
                ids.dims()
            )
        }
        if let Some(s) = cache.lengths.iter().position(|&l| l >= cache.capacity) {
            candle::bail!(
                "cache: sequence {s} is full ({} tokens, the capacity given to --max-new-tokens \
                 and the prompt)",
                cache.capacity
            )
        }
        self.check_positions(cache.lengths.iter().copied().max().unwrap_or(0) + 1)
    }

    /// [`Llama::forward_step`] with the per-sequence inputs on the device: `ids` `(b,)` u32
    /// and `step`'s lengths, which are also the positions (the rotary tables are gathered by
    /// them). Nothing is uploaded or read back, so the step can be captured in a CUDA graph
    /// (graph.rs). Nothing is advanced either: the caller adds one to `step.lengths` on the
    /// device and calls [`Cache::advance`], whose lengths must mirror them (they are what is
    /// checked). Flash attention only; every layer's cache holds `step.lengths` tokens.
    pub fn forward_step_device(
        &self,
        ids: &Tensor,
        step: &DeviceStep,
        cache: &mut Cache,
    ) -> Result<Tensor> {
        self.check_step(ids, cache)?;
        if self.attn != AttnImpl::Flash {
            candle::bail!("a device step needs flash attention (--attention flash)")
        }
        cache.on_device = true;
        self.run_blocks(ids, &step.lengths, &Pass::Step(Some(step)), Some(cache))
    }

    /// Rotary positions the model was loaded for.
    pub fn max_positions(&self) -> usize {
        self.rope.max_positions()
    }

    /// Bytes of weights a decoding step reads: every projection (the stacked ones once),
    /// norm and the LM head; the embedding lookup's few rows are left out.
    pub fn step_weight_bytes(&self) -> usize {
        let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let proj = |p: &Proj| {
            let lora = p.lora.as_ref().map_or(0, |l| bytes(&l.a) + bytes(&l.b));
            bytes(&p.weight) + p.bias.as_ref().map_or(0, bytes) + lora
        };
        let mut total =
            bytes(&self.norm.weight) + bytes(self.lm_head.as_ref().unwrap_or(&self.embed));
        for b in &self.blocks {
            let a = &b.attn;
            total += match &a.qkv {
                Some(qkv) => proj(qkv),
                None => proj(&a.q) + proj(&a.k) + proj(&a.v),
            };
            total += match &b.mlp.gate_up {
                Some(gu) => proj(gu),
                None => proj(&b.mlp.gate) + proj(&b.mlp.up),
            };
            total += proj(&a.o) + proj(&b.mlp.down);
            total += bytes(&b.norm1.weight) + bytes(&b.norm2.weight);
        }
        total
    }

    /// Bytes of keys and values one cached token holds over all layers.
    pub fn kv_bytes_per_token(&self) -> usize {
        let c = &self.cfg;
        c.num_hidden_layers * 2 * c.num_kv_heads() * c.head_dim() * self.kv_dtype.size_in_bytes()
    }

    /// The rows of `hidden` `(n, hidden)` at the last token of each packed sequence.
    pub fn last_tokens(hidden: &Tensor, seqlens: &[usize]) -> Result<Tensor> {
        let mut end = 0u32;
        let idx: Vec<u32> = seqlens
            .iter()
            .map(|&l| {
                end += l as u32;
                end.saturating_sub(1)
            })
            .collect();
        hidden.index_select(&Tensor::new(idx, hidden.device())?, 0)
    }
}

impl Module for Proj {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Proj::forward(self, x)
    }
}
