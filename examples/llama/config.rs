//! The model configuration, read from a Hugging Face `config.json` of the LLaMA family.
//!
//! Only what changes the computation is read; a field this model cannot honour (another
//! activation, a sliding window, a rope scaling it does not implement) is an error naming it,
//! so a checkpoint never runs silently wrong.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

/// `rope_scaling` of LLaMA 3.x (`"rope_type": "llama3"`) or linear position interpolation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    #[serde(alias = "type")]
    pub rope_type: String,
    pub factor: f64,
    #[serde(default)]
    pub low_freq_factor: Option<f64>,
    #[serde(default)]
    pub high_freq_factor: Option<f64>,
    #[serde(default)]
    pub original_max_position_embeddings: Option<usize>,
}

/// Token ids that end a sequence: one id or a list (`eos_token_id` in LLaMA 3 configs).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            TokenIds::One(id) => vec![*id],
            TokenIds::Many(ids) => ids.clone(),
        }
    }
}

/// The fields of `config.json` the model reads (Hugging Face names).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Config {
    #[serde(default = "default_model_type")]
    pub model_type: String,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    pub vocab_size: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Bias on q/k/v/o (LLaMA's `attention_bias`); Qwen2 always has q/k/v biases.
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_id: Option<TokenIds>,
    /// Qwen2's switch for its sliding-window layers (not supported here).
    #[serde(default)]
    pub use_sliding_window: Option<bool>,
    /// Mistral's sliding window (not supported here when set).
    #[serde(default)]
    pub sliding_window: Option<usize>,
    #[serde(default)]
    pub pretraining_tp: Option<usize>,
}

/// `config.json` as JSON with transformers 5's `rope_parameters` (which holds `rope_theta`
/// and the scaling) spelled the 4.x way (`rope_theta`, `rope_scaling`), which this model and
/// candle-transformers read.
pub fn normalized_json(text: &str) -> Result<serde_json::Value> {
    let mut json: serde_json::Value =
        serde_json::from_str(text).context("config.json: not JSON")?;
    let Some(obj) = json.as_object_mut() else {
        bail!("config.json: not a JSON object")
    };
    if let Some(params) = obj.remove("rope_parameters") {
        if let Some(theta) = params.get("rope_theta") {
            obj.insert("rope_theta".into(), theta.clone());
        }
        let kind = params
            .get("rope_type")
            .or_else(|| params.get("type"))
            .and_then(|t| t.as_str())
            .unwrap_or("default");
        if kind == "default" {
            obj.remove("rope_scaling");
        } else {
            let mut scaling = params.clone();
            if let Some(m) = scaling.as_object_mut() {
                m.remove("rope_theta");
            }
            obj.insert("rope_scaling".into(), scaling);
        }
    }
    if obj.get("rope_scaling").is_some_and(|v| {
        v.get("rope_type")
            .or_else(|| v.get("type"))
            .and_then(|t| t.as_str())
            == Some("default")
    }) {
        obj.remove("rope_scaling");
    }
    Ok(json)
}

fn default_model_type() -> String {
    "llama".into()
}
fn default_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    10000.0
}
fn default_max_pos() -> usize {
    4096
}
fn default_act() -> String {
    "silu".into()
}

impl Config {
    /// Parses and checks a `config.json` text.
    pub fn from_json(text: &str) -> Result<Self> {
        let json = normalized_json(text)?;
        let cfg: Config =
            serde_json::from_value(json).context("config.json: not a LLaMA config")?;
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn num_kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Whether q/k/v carry a bias (Qwen2 always, LLaMA when `attention_bias`).
    pub fn qkv_bias(&self) -> bool {
        self.model_type == "qwen2" || self.attention_bias
    }

    /// Whether o_proj carries a bias (LLaMA's `attention_bias`; never in Qwen2).
    pub fn o_bias(&self) -> bool {
        self.model_type != "qwen2" && self.attention_bias
    }

    /// Token ids that end generation: `eos_token_id` of the config.
    pub fn eos_ids(&self) -> Vec<u32> {
        self.eos_token_id
            .as_ref()
            .map(TokenIds::to_vec)
            .unwrap_or_default()
    }

    pub fn validate(&self) -> Result<()> {
        match self.model_type.as_str() {
            "llama" | "qwen2" | "mistral" => {}
            other => {
                bail!("config.json: model_type {other:?} is not supported (llama, qwen2, mistral)")
            }
        }
        if self.hidden_act != "silu" {
            bail!(
                "config.json: hidden_act {:?} is not supported (silu)",
                self.hidden_act
            )
        }
        if self.use_sliding_window == Some(true) {
            bail!("config.json: use_sliding_window = true is not supported")
        }
        if let (Some(w), "mistral") = (self.sliding_window, self.model_type.as_str()) {
            if w < self.max_position_embeddings {
                bail!(
                    "config.json: sliding_window {w} (< max_position_embeddings) is not \
                     supported"
                )
            }
        }
        if self.pretraining_tp.unwrap_or(1) != 1 {
            bail!("config.json: pretraining_tp != 1 is not supported")
        }
        let (h, hk) = (self.num_attention_heads, self.num_kv_heads());
        if h == 0 || hk == 0 || h % hk != 0 {
            bail!("config.json: num_key_value_heads {hk} must divide num_attention_heads {h}")
        }
        let d = self.head_dim();
        if d == 0 || !d.is_multiple_of(2) || d > candle_flash::MAX_HEAD_DIM {
            bail!(
                "config.json: head_dim {d} must be even and at most {}",
                candle_flash::MAX_HEAD_DIM
            )
        }
        if self.head_dim.is_none() && !self.hidden_size.is_multiple_of(h) {
            bail!(
                "config.json: hidden_size {} is not a multiple of num_attention_heads {h}",
                self.hidden_size
            )
        }
        if let Some(s) = &self.rope_scaling {
            match s.rope_type.as_str() {
                "llama3" => {
                    if s.low_freq_factor.is_none()
                        || s.high_freq_factor.is_none()
                        || s.original_max_position_embeddings.is_none()
                    {
                        bail!(
                            "config.json: rope_scaling llama3 needs low_freq_factor, \
                             high_freq_factor and original_max_position_embeddings"
                        )
                    }
                }
                "linear" | "default" => {}
                other => bail!(
                    "config.json: rope_scaling type {other:?} is not supported (llama3, linear)"
                ),
            }
        }
        Ok(())
    }

    /// The inverse frequencies of the rotary embedding, `head_dim / 2` of them, with the
    /// configured scaling (LLaMA 3's piecewise rule, or linear interpolation).
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        let d = self.head_dim();
        let base: Vec<f64> = (0..d / 2)
            .map(|i| 1.0 / self.rope_theta.powf(2.0 * i as f64 / d as f64))
            .collect();
        let Some(s) = &self.rope_scaling else {
            return base;
        };
        match s.rope_type.as_str() {
            "linear" => base.into_iter().map(|f| f / s.factor).collect(),
            "llama3" => {
                let (low, high) = (s.low_freq_factor.unwrap(), s.high_freq_factor.unwrap());
                let old = s.original_max_position_embeddings.unwrap() as f64;
                let (low_wavelen, high_wavelen) = (old / low, old / high);
                base.into_iter()
                    .map(|f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / s.factor
                        } else {
                            let smooth = (old / wavelen - low) / (high - low);
                            (1.0 - smooth) * f / s.factor + smooth * f
                        }
                    })
                    .collect()
            }
            _ => base,
        }
    }
}
