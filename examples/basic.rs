//! The smallest useful program: causal GQA attention with `flash_attn`, checked against the
//! plain-ops oracle, then one backward pass.
//!
//! `cargo run --release --example basic` runs on the CPU; built with `--features cuda` it
//! runs on GPU 0 in bf16 when one is present.

use anyhow::Result;
use candle::{DType, Device, Tensor, Var};
use candle_flash::{attention_slow, flash_attn};

fn main() -> Result<()> {
    let (device, dtype) = match Device::cuda_if_available(0)? {
        Device::Cpu => (Device::Cpu, DType::F32),
        gpu => (gpu, DType::BF16),
    };
    let (batch, seqlen, heads, heads_kv, head_dim) = (2, 256, 8, 2, 64);
    println!("device {device:?}, dtype {dtype:?}");
    println!("q: ({batch}, {seqlen}, {heads}, {head_dim}), k and v: ({batch}, {seqlen}, {heads_kv}, {head_dim})");

    let randn =
        |h| Tensor::randn(0f32, 1.0, (batch, seqlen, h, head_dim), &device)?.to_dtype(dtype);
    let q = Var::from_tensor(&randn(heads)?)?;
    let k = Var::from_tensor(&randn(heads_kv)?)?;
    let v = Var::from_tensor(&randn(heads_kv)?)?;

    let out = flash_attn(&q, &k, &v, true)?;
    let reference = attention_slow(&q, &k, &v, 1.0 / (head_dim as f32).sqrt(), true)?;
    let diff = (out.to_dtype(DType::F32)? - reference.to_dtype(DType::F32)?)?
        .abs()?
        .max_all()?
        .to_scalar::<f32>()?;
    println!(
        "out: {:?}, max |flash_attn - attention_slow| = {diff:.2e}",
        out.dims()
    );

    let loss = out.to_dtype(DType::F32)?.sqr()?.mean_all()?;
    let grads = loss.backward()?;
    for (name, var) in [("q", &q), ("k", &k), ("v", &v)] {
        let g = grads
            .get(var)
            .ok_or_else(|| anyhow::anyhow!("no gradient for {name}"))?;
        let norm = g
            .to_dtype(DType::F32)?
            .sqr()?
            .sum_all()?
            .sqrt()?
            .to_scalar::<f32>()?;
        println!("d{name}: {:?}, norm {norm:.4}", g.dims());
    }
    Ok(())
}
