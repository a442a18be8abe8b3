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
//!
//! This file is the decoder ([`Llama`]: embeddings, blocks, the LM head); its parts:
//! `layers.rs` (projections with LoRA adapters, RMSNorm, rotary embeddings), `attention.rs`
//! (one layer's attention over packed sequences or a cache), `mlp.rs` (SwiGLU) and `cache.rs`
//! (the KV caches).

use std::collections::HashMap;

use candle::{DType, Device, Result, Tensor};
use candle_flash::VarLen;
use candle_nn::VarBuilder;

#[path = "attention.rs"]
mod attention;
#[path = "cache.rs"]
mod cache;
#[path = "../config.rs"]
mod config;
#[path = "layers.rs"]
mod layers;
#[path = "mlp.rs"]
mod mlp;
// The examples and tests that include this module each use a part of these (the
// candle-transformers baseline normalized_json, the fine-tuning example Lora, ...).
#[allow(unused_imports)]
pub use cache::{Cache, CacheLayout, DeviceStep, LayerCache};
#[allow(unused_imports)]
pub use config::{normalized_json, Config, RopeScaling, TokenIds};
#[allow(unused_imports)]
pub use layers::{Lora, Proj, RmsNorm, Rope};

use attention::Attention;
use layers::init_normal;
use mlp::Mlp;

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
