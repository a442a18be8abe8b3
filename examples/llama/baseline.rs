//! The code Candle users run today: candle-transformers' own `llama` model (no flash-attn
//! feature) on the same checkpoint, same prompts, same sampling, timed the same way. Its
//! cache grows by `Tensor::cat` and its GQA copies K/V (`repeat_kv`); prompts of one batch
//! must have equal lengths (it has no padding or varlen path).

use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle::{DType, Device, Tensor, D};
use candle_transformers::models::llama as ct;

use super::checkpoint::Checkpoint;
use super::generate::{memory, GenOpts, GenStats, Generation};

pub fn generate(
    ckpt: &Checkpoint,
    dtype: DType,
    dev: &Device,
    prompts: &[Vec<u32>],
    opts: &GenOpts,
) -> Result<Generation> {
    let batch = prompts.len();
    let len = prompts.first().map(Vec::len).unwrap_or(0);
    if batch == 0 || len == 0 || prompts.iter().any(|p| p.len() != len) {
        bail!("--impl candle-transformers: needs prompts of one (non-zero) length")
    }
    if opts.record_logits
        || !matches!(
            opts.sampling,
            candle_transformers::generation::Sampling::ArgMax
        )
    {
        bail!("--impl candle-transformers: only greedy decoding is wired up")
    }
    // The configuration as the checkpoint's config.json spells it (a GGUF file's included).
    let cfg: ct::LlamaConfig = serde_json::from_value(serde_json::to_value(&ckpt.config)?)
        .context("--impl candle-transformers: a configuration its llama does not take")?;
    let cfg = cfg.into_config(false);
    let vb = ckpt.var_builder(dtype, dev)?;
    let model = ct::Llama::load(vb, &cfg)?;
    let mut cache = ct::Cache::new(true, dtype, &cfg, dev)?;
    let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); batch];
    let mut stats = GenStats {
        batch,
        prompt_tokens: batch * len,
        ..GenStats::default()
    };
    dev.synchronize()?;
    memory::reset_peak(dev);
    let start = Instant::now();
    let ids: Vec<u32> = prompts.iter().flatten().copied().collect();
    let mut logits = model.forward(&Tensor::from_vec(ids, (batch, len), dev)?, 0, &mut cache)?;
    let mut decode_start = start;
    // The same end-of-sequence rule as ours (generate.rs), so that both stop where the
    // model ends its turn and their token counts and speeds compare.
    let mut done = vec![false; batch];
    for (step, pos) in (0..opts.max_new_tokens).zip(len..) {
        let next = logits.argmax(D::Minus1)?.to_vec1::<u32>()?;
        for (b, &t) in next.iter().enumerate() {
            if done[b] {
                continue;
            }
            tokens[b].push(t);
            if !opts.ignore_eos && opts.eos_ids.contains(&t) {
                done[b] = true;
            }
        }
        if step == 0 {
            stats.time_to_first_token = start.elapsed();
            decode_start = Instant::now();
        } else {
            stats.decode_steps += 1;
        }
        if step + 1 == opts.max_new_tokens || done.iter().all(|&d| d) {
            break;
        }
        let input = Tensor::from_vec(next, (batch, 1), dev)?;
        logits = model.forward(&input, pos, &mut cache)?;
    }
    dev.synchronize()?;
    stats.decode_time = decode_start.elapsed();
    stats.generated_tokens = tokens.iter().map(Vec::len).sum();
    stats.peak_memory = memory::peak(dev);
    Ok(Generation {
        tokens,
        stats,
        logits: Vec::new(),
    })
}
