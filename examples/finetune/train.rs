//! The training state: f32 master weights in a `VarMap` (or frozen, with LoRA adapters), the
//! model that casts them to the compute dtype in its forward (mixed precision as PyTorch's
//! autocast does it), the optimiser, and checkpoints the inference example loads.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use candle::{DType, Device, Tensor, Var, D};
use candle_nn::{VarBuilder, VarMap};

use super::data::Batch;
use super::lora::{self, LoraOpts};
use super::model::{AttnImpl, Config, Llama, TrainOpts};
use super::optim;
use candle_flash::train::AdamW;

/// What one optimiser step saw.
#[derive(Clone, Copy, Debug, Default)]
pub struct StepStats {
    pub loss: f64,
    pub correct: usize,
    pub count: usize,
    pub tokens: usize,
    pub grad_norm: f64,
}

pub struct Trainer {
    pub model: Llama,
    pub cfg: Config,
    varmap: VarMap,
    /// What the optimiser updates: every weight, or only the LoRA adapters.
    pub trainable: Vec<(String, Var)>,
    pub lora: Option<LoraOpts>,
    pub opt: AdamW,
    pub dropout: f32,
    pub seed: u64,
    /// Bitwise repeatable steps (`--deterministic`, `TrainOpts::deterministic`).
    pub deterministic: bool,
    dev: Device,
}

impl Trainer {
    /// A model of `cfg` with `weights` (f32 master copies, any dtype in the map) on `dev`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: &Config,
        weights: &HashMap<String, Tensor>,
        attn: AttnImpl,
        dtype: DType,
        dev: &Device,
        max_positions: usize,
        lora_opts: Option<LoraOpts>,
        weight_decay: f64,
        seed: u64,
    ) -> Result<Self> {
        // Each step frees and re-allocates gigabytes: keep them in CUDA's pool.
        candle_flash::train::retain_freed_device_memory(dev)?;
        let varmap = VarMap::new();
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, dev);
        let mut model = Llama::load(vb, cfg, attn, dtype, max_positions)?;
        {
            let vars = varmap.data().lock().unwrap();
            for (name, var) in vars.iter() {
                let Some(w) = weights.get(name) else {
                    bail!("weights: {name} is missing")
                };
                if w.dims() != var.dims() {
                    bail!(
                        "weights: {name} has shape {:?}, the model expects {:?}",
                        w.dims(),
                        var.dims()
                    )
                }
                var.set(&w.to_dtype(DType::F32)?.to_device(dev)?)?;
            }
        }
        let trainable = match lora_opts {
            Some(o) => lora::attach(&mut model, o, seed, dev)?,
            None => named_vars(&varmap),
        };
        let opt = AdamW::new(trainable.clone(), 0.0, weight_decay)?;
        Ok(Self {
            model,
            cfg: cfg.clone(),
            varmap,
            trainable,
            lora: lora_opts,
            opt,
            dropout: 0.0,
            seed,
            deterministic: false,
            dev: dev.clone(),
        })
    }

    /// Mean cross-entropy over the batch's targets, and how many the argmax gets right
    /// (counted only with `accuracy`: the argmax over every row costs a pass over the logits).
    pub fn loss(
        &self,
        batch: &Batch,
        train: Option<TrainOpts>,
        accuracy: bool,
    ) -> Result<(Tensor, usize, usize)> {
        let (ids, rows, targets) = batch.tensors(&self.dev)?;
        let hidden = self
            .model
            .forward_packed(&ids, &batch.seqlens, None, train)?;
        // The rows that predict a target. Candle's `index_select` has a slow backward on
        // CUDA (an `index_add` that walks every id per column: 8.7 ms at 16k rows, H100), the
        // fused embedding lookup a scatter-add; all rows need no gather at all.
        let all_rows = batch.rows.len() == batch.ids.len()
            && batch.rows.iter().enumerate().all(|(i, &r)| r as usize == i);
        let hidden = if all_rows {
            hidden
        } else {
            candle_flash::train::embedding(&hidden, &rows, hidden.dtype())?
        };
        // Logits in the compute dtype; the fused cross-entropy works in f32 inside.
        let logits = self.model.logits_raw(&hidden)?;
        let loss = candle_flash::train::cross_entropy(&logits, &targets)?;
        let correct = if accuracy {
            logits
                .argmax(D::Minus1)?
                .eq(&targets)?
                .to_dtype(DType::F32)?
                .sum_all()?
                .to_scalar::<f32>()? as usize
        } else {
            0
        };
        Ok((loss, correct, batch.targets.len()))
    }

    /// One optimiser step over `micro` batches (gradient accumulation: each contributes in
    /// proportion to its targets), clipped to `clip` global norm, at learning rate `lr`.
    pub fn step(&mut self, micro: &[Batch], lr: f64, clip: f64) -> Result<StepStats> {
        let total: usize = micro.iter().map(|b| b.targets.len()).sum();
        if total == 0 {
            bail!("a training step with no target")
        }
        let mut grads = None;
        let mut stats = StepStats::default();
        let mut timer = PhaseTimer::new(&self.dev)?;
        for (i, batch) in micro.iter().enumerate() {
            let train = TrainOpts {
                attn_dropout: self.dropout,
                seed: self
                    .seed
                    .wrapping_mul(1_000_003)
                    .wrapping_add((self.opt.step * 64 + i) as u64),
                deterministic: self.deterministic,
            };
            // Accuracy of training batches only where targets are few (the built-in task):
            // with a target per token it is a pass over all logits, and uninformative.
            let sparse = batch.targets.len() * 4 <= batch.ids.len();
            let (loss, correct, count) = self.loss(batch, Some(train), sparse)?;
            timer.mark("forward+loss")?;
            let weight = count as f64 / total as f64;
            stats.loss += loss.to_dtype(DType::F32)?.to_scalar::<f32>()? as f64 * weight;
            stats.correct += correct;
            stats.count += count;
            stats.tokens += batch.tokens();
            // Each micro-batch weighs by its targets: scaling the scalar loss scales its
            // gradients, with no pass over them.
            let loss = if micro.len() > 1 {
                (loss * weight)?
            } else {
                loss
            };
            optim::accumulate(&mut grads, loss.backward()?, &self.trainable)?;
            timer.mark("backward")?;
        }
        let grads = grads.expect("at least one micro-batch");
        let (norm, scale) = optim::clip_scale(&grads, &self.trainable, clip)?;
        stats.grad_norm = norm;
        timer.mark("grad norm")?;
        self.opt.lr = lr;
        self.opt.update(&grads, scale)?;
        timer.mark("adamw")?;
        drop(grads);
        timer.mark("free")?;
        timer.report();
        Ok(stats)
    }

    /// Mean loss and accuracy over `batches` (no dropout, no gradient).
    pub fn evaluate(&self, batches: &[Batch]) -> Result<(f64, f64)> {
        let (mut loss, mut correct, mut count) = (0.0, 0, 0);
        for b in batches {
            let (l, c, n) = self.loss(b, None, true)?;
            loss += l.to_dtype(DType::F32)?.to_scalar::<f32>()? as f64 * n as f64;
            correct += c;
            count += n;
        }
        Ok((
            loss / count.max(1) as f64,
            correct as f64 / count.max(1) as f64,
        ))
    }

    /// Writes a checkpoint into `dir`: the model (LoRA merged) as `model.safetensors` with
    /// `config.json` and `generation_config.json`, the tokenizer when given, the adapters on
    /// their own (`adapter.safetensors`), and the optimiser state for `--resume`.
    pub fn save(&self, dir: &Path, tokenizer: Option<&tokenizers::Tokenizer>) -> Result<()> {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let weights = self.model.named_weights(true)?;
        let weights: HashMap<String, Tensor> = weights
            .into_iter()
            .map(|(n, t)| Ok((n, t.to_dtype(DType::F32)?)))
            .collect::<Result<_>>()?;
        candle::safetensors::save(&weights, dir.join("model.safetensors"))?;
        super::builtin::write_config(dir, &self.cfg)?;
        if let Some(tok) = tokenizer {
            tok.save(dir.join("tokenizer.json"), false)
                .map_err(anyhow::Error::msg)?;
        }
        if let Some(o) = self.lora {
            candle::safetensors::save(
                &lora::tensors(&self.trainable),
                dir.join("adapter.safetensors"),
            )?;
            let meta = serde_json::json!({"rank": o.rank, "alpha": o.alpha, "mlp": o.mlp});
            std::fs::write(dir.join("adapter_config.json"), meta.to_string())?;
        }
        candle::safetensors::save(&self.opt.state()?, dir.join("optimizer.safetensors"))?;
        Ok(())
    }

    /// Restores what [`Trainer::save`] wrote: the trainable weights (the adapters with LoRA)
    /// and the optimiser state, so training continues where it stopped.
    pub fn resume(&mut self, dir: &Path) -> Result<()> {
        let file = if self.lora.is_some() {
            "adapter.safetensors"
        } else {
            "model.safetensors"
        };
        let saved = candle::safetensors::load(dir.join(file), &self.dev)
            .with_context(|| format!("--resume {}: {file}", dir.display()))?;
        for (name, var) in &self.trainable {
            let Some(t) = saved.get(name) else {
                bail!("--resume {}: {name} missing from {file}", dir.display())
            };
            var.set(&t.to_dtype(DType::F32)?)?;
        }
        let state = candle::safetensors::load(dir.join("optimizer.safetensors"), &self.dev)
            .with_context(|| format!("--resume {}: optimizer.safetensors", dir.display()))?;
        self.opt.load_state(&state)?;
        Ok(())
    }

    /// The master weights by name (tests).
    pub fn weights(&self) -> HashMap<String, Tensor> {
        named_vars(&self.varmap)
            .into_iter()
            .map(|(n, v)| (n, v.as_tensor().clone()))
            .collect()
    }
}

/// The variables of `varmap` by name, sorted (a stable order for the optimiser state).
fn named_vars(varmap: &VarMap) -> Vec<(String, Var)> {
    let mut v: Vec<(String, Var)> = varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// With `FT_TIMING=1`: where a step's wall time goes. Each mark records the host time to
/// queue the phase, then waits for the device, so a phase's device time shows separately
/// from its launch time (the waits serialise the step: for attribution, not for speed).
struct PhaseTimer<'a> {
    dev: &'a Device,
    on: bool,
    last: std::time::Instant,
    phases: Vec<(&'static str, f64, f64)>,
}

impl<'a> PhaseTimer<'a> {
    fn new(dev: &'a Device) -> Result<Self> {
        let on = std::env::var("FT_TIMING").is_ok_and(|v| v == "1");
        if on {
            dev.synchronize()?;
        }
        Ok(Self {
            dev,
            on,
            last: std::time::Instant::now(),
            phases: vec![],
        })
    }

    fn mark(&mut self, name: &'static str) -> Result<()> {
        if !self.on {
            return Ok(());
        }
        let queued = self.last.elapsed().as_secs_f64() * 1e3;
        self.dev.synchronize()?;
        let total = self.last.elapsed().as_secs_f64() * 1e3;
        self.phases.push((name, queued, total));
        self.last = std::time::Instant::now();
        Ok(())
    }

    fn report(&self) {
        if self.on {
            let parts: Vec<String> = self
                .phases
                .iter()
                .map(|(n, q, t)| format!("{n} {t:.1} ms (queued in {q:.1})"))
                .collect();
            eprintln!("timing: {}", parts.join(", "));
        }
    }
}
