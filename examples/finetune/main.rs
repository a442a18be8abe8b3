//! Training a LLaMA-style model with candle-flash's forward and backward: the model of the
//! inference example (`examples/llama/model/`), packed documents (varlen: no token attends
//! across a document), AdamW, warm-up + cosine learning rate, gradient clipping and
//! accumulation, evaluation on a held-out split, checkpoints the inference example loads.
//!
//! ```text
//! cargo run --release --example finetune                       # tiny model, copy task, CPU
//! cargo run --release --features cuda --example finetune -- --context 2048
//! cargo run --release --features cuda --example finetune -- --model DIR --data notes.jsonl --lora 16
//! ```

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

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
#[path = "../llama/model/mod.rs"]
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

/// What a run with no option does, for `--help`.
const DEFAULTS: &str = "\
Defaults: on the CPU, a tiny model (--config tiny, 0.18M parameters) learns the copy task at \
--context 128 from scratch: 300 steps of 16 sequences (lr 5e-3, 10 warm-up steps), its eval \
accuracy going from chance (~0%) to ~100% by step ~200; about 30 s on two cores, up to a \
minute when other work shares them. On CUDA, the built-in model (--config builtin) at --context 256: 400 \
steps of 32 sequences (lr 1e-3, 30 warm-up steps). Progress goes to stderr; the evaluation \
lines and the closing summary are printed whether or not stderr is a terminal.";

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
enum Shape {
    /// a tiny model for the CPU (the default there): hidden 64, 2 layers, 4/2 heads,
    /// head_dim 16
    Tiny,
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
    /// ~200 steps of 32 sequences; on the CPU, the tiny model at --context 128 in ~200 steps
    /// of 16)
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
#[command(
    about = "Train a LLaMA-style model with candle-flash attention",
    after_help = DEFAULTS
)]
struct Args {
    /// Hugging Face checkpoint to fine-tune; without it a model of --config is trained from
    /// scratch (seeded initialisation).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Model shape trained from scratch (default: tiny on the CPU, builtin on CUDA).
    #[arg(long, value_enum)]
    config: Option<Shape>,
    /// Text files or JSONL ({"text"} or {"prompt","completion"}); without it, the built-in
    /// task (--task).
    #[arg(long)]
    data: Vec<PathBuf>,
    /// Built-in task when no --data is given.
    #[arg(long, value_enum, default_value_t = TaskKind::Copy)]
    task: TaskKind,
    /// Built-in task: tokens per sequence (default 128 on the CPU, 256 on CUDA).
    #[arg(long)]
    context: Option<usize>,
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
    /// docs/PERF.md).
    #[arg(long)]
    batch: Option<usize>,
    #[arg(long, default_value_t = 1)]
    grad_accum: usize,
    /// Optimiser steps (default 300 on the CPU, 400 on CUDA).
    #[arg(long)]
    steps: Option<usize>,
    /// Peak learning rate (default 5e-3 for the tiny model trained from scratch, else 1e-3).
    #[arg(long)]
    lr: Option<f64>,
    #[arg(long, default_value_t = 1e-4)]
    min_lr: f64,
    /// Warm-up steps (default 10 for the tiny model trained from scratch, else 30).
    #[arg(long)]
    warmup: Option<usize>,
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
    /// Output directory: the checkpoint (written at the end and every --save-every steps)
    /// and loss.svg, the loss curves.
    #[arg(long, default_value = "finetune-out")]
    out: PathBuf,
    /// Also write the checkpoint every this many steps (0: only at the end).
    #[arg(long, default_value_t = 0)]
    save_every: usize,
    /// Continue from a checkpoint written by this example (same options).
    #[arg(long)]
    resume: Option<PathBuf>,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print the run's figures as one JSON line on stdout at the end.
    #[arg(long)]
    stats_json: bool,
    /// No progress bar (evaluation lines and the summary are still printed).
    #[arg(long)]
    no_progress: bool,
    /// Write nothing to --out: no checkpoint, no loss.svg (speed measurements).
    #[arg(long)]
    no_save: bool,
}

fn shape_config(shape: Shape, vocab: usize, bos: u32, eos: u32) -> Config {
    let mut c = builtin::config(vocab, bos, eos);
    match shape {
        Shape::Builtin => {}
        Shape::Tiny => {
            (c.hidden_size, c.intermediate_size, c.num_hidden_layers) = (64, 128, 2);
            (c.num_attention_heads, c.num_key_value_heads, c.head_dim) = (4, Some(2), Some(16));
        }
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
    /// The built-in task at `context` tokens, or the `--data` files packed into batches of
    /// up to `batch * --seq-len` tokens, a tenth of the documents held out for evaluation.
    fn new(
        args: &Args,
        cfg: &Config,
        tokenizer: Option<&tokenizers::Tokenizer>,
        context: usize,
        batch: usize,
    ) -> Result<Self> {
        let bos = cfg.bos_token_id.unwrap_or(1);
        if !args.data.is_empty() {
            let tok = tokenizer.context("--data: the model has no tokenizer.json")?;
            let eos = cfg.eos_ids().first().copied();
            let mut docs = vec![];
            for p in &args.data {
                docs.extend(data::load(p, tok, eos, args.seq_len)?);
            }
            if docs.len() < 2 {
                bail!("--data: need at least two documents (one is held out for evaluation)")
            }
            let held = (docs.len() / 10).max(1);
            let eval_docs = docs.split_off(docs.len() - held);
            let max_tokens = batch * args.seq_len;
            return Ok(Source::Data {
                train: data::batches(&docs, max_tokens),
                eval: data::batches(&eval_docs, max_tokens),
            });
        }
        Ok(match args.task {
            TaskKind::Random => {
                if context < 2 {
                    bail!("--context {context}: --task random needs at least 2 tokens")
                }
                Source::Random {
                    context,
                    vocab: cfg.vocab_size as u32,
                }
            }
            TaskKind::Copy => {
                Source::Task(Task::Copy(CopyTask::new(context, cfg.vocab_size, bos)?))
            }
            TaskKind::Recall => Source::Task(Task::Recall(Recall::new(
                context,
                args.pairs,
                args.queries,
                cfg.vocab_size,
                bos,
            )?)),
        })
    }

    /// What is trained on, for the opening line.
    fn describe(&self) -> String {
        match self {
            Source::Task(Task::Copy(_)) => "the copy task".into(),
            Source::Task(Task::Recall(r)) => {
                format!("the recall task ({} pairs, {} queries)", r.pairs, r.queries)
            }
            Source::Random { .. } => "random tokens".into(),
            Source::Data { train, eval } => format!(
                "--data ({} training batches, {} held-out)",
                train.len(),
                eval.len()
            ),
        }
    }

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
    let started = Instant::now();
    let args = Args::parse();
    if args.no_save && args.save_every > 0 {
        bail!(
            "--no-save writes nothing, --save-every {} writes checkpoints: pick one",
            args.save_every
        )
    }
    let dev = generate::parse_device(args.device.as_deref())?;
    let flash = matches!(args.attention, Attention::Flash);
    let dtype = generate::choose_dtype(args.dtype.as_deref(), &dev, flash)?;
    // The CPU's defaults make a run without options a demonstration that fits in about a
    // minute on two cores: a tiny model on a short copy task, which it learns by step ~200.
    let cpu = !dev.is_cuda();
    let shape = args
        .config
        .unwrap_or(if cpu { Shape::Tiny } else { Shape::Builtin });
    let context = args.context.unwrap_or(if cpu { 128 } else { 256 });
    let steps = args.steps.unwrap_or(if cpu { 300 } else { 400 });
    let batch = args
        .batch
        .unwrap_or(if !cpu && args.data.is_empty() { 32 } else { 16 });
    // The tiny model from scratch wants a higher rate and a shorter warm-up. On the copy task
    // at context 128 (CPU, 300 steps): lr 5e-3 after 10 warm-up steps passes 97% by step 200
    // for each of 4 seeds; at 1e-3 it is still at chance at step 300, and after 30 warm-up
    // steps it reaches only 5% (at context 64, 1e-2 leaves the plateau later than 5e-3).
    let tiny = shape == Shape::Tiny && args.model.is_none();
    let lr = args.lr.unwrap_or(if tiny { 5e-3 } else { 1e-3 });
    let warmup = args.warmup.unwrap_or(if tiny { 10 } else { 30 });
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
            let cfg = shape_config(shape, tok.get_vocab_size(true), bos, eos);
            let w = builtin::weights(&cfg, args.seed)?;
            (cfg, w, Some(tok))
        }
    };
    let source = Source::new(&args, &cfg, tokenizer.as_ref(), context, batch)?;
    let max_pos = match &source {
        Source::Task(_) | Source::Random { .. } => context,
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
    let params: usize = trainer.trainable.iter().map(|(_, v)| v.elem_count()).sum();
    if let Some(dir) = &args.resume {
        trainer.resume(dir)?;
    }
    let model_name = match (&args.resume, &args.model) {
        (Some(dir), _) => format!(
            "continuing {} from step {}",
            dir.display(),
            trainer.opt.step
        ),
        (None, Some(dir)) => format!("fine-tuning {}", dir.display()),
        (None, None) => format!(
            "training the {} model from scratch",
            shape
                .to_possible_value()
                .expect("no skipped shape")
                .get_name()
        ),
    };
    let mut per_step = match &source {
        Source::Data { .. } => format!("up to {} tokens", batch * args.seq_len),
        _ => format!("{batch} x {context} tokens"),
    };
    if args.grad_accum > 1 {
        per_step += &format!(", {} accumulated", args.grad_accum);
    }
    let first_step = trainer.opt.step;
    eprintln!(
        "{model_name} ({:.2}M trainable parameters) on {}: {} steps of {per_step}, lr \
         {lr:e}, {} {dtype:?}",
        params as f64 / 1e6,
        source.describe(),
        steps.saturating_sub(first_step),
        if cpu { "CPU" } else { "CUDA" },
    );
    let eval_set = source.eval(args.eval_batches, batch, args.seed);
    let (loss0, acc0) = trainer.evaluate(&eval_set)?;
    eprintln!(
        "step {first_step}/{steps}: eval loss {loss0:.4}, accuracy {:.1}%{}",
        acc0 * 100.0,
        if first_step == 0 {
            " (before training)"
        } else {
            ""
        }
    );

    let bar = if args.no_progress {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(steps as u64)
    };
    bar.set_style(ProgressStyle::with_template(
        "{bar:30} {pos}/{len} {msg} ETA {eta}",
    )?);
    bar.set_position(first_step as u64);
    let (mut train_curve, mut eval_curve) = (vec![], vec![(first_step, loss0)]);
    // Training throughput over the whole run and since the last evaluation line.
    let (mut all, mut timed, mut window) = (
        Throughput::default(),
        Throughput::default(),
        Throughput::default(),
    );
    generate::memory::reset_peak(&dev);
    let (mut last_eval, mut last_acc) = (loss0, acc0);
    while trainer.opt.step < steps {
        let step = trainer.opt.step;
        let micro: Vec<Batch> = (0..args.grad_accum)
            .map(|k| source.micro(step, k, batch, args.seed))
            .collect();
        let lr_now = optim::learning_rate(step, warmup, steps, lr, args.min_lr);
        let t0 = Instant::now();
        let s = trainer.step(&micro, lr_now, args.clip)?;
        dev.synchronize()?;
        let dt = t0.elapsed();
        all.add(&s, dt);
        window.add(&s, dt);
        // The first two steps load kernels and grow the memory pool: not timed.
        if step >= first_step + 2 {
            timed.add(&s, dt);
        }
        train_curve.push((step + 1, s.loss));
        bar.set_message(format!(
            "loss {:.4} lr {lr_now:.2e} |g| {:.2} {:.0} tok/s",
            s.loss,
            s.grad_norm,
            s.tokens as f64 / dt.as_secs_f64()
        ));
        bar.inc(1);
        let done = trainer.opt.step;
        if done % args.eval_every.max(1) == 0 || done == steps {
            (last_eval, last_acc) = trainer.evaluate(&eval_set)?;
            eval_curve.push((done, last_eval));
            say(
                &bar,
                &format!(
                    "step {done}/{steps}: eval loss {last_eval:.4}, accuracy {:.1}%; train loss \
                     {:.4}, {:.0} tokens/s, {:.0} s elapsed",
                    last_acc * 100.0,
                    window.mean_loss(),
                    window.tokens_per_s(),
                    started.elapsed().as_secs_f64()
                ),
            );
            window = Throughput::default();
        }
        if args.save_every > 0 && done % args.save_every == 0 && done < steps {
            trainer.save(&args.out, tokenizer.as_ref())?;
            say(
                &bar,
                &format!("step {done}: checkpoint written to {}", args.out.display()),
            );
        }
    }
    // The last evaluation line and the summary below say what the bar said.
    bar.finish_and_clear();
    let written = if args.no_save {
        "nothing written (--no-save)".to_string()
    } else {
        trainer.save(&args.out, tokenizer.as_ref())?;
        let svg = plot::loss_svg(&train_curve, &eval_curve, "candle-flash fine-tuning: loss");
        std::fs::write(args.out.join("loss.svg"), svg)?;
        format!("checkpoint and loss.svg in {}", args.out.display())
    };
    sample(&trainer, &source, tokenizer.as_ref(), args.seed)?;
    // Steady-state throughput; a run too short to have any falls back to every step.
    let tok_s = if timed.steps > 0 { timed } else { all }.tokens_per_s();
    let peak = generate::memory::peak(&dev).map(|p| p as f64 / 1048576.0);
    let peak_note = match peak {
        Some(p) if cpu => format!(", peak resident memory {p:.0} MiB"),
        Some(p) => format!(", peak device memory {p:.0} MiB"),
        None => String::new(),
    };
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "done: {} steps in {secs:.1} s, eval loss {loss0:.4} -> {last_eval:.4}, accuracy \
         {:.1}% -> {:.1}%, {tok_s:.0} training tokens/s{peak_note}; {written}",
        all.steps,
        acc0 * 100.0,
        last_acc * 100.0,
    );
    if args.stats_json {
        let json = serde_json::json!({
            "attention": format!("{:?}", args.attention).to_lowercase(),
            "config": format!("{shape:?}"), "dtype": format!("{dtype:?}"),
            "batch": batch, "grad_accum": args.grad_accum,
            "context": max_pos, "steps": steps, "lr": lr, "seconds": secs,
            "tokens_per_s": tok_s, "peak_mem_mib": peak,
            "eval_loss_start": loss0, "eval_loss_end": last_eval,
            "accuracy_start": acc0, "accuracy_end": last_acc,
        });
        println!("{json}");
    }
    Ok(())
}

/// Prints a line above the progress bar. `ProgressBar::println` would drop it when the bar
/// is hidden (--no-progress, or stderr not a terminal, where indicatif hides the bar).
fn say(bar: &ProgressBar, line: &str) {
    bar.suspend(|| eprintln!("{line}"));
}

/// Training steps, their tokens, loss and time, summed.
#[derive(Clone, Copy, Default)]
struct Throughput {
    steps: usize,
    tokens: usize,
    loss: f64,
    time: Duration,
}

impl Throughput {
    fn add(&mut self, s: &train::StepStats, dt: Duration) {
        self.steps += 1;
        self.tokens += s.tokens;
        self.loss += s.loss;
        self.time += dt;
    }
    fn mean_loss(&self) -> f64 {
        self.loss / self.steps.max(1) as f64
    }
    fn tokens_per_s(&self) -> f64 {
        self.tokens as f64 / self.time.as_secs_f64().max(1e-9)
    }
}

/// A final sample with the trained weights: the built-in task's first predictions for one
/// fresh sequence, or a greedy continuation of the first held-out document.
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
                .targets
                .iter()
                .zip(&pred)
                .take(8)
                .map(|(&t, &p)| {
                    if p == t {
                        format!("{p} right")
                    } else {
                        format!("{p} wrong (wanted {t})")
                    }
                })
                .collect();
            eprintln!(
                "sample, the first predicted targets of a fresh sequence: {}",
                shown.join(", ")
            );
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
            eprintln!("sample, a held-out document's first tokens continued greedily: {text}");
        }
    }
    Ok(())
}
