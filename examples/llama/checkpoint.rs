//! A model to run: a Hugging Face LLaMA-family checkpoint directory (`config.json`, the
//! weights in `model.safetensors` or in shards listed by `model.safetensors.index.json`,
//! `tokenizer.json`, `generation_config.json`, `tokenizer_config.json` for the chat template),
//! or weights already in memory (a dequantized GGUF file, see gguf.rs). Nothing is fetched
//! here: every file must be in the directory.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use tokenizers::Tokenizer;

use super::model::{AttnImpl, Config, Llama};

/// What a checkpoint holds.
pub struct Checkpoint {
    /// The checkpoint directory, or the file the weights came from.
    pub dir: PathBuf,
    pub config: Config,
    /// The safetensors files of a directory (empty when the weights are in `tensors`).
    pub weights: Vec<PathBuf>,
    /// Weights held in memory under their Hugging Face names (f32 on the CPU).
    pub tensors: Option<HashMap<String, Tensor>>,
    /// `tokenizer.json`, when present.
    pub tokenizer: Option<Tokenizer>,
    /// End-of-sequence ids: `generation_config.json`'s, else `config.json`'s.
    pub eos_ids: Vec<u32>,
    /// The Jinja chat template of an instruct model (`tokenizer_config.json`'s
    /// `chat_template`, or `chat_template.jinja`), when there is one.
    pub chat_template: Option<String>,
}

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

/// The safetensors files of `dir`: the shards of the index when there is one, else
/// `model.safetensors`, else every `*.safetensors` file.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let json: serde_json::Value = serde_json::from_str(&read(&index)?)
            .with_context(|| format!("{}: not JSON", index.display()))?;
        let map = json["weight_map"]
            .as_object()
            .with_context(|| format!("{}: no weight_map object", index.display()))?;
        let files: BTreeSet<&str> = map.values().filter_map(|v| v.as_str()).collect();
        if files.is_empty() {
            bail!("{}: weight_map names no file", index.display())
        }
        return files
            .into_iter()
            .map(|f| {
                let p = dir.join(f);
                if p.exists() {
                    Ok(p)
                } else {
                    bail!("{}: shard {f} is missing", index.display())
                }
            })
            .collect();
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let mut all: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    all.sort();
    if all.is_empty() {
        bail!(
            "{}: no model.safetensors, model.safetensors.index.json or *.safetensors",
            dir.display()
        )
    }
    Ok(all)
}

impl Checkpoint {
    /// Reads the directory's metadata and tokenizer (the weights are mapped by [`Self::load`]).
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            bail!("--model {}: not a directory", dir.display())
        }
        let cfg_path = dir.join("config.json");
        let config = Config::from_json(&read(&cfg_path)?)
            .with_context(|| format!("{}", cfg_path.display()))?;
        let weights = weight_files(dir)?;
        let tok_path = dir.join("tokenizer.json");
        let tokenizer = if tok_path.exists() {
            Some(
                Tokenizer::from_file(&tok_path)
                    .map_err(|e| anyhow::anyhow!("{}: {e}", tok_path.display()))?,
            )
        } else {
            None
        };
        let gen_path = dir.join("generation_config.json");
        let mut eos_ids = config.eos_ids();
        if gen_path.exists() {
            let gen: serde_json::Value = serde_json::from_str(&read(&gen_path)?)
                .with_context(|| format!("{}: not JSON", gen_path.display()))?;
            match &gen["eos_token_id"] {
                serde_json::Value::Number(n) => {
                    eos_ids = n.as_u64().into_iter().map(|i| i as u32).collect()
                }
                serde_json::Value::Array(a) => {
                    eos_ids = a
                        .iter()
                        .filter_map(|v| v.as_u64())
                        .map(|i| i as u32)
                        .collect()
                }
                _ => {}
            }
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
            weights,
            tensors: None,
            tokenizer,
            eos_ids,
            chat_template: chat_template(dir)?,
        })
    }

    /// A builder of `dtype` on `dev` over the weights: memory-mapped files, or the tensors
    /// held in memory (converted when a layer takes them).
    pub fn var_builder(&self, dtype: DType, dev: &Device) -> Result<VarBuilder<'static>> {
        if let Some(t) = &self.tensors {
            return Ok(VarBuilder::from_tensors(t.clone(), dtype, dev));
        }
        // Safety: the files are mapped read-only; they must not change while mapped.
        Ok(unsafe { VarBuilder::from_mmaped_safetensors(&self.weights, dtype, dev)? })
    }

    /// The model in `dtype` on `dev`, rotary tables for `max_positions`.
    pub fn load(
        &self,
        attn: AttnImpl,
        dtype: DType,
        dev: &Device,
        max_positions: usize,
    ) -> Result<Llama> {
        let vb = self.var_builder(dtype, dev)?;
        let mut model = Llama::load(vb, &self.config, attn, dtype, max_positions)
            .with_context(|| format!("loading the weights of {}", self.dir.display()))?;
        model.fuse_projections()?;
        Ok(model)
    }

    pub fn tokenizer(&self) -> Result<&Tokenizer> {
        self.tokenizer.as_ref().with_context(|| {
            format!(
                "{}: no tokenizer (give one with --tokenizer tokenizer.json)",
                self.dir.display()
            )
        })
    }
}

/// The chat template of a checkpoint directory: `chat_template.jinja` (transformers 4.43+
/// writes it there), else `tokenizer_config.json`'s `chat_template`, a string or a list of
/// named templates of which the one named "default" is taken.
fn chat_template(dir: &Path) -> Result<Option<String>> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.exists() {
        return Ok(Some(read(&jinja)?));
    }
    let path = dir.join("tokenizer_config.json");
    if !path.exists() {
        return Ok(None);
    }
    let json: serde_json::Value = serde_json::from_str(&read(&path)?)
        .with_context(|| format!("{}: not JSON", path.display()))?;
    Ok(match &json["chat_template"] {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(list) => list
            .iter()
            .find(|t| t["name"] == "default")
            .and_then(|t| t["template"].as_str())
            .map(String::from),
        _ => None,
    })
}
