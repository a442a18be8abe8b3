//! Loading a Hugging Face LLaMA-family checkpoint directory: `config.json`, the weights
//! (`model.safetensors`, or shards listed by `model.safetensors.index.json`), `tokenizer.json`
//! and `generation_config.json`. Nothing is fetched: every file must be in the directory.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle::{DType, Device};
use candle_nn::VarBuilder;
use tokenizers::Tokenizer;

use super::model::{AttnImpl, Config, Llama};

/// What a checkpoint directory holds.
pub struct Checkpoint {
    pub dir: PathBuf,
    pub config: Config,
    pub weights: Vec<PathBuf>,
    /// `tokenizer.json`, when present.
    pub tokenizer: Option<Tokenizer>,
    /// End-of-sequence ids: `generation_config.json`'s, else `config.json`'s.
    pub eos_ids: Vec<u32>,
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
            tokenizer,
            eos_ids,
        })
    }

    /// Memory-maps the weights into a builder of `dtype` on `dev`.
    pub fn var_builder(&self, dtype: DType, dev: &Device) -> Result<VarBuilder<'static>> {
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
        self.tokenizer
            .as_ref()
            .with_context(|| format!("{}: no tokenizer.json", self.dir.display()))
    }
}
