//! candle-flash-attn 0.11.1's forward timed on the grid of benches/attention/, the same way
//! (three rotating input sets, warm-up, calibrated iterations, median of 7, freed memory kept in
//! CUDA's pool), for the same-run comparison of docs/archive/bench-h200-s15.md. Not part of the crate:
//! build it in a scratch directory outside this repository (its binary stays out of it too):
//!
//! ```toml
//! [package]
//! name = "cfa-bench"
//! version = "0.1.0"
//! edition = "2021"
//! [dependencies]
//! candle-flash-attn = "0.11.1"
//! candle-core = { version = "0.11.1", features = ["cuda"] }
//! # for `retain_freed_device_memory`, the pool setting our bench runs under
//! candle-flash = { path = "PATH/TO/THIS/REPOSITORY", features = ["cuda"] }
//! ```
//!
//! with this file as src/main.rs, `CUDA_COMPUTE_CAP=90 cargo build --release` (CUTLASS from the
//! cudaforge cache: ../shared/GPU.md). A full build takes ~2 hours on 2 cores; a local copy of
//! the crate (`[patch.crates-io]`) whose kernel files other than the bf16 head dim 64/128/256
//! ones had their launch call emptied (only those are called) built in 41 minutes.
//! Prints JSON records for scripts/bench/compare.py (impl "candle-flash-attn", pass "fwd").
use candle_core::{DType, Device, Tensor};
use std::time::Instant;

fn main() -> candle_core::Result<()> {
    let dev = Device::new_cuda(0)?;
    candle_flash::train::retain_freed_device_memory(&dev)?;
    let mut cases = vec![];
    for hd in [64usize, 128, 256] {
        for seqlen in [512usize, 1024, 2048, 4096, 8192, 16384] {
            for causal in [false, true] {
                cases.push((hd, seqlen, 2048 / hd, 2048 / hd, causal));
            }
        }
    }
    for seqlen in [2048usize, 8192] {
        for causal in [false, true] {
            cases.push((128, seqlen, 32, 8, causal));
        }
    }
    let mut records = vec![];
    for (hd, seqlen, h, hk, causal) in cases {
        let b = 16384 / seqlen;
        let sets: Vec<(Tensor, Tensor, Tensor)> = (0..3)
            .map(|_| -> candle_core::Result<_> {
                let r = |heads| {
                    Tensor::randn(0f32, 1.0, (b, seqlen, heads, hd), &dev)?.to_dtype(DType::BF16)
                };
                Ok((r(h)?, r(hk)?, r(hk)?))
            })
            .collect::<candle_core::Result<_>>()?;
        let scale = 1.0 / (hd as f32).sqrt();
        let step = |i: usize| -> candle_core::Result<()> {
            let (q, k, v) = &sets[i % 3];
            candle_flash_attn::flash_attn(q, k, v, scale, causal).map(drop)
        };
        for i in 0..3 {
            step(i)?;
        }
        dev.synchronize()?;
        let t = Instant::now();
        step(0)?;
        dev.synchronize()?;
        let once = t.elapsed().as_secs_f64() * 1e3;
        let iters = ((20.0 / once.max(1e-3)).ceil() as usize).clamp(1, 1000);
        let mut samples = vec![];
        for _ in 0..7 {
            let t = Instant::now();
            for i in 0..iters {
                step(i)?;
            }
            dev.synchronize()?;
            samples.push(t.elapsed().as_secs_f64() * 1e3 / iters as f64);
        }
        samples.sort_by(f64::total_cmp);
        let ms = samples[3];
        let flop = 4.0 * (b * h * seqlen * seqlen * hd) as f64 / if causal { 2.0 } else { 1.0 };
        let tflops = flop / (ms * 1e-3) / 1e12;
        eprintln!("candle-flash-attn fwd hd {hd} seqlen {seqlen} heads {h}/{hk} causal {causal}: {ms:.3} ms {tflops:.1} TFLOP/s");
        records.push(format!(
            "{{\"impl\": \"candle-flash-attn\", \"pass\": \"fwd\", \"hd\": {hd}, \"seqlen\": {seqlen}, \"batch\": {b}, \"heads\": {h}, \"heads_k\": {hk}, \"causal\": {causal}, \"ms\": {ms}, \"tflops\": {tflops}}}"
        ));
    }
    println!("[{}]", records.join(",\n"));
    Ok(())
}
