//! Training a LLaMA-style model with candle-flash's forward and backward: the model of the
//! inference example (`examples/llama/model.rs`), packed documents (varlen: no token attends
//! across a document), AdamW, warm-up + cosine learning rate, gradient clipping and
//! accumulation, evaluation on a held-out split, checkpoints the inference example loads.
//!
//! ```text
//! cargo run --release --example finetune                       # built-in copy task, CPU
//! cargo run --release --features cuda --example finetune -- --context 2048
//! cargo run --release --features cuda --example finetune -- --model DIR --data notes.jsonl --lora 16
//! ```

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle::Device;
use clap::{Parser, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};

#[allow(dead_code)] // shared with the inference example
#[path = "../llama/builtin.rs"]
mod builtin;
#[allow(dead_code)]
#[path = "../llama/checkpoint.rs"]
mod checkpoint;
#[allow(dead_code)]
#[path = "../llama/generate.rs"]
mod generate;
#[allow(dead_code)]
#[path = "../llama/model.rs"]
mod model;

mod data;
mod lora;
mod optim;
mod plot;
mod task;
#[allow(dead_code)] // Trainer::weights serves the tests
mod train;

use data::Batch;
use model::{AttnImpl, Config};
use task::{CopyTask, Recall, Task};
use train::Trainer;

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
enum Shape {
    /// the inference example's built-in model (hidden 256, 4 layers, 4/2 heads)
    Builtin,
    /// ~150M parameters: hidden 768, 12 layers, 12/4 heads, head_dim 64
    #[value(name = "150m")]
    M150,
    /// LLaMA-3.2-1B's shape: hidden 2048, 16 layers, 32/8 heads, vocab 128256, tied
    #[value(name = "1b")]
    B1,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
enum TaskKind {
    /// a random block then the same block again, the loss on the second copy: needs an
    /// induction head over the whole context (on the H200, --context 2048 passes 99% in
    /// ~200 steps of 32 sequences)
    Copy,
    /// associative recall (key-value pairs among filler, then queries; loss on the queried
    /// values): from scratch it stays at chance (ln 128) for 1000+ steps, its targets too few
    Recall,
    /// random tokens with the loss on every next token (speed measurements, like
    /// pre-training: logits for every position)
    Random,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Attention {
    Flash,
    Naive,
}

#[derive(Parser, Debug)]
#[command(about = "Train a LLaMA-style model with candle-flash attention")]
struct Args {
    /// Hugging Face checkpoint to fine-tune; without it a model of --config is trained from
    /// scratch (seeded initialisation).
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = Shape::Builtin)]
    config: Shape,
    /// Text files or JSONL ({"text"} or {"prompt","completion"}); without it, the built-in
    /// task (--task).
    #[arg(long)]
    data: Vec<PathBuf>,
    /// Built-in task when no --data is given.
    #[arg(long, value_enum, default_value_t = TaskKind::Copy)]
    task: TaskKind,
    /// Built-in task: tokens per sequence.
    #[arg(long, default_value_t = 256)]
    context: usize,
    /// Recall task: key-value pairs per sequence.
    #[arg(long, default_value_t = 16)]
    pairs: usize,
    /// Recall task: questions per sequence.
    #[arg(long, default_value_t = 16)]
    queries: usize,
    /// Data: longest packed document (longer ones are cut).
    #[arg(long, default_value_t = 512)]
    seq_len: usize,
    /// Sequences per micro-batch (task; default 32 on CUDA, 16 on the CPU), or --batch *
    /// --seq-len tokens (data; default 16). The copy task at --context 2048 learned in 15 of
    /// 15 runs with 32 sequences a step (its drop by step 150) and in 20 of 25 with 16 (H200,
    /// docs/PERF.md session 19).
    #[arg(long)]
    batch: Option<usize>,
    #[arg(long, default_value_t = 1)]
    grad_accum: usize,
    /// Optimiser steps (default: 400 on CUDA, 60 on the CPU, where a step of the built-in
    /// task takes about a second: a smoke run, too short for the copy task to be learned).
    #[arg(long)]
    steps: Option<usize>,
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    #[arg(long, default_value_t = 1e-4)]
    min_lr: f64,
    #[arg(long, default_value_t = 30)]
    warmup: usize,
    #[arg(long, default_value_t = 0.01)]
    weight_decay: f64,
    /// Global gradient-norm bound (0: none).
    #[arg(long, default_value_t = 1.0)]
    clip: f64,
    #[arg(long, default_value_t = 50)]
    eval_every: usize,
    #[arg(long, default_value_t = 4)]
    eval_batches: usize,
    #[arg(long, default_value_t = 0.0)]
    attn_dropout: f32,
    /// Bitwise repeatable steps: flash attention's deterministic backward and the embedding's
    /// sorted backward (RMSNorm's dw and the gradient norm are always summed in a fixed
    /// order); only with `--attention flash`.
    #[arg(long)]
    deterministic: bool,
    /// LoRA rank on q/k/v/o (base weights frozen).
    #[arg(long)]
    lora: Option<usize>,
    #[arg(long, default_value_t = 16.0)]
    lora_alpha: f64,
    /// LoRA on gate/up/down too.
    #[arg(long)]
    lora_mlp: bool,
    #[arg(long, value_enum, default_value_t = Attention::Flash)]
    attention: Attention,
    /// f32, f16 or bf16 compute (default bf16 on CUDA, f32 on the CPU); weights stay f32.
    #[arg(long)]
    dtype: Option<String>,
    #[arg(long)]
    device: Option<String>,
    /// Checkpoint directory (written at the end and every --save-every steps).
    #[arg(long, default_value = "finetune-out")]
    out: PathBuf,
    #[arg(long, default_value_t = 0)]
    save_every: usize,
    /// Continue from a checkpoint written by this example (same options).
    #[arg(long)]
    resume: Option<PathBuf>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long)]
    stats_json: bool,
    #[arg(long)]
    no_progress: bool,
    /// Write no checkpoint at the end (speed measurements).
    #[arg(long)]
    no_save: bool,
}

fn shape_config(shape: Shape, vocab: usize, bos: u32, eos: u32) -> Config {
    let mut c = builtin::config(vocab, bos, eos);
    match shape {
        Shape::Builtin => {}
        Shape::M150 => {
            (c.hidden_size, c.intermediate_size, c.num_hidden_layers) = (768, 2048, 12);
            (c.num_attention_heads, c.num_key_value_heads, c.head_dim) = (12, Some(4), Some(64));
        }
        Shape::B1 => {
            (c.hidden_size, c.intermediate_size, c.num_hidden_layers) = (2048, 8192, 16);
            (c.num_attention_heads, c.num_key_value_heads, c.head_dim) = (32, Some(8), Some(64));
            (c.vocab_size, c.tie_word_embeddings) = (128256, true);
        }
    }
    c.max_position_embeddings = c.max_position_embeddings.max(8192);
    c
}

/// Training and evaluation batches for step `i`.
enum Source {
    /// A built-in task.
    Task(Task),
    Random {
        context: usize,
        vocab: u32,
    },
    Data {
        train: Vec<Batch>,
        eval: Vec<Batch>,
    },
}

impl Source {
    fn micro(&self, step: usize, k: usize, batch: usize, seed: u64) -> Batch {
        match self {
            Source::Task(t) => t.batch(
                batch,
                seed.wrapping_mul(7919)
                    .wrapping_add((step * 131 + k) as u64),
            ),
            Source::Random { context, vocab } => {
                random_batch(*context, *vocab, batch, (step * 131 + k) as u64)
            }
            Source::Data { train, .. } => train[(step * 131 + k) % train.len()].clone(),
        }
    }
    fn eval(&self, n: usize, batch: usize, seed: u64) -> Vec<Batch> {
        match self {
            Source::Task(t) => (0..n)
                .map(|i| t.batch(batch, seed ^ 0xe7a1 ^ (i as u64) << 32))
                .collect(),
            Source::Random { context, vocab } => (0..n)
                .map(|i| random_batch(*context, *vocab, batch, !(i as u64)))
                .collect(),
            Source::Data { eval, .. } => eval.iter().take(n.max(1)).cloned().collect(),
        }
    }
}

/// `batch` sequences of `context` random tokens, every next token a target.
fn random_batch(context: usize, vocab: u32, batch: usize, seed: u64) -> Batch {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    Batch::pack(
        (0..batch)
            .map(|_| {
                let tokens: Vec<u32> = (0..context).map(|_| rng.random_range(0..vocab)).collect();
                let targets = (0..context - 1).map(|i| (i, tokens[i + 1])).collect();
                data::Example { tokens, targets }
            })
            .collect(),
    )
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dev = generate::parse_device(args.device.as_deref())?;
    let flash = matches!(args.attention, Attention::Flash);
    let dtype = generate::choose_dtype(args.dtype.as_deref(), &dev, flash)?;
    let steps = args.steps.unwrap_or(if dev.is_cuda() { 400 } else { 60 });
    let batch = args
        .batch
        .unwrap_or(if dev.is_cuda() && args.data.is_empty() {
            32
        } else {
            16
        });
    let attn = match args.attention {
        Attention::Flash => AttnImpl::Flash,
        Attention::Naive => AttnImpl::Naive,
    };
    // The model, its weights and its tokenizer.
    let (cfg, weights, tokenizer) = match &args.model {
        Some(dir) => {
            let ck = checkpoint::Checkpoint::open(dir)?;
            let mut w = HashMap::new();
            for f in &ck.weights {
                w.extend(candle::safetensors::load(f, &Device::Cpu)?);
            }
            (ck.config.clone(), w, ck.tokenizer)
        }
        None => {
            let tok = builtin::train_tokenizer(2048)?;
            let bos = tok.token_to_id(builtin::BOS).context("tokenizer: no <s>")?;
            let eos = tok
                .token_to_id(builtin::EOS)
                .context("tokenizer: no </s>")?;
            let cfg = shape_config(args.config, tok.get_vocab_size(true), bos, eos);
            let w = builtin::weights(&cfg, args.seed)?;
            (cfg, w, Some(tok))
        }
    };
    let bos = cfg.bos_token_id.unwrap_or(1);
    let source = if args.data.is_empty() && args.task == TaskKind::Random {
        if args.context < 2 {
            bail!("--context: at least 2 tokens")
        }
        Source::Random {
            context: args.context,
            vocab: cfg.vocab_size as u32,
        }
    } else if args.data.is_empty() {
        Source::Task(match args.task {
            TaskKind::Copy => Task::Copy(CopyTask::new(args.context, cfg.vocab_size, bos)?),
            _ => Task::Recall(Recall::new(
                args.context,
                args.pairs,
                args.queries,
                cfg.vocab_size,
                bos,
            )?),
        })
    } else {
        let tok = tokenizer
            .as_ref()
            .context("--data: the model has no tokenizer.json")?;
        let eos = cfg.eos_ids().first().copied();
        let mut docs = vec![];
        for p in &args.data {
            docs.extend(data::load(p, tok, eos, args.seq_len)?);
        }
        let held = (docs.len() / 10).max(1).min(docs.len().saturating_sub(1));
        if docs.len() < 2 {
            bail!("--data: need at least two documents (one is held out for evaluation)")
        }
        let eval_docs = docs.split_off(docs.len() - held);
        let max_tokens = batch * args.seq_len;
        Source::Data {
            train: data::batches(&docs, max_tokens),
            eval: data::batches(&eval_docs, max_tokens),
        }
    };
    let max_pos = match &source {
        Source::Task(_) | Source::Random { .. } => args.context,
        Source::Data { .. } => args.seq_len,
    };
    let lora = args.lora.map(|rank| lora::LoraOpts {
        rank,
        alpha: args.lora_alpha,
        mlp: args.lora_mlp,
    });
    let mut trainer = Trainer::new(
        &cfg,
        &weights,
        attn,
        dtype,
        &dev,
        max_pos,
        lora,
        args.weight_decay,
        args.seed,
    )?;
    trainer.dropout = args.attn_dropout;
    trainer.deterministic = args.deterministic;
    drop(weights);
    if let Some(dir) = &args.resume {
        trainer.resume(dir)?;
        eprintln!(
            "resumed from {} at step {}",
            dir.display(),
            trainer.opt.step
        );
    }
    let eval_set = source.eval(args.eval_batches, batch, args.seed);
    let (loss0, acc0) = trainer.evaluate(&eval_set)?;
    eprintln!(
        "eval before training: loss {loss0:.4}, accuracy {:.1}%",
        acc0 * 100.0
    );

    let bar = if args.no_progress {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(steps as u64)
    };
    bar.set_style(ProgressStyle::with_template(
        "{bar:30} {pos}/{len} {msg} ETA {eta}",
    )?);
    bar.set_position(trainer.opt.step as u64);
    let (mut train_curve, mut eval_curve) = (vec![], vec![(trainer.opt.step, loss0)]);
    let (mut timed_tokens, mut timed) = (0usize, std::time::Duration::ZERO);
    generate::memory::reset_peak(&dev);
    let (mut last_eval, mut last_acc) = (loss0, acc0);
    while trainer.opt.step < steps {
        let step = trainer.opt.step;
        let micro: Vec<Batch> = (0..args.grad_accum)
            .map(|k| source.micro(step, k, batch, args.seed))
            .collect();
        let lr = optim::learning_rate(step, args.warmup, steps, args.lr, args.min_lr);
        let t0 = Instant::now();
        let s = trainer.step(&micro, lr, args.clip)?;
        dev.synchronize()?;
        let dt = t0.elapsed();
        // The first two steps load kernels and grow the memory pool: not timed.
        if step >= 2 {
            (timed_tokens, timed) = (timed_tokens + s.tokens, timed + dt);
        }
        train_curve.push((step + 1, s.loss));
        let tps = s.tokens as f64 / dt.as_secs_f64();
        bar.set_message(format!(
            "loss {:.4} lr {lr:.2e} |g| {:.2} {tps:.0} tok/s",
            s.loss, s.grad_norm
        ));
        bar.inc(1);
        let done = trainer.opt.step;
        if done % args.eval_every.max(1) == 0 || done == steps {
            (last_eval, last_acc) = trainer.evaluate(&eval_set)?;
            eval_curve.push((done, last_eval));
            let line = format!(
                "step {done}: eval loss {last_eval:.4}, accuracy {:.1}%",
                last_acc * 100.0
            );
            if args.no_progress {
                eprintln!("{line}");
            } else {
                bar.println(line);
            }
        }
        if args.save_every > 0 && done % args.save_every == 0 {
            trainer.save(&args.out, tokenizer.as_ref())?;
        }
    }
    bar.finish();
    if !args.no_save {
        trainer.save(&args.out, tokenizer.as_ref())?;
    }
    std::fs::create_dir_all(&args.out)?;
    let svg = plot::loss_svg(&train_curve, &eval_curve, "candle-flash fine-tuning: loss");
    std::fs::write(args.out.join("loss.svg"), svg)?;
    let tok_s = timed_tokens as f64 / timed.as_secs_f64().max(1e-9);
    let peak = generate::memory::peak(&dev);
    eprintln!(
        "eval loss {loss0:.4} -> {last_eval:.4}, accuracy {:.1}% -> {:.1}%; {tok_s:.0} training tokens/s; peak memory {}; checkpoint, loss.svg in {}",
        acc0 * 100.0,
        last_acc * 100.0,
        peak.map(|p| format!("{:.0} MiB", p as f64 / 1048576.0)).unwrap_or("n/a".into()),
        args.out.display()
    );
    sample(&trainer, &source, tokenizer.as_ref(), args.seed)?;
    if args.stats_json {
        let json = serde_json::json!({
            "attention": format!("{:?}", args.attention).to_lowercase(),
            "config": format!("{:?}", args.config), "dtype": format!("{dtype:?}"),
            "batch": batch, "grad_accum": args.grad_accum,
            "context": max_pos, "steps": steps,
            "tokens_per_s": tok_s, "peak_mem_mib": peak.map(|p| p as f64 / 1048576.0),
            "eval_loss_start": loss0, "eval_loss_end": last_eval,
            "accuracy_start": acc0, "accuracy_end": last_acc,
        });
        println!("{json}");
    }
    Ok(())
}

/// A final sample with the trained weights: the recall task's answers for one fresh
/// sequence, or a continuation of the first evaluation document.
fn sample(
    trainer: &Trainer,
    source: &Source,
    tok: Option<&tokenizers::Tokenizer>,
    seed: u64,
) -> Result<()> {
    match source {
        Source::Task(t) => {
            let b = t.batch(1, seed ^ 0x5a5a);
            let (ids, rows, _) = b.tensors(trainer.model.device())?;
            let hidden = trainer.model.forward_packed(&ids, &b.seqlens, None, None)?;
            let pred = trainer
                .model
                .logits(&hidden.index_select(&rows, 0)?)?
                .argmax(candle::D::Minus1)?;
            let pred = pred.to_vec1::<u32>()?;
            let shown: Vec<String> = b
                .rows
                .iter()
                .zip(&b.targets)
                .zip(&pred)
                .take(8)
                .map(|((&r, &t), &p)| {
                    format!(
                        "{} -> {p} ({})",
                        b.ids[r as usize],
                        if p == t { "right" } else { "wrong" }
                    )
                })
                .collect();
            eprintln!("sample: {}", shown.join(", "));
        }
        Source::Random { .. } => {}
        Source::Data { eval, .. } => {
            let (Some(tok), Some(first)) = (tok, eval.first()) else {
                return Ok(());
            };
            let prompt: Vec<u32> = first.ids[..first.seqlens[0].min(16)].to_vec();
            let opts = generate::GenOpts {
                max_new_tokens: 32,
                sampling: candle_transformers::generation::Sampling::ArgMax,
                seed,
                repeat_penalty: 1.1,
                repeat_last_n: 64,
                eos_ids: trainer.cfg.eos_ids(),
                ignore_eos: false,
                layout: model::CacheLayout::Contiguous,
                record_logits: false,
            };
            let g = generate::generate(
                &trainer.model,
                std::slice::from_ref(&prompt),
                &opts,
                |_, _| {},
            )?;
            let text = tok
                .decode(&[prompt, g.tokens[0].clone()].concat(), true)
                .map_err(anyhow::Error::msg)?;
            eprintln!("sample: {text}");
        }
    }
    Ok(())
}
