//! LLaMA-style text generation with candle-flash: a packed (varlen) prefill of every prompt
//! through `forward_varlen`, then token-by-token decoding from a preallocated (or paged) KV
//! cache through the crate's decode kernels.
//!
//! ```text
//! scripts/model/fetch-model.sh                    # SmolLM2-135M-Instruct into the cache, once
//! cargo run --release --example llama             # that model (or the built-in one), CPU
//! cargo run --release --example llama -- --chat --prompt "What is the capital of France?"
//! cargo run --release --features cuda --example llama -- --model DIR --prompt "Once upon a time"
//! ```
//!
//! On CUDA each decoding step is a CUDA graph, captured once per batch size and replayed
//! (graph.rs); `--no-cuda-graph` launches its ops one by one instead.
//!
//! `--model` takes a Hugging Face LLaMA-family checkpoint directory (LLaMA 2/3, TinyLlama,
//! SmolLM, Qwen2), a `.gguf` file of the llama architecture (dequantized on load, see
//! gguf.rs) or a hub id (source.rs); without it the example runs SmolLM2-135M-Instruct when
//! it is in the cache, else a small built-in model with random weights (see builtin.rs).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle::{DType, Device};
use candle_transformers::generation::Sampling;
use clap::{Parser, ValueEnum};

mod baseline;
mod builtin;
mod chat;
mod checkpoint;
mod generate;
mod gguf;
mod graph;
#[allow(dead_code)] // shared with the fine-tuning example and the tests
mod model;
mod source;
mod stream;
mod tokenizer_gguf;

use checkpoint::Checkpoint;
use generate::{GenOpts, Generation};
use model::{AttnImpl, CacheLayout};
use source::Source;

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Attention {
    /// candle-flash kernels (varlen prefill, KV-cache decode)
    Flash,
    /// plain Candle attention with a concatenating cache (for comparison)
    Naive,
}

/// The KV cache's element type.
#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
enum KvCacheDtype {
    /// the model's dtype (--dtype)
    Auto,
    /// F8E4M3: half a bf16 cache's bytes, per-head scales calibrated on each prompt
    Fp8,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq)]
enum Impl {
    /// this example's model (attention per --attention)
    CandleFlash,
    /// candle-transformers' llama on the same weights (the baseline; greedy, equal lengths)
    CandleTransformers,
}

#[derive(Parser, Debug)]
#[command(
    about = "LLaMA-style generation with candle-flash attention",
    after_help = "Models are looked for in the example's cache ($CANDLE_FLASH_CACHE, else \
                  $XDG_CACHE_HOME/candle-flash, else ~/.cache/candle-flash), where \
                  scripts/model/fetch-model.sh puts SmolLM2-135M-Instruct.Q4_1.gguf, and in the \
                  Hugging Face cache ($HF_HOME/hub, else ~/.cache/huggingface/hub)."
)]
struct Args {
    /// The model: a Hugging Face checkpoint directory (config.json, *.safetensors,
    /// tokenizer.json), a .gguf file (llama architecture; F32/F16/BF16 and the Q4/Q5/Q8/K
    /// quantizations, dequantized on load), or a hub id (owner/name, or owner/name:FILE.gguf)
    /// taken from the Hugging Face cache or downloaded when the hub can be reached. Without
    /// it: SmolLM2-135M-Instruct from the cache (scripts/model/fetch-model.sh fetches it), else a
    /// small built-in model with random weights.
    #[arg(long)]
    model: Option<String>,
    /// A tokenizer.json to use instead of the model's (for GGUF files whose tokenizer this
    /// example cannot rebuild from their metadata).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// A prompt; repeat for a batch of prompts (of any lengths).
    #[arg(long)]
    prompt: Vec<String>,
    /// A file of prompts, one per line (added to --prompt).
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// Each prompt is a user message of a chat, formatted with the model's chat template
    /// (instruct models); generation stops at the end of the assistant's turn.
    #[arg(long)]
    chat: bool,
    /// With --chat: a system message before each prompt (else the template's default).
    #[arg(long)]
    system: Option<String>,
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
    /// The KV cache's dtype: `fp8` keeps keys and values in e4m3 with per-head scales
    /// (flash attention; on CUDA head_dim a multiple of 16).
    #[arg(long, value_enum, default_value_t = KvCacheDtype::Auto)]
    kv_cache_dtype: KvCacheDtype,
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
    /// Decode eagerly, launching each op of a step as it comes. By default on CUDA (flash
    /// attention) the decoding step is captured once per batch size in a CUDA graph and
    /// replayed: its inputs stay on the device and a paged cache gives each sequence its
    /// pages up front. This flag runs the same step (the same kernels, so the same tokens)
    /// without the graph. No effect on the CPU or with --attention naive.
    #[arg(long)]
    no_cuda_graph: bool,
    /// Decode with the lengths on the host (`KvCache::append_and_attend`, Candle's rotary
    /// kernel; the CPU's step) instead of the device step: the eager path before CUDA graphs,
    /// for comparison.
    #[arg(long)]
    host_step: bool,
    /// Diagnosis: run the graph's step (inputs on the device) eagerly, without capturing it.
    #[arg(long, hide = true)]
    no_capture: bool,
    /// After the run, measure the device's copy bandwidth (2 GiB device-to-device copies) and
    /// print the decoding step against the time to read the weights once at that bandwidth
    /// (CUDA).
    #[arg(long)]
    roofline: bool,
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

/// The prompts as token ids, and the text shown before each sequence's output.
struct Prompts {
    ids: Vec<Vec<u32>>,
    heads: Vec<String>,
}

fn prompts(args: &Args, ckpt: &Checkpoint) -> Result<Prompts> {
    if let Some(len) = args.random_prompt {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(args.seed);
        let v = ckpt.config.vocab_size as u32;
        let ids = (0..args.batch)
            .map(|_| (0..len).map(|_| rng.random_range(0..v)).collect())
            .collect();
        return Ok(Prompts {
            ids,
            heads: vec![String::new(); args.batch],
        });
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
        texts.push(
            match args.chat {
                true => "What is the capital of France?",
                false => "The three most useful things to know about attention are",
            }
            .into(),
        );
    }
    let tok = ckpt.tokenizer()?;
    let encode = |text: &str, special: bool| -> Result<Vec<u32>> {
        Ok(tok
            .encode(text, special)
            .map_err(anyhow::Error::msg)?
            .get_ids()
            .to_vec())
    };
    if !args.chat {
        let ids = texts
            .iter()
            .map(|t| encode(t, true))
            .collect::<Result<_>>()?;
        return Ok(Prompts { ids, heads: texts });
    }
    let template = chat::ChatTemplate::for_model(
        ckpt.chat_template.as_deref(),
        tok,
        ckpt.config.bos_token_id,
        &ckpt.eos_ids,
    )?;
    let mut ids = Vec::new();
    for t in &texts {
        let mut messages = Vec::new();
        if let Some(s) = &args.system {
            messages.push(chat::Message::new("system", s));
        }
        messages.push(chat::Message::new("user", t));
        ids.push(encode(&template.render(&messages)?, false)?);
    }
    let heads = texts.iter().map(|t| format!("> {t}\n")).collect();
    Ok(Prompts { ids, heads })
}

/// Opens the model and says which it is (stderr), plainly so for the built-in one.
fn open_model(args: &Args) -> Result<Checkpoint> {
    let hub = source::Hub::from_env();
    let src = match &args.model {
        Some(m) => source::resolve(m, &hub)?,
        None => source::default_model(&hub),
    };
    let cfg_line = |c: &model::Config| {
        format!(
            "{} layers, hidden {}, {}/{} heads, vocab {}",
            c.num_hidden_layers,
            c.hidden_size,
            c.num_attention_heads,
            c.num_kv_heads(),
            c.vocab_size
        )
    };
    let tokenizer_json = args.tokenizer.as_deref();
    let ckpt = match src {
        Source::Gguf(path) => {
            let (content, file) = gguf::read_content(&path)?;
            let ckpt = gguf::load(&path, &content, file, tokenizer_json)?;
            eprintln!(
                "model: {} ({}; {}, dequantized) from {}",
                path.file_name().unwrap_or_default().to_string_lossy(),
                cfg_line(&ckpt.config),
                gguf::storage_summary(&content),
                path.display()
            );
            ckpt
        }
        Source::Dir(dir) => {
            let mut ckpt = Checkpoint::open(&dir)?;
            if let Some(p) = tokenizer_json {
                ckpt.tokenizer = Some(
                    tokenizers::Tokenizer::from_file(p)
                        .map_err(|e| anyhow::anyhow!("--tokenizer {}: {e}", p.display()))?,
                );
            }
            eprintln!(
                "model: {} ({}) from {}",
                dir.file_name().unwrap_or_default().to_string_lossy(),
                cfg_line(&ckpt.config),
                dir.display()
            );
            ckpt
        }
        Source::Builtin => {
            let d = std::env::temp_dir().join("candle-flash-builtin-llama");
            builtin::write(&d, 0).context("writing the built-in model")?;
            let cache = source::cache_dir()
                .map(|d| d.display().to_string())
                .unwrap_or_else(|| "$CANDLE_FLASH_CACHE".into());
            let ckpt = Checkpoint::open(&d)?;
            eprintln!(
                "model: the built-in one ({}). Its weights are RANDOM, so its text is noise.\n\
                 For real text: scripts/model/fetch-model.sh (puts SmolLM2-135M-Instruct, 98 MB, in \
                 {cache}) and run again, or pass --model DIR | FILE.gguf | owner/name.",
                cfg_line(&ckpt.config)
            );
            ckpt
        }
    };
    Ok(ckpt)
}

/// The decoding step against the time to read the weights once at the device's copy
/// bandwidth (measured in the same run).
struct Roofline {
    /// Weight bytes a step reads.
    weights: usize,
    /// Average bytes of K and V a step reads.
    kv: f64,
    /// Copy bandwidth, GB/s (bytes read + written).
    copy_gbps: f64,
}

impl Roofline {
    fn measure(
        dev: &Device,
        model: &model::Llama,
        prompts: &[Vec<u32>],
        s: &generate::GenStats,
    ) -> Result<Option<Self>> {
        let Some(copy_gbps) = graph::copy_bandwidth(dev)? else {
            return Ok(None);
        };
        // Step i (from 0) of the decode_steps timed ones attends to prompt + i + 1 keys.
        let steps = s.decode_steps.max(1) as f64;
        let keys: f64 = prompts
            .iter()
            .map(|p| p.len() as f64 + 1.0 + (steps - 1.0) / 2.0)
            .sum();
        Ok(Some(Self {
            weights: model.step_weight_bytes(),
            kv: keys * model.kv_bytes_per_token() as f64,
            copy_gbps,
        }))
    }

    /// Milliseconds to read the weights once at the copy bandwidth.
    fn weights_ms(&self) -> f64 {
        self.weights as f64 / (self.copy_gbps * 1e9) * 1e3
    }
}

fn report(
    args: &Args,
    dev: &Device,
    dt: DType,
    gen: &Generation,
    ckpt: &Checkpoint,
    roofline: Option<&Roofline>,
) {
    let s = &gen.stats;
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    let ms_per_step = s.decode_time.as_secs_f64() * 1e3 / s.decode_steps.max(1) as f64;
    eprintln!(
        "{} prompt tokens in {} sequence(s): {:.1} ms to first token ({:.1} prompt tokens/s)",
        s.prompt_tokens,
        s.batch,
        s.time_to_first_token.as_secs_f64() * 1e3,
        s.prompt_tokens_per_s()
    );
    let how = match s.decode {
        "" => String::new(),
        d => format!(", {d}"),
    };
    eprintln!(
        "{} tokens generated: {:.1} tokens/s from the second token ({} steps, {ms_per_step:.2} \
         ms/step{how})",
        s.generated_tokens,
        s.generated_tokens_per_s(),
        s.decode_steps,
    );
    if let Some(r) = roofline {
        let gb = |b: f64| b / 1e9;
        eprintln!(
            "roofline: {:.3} GB of weights read once at the copy bandwidth ({:.0} GB/s, measured \
             now) take {:.3} ms; {ms_per_step:.3} ms/step is {:.0}% of that roofline (K and V \
             add {:.3} GB a step)",
            gb(r.weights as f64),
            r.copy_gbps,
            r.weights_ms(),
            100.0 * r.weights_ms() / ms_per_step,
            gb(r.kv),
        );
    } else if args.roofline {
        eprintln!("roofline: needs CUDA and --impl candle-flash");
    }
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
            "kv_cache_dtype": format!("{:?}", args.kv_cache_dtype).to_lowercase(),
            "dtype": format!("{dt:?}"),
            "device": if dev.is_cuda() { "cuda" } else { "cpu" },
            "batch": s.batch,
            "prompt_tokens": s.prompt_tokens,
            "generated_tokens": s.generated_tokens,
            "ttft_ms": s.time_to_first_token.as_secs_f64() * 1e3,
            "prefill_tok_s": s.prompt_tokens_per_s(),
            "decode_tok_s": s.generated_tokens_per_s(),
            "decode_ms_per_step": ms_per_step,
            "decode": s.decode,
            "cuda_graph": s.decode == "CUDA graph",
            "peak_mem_mib": s.peak_memory.map(mib),
            "runs": s.runs,
            "weight_bytes": roofline.map(|r| r.weights),
            "kv_bytes_per_step": roofline.map(|r| r.kv),
            "copy_gbps": roofline.map(|r| r.copy_gbps),
            "roofline_ms": roofline.map(Roofline::weights_ms),
            "roofline_pct": roofline.map(|r| 100.0 * r.weights_ms() / ms_per_step),
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
    if args.repeat == 0 {
        bail!("--repeat: must be at least 1")
    }
    if args.kv_cache_dtype == KvCacheDtype::Fp8 && !flash {
        bail!("--kv-cache-dtype fp8: needs candle-flash's attention (--impl candle-flash --attention flash)")
    }
    let ckpt = open_model(&args)?;
    let prompts = prompts(&args, &ckpt)?;
    let ids = &prompts.ids;
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
    let warmup_opts = GenOpts {
        max_new_tokens: args.max_new_tokens.min(3),
        record_logits: false,
        ..opts.clone()
    };
    // Text is printed as it is generated, whole characters only (stream.rs).
    let show = !args.quiet && args.random_prompt.is_none();
    let mut printer = match (show, ckpt.tokenizer.as_ref()) {
        (true, Some(tok)) => Some(stream::Printer::new(
            tok,
            ids,
            &prompts.heads,
            std::io::stdout(),
        )?),
        _ => None,
    };
    // The warm-up takes the same prompts: the timed run then finds the memory pool grown and
    // every kernel and cuBLAS plan of its shapes loaded.
    let mut roofline = None;
    let mut gen = match args.implementation {
        Impl::CandleTransformers => {
            if args.warmup {
                baseline::generate(&ckpt, dt, &dev, ids, &warmup_opts)?;
            }
            let mut runs = vec![];
            for _ in 0..args.repeat {
                runs.push(baseline::generate(&ckpt, dt, &dev, ids, &opts)?);
            }
            let gen = generate::median_run(runs);
            if let Some(p) = printer.as_mut() {
                for (b, toks) in gen.tokens.iter().enumerate() {
                    for &t in toks {
                        p.push(b, t)?;
                    }
                }
            }
            gen
        }
        Impl::CandleFlash => {
            let max_len = ids.iter().map(Vec::len).max().unwrap_or(0) + args.max_new_tokens;
            let mut model = ckpt.load(attn_impl(&args), dt, &dev, max_len)?;
            if args.kv_cache_dtype == KvCacheDtype::Fp8 {
                model.set_kv_cache_dtype(DType::F8E4M3)?;
            }
            // Graphs on CUDA with flash attention; the warm-up (3 tokens) captures the step
            // the timed runs replay: the caches are made for max_len whatever the run.
            // --no-cuda-graph runs the same device step uncaptured: the same kernels and
            // split plans, so the same tokens, and the difference in speed is the graph's.
            let graphs = dev.is_cuda() && flash && !args.host_step;
            let capture = !args.no_cuda_graph && !args.no_capture;
            let mut stepper: Box<dyn generate::Stepper> = match graphs {
                true => Box::new(graph::Graphs::new(capture, max_len)),
                false => Box::new(generate::Eager::default()),
            };
            let stepper = stepper.as_mut();
            if args.warmup {
                generate::generate_with(&model, ids, &warmup_opts, stepper, |_, _| {})?;
            }
            let mut err = None;
            let gen = generate::generate_with(&model, ids, &opts, stepper, |b, t| {
                if let Some(p) = printer.as_mut() {
                    if let Err(e) = p.push(b, t) {
                        err.get_or_insert(e);
                    }
                }
            })?;
            if let Some(e) = err {
                return Err(e);
            }
            let mut runs = vec![gen];
            for _ in 1..args.repeat {
                runs.push(generate::generate_with(
                    &model,
                    ids,
                    &opts,
                    stepper,
                    |_, _| {},
                )?);
            }
            let gen = generate::median_run(runs);
            if args.roofline {
                roofline = Roofline::measure(&dev, &model, ids, &gen.stats)?;
            }
            gen
        }
    };
    gen.stats.runs = args.repeat;
    if let Some(p) = printer {
        p.finish()?;
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
    report(&args, &dev, dt, &gen, &ckpt, roofline.as_ref());
    Ok(())
}
