//! FlashAttention-3's FP8 accuracy experiment (§4.3, "Numerical error"): q, k and v drawn
//! from N(0, 1) with 0.1% of their entries replaced by N(0, 10²) outliers, as trained models'
//! activations have them; each attention variant's RMSE against f64 attention of the
//! unquantized inputs. FP8 rows quantize q, k and v to e4m3 with one scale per tensor, per
//! head or per block of 128 tokens of each head (`quant::fp8_scales`, block quantization);
//! "+ Hadamard" rotates q and k first (`quant::hadamard`, incoherent processing), which
//! leaves the scores unchanged and spreads the outliers over every feature, so the scales
//! fit the bulk of the values better.
//!
//! ```text
//! cargo run --release --example fp8_accuracy
//! cargo run --release --features cuda --example fp8_accuracy -- --device cuda --seqlen 4096
//! ```
//!
//! Options: `--seqlen` (1024 on the CPU, 4096 on CUDA), `--heads` (4), `--head-dim` (128),
//! `--causal`, `--device cpu|cuda`, `--seed` (0). The inputs come from a seeded generator, so
//! a run is reproducible; the f64 reference runs on the CPU.

use anyhow::{bail, Result};
use candle::{DType, Device, Tensor};
use candle_flash::quant::{fp8_scales, hadamard, quantize_fp8, Fp8Scaling, FP8_BLOCK_ROWS};
use candle_flash::{attention_slow, flash_attn, FlashAttn};
use clap::{Parser, ValueEnum};

/// The share of entries replaced by outliers, and the outliers' standard deviation.
const OUTLIER_FRACTION: f64 = 0.001;
const OUTLIER_STD: f64 = 10.0;

#[derive(Clone, Copy, Debug, PartialEq, ValueEnum)]
enum Dev {
    Cpu,
    Cuda,
}

#[derive(Parser, Debug)]
#[command(
    about = "FP8 attention's error against f64 attention: per-tensor, per-head and per-block \
             scales, with and without Hadamard rotation"
)]
struct Args {
    /// Tokens of q, k and v (default: 1024 on the CPU, 4096 on CUDA).
    #[arg(long)]
    seqlen: Option<usize>,
    /// Attention heads (q, k and v alike).
    #[arg(long, default_value_t = 4)]
    heads: usize,
    /// Head dimension (a power of two for the Hadamard rows).
    #[arg(long, default_value_t = 128)]
    head_dim: usize,
    /// Causal mask.
    #[arg(long)]
    causal: bool,
    #[arg(long, value_enum, default_value_t = Dev::Cpu)]
    device: Dev,
    /// Seed of the inputs.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// splitmix64 for uniform bits, Box–Muller for normals: seeded, unlike candle's CPU RNG.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    fn normal(&mut self) -> f64 {
        let (u1, u2) = (self.uniform(), self.uniform());
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// `n` values from N(0, 1), each replaced with probability `OUTLIER_FRACTION` by one
    /// from N(0, OUTLIER_STD²).
    fn with_outliers(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let outlier = self.uniform() < OUTLIER_FRACTION;
                let x = self.normal();
                (if outlier { x * OUTLIER_STD } else { x }) as f32
            })
            .collect()
    }
}

/// The three inputs, `(1, seqlen, heads, head_dim)` f32 on `device`.
struct Inputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
}

/// FP8 attention of the inputs with `scaling`, q and k rotated first if `rotate`.
fn fp8_attention(x: &Inputs, scaling: Fp8Scaling, rotate: bool, causal: bool) -> Result<Tensor> {
    let (q, k) = if rotate {
        (hadamard(&x.q)?, hadamard(&x.k)?)
    } else {
        (x.q.clone(), x.k.clone())
    };
    let (sq, sk, sv) = (
        fp8_scales(&q, scaling)?,
        fp8_scales(&k, scaling)?,
        fp8_scales(&x.v, scaling)?,
    );
    let (q8, k8, v8) = (
        quantize_fp8(&q, &sq, scaling)?,
        quantize_fp8(&k, &sk, scaling)?,
        quantize_fp8(&x.v, &sv, scaling)?,
    );
    Ok(FlashAttn::new()
        .causal(causal)
        .fp8_descales(&sq, &sk, &sv)
        .forward(&q8, &k8, &v8)?)
}

/// Root-mean-square of `out - reference`, in f64 on the CPU.
fn rmse(out: &Tensor, reference: &Tensor) -> Result<f64> {
    let out = out.to_device(&Device::Cpu)?.to_dtype(DType::F64)?;
    let diff = (out - reference)?;
    Ok(diff.sqr()?.mean_all()?.sqrt()?.to_scalar::<f64>()?)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let device = match args.device {
        Dev::Cpu => Device::Cpu,
        Dev::Cuda if cfg!(feature = "cuda") => Device::new_cuda(0)?,
        Dev::Cuda => bail!("--device cuda: this build has no CUDA; add --features cuda"),
    };
    let seqlen = args.seqlen.unwrap_or(match args.device {
        Dev::Cpu => 1024,
        Dev::Cuda => 4096,
    });
    let (h, d) = (args.heads, args.head_dim);
    let shape = (1, seqlen, h, d);

    let mut rng = Rng(args.seed);
    let mut input = || Tensor::from_vec(rng.with_outliers(seqlen * h * d), shape, &Device::Cpu);
    let host = Inputs {
        q: input()?,
        k: input()?,
        v: input()?,
    };
    let on_device = Inputs {
        q: host.q.to_device(&device)?,
        k: host.k.to_device(&device)?,
        v: host.v.to_device(&device)?,
    };
    let f64s = |t: &Tensor| t.to_dtype(DType::F64);
    let scale = 1.0 / (d as f32).sqrt();
    let reference = attention_slow(
        &f64s(&host.q)?,
        &f64s(&host.k)?,
        &f64s(&host.v)?,
        scale,
        args.causal,
    )?;

    let half = |dtype: DType| -> Result<Tensor> {
        let x = &on_device;
        let (q, k, v) = (
            x.q.to_dtype(dtype)?,
            x.k.to_dtype(dtype)?,
            x.v.to_dtype(dtype)?,
        );
        Ok(flash_attn(&q, &k, &v, args.causal)?)
    };
    let fp8 = |scaling, rotate| fp8_attention(&on_device, scaling, rotate, args.causal);
    let mut rows: Vec<(String, Tensor)> = vec![
        ("bf16 (flash_attn)".into(), half(DType::BF16)?),
        ("fp16 (flash_attn)".into(), half(DType::F16)?),
    ];
    let per_block = Fp8Scaling::PerBlock {
        rows: FP8_BLOCK_ROWS,
    };
    let scalings = [
        ("per-tensor", Fp8Scaling::PerTensor),
        ("per-head", Fp8Scaling::PerHead),
        ("per-block", per_block),
    ];
    for (name, scaling) in scalings {
        rows.push((format!("fp8 {name}"), fp8(scaling, false)?));
    }
    // The Walsh-Hadamard matrix exists for powers of two only.
    let rotatable = d.is_power_of_two();
    if rotatable {
        for (name, scaling) in scalings {
            rows.push((format!("fp8 {name} + Hadamard"), fp8(scaling, true)?));
        }
    }
    let errors = rows
        .iter()
        .map(|(name, out)| Ok((name.as_str(), rmse(out, &reference)?)))
        .collect::<Result<Vec<_>>>()?;
    let baseline = errors[2].1;

    let (features, device_name) = match args.device {
        Dev::Cpu => ("", "cpu"),
        Dev::Cuda => (" --features cuda", "cuda"),
    };
    let causal = if args.causal { " --causal" } else { "" };
    println!(
        "cargo run --release{features} --example fp8_accuracy -- --seqlen {seqlen} --heads {h} \
         --head-dim {d}{causal} --device {device_name} --seed {}",
        args.seed
    );
    println!(
        "q, k, v ~ N(0, 1), {}% of entries ~ N(0, {OUTLIER_STD}²); RMSE against f64 attention of \
         the unquantized inputs\n",
        OUTLIER_FRACTION * 100.0
    );
    println!("| method | RMSE | vs fp8 per-tensor |");
    println!("|---|---:|---:|");
    for (name, err) in errors {
        println!("| {name} | {err:.2e} | {:.2}x |", err / baseline);
    }
    if !rotatable {
        println!("\n(no Hadamard rows: head_dim {d} is not a power of two)");
    }
    Ok(())
}
