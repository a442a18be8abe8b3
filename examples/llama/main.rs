//! LLaMA-style text generation with candle-flash: a packed (varlen) prefill of every prompt
//! through `forward_varlen`, then token-by-token decoding from a preallocated (or paged) KV
//! cache through the crate's decode kernels.
//!
//! ```text
//! cargo run --release --example llama                                   # built-in model, CPU
//! cargo run --release --features cuda --example llama -- --model DIR --prompt "Once upon a time"
//! ```
//!
//! `--model DIR` takes a Hugging Face LLaMA-family checkpoint (LLaMA 2/3, TinyLlama, SmolLM,
//! Qwen2); without it the example writes and runs a small built-in model (see builtin.rs).

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle::{DType, Device};
use candle_transformers::generation::Sampling;
use clap::{Parser, ValueEnum};

mod baseline;
mod builtin;
mod checkpoint;
mod generate;
#[allow(dead_code)] // shared with the fine-tuning example and the tests
mod model;

use checkpoint::Checkpoint;
use generate::{GenOpts, Generation};
use model::{AttnImpl, CacheLayout};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Attention {
    /// candle-flash kernels (varlen prefill, KV-cache decode)
    Flash,
    /// plain Candle attention with a concatenating cache (for comparison)
    Naive,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
enum Impl {
    /// this example's model (attention per --attention)
    CandleFlash,
    /// candle-transformers' llama on the same weights (the baseline; greedy, equal lengths)
    CandleTransformers,
}

#[derive(Parser, Debug)]
#[command(about = "LLaMA-style generation with candle-flash attention")]
struct Args {
    /// Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json);
    /// without it a small built-in model is written to a temporary directory and used.
    #[arg(long)]
    model: Option<PathBuf>,
    /// A prompt; repeat for a batch of prompts (of any lengths).
    #[arg(long)]
    prompt: Vec<String>,
    /// A file of prompts, one per line (added to --prompt).
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// Instead of text: --batch prompts of this many seeded random token ids (benchmarks).
    #[arg(long)]
    random_prompt: Option<usize>,
    /// Prompts made by --random-prompt.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// Sampling temperature; 0 (the default) is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    #[arg(long)]
    top_k: Option<usize>,
    #[arg(long)]
    top_p: Option<f64>,
    /// Penalty on tokens seen in the last --repeat-last-n (1.0: none).
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    #[arg(long, default_value_t = 64)]
    repeat_last_n: usize,
    #[arg(long, default_value_t = 299792458)]
    seed: u64,
    /// f32, f16 or bf16 (default: bf16 on CUDA, f32 on the CPU).
    #[arg(long)]
    dtype: Option<String>,
    /// cpu or cuda (default: cuda when built with it and a GPU is present).
    #[arg(long)]
    device: Option<String>,
    /// A paged KV cache (PagedKvCache) instead of a contiguous one.
    #[arg(long)]
    paged: bool,
    #[arg(long, default_value_t = 16)]
    page_size: usize,
    #[arg(long, value_enum, default_value_t = Attention::Flash)]
    attention: Attention,
    #[arg(long = "impl", value_enum, default_value_t = Impl::CandleFlash)]
    implementation: Impl,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// Do not print text (benchmarks).
    #[arg(long)]
    quiet: bool,
    /// Print the prompt and generated token ids of each sequence.
    #[arg(long)]
    print_ids: bool,
    /// Print one JSON line of measurements at the end.
    #[arg(long)]
    stats_json: bool,
    /// Run a short generation (3 tokens) of the same prompts first, so the timed run pays no
    /// one-time costs (kernel loading, cuBLAS set-up, memory pool growth).
    #[arg(long)]
    warmup: bool,
    /// Time the generation this many times (streaming only the first) and report the median
    /// time to first token and decoding time (benchmarks: host timing at batch 1 is noisy).
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Write the first step's logits (batch, vocab) f32 to this safetensors file.
    #[arg(long)]
    logits_out: Option<PathBuf>,
}

fn sampling(args: &Args) -> Sampling {
    let t = args.temperature;
    if t <= 0.0 {
        return Sampling::ArgMax;
    }
    match (args.top_k, args.top_p) {
        (None, None) => Sampling::All { temperature: t },
        (Some(k), None) => Sampling::TopK { k, temperature: t },
        (None, Some(p)) => Sampling::TopP { p, temperature: t },
        (Some(k), Some(p)) => Sampling::TopKThenTopP {
            k,
            p,
            temperature: t,
        },
    }
}

/// Prints a sequence's text as it grows, on whole UTF-8 characters only.
struct Streamer<'a> {
    tok: &'a tokenizers::Tokenizer,
    ids: Vec<u32>,
    printed: usize,
}

impl Streamer<'_> {
    fn push(&mut self, id: u32) -> Result<()> {
        self.ids.push(id);
        let text = self
            .tok
            .decode(&self.ids, true)
            .map_err(anyhow::Error::msg)?;
        if text.len() > self.printed && !text.ends_with('\u{FFFD}') {
            if let Some(new) = text.get(self.printed..) {
                print!("{new}");
                std::io::stdout().flush()?;
            }
            self.printed = text.len();
        }
        Ok(())
    }
}

fn prompts(args: &Args, ckpt: &Checkpoint) -> Result<(Vec<String>, Vec<Vec<u32>>)> {
    if let Some(len) = args.random_prompt {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed);
        let v = ckpt.config.vocab_size as u32;
        let ids = (0..args.batch)
            .map(|_| (0..len).map(|_| rng.random_range(0..v)).collect())
            .collect();
        return Ok((vec![String::new(); args.batch], ids));
    }
    let mut texts = args.prompt.clone();
    if let Some(f) = &args.prompt_file {
        let body =
            std::fs::read_to_string(f).with_context(|| format!("--prompt-file {}", f.display()))?;
        texts.extend(
            body.lines()
                .filter(|l| !l.trim().is_empty())
                .map(String::from),
        );
    }
    if texts.is_empty() {
        texts.push("FlashAttention computes exact attention".into());
    }
    let tok = ckpt.tokenizer()?;
    let ids = texts
        .iter()
        .map(|t| {
            tok.encode(t.as_str(), true)
                .map(|e| e.get_ids().to_vec())
                .map_err(anyhow::Error::msg)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((texts, ids))
}

fn report(args: &Args, dev: &Device, dt: DType, gen: &Generation, ckpt: &Checkpoint) {
    let s = &gen.stats;
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    eprintln!(
        "{} prompt tokens in {} sequence(s): {:.1} ms to first token ({:.1} prompt tokens/s)",
        s.prompt_tokens,
        s.batch,
        s.time_to_first_token.as_secs_f64() * 1e3,
        s.prompt_tokens_per_s()
    );
    eprintln!(
        "{} tokens generated: {:.1} tokens/s from the second token ({} steps, {:.2} ms/step)",
        s.generated_tokens,
        s.generated_tokens_per_s(),
        s.decode_steps,
        s.decode_time.as_secs_f64() * 1e3 / s.decode_steps.max(1) as f64
    );
    if let Some(p) = s.peak_memory {
        let what = if dev.is_cuda() {
            "device memory (CUDA pool high-water mark)"
        } else {
            "resident memory"
        };
        eprintln!("peak {what}: {:.1} MiB", mib(p));
    }
    if args.stats_json {
        let attention = match args.implementation {
            Impl::CandleTransformers => "candle-transformers",
            Impl::CandleFlash => generate::attn_name(attn_impl(args)),
        };
        let json = serde_json::json!({
            "model": ckpt.dir.display().to_string(),
            "impl": attention,
            "paged": args.paged,
            "dtype": format!("{dt:?}"),
            "device": if dev.is_cuda() { "cuda" } else { "cpu" },
            "batch": s.batch,
            "prompt_tokens": s.prompt_tokens,
            "generated_tokens": s.generated_tokens,
            "ttft_ms": s.time_to_first_token.as_secs_f64() * 1e3,
            "prefill_tok_s": s.prompt_tokens_per_s(),
            "decode_tok_s": s.generated_tokens_per_s(),
            "decode_ms_per_step": s.decode_time.as_secs_f64() * 1e3 / s.decode_steps.max(1) as f64,
            "peak_mem_mib": s.peak_memory.map(mib),
            "runs": s.runs,
        });
        println!("{json}");
    }
}

fn attn_impl(args: &Args) -> AttnImpl {
    match args.attention {
        Attention::Flash => AttnImpl::Flash,
        Attention::Naive => AttnImpl::Naive,
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dev = generate::parse_device(args.device.as_deref())?;
    let flash =
        matches!(args.attention, Attention::Flash) && args.implementation == Impl::CandleFlash;
    let dt = generate::choose_dtype(args.dtype.as_deref(), &dev, flash)?;
    let dir = match &args.model {
        Some(d) => d.clone(),
        None => {
            let d = std::env::temp_dir().join("candle-flash-builtin-llama");
            builtin::write(&d, 0).context("writing the built-in model")?;
            eprintln!("built-in model written to {}", d.display());
            d
        }
    };
    let ckpt = Checkpoint::open(&dir)?;
    let (texts, ids) = prompts(&args, &ckpt)?;
    let opts = GenOpts {
        max_new_tokens: args.max_new_tokens,
        sampling: sampling(&args),
        seed: args.seed,
        repeat_penalty: args.repeat_penalty,
        repeat_last_n: args.repeat_last_n,
        eos_ids: ckpt.eos_ids.clone(),
        ignore_eos: args.ignore_eos,
        layout: if args.paged {
            if args.page_size == 0 {
                bail!("--page-size: must be > 0")
            }
            CacheLayout::Paged {
                page_size: args.page_size,
            }
        } else {
            CacheLayout::Contiguous
        },
        record_logits: args.logits_out.is_some(),
    };
    let stream = !args.quiet && ids.len() == 1 && args.random_prompt.is_none();
    let warmup_opts = GenOpts {
        max_new_tokens: args.max_new_tokens.min(3),
        record_logits: false,
        ..opts.clone()
    };
    // The warm-up takes the same prompts: the timed run then finds the memory pool grown and
    // every kernel and cuBLAS plan of its shapes loaded.
    if args.repeat == 0 {
        bail!("--repeat: must be at least 1")
    }
    let mut gen = match args.implementation {
        Impl::CandleTransformers => {
            if args.warmup {
                baseline::generate(&ckpt, dt, &dev, &ids, &warmup_opts)?;
            }
            let mut runs = vec![];
            for _ in 0..args.repeat {
                runs.push(baseline::generate(&ckpt, dt, &dev, &ids, &opts)?);
            }
            generate::median_run(runs)
        }
        Impl::CandleFlash => {
            let max_len = ids.iter().map(Vec::len).max().unwrap_or(0) + args.max_new_tokens;
            let model = ckpt.load(attn_impl(&args), dt, &dev, max_len)?;
            if args.warmup {
                generate::generate(&model, &ids, &warmup_opts, |_, _| {})?;
            }
            let mut streamer = match (stream, ckpt.tokenizer.as_ref()) {
                (true, Some(tok)) => {
                    print!("{}", texts[0]);
                    Some(Streamer {
                        tok,
                        ids: Vec::new(),
                        printed: 0,
                    })
                }
                _ => None,
            };
            let mut err = None;
            let gen = generate::generate(&model, &ids, &opts, |_, t| {
                if let Some(s) = streamer.as_mut() {
                    if let Err(e) = s.push(t) {
                        err.get_or_insert(e);
                    }
                }
            })?;
            if let Some(e) = err {
                return Err(e);
            }
            let mut runs = vec![gen];
            for _ in 1..args.repeat {
                runs.push(generate::generate(&model, &ids, &opts, |_, _| {})?);
            }
            generate::median_run(runs)
        }
    };
    gen.stats.runs = args.repeat;
    if stream {
        println!();
    } else if !args.quiet {
        if let Some(tok) = &ckpt.tokenizer {
            for (b, toks) in gen.tokens.iter().enumerate() {
                let text = tok.decode(toks, true).map_err(anyhow::Error::msg)?;
                println!("[{b}] {}{text}", texts[b]);
            }
        }
    }
    if args.print_ids {
        for (b, toks) in gen.tokens.iter().enumerate() {
            println!("ids[{b}] prompt={:?} new={:?}", ids[b], toks);
        }
    }
    if let Some(path) = &args.logits_out {
        let first = gen.logits.first().context("no logits were recorded")?;
        let map = std::collections::HashMap::from([("logits".to_string(), first.clone())]);
        candle::safetensors::save(&map, path)?;
    }
    report(&args, &dev, dt, &gen, &ckpt);
    Ok(())
}
