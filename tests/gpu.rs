//! The GPU test suite: one binary (`harness = false`), run on the lent GPU by
//! `scripts/gpu-suite.sh`. It prints one line per failure and a closing summary
//! `gpu: N passed, N failed`. Built without the `cuda` feature, or run without a GPU, it prints
//! an explicit SKIPPED line and exits 0.
//!
//! Accuracy rule (FlashAttention's): against an f32 reference computed from the same
//! low-precision inputs, our max error is at most 2x the max error of the same math
//! (`attention_slow`) done in f16/bf16, plus 1e-5.
//!
//! Flags: `--quick` runs a reduced grid (for compute-sanitizer).

#[cfg(not(feature = "cuda"))]
fn main() {
    println!(
        "gpu: SKIPPED: built without the `cuda` feature (cargo test --release --features cuda)"
    );
    println!("gpu: 0 passed, 0 failed, 1 skipped");
}

#[cfg(feature = "cuda")]
fn main() -> std::process::ExitCode {
    cuda_suite::main()
}

#[cfg(feature = "cuda")]
mod cuda_suite {
    use std::process::ExitCode;
    use std::time::Instant;

    use candle::{DType, Device, Result, Tensor, D};
    use candle_flash::{attention_slow, flash_attn, FlashAttn};

    /// Counts results and prints failures as they happen.
    #[derive(Default)]
    struct Suite {
        passed: usize,
        failed: usize,
    }

    impl Suite {
        fn record(&mut self, name: &str, result: Result<()>) {
            match result {
                Ok(()) => self.passed += 1,
                Err(e) => {
                    self.failed += 1;
                    let first_line = e.to_string().lines().next().unwrap_or_default().to_string();
                    println!("FAIL {name}: {first_line}");
                }
            }
        }
    }

    #[derive(Clone, Copy, Debug)]
    struct Case {
        dtype: DType,
        b: usize,
        sq: usize,
        sk: usize,
        h: usize,
        hk: usize,
        d: usize,
        causal: bool,
    }

    impl std::fmt::Display for Case {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(
                f,
                "{:?} b={} sq={} sk={} h={}/{} d={} causal={}",
                self.dtype, self.b, self.sq, self.sk, self.h, self.hk, self.d, self.causal
            )
        }
    }

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
        let a = a.to_dtype(DType::F32)?;
        let b = b.to_dtype(DType::F32)?;
        a.sub(&b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
    }

    fn has_nan(t: &Tensor) -> Result<bool> {
        let t = t.to_dtype(DType::F32)?.flatten_all()?;
        let n = t
            .ne(&t)?
            .to_dtype(DType::F32)?
            .sum_all()?
            .to_scalar::<f32>()?;
        Ok(n > 0.0)
    }

    /// Row log-sum-exp of the masked, scaled scores in plain f32 ops: `(b, h, sq)`.
    fn lse_reference(q: &Tensor, k: &Tensor, scale: f32, causal: bool) -> Result<Tensor> {
        let (_, sq, h, _) = q.dims4()?;
        let (_, sk, hk, _) = k.dims4()?;
        let q = q.to_dtype(DType::F32)?.transpose(1, 2)?.contiguous()?;
        let k = k.to_dtype(DType::F32)?.transpose(1, 2)?.contiguous()?;
        let k = repeat_kv(&k, h / hk)?;
        let s = (q.matmul(&k.t()?)? * scale as f64)?;
        let s = if causal {
            let offset = sk as i64 - sq as i64;
            let mask: Vec<f32> = (0..sq)
                .flat_map(|i| {
                    (0..sk).map(move |j| {
                        if j as i64 <= i as i64 + offset {
                            0.0
                        } else {
                            f32::NEG_INFINITY
                        }
                    })
                })
                .collect();
            let mask = Tensor::from_vec(mask, (sq, sk), q.device())?;
            s.broadcast_add(&mask)?
        } else {
            s
        };
        let m = s.max_keepdim(D::Minus1)?;
        // Rows that see no key: m = -inf; keep them -inf without NaN.
        let m_safe = m.clamp(-1e30f32, f32::INFINITY)?;
        let l = s.broadcast_sub(&m_safe)?.exp()?.sum_keepdim(D::Minus1)?;
        l.log()?.add(&m_safe)?.squeeze(D::Minus1)
    }

    fn repeat_kv(x: &Tensor, n: usize) -> Result<Tensor> {
        if n == 1 {
            return Ok(x.clone());
        }
        let (b, hk, s, d) = x.dims4()?;
        x.unsqueeze(2)?
            .expand((b, hk, n, s, d))?
            .reshape((b, hk * n, s, d))
    }

    fn check_lse(lse: &Tensor, reference: &Tensor) -> Result<()> {
        let a = lse.flatten_all()?.to_vec1::<f32>()?;
        let b = reference.flatten_all()?.to_vec1::<f32>()?;
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            let ok = if y.is_infinite() {
                x == y
            } else {
                (x - y).abs() <= 2e-3 * y.abs().max(1.0)
            };
            if !ok {
                candle::bail!("lse[{i}] = {x}, reference {y}");
            }
        }
        Ok(())
    }

    fn fwd_case(dev: &Device, c: Case) -> Result<()> {
        let q = Tensor::randn(0f32, 1.0, (c.b, c.sq, c.h, c.d), dev)?.to_dtype(c.dtype)?;
        let k = Tensor::randn(0f32, 1.0, (c.b, c.sk, c.hk, c.d), dev)?.to_dtype(c.dtype)?;
        let v = Tensor::randn(0f32, 1.0, (c.b, c.sk, c.hk, c.d), dev)?.to_dtype(c.dtype)?;
        let scale = 1.0 / (c.d as f32).sqrt();
        let (out, lse) = FlashAttn::new()
            .causal(c.causal)
            .forward_with_lse(&q, &k, &v)?;
        if out.dims() != [c.b, c.sq, c.h, c.d] || out.dtype() != c.dtype {
            candle::bail!("output {:?} {:?}", out.dims(), out.dtype());
        }
        if has_nan(&out)? {
            candle::bail!("output has NaN (unwritten or bad math)");
        }
        let f32_of = |t: &Tensor| t.to_dtype(DType::F32);
        let reference = attention_slow(&f32_of(&q)?, &f32_of(&k)?, &f32_of(&v)?, scale, c.causal)?;
        let low = attention_slow(&q, &k, &v, scale, c.causal)?;
        let ours = max_abs_diff(&out, &reference)?;
        let base = max_abs_diff(&low, &reference)?;
        if ours > 2.0 * base + 1e-5 {
            candle::bail!(
                "max error {ours:.3e} > 2 x {base:.3e} (attention_slow in {:?}) + 1e-5",
                c.dtype
            );
        }
        check_lse(&lse, &lse_reference(&q, &k, scale, c.causal)?)
    }

    /// The forward grid of DESIGN.md: every head dim, both dtypes, causal or not, seqlens with
    /// tails and both seq_q < seq_k and seq_q > seq_k, MHA/GQA/MQA.
    fn fwd_grid(quick: bool) -> Vec<Case> {
        let dims: &[usize] = if quick {
            &[40, 128, 256]
        } else {
            &[32, 40, 64, 96, 128, 160, 192, 256]
        };
        let seqs: &[(usize, usize)] = if quick {
            &[(1, 17), (113, 203), (203, 113)]
        } else {
            &[
                (1, 1),
                (17, 17),
                (113, 203),
                (203, 113),
                (128, 128),
                (256, 256),
                (1, 1023),
                (1023, 1024),
                (1024, 1023),
                (2048, 2048),
                (17, 2048),
                (2048, 17),
            ]
        };
        let heads = [(4, 4), (8, 2), (4, 1)];
        let mut cases = vec![];
        for dtype in [DType::F16, DType::BF16] {
            for &d in dims {
                for causal in [false, true] {
                    for (i, &(sq, sk)) in seqs.iter().enumerate() {
                        let (h, hk) = heads[i % heads.len()];
                        let b = if sq * sk > 1 << 20 { 1 } else { 2 };
                        cases.push(Case {
                            dtype,
                            b,
                            sq,
                            sk,
                            h,
                            hk,
                            d,
                            causal,
                        });
                    }
                }
            }
        }
        cases
    }

    /// Strided inputs: q from a (b, h, s, d) tensor transposed, k and v narrowed along seqlen,
    /// and a row stride that is not a multiple of 8 (copied once by the op).
    fn strided_inputs(dev: &Device) -> Result<()> {
        let (b, s, h, d) = (2, 97, 4, 64);
        let q = Tensor::randn(0f32, 1.0, (b, h, s, d), dev)?
            .to_dtype(DType::BF16)?
            .transpose(1, 2)?;
        let k = Tensor::randn(0f32, 1.0, (b, s + 9, h, d), dev)?
            .to_dtype(DType::BF16)?
            .narrow(1, 9, s)?;
        let v_wide = Tensor::randn(0f32, 1.0, (b, s, h, d + 4), dev)?.to_dtype(DType::BF16)?;
        let v = v_wide.narrow(3, 0, d)?;
        let out = flash_attn(&q, &k, &v, true)?;
        let expected = flash_attn(&q.contiguous()?, &k.contiguous()?, &v.contiguous()?, true)?;
        let diff = max_abs_diff(&out, &expected)?;
        if diff != 0.0 {
            candle::bail!("strided inputs differ from contiguous ones by {diff}");
        }
        Ok(())
    }

    /// 100 runs on the same inputs give bitwise-identical outputs.
    fn repeatable(dev: &Device, runs: usize) -> Result<()> {
        let q = Tensor::randn(0f32, 1.0, (2, 1023, 8, 128), dev)?.to_dtype(DType::BF16)?;
        let k = Tensor::randn(0f32, 1.0, (2, 1023, 2, 128), dev)?.to_dtype(DType::BF16)?;
        let v = Tensor::randn(0f32, 1.0, (2, 1023, 2, 128), dev)?.to_dtype(DType::BF16)?;
        let first = flash_attn(&q, &k, &v, true)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        for run in 1..runs {
            let again = flash_attn(&q, &k, &v, true)?
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            if again
                .iter()
                .zip(&first)
                .any(|(a, b)| a.to_bits() != b.to_bits())
            {
                candle::bail!("run {run} differs from run 0");
            }
        }
        Ok(())
    }

    /// The CPU op (f32 math) agrees with the CUDA backend of `attention_slow`.
    fn cpu_vs_cuda(dev: &Device) -> Result<()> {
        let q = Tensor::randn(0f32, 1.0, (2, 113, 4, 40), dev)?;
        let k = Tensor::randn(0f32, 1.0, (2, 203, 2, 40), dev)?;
        let v = Tensor::randn(0f32, 1.0, (2, 203, 2, 40), dev)?;
        let cpu = Device::Cpu;
        let ours = flash_attn(
            &q.to_device(&cpu)?,
            &k.to_device(&cpu)?,
            &v.to_device(&cpu)?,
            true,
        )?;
        let reference = attention_slow(&q, &k, &v, 1.0 / 40f32.sqrt(), true)?.to_device(&cpu)?;
        let diff = max_abs_diff(&ours, &reference)?;
        if diff > 1e-4 {
            candle::bail!("CPU op vs CUDA attention_slow: max diff {diff}");
        }
        Ok(())
    }

    fn expect_error(result: Result<Tensor>, needle: &str) -> Result<()> {
        match result {
            Ok(_) => candle::bail!("expected an error mentioning {needle:?}, got Ok"),
            Err(e) if e.to_string().contains(needle) => Ok(()),
            Err(e) => candle::bail!("expected an error mentioning {needle:?}, got: {e}"),
        }
    }

    /// Bad input that only a GPU can produce: f32 on CUDA, mixed devices, head_dim % 8 != 0.
    fn cuda_errors(dev: &Device) -> Result<()> {
        let t = |shape: (usize, usize, usize, usize), dt: DType, dev: &Device| {
            Tensor::randn(0f32, 1.0, shape, dev)?.to_dtype(dt)
        };
        let q = t((1, 8, 2, 64), DType::BF16, dev)?;
        let f = t((1, 8, 2, 64), DType::F32, dev)?;
        expect_error(flash_attn(&f, &f, &f, false), "q: dtype F32")?;
        let k_cpu = t((1, 8, 2, 64), DType::BF16, &Device::Cpu)?;
        expect_error(
            flash_attn(&q, &k_cpu, &q, false),
            "k: expected the same device",
        )?;
        let odd = t((1, 8, 2, 36), DType::BF16, dev)?;
        expect_error(flash_attn(&odd, &odd, &odd, false), "multiple of 8")
    }

    pub fn main() -> ExitCode {
        let quick = std::env::args().any(|a| a == "--quick");
        // Every output buffer starts as NaN, so an element a kernel fails to write fails a check.
        std::env::set_var("CANDLE_FLASH_POISON", "1");
        let dev = match Device::new_cuda(0) {
            Ok(dev) => dev,
            Err(e) => {
                println!("gpu: SKIPPED: no CUDA device ({e})");
                println!("gpu: 0 passed, 0 failed, 1 skipped");
                return ExitCode::SUCCESS;
            }
        };
        let mut suite = Suite::default();
        let start = Instant::now();

        let grid = fwd_grid(quick);
        let n = grid.len();
        for c in grid {
            suite.record(&format!("fwd {c}"), fwd_case(&dev, c));
        }
        println!(
            "fwd grid: {n} cases, {} failed so far ({:.1}s)",
            suite.failed,
            start.elapsed().as_secs_f32()
        );
        suite.record("strided inputs", strided_inputs(&dev));
        suite.record(
            "repeatable forward",
            repeatable(&dev, if quick { 3 } else { 100 }),
        );
        suite.record("cpu op vs cuda attention_slow", cpu_vs_cuda(&dev));
        suite.record("cuda input errors", cuda_errors(&dev));

        println!("elapsed {:.1}s", start.elapsed().as_secs_f32());
        println!("gpu: {} passed, {} failed", suite.passed, suite.failed);
        if suite.failed == 0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }
    }
}
