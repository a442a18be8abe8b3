//! AdamW as two fused passes per variable, where the op-by-op form (and `candle_nn::AdamW`)
//! runs about a dozen element-wise kernels: the moments updated in place from the gradient,
//! then the master weight updated in place. Gradient clipping is a factor on the gradient
//! inside the first pass, so clipped gradients are never written; [`sum_squares`] gives the
//! global norm with one synchronisation for the whole model.
//!
//! The state is readable and restorable ([`AdamW::state`], [`AdamW::load_state`]), which
//! `candle_nn::AdamW` does not allow, so checkpoints resume exactly. A state is a copy, and
//! an update or a restore that fails changes nothing, so a step can be rolled back or retried.

use std::collections::{HashMap, HashSet};

use candle::backprop::GradStore;
use candle::{bail, DType, Result, Tensor, Var};

use super::adamw_ops::{self, Apply, Moments, SumSquares};
use super::{adamw_state, host};

/// AdamW (decoupled weight decay) over f32 variables, with f32 moments.
pub struct AdamW {
    vars: Vec<(String, Var)>,
    /// Per variable, `(2, numel)` f32: the first moment, then the second. Never shared with
    /// a tensor handed out or taken in, since the update writes them in place.
    moments: Vec<Tensor>,
    /// Updates done so far (bias corrections use it); at most `i32::MAX`.
    pub step: usize,
    /// Learning rate of the next update (set it per step for a schedule); finite, >= 0.
    pub lr: f64,
    /// Decay of the first moment, in [0, 1).
    pub beta1: f64,
    /// Decay of the second moment, in [0, 1).
    pub beta2: f64,
    /// Added to the root of the second moment; finite, >= 0.
    pub eps: f64,
    /// Decoupled weight decay, applied as `w * (1 - lr * weight_decay)`; finite, >= 0.
    pub weight_decay: f64,
}

impl AdamW {
    /// `vars` by name (the names key the saved state), each F32. Defaults as PyTorch's:
    /// betas (0.9, 0.999), eps 1e-8. Errors: a variable of another dtype, two variables of
    /// one name, or one variable listed twice (it would be updated twice per step).
    pub fn new(vars: Vec<(String, Var)>, lr: f64, weight_decay: f64) -> Result<Self> {
        let mut names = HashSet::new();
        let mut ids = HashMap::new();
        let mut moments = Vec::with_capacity(vars.len());
        for (name, v) in &vars {
            if v.dtype() != DType::F32 {
                bail!(
                    "AdamW: variable {name} is {:?}, expected F32 master weights",
                    v.dtype()
                )
            }
            if !names.insert(name.as_str()) {
                bail!("AdamW: two variables are named {name}, expected unique names")
            }
            if let Some(other) = ids.insert(v.as_tensor().id(), name) {
                bail!("AdamW: variables {other} and {name} are the same Var, expected distinct")
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
    /// 1 for none; finite, >= 0). Variables without a gradient are left alone, their moments
    /// too. A gradient must have its variable's shape, be BF16, F16 or F32, and be on its
    /// device.
    ///
    /// All or nothing: any error (a gradient, a setting out of range, `step` at
    /// `i32::MAX`, an allocation) leaves the variables, the moments and `step` as they
    /// were, so the update can be retried. Everything that can fail runs before the first
    /// write: the checks of every gradient, their contiguous copies, and on CUDA the loading
    /// of the kernels. The writes themselves cannot fail on the CPU. On CUDA they are two
    /// kernel launches per variable, which fail only when the CUDA context has already
    /// failed (a sticky error of an earlier fault); then the variables and moments written
    /// before the failed launch hold their new values, the others their old ones, `step` is
    /// unchanged, and the device's memory cannot be read anymore anyway.
    pub fn update(&mut self, grads: &GradStore, grad_scale: f64) -> Result<()> {
        let step = self.check_settings(grad_scale)?;
        let mut todo = vec![];
        for (i, (name, var)) in self.vars.iter().enumerate() {
            if let Some(g) = grads.get(var.as_tensor()) {
                check_gradient(name, var, g)?;
                todo.push((i, g));
            }
        }
        // The kernels once per (device, dtype) the gradients use, not once per gradient: the
        // update runs every step, over every variable.
        let mut loaded = Vec::new();
        for (_, g) in &todo {
            let key = (g.device().location(), g.dtype());
            if !loaded.contains(&key) {
                adamw_ops::preload(g.device(), g.dtype())?;
                loaded.push(key);
            }
        }
        let todo = todo
            .into_iter()
            .map(|(i, g)| Ok((i, g.contiguous()?)))
            .collect::<Result<Vec<_>>>()?;
        let t = step as i32;
        let moments = Moments {
            scale: grad_scale as f32,
            beta1: self.beta1 as f32,
            beta2: self.beta2 as f32,
        };
        let apply = Apply {
            lr: self.lr as f32,
            decay: (1.0 - self.lr * self.weight_decay) as f32,
            c1: (1.0 - self.beta1.powi(t)) as f32,
            c2: (1.0 - self.beta2.powi(t)) as f32,
            eps: self.eps as f32,
        };
        for (i, g) in &todo {
            let (var, mv) = (&self.vars[*i].1, &self.moments[*i]);
            mv.inplace_op2(g, &moments)?;
            var.as_tensor().inplace_op2(mv, &apply)?;
        }
        self.step = step;
        Ok(())
    }

    /// The step the next update makes, once the settings and `grad_scale` are in range.
    fn check_settings(&self, grad_scale: f64) -> Result<usize> {
        let Some(step) = self.step.checked_add(1).filter(|s| *s <= i32::MAX as usize) else {
            bail!(
                "AdamW: step {} is at the limit of the bias corrections (i32::MAX)",
                self.step
            )
        };
        let checks = [
            ("lr", self.lr, self.lr >= 0.0, "finite, >= 0"),
            (
                "beta1",
                self.beta1,
                (0.0..1.0).contains(&self.beta1),
                "in [0, 1)",
            ),
            (
                "beta2",
                self.beta2,
                (0.0..1.0).contains(&self.beta2),
                "in [0, 1)",
            ),
            ("eps", self.eps, self.eps >= 0.0, "finite, >= 0"),
            (
                "weight_decay",
                self.weight_decay,
                self.weight_decay >= 0.0,
                "finite, >= 0",
            ),
            ("grad_scale", grad_scale, grad_scale >= 0.0, "finite, >= 0"),
        ];
        for (what, value, in_range, expected) in checks {
            if !(value.is_finite() && in_range) {
                bail!("AdamW: {what} is {value}, expected {expected}")
            }
        }
        Ok(step)
    }

    /// A copy of the state, for a checkpoint or a roll-back: the moments as `m.NAME` /
    /// `v.NAME` (F32, shaped like the variable, on its device) and the step count as `step`
    /// (`(1,)` U32, on the first variable's device). Later updates do not change it.
    pub fn state(&self) -> Result<HashMap<String, Tensor>> {
        let mut out = HashMap::new();
        for ((name, var), mv) in self.vars.iter().zip(&self.moments) {
            // `force_contiguous` copies just the row (`copy` would clone both moments).
            out.insert(
                format!("m.{name}"),
                mv.get(0)?.force_contiguous()?.reshape(var.shape())?,
            );
            out.insert(
                format!("v.{name}"),
                mv.get(1)?.force_contiguous()?.reshape(var.shape())?,
            );
        }
        let dev = self
            .vars
            .first()
            .map(|(_, v)| v.device().clone())
            .unwrap_or(candle::Device::Cpu);
        let Ok(step) = u32::try_from(self.step) else {
            bail!("AdamW: step {} does not fit the state's U32", self.step)
        };
        out.insert("step".into(), Tensor::new(&[step], &dev)?);
        Ok(out)
    }

    /// Restores a state of the form [`AdamW::state`] writes (copied: the optimiser shares no
    /// memory with `state`). Each moment must be F32 and have its variable's shape, on its
    /// device or on the CPU; `step` one element, of an integer dtype or F32/F64, a whole
    /// number in `0..=i32::MAX`, on the first variable's device or on the CPU. Errors name
    /// the entry: a moment or `step` missing, of another shape, dtype or device, a `step` out
    /// of range, or an entry that belongs to no variable. On error nothing changes.
    pub fn load_state(&mut self, state: &HashMap<String, Tensor>) -> Result<()> {
        let (moments, step) = adamw_state::parse(&self.vars, state)?;
        self.moments = moments;
        self.step = step;
        Ok(())
    }
}

/// Errors unless `g` can be the gradient of `var`.
fn check_gradient(name: &str, var: &Var, g: &Tensor) -> Result<()> {
    if g.dims() != var.dims() {
        bail!(
            "AdamW: the gradient of {name} has shape {:?}, expected the variable's {:?}",
            g.dims(),
            var.dims()
        )
    }
    host::check_float(g, &format!("AdamW: the gradient of {name}"))?;
    if !g.device().same_device(var.device()) {
        bail!(
            "AdamW: the gradient of {name} is on {:?}, expected its variable's device {:?}",
            g.device().location(),
            var.device().location()
        )
    }
    Ok(())
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
