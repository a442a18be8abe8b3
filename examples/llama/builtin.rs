//! The built-in small model: a LLaMA-architecture checkpoint made offline and from a seed,
//! so the examples and tests run on a fresh machine with nothing downloaded. It is written in
//! the Hugging Face layout (`config.json`, `model.safetensors` with HF tensor names,
//! `tokenizer.json`, `generation_config.json`) and loaded like any other checkpoint.
//!
//! The tokenizer is a byte-level BPE trained by the `tokenizers` crate's trainer on a fixed
//! corpus of this example (`corpus.txt`), so editing the repository's documentation never
//! changes it; the weights are seeded normal draws, so the model's text is noise until the
//! fine-tuning example trains it.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result};
use candle::{Device, Tensor};
use rand::{rngs::StdRng, Rng, SeedableRng};
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, Tokenizer};

use super::model::{Config, RopeScaling, TokenIds};

/// Text the tokenizer is trained on, fixed with the example.
const CORPUS: &str = include_str!("corpus.txt");

/// Beginning- and end-of-sequence tokens of the built-in tokenizer.
pub const BOS: &str = "<s>";
pub const EOS: &str = "</s>";

/// The built-in model's shape: GQA (4 query heads over 2 K/V heads), head_dim 64, LLaMA 3
/// rope scaling, untied embeddings. `vocab_size` is the trained tokenizer's, rounded up to 64.
pub fn config(vocab_size: usize, bos: u32, eos: u32) -> Config {
    Config {
        model_type: "llama".into(),
        hidden_size: 256,
        intermediate_size: 768,
        num_hidden_layers: 4,
        num_attention_heads: 4,
        num_key_value_heads: Some(2),
        head_dim: Some(64),
        vocab_size: vocab_size.div_ceil(64) * 64,
        rms_norm_eps: 1e-5,
        rope_theta: 500000.0,
        rope_scaling: Some(RopeScaling {
            rope_type: "llama3".into(),
            factor: 8.0,
            low_freq_factor: Some(1.0),
            high_freq_factor: Some(4.0),
            original_max_position_embeddings: Some(1024),
        }),
        max_position_embeddings: 8192,
        tie_word_embeddings: false,
        attention_bias: false,
        mlp_bias: false,
        hidden_act: "silu".into(),
        bos_token_id: Some(bos),
        eos_token_id: Some(TokenIds::One(eos)),
        use_sliding_window: None,
        sliding_window: None,
        pretraining_tp: None,
    }
}

/// Trains the byte-level BPE tokenizer (at most `vocab_size` tokens) on the corpus.
pub fn train_tokenizer(vocab_size: usize) -> Result<Tokenizer> {
    let mut tok = Tokenizer::new(BPE::default());
    tok.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tok.with_decoder(Some(ByteLevel::default()));
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(vec![
            AddedToken::from(BOS, true),
            AddedToken::from(EOS, true),
        ])
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    tok.train(&mut trainer, CORPUS.lines())
        .map_err(anyhow::Error::msg)?;
    let bos = tok.token_to_id(BOS).context("tokenizer: no <s> token")?;
    let template = TemplateProcessing::builder()
        .try_single(format!("{BOS} $A"))
        .map_err(anyhow::Error::msg)?
        .special_tokens(vec![(BOS, bos)])
        .build()?;
    tok.with_post_processor(Some(template));
    Ok(tok)
}

/// Seeded normal draws (Box-Muller) of standard deviation `std`.
fn normal(rng: &mut StdRng, n: usize, std: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let u1: f32 = rng.random::<f32>().max(f32::MIN_POSITIVE);
            let u2: f32 = rng.random();
            std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
        })
        .collect()
}

/// Seeded f32 weights for `cfg` under their Hugging Face names (norms at 1, matrices
/// normal with std 0.02, as `LlamaForCausalLM` initialises them).
pub fn weights(cfg: &Config, seed: u64) -> Result<HashMap<String, Tensor>> {
    let mut rng = StdRng::seed_from_u64(seed);
    let (e, i, d) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim());
    let (h, hk, v) = (cfg.num_attention_heads, cfg.num_kv_heads(), cfg.vocab_size);
    let mut out = HashMap::new();
    let mut mat = |name: String, rows: usize, cols: usize| -> Result<()> {
        let t = Tensor::from_vec(
            normal(&mut rng, rows * cols, 0.02),
            (rows, cols),
            &Device::Cpu,
        )?;
        out.insert(name, t);
        Ok(())
    };
    mat("model.embed_tokens.weight".into(), v, e)?;
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        mat(format!("{p}.self_attn.q_proj.weight"), h * d, e)?;
        mat(format!("{p}.self_attn.k_proj.weight"), hk * d, e)?;
        mat(format!("{p}.self_attn.v_proj.weight"), hk * d, e)?;
        mat(format!("{p}.self_attn.o_proj.weight"), e, h * d)?;
        mat(format!("{p}.mlp.gate_proj.weight"), i, e)?;
        mat(format!("{p}.mlp.up_proj.weight"), i, e)?;
        mat(format!("{p}.mlp.down_proj.weight"), e, i)?;
    }
    if !cfg.tie_word_embeddings {
        mat("lm_head.weight".into(), v, e)?;
    }
    let ones = Tensor::ones(e, candle::DType::F32, &Device::Cpu)?;
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        out.insert(format!("{p}.input_layernorm.weight"), ones.clone());
        out.insert(format!("{p}.post_attention_layernorm.weight"), ones.clone());
    }
    out.insert("model.norm.weight".into(), ones);
    Ok(out)
}

/// Writes `config.json` and `generation_config.json` for `cfg`.
pub fn write_config(dir: &Path, cfg: &Config) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut json = serde_json::to_value(cfg)?;
    json["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&json)?,
    )?;
    let gen = serde_json::json!({
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
    });
    std::fs::write(
        dir.join("generation_config.json"),
        serde_json::to_string_pretty(&gen)?,
    )?;
    Ok(())
}

/// Writes the whole built-in checkpoint into `dir` (created if missing) from `seed`.
pub fn write(dir: &Path, seed: u64) -> Result<Config> {
    let tok = train_tokenizer(2048)?;
    let bos = tok.token_to_id(BOS).context("tokenizer: no <s>")?;
    let eos = tok.token_to_id(EOS).context("tokenizer: no </s>")?;
    let cfg = config(tok.get_vocab_size(true), bos, eos);
    write_config(dir, &cfg)?;
    tok.save(dir.join("tokenizer.json"), false)
        .map_err(anyhow::Error::msg)?;
    candle::safetensors::save(&weights(&cfg, seed)?, dir.join("model.safetensors"))?;
    Ok(cfg)
}
