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

/// One attention shape of the grid.
#[derive(Clone, Copy)]
struct Case {
    hd: usize,
    seqlen: usize,
    heads: usize,
    heads_k: usize,
    causal: bool,
}

impl Case {
    fn batch(&self) -> usize {
        TOKENS / self.seqlen
    }

    /// 4·b·h·s·s·d (two matmuls of 2 FLOPs per multiply-add), halved for causal: the useful
    /// work, also for Candle's attention, which computes the masked half anyway.
    fn fwd_flops(&self) -> f64 {
        let full =
            4.0 * (self.batch() * self.heads * self.hd) as f64 * (self.seqlen as f64).powi(2);
        if self.causal {
            full / 2.0
        } else {
            full
        }
    }

    /// Bytes of one (b, h, s, s) score tensor in `dtype`.
    fn score_bytes(&self, dtype: DType) -> f64 {
        (self.batch() * self.heads * dtype.size_in_bytes()) as f64 * (self.seqlen as f64).powi(2)
    }
}

impl fmt::Display for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "hd={} seqlen={} heads={}/{} causal={}",
            self.hd, self.seqlen, self.heads, self.heads_k, self.causal
        )
    }
}

/// The shapes, in the order scripts/bench/torch_bench.py measures them (its `--quick` grid too).
fn grid(quick: bool) -> Vec<Case> {
    let (hds, seqlens, gqa_seqlens): (&[usize], &[usize], &[usize]) = if quick {
        (&[64, 128], &[1024, 4096], &[2048])
    } else {
        (
            &[64, 128, 256],
            &[512, 1024, 2048, 4096, 8192, 16384],
            &[2048, 8192],
        )
    };
    // `CANDLE_FLASH_BENCH_HDS=96,224` replaces the head dims (hidden 2048 / hd heads, rounded
    // down): the head-dim classes between the grid's.
    let hds_env: Option<Vec<usize>> = std::env::var("CANDLE_FLASH_BENCH_HDS")
        .ok()
        .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect());
    let hds = hds_env.as_deref().unwrap_or(hds);
    // `CANDLE_FLASH_BENCH_HEADS=33` replaces the MHA cases' head count (the hidden size then
    // differs from 2048): the work tiles' count against the SMs' (wave quantization).
    let heads_env: Option<usize> = std::env::var("CANDLE_FLASH_BENCH_HEADS")
        .ok()
        .and_then(|v| v.trim().parse().ok());
    let mut cases = Vec::new();
    for &hd in hds {
        for &seqlen in seqlens {
            for causal in [false, true] {
                let heads = heads_env.unwrap_or(HIDDEN / hd);
                cases.push(Case {
                    hd,
                    seqlen,
                    heads,
                    heads_k: heads,
                    causal,
                });
            }
        }
    }
    for &seqlen in gqa_seqlens {
        for causal in [false, true] {
            cases.push(Case {
                hd: 128,
                seqlen,
                heads: 32,
                heads_k: 8,
                causal,
            });
        }
    }
    // `CANDLE_FLASH_BENCH_CASES=128/8192/n,64/2048/c` keeps only those (hd/seqlen/causal,
    // MHA shapes): one case under a profiler.
    if let Ok(list) = std::env::var("CANDLE_FLASH_BENCH_CASES") {
        let keys: Vec<&str> = list.split(',').map(str::trim).collect();
        cases.retain(|c| {
            let key = format!("{}/{}/{}", c.hd, c.seqlen, if c.causal { "c" } else { "n" });
            c.heads == c.heads_k && keys.contains(&key.as_str())
        });
    }
    cases
}

/// `CANDLE_FLASH_BENCH_MODS`'s items, `HD/NAME` separated by commas. A window's name holds a
/// comma of its own (`128/window (4096, 0) causal`), so a piece that does not start with a
/// head dim and a slash continues the item before it.
fn mods_filter(list: &str) -> Vec<(usize, String)> {
    let mut items: Vec<(usize, String)> = Vec::new();
    for piece in list.split(',') {
        let item = piece
            .split_once('/')
            .and_then(|(hd, name)| Some((hd.trim().parse().ok()?, name.trim().to_string())));
        match (item, items.last_mut()) {
            (Some(item), _) => items.push(item),
            (None, Some((_, name))) => {
                name.push(',');
                name.push_str(piece.trim_end());
            }
            (None, None) => {}
        }
    }
    items
}

/// The share of a `seqlen` x `seqlen` score matrix that a (causal, window) mask leaves
/// visible (FA2's window: -1 unbounded; causal sets right = 0).
fn visible_share(seqlen: usize, causal: bool, left: i64, right: i64) -> f64 {
    let n = seqlen as i64;
    let right = if causal { 0 } else { right };
    let visible: i64 = (0..n)
        .map(|i| {
            let lo = if left >= 0 { (i - left).max(0) } else { 0 };
            let hi = if right >= 0 {
                (i + right).min(n - 1)
            } else {
                n - 1
            };
            (hi - lo + 1).max(0)
        })
        .sum();
    visible as f64 / (n * n) as f64
}

fn flop_factor(pass: &str) -> f64 {
    match pass {
        "bwd" | "bwd-autograd" => 2.5,
        "fwd+bwd" => 3.5,
        _ => 1.0,
    }
}

/// One JSON record, the schema scripts/bench/compare.py reads.
struct Record {
    imp: &'static str,
    pass: &'static str,
    case: Case,
    ms: f64,
    tflops: f64,
    /// `--dropout P`, recorded where nonzero (the records of a dropout run say so).
    dropout: f32,
    /// `--deterministic`, recorded where set.
    deterministic: bool,
}

impl Record {
    fn json(&self) -> String {
        let c = &self.case;
        format!(
            "  {{\"impl\": \"{}\", \"pass\": \"{}\", \"hd\": {}, \"seqlen\": {}, \"batch\": {}, \
             \"heads\": {}, \"heads_k\": {}, \"causal\": {}, \"ms\": {:.6}, \"tflops\": {:.3}{}{}}}",
            self.imp,
            self.pass,
            c.hd,
            c.seqlen,
            c.batch(),
            c.heads,
            c.heads_k,
            c.causal,
            self.ms,
            self.tflops,
            if self.dropout > 0.0 {
                format!(", \"dropout\": {}", self.dropout)
            } else {
                String::new()
            },
            if self.deterministic {
                ", \"deterministic\": true"
            } else {
                ""
            }
        )
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

    /// `--mods-only`: sliding windows, softcapping and ALiBi against plain attention of the
    /// same shape, in the same run (torch's SDPA has neither a window nor a cap to compare
    /// with). `ideal` is the window's share of the plain (non-causal) score matrix: the
    /// time a windowed pass would take if its cost followed the visible pairs exactly.
    /// `vs plain` divides by plain attention timed again right before the variant
    /// (`baseline_passes`), `vs first` by the section's first plain lines (the d 128 causal
    /// softcap read 1.16-1.26x against those, 1.06-1.09x beside plain attention; H100,
    /// docs/archive/PERF.md, "The bench's "vs plain" and the card's power limit").
    fn mods_section(&mut self) {
        println!(
            "{:<34} {:>4} {:>6} {:>5} {:<4} {:>9} {:>8} {:>9} {:>9} {:>6}",
            "variant",
            "hd",
            "seqlen",
            "batch",
            "pass",
            "ms",
            "TFLOP/s",
            "vs plain",
            "vs first",
            "ideal"
        );
        let dev = self.dev.clone();
        let deterministic = self.deterministic;
        let plain = |causal| FlashAttn::new().causal(causal).deterministic(deterministic);
        // `CANDLE_FLASH_BENCH_MODS=128/softcap 50 causal,64/plain` (profiling): only those
        // head dims and variants, so that a profiler's launch count finds one variant's kernel.
        let only: Option<Vec<(usize, String)>> = std::env::var("CANDLE_FLASH_BENCH_MODS")
            .ok()
            .map(|v| mods_filter(&v));
        let keep = |hd: usize, name: &str| {
            only.as_ref()
                .is_none_or(|list| list.iter().any(|(h, n)| *h == hd && n == name))
        };
        for (hd, seqlen, heads) in [(128, 16384, 16), (64, 4096, 32), (256, 4096, 8)] {
            if only
                .as_ref()
                .is_some_and(|l| l.iter().all(|(h, _)| *h != hd))
            {
                continue;
            }
            let case = Case {
                hd,
                seqlen,
                heads,
                heads_k: heads,
                causal: false,
            };
            let Some(sets) = self.option_inputs(&case) else {
                continue;
            };
            let slopes: Vec<f32> = (0..heads)
                .map(|i| 2f32.powf(-8.0 * (i + 1) as f32 / heads as f32))
                .collect();
            let slopes = match Tensor::new(slopes.as_slice(), &dev) {
                Ok(s) => s,
                Err(e) => {
                    println!("skipped: slopes: {}", first_line(&e));
                    continue;
                }
            };
            let quarter = seqlen as i64 / 4;
            let variants: Vec<(String, FlashAttn, bool)> = vec![
                ("plain".into(), plain(false), false),
                ("plain causal".into(), plain(true), true),
                (
                    format!("window ({quarter}, 0) causal"),
                    plain(true).window_size(quarter, 0),
                    true,
                ),
                (
                    format!("window ({}, {})", quarter / 2, quarter / 2),
                    plain(false).window_size(quarter / 2, quarter / 2),
                    false,
                ),
                ("softcap 50".into(), plain(false).softcap(50.0), false),
                ("softcap 50 causal".into(), plain(true).softcap(50.0), true),
                (
                    "alibi causal".into(),
                    plain(true).alibi_slopes(&slopes),
                    true,
                ),
            ];
            let mut base = [[None; 2]; 2]; // [causal][pass]
            for (name, opts, causal) in &variants {
                if !keep(hd, name) {
                    continue;
                }
                let (left, right) = opts.window_size;
                let visible = visible_share(seqlen, *causal, left, right);
                // Windows against plain non-causal attention (their ideal share), the rest
                // against plain attention with their own mask.
                let windowed = left >= 0 || (right >= 0 && !*causal);
                let against_causal = *causal && !windowed;
                let adjacent = if name.starts_with("plain") {
                    Vec::new()
                } else {
                    baseline_passes(&dev, &sets, &plain(against_causal), self.fwd_only)
                };
                let passes = time_option_passes(&dev, &sets, opts, self.fwd_only);
                for (p, (pass, ms)) in passes.into_iter().enumerate() {
                    let ms = match ms {
                        Ok(ms) => ms,
                        Err(e) => {
                            println!("{name:<34} {hd:>4} {seqlen:>6} {pass}: failed: {e}");
                            continue;
                        }
                    };
                    let flops = 4.0
                        * (case.batch() * heads * hd) as f64
                        * (seqlen * seqlen) as f64
                        * visible
                        * flop_factor(pass);
                    if name.starts_with("plain") {
                        base[usize::from(*causal)][p] = Some(ms);
                    }
                    let first = base[usize::from(against_causal)][p];
                    let against = adjacent.get(p).copied().flatten().or(first);
                    let ratio = against.map_or("-".into(), |b| format!("{:.3}", ms / b));
                    let vs_first = first.map_or("-".into(), |b| format!("{:.3}", ms / b));
                    let ideal = if windowed {
                        format!("{visible:.3}")
                    } else {
                        "-".into()
                    };
                    println!(
                        "{name:<34} {hd:>4} {seqlen:>6} {:>5} {pass:<4} {ms:>9.3} {:>8.1} {ratio:>9} {vs_first:>9} {ideal:>6}",
                        case.batch(),
                        flops / ms / 1e9,
                    );
                }
            }
        }
    }

    /// `--sparse-only`: block-sparse attention (128 x 128 blocks) against dense attention of
    /// the same shape timed right before each mask (`baseline_passes`); `ideal` is the share of
    /// blocks kept, the time a block-sparse pass would take if its cost followed the blocks
    /// exactly.
    /// Packed (variable-length) batches against fixed-length ones of the same tokens: 16k
    /// tokens in sequences of random lengths (a fixed LCG, uniform in [mean / 2, 3 mean / 2),
    /// the last one cut to fill 16k), seqlen_q = seqlen_k. `fwd` is the forward alone, `bwd`
    /// `loss.backward()` on a kept graph (so Candle's per-gradient bookkeeping too, the same
    /// bytes for both layouts). TFLOP/s counts each sequence's 4·h·s²·d (halved for causal,
    /// x2.5 for bwd), as the grid does; "vs fixed" is the ratio of TFLOP/s to the fixed-length
    /// batch's. `CANDLE_FLASH_WS_PACKED=0` in a second run times the kernels packed batches
    /// had before the warp-specialized ones.
    /// The FP8 (e4m3) forward against our bf16 forward on the same shapes (16k tokens per
    /// batch, hidden 2048): ms, TFLOP/s and the ratio. Inputs quantized per tensor (or per
    /// block: `CANDLE_FLASH_BENCH_FP8_BLOCKS=1`).
    fn fp8_section(&mut self) {
        println!(
            "{:<10} {:>4} {:>6} {:>5} {:>6} {:>6} {:>9} {:>9} {:>9} {:>9} {:>7}",
            "pass",
            "hd",
            "seqlen",
            "batch",
            "heads",
            "causal",
            "bf16 ms",
            "bf16 TF",
            "fp8 ms",
            "fp8 TF",
            "fp8/bf16"
        );
        use candle_flash::quant::{fp8_scales, quantize_fp8, Fp8Scaling, FP8_BLOCK_ROWS};
        let dev = self.dev.clone();
        let scaling = if std::env::var("CANDLE_FLASH_BENCH_FP8_BLOCKS").is_ok_and(|v| v == "1") {
            println!("FP8 descales per block of {FP8_BLOCK_ROWS} rows");
            Fp8Scaling::PerBlock {
                rows: FP8_BLOCK_ROWS,
            }
        } else {
            Fp8Scaling::PerTensor
        };
        let fp8_hds: Vec<usize> = std::env::var("CANDLE_FLASH_BENCH_HDS")
            .ok()
            .map(|v| v.split(',').filter_map(|x| x.trim().parse().ok()).collect())
            .unwrap_or_else(|| vec![128, 256]);
        for &hd in &fp8_hds {
            for seqlen in [512usize, 1024, 2048, 4096, 8192, 16384] {
                for causal in [false, true] {
                    let heads = HIDDEN / hd;
                    let batch = TOKENS / seqlen;
                    let run = || -> Result<(f64, f64)> {
                        let x = || Tensor::randn(0f32, 1.0, (batch, seqlen, heads, hd), &dev);
                        let (q, k, v) = (x()?, x()?, x()?);
                        let quant = |t: &Tensor| -> Result<(Tensor, Tensor)> {
                            let s = fp8_scales(t, scaling)?;
                            Ok((quantize_fp8(t, &s, scaling)?, s))
                        };
                        let ((q8, qs), (k8, ks), (v8, vs)) = (quant(&q)?, quant(&k)?, quant(&v)?);
                        let bf = |t: &Tensor| t.to_dtype(DType::BF16);
                        let (qb, kb, vb) = (bf(&q)?, bf(&k)?, bf(&v)?);
                        let opts = FlashAttn::new().causal(causal);
                        let bf16_ms = time_ms(&dev, |_| opts.forward(&qb, &kb, &vb).map(|_| ()))?;
                        let fp8 = opts.clone().fp8_descales(&qs, &ks, &vs);
                        let fp8_ms = time_ms(&dev, |_| fp8.forward(&q8, &k8, &v8).map(|_| ()))?;
                        Ok((bf16_ms, fp8_ms))
                    };
                    let flop = 4.0
                        * (batch * heads * hd) as f64
                        * (seqlen * seqlen) as f64
                        * visible_share(seqlen, causal, -1, -1);
                    match run() {
                        Ok((b_ms, f_ms)) => {
                            let tf = |ms: f64| flop / (ms * 1e-3) / 1e12;
                            println!(
                                "{:<10} {:>4} {:>6} {:>5} {:>6} {:>6} {:>9.4} {:>9.1} {:>9.4} {:>9.1} {:>6.2}x",
                                "fwd-fp8", hd, seqlen, batch, heads, causal, b_ms, tf(b_ms), f_ms,
                                tf(f_ms), b_ms / f_ms
                            );
                        }
                        Err(e) => println!(
                            "{:<10} {:>4} {:>6} {:>5} {:>6} {:>6} error: {}",
                            "fwd-fp8",
                            hd,
                            seqlen,
                            batch,
                            heads,
                            causal,
                            first_line(&e)
                        ),
                    }
                }
            }
        }
    }

    fn varlen_section(&mut self) {
        /// (layout, pass, causal, ms, TFLOP)
        type VarlenRow = (&'static str, &'static str, bool, f64, f64);
        println!(
            "{:<8} {:<4} {:>4} {:>6} {:>5} {:>6} {:>6} {:>9} {:>8} {:>9}",
            "layout", "pass", "hd", "mean", "seqs", "heads", "causal", "ms", "TFLOP/s", "vs fixed"
        );
        let dev = self.dev.clone();
        let dtype = self.dtype;
        for (hd, heads) in [(64, 32), (128, 16), (256, 8)] {
            for mean in [512usize, 2048] {
                let mut x = 0x2545_F491_4F6C_DD1Du64 ^ (hd * mean) as u64;
                let mut lens = vec![];
                let mut left = TOKENS;
                while left > 0 {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let len = (mean / 2 + (x >> 33) as usize % mean).min(left);
                    lens.push(len);
                    left -= len;
                }
                let fixed_lens = vec![mean; TOKENS / mean];
                let run = || -> Result<Vec<VarlenRow>> {
                    let varlen = candle_flash::VarLen::from_seqlens(&lens, &lens)?;
                    let qkv = || -> Result<Var> {
                        Var::from_tensor(
                            &Tensor::randn(0f32, 1.0, (TOKENS, heads, hd), &dev)?
                                .to_dtype(dtype)?,
                        )
                    };
                    let (q, k, v) = (qkv()?, qkv()?, qkv()?);
                    let dout =
                        Tensor::randn(0f32, 1.0, (TOKENS, heads, hd), &dev)?.to_dtype(dtype)?;
                    // The fixed batch's inputs are variables of their own shape, so that its
                    // graph holds no reshape (whose gradients Candle would also accumulate).
                    let fixed = |t: &Tensor| -> Result<Var> {
                        Var::from_tensor(&t.reshape((TOKENS / mean, mean, heads, hd))?)
                    };
                    let (qf, kf, vf) = (fixed(&q)?, fixed(&k)?, fixed(&v)?);
                    let dout_f = dout.reshape((TOKENS / mean, mean, heads, hd))?;
                    let mut rows = vec![];
                    for causal in [false, true] {
                        let attn = FlashAttn::new().causal(causal);
                        let half = if causal { 0.5 } else { 1.0 };
                        for (layout, lens) in [("packed", &lens), ("fixed", &fixed_lens)] {
                            let packed = layout == "packed";
                            let (q, k, v, dout) = if packed {
                                (&q, &k, &v, &dout)
                            } else {
                                (&qf, &kf, &vf, &dout_f)
                            };
                            let fwd = |q: &Tensor, k: &Tensor, v: &Tensor| {
                                if packed {
                                    attn.forward_varlen(q, k, v, &varlen)
                                } else {
                                    attn.forward(q, k, v)
                                }
                            };
                            let tflop = lens
                                .iter()
                                .map(|&l| 4.0 * (heads * hd) as f64 * (l * l) as f64 * half)
                                .sum::<f64>()
                                / 1e12;
                            let (qd, kd, vd) = (
                                q.as_detached_tensor(),
                                k.as_detached_tensor(),
                                v.as_detached_tensor(),
                            );
                            let ms = time_ms(&dev, |_| fwd(&qd, &kd, &vd).map(drop))?;
                            rows.push((layout, "fwd", causal, ms, tflop));
                            let loss = grad_loss(&fwd(q, k, v)?, dout)?;
                            let ms = time_ms(&dev, |_| loss.backward().map(drop))?;
                            rows.push((layout, "bwd", causal, ms, 2.5 * tflop));
                        }
                    }
                    Ok(rows)
                };
                match run() {
                    Ok(rows) => {
                        for (layout, pass, causal, ms, tflop) in &rows {
                            let tflops = tflop / ms * 1e3;
                            let (_, _, _, fixed_ms, fixed_tflop) = rows
                                .iter()
                                .find(|r| r.0 == "fixed" && r.1 == *pass && r.2 == *causal)
                                .expect("a fixed row per pass and mask");
                            let seqs = if *layout == "packed" {
                                lens.len()
                            } else {
                                fixed_lens.len()
                            };
                            println!(
                                "{layout:<8} {pass:<4} {hd:>4} {mean:>6} {seqs:>5} {heads:>6} {causal:>6} {ms:>9.3} {tflops:>8.1} {:>9.3}",
                                tflops / (fixed_tflop / fixed_ms * 1e3),
                            );
                        }
                    }
                    Err(e) => println!("varlen hd {hd} mean {mean}: failed: {}", first_line(&e)),
                }
            }
        }
    }

    fn sparse_section(&mut self) {
        println!(
            "{:<24} {:>4} {:>6} {:>5} {:<4} {:>9} {:>8} {:>9} {:>6}",
            "mask", "hd", "seqlen", "batch", "pass", "ms", "TFLOP/s", "vs dense", "ideal"
        );
        let dev = self.dev.clone();
        // `CANDLE_FLASH_BENCH_SPARSE=HD/DENSITY` (profiling): that head dim and one random mask.
        let only: Option<(usize, f64)> =
            std::env::var("CANDLE_FLASH_BENCH_SPARSE")
                .ok()
                .and_then(|v| {
                    let (hd, density) = v.split_once('/')?;
                    Some((hd.parse().ok()?, density.parse().ok()?))
                });
        for (hd, seqlen, heads) in [(128, 16384, 16), (64, 16384, 32), (256, 16384, 8)] {
            if only.is_some_and(|(h, _)| h != hd) {
                continue;
            }
            let case = Case {
                hd,
                seqlen,
                heads,
                heads_k: heads,
                causal: false,
            };
            let Some(sets) = self.option_inputs(&case) else {
                continue;
            };
            let blocks = seqlen / 128;
            // Random blocks per head, from a fixed LCG: the same mask every run.
            let random = |density: f64| -> Result<BlockMask> {
                let mut x = 0x9E37_79B9_7F4A_7C15u64;
                let v: Vec<u8> = (0..heads * blocks * blocks)
                    .map(|_| {
                        x = x
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        u8::from(((x >> 11) as f64 / (1u64 << 53) as f64) < density)
                    })
                    .collect();
                BlockMask::new(
                    &Tensor::from_vec(v, (heads, blocks, blocks), &dev)?,
                    128,
                    128,
                )
            };
            let masks: Vec<(String, Result<BlockMask>)> = if let Some((_, density)) = only {
                vec![(format!("random {:.0}%", density * 100.0), random(density))]
            } else {
                vec![
                    ("random 10%".into(), random(0.1)),
                    ("random 50%".into(), random(0.5)),
                    ("random 100%".into(), random(1.0)),
                    (
                        "butterfly".into(),
                        BlockMask::butterfly(seqlen, seqlen, 128, &dev),
                    ),
                    (
                        "local 3 + global 1".into(),
                        BlockMask::local_global(seqlen, seqlen, 128, 3, 1, &dev),
                    ),
                ]
            };
            let det = FlashAttn::new().deterministic(self.deterministic);
            let mut variants = vec![("dense".to_string(), det.clone(), 1.0)];
            for (name, mask) in masks {
                match mask.and_then(|m| Ok((m.density()?, m))) {
                    Ok((density, m)) => variants.push((name, det.clone().block_mask(&m), density)),
                    Err(e) => println!("skipped {name}: {}", first_line(&e)),
                }
            }
            let mut base = [None; 2];
            for (name, opts, density) in &variants {
                let adjacent = if name == "dense" {
                    Vec::new()
                } else {
                    baseline_passes(&dev, &sets, &det, self.fwd_only)
                };
                let passes = time_option_passes(&dev, &sets, opts, self.fwd_only);
                for (p, (pass, ms)) in passes.into_iter().enumerate() {
                    let ms = match ms {
                        Ok(ms) => ms,
                        Err(e) => {
                            println!("{name:<24} {hd:>4} {seqlen:>6} {pass}: failed: {e}");
                            continue;
                        }
                    };
                    let flops = 4.0
                        * (case.batch() * heads * hd) as f64
                        * (seqlen * seqlen) as f64
                        * density
                        * flop_factor(pass);
                    if name == "dense" {
                        base[p] = Some(ms);
                    }
                    let against = adjacent.get(p).copied().flatten().or(base[p]);
                    let ratio = against.map_or("-".into(), |b| format!("{:.3}", ms / b));
                    println!(
                        "{name:<24} {hd:>4} {seqlen:>6} {:>5} {pass:<4} {ms:>9.3} {:>8.1} {ratio:>9} {density:>6.3}",
                        case.batch(),
                        flops / ms / 1e9,
                    );
                }
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

/// KV-cache decoding ([`flash_attn_with_kvcache`]) and the copy bandwidth it is measured
/// against.
impl Bench {
    /// The copy bandwidth once, then every decode shape; the JSON is rewritten after each.
    fn decode_section(&mut self, json: Option<&PathBuf>) {
        println!(
            "# decode: GQA {DECODE_HEADS}/{DECODE_HEADS_K} heads, hd {DECODE_HD}, {:?}, one query \
             token attending to all L cached tokens (no append); GB/s of K+V read",
            self.dtype
        );
        let copy_gbps = self.copy_bandwidth();
        if let Some(path) = json {
            self.write_json(path);
        }
        println!(
            "{:<12} {:<8} {:>4} {:>6} {:>5} {:>6} {:>6} {:>9} {:>8} {:>6} {:>9}  check",
            "impl", "pass", "hd", "L", "batch", "heads", "caches", "ms", "GB/s", "%copy", "host ms"
        );
        for (batch, seqlen) in decode_shapes() {
            for fp8 in [false, true] {
                self.decode(&DecodeCase { batch, seqlen, fp8 }, copy_gbps);
                if let Some(path) = json {
                    self.write_json(path);
                }
            }
        }
        println!(
            "# %copy: GB/s of K+V read / the copy bandwidth above. dec-fp8 / grph-fp8: the same \
             calls over an F8E4M3 cache (one byte an element; its own GB/s). host ms: time to \
             queue a call; close to ms means the host, not the GPU, sets the pace. check: max \
             |ours - f32 reference| as a % of max |reference| (MISMATCH above {:.0}%)",
            100.0 * DECODE_CHECK_REL
        );
    }

    /// Device-to-device copy bandwidth in GB/s: bytes read + written by `cuMemcpyDtoDAsync`
    /// of a 2 GiB buffer into another (no allocation in the loop; like torch's
    /// `dst.copy_(src)`). Candle's `slice_set` is not used: it measured 1.1 TB/s on the H200,
    /// a quarter of the memcpy. Recorded as impl "copy", pass "copy".
    fn copy_bandwidth(&mut self) -> Option<f64> {
        let dev = self.dev.clone();
        let size = COPY_ELEMS * 2;
        let bytes = 2 * size;
        let timed = try_run(|| memcpy_timing(&dev));
        match timed {
            Ok(t) if t.ms.is_finite() && t.ms > 0.0 => {
                let gbps = bytes as f64 / (t.ms * 1e-3) / 1e9;
                println!(
                    "copy: {} MiB bf16 device-to-device, {} MiB read + written: {:.3} ms, \
                     {gbps:.0} GB/s",
                    size >> 20,
                    bytes >> 20,
                    t.ms
                );
                self.records.push(format!(
                    "  {{\"impl\": \"copy\", \"pass\": \"copy\", \"bytes\": {bytes}, \
                     \"ms\": {:.6}, \"gbps\": {gbps:.1}}}",
                    t.ms
                ));
                Some(gbps)
            }
            Ok(t) => {
                println!("copy: n/a  bad timing {}", t.ms);
                None
            }
            Err(e) => {
                println!("copy: n/a  {e}");
                None
            }
        }
    }

    /// One decode shape: [`flash_attn_with_kvcache`] over `case.caches()` separate filled
    /// caches in turn, checked once against Candle's attention in f32, then timed.
    fn decode(&mut self, case: &DecodeCase, copy_gbps: Option<f64>) {
        let n = case.caches(self.dtype);
        let sets = (0..n).map(|_| DecodeInputs::new(case, self.dtype, &self.dev));
        let sets = match sets.collect::<Result<Vec<_>>>() {
            Ok(sets) => sets,
            Err(e) => {
                println!(
                    "{FLASH:<12} skipped decode {case}: inputs: {}",
                    first_line(&e)
                );
                return;
            }
        };
        let lens = vec![case.seqlen as u32; case.batch];
        let opts = match &sets[0].scales {
            Some((ks, vs)) => FlashAttn::new().kv_cache_scales(ks, vs),
            None => FlashAttn::new(),
        };
        let (pass_eager, pass_graph) = match case.fp8 {
            false => ("decode", "graph"),
            true => ("dec-fp8", "grph-fp8"),
        };
        let attend =
            |s: &DecodeInputs| flash_attn_with_kvcache(&s.q, &s.k, &s.v, None, &lens, &opts);
        let check = match try_run(|| decode_check(&sets[0], &attend(&sets[0])?)) {
            Ok(rel) if rel <= DECODE_CHECK_REL => (format!("ok ({:.2}%)", 100.0 * rel), Some(rel)),
            Ok(rel) => (format!("MISMATCH ({:.2}%)", 100.0 * rel), Some(rel)),
            Err(e) => (format!("n/a ({e})"), None),
        };
        let dev = self.dev.clone();
        let timed =
            try_run(|| time_ms_with(&dev, DECODE_TIMING, |i| attend(&sets[i % n]).map(drop)));
        let row = case.row(pass_eager, n);
        let t = match timed {
            Ok(t) if t.ms.is_finite() && t.ms > 0.0 => t,
            Ok(t) => return println!("{row} n/a  bad timing {}  check {}", t.ms, check.0),
            Err(e) => return println!("{row} n/a  {e}  check {}", check.0),
        };
        let (cells, mut fields) = case.record("decode", t.ms, self.dtype, copy_gbps);
        println!("{row} {cells} {:>9.4}  {}", t.host_ms, check.0);
        fields.push(format!("\"host_ms\": {:.6}", t.host_ms));
        fields.push(format!("\"caches\": {n}"));
        if let Some(rel) = check.1 {
            let ok = rel <= DECODE_CHECK_REL;
            fields.push(format!(
                "\"check\": \"{}\"",
                if ok { "ok" } else { "mismatch" }
            ));
            if rel.is_finite() {
                fields.push(format!("\"max_rel_err\": {rel:.3e}"));
            }
        }
        self.records.push(format!("  {{{}}}", fields.join(", ")));

        // The same calls captured in a CUDA graph (lengths in a device tensor, one call per
        // cache set in turn) and replayed: the kernels back to back without launch gaps, as a
        // captured decoding step runs them.
        let lens_dev = match Tensor::new(lens.as_slice(), &dev) {
            Ok(t) => t,
            Err(e) => return println!("{FLASH:<12} skipped decode-graph: {}", first_line(&e)),
        };
        let attend_dev =
            |s: &DecodeInputs| flash_attn_with_kvcache(&s.q, &s.k, &s.v, None, &lens_dev, &opts);
        // The library's capture (memory nodes out of the kernels' chain, programmatic edges
        // kept: candle_flash::graph) and the graph as a plain stream capture records it.
        let pass_cap = if case.fp8 { "gr-c-fp8" } else { "graph-c" };
        for (as_captured, pass, json_pass) in [
            (false, pass_graph, "decode-graph"),
            (true, pass_cap, "decode-graph-captured"),
        ] {
            let timed =
                try_run(|| graph_timing(&dev, n, as_captured, |i| attend_dev(&sets[i]).map(drop)));
            let row = case.row(pass, n);
            let (t, stats) = match timed {
                Ok((t, stats)) if t.ms.is_finite() && t.ms > 0.0 => (t, stats),
                Ok((t, _)) => {
                    println!("{row} n/a  bad timing {}", t.ms);
                    continue;
                }
                Err(e) => {
                    println!("{row} n/a  {}", first_line(&e));
                    continue;
                }
            };
            let (cells, fields) = case.record(json_pass, t.ms, self.dtype, copy_gbps);
            println!("{row} {cells} {:>9.4}  in a CUDA graph: {stats}", t.host_ms);
            self.records.push(format!("  {{{}}}", fields.join(", ")));
        }
    }
}

/// Per-call time of `calls` calls (`step(0..calls)`) captured once in a CUDA graph and
/// replayed, with what the graph holds; each call is run eagerly first (kernel modules, the
/// decode's counters). `as_captured`: the graph as a plain stream capture records it,
/// otherwise as `candle_flash::graph` shapes it.
#[cfg(feature = "cuda")]
fn graph_timing(
    dev: &Device,
    calls: usize,
    as_captured: bool,
    step: impl Fn(usize) -> Result<()>,
) -> Result<(Timed, String)> {
    use candle_flash::graph::{CapturedGraph, Wiring};
    for i in 0..calls {
        step(i)?;
    }
    dev.synchronize()?;
    let wiring = match as_captured {
        true => Wiring::AsCaptured,
        false => Wiring::Programmatic,
    };
    let (graph, ()) = CapturedGraph::capture_with(dev, wiring, || (0..calls).try_for_each(&step))?;
    let t = time_ms_with(dev, DECODE_TIMING, |_| graph.launch())?;
    let stats = graph.stats().to_string();
    Ok((
        Timed {
            ms: t.ms / calls as f64,
            host_ms: t.host_ms / calls as f64,
        },
        stats,
    ))
}

#[cfg(not(feature = "cuda"))]
fn graph_timing(
    _dev: &Device,
    _calls: usize,
    _as_captured: bool,
    _step: impl Fn(usize) -> Result<()>,
) -> Result<(Timed, String)> {
    candle::bail!("CUDA graphs need the cuda feature")
}

/// [`DECODE_SHAPES`], or the `BxL` shapes listed in `CANDLE_FLASH_BENCH_DECODE` (e.g.
/// `8x8192,1x65536`: one shape under a profiler). Unparsable entries are reported and skipped.
fn decode_shapes() -> Vec<(usize, usize)> {
    let Ok(list) = std::env::var("CANDLE_FLASH_BENCH_DECODE") else {
        return DECODE_SHAPES.to_vec();
    };
    list.split(',')
        .filter_map(|entry| {
            let parsed = entry
                .split_once('x')
                .and_then(|(b, l)| Some((b.trim().parse().ok()?, l.trim().parse().ok()?)));
            if parsed.is_none() {
                println!("CANDLE_FLASH_BENCH_DECODE: skipping {entry:?}, expected BxL");
            }
            parsed
        })
        .collect()
}

/// One decode shape: `batch` sequences of `seqlen` cached tokens (all attended), GQA
/// DECODE_HEADS/DECODE_HEADS_K heads at DECODE_HD, one query token per sequence.
#[derive(Clone, Copy)]
struct DecodeCase {
    batch: usize,
    seqlen: usize,
    /// The cache is F8E4M3 (one byte an element, per-head scales).
    fp8: bool,
}

impl DecodeCase {
    /// A table row's leading cells: implementation, `pass`, shape, `caches` cache sets.
    fn row(&self, pass: &str, caches: usize) -> String {
        format!(
            "{FLASH:<12} {:<8} {DECODE_HD:>4} {:>6} {:>5} {:>6} {caches:>6}",
            pass,
            self.seqlen,
            self.batch,
            format!("{DECODE_HEADS}/{DECODE_HEADS_K}"),
        )
    }

    /// A call of `ms` milliseconds: the row's ms, GB/s and % of copy cells, and the JSON
    /// fields every decode record shares (pass `json_pass`, `-fp8` appended for an e4m3
    /// cache).
    fn record(
        &self,
        json_pass: &str,
        ms: f64,
        dtype: DType,
        copy_gbps: Option<f64>,
    ) -> (String, Vec<String>) {
        let gbps = self.kv_bytes(dtype) as f64 / (ms * 1e-3) / 1e9;
        let pct = copy_gbps.map(|c| 100.0 * gbps / c);
        let pct_cell = pct.map_or("n/a".to_string(), |p| format!("{p:.1}"));
        let suffix = if self.fp8 { "-fp8" } else { "" };
        let mut fields = vec![
            format!("\"impl\": \"{FLASH}\""),
            format!("\"pass\": \"{json_pass}{suffix}\""),
            format!("\"hd\": {DECODE_HD}"),
            format!("\"seqlen\": {}", self.seqlen),
            format!("\"batch\": {}", self.batch),
            format!("\"heads\": {DECODE_HEADS}"),
            format!("\"heads_k\": {DECODE_HEADS_K}"),
            "\"causal\": false".into(),
            format!("\"ms\": {ms:.6}"),
            format!("\"gbps\": {gbps:.1}"),
        ];
        if let Some(p) = pct {
            fields.push(format!("\"pct_copy\": {p:.2}"));
        }
        (format!("{ms:>9.4} {gbps:>8.0} {pct_cell:>6}"), fields)
    }

    /// Bytes of K and V one call reads: 2·b·L·hk·d elements.
    fn kv_bytes(&self, dtype: DType) -> usize {
        let elem = if self.fp8 { 1 } else { dtype.size_in_bytes() };
        2 * self.batch * self.seqlen * DECODE_HEADS_K * DECODE_HD * elem
    }

    /// Caches to rotate over: at least DECODE_MIN_CACHES and DECODE_ROTATE_BYTES in all, at
    /// most DECODE_MAX_BYTES.
    fn caches(&self, dtype: DType) -> usize {
        let one = self.kv_bytes(dtype).max(1);
        let wanted = DECODE_ROTATE_BYTES.div_ceil(one).max(DECODE_MIN_CACHES);
        wanted.min(DECODE_MAX_BYTES / one).max(1)
    }
}

impl fmt::Display for DecodeCase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "batch={} L={} heads={DECODE_HEADS}/{DECODE_HEADS_K} hd={DECODE_HD}{}",
            self.batch,
            self.seqlen,
            if self.fp8 { " fp8 cache" } else { "" }
        )
    }
}

/// One decode input: q `(b, 1, h, d)` and a full cache `(b, L, hk, d)` of random values; an
/// F8E4M3 cache holds N(0, 1) values quantized with a scale of 4 per head.
struct DecodeInputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scales: Option<(Tensor, Tensor)>,
}

impl DecodeInputs {
    fn new(case: &DecodeCase, dtype: DType, dev: &Device) -> Result<Self> {
        let randn = |rows: usize, heads: usize| {
            Tensor::randn(0f32, 1.0, (case.batch, rows, heads, DECODE_HD), dev)?.to_dtype(dtype)
        };
        if !case.fp8 {
            return Ok(Self {
                q: randn(1, DECODE_HEADS)?,
                k: randn(case.seqlen, DECODE_HEADS_K)?,
                v: randn(case.seqlen, DECODE_HEADS_K)?,
                scales: None,
            });
        }
        let scale = Tensor::full(4f32, DECODE_HEADS_K, dev)?;
        let fp8 = |rows: usize| {
            let x = Tensor::randn(
                0f32,
                1.0,
                (case.batch, rows, DECODE_HEADS_K, DECODE_HD),
                dev,
            )?;
            quant::quantize_fp8(&x, &scale, quant::Fp8Scaling::PerHead)
        };
        Ok(Self {
            q: randn(1, DECODE_HEADS)?,
            k: fp8(case.seqlen)?,
            v: fp8(case.seqlen)?,
            scales: Some((scale.clone(), scale)),
        })
    }
}

/// max |out - reference| / max |reference|, the reference being Candle's attention in f32 on
/// the same inputs (an F8E4M3 cache dequantized; a guard against a fast but wrong kernel; NaN
/// or inf anywhere gives inf).
fn decode_check(s: &DecodeInputs, out: &Tensor) -> Result<f64> {
    let f32 = |t: &Tensor| t.to_dtype(DType::F32);
    let (k, v) = match &s.scales {
        None => (f32(&s.k)?, f32(&s.v)?),
        Some((ks, vs)) => {
            let real = |x: &Tensor, scale: &Tensor| {
                quant::dequantize_fp8(x, scale, quant::Fp8Scaling::PerHead, DType::F32)
            };
            (real(&s.k, ks)?, real(&s.v, vs)?)
        }
    };
    let reference = naive_attention(&f32(&s.q)?, &k, &v, None, false)?;
    let out = f32(out)?;
    // NaN compares false with everything: count the elements of finite magnitude.
    let finite = out.abs()?.le(f32::MAX as f64)?.to_dtype(DType::F32)?;
    if (finite.sum_all()?.to_scalar::<f32>()? as usize) < out.elem_count() {
        return Ok(f64::INFINITY);
    }
    let max_abs = |t: &Tensor| -> Result<f64> {
        Ok(t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()? as f64)
    };
    Ok(max_abs(&(&out - &reference)?)? / max_abs(&reference)?.max(1e-30))
}

/// Cascade attention: a decode step over a prompt shared by every sequence, unshared and as
/// a cascade.
impl Bench {
    /// The unshared step, the cascade and its parts timed on the same inputs, and the
    /// cascade checked against the unshared step; the JSON rewritten at the end.
    fn cascade_section(&mut self, json: Option<&PathBuf>) {
        let lens = cascade_suffix_lens();
        let (lo, hi) = (
            lens.iter().min().unwrap_or(&0),
            lens.iter().max().unwrap_or(&0),
        );
        let sets = cascade_sets(self.dtype);
        println!(
            "# cascade: {CASCADE_BATCH} sequences share a {CASCADE_PREFIX}-token prefix, each \
             with its own suffix of {lo}..{hi} tokens (all different), GQA \
             {DECODE_HEADS}/{DECODE_HEADS_K} heads, hd {DECODE_HD}, {:?}, one query token each; \
             {sets} input sets",
            self.dtype
        );
        let sets = (0..sets).map(|_| CascadeInputs::new(self.dtype, &self.dev));
        let sets = match sets.collect::<Result<Vec<_>>>() {
            Ok(sets) => sets,
            Err(e) => return println!("{FLASH:<12} skipped cascade: inputs: {}", first_line(&e)),
        };
        let full_lens: Vec<u32> = lens.iter().map(|&l| l + CASCADE_PREFIX as u32).collect();
        let opts = FlashAttn::new();
        let unshared = |s: &CascadeInputs| {
            flash_attn_with_kvcache(&s.q, &s.full_k, &s.full_v, None, &full_lens, &opts)
        };
        let suffix = |s: &CascadeInputs| {
            flash_attn_with_kvcache_lse(&s.q, &s.suffix_k, &s.suffix_v, None, &lens, &opts)
        };
        let cascade = |s: &CascadeInputs, split: bool| -> Result<Tensor> {
            let mut parts = if split {
                s.prefix_split(&opts)?
            } else {
                vec![s.prefix(&opts)?]
            };
            parts.push(suffix(s)?);
            Ok(combine(&parts)?.0)
        };
        // The parts of each set for timing the merge alone.
        let parts = sets
            .iter()
            .map(|s| Ok([s.prefix(&opts)?, suffix(s)?]))
            .collect::<Result<Vec<_>>>();
        let n = sets.len();
        let dev = self.dev.clone();
        let time = |f: &dyn Fn(usize) -> Result<()>| {
            try_run(|| time_ms_with(&dev, DECODE_TIMING, f)).and_then(|t| {
                if t.ms.is_finite() && t.ms > 0.0 {
                    Ok(t)
                } else {
                    Err(format!("bad timing {}", t.ms))
                }
            })
        };
        let rows: Vec<(&'static str, std::result::Result<Timed, String>)> = vec![
            ("unshared", time(&|i| unshared(&sets[i % n]).map(drop))),
            ("cascade", time(&|i| cascade(&sets[i % n], false).map(drop))),
            ("prefix", time(&|i| sets[i % n].prefix(&opts).map(drop))),
            ("suffix", time(&|i| suffix(&sets[i % n]).map(drop))),
            (
                "combine",
                match &parts {
                    Ok(parts) => time(&|i| combine(&parts[i % n]).map(drop)),
                    Err(e) => Err(first_line(e)),
                },
            ),
            (
                "cascade-split",
                time(&|i| cascade(&sets[i % n], true).map(drop)),
            ),
            (
                "prefix-split",
                time(&|i| sets[i % n].prefix_split(&opts).map(drop)),
            ),
        ];
        let base = rows[0].1.as_ref().ok().map(|t| t.ms);
        let dtype = self.dtype;
        let kv = |tokens: usize| {
            (2 * tokens * DECODE_HEADS_K * DECODE_HD * dtype.size_in_bytes()) as f64
        };
        let suffix_tokens: usize = lens.iter().map(|&l| l as usize).sum();
        let prefix_bytes = kv(CASCADE_PREFIX);
        let suffix_bytes = kv(suffix_tokens);
        let bytes = |pass: &str| match pass {
            "unshared" => kv(CASCADE_BATCH * CASCADE_PREFIX + suffix_tokens),
            "cascade" | "cascade-split" => prefix_bytes + suffix_bytes,
            "prefix" | "prefix-split" => prefix_bytes,
            "suffix" => suffix_bytes,
            _ => 0.0,
        };
        println!(
            "{:<12} {:<15} {:>9} {:>8} {:>9} {:>9}",
            "impl", "pass", "ms", "speedup", "K+V MB", "host ms"
        );
        for (pass, timed) in &rows {
            // The parts indented under their cascade.
            let label = match *pass {
                "prefix" | "suffix" | "combine" | "prefix-split" => format!("  {pass}"),
                _ => pass.to_string(),
            };
            let t = match timed {
                Ok(t) => t,
                Err(e) => {
                    println!("{FLASH:<12} {label:<15} n/a  {e}");
                    continue;
                }
            };
            let speedup = match (*pass, base) {
                ("unshared" | "cascade" | "cascade-split", Some(b)) => {
                    format!("{:.2}x", b / t.ms)
                }
                _ => String::new(),
            };
            let mb = bytes(pass) / 1e6;
            println!(
                "{FLASH:<12} {label:<15} {:>9.4} {speedup:>8} {mb:>9.1} {:>9.4}",
                t.ms, t.host_ms
            );
            // JSON passes: "cascade-unshared", "cascade", "cascade-prefix", ...
            let record_pass = match pass.starts_with("cascade") {
                true => pass.to_string(),
                false => format!("cascade-{pass}"),
            };
            self.records.push(format!(
                "  {{\"impl\": \"{FLASH}\", \"pass\": \"{record_pass}\", \"hd\": {DECODE_HD}, \
                 \"batch\": {CASCADE_BATCH}, \"prefix\": {CASCADE_PREFIX}, \"suffix_min\": {lo}, \
                 \"suffix_max\": {hi}, \"heads\": {DECODE_HEADS}, \"heads_k\": {DECODE_HEADS_K}, \
                 \"ms\": {:.6}, \"host_ms\": {:.6}, \"kv_bytes\": {:.0}}}",
                t.ms,
                t.host_ms,
                bytes(pass)
            ));
        }
        for packed in [false, true] {
            let name = if packed { "cascade-split" } else { "cascade" };
            let check =
                try_run(|| cascade_check(&cascade(&sets[0], packed)?, &unshared(&sets[0])?));
            match check {
                Ok((diff, max)) => {
                    let ulp = dtype_ulp(self.dtype, max);
                    let ulps = diff / ulp;
                    let verdict = if ulps <= CASCADE_CHECK_ULPS {
                        "ok"
                    } else {
                        "MISMATCH"
                    };
                    println!(
                        "check {name}: max |{name} - unshared| {diff:.3e} = {ulps:.2} {:?} ulp \
                         at max |unshared| {max:.3e} (bound {CASCADE_CHECK_ULPS}): {verdict}",
                        self.dtype
                    );
                    self.records.push(format!(
                        "  {{\"impl\": \"{FLASH}\", \"pass\": \"cascade-check\", \"variant\": \
                         \"{name}\", \"max_abs_diff\": {diff:.3e}, \"ulps\": {ulps:.3}, \
                         \"check\": \"{}\"}}",
                        verdict.to_lowercase()
                    ));
                }
                Err(e) => println!("check {name}: n/a ({e})"),
            }
        }
        println!(
            "# speedup: unshared ms / ms. K+V MB: the keys and values each pass reads (the \
             prefix once for all sequences in the cascade). host ms: time to queue a call."
        );
        if let Some(path) = json {
            self.write_json(path);
        }
    }
}

/// Sequence `i`'s suffix: `CASCADE_SUFFIX_MIN + (i · 97 mod CASCADE_SUFFIX_SPAN)` tokens,
/// different for every sequence and spread over 64..256.
fn cascade_suffix_lens() -> Vec<u32> {
    (0..CASCADE_BATCH)
        .map(|i| (CASCADE_SUFFIX_MIN + (i * 97) % CASCADE_SUFFIX_SPAN) as u32)
        .collect()
}

/// Input sets to rotate over: as for decode, at least DECODE_MIN_CACHES and enough that the
/// cascade's reads total DECODE_ROTATE_BYTES (its prompt, 32 MiB in bf16, would otherwise
/// stay in L2), while the unshared caches stay within DECODE_MAX_BYTES.
fn cascade_sets(dtype: DType) -> usize {
    let row = DECODE_HEADS_K * DECODE_HD * dtype.size_in_bytes() * 2;
    let suffix_cap = CASCADE_SUFFIX_MIN + CASCADE_SUFFIX_SPAN - 1;
    let cascade = row * (CASCADE_PREFIX + CASCADE_BATCH * suffix_cap);
    let full = row * CASCADE_BATCH * (CASCADE_PREFIX + suffix_cap);
    let wanted = DECODE_ROTATE_BYTES.div_ceil(cascade).max(DECODE_MIN_CACHES);
    wanted.min(DECODE_MAX_BYTES / full).max(1)
}

/// One cascade input set: q `(b, 1, h, d)`; the prompt's K and V `(1, prefix, hk, d)`; each
/// sequence's own tokens `(b, suffix_max, hk, d)`; and the unshared caches `(b, prefix +
/// suffix_max, hk, d)`, the prompt copied in front of each sequence's own tokens.
struct CascadeInputs {
    q: Tensor,
    prefix_k: Tensor,
    prefix_v: Tensor,
    suffix_k: Tensor,
    suffix_v: Tensor,
    full_k: Tensor,
    full_v: Tensor,
}

impl CascadeInputs {
    fn new(dtype: DType, dev: &Device) -> Result<Self> {
        let randn = |b: usize, rows: usize, heads: usize| {
            Tensor::randn(0f32, 1.0, (b, rows, heads, DECODE_HD), dev)?.to_dtype(dtype)
        };
        let (b, hk) = (CASCADE_BATCH, DECODE_HEADS_K);
        let suffix_cap = CASCADE_SUFFIX_MIN + CASCADE_SUFFIX_SPAN - 1;
        let prefix_k = randn(1, CASCADE_PREFIX, hk)?;
        let prefix_v = randn(1, CASCADE_PREFIX, hk)?;
        let suffix_k = randn(b, suffix_cap, hk)?;
        let suffix_v = randn(b, suffix_cap, hk)?;
        let full = |p: &Tensor, s: &Tensor| -> Result<Tensor> {
            Tensor::cat(
                &[&p.broadcast_as((b, CASCADE_PREFIX, hk, DECODE_HD))?, s],
                1,
            )
        };
        Ok(Self {
            q: randn(b, 1, DECODE_HEADS)?,
            full_k: full(&prefix_k, &suffix_k)?,
            full_v: full(&prefix_v, &suffix_v)?,
            prefix_k,
            prefix_v,
            suffix_k,
            suffix_v,
        })
    }

    /// The prompt attended once: the sequences' query tokens as the rows of one batch,
    /// `(out (b, 1, h, d), lse (b, h, 1))` (the lse a transposed view, which `combine` reads
    /// as it is).
    fn prefix(&self, opts: &FlashAttn) -> Result<(Tensor, Tensor)> {
        let (b, h, d) = (CASCADE_BATCH, DECODE_HEADS, DECODE_HD);
        let rows = self.q.reshape((1, b, h, d))?;
        let (out, lse) = opts.forward_with_lse(&rows, &self.prefix_k, &self.prefix_v)?;
        Ok((out.reshape((b, 1, h, d))?, lse.transpose(0, 2)?))
    }

    /// [`Self::prefix`] with the prompt's keys split into [`CASCADE_SPLIT`] chunks, attended
    /// in one launch as a batch of chunks (the prompt reshaped, a view; q copied per chunk),
    /// so that the launch has `CASCADE_SPLIT` times the blocks of 64 query rows per head; the
    /// chunks' `(out, lse)` go to `combine` with the suffix.
    fn prefix_split(&self, opts: &FlashAttn) -> Result<Vec<(Tensor, Tensor)>> {
        let (b, h, hk, d) = (CASCADE_BATCH, DECODE_HEADS, DECODE_HEADS_K, DECODE_HD);
        let parts = CASCADE_SPLIT;
        let chunk = CASCADE_PREFIX / parts;
        let k = self.prefix_k.reshape((parts, chunk, hk, d))?;
        let v = self.prefix_v.reshape((parts, chunk, hk, d))?;
        let rows = self
            .q
            .reshape((1, b, h, d))?
            .broadcast_as((parts, b, h, d))?
            .contiguous()?;
        let (out, lse) = opts.forward_with_lse(&rows, &k, &v)?;
        (0..parts)
            .map(|p| {
                Ok((
                    out.get(p)?.reshape((b, 1, h, d))?,
                    lse.get(p)?.transpose(0, 1)?.unsqueeze(2)?,
                ))
            })
            .collect()
    }
}

/// `(max |cascade - unshared|, max |unshared|)` in f32; infinite where either has a NaN or
/// an infinity.
fn cascade_check(cascade: &Tensor, unshared: &Tensor) -> Result<(f64, f64)> {
    let f32 = |t: &Tensor| -> Result<Vec<f32>> {
        t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
    };
    let (a, b) = (f32(cascade)?, f32(unshared)?);
    if a.len() != b.len() {
        bail!(
            "cascade {:?} vs unshared {:?}",
            cascade.dims(),
            unshared.dims()
        )
    }
    let (mut diff, mut max) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(&b) {
        if !(x.is_finite() && y.is_finite()) {
            return Ok((f64::INFINITY, f64::INFINITY));
        }
        diff = diff.max((x - y).abs() as f64);
        max = max.max(y.abs() as f64);
    }
    Ok((diff, max))
}

/// One unit in the last place of `dtype` at `x`.
fn dtype_ulp(dtype: DType, x: f64) -> f64 {
    let mantissa = match dtype {
        DType::BF16 => 7,
        DType::F16 => 10,
        _ => 23,
    };
    x.max(f64::MIN_POSITIVE).log2().floor().exp2() / f64::from(1u32 << mantissa)
}

/// One set of fresh random inputs, in the crate's (batch, seqlen, heads, head_dim) layout.
struct Inputs {
    q: Var,
    k: Var,
    v: Var,
    /// The output gradient fed to the backward pass.
    dout: Tensor,
}

impl Inputs {
    fn new(case: &Case, dtype: DType, dev: &Device) -> Result<Self> {
        // Generated in f32 (curand's native type), then converted.
        let randn = |heads: usize| {
            Tensor::randn(0f32, 1.0, (case.batch(), case.seqlen, heads, case.hd), dev)?
                .to_dtype(dtype)
        };
        Ok(Self {
            q: Var::from_tensor(&randn(case.heads)?)?,
            k: Var::from_tensor(&randn(case.heads_k)?)?,
            v: Var::from_tensor(&randn(case.heads_k)?)?,
            dout: randn(case.heads)?,
        })
    }
}

/// An attention implementation: `(q, k, v, train)`, where `train` asks for a differentiable
/// graph (Candle's fused softmax has no backward).
type Attn<'a> = dyn Fn(&Tensor, &Tensor, &Tensor, bool) -> Result<Tensor> + 'a;

/// Forward only, on detached inputs: no graph is recorded (like torch.no_grad()).
fn time_fwd(dev: &Device, sets: &[Inputs], attn: &Attn) -> Result<f64> {
    let inputs: Vec<_> = sets
        .iter()
        .map(|s| {
            (
                s.q.as_tensor().detach(),
                s.k.as_tensor().detach(),
                s.v.as_tensor().detach(),
            )
        })
        .collect();
    time_ms(dev, |i| {
        let (q, k, v) = &inputs[i % inputs.len()];
        attn(q, k, v, false).map(drop)
    })
}

/// Backward alone, called directly ([`FlashAttn::backward`]): one forward per input set, outside
/// the timed region, gives its `(out, lse)`; then only the backward runs, with no graph and no
/// gradient accumulation (like `torch.autograd.grad` on the flash kernel).
fn time_bwd_direct(dev: &Device, sets: &[Inputs], opts: &FlashAttn) -> Result<f64> {
    let saved = sets
        .iter()
        .map(|s| {
            let (q, k, v) = (
                s.q.as_tensor().detach(),
                s.k.as_tensor().detach(),
                s.v.as_tensor().detach(),
            );
            let (out, lse) = opts.forward_with_lse(&q, &k, &v)?;
            Ok((q, k, v, out, lse, s.dout.clone()))
        })
        .collect::<Result<Vec<_>>>()?;
    let t = time_ms_with(dev, PREFILL_TIMING, |i| {
        let (q, k, v, out, lse, dout) = &saved[i % saved.len()];
        opts.backward(q, k, v, out, lse, dout).map(drop)
    })?;
    // CANDLE_FLASH_BENCH_HOST=1: the host's time per call beside the device's (a host that
    // waits for the device somewhere shows as host ms close to ms).
    if std::env::var("CANDLE_FLASH_BENCH_HOST").is_ok_and(|v| v == "1") {
        println!(
            "# bwd host {:.3} ms per call, {:.3} ms with the device",
            t.host_ms, t.ms
        );
    }
    Ok(t.ms)
}

/// Backward alone through Candle's autograd: one graph per input set is built once and its
/// backward re-run (like torch's `retain_graph=True`). Includes Candle's per-gradient
/// zeros_like + add, measured separately by [`time_autograd_overhead`].
fn time_bwd(dev: &Device, sets: &[Inputs], attn: &Attn) -> Result<f64> {
    let losses = sets
        .iter()
        .map(|s| grad_loss(&attn(&s.q, &s.k, &s.v, true)?, &s.dout))
        .collect::<Result<Vec<_>>>()?;
    time_ms(dev, |i| losses[i % losses.len()].backward().map(drop))
}

fn time_fwd_bwd(dev: &Device, sets: &[Inputs], attn: &Attn) -> Result<f64> {
    time_ms(dev, |i| {
        let s = &sets[i % sets.len()];
        grad_loss(&attn(&s.q, &s.k, &s.v, true)?, &s.dout)?
            .backward()
            .map(drop)
    })
}

/// The same backward as [`time_bwd`] with the attention kernel taken out: what Candle's
/// autograd itself costs around it.
fn time_autograd_overhead(dev: &Device, sets: &[Inputs]) -> Result<f64> {
    let losses = sets
        .iter()
        .map(|s| grad_loss(&s.q.apply_op3(&s.k, &s.v, FixedGrads)?, &s.dout))
        .collect::<Result<Vec<_>>>()?;
    time_ms(dev, |i| losses[i % losses.len()].backward().map(drop))
}

/// Median milliseconds per call of `step(i)`, i = 0, 1, 2, ... Each repetition runs enough
/// calls to last >= TARGET_MS, with the device synchronised at both ends, so that launch
/// overhead overlaps GPU work as it would in a model.
fn time_ms(dev: &Device, step: impl FnMut(usize) -> Result<()>) -> Result<f64> {
    Ok(time_ms_with(dev, PREFILL_TIMING, step)?.ms)
}

/// Milliseconds per call, medians over the repetitions.
#[derive(Clone, Copy)]
struct Timed {
    /// Per call, the device synchronised at both ends of each repetition.
    ms: f64,
    /// Per call, until the host had queued the repetition's calls (before the final
    /// synchronisation). About `ms` when the host (launches, allocations, copies of the
    /// lengths) rather than the GPU is the bottleneck, or when the launch queue is full.
    host_ms: f64,
}

/// [`time_ms`] with the warm-up, calibration, iteration cap and repetitions of `timing`.
fn time_ms_with(
    dev: &Device,
    timing: Timing,
    mut step: impl FnMut(usize) -> Result<()>,
) -> Result<Timed> {
    for i in 0..timing.warmup {
        step(i)?;
    }
    dev.synchronize()?;
    let calib = timing.calib.max(1);
    let t = Instant::now();
    for i in 0..calib {
        step(i)?;
    }
    dev.synchronize()?;
    let once_ms = t.elapsed().as_secs_f64() * 1e3 / calib as f64;
    let iters = ((TARGET_MS / once_ms.max(1e-3)).ceil() as usize).clamp(1, timing.max_iters);
    let repeats = timing.repeats.max(1);
    let (mut samples, mut host) = (Vec::with_capacity(repeats), Vec::with_capacity(repeats));
    for _ in 0..repeats {
        let t = Instant::now();
        for i in 0..iters {
            step(i)?;
        }
        host.push(t.elapsed().as_secs_f64() * 1e3 / iters as f64);
        dev.synchronize()?;
        samples.push(t.elapsed().as_secs_f64() * 1e3 / iters as f64);
    }
    Ok(Timed {
        ms: median(samples),
        host_ms: median(host),
    })
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Runs a measurement, turning errors (unsupported shape, backward not implemented, out of
/// memory) and panics into the error's first line, so that one failure costs one row.
/// The forward and the direct backward of `opts` on `sets`, timed: `[("fwd", ms), ("bwd", ms)]`.
fn time_option_passes(
    dev: &Device,
    sets: &[Inputs],
    opts: &FlashAttn,
    fwd_only: bool,
) -> Vec<(&'static str, std::result::Result<f64, String>)> {
    let attn = |q: &Tensor, k: &Tensor, v: &Tensor, _train: bool| opts.forward(q, k, v);
    let mut passes = vec![("fwd", try_time(|| time_fwd(dev, sets, &attn)))];
    if !fwd_only {
        passes.push(("bwd", try_time(|| time_bwd_direct(dev, sets, opts))));
    }
    passes
}

/// The baseline of a `--mods-only` or `--sparse-only` line, timed again right before it (ms
/// per pass, `None` where it failed): at its power limit the card's clock moves by up to a
/// fifth from one second to the next, so a variant compares only with a baseline timed beside
/// it (docs/archive/PERF.md, "The bench's "vs plain" and the card's power limit").
fn baseline_passes(
    dev: &Device,
    sets: &[Inputs],
    opts: &FlashAttn,
    fwd_only: bool,
) -> Vec<Option<f64>> {
    time_option_passes(dev, sets, opts, fwd_only)
        .into_iter()
        .map(|(_, ms)| ms.ok())
        .collect()
}

fn try_time(f: impl FnOnce() -> Result<f64>) -> std::result::Result<f64, String> {
    match try_run(f)? {
        ms if ms.is_finite() && ms > 0.0 => Ok(ms),
        ms => Err(format!("bad timing {ms}")),
    }
}

/// Runs `f`, turning an error or a panic into its first line.
fn try_run<T>(f: impl FnOnce() -> Result<T>) -> std::result::Result<T, String> {
    match panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(x)) => Ok(x),
        Ok(Err(e)) => Err(first_line(&e)),
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            Err(format!("panicked: {}", first_line(&msg)))
        }
    }
}

fn first_line(e: &dyn fmt::Display) -> String {
    let text = e.to_string();
    text.lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("(no message)")
        .trim()
        .to_string()
}

/// A scalar loss whose gradient with respect to `out` is exactly `dout`.
///
/// The usual `(out * dout).sum_all()` would add a multiply, a broadcast and their gradients
/// (several memory-bound passes over `out`) to every backward; this adds only the one
/// zeros_like + add that Candle spends on any gradient.
fn grad_loss(out: &Tensor, dout: &Tensor) -> Result<Tensor> {
    out.apply_op1(GradInject(dout.clone()))
}

/// See [`grad_loss`]: forward gives a scalar zero, backward hands back the stored gradient.
struct GradInject(Tensor);

impl CustomOp1 for GradInject {
    fn name(&self) -> &'static str {
        "grad-inject"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((CpuStorage::F32(vec![0.0]), Shape::from(())))
    }

    fn cuda_fwd(&self, storage: &CudaStorage, _: &Layout) -> Result<(CudaStorage, Shape)> {
        let scalar = Shape::from(());
        Ok((storage.device().zeros_impl(&scalar, DType::F32)?, scalar))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, _grad: &Tensor) -> Result<Option<Tensor>> {
        if arg.shape() != self.0.shape() || arg.dtype() != self.0.dtype() {
            bail!(
                "grad-inject: gradient {:?} does not match output {:?}",
                self.0,
                arg
            )
        }
        Ok(Some(self.0.clone()))
    }
}

/// Stands in for the attention op in [`time_autograd_overhead`]: forward gives zeros shaped
/// like q, backward returns q, k and v themselves as gradients, computing nothing.
struct FixedGrads;

impl CustomOp3 for FixedGrads {
    fn name(&self) -> &'static str {
        "fixed-grads"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Ok((
            s1.device().zeros_impl(l1.shape(), s1.dtype())?,
            l1.shape().clone(),
        ))
    }

    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        _: &CudaStorage,
        _: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        Ok((
            s1.device().zeros_impl(l1.shape(), s1.dtype())?,
            l1.shape().clone(),
        ))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _out: &Tensor,
        _grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        Ok((Some(q.detach()), Some(k.detach()), Some(v.detach())))
    }
}

/// Candle's own attention, written as a Candle model would: heads-first copies, K/V heads
/// repeated for GQA, q·kᵀ, additive causal mask, softmax, ·v, back to (b, s, h, d).
fn naive_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    train: bool,
) -> Result<Tensor> {
    let (_, _, heads, hd) = q.dims4()?;
    let n_rep = heads / k.dim(2)?;
    let q = (q.transpose(1, 2)?.contiguous()? * (1.0 / (hd as f64).sqrt()))?;
    let k = repeat_kv(&k.transpose(1, 2)?.contiguous()?, n_rep)?;
    let v = repeat_kv(&v.transpose(1, 2)?.contiguous()?, n_rep)?;
    let mut scores = q.matmul(&k.t()?)?;
    if let Some(mask) = mask {
        scores = scores.broadcast_add(mask)?;
    }
    // The fused softmax is what inference uses, but it has no backward; training needs the
    // composite one.
    let probs = if train {
        candle_nn::ops::softmax(&scores, D::Minus1)?
    } else {
        candle_nn::ops::softmax_last_dim(&scores)?
    };
    probs.matmul(&v)?.transpose(1, 2)?.contiguous()
}

/// (b, hk, s, d) -> (b, hk·n_rep, s, d), query head h reading K/V head h / n_rep
/// (candle-transformers' `repeat_kv`).
fn repeat_kv(x: &Tensor, n_rep: usize) -> Result<Tensor> {
    if n_rep == 1 {
        return Ok(x.clone());
    }
    let (b, hk, s, d) = x.dims4()?;
    Tensor::cat(&vec![x; n_rep], 2)?.reshape((b, hk * n_rep, s, d))
}

/// (s, s) additive mask: 0 where key <= query, -inf above the diagonal.
fn causal_mask(s: usize, dtype: DType, dev: &Device) -> Result<Tensor> {
    let idx = Tensor::arange(0u32, s as u32, dev)?;
    let above = idx.unsqueeze(0)?.broadcast_gt(&idx.unsqueeze(1)?)?;
    let neg_inf = Tensor::new(f32::NEG_INFINITY, dev)?
        .to_dtype(dtype)?
        .broadcast_as((s, s))?;
    above.where_cond(&neg_inf, &Tensor::zeros((s, s), dtype, dev)?)
}

/// The device address of `t`'s first element, for `CANDLE_FLASH_BENCH_ADDRS=1` (None on the
/// CPU or without the cuda feature).
#[cfg(feature = "cuda")]
fn device_addr(t: &Tensor) -> Option<u64> {
    use candle::cuda_backend::cudarc::driver::DevicePtr;
    use candle::Storage;
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*storage else {
        return None;
    };
    let stream = cs.device.cuda_stream();
    let elem = t.dtype().size_in_bytes() as u64;
    let base = match t.dtype() {
        DType::BF16 => cs.as_cuda_slice::<half::bf16>().ok()?.device_ptr(&stream).0,
        DType::F16 => cs.as_cuda_slice::<half::f16>().ok()?.device_ptr(&stream).0,
        DType::F32 => cs.as_cuda_slice::<f32>().ok()?.device_ptr(&stream).0,
        _ => return None,
    };
    Some(base + layout.start_offset() as u64 * elem)
}

#[cfg(not(feature = "cuda"))]
fn device_addr(_: &Tensor) -> Option<u64> {
    None
}

#[cfg(feature = "cuda")]
fn gpu_name(dev: &Device) -> Option<String> {
    let Device::Cuda(d) = dev else { return None };
    d.cuda_stream().context().name().ok()
}

#[cfg(not(feature = "cuda"))]
fn gpu_name(_: &Device) -> Option<String> {
    None
}

/// Times `cuMemcpyDtoDAsync` of `COPY_ELEMS` 2-byte elements into a second buffer.
#[cfg(feature = "cuda")]
fn memcpy_timing(dev: &Device) -> Result<Timed> {
    let stream = dev.as_cuda_device()?.cuda_stream();
    let src = stream
        .alloc_zeros::<u16>(COPY_ELEMS)
        .map_err(candle::Error::wrap)?;
    let mut dst = stream
        .alloc_zeros::<u16>(COPY_ELEMS)
        .map_err(candle::Error::wrap)?;
    time_ms_with(dev, PREFILL_TIMING, |_| {
        stream
            .memcpy_dtod(&src, &mut dst)
            .map_err(candle::Error::wrap)
    })
}

#[cfg(not(feature = "cuda"))]
fn memcpy_timing(_dev: &Device) -> Result<Timed> {
    candle::bail!("the copy bandwidth needs the cuda feature")
}
