//! The optimiser side of training, small enough to read: AdamW with its state saved in
//! checkpoints, the warm-up + cosine learning-rate schedule, gradient clipping by global norm,
//! and gradient accumulation over micro-batches.
//!
//! AdamW is written here rather than taken from `candle_nn::AdamW` (the same update, the same
//! defaults) because candle-nn keeps its moments private: a checkpoint without them cannot
//! resume exactly.

use std::collections::HashMap;

use candle::backprop::GradStore;
use candle::{DType, Result, Tensor, Var};

/// AdamW (decoupled weight decay), f32 moments for every trainable variable.
pub struct AdamW {
    vars: Vec<(String, Var)>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    pub step: usize,
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl AdamW {
    /// `vars` by name (the names key the saved state).
    pub fn new(vars: Vec<(String, Var)>, lr: f64, weight_decay: f64) -> Result<Self> {
        let zeros = |v: &Var| v.as_tensor().zeros_like()?.to_dtype(DType::F32);
        Ok(Self {
            m: vars.iter().map(|(_, v)| zeros(v)).collect::<Result<_>>()?,
            v: vars.iter().map(|(_, v)| zeros(v)).collect::<Result<_>>()?,
            vars,
            step: 0,
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay,
        })
    }

    /// One update from `grads` (variables without a gradient are left alone).
    pub fn update(&mut self, grads: &GradStore) -> Result<()> {
        self.step += 1;
        let t = self.step as i32;
        let (c1, c2) = (1.0 - self.beta1.powi(t), 1.0 - self.beta2.powi(t));
        for (i, (_, var)) in self.vars.iter().enumerate() {
            let Some(g) = grads.get(var.as_tensor()) else {
                continue;
            };
            let g = g.to_dtype(DType::F32)?;
            self.m[i] = ((&self.m[i] * self.beta1)? + (&g * (1.0 - self.beta1))?)?;
            self.v[i] = ((&self.v[i] * self.beta2)? + (g.sqr()? * (1.0 - self.beta2))?)?;
            let m_hat = (&self.m[i] / c1)?;
            let v_hat = (&self.v[i] / c2)?;
            let w = var.as_tensor();
            let decayed = (w * (1.0 - self.lr * self.weight_decay))?;
            let step = (m_hat / (v_hat.sqrt()? + self.eps)?)?;
            var.set(&(decayed - (step * self.lr)?)?)?;
        }
        Ok(())
    }

    /// The moments by `m.NAME` / `v.NAME`, and the step count, for a checkpoint.
    pub fn state(&self) -> Result<HashMap<String, Tensor>> {
        let mut out = HashMap::new();
        for (i, (name, _)) in self.vars.iter().enumerate() {
            out.insert(format!("m.{name}"), self.m[i].clone());
            out.insert(format!("v.{name}"), self.v[i].clone());
        }
        let dev = self
            .m
            .first()
            .map(|m| m.device().clone())
            .unwrap_or(candle::Device::Cpu);
        out.insert("step".into(), Tensor::new(&[self.step as u32], &dev)?);
        Ok(out)
    }

    /// Restores [`AdamW::state`]. Errors: a moment missing or of another shape.
    pub fn load_state(&mut self, state: &HashMap<String, Tensor>) -> Result<()> {
        for (i, (name, var)) in self.vars.iter().enumerate() {
            for (prefix, slot) in [("m", &mut self.m[i]), ("v", &mut self.v[i])] {
                let key = format!("{prefix}.{name}");
                let Some(t) = state.get(&key) else {
                    candle::bail!("optimizer state: {key} is missing")
                };
                if t.dims() != var.dims() {
                    candle::bail!(
                        "optimizer state: {key} has shape {:?}, the variable {:?}",
                        t.dims(),
                        var.dims()
                    )
                }
                *slot = t.to_dtype(DType::F32)?.to_device(var.device())?;
            }
        }
        let Some(step) = state.get("step") else {
            candle::bail!("optimizer state: step is missing")
        };
        self.step = step.to_vec1::<u32>()?[0] as usize;
        Ok(())
    }
}

/// Linear warm-up over `warmup` steps to `peak`, then a cosine decay to `min` at `total`.
pub fn learning_rate(step: usize, warmup: usize, total: usize, peak: f64, min: f64) -> f64 {
    if step < warmup {
        return peak * (step + 1) as f64 / warmup as f64;
    }
    let span = total.saturating_sub(warmup).max(1);
    let progress = ((step - warmup) as f64 / span as f64).min(1.0);
    min + 0.5 * (peak - min) * (1.0 + (std::f64::consts::PI * progress).cos())
}

/// The global L2 norm of `vars`' gradients; when it exceeds `max_norm` every gradient is
/// scaled by `max_norm / norm`. Returns the norm before clipping.
pub fn clip_grad_norm(grads: &mut GradStore, vars: &[(String, Var)], max_norm: f64) -> Result<f64> {
    // Summed on the device: one synchronisation for the whole model, not one per variable.
    let mut squares = vec![];
    for (_, v) in vars {
        if let Some(g) = grads.get(v.as_tensor()) {
            squares.push(g.to_dtype(DType::F32)?.sqr()?.sum_all()?);
        }
    }
    if squares.is_empty() {
        return Ok(0.0);
    }
    let norm = (Tensor::stack(&squares, 0)?.sum_all()?.to_scalar::<f32>()? as f64).sqrt();
    if max_norm > 0.0 && norm > max_norm {
        let scale = max_norm / (norm + 1e-6);
        for (_, v) in vars {
            if let Some(g) = grads.remove(v.as_tensor()) {
                grads.insert(v.as_tensor(), (g * scale)?);
            }
        }
    }
    Ok(norm)
}

/// Adds `more` into `acc` for `vars` (gradient accumulation), scaled by `weight`.
pub fn accumulate(
    acc: &mut Option<GradStore>,
    mut more: GradStore,
    vars: &[(String, Var)],
    weight: f64,
) -> Result<()> {
    for (_, v) in vars {
        if let Some(g) = more.remove(v.as_tensor()) {
            let g = (g * weight)?;
            more.insert(v.as_tensor(), g);
        }
    }
    match acc {
        None => *acc = Some(more),
        Some(sum) => {
            for (_, v) in vars {
                if let Some(g) = more.remove(v.as_tensor()) {
                    let total = match sum.remove(v.as_tensor()) {
                        Some(prev) => (prev + g)?,
                        None => g,
                    };
                    sum.insert(v.as_tensor(), total);
                }
            }
        }
    }
    Ok(())
}
