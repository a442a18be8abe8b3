//! Attention speed on the FlashAttention-2 paper grid: candle-flash against Candle's own
//! attention (matmul + softmax + matmul), forward, backward and both, in TFLOP/s; then KV-cache
//! decoding ([`candle_flash::flash_attn_with_kvcache`]) in GB/s of K+V read, against the
//! device's copy bandwidth measured in the same run.
//!
//! Passes of candle-flash:
//! - `fwd`: [`FlashAttn::forward`] on detached inputs (no graph).
//! - `bwd`: [`FlashAttn::backward`] called directly on the `(out, lse)` of one
//!   [`FlashAttn::forward_with_lse`] per input set (run outside the timed region): the
//!   backward kernels alone, like scripts/bench/torch_bench.py's
//!   `torch.autograd.grad(out, (q, k, v), dout)`, so the two compare kernel for kernel.
//! - `bwd-autograd`: `loss.backward()` re-run on one kept graph per input set, i.e. the same
//!   kernels plus Candle's autograd bookkeeping (a `zeros_like` + `add` per gradient, ~0.7 ms on
//!   an H200); the line under it estimates that bookkeeping by timing the same backward with the
//!   attention op replaced by one that computes nothing.
//! - `fwd+bwd`: forward then `loss.backward()`, through autograd: the training path users run.
//!
//! Candle's own attention has `fwd` and `fwd+bwd` (through autograd).
//!
//! `--dropout P`: the grid's passes of candle-flash with dropout `P` (one fixed RNG offset),
//! without Candle's attention; `scripts/bench/torch_bench.py --dropout P` times SDPA likewise, and
//! `CANDLE_FLASH_WS_DROPOUT=0` in a second run times the kernels dropout had before the
//! warp-specialized ones.
//!
//! `--deterministic`: our kernels with `deterministic(true)` (the grid, or with `--mods-only`
//! or `--sparse-only` their variants); `CANDLE_FLASH_BWD=separate` in a second run times the
//! separate dK/dV and dQ kernels, which that mode runs where the warp-specialized backward
//! does not.
//!
//! ```text
//! cargo bench --features cuda --bench attention -- [--quick] [--decode-only | --no-decode | --cascade-only | --mods-only | --sparse-only | --varlen-only | --fp8-only] [--no-naive] [--fwd-only | --bwd-only] [--dropout P] [--deterministic] [--dtype bf16|f16] [--json PATH]
//! ```
//! On the lent GPU it runs as `bench-attention --json $OUT/bench.json` (scripts/gpu/stage.sh
//! builds it, scripts/gpu/suite.sh --bench runs it). Built without the `cuda` feature, or run
//! without a CUDA device, it prints a SKIPPED line and exits 0.
//!
//! Grid, FLOP counts and JSON records match scripts/bench/torch_bench.py, so
//! scripts/bench/compare.py can put both side by side: batch·seqlen = 16k tokens, hidden 2048
//! (hd 64/128/256 → 32/16/8 heads), seqlen 512..16k, causal and not, plus GQA 32/8 heads at
//! hd 128.
//!
//! `--fp8-only`: the FP8 (e4m3) forward beside our bf16 forward on the MHA grid shapes (hd 128, 256;
//! `CANDLE_FLASH_BENCH_HDS` for others), inputs quantized per tensor
//! (`CANDLE_FLASH_BENCH_FP8_BLOCKS=1`: per block of 128 rows).
//!
//! Decode (always run after the grid; `--decode-only` runs only it): GQA 32/8 heads, hd 128,
//! one query token per sequence attending to all `L` cached tokens, (batch, L) in
//! {(1, 8k), (8, 8k), (1, 64k), (32, 4k)}; no append in the timed loop. GB/s counts the K and
//! V bytes read, `2·b·L·8·128·2`, and is also given as a % of the device-to-device copy
//! bandwidth (bytes read + written by a 2 GiB copy). scripts/bench/torch_bench.py times PyTorch
//! SDPA on the same shapes.
//!
//! Cascade attention (after decode; `--cascade-only` runs only it, `--no-decode` skips it too):
//! one decode step of 64 sequences that share an 8192-token prompt and hold 64..256 tokens of
//! their own (all different), GQA 32/8 heads, hd 128. Unshared, each sequence's cache holds
//! the prompt and its suffix and [`flash_attn_with_kvcache`] reads all of it; the cascade
//! attends the prompt once for all 64 query tokens ([`FlashAttn::forward_with_lse`], the
//! tokens as 64 query rows of one batch), the suffixes through
//! [`flash_attn_with_kvcache_lse`], and merges the two with [`combine`]. Also the prompt part
//! split along its keys (`-split`: 8 chunks of the prompt as one batch of the forward, whose
//! launch then has 8 times the blocks; the chunks merge with the suffix in the same
//! `combine`). The table gives each part's time, the totals, the speedup
//! over the unshared step, and a check of the cascade against it in ulps of the dtype.
//!
//! Everything below compiles without `cuda` too (candle's dummy CUDA backend has the same
//! types), so a CPU-only build type-checks all of it; only [`gpu_name`] needs the feature.
//!
//! This file parses the arguments and runs the grid; beside it: `grid.rs` (shapes, FLOPs,
//! records), `options.rs` (the modifier, FP8, varlen and block-mask sections), `decode.rs`,
//! `cascade.rs`, `timing.rs` (inputs, timed passes, timing loops), `baseline.rs` (Candle's
//! attention) and `device.rs`.

use std::fmt;
use std::panic::{self, AssertUnwindSafe};
use std::path::PathBuf;
use std::time::Instant;

use candle::backend::{BackendDevice, BackendStorage};
use candle::{
    bail, CpuStorage, CudaStorage, CustomOp1, CustomOp3, DType, Device, Layout, Result, Shape,
    Tensor, Var, D,
};
use candle_flash::{
    combine, flash_attn_with_kvcache, flash_attn_with_kvcache_lse, quant, BlockMask, FlashAttn,
};

mod baseline;
mod cascade;
mod decode;
mod device;
mod grid;
mod options;
mod timing;

use baseline::*;
use device::*;
use grid::*;
use timing::*;

/// batch · seqlen for every shape, as in the FlashAttention-2 paper.
const TOKENS: usize = 16 * 1024;
/// heads · head_dim for the non-GQA shapes.
const HIDDEN: usize = 2048;
/// Input sets to rotate over: one set (q, k, v, dout) is already >= 64 MB, so three of them
/// keep every iteration reading from HBM rather than from the 50-60 MB L2.
const N_SETS: usize = 3;

/// `CANDLE_FLASH_BENCH_ADDRS=1`: print the device addresses of each case's input sets.
fn print_addrs() -> bool {
    std::env::var("CANDLE_FLASH_BENCH_ADDRS").is_ok_and(|v| v == "1")
}
const WARMUP: usize = 3;
const REPEATS: usize = 7;
/// Iterations per repetition are chosen so that one repetition lasts at least this long...
const TARGET_MS: f64 = 20.0;
/// ...up to this many (the smallest forward takes ~20 µs).
const MAX_ITERS: usize = 1000;
/// Candle's attention materialises (b, h, s, s) scores; skip it when scores, probabilities
/// and their gradients (4 such tensors) would exceed this.
const NAIVE_MAX_BYTES: f64 = 40e9;
/// Candle's attention is the slow, optional part: past this many seconds into the run it is
/// skipped, so that the whole grid stays within its ~4 minute budget on an H100.
const NAIVE_DEADLINE_S: f64 = 150.0;

const FLASH: &str = "candle-flash";
const NAIVE: &str = "candle-naive";

/// Decode shapes: GQA 32/8 heads at hd 128, one new query token, `(batch, cache length)`.
const DECODE_HEADS: usize = 32;
const DECODE_HEADS_K: usize = 8;
const DECODE_HD: usize = 128;
const DECODE_SHAPES: [(usize, usize); 4] = [(1, 8192), (8, 8192), (1, 65536), (32, 4096)];
/// Caches to rotate over: at least this many...
const DECODE_MIN_CACHES: usize = 3;
/// ...and enough that their K+V total at least this (4-5x the 50-60 MB L2), so that every
/// call reads its cache from HBM...
const DECODE_ROTATE_BYTES: usize = 256 << 20;
/// ...but no more than this in all.
const DECODE_MAX_BYTES: usize = 8 << 30;
/// A decode call takes ~10-100 µs: calibrate the iteration count on this many calls, allow
/// this many per repetition, and take the median of more repetitions.
const DECODE_CALIB_CALLS: usize = 20;
const DECODE_MAX_ITERS: usize = 50_000;
const DECODE_REPEATS: usize = 9;
/// A decode output further than this (relative to the largest |output|) from the f32
/// reference is flagged as a MISMATCH: bf16 rounding alone gives ~0.4%.
const DECODE_CHECK_REL: f64 = 0.03;
/// Cascade attention: sequences sharing a prompt of this many tokens...
const CASCADE_BATCH: usize = 64;
const CASCADE_PREFIX: usize = 8192;
/// Chunks of the prompt's keys in the split cascade (64 query rows per head fill one block:
/// 32 heads x 8 chunks give the forward 256 blocks).
const CASCADE_SPLIT: usize = 8;
/// ...each with its own suffix of this many tokens or more (see [`cascade_suffix_lens`]).
const CASCADE_SUFFIX_MIN: usize = 64;
/// 193 lengths from the least: a prime count, so that `i · 97 mod 193` differs for every
/// sequence.
const CASCADE_SUFFIX_SPAN: usize = 193;
/// The cascade passes if it is this many units in the last place of the dtype (at the
/// largest |output|) or closer to the unshared attention: each side rounds its output once,
/// the cascade its two parts too (at weights that sum to 1).
const CASCADE_CHECK_ULPS: f64 = 2.0;
/// Elements of the tensor copied to measure the device bandwidth: 2 GiB of bf16.
const COPY_ELEMS: usize = 1 << 30;

/// How [`time_ms_with`] times one measurement.
#[derive(Clone, Copy)]
struct Timing {
    warmup: usize,
    /// Calls timed together to estimate one call's time (launch latency dominates one call).
    calib: usize,
    max_iters: usize,
    repeats: usize,
}

const PREFILL_TIMING: Timing = Timing {
    warmup: WARMUP,
    calib: 1,
    max_iters: MAX_ITERS,
    repeats: REPEATS,
};

const DECODE_TIMING: Timing = Timing {
    warmup: 2 * DECODE_CALIB_CALLS,
    calib: DECODE_CALIB_CALLS,
    max_iters: DECODE_MAX_ITERS,
    repeats: DECODE_REPEATS,
};

const USAGE: &str =
    "usage: bench-attention [--quick] [--decode-only | --no-decode | --cascade-only | --mods-only | --sparse-only | --varlen-only | --fp8-only] [--no-naive] [--fwd-only | --bwd-only] [--dropout P] [--deterministic] [--dtype bf16|f16] [--json PATH]";

fn main() {
    if !cfg!(feature = "cuda") {
        println!("bench-attention: SKIPPED (built without the `cuda` feature)");
        return;
    }
    let args = match Args::parse(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(e) => {
            eprintln!("bench-attention: {e}\n{USAGE}");
            std::process::exit(2);
        }
    };
    let dev = match Device::new_cuda(0) {
        Ok(dev) => dev,
        Err(e) => {
            println!(
                "bench-attention: SKIPPED (no CUDA device: {})",
                first_line(&e)
            );
            return;
        }
    };
    run(&args, &dev);
}

struct Args {
    quick: bool,
    decode_only: bool,
    no_decode: bool,
    cascade_only: bool,
    no_naive: bool,
    fwd_only: bool,
    bwd_only: bool,
    mods_only: bool,
    sparse_only: bool,
    varlen_only: bool,
    fp8_only: bool,
    dropout: f32,
    deterministic: bool,
    dtype: DType,
    json: Option<PathBuf>,
}

impl Args {
    fn parse(mut it: impl Iterator<Item = String>) -> std::result::Result<Self, String> {
        let mut args = Args {
            quick: false,
            decode_only: false,
            no_decode: false,
            cascade_only: false,
            no_naive: false,
            fwd_only: false,
            bwd_only: false,
            mods_only: false,
            sparse_only: false,
            varlen_only: false,
            fp8_only: false,
            dropout: 0.0,
            deterministic: false,
            dtype: DType::BF16,
            json: None,
        };
        while let Some(arg) = it.next() {
            match arg.as_str() {
                "--quick" => args.quick = true,
                "--decode-only" => args.decode_only = true,
                "--no-decode" => args.no_decode = true,
                "--cascade-only" => args.cascade_only = true,
                "--no-naive" => args.no_naive = true,
                "--fwd-only" => args.fwd_only = true,
                "--bwd-only" => args.bwd_only = true,
                "--mods-only" => args.mods_only = true,
                "--sparse-only" => args.sparse_only = true,
                "--varlen-only" => args.varlen_only = true,
                "--fp8-only" => args.fp8_only = true,
                "--deterministic" => args.deterministic = true,
                "--json" => args.json = Some(it.next().ok_or("--json needs a path")?.into()),
                "--dropout" => {
                    let p = it.next().ok_or("--dropout needs a probability")?;
                    args.dropout = match p.parse::<f32>() {
                        Ok(p) if (0.0..1.0).contains(&p) => p,
                        _ => {
                            return Err(format!(
                                "--dropout: expected a number in [0, 1), got {p:?}"
                            ))
                        }
                    };
                }
                "--dtype" => {
                    args.dtype = match it.next().as_deref() {
                        Some("bf16") => DType::BF16,
                        Some("f16" | "fp16") => DType::F16,
                        other => {
                            return Err(format!("--dtype: expected bf16 or f16, got {other:?}"))
                        }
                    }
                }
                // `cargo bench` passes --bench to every `harness = false` target.
                "--bench" => {}
                "-h" | "--help" => {
                    println!("{USAGE}");
                    std::process::exit(0);
                }
                _ => return Err(format!("unknown argument {arg:?}")),
            }
        }
        Ok(args)
    }
}

fn run(args: &Args, dev: &Device) {
    // Keep freed memory in CUDA's pool between repetitions, as PyTorch's caching allocator
    // (which scripts/bench/torch_bench.py runs under) does; the pool's default hands it back to the
    // driver at each synchronisation and the next call maps it again (the backward's 128-320 MB
    // of buffers at batch x seqlen = 16k). CANDLE_FLASH_BENCH_POOL=0 leaves the default.
    if std::env::var("CANDLE_FLASH_BENCH_POOL").is_ok_and(|v| v == "0") {
        println!("# memory pool: driver default (freed memory released at synchronisation)");
    } else if let Err(e) = candle_flash::train::retain_freed_device_memory(dev) {
        println!(
            "# memory pool: could not keep freed memory: {}",
            first_line(&e)
        );
    }
    let gpu = gpu_name(dev).unwrap_or_else(|| "CUDA device 0".into());
    let quick = if args.quick { "  (quick grid)" } else { "" };
    println!("# {gpu}  candle-flash bench  {:?}{quick}", args.dtype);
    let mut bench = Bench {
        dev: dev.clone(),
        dtype: args.dtype,
        records: Vec::new(),
        start: Instant::now(),
        no_naive: args.no_naive,
        fwd_only: args.fwd_only,
        bwd_only: args.bwd_only,
        dropout: args.dropout,
        deterministic: args.deterministic,
    };
    if args.dropout > 0.0 {
        println!("# dropout p = {}", args.dropout);
    }
    if args.deterministic {
        println!("# deterministic backward");
    }
    if args.mods_only {
        bench.mods_section();
        return;
    }
    if args.varlen_only {
        bench.varlen_section();
        return;
    }
    if args.fp8_only {
        bench.fp8_section();
        return;
    }
    if args.sparse_only {
        bench.sparse_section();
        return;
    }
    if args.cascade_only {
        bench.cascade_section(args.json.as_ref());
        return;
    }
    if !args.decode_only {
        println!(
            "{:<12} {:<12} {:>4} {:>6} {:>5} {:>6} {:>6} {:>9} {:>8}",
            "impl", "pass", "hd", "seqlen", "batch", "heads", "causal", "ms", "TFLOP/s"
        );
        for case in grid(args.quick) {
            bench.case(&case);
            // Rewritten after each shape so that a run cut short still leaves its results.
            if let Some(path) = &args.json {
                bench.write_json(path);
            }
        }
    }
    if !args.no_decode {
        bench.decode_section(args.json.as_ref());
        if !args.decode_only {
            bench.cascade_section(args.json.as_ref());
        }
    }
    println!(
        "# {} records in {:.0} s",
        bench.records.len(),
        bench.start.elapsed().as_secs_f64()
    );
}

struct Bench {
    dev: Device,
    dtype: DType,
    /// JSON objects, one per record.
    records: Vec<String>,
    start: Instant,
    /// `--no-naive`: only our kernels (A/B runs of kernel variants).
    no_naive: bool,
    /// `--fwd-only`: no backward passes (A/B runs of forward kernels).
    fwd_only: bool,
    /// `--bwd-only`: only the `bwd` pass (A/B runs of backward kernels).
    bwd_only: bool,
    /// `--dropout P`: our kernels with dropout (a fixed RNG offset, so that the direct
    /// backward may run), no naive rows (Candle's attention has no dropout here);
    /// scripts/bench/torch_bench.py takes the same flag.
    dropout: f32,
    /// `--deterministic`: our kernels with `deterministic(true)` (a bitwise repeatable
    /// backward).
    deterministic: bool,
}
impl Bench {
    fn case(&mut self, case: &Case) {
        let sets = (0..N_SETS).map(|_| Inputs::new(case, self.dtype, &self.dev));
        match sets.collect::<Result<Vec<_>>>() {
            Ok(sets) => {
                if print_addrs() {
                    // Where the inputs lie, to set against the time (some shapes' times are
                    // bimodal from process to process: docs/archive/PERF.md, "The bimodal
                    // d 128 1k forward: the same addresses, three modes").
                    for (i, set) in sets.iter().enumerate() {
                        let addr =
                            |t: &Tensor| device_addr(t).map_or("-".into(), |a| format!("{a:#x}"));
                        println!(
                            "# addrs {case} set {i}: q {} k {} v {} dout {}",
                            addr(set.q.as_tensor()),
                            addr(set.k.as_tensor()),
                            addr(set.v.as_tensor()),
                            addr(&set.dout)
                        );
                    }
                }
                self.flash(case, &sets);
                if !self.no_naive && self.dropout == 0.0 {
                    self.naive(case, &sets);
                }
            }
            Err(e) => println!("skipped {case}: inputs: {}", first_line(&e)),
        }
    }

    fn flash(&mut self, case: &Case, sets: &[Inputs]) {
        let dev = self.dev.clone();
        let mut opts = FlashAttn::new()
            .causal(case.causal)
            .deterministic(self.deterministic);
        if self.dropout > 0.0 {
            opts = opts.dropout(self.dropout).rng_offset(0);
        }
        let attn = |q: &Tensor, k: &Tensor, v: &Tensor, _train: bool| opts.forward(q, k, v);
        if self.bwd_only {
            let bwd = try_time(|| time_bwd_direct(&dev, sets, &opts));
            self.record(FLASH, "bwd", case, bwd);
            return;
        }
        let fwd = self.record(FLASH, "fwd", case, try_time(|| time_fwd(&dev, sets, &attn)));
        if self.fwd_only {
            return;
        }
        self.record(
            FLASH,
            "bwd",
            case,
            try_time(|| time_bwd_direct(&dev, sets, &opts)),
        );
        let bwd_autograd = self.record(
            FLASH,
            "bwd-autograd",
            case,
            try_time(|| time_bwd(&dev, sets, &attn)),
        );
        if let Some(bwd_autograd) = bwd_autograd {
            self.print_autograd_overhead(sets, bwd_autograd);
        }
        let fwd_bwd = self.record(
            FLASH,
            "fwd+bwd",
            case,
            try_time(|| time_fwd_bwd(&dev, sets, &attn)),
        );
        // The autograd backward alone failed (for example if it cannot run twice on one graph)
        // but the forward and forward+backward did: derive it from the two.
        if let (None, Some(fwd), Some(fwd_bwd)) = (bwd_autograd, fwd, fwd_bwd) {
            if fwd_bwd > fwd {
                println!("{:<25} bwd-autograd derived as (fwd+bwd) - fwd:", "");
                self.record(FLASH, "bwd-autograd", case, Ok(fwd_bwd - fwd));
            }
        }
    }

    /// The input sets of `--mods-only` and `--sparse-only` cases, or none (said why).
    fn option_inputs(&self, case: &Case) -> Option<Vec<Inputs>> {
        match (0..N_SETS)
            .map(|_| Inputs::new(case, self.dtype, &self.dev))
            .collect::<Result<Vec<_>>>()
        {
            Ok(sets) => Some(sets),
            Err(e) => {
                println!(
                    "skipped hd {} seqlen {}: inputs: {}",
                    case.hd,
                    case.seqlen,
                    first_line(&e)
                );
                None
            }
        }
    }

    /// Tells the kernels' share of `bwd-autograd` (`autograd_ms`) from Candle's: a number to
    /// read, not to record.
    fn print_autograd_overhead(&self, sets: &[Inputs], autograd_ms: f64) {
        if let Ok(ms) = try_time(|| time_autograd_overhead(&self.dev, sets)) {
            println!(
                "{:<25} of which ~{ms:.3} ms ({:.0}%) is Candle's autograd bookkeeping \
                 (zeros_like + add per gradient)",
                "",
                100.0 * ms / autograd_ms
            );
        }
    }

    fn naive(&mut self, case: &Case, sets: &[Inputs]) {
        let need = 4.0 * case.score_bytes(self.dtype);
        if need > NAIVE_MAX_BYTES {
            println!(
                "{NAIVE:<12} skipped {case}: scores would need ~{:.0} GB",
                need / 1e9
            );
            return;
        }
        // Candle's CUDA kernels index elements with 32 bits: past 2^31 score elements its
        // matmul/softmax read out of bounds (seen: an illegal address at b=2, h=32, s=8192,
        // which poisons the context for every later measurement).
        let elems = case.score_bytes(self.dtype) / self.dtype.size_in_bytes() as f64;
        if elems >= 2f64.powi(31) {
            println!("{NAIVE:<12} skipped {case}: {elems:.1e} score elements exceed Candle's 32-bit indexing");
            return;
        }
        if self.start.elapsed().as_secs_f64() > NAIVE_DEADLINE_S {
            println!("{NAIVE:<12} skipped {case}: past the {NAIVE_DEADLINE_S} s time budget");
            return;
        }
        let mask = match case
            .causal
            .then(|| causal_mask(case.seqlen, self.dtype, &self.dev))
        {
            None => None,
            Some(Ok(mask)) => Some(mask),
            Some(Err(e)) => {
                println!("{NAIVE:<12} skipped {case}: mask: {}", first_line(&e));
                return;
            }
        };
        let dev = self.dev.clone();
        let attn = |q: &Tensor, k: &Tensor, v: &Tensor, train: bool| {
            naive_attention(q, k, v, mask.as_ref(), train)
        };
        self.record(NAIVE, "fwd", case, try_time(|| time_fwd(&dev, sets, &attn)));
        self.record(
            NAIVE,
            "fwd+bwd",
            case,
            try_time(|| time_fwd_bwd(&dev, sets, &attn)),
        );
    }

    /// Prints one table row (or "n/a" and the error) and keeps the record; returns the ms.
    fn record(
        &mut self,
        imp: &'static str,
        pass: &'static str,
        case: &Case,
        ms: std::result::Result<f64, String>,
    ) -> Option<f64> {
        let c = case;
        let heads = format!("{}/{}", c.heads, c.heads_k);
        let row = format!(
            "{imp:<12} {pass:<12} {:>4} {:>6} {:>5} {heads:>6} {:>6}",
            c.hd,
            c.seqlen,
            c.batch(),
            c.causal.to_string()
        );
        match ms {
            Ok(ms) => {
                let tflops = flop_factor(pass) * c.fwd_flops() / (ms * 1e-3) / 1e12;
                println!("{row} {ms:>9.3} {tflops:>8.1}");
                let record = Record {
                    imp,
                    pass,
                    case: *case,
                    ms,
                    tflops,
                    dropout: self.dropout,
                    deterministic: self.deterministic,
                };
                self.records.push(record.json());
                Some(ms)
            }
            Err(e) => {
                println!("{row} {:>9} {:>8}  {e}", "n/a", "n/a");
                None
            }
        }
    }

    fn write_json(&self, path: &PathBuf) {
        let text = format!("[\n{}\n]\n", self.records.join(",\n"));
        if let Err(e) = std::fs::write(path, text) {
            eprintln!("bench-attention: cannot write {}: {e}", path.display());
        }
    }
}
