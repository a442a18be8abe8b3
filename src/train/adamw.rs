//! AdamW as two fused passes per variable, where the op-by-op form (and `candle_nn::AdamW`)
//! runs about a dozen element-wise kernels: the moments updated in place from the gradient,
//! then the master weight updated in place. Gradient clipping is a factor on the gradient
//! inside the first pass, so clipped gradients are never written; [`sum_squares`] gives the
//! global norm with one synchronisation for the whole model.
//!
//! The state is readable and restorable ([`AdamW::state`], [`AdamW::load_state`]), which
//! `candle_nn::AdamW` does not allow, so checkpoints resume exactly.

use std::collections::HashMap;

use candle::backprop::GradStore;
use candle::{bail, CpuStorage, DType, InplaceOp2, Layout, Result, Tensor, Var};

use super::host;

/// AdamW (decoupled weight decay) over f32 variables, with f32 moments.
pub struct AdamW {
    vars: Vec<(String, Var)>,
    /// Per variable, `(2, numel)` f32: the first moment, then the second.
    moments: Vec<Tensor>,
    /// Updates done so far (bias corrections use it).
    pub step: usize,
    /// Learning rate of the next update (set it per step for a schedule).
    pub lr: f64,
    /// Decay of the first moment.
    pub beta1: f64,
    /// Decay of the second moment.
    pub beta2: f64,
    /// Added to the root of the second moment.
    pub eps: f64,
    /// Decoupled weight decay, applied as `w * (1 - lr * weight_decay)`.
    pub weight_decay: f64,
}

impl AdamW {
    /// `vars` by name (the names key the saved state), each F32. Defaults as PyTorch's:
    /// betas (0.9, 0.999), eps 1e-8.
    pub fn new(vars: Vec<(String, Var)>, lr: f64, weight_decay: f64) -> Result<Self> {
        let mut moments = Vec::with_capacity(vars.len());
        for (name, v) in &vars {
            if v.dtype() != DType::F32 {
                bail!(
                    "AdamW: variable {name} is {:?}, expected F32 master weights",
                    v.dtype()
                )
            }
            moments.push(Tensor::zeros((2, v.elem_count()), DType::F32, v.device())?);
        }
        Ok(Self {
            vars,
            moments,
            step: 0,
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay,
        })
    }

    /// The variables, by name.
    pub fn vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    /// One update from `grads`, each gradient multiplied by `grad_scale` first (clipping;
    /// 1 for none). Variables without a gradient are left alone.
    pub fn update(&mut self, grads: &GradStore, grad_scale: f64) -> Result<()> {
        self.step += 1;
        let t = self.step as i32;
        let (c1, c2) = (1.0 - self.beta1.powi(t), 1.0 - self.beta2.powi(t));
        for ((name, var), mv) in self.vars.iter().zip(&self.moments) {
            let Some(g) = grads.get(var.as_tensor()) else {
                continue;
            };
            if g.dims() != var.dims() {
                bail!(
                    "AdamW: the gradient of {name} has shape {:?}, the variable {:?}",
                    g.dims(),
                    var.dims()
                )
            }
            host::check_float(g, "AdamW: gradient")?;
            let g = g.contiguous()?;
            mv.inplace_op2(
                &g,
                &Moments {
                    scale: grad_scale as f32,
                    beta1: self.beta1 as f32,
                    beta2: self.beta2 as f32,
                },
            )?;
            var.as_tensor().inplace_op2(
                mv,
                &Apply {
                    lr: self.lr as f32,
                    decay: (1.0 - self.lr * self.weight_decay) as f32,
                    c1: c1 as f32,
                    c2: c2 as f32,
                    eps: self.eps as f32,
                },
            )?;
        }
        Ok(())
    }

    /// The moments as `m.NAME` / `v.NAME` (shaped like the variable) and the step count as
    /// `step`, for a checkpoint.
    pub fn state(&self) -> Result<HashMap<String, Tensor>> {
        let mut out = HashMap::new();
        for ((name, var), mv) in self.vars.iter().zip(&self.moments) {
            out.insert(format!("m.{name}"), mv.get(0)?.reshape(var.shape())?);
            out.insert(format!("v.{name}"), mv.get(1)?.reshape(var.shape())?);
        }
        let dev = self
            .vars
            .first()
            .map(|(_, v)| v.device().clone())
            .unwrap_or(candle::Device::Cpu);
        out.insert("step".into(), Tensor::new(&[self.step as u32], &dev)?);
        Ok(out)
    }

    /// Restores [`AdamW::state`]. Errors: a moment missing or of another shape.
    pub fn load_state(&mut self, state: &HashMap<String, Tensor>) -> Result<()> {
        let mut moments = Vec::with_capacity(self.vars.len());
        for (name, var) in &self.vars {
            let mut parts = vec![];
            for prefix in ["m", "v"] {
                let key = format!("{prefix}.{name}");
                let Some(t) = state.get(&key) else {
                    bail!("optimizer state: {key} is missing")
                };
                if t.dims() != var.dims() {
                    bail!(
                        "optimizer state: {key} has shape {:?}, the variable {:?}",
                        t.dims(),
                        var.dims()
                    )
                }
                parts.push(
                    t.to_dtype(DType::F32)?
                        .to_device(var.device())?
                        .flatten_all()?,
                );
            }
            moments.push(Tensor::stack(&parts, 0)?);
        }
        let Some(step) = state.get("step") else {
            bail!("optimizer state: step is missing")
        };
        self.step = step.flatten_all()?.to_vec1::<u32>()?[0] as usize;
        self.moments = moments;
        Ok(())
    }
}

/// The sum of the squares of every element of `tensors`, a scalar F32 on their device,
/// accumulated in f32 in a fixed order (bitwise repeatable; one pass per tensor, no
/// synchronisation).
pub fn sum_squares<'a>(tensors: impl IntoIterator<Item = &'a Tensor>) -> Result<Tensor> {
    let mut tensors = tensors.into_iter().peekable();
    let Some(first) = tensors.peek() else {
        return Tensor::new(0f32, &candle::Device::Cpu);
    };
    // On CUDA the sum, the kernel's block counter and a partial per block (train_adamw.cuh).
    let len = match first.device() {
        #[cfg(feature = "cuda")]
        candle::Device::Cuda(dev) => 2 + super::launch::max_stride_blocks(dev)?,
        _ => 1,
    };
    let acc = Tensor::zeros(len, DType::F32, first.device())?;
    for t in tensors {
        host::check_float(t, "sum_squares")?;
        acc.inplace_op2(&t.contiguous()?, &SumSquares)?;
    }
    acc.narrow(0, 0, 1)?.squeeze(0)
}

struct Moments {
    scale: f32,
    beta1: f32,
    beta2: f32,
}

fn f32_mut<'a>(s: &'a mut CpuStorage, l: &Layout, what: &str) -> Result<&'a mut [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&mut v[a..b]),
        _ => bail!("{what}: expected a contiguous F32 tensor"),
    }
}

impl InplaceOp2 for Moments {
    fn name(&self) -> &'static str {
        "adamw-moments"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        let g = crate::cpu::gather_f32(s2, l2)?;
        let mv = f32_mut(s1, l1, "AdamW moments")?;
        let (m, v) = mv.split_at_mut(g.len());
        for i in 0..g.len() {
            let gi = g[i] * self.scale;
            m[i] = self.beta1 * m[i] + (1.0 - self.beta1) * gi;
            v[i] = self.beta2 * v[i] + (1.0 - self.beta2) * gi * gi;
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle::CudaStorage,
        l1: &Layout,
        s2: &candle::CudaStorage,
        l2: &Layout,
    ) -> Result<()> {
        use super::launch::{self, Arg};
        use candle::backend::BackendStorage;
        let dev = s2.device.clone();
        let n = l2.shape().elem_count();
        let name = format!(
            "train_adamw_moments_{}",
            launch::suffix(s2.dtype(), "AdamW: gradient")?
        );
        let stream = dev.cuda_stream();
        let (mv, _a) = launch::ptr_mut(s1, l1.start_offset(), &stream)?;
        let (g, _b) = launch::ptr(s2, l2, &stream)?;
        let args = [
            Arg::Ptr(mv),
            Arg::Ptr(g),
            Arg::I64(n as i64),
            Arg::F32(self.scale),
            Arg::F32(self.beta1),
            Arg::F32(self.beta2),
        ];
        launch::launch(
            &dev,
            &name,
            launch::stride_blocks(&dev, n, 256)?,
            256,
            &args,
        )
    }
}

struct Apply {
    lr: f32,
    decay: f32,
    c1: f32,
    c2: f32,
    eps: f32,
}

impl InplaceOp2 for Apply {
    fn name(&self) -> &'static str {
        "adamw-apply"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        let mv = crate::cpu::gather_f32(s2, l2)?;
        let w = f32_mut(s1, l1, "AdamW variable")?;
        let n = w.len();
        for i in 0..n {
            let (m_hat, v_hat) = (mv[i] / self.c1, mv[n + i] / self.c2);
            w[i] = w[i] * self.decay - self.lr * m_hat / (v_hat.sqrt() + self.eps);
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle::CudaStorage,
        l1: &Layout,
        s2: &candle::CudaStorage,
        l2: &Layout,
    ) -> Result<()> {
        use super::launch::{self, Arg};
        let dev = s2.device.clone();
        let n = l1.shape().elem_count();
        let stream = dev.cuda_stream();
        let (w, _a) = launch::ptr_mut(s1, l1.start_offset(), &stream)?;
        let (mv, _b) = launch::ptr(s2, l2, &stream)?;
        let args = [
            Arg::Ptr(w),
            Arg::Ptr(mv),
            Arg::I64(n as i64),
            Arg::F32(self.lr),
            Arg::F32(self.decay),
            Arg::F32(self.c1),
            Arg::F32(self.c2),
            Arg::F32(self.eps),
        ];
        launch::launch(
            &dev,
            "train_adamw_apply",
            launch::stride_blocks(&dev, n, 256)?,
            256,
            &args,
        )
    }
}

struct SumSquares;

impl InplaceOp2 for SumSquares {
    fn name(&self) -> &'static str {
        "sum-squares"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        let x = crate::cpu::gather_f32(s2, l2)?;
        let acc = f32_mut(s1, l1, "sum_squares accumulator")?;
        acc[0] += x.iter().map(|v| v * v).sum::<f32>();
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle::CudaStorage,
        l1: &Layout,
        s2: &candle::CudaStorage,
        l2: &Layout,
    ) -> Result<()> {
        use super::launch::{self, Arg};
        use candle::backend::BackendStorage;
        let dev = s2.device.clone();
        let n = l2.shape().elem_count();
        let name = format!(
            "train_sum_squares_{}",
            launch::suffix(s2.dtype(), "sum_squares")?
        );
        let blocks = launch::stride_blocks(&dev, n, 256)?;
        if l1.shape().elem_count() < 2 + blocks {
            bail!("sum_squares: the accumulator holds no partial per block (use `sum_squares`)")
        }
        let stream = dev.cuda_stream();
        let (acc, _a) = launch::ptr_mut(s1, l1.start_offset(), &stream)?;
        let (x, _b) = launch::ptr(s2, l2, &stream)?;
        let args = [Arg::Ptr(x), Arg::Ptr(acc), Arg::I64(n as i64)];
        launch::launch(&dev, &name, blocks, 256, &args)
    }
}
