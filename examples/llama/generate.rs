//! Batched generation: one packed prefill of every prompt, then one decoding step per token
//! for all sequences together, each at its own position in its own KV cache rows. How a step
//! runs is a [`Stepper`]'s business: [`Eager`] here, a CUDA graph in graph.rs.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use candle::{DType, Device, Tensor, D};
use candle_transformers::generation::{LogitsProcessor, Sampling};

use super::model::{AttnImpl, Cache, CacheLayout, Llama};

/// How tokens are chosen and when generation stops.
#[derive(Clone, Debug)]
pub struct GenOpts {
    pub max_new_tokens: usize,
    pub sampling: Sampling,
    pub seed: u64,
    /// 1.0 turns it off.
    pub repeat_penalty: f32,
    pub repeat_last_n: usize,
    pub eos_ids: Vec<u32>,
    /// Generate `max_new_tokens` even past an end-of-sequence token (benchmarks).
    pub ignore_eos: bool,
    pub layout: CacheLayout,
    /// Keep each step's logits `(batch, vocab)` (tests).
    pub record_logits: bool,
}

/// What a generation measured, with the definitions of candle's llama example.
#[derive(Clone, Debug, Default)]
pub struct GenStats {
    pub batch: usize,
    pub prompt_tokens: usize,
    /// Tokens generated over all sequences.
    pub generated_tokens: usize,
    /// Prefill of every prompt and the first sampled token of each.
    pub time_to_first_token: Duration,
    /// From the second token on.
    pub decode_time: Duration,
    /// Decoding steps after the first token (each makes one token per running sequence).
    pub decode_steps: usize,
    /// Peak device memory of the run (CUDA: the memory pool's high-water mark).
    pub peak_memory: Option<u64>,
    /// Timed runs these figures are the median of.
    pub runs: usize,
    /// How the decoding steps ran ([`Stepper::name`]).
    pub decode: &'static str,
}

impl GenStats {
    pub fn prompt_tokens_per_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.time_to_first_token.as_secs_f64()
    }

    /// Generated tokens per second over all sequences, from the second token on.
    pub fn generated_tokens_per_s(&self) -> f64 {
        (self.generated_tokens - self.batch.min(self.generated_tokens)) as f64
            / self.decode_time.as_secs_f64().max(1e-12)
    }
}

/// The output of [`generate`].
pub struct Generation {
    /// New tokens of each sequence (an end-of-sequence token included when one ended it).
    pub tokens: Vec<Vec<u32>>,
    pub stats: GenStats,
    /// Logits of each step, when [`GenOpts::record_logits`].
    pub logits: Vec<Tensor>,
}

/// The first of `runs` (same inputs, so same tokens) with the median time to first token and
/// the median decoding time of all of them, and the largest peak memory.
pub fn median_run(mut runs: Vec<Generation>) -> Generation {
    fn median(mut xs: Vec<Duration>) -> Duration {
        xs.sort();
        xs[xs.len() / 2]
    }
    let ttft = median(runs.iter().map(|g| g.stats.time_to_first_token).collect());
    let decode = median(runs.iter().map(|g| g.stats.decode_time).collect());
    let peak = runs.iter().filter_map(|g| g.stats.peak_memory).max();
    let mut first = runs.swap_remove(0);
    first.stats.time_to_first_token = ttft;
    first.stats.decode_time = decode;
    first.stats.peak_memory = peak;
    first
}

/// Chooses the next token of each sequence from `logits` `(batch, vocab)` f32.
struct Sampler {
    processors: Vec<LogitsProcessor>,
    greedy: bool,
    penalty: f32,
    last_n: usize,
}

impl Sampler {
    fn new(opts: &GenOpts, batch: usize) -> Self {
        Self {
            processors: (0..batch)
                .map(|b| {
                    LogitsProcessor::from_sampling(opts.seed + b as u64, opts.sampling.clone())
                })
                .collect(),
            greedy: matches!(opts.sampling, Sampling::ArgMax),
            penalty: opts.repeat_penalty,
            last_n: opts.repeat_last_n,
        }
    }

    /// Whether the choice is the argmax of the logits, made on the device.
    fn on_device(&self) -> bool {
        self.greedy && self.penalty == 1.0
    }

    fn sample(&mut self, logits: &Tensor, history: &[Vec<u32>]) -> Result<Vec<u32>> {
        if self.on_device() {
            // On the device: only the chosen ids cross to the host.
            return Ok(logits.argmax(D::Minus1)?.to_vec1::<u32>()?);
        }
        let logits = logits.to_device(&Device::Cpu)?;
        let mut out = Vec::with_capacity(history.len());
        for (b, proc) in self.processors.iter_mut().enumerate() {
            let mut row = logits.get(b)?;
            if self.penalty != 1.0 {
                let h = &history[b];
                let start = h.len().saturating_sub(self.last_n);
                row = candle_transformers::utils::apply_repeat_penalty(
                    &row,
                    self.penalty,
                    &h[start..],
                )?;
            }
            out.push(proc.sample(&row)?);
        }
        Ok(out)
    }
}

/// Peak device memory: the CUDA memory pool's high-water mark (Candle allocates from it).
pub mod memory {
    use candle::Device;

    #[cfg(feature = "cuda")]
    fn pool(
        dev: &candle::CudaDevice,
    ) -> Option<candle::cuda_backend::cudarc::driver::sys::CUmemoryPool> {
        use candle::cuda_backend::cudarc::driver::sys;
        let ctx = dev.cuda_stream().context().clone();
        ctx.bind_to_thread().ok()?;
        let mut pool = std::ptr::null_mut();
        let r = unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) };
        (r == sys::CUresult::CUDA_SUCCESS).then_some(pool)
    }

    /// Resets the high-water mark to what is in use now.
    pub fn reset_peak(dev: &Device) {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(d) = dev {
            use candle::cuda_backend::cudarc::driver::sys;
            if let Some(p) = pool(d) {
                let mut zero = 0u64;
                let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
                unsafe { sys::cuMemPoolSetAttribute(p, attr, &mut zero as *mut u64 as *mut _) };
            }
        }
        let _ = dev;
    }

    /// Bytes: the pool's high-water mark on CUDA, the process's peak resident set on the CPU.
    pub fn peak(dev: &Device) -> Option<u64> {
        match dev {
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => {
                use candle::cuda_backend::cudarc::driver::sys;
                let p = pool(d)?;
                let mut v = 0u64;
                let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
                let r =
                    unsafe { sys::cuMemPoolGetAttribute(p, attr, &mut v as *mut u64 as *mut _) };
                (r == sys::CUresult::CUDA_SUCCESS).then_some(v)
            }
            Device::Cpu => {
                let status = std::fs::read_to_string("/proc/self/status").ok()?;
                let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
                let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
                Some(kb * 1024)
            }
            _ => None,
        }
    }
}

/// What a decoding step should give back besides advancing the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Want {
    /// The step's logits `(batch, vocab)` f32 (the host samples, or records them).
    pub logits: bool,
    /// The argmax of each row of the logits: the next tokens when sampling is greedy. A
    /// stepper may choose them on the device ([`StepOut::ids`]) or leave it to the host.
    pub greedy: bool,
}

/// What a decoding step gave back.
pub struct StepOut {
    /// `(batch, vocab)` f32, a tensor of its own; present when asked for, or when `ids` is not.
    pub logits: Option<Tensor>,
    /// The next tokens, when the step chose them (greedy, on the device).
    pub ids: Option<Vec<u32>>,
}

/// How decoding steps run over a cache it owns.
pub trait Stepper {
    /// The way, for reports: "eager", "CUDA graph".
    fn name(&self) -> &'static str;
    /// An empty cache for `batch` sequences of at least `capacity` tokens, for the prompts to
    /// fill; the next steps run over it.
    fn cache(
        &mut self,
        model: &Llama,
        batch: usize,
        capacity: usize,
        layout: CacheLayout,
    ) -> Result<&mut Cache>;
    /// One step over the cache: `ids` `(batch,)` are the tokens just chosen, appended at each
    /// sequence's length.
    fn step(&mut self, model: &Llama, ids: &[u32], want: Want) -> Result<StepOut>;
}

/// [`Llama::forward_step`]: every op launched as it comes, the step's small inputs uploaded
/// each time (the CPU, and CUDA with `--no-cuda-graph`). A fresh cache per generation.
#[derive(Debug, Default)]
pub struct Eager {
    cache: Option<Cache>,
}

impl Stepper for Eager {
    fn name(&self) -> &'static str {
        "eager"
    }

    fn cache(
        &mut self,
        model: &Llama,
        batch: usize,
        capacity: usize,
        layout: CacheLayout,
    ) -> Result<&mut Cache> {
        self.cache = None; // the last generation's, freed before the next is allocated
        let cache = Cache::new(
            model.config(),
            model.attn_impl(),
            layout,
            batch,
            capacity,
            model.kv_cache_dtype(),
            model.device(),
        )?;
        Ok(self.cache.insert(cache))
    }

    fn step(&mut self, model: &Llama, ids: &[u32], _want: Want) -> Result<StepOut> {
        let cache = self
            .cache
            .as_mut()
            .context("a step before the cache was made")?;
        let ids = Tensor::new(ids, model.device())?;
        let hidden = model.forward_step(&ids, cache)?;
        Ok(StepOut {
            logits: Some(model.logits(&hidden)?),
            ids: None,
        })
    }
}

/// Generates up to `opts.max_new_tokens` for every prompt (token ids, BOS included where the
/// tokenizer adds one). `on_token(seq, token)` sees each new token as soon as it is chosen.
#[allow(dead_code)] // the tests and the fine-tuning example; main.rs picks a stepper
pub fn generate(
    model: &Llama,
    prompts: &[Vec<u32>],
    opts: &GenOpts,
    on_token: impl FnMut(usize, u32),
) -> Result<Generation> {
    generate_with(model, prompts, opts, &mut Eager::default(), on_token)
}

/// [`generate`] with the decoding steps run by `stepper`.
pub fn generate_with(
    model: &Llama,
    prompts: &[Vec<u32>],
    opts: &GenOpts,
    stepper: &mut dyn Stepper,
    mut on_token: impl FnMut(usize, u32),
) -> Result<Generation> {
    let dev = model.device().clone();
    let batch = prompts.len();
    if batch == 0 {
        anyhow::bail!("prompt: no prompt given")
    }
    if let Some(b) = prompts.iter().position(|p| p.is_empty()) {
        anyhow::bail!("prompt {b}: no tokens")
    }
    let seqlens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    let max_prompt = seqlens.iter().copied().max().unwrap_or(0);
    let capacity = max_prompt + opts.max_new_tokens;
    let max_pos = model.config().max_position_embeddings;
    if capacity > max_pos {
        anyhow::bail!(
            "prompt: {max_prompt} tokens + {} new ones exceed the model's \
             max_position_embeddings of {max_pos}",
            opts.max_new_tokens
        )
    }
    let decode = stepper.name();
    let cache = stepper.cache(model, batch, capacity, opts.layout)?;
    let mut sampler = Sampler::new(opts, batch);
    let mut history: Vec<Vec<u32>> = prompts.to_vec();
    let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); batch];
    let mut done = vec![false; batch];
    let mut logits_log = Vec::new();
    let mut stats = GenStats {
        batch,
        prompt_tokens: seqlens.iter().sum(),
        decode,
        ..GenStats::default()
    };
    if opts.max_new_tokens == 0 {
        return Ok(Generation {
            tokens,
            stats,
            logits: logits_log,
        });
    }
    dev.synchronize()?;
    memory::reset_peak(&dev);
    let start = Instant::now();
    let ids: Vec<u32> = prompts.iter().flatten().copied().collect();
    let ids = Tensor::new(ids, &dev)?;
    let hidden = model.forward_packed(&ids, &seqlens, Some(cache), None)?;
    let mut logits = Some(model.logits(&Llama::last_tokens(&hidden, &seqlens)?)?);
    // Tokens a step chose itself (greedy, on the device), else the host samples the logits.
    let mut chosen: Option<Vec<u32>> = None;
    let want = Want {
        logits: opts.record_logits || !sampler.on_device(),
        greedy: sampler.on_device(),
    };
    let mut decode_start = start;
    for step in 0..opts.max_new_tokens {
        let no_logits = || anyhow::anyhow!("the decoding step returned no logits");
        if opts.record_logits {
            let l = logits.as_ref().ok_or_else(no_logits)?;
            logits_log.push(l.to_device(&Device::Cpu)?);
        }
        let next = match chosen.take() {
            Some(ids) => ids,
            None => sampler.sample(logits.as_ref().ok_or_else(no_logits)?, &history)?,
        };
        for (b, &t) in next.iter().enumerate() {
            if done[b] {
                continue;
            }
            tokens[b].push(t);
            history[b].push(t);
            on_token(b, t);
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
        // Finished sequences keep stepping (their output is dropped) so the batch stays whole.
        let out = stepper.step(model, &next, want)?;
        (logits, chosen) = (out.logits, out.ids);
    }
    dev.synchronize()?;
    stats.decode_time = decode_start.elapsed();
    stats.generated_tokens = tokens.iter().map(Vec::len).sum();
    stats.peak_memory = memory::peak(&dev);
    Ok(Generation {
        tokens,
        stats,
        logits: logits_log,
    })
}

/// The attention implementation's name, for tables.
pub fn attn_name(a: AttnImpl) -> &'static str {
    match a {
        AttnImpl::Flash => "flash",
        AttnImpl::Naive => "naive",
    }
}

/// `--device`: cpu or cuda; by default CUDA when built with it and a GPU is present.
pub fn parse_device(arg: Option<&str>) -> Result<Device> {
    use anyhow::Context;
    Ok(match arg {
        None => Device::cuda_if_available(0)?,
        Some("cpu") => Device::Cpu,
        Some("cuda") => Device::new_cuda(0).context(
            "--device cuda: no CUDA device (build with --features cuda on a machine with a GPU)",
        )?,
        Some(other) => anyhow::bail!("--device {other:?}: expected cpu or cuda"),
    })
}

/// `--dtype` (default bf16 on CUDA, f32 on the CPU), checked against what the device runs:
/// candle-flash's CUDA kernels take f16/bf16, so f32 with `flash` attention on CUDA is an error.
pub fn choose_dtype(arg: Option<&str>, dev: &Device, flash: bool) -> Result<DType> {
    let dt = match arg {
        Some(s) => parse_dtype(s)?,
        None if dev.is_cuda() => DType::BF16,
        None => DType::F32,
    };
    if dev.is_cuda() && dt == DType::F32 && flash {
        anyhow::bail!(
            "--dtype f32 on CUDA: candle-flash's CUDA kernels take f16/bf16 \
             (use --dtype bf16, or --attention naive for an f32 model on the GPU)"
        )
    }
    Ok(dt)
}

/// `dtype` from its command-line name.
pub fn parse_dtype(s: &str) -> Result<DType> {
    Ok(match s {
        "f32" => DType::F32,
        "f16" => DType::F16,
        "bf16" => DType::BF16,
        other => anyhow::bail!("--dtype {other:?}: expected f32, f16 or bf16"),
    })
}
