//! Loading a GGUF file (llama.cpp's format) of the `llama` architecture (LLaMA 1/2/3,
//! Mistral, SmolLM, TinyLlama): the configuration from its metadata, every tensor dequantized
//! to f32 under its Hugging Face name, and the tokenizer and chat template from its metadata
//! (tokenizer_gguf.rs). The model then runs exactly as from safetensors.
//!
//! llama.cpp's converter (`convert_hf_to_gguf.py`, `LlamaModel.permute`) reorders the rows of
//! each head of `q_proj` and `k_proj` so that its interleaved rotary (pairs `2i, 2i+1`)
//! computes what the Hugging Face model's half rotation (pairs `i, i + d/2`) does. This model
//! rotates halves, so the loader puts the rows back ([`unpermute`]); the real-model test
//! (tests/llama_real_model.rs) checks it against candle-transformers' `quantized_llama`,
//! which runs the permuted rows with interleaved rotary.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use anyhow::{bail, Context, Result};
use candle::quantized::gguf_file::{Content, Value};
use candle::{DType, Device, Tensor};

use super::checkpoint::Checkpoint;
use super::model::{Config, RopeScaling, TokenIds};
use super::tokenizer_gguf;

/// The metadata of a GGUF file.
pub type Metadata = HashMap<String, Value>;

/// An unsigned integer of the metadata, whatever width the writer chose.
pub fn md_uint(md: &Metadata, key: &str) -> Result<Option<u64>> {
    Ok(match md.get(key) {
        None => None,
        Some(Value::U8(v)) => Some(*v as u64),
        Some(Value::U16(v)) => Some(*v as u64),
        Some(Value::U32(v)) => Some(*v as u64),
        Some(Value::U64(v)) => Some(*v),
        Some(Value::I8(v)) if *v >= 0 => Some(*v as u64),
        Some(Value::I16(v)) if *v >= 0 => Some(*v as u64),
        Some(Value::I32(v)) if *v >= 0 => Some(*v as u64),
        Some(Value::I64(v)) if *v >= 0 => Some(*v as u64),
        Some(v) => bail!("GGUF metadata {key}: expected an unsigned integer, found {v:?}"),
    })
}

fn md_float(md: &Metadata, key: &str) -> Result<Option<f64>> {
    Ok(match md.get(key) {
        None => None,
        Some(Value::F32(v)) => Some(*v as f64),
        Some(Value::F64(v)) => Some(*v),
        Some(v) => bail!("GGUF metadata {key}: expected a float, found {v:?}"),
    })
}

pub fn md_str<'a>(md: &'a Metadata, key: &str) -> Result<Option<&'a str>> {
    Ok(match md.get(key) {
        None => None,
        Some(Value::String(s)) => Some(s.as_str()),
        Some(v) => bail!("GGUF metadata {key}: expected a string, found {v:?}"),
    })
}

fn need(md: &Metadata, key: &str) -> Result<usize> {
    md_uint(md, key)?
        .map(|v| v as usize)
        .with_context(|| format!("GGUF metadata: no {key}"))
}

/// Rows of each head back in the Hugging Face order: the inverse of llama.cpp's `permute`,
/// which views a `(heads * d, ...)` weight as `(heads, 2, d/2, ...)` and swaps the middle
/// axes, so that the two halves rotated together become adjacent rows. Works on weights
/// `(heads * d, cols)` and biases `(heads * d,)`.
pub fn unpermute(w: &Tensor, heads: usize) -> Result<Tensor> {
    let dims = w.dims().to_vec();
    let rows = dims.first().copied().unwrap_or(0);
    if heads == 0 || !rows.is_multiple_of(heads) || !(rows / heads).is_multiple_of(2) {
        bail!("cannot split {rows} rows into {heads} heads of even size")
    }
    let d = rows / heads;
    let rest: usize = dims[1..].iter().product();
    Ok(w.reshape((heads, d / 2, 2, rest))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)?)
}

/// llama.cpp's `permute` itself (what its converter writes), for tests that make GGUF files.
#[allow(dead_code)]
pub fn permute(w: &Tensor, heads: usize) -> Result<Tensor> {
    let dims = w.dims().to_vec();
    let d = dims[0] / heads;
    let rest: usize = dims[1..].iter().product();
    Ok(w.reshape((heads, 2, d / 2, rest))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)?)
}

/// The Hugging Face name of a GGUF tensor of a LLaMA model, and whether its rows were
/// permuted for `heads` query heads (`Some(false)`) or key heads (`Some(true)`).
fn hf_name(name: &str) -> Option<(String, Option<bool>)> {
    let fixed = match name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some((f.to_string(), None));
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (part, kind) = rest.rsplit_once('.')?;
    if kind != "weight" && kind != "bias" {
        return None;
    }
    let (hf, permuted) = match part {
        "attn_norm" => ("input_layernorm", None),
        "ffn_norm" => ("post_attention_layernorm", None),
        "attn_q" => ("self_attn.q_proj", Some(false)),
        "attn_k" => ("self_attn.k_proj", Some(true)),
        "attn_v" => ("self_attn.v_proj", None),
        "attn_output" => ("self_attn.o_proj", None),
        "ffn_gate" => ("mlp.gate_proj", None),
        "ffn_up" => ("mlp.up_proj", None),
        "ffn_down" => ("mlp.down_proj", None),
        _ => return None,
    };
    Some((format!("model.layers.{layer}.{hf}.{kind}"), permuted))
}

/// LLaMA 3.1's rope scaling, which llama.cpp stores as per-frequency factors
/// (`rope_freqs.weight`) rather than parameters: the parameters of Meta's releases (low 1,
/// high 4, the factor the largest one) with the original context that reproduces them.
fn llama3_scaling(cfg: &Config, factors: &[f32]) -> Result<RopeScaling> {
    let factor = factors.iter().copied().fold(1f32, f32::max) as f64;
    let mut plain = cfg.clone();
    plain.rope_scaling = None;
    let base = plain.rope_inv_freq();
    if factors.len() != base.len() {
        bail!(
            "GGUF rope_freqs.weight: {} factors for {} frequencies",
            factors.len(),
            base.len()
        )
    }
    for old in [8192, 4096, 2048, 1024, 16384, 32768, 65536, 131072] {
        let scaling = RopeScaling {
            rope_type: "llama3".into(),
            factor,
            low_freq_factor: Some(1.0),
            high_freq_factor: Some(4.0),
            original_max_position_embeddings: Some(old),
        };
        let mut c = cfg.clone();
        c.rope_scaling = Some(scaling.clone());
        let fits = c
            .rope_inv_freq()
            .iter()
            .zip(&base)
            .zip(factors)
            .all(|((s, b), f)| ((b / s) / *f as f64 - 1.0).abs() < 1e-3);
        if fits {
            return Ok(scaling);
        }
    }
    bail!("GGUF rope_freqs.weight: factors that no LLaMA 3 rope scaling reproduces")
}

/// The model configuration from the metadata of a `llama` GGUF file.
fn config(content: &Content) -> Result<Config> {
    let md = &content.metadata;
    let arch = md_str(md, "general.architecture")?.unwrap_or("");
    if arch != "llama" {
        bail!("GGUF architecture {arch:?} is not supported (llama)")
    }
    let key = |k: &str| format!("llama.{k}");
    if md_uint(md, &key("expert_count"))?.unwrap_or(0) > 0 {
        bail!("GGUF: mixture-of-experts models are not supported")
    }
    let hidden = need(md, &key("embedding_length"))?;
    let heads = need(md, &key("attention.head_count"))?;
    let kv_heads = md_uint(md, &key("attention.head_count_kv"))?.map_or(heads, |v| v as usize);
    let head_dim =
        md_uint(md, &key("attention.key_length"))?.map_or(hidden / heads.max(1), |v| v as usize);
    if let Some(v) = md_uint(md, &key("attention.value_length"))? {
        if v as usize != head_dim {
            bail!("GGUF: value_length {v} != key_length {head_dim} is not supported")
        }
    }
    if let Some(r) = md_uint(md, &key("rope.dimension_count"))? {
        if r as usize != head_dim {
            bail!("GGUF: rotary on {r} of {head_dim} dimensions is not supported")
        }
    }
    let embed = content
        .tensor_infos
        .get("token_embd.weight")
        .context("GGUF: no token_embd.weight tensor")?;
    let vocab_size = embed.shape.dims()[0];
    let rope_scaling = match md_str(md, &key("rope.scaling.type"))? {
        None | Some("none") => None,
        Some("linear") => Some(RopeScaling {
            rope_type: "linear".into(),
            factor: md_float(md, &key("rope.scaling.factor"))?
                .context("GGUF: linear rope scaling without rope.scaling.factor")?,
            low_freq_factor: None,
            high_freq_factor: None,
            original_max_position_embeddings: None,
        }),
        Some(other) => bail!("GGUF rope scaling {other:?} is not supported (linear)"),
    };
    let tokenizer_id = |k: &str| -> Result<Option<u32>> {
        Ok(md_uint(md, &format!("tokenizer.ggml.{k}"))?.map(|v| v as u32))
    };
    let cfg = Config {
        model_type: "llama".into(),
        hidden_size: hidden,
        intermediate_size: need(md, &key("feed_forward_length"))?,
        num_hidden_layers: need(md, &key("block_count"))?,
        num_attention_heads: heads,
        num_key_value_heads: Some(kv_heads),
        head_dim: Some(head_dim),
        vocab_size,
        rms_norm_eps: md_float(md, &key("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-5),
        rope_theta: md_float(md, &key("rope.freq_base"))?.unwrap_or(10000.0),
        rope_scaling,
        max_position_embeddings: md_uint(md, &key("context_length"))?.map_or(4096, |v| v as usize),
        tie_word_embeddings: !content.tensor_infos.contains_key("output.weight"),
        attention_bias: content.tensor_infos.contains_key("blk.0.attn_q.bias"),
        mlp_bias: content.tensor_infos.contains_key("blk.0.ffn_up.bias"),
        hidden_act: "silu".into(),
        bos_token_id: tokenizer_id("bos_token_id")?,
        eos_token_id: tokenizer_id("eos_token_id")?.map(TokenIds::One),
        use_sliding_window: None,
        sliding_window: None,
        pretraining_tp: None,
    };
    cfg.validate()?;
    Ok(cfg)
}

/// The end-of-sequence ids: the end-of-text token and, in chat models, the end-of-turn and
/// end-of-message ones (LLaMA 3's `<|eot_id|>`, `<|eom_id|>`).
fn eos_ids(md: &Metadata) -> Result<Vec<u32>> {
    let mut ids = Vec::new();
    for k in ["eos_token_id", "eot_token_id", "eom_token_id"] {
        if let Some(id) = md_uint(md, &format!("tokenizer.ggml.{k}"))? {
            if !ids.contains(&(id as u32)) {
                ids.push(id as u32);
            }
        }
    }
    Ok(ids)
}

/// How the tensors of a file are stored, e.g. "Q4_1 x210, F32 x61, Q8_0 x1".
pub fn storage_summary(content: &Content) -> String {
    let mut counts: BTreeMap<String, usize> = BTreeMap::new();
    for info in content.tensor_infos.values() {
        *counts.entry(format!("{:?}", info.ggml_dtype)).or_default() += 1;
    }
    let mut v: Vec<(String, usize)> = counts.into_iter().collect();
    v.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
    v.iter()
        .map(|(t, n)| format!("{t} x{n}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Reads the header of a GGUF file.
pub fn read_content(path: &Path) -> Result<(Content, std::fs::File)> {
    let mut file =
        std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let content = Content::read(&mut file)
        .map_err(|e| anyhow::anyhow!("{}: not a readable GGUF file: {e}", path.display()))?;
    Ok((content, file))
}

/// Opens a GGUF file: configuration, dequantized weights, tokenizer (the one of
/// `tokenizer_json` when given, else the metadata's) and chat template.
#[allow(dead_code)] // main reads the header itself, to describe the file as well
pub fn open(path: &Path, tokenizer_json: Option<&Path>) -> Result<Checkpoint> {
    let (content, file) = read_content(path)?;
    load(path, &content, file, tokenizer_json)
}

/// [`open`] from a header already read by [`read_content`].
pub fn load(
    path: &Path,
    content: &Content,
    mut file: std::fs::File,
    tokenizer_json: Option<&Path>,
) -> Result<Checkpoint> {
    let ctx = || path.display().to_string();
    let mut cfg = config(content).with_context(ctx)?;
    // The tokenizer first: a file this example cannot tokenize for fails before the
    // seconds spent dequantizing.
    let tokenizer = match tokenizer_json {
        Some(p) => tokenizers::Tokenizer::from_file(p)
            .map_err(|e| anyhow::anyhow!("--tokenizer {}: {e}", p.display()))?,
        None => tokenizer_gguf::from_metadata(&content.metadata).with_context(|| {
            format!(
                "{}: the tokenizer in its metadata (or give one with --tokenizer \
                 tokenizer.json)",
                path.display()
            )
        })?,
    };
    let (heads, kv_heads) = (cfg.num_attention_heads, cfg.num_kv_heads());
    let mut tensors = HashMap::new();
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    for name in names {
        let q = content
            .tensor(&mut file, name, &Device::Cpu)
            .map_err(|e| anyhow::anyhow!("{}: tensor {name}: {e}", path.display()))?;
        let t = q
            .dequantize(&Device::Cpu)
            .and_then(|t| t.to_dtype(DType::F32))
            .map_err(|e| {
                anyhow::anyhow!(
                    "{}: dequantizing {name} ({:?}): {e}",
                    path.display(),
                    q.dtype()
                )
            })?;
        if name == "rope_freqs.weight" {
            let factors = t.flatten_all()?.to_vec1::<f32>()?;
            cfg.rope_scaling = Some(llama3_scaling(&cfg, &factors).with_context(ctx)?);
            continue;
        }
        let Some((hf, permuted)) = hf_name(name) else {
            bail!(
                "{}: tensor {name} is not part of a LLaMA model this example runs",
                path.display()
            )
        };
        let t = match permuted {
            Some(is_k) => unpermute(&t, if is_k { kv_heads } else { heads })
                .with_context(|| format!("{}: {name}", path.display()))?,
            None => t,
        };
        tensors.insert(hf, t);
    }
    let chat_template = md_str(&content.metadata, "tokenizer.chat_template")?.map(String::from);
    Ok(Checkpoint {
        dir: path.to_path_buf(),
        eos_ids: eos_ids(&content.metadata)?,
        config: cfg,
        weights: Vec::new(),
        tensors: Some(tensors),
        tokenizer: Some(tokenizer),
        chat_template,
    })
}
