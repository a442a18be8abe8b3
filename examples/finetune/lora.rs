//! LoRA (Hu et al. 2021): a frozen projection `W` learns `W + (alpha / rank) · B A` through two
//! small matrices, `A` `(rank, in)` drawn small and `B` `(out, rank)` zero, so training starts
//! from the base model exactly. Adapters are saved on their own (`adapter.safetensors`) and can
//! be merged into a full checkpoint the inference example loads.

use std::collections::HashMap;

use candle::{DType, Device, Result, Tensor, Var};
use rand::{rngs::StdRng, Rng, SeedableRng};

use super::model::{Llama, Lora};

/// Which projections get adapters.
#[derive(Clone, Copy, Debug)]
pub struct LoraOpts {
    pub rank: usize,
    pub alpha: f64,
    /// Also gate/up/down, not only q/k/v/o.
    pub mlp: bool,
}

/// Attaches fresh adapters (seeded) and freezes the base weights; returns the adapter
/// variables by name (`NAME.lora_a`, `NAME.lora_b`), the only ones to train.
pub fn attach(
    model: &mut Llama,
    opts: LoraOpts,
    seed: u64,
    dev: &Device,
) -> Result<Vec<(String, Var)>> {
    if opts.rank == 0 {
        candle::bail!("--lora: rank must be > 0")
    }
    model.detach_base();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut vars = vec![];
    for (name, proj) in model.projections_mut() {
        if !opts.mlp && name.contains(".mlp.") {
            continue;
        }
        let (out, inp) = proj.weight.dims2()?;
        let std = 1.0 / (inp as f32).sqrt();
        let a: Vec<f32> = (0..opts.rank * inp)
            .map(|_| std * (rng.random::<f32>() * 2.0 - 1.0))
            .collect();
        let a = Var::from_tensor(&Tensor::from_vec(a, (opts.rank, inp), dev)?)?;
        let b = Var::zeros((out, opts.rank), DType::F32, dev)?;
        proj.lora = Some(Lora {
            a: a.as_tensor().clone(),
            b: b.as_tensor().clone(),
            scale: opts.alpha / opts.rank as f64,
        });
        vars.push((format!("{name}.lora_a"), a));
        vars.push((format!("{name}.lora_b"), b));
    }
    Ok(vars)
}

/// The adapters by name, for `adapter.safetensors`.
pub fn tensors(vars: &[(String, Var)]) -> HashMap<String, Tensor> {
    vars.iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
        .collect()
}
