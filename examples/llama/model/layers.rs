//! The model's building blocks: projections (with LoRA adapters), RMSNorm and rotary
//! embeddings.

use candle::{DType, Device, Module, Result, Tensor};
use candle_nn::VarBuilder;

use super::Config;

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
    pub(super) fn load(vb: &VarBuilder, out: usize, inp: usize, bias: bool) -> Result<Self> {
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
    pub(super) fn forward_normed(&self, x: &Tensor, norm: Option<&RmsNorm>) -> Result<Tensor> {
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
    pub(super) fn forward_add(&self, x: &Tensor, residual: Option<&Tensor>) -> Result<Tensor> {
        match residual {
            Some(r) if self.bias.is_none() && self.lora.is_none() => {
                candle_flash::infer::linear(x, &self.weight.to_dtype(x.dtype())?, Some(r))
            }
            Some(r) => self.forward(x)? + r,
            None => self.forward(x),
        }
    }
}

pub(super) fn init_normal() -> candle_nn::Init {
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
    pub(super) eps: f64,
}

impl RmsNorm {
    pub(super) fn load(vb: &VarBuilder, size: usize, eps: f64) -> Result<Self> {
        let weight = vb.get_with_hints(size, "weight", candle_nn::Init::Const(1.0))?;
        Ok(Self { weight, eps })
    }

    pub(super) fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        if train {
            // One op with its own backward, the f32 master weight read as it is.
            return candle_flash::train::rms_norm(x, &self.weight, self.eps as f32);
        }
        candle_nn::ops::rms_norm(x, &self.weight.to_dtype(x.dtype())?, self.eps as f32)
    }

    /// `(residual + x, the norm of that sum)` in one kernel, for inference.
    pub(super) fn add_forward(&self, x: &Tensor, residual: &Tensor) -> Result<(Tensor, Tensor)> {
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
    pub(super) cos: Tensor,
    pub(super) sin: Tensor,
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
    pub(super) fn with_cast(mut self, dtype: DType) -> Result<Self> {
        if dtype != self.cos.dtype() {
            self.cast = Some((self.cos.to_dtype(dtype)?, self.sin.to_dtype(dtype)?));
        }
        Ok(self)
    }

    pub fn max_positions(&self) -> usize {
        self.cos.dim(0).unwrap_or(0)
    }

    /// The tables at each token's position, `(n, head_dim / 2)` each in `dtype`.
    pub(super) fn at(&self, positions: &Tensor, dtype: DType) -> Result<(Tensor, Tensor)> {
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
    pub(super) fn apply(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        train: bool,
    ) -> Result<Tensor> {
        if train {
            return candle_flash::train::rotary(x, cos, sin);
        }
        let x4 = x.unsqueeze(0)?.contiguous()?;
        candle_nn::rotary_emb::rope_thd(&x4, cos, sin)?.squeeze(0)
    }
}

/// Views of consecutive row blocks of a stacked projection: the separate projections share
/// the stacked storage instead of keeping a second copy of the weights.
pub(super) fn split_rows<const N: usize>(fused: &Proj, rows: &[usize; N]) -> Result<[Proj; N]> {
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

impl Module for Proj {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Proj::forward(self, x)
    }
}
