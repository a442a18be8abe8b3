//! The optimiser side of training around `candle_flash::train::AdamW` (fused, its state
//! saved in checkpoints; `candle_nn::AdamW` keeps its moments private, so a checkpoint
//! without them could not resume exactly): the warm-up + cosine learning-rate schedule,
//! gradient clipping by global norm, and gradient accumulation over micro-batches.

use candle::backprop::GradStore;
use candle::{Result, Var};

/// Linear warm-up over `warmup` steps to `peak`, then a cosine decay to `min` at `total`.
pub fn learning_rate(step: usize, warmup: usize, total: usize, peak: f64, min: f64) -> f64 {
    if step < warmup {
        return peak * (step + 1) as f64 / warmup as f64;
    }
    let span = total.saturating_sub(warmup).max(1);
    let progress = ((step - warmup) as f64 / span as f64).min(1.0);
    min + 0.5 * (peak - min) * (1.0 + (std::f64::consts::PI * progress).cos())
}

/// The global L2 norm of `vars`' gradients and the factor that clips it to `max_norm` (1
/// when it is within, or when `max_norm` is 0): the optimiser applies the factor inside its
/// update, so the gradients are never rewritten. One synchronisation for the whole model.
pub fn clip_scale(grads: &GradStore, vars: &[(String, Var)], max_norm: f64) -> Result<(f64, f64)> {
    let present: Vec<&candle::Tensor> = vars
        .iter()
        .filter_map(|(_, v)| grads.get(v.as_tensor()))
        .collect();
    if present.is_empty() {
        return Ok((0.0, 1.0));
    }
    let norm = (candle_flash::train::sum_squares(present)?.to_scalar::<f32>()? as f64).sqrt();
    let scale = if max_norm > 0.0 && norm > max_norm {
        max_norm / (norm + 1e-6)
    } else {
        1.0
    };
    Ok((norm, scale))
}

/// Adds `more` into `acc` for `vars` (gradient accumulation; each micro-batch's loss was
/// already weighted before its backward pass).
pub fn accumulate(
    acc: &mut Option<GradStore>,
    mut more: GradStore,
    vars: &[(String, Var)],
) -> Result<()> {
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
