//! One layer's SwiGLU MLP.

use candle::{Result, Tensor};
use candle_nn::VarBuilder;

use super::layers::{split_rows, Proj, RmsNorm};
use super::Config;

#[derive(Clone, Debug)]
pub(super) struct Mlp {
    pub(super) gate: Proj,
    pub(super) up: Proj,
    pub(super) down: Proj,
    /// gate and up stacked, for one matmul in inference.
    pub(super) gate_up: Option<Proj>,
}

impl Mlp {
    pub(super) fn load(vb: &VarBuilder, cfg: &Config) -> Result<Self> {
        let (e, i, bias) = (cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias);
        Ok(Self {
            gate: Proj::load(&vb.pp("gate_proj"), i, e, bias)?,
            up: Proj::load(&vb.pp("up_proj"), i, e, bias)?,
            down: Proj::load(&vb.pp("down_proj"), e, i, bias)?,
            gate_up: None,
        })
    }

    pub(super) fn fuse(&mut self) -> Result<()> {
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
    pub(super) fn forward(
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
