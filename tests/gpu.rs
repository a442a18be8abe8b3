//! The GPU test suite: one binary (`harness = false`), run on the lent GPU by
//! `scripts/gpu/suite.sh`. It prints one line per failure and a closing summary
//! `gpu: N passed, N failed`. Built without the `cuda` feature (the CPU test run) it prints an
//! explicit SKIPPED line and exits 0; built with it, no CUDA device or no test run is a
//! failure, so a script cannot report success over nothing.
//!
//! Accuracy rule (FlashAttention's): against an f32 reference computed from the same
//! low-precision inputs, our max error is at most 2x the max error of the same math
//! (`attention_slow`) done in f16/bf16, plus 1e-5.
//!
//! Flags: `--quick` runs a reduced grid (for compute-sanitizer); `--only SECTION[,SECTION]`
//! runs only those sections: fwd, bwd, mods (window, softcap, ALiBi), sparse (block-sparse), varlen (varlen,
//! padding, dropout), sinks (attention sinks), kvcache, fp8 (the FP8 KV cache), fp8fwd (the FP8
//! forward), misc
//! (training step, memory, strided inputs, repeatability, CPU vs CUDA, input errors),
//! reliability, train (the fused training ops), property (random configurations over every
//! option, tests/gpu/property.rs); `--sanitize` (scripts/gpu/sanitize.sh, with `--quick`) draws random inputs and
//! computes every reference on the CPU, so that the device runs only our kernels, copies and
//! Candle's element-wise kernels (see `cuda_suite::reference_device`), and shrinks the
//! reliability checks. Each section prints its time.

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

// Declared here rather than inside `cuda_suite`: a `#[path]` inside an inline module is
// relative to tests/cuda_suite/, which does not exist.
#[cfg(feature = "cuda")]
#[path = "gpu/reliability.rs"]
mod reliability;

#[cfg(feature = "cuda")]
#[path = "gpu/varlen_dropout.rs"]
mod varlen_dropout;

#[cfg(feature = "cuda")]
#[path = "gpu/kvcache.rs"]
mod kvcache;

#[cfg(feature = "cuda")]
#[path = "gpu/kvcache_fp8.rs"]
mod kvcache_fp8;

#[cfg(feature = "cuda")]
#[path = "gpu/fwd_fp8.rs"]
mod fwd_fp8;

#[cfg(feature = "cuda")]
#[path = "gpu/block_sparse.rs"]
mod block_sparse;
#[cfg(feature = "cuda")]
#[path = "gpu/mods.rs"]
mod mods;

#[cfg(feature = "cuda")]
#[path = "gpu/deterministic.rs"]
mod deterministic;

#[cfg(feature = "cuda")]
#[path = "gpu/sinks.rs"]
mod sinks;

#[cfg(feature = "cuda")]
#[path = "gpu/property.rs"]
mod property;

#[cfg(feature = "cuda")]
#[path = "gpu/combine.rs"]
mod combine;

// The CPU tests' helpers, for the `train` section's shared checks (tests/common/train.rs)
// and the `property` section's generator (tests/common/property.rs).
#[cfg(feature = "cuda")]
mod common;

#[cfg(feature = "cuda")]
mod cuda_suite {
    use std::process::ExitCode;
    use std::sync::OnceLock;
    use std::time::Instant;

    use candle::{DType, Device, Result, Shape, Tensor, Var, D};
    use candle_flash::{attention_slow, attention_slow_with, flash_attn, FlashAttn, VarLen};

    /// Counts results and prints failures as they happen.
    #[derive(Default)]
    pub(crate) struct Suite {
        pub(crate) passed: usize,
        pub(crate) failed: usize,
    }

    impl Suite {
        pub(crate) fn record(&mut self, name: &str, result: Result<()>) {
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
    pub(crate) struct Case {
        pub(crate) dtype: DType,
        pub(crate) b: usize,
        pub(crate) sq: usize,
        pub(crate) sk: usize,
        pub(crate) h: usize,
        pub(crate) hk: usize,
        pub(crate) d: usize,
        pub(crate) causal: bool,
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

    /// Whether the binary runs under compute-sanitizer (`--sanitize`, from scripts/gpu/sanitize.sh).
    pub(crate) fn sanitize() -> bool {
        static SANITIZE: OnceLock<bool> = OnceLock::new();
        *SANITIZE.get_or_init(|| std::env::args().any(|a| a == "--sanitize"))
    }

    /// Where the references (`attention_slow` in f32 and in low precision, its gradients, the
    /// LSE) are computed: on `dev`, or under `--sanitize` on the CPU. There the device must run
    /// only our kernels, plain copies and Candle's element-wise kernels on inputs and on our
    /// outputs: initcheck does not see cuBLAS's writes (Candle's matmul on CUDA), so every
    /// Candle kernel that read a reference's product was reported (117,504 reports in
    /// `affine_bf16` and `cast_bf16_f32`, none in ours), and those reports would hide ours.
    pub(crate) fn reference_device(dev: &Device) -> Device {
        if sanitize() {
            Device::Cpu
        } else {
            dev.clone()
        }
    }

    /// Attention in the inputs' low precision the way a GPU does it: products and sums
    /// accumulate in f32, and the scores, the probabilities and the output round to the
    /// dtype. The baseline of the accuracy rule at long rows: Candle's CPU sums in bf16
    /// accumulate in bf16, so under `--sanitize` (CPU references) `attention_slow` in bf16
    /// erred by 0.15-0.17 at 4096 keys and let a kernel that loses a 16-key tile pass.
    /// Causal masks are bottom-right aligned; every row must see a key.
    pub(crate) fn attention_low(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scale: f32,
        causal: bool,
    ) -> Result<Tensor> {
        let dtype = q.dtype();
        let round = |t: &Tensor| t.to_dtype(dtype)?.to_dtype(DType::F32);
        let f32_of = |t: &Tensor| t.to_dtype(DType::F32);
        let (_, sq, h, _) = q.dims4()?;
        let (_, sk, hk, _) = k.dims4()?;
        let heads = |t: &Tensor| repeat_kv(&f32_of(t)?.transpose(1, 2)?.contiguous()?, h / hk);
        let q = f32_of(q)?.transpose(1, 2)?.contiguous()?;
        let (k, v) = (heads(k)?, heads(v)?);
        let mut scores = round(&(q.matmul(&k.t()?)? * scale as f64)?)?;
        if causal {
            if sq > sk {
                candle::bail!("attention_low: rows without keys are not modelled");
            }
            scores = scores.broadcast_add(&causal_mask(sq, sk, q.device())?)?;
        }
        let max = scores.max_keepdim(D::Minus1)?.detach();
        let exp = scores.broadcast_sub(&max)?.exp()?;
        let probs = round(&exp.broadcast_div(&exp.sum_keepdim(D::Minus1)?)?)?;
        probs.matmul(&v)?.transpose(1, 2)?.to_dtype(dtype)
    }

    /// `t` where references are computed: `t` itself, or a CPU copy under `--sanitize`.
    pub(crate) fn to_reference(t: &Tensor) -> Result<Tensor> {
        t.to_device(&reference_device(t.device()))
    }

    /// Standard normal values in `dtype` on `dev`. Under `--sanitize` they are drawn on the CPU
    /// and copied, so that no curand kernel runs (see `reference_device`).
    pub(crate) fn randn<S: Into<Shape>>(shape: S, dtype: DType, dev: &Device) -> Result<Tensor> {
        if sanitize() && !dev.is_cpu() {
            Tensor::randn(0f32, 1.0, shape, &Device::Cpu)?
                .to_dtype(dtype)?
                .to_device(dev)
        } else {
            Tensor::randn(0f32, 1.0, shape, dev)?.to_dtype(dtype)
        }
    }

    /// `a` and `b` on one device: as they are, or both on the CPU when they differ (an output
    /// of ours on the GPU against a CPU reference under `--sanitize`).
    pub(crate) fn on_one_device(a: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor)> {
        if a.device().same_device(b.device()) {
            Ok((a.clone(), b.clone()))
        } else {
            Ok((a.to_device(&Device::Cpu)?, b.to_device(&Device::Cpu)?))
        }
    }

    pub(crate) fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
        let (a, b) = on_one_device(a, b)?;
        let a = a.to_dtype(DType::F32)?;
        let b = b.to_dtype(DType::F32)?;
        a.sub(&b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
    }

    /// Elements where `reference` is finite and `ours` is not.
    fn new_non_finite(ours: &Tensor, reference: &Tensor) -> Result<usize> {
        let finite = |t: &Tensor| -> Result<Tensor> {
            // NaN compares false, and so does inf.
            t.to_dtype(DType::F32)?
                .abs()?
                .le(f32::MAX)?
                .to_dtype(DType::F32)
        };
        let (ours, reference) = on_one_device(ours, reference)?;
        let (ours, reference) = (finite(&ours)?, finite(&reference)?);
        let bad = reference
            .mul(&ours.affine(-1.0, 1.0)?)?
            .sum_all()?
            .to_scalar::<f32>()?;
        Ok(bad as usize)
    }

    /// FlashAttention's accuracy rule for one tensor: `ours` has the reference's shape, no
    /// inf/NaN where the f32 `reference` has none, and is at most `factor` times as far from
    /// it as `low` (the same math done in f16/bf16), plus `slack`. Returns the margins.
    pub(crate) fn check_rule(
        what: &str,
        ours: &Tensor,
        low: &Tensor,
        reference: &Tensor,
        factor: f32,
        slack: f32,
    ) -> Result<String> {
        if ours.dims() != reference.dims() {
            candle::bail!(
                "{what}: shape {:?}, expected {:?}",
                ours.dims(),
                reference.dims()
            );
        }
        let bad = new_non_finite(ours, reference)?;
        if bad > 0 {
            candle::bail!("{what}: {bad} inf/NaN values where the f32 reference is finite");
        }
        let err = max_abs_diff(ours, reference)?;
        let base = max_abs_diff(low, reference)?;
        if !base.is_finite() {
            candle::bail!("{what}: the low-precision baseline is not finite ({base}): bad test");
        }
        if err.is_nan() || err > factor * base + slack {
            candle::bail!(
                "{what}: max error {err:.3e} > {factor} x {base:.3e} (the same math in f16/bf16) + {slack:e}"
            );
        }
        Ok(format!("{what} {err:.2e} <= {factor}x{base:.2e}"))
    }

    /// The rule for outputs: 2x + 1e-5.
    pub(crate) fn check_output(
        what: &str,
        ours: &Tensor,
        low: &Tensor,
        reference: &Tensor,
    ) -> Result<()> {
        check_rule(what, ours, low, reference, 2.0, 1e-5).map(|_| ())
    }

    /// The rule for gradients `[dq, dk, dv]`: 3x + 1e-4.
    pub(crate) fn check_grads(ours: &[Tensor], low: &[Tensor], reference: &[Tensor]) -> Result<()> {
        for (i, name) in ["dq", "dk", "dv"].iter().enumerate() {
            check_rule(name, &ours[i], &low[i], &reference[i], 3.0, 1e-4)?;
        }
        Ok(())
    }

    pub(crate) fn has_nan(t: &Tensor) -> Result<bool> {
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
            s.broadcast_add(&causal_mask(sq, sk, q.device())?)?
        } else {
            s
        };
        let m = s.max_keepdim(D::Minus1)?;
        // Rows that see no key: m = -inf; keep them -inf without NaN.
        let m_safe = m.clamp(-1e30f32, f32::INFINITY)?;
        let l = s.broadcast_sub(&m_safe)?.exp()?.sum_keepdim(D::Minus1)?;
        l.log()?.add(&m_safe)?.squeeze(D::Minus1)
    }

    /// The bottom-right aligned causal mask `(sq, sk)` to add to scores: 0 where query i sees
    /// key j (j <= i + sk - sq), -inf elsewhere.
    fn causal_mask(sq: usize, sk: usize, dev: &Device) -> Result<Tensor> {
        let offset = sk as i64 - sq as i64;
        let mask: Vec<f32> = (0..sq as i64)
            .flat_map(|i| {
                (0..sk as i64).map(move |j| {
                    if j <= i + offset {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
            })
            .collect();
        Tensor::from_vec(mask, (sq, sk), dev)
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
                // f32 scores and sums of bf16/f16 inputs: ~1e-6 relative. 2e-4 fails a
                // dropped key among up to ~5000 (its weight shifts the LSE by ~1/n).
                (x - y).abs() <= 2e-4 * y.abs().max(1.0)
            };
            if !ok {
                candle::bail!("lse[{i}] = {x}, reference {y}");
            }
        }
        Ok(())
    }

    fn fwd_case(dev: &Device, c: Case) -> Result<()> {
        let q = randn((c.b, c.sq, c.h, c.d), c.dtype, dev)?;
        let k = randn((c.b, c.sk, c.hk, c.d), c.dtype, dev)?;
        let v = randn((c.b, c.sk, c.hk, c.d), c.dtype, dev)?;
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
        let (q, k, v) = (to_reference(&q)?, to_reference(&k)?, to_reference(&v)?);
        let f32_of = |t: &Tensor| t.to_dtype(DType::F32);
        let reference = attention_slow(&f32_of(&q)?, &f32_of(&k)?, &f32_of(&v)?, scale, c.causal)?;
        let low = attention_slow(&q, &k, &v, scale, c.causal)?;
        check_output("out", &out, &low, &reference)?;
        check_lse(&lse, &lse_reference(&q, &k, scale, c.causal)?)
    }

    /// Every dtype x head dim x mask x seqlen pair, cycling MHA / GQA / MQA over the seqlen
    /// pairs; batch 2, or 1 where seq_q * seq_k exceeds `big` (to bound the reference's memory).
    fn grid(dims: &[usize], seqs: &[(usize, usize)], big: usize) -> Vec<Case> {
        let heads = [(4, 4), (8, 2), (4, 1)];
        let mut cases = vec![];
        for dtype in [DType::F16, DType::BF16] {
            for &d in dims {
                for causal in [false, true] {
                    for (i, &(sq, sk)) in seqs.iter().enumerate() {
                        let (h, hk) = heads[i % heads.len()];
                        let b = if sq * sk > big { 1 } else { 2 };
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

    /// The forward grid of DESIGN.md: every head dim, both dtypes, causal or not, seqlens with
    /// tails and both seq_q < seq_k and seq_q > seq_k, MHA/GQA/MQA.
    fn fwd_grid(quick: bool) -> Vec<Case> {
        // 160, 192 and 208: the 160, 192 and 224 classes, on the d = 256 warp-specialized
        // kernel on Hopper (160: a 64-column panel entirely past the head dim, in the quick
        // grid too, which the sanitizers run).
        let dims: &[usize] = if quick {
            &[40, 128, 160, 256]
        } else {
            &[32, 40, 64, 80, 96, 128, 160, 192, 208, 256]
        };
        let seqs: &[(usize, usize)] = if quick {
            // (2048, 300): d = 64 non-causal takes the three-warpgroup wgmma kernel from 1k on.
            &[(1, 17), (113, 203), (203, 113), (2048, 300)]
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
        let mut cases = grid(dims, seqs, 1 << 20);
        if !quick {
            // Past the short-sequence shapes of the wgmma forward (Sm90Tile::shape): d = 64
            // non-causal from 4k takes three warpgroups, d = 128 causal past 2k two.
            cases.extend(grid(&[64, 128], &[(4096, 4001), (4001, 4096)], 1 << 20));
            // Offsets of 64 between query and key lengths: under the causal mask the second
            // warpgroup's rows see half of a 128-key tile that the first one's cannot see.
            cases.extend(grid(&[64, 128], &[(1024, 1088), (1088, 1024)], 1 << 20));
        }
        cases
    }

    /// Strided inputs: q from a (b, h, s, d) tensor transposed, k and v narrowed along seqlen,
    /// and a row stride that is not a multiple of 8 (copied once by the op).
    fn strided_inputs(dev: &Device) -> Result<()> {
        let (b, s, h, d) = (2, 97, 4, 64);
        let q = randn((b, h, s, d), DType::BF16, dev)?.transpose(1, 2)?;
        let k = randn((b, s + 9, h, d), DType::BF16, dev)?.narrow(1, 9, s)?;
        let v_wide = randn((b, s, h, d + 4), DType::BF16, dev)?;
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
        let q = randn((2, 1023, 8, 128), DType::BF16, dev)?;
        let k = randn((2, 1023, 2, 128), DType::BF16, dev)?;
        let v = randn((2, 1023, 2, 128), DType::BF16, dev)?;
        let first = tensor_bits(&flash_attn(&q, &k, &v, true)?)?;
        for run in 1..runs {
            if tensor_bits(&flash_attn(&q, &k, &v, true)?)? != first {
                candle::bail!("run {run} differs from run 0");
            }
        }
        Ok(())
    }

    /// The CPU op (f32 math) agrees with `attention_slow` on the GPU (on the CPU under
    /// `--sanitize`, see `reference_device`).
    fn cpu_vs_cuda(dev: &Device) -> Result<()> {
        let q = randn((2, 113, 4, 40), DType::F32, dev)?;
        let k = randn((2, 203, 2, 40), DType::F32, dev)?;
        let v = randn((2, 203, 2, 40), DType::F32, dev)?;
        let cpu = Device::Cpu;
        let ours = flash_attn(
            &q.to_device(&cpu)?,
            &k.to_device(&cpu)?,
            &v.to_device(&cpu)?,
            true,
        )?;
        let (q, k, v) = (to_reference(&q)?, to_reference(&k)?, to_reference(&v)?);
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
        let t =
            |shape: (usize, usize, usize, usize), dt: DType, dev: &Device| randn(shape, dt, dev);
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

    /// Every element's bits (through f32, exact for f16 and bf16), for bitwise comparisons.
    pub(crate) fn tensor_bits(t: &Tensor) -> Result<Vec<u32>> {
        let host = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        Ok(host.into_iter().map(f32::to_bits).collect())
    }

    /// The bits of several tensors, one after the other.
    pub(crate) fn tensors_bits<'a>(ts: impl IntoIterator<Item = &'a Tensor>) -> Result<Vec<u32>> {
        let mut all = vec![];
        for t in ts {
            all.extend(tensor_bits(t)?);
        }
        Ok(all)
    }

    /// Gradients of `sum(out * w)` for q, k, v through `attn`, in the inputs' dtype.
    pub(crate) fn grads_of(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        w: &Tensor,
        attn: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<[Tensor; 3]> {
        let (q, k, v) = (
            Var::from_tensor(q)?,
            Var::from_tensor(k)?,
            Var::from_tensor(v)?,
        );
        let out = attn(q.as_tensor(), k.as_tensor(), v.as_tensor())?;
        let grads = out.mul(&w.to_dtype(out.dtype())?)?.sum_all()?.backward()?;
        let get = |x: &Var, name: &str| match grads.get(x.as_tensor()) {
            Some(g) => Ok(g.clone()),
            None => candle::bail!("no gradient for {name}"),
        };
        Ok([get(&q, "q")?, get(&k, "k")?, get(&v, "v")?])
    }

    /// Our output and gradients of `sum(out * w)` (`ours`, for inputs q, k, v, w on the GPU)
    /// against `slow` on the reference device: the output by the 2x rule and the gradients
    /// by the 3x rule, with `slow` in the inputs' dtype as the baseline and in f32 as the
    /// truth. `slow` must take tensors of the reference device (`reference_device`).
    pub(crate) fn check_against_slow(
        out: &Tensor,
        ours: &[Tensor],
        [q, k, v, w]: [&Tensor; 4],
        slow: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
    ) -> Result<()> {
        let (q, k, v, w) = (
            to_reference(q)?,
            to_reference(k)?,
            to_reference(v)?,
            to_reference(w)?,
        );
        let f32_of = |t: &Tensor| t.to_dtype(DType::F32);
        let (q32, k32, v32, w32) = (f32_of(&q)?, f32_of(&k)?, f32_of(&v)?, f32_of(&w)?);
        check_output("out", out, &slow(&q, &k, &v)?, &slow(&q32, &k32, &v32)?)?;
        let reference = grads_of(&q32, &k32, &v32, &w32, &slow)?;
        let low = grads_of(&q, &k, &v, &w, &slow)?;
        check_grads(ours, &low, &reference)
    }

    /// A packed bf16 batch (`lens_q`, `lens_k`; `heads` = (h, hk) of `d`) through
    /// `opts.forward_varlen`, output and gradients, against `attention_slow_with` run on each
    /// sequence alone with `seq_opts(b, len_q, len_k)` (options on the reference device),
    /// concatenated, by [`check_against_slow`]'s rules.
    pub(crate) fn check_varlen_against_slow(
        dev: &Device,
        d: usize,
        (h, hk): (usize, usize),
        (lens_q, lens_k): (&[usize], &[usize]),
        opts: &FlashAttn,
        seq_opts: impl Fn(usize, usize, usize) -> Result<FlashAttn>,
    ) -> Result<()> {
        let dtype = DType::BF16;
        let (tq, tk): (usize, usize) = (lens_q.iter().sum(), lens_k.iter().sum());
        let q = randn((tq, h, d), dtype, dev)?;
        let k = randn((tk, hk, d), dtype, dev)?;
        let v = randn((tk, hk, d), dtype, dev)?;
        let w = randn((tq, h, d), dtype, dev)?;
        let varlen = VarLen::from_seqlens(lens_q, lens_k)?;
        // Both sides on `(1, t, h, d)` tensors, so that the oracle's gradients follow.
        let as4 = |t: &Tensor| t.unsqueeze(0);
        let out = opts.forward_varlen(&q, &k, &v, &varlen)?;
        let ours = grads_of(&as4(&q)?, &as4(&k)?, &as4(&v)?, &as4(&w)?, |q, k, v| {
            opts.forward_varlen(&q.squeeze(0)?, &k.squeeze(0)?, &v.squeeze(0)?, &varlen)?
                .unsqueeze(0)
        })?;
        let per_seq = |q: &Tensor, k: &Tensor, v: &Tensor| -> Result<Tensor> {
            let (mut oq, mut ok, mut outs) = (0, 0, vec![]);
            for (b, (&lq, &lk)) in lens_q.iter().zip(lens_k).enumerate() {
                outs.push(attention_slow_with(
                    &q.narrow(1, oq, lq)?,
                    &k.narrow(1, ok, lk)?,
                    &v.narrow(1, ok, lk)?,
                    &seq_opts(b, lq, lk)?,
                )?);
                (oq, ok) = (oq + lq, ok + lk);
            }
            Tensor::cat(&outs, 1)
        };
        let inputs = [as4(&q)?, as4(&k)?, as4(&v)?, as4(&w)?];
        check_against_slow(
            &as4(&out)?,
            &ours,
            [&inputs[0], &inputs[1], &inputs[2], &inputs[3]],
            per_seq,
        )
    }

    fn bwd_case(dev: &Device, c: Case) -> Result<()> {
        let q = randn((c.b, c.sq, c.h, c.d), c.dtype, dev)?;
        let k = randn((c.b, c.sk, c.hk, c.d), c.dtype, dev)?;
        let v = randn((c.b, c.sk, c.hk, c.d), c.dtype, dev)?;
        let w = randn((c.b, c.sq, c.h, c.d), c.dtype, dev)?;
        let scale = 1.0 / (c.d as f32).sqrt();
        let ours = grads_of(&q, &k, &v, &w, |q, k, v| flash_attn(q, k, v, c.causal))?;
        let (q, k, v, w) = (
            to_reference(&q)?,
            to_reference(&k)?,
            to_reference(&v)?,
            to_reference(&w)?,
        );
        let f32_of = |t: &Tensor| t.to_dtype(DType::F32);
        let reference = grads_of(
            &f32_of(&q)?,
            &f32_of(&k)?,
            &f32_of(&v)?,
            &f32_of(&w)?,
            |q, k, v| attention_slow(q, k, v, scale, c.causal),
        )?;
        let low = grads_of(&q, &k, &v, &w, |q, k, v| {
            attention_slow(q, k, v, scale, c.causal)
        })?;
        for (i, name) in ["dq", "dk", "dv"].iter().enumerate() {
            if ours[i].dims() != reference[i].dims() {
                candle::bail!(
                    "{name} shape {:?}, expected {:?}",
                    ours[i].dims(),
                    reference[i].dims()
                );
            }
            if has_nan(&ours[i])? {
                candle::bail!("{name} has NaN (unwritten or bad math)");
            }
        }
        check_grads(&ours, &low, &reference)
    }

    fn bwd_grid(quick: bool) -> Vec<Case> {
        // 160, 192, 208 and 248: the d = 256 warp-specialized backward with columns past the
        // head dim (TMA's zero fill, the stores' column bounds; at 160 a whole panel).
        let dims: &[usize] = if quick {
            &[40, 128, 160, 256]
        } else {
            &[32, 40, 64, 80, 96, 128, 160, 192, 208, 248, 256]
        };
        let seqs: &[(usize, usize)] = if quick {
            &[(17, 113), (203, 113)]
        } else {
            &[
                (1, 17),
                (17, 17),
                (113, 203),
                (203, 113),
                (128, 128),
                (256, 256),
                (1023, 1024),
                (1024, 1023),
                (2048, 17),
            ]
        };
        grid(dims, seqs, 1 << 18)
    }

    /// The backward is bitwise reproducible (it uses no floating-point atomics).
    fn repeatable_backward(dev: &Device, runs: usize) -> Result<()> {
        let q = randn((2, 777, 8, 128), DType::BF16, dev)?;
        let k = randn((2, 901, 2, 128), DType::BF16, dev)?;
        let v = randn((2, 901, 2, 128), DType::BF16, dev)?;
        let w = randn((2, 777, 8, 128), DType::BF16, dev)?;
        let attn = FlashAttn::new().causal(true).deterministic(true);
        let bits = || tensors_bits(&grads_of(&q, &k, &v, &w, |q, k, v| attn.forward(q, k, v))?);
        let first = bits()?;
        for run in 1..runs {
            if bits()? != first {
                candle::bail!("backward run {run} differs from run 0");
            }
        }
        Ok(())
    }

    /// `FlashAttn::backward` called directly gives autograd's gradients: bit for bit on the
    /// deterministic path, for the wgmma (hd 128, 256) and mma.sync (hd 96) kernels, causal GQA
    /// with seqlen_q != seqlen_k; and with dropout, given the forward's rng_offset.
    fn backward_api(dev: &Device) -> Result<()> {
        for (d, dropout) in [(128, 0.0), (96, 0.0), (64, 0.2), (256, 0.0)] {
            let q = randn((2, 333, 8, d), DType::BF16, dev)?;
            let k = randn((2, 401, 2, d), DType::BF16, dev)?;
            let v = randn((2, 401, 2, d), DType::BF16, dev)?;
            let w = randn((2, 333, 8, d), DType::BF16, dev)?;
            let attn = FlashAttn::new()
                .causal(true)
                .deterministic(true)
                .dropout(dropout)
                .seed(7)
                .rng_offset(11);
            let autograd = grads_of(&q, &k, &v, &w, |q, k, v| attn.forward(q, k, v))?;
            let (out, lse) = attn.forward_with_lse(&q, &k, &v)?;
            let (dq, dk, dv) = attn.backward(&q, &k, &v, &out, &lse, &w)?;
            for (name, ours, theirs) in [
                ("dq", dq, &autograd[0]),
                ("dk", dk, &autograd[1]),
                ("dv", dv, &autograd[2]),
            ] {
                let diff = (ours.to_dtype(DType::F32)? - theirs.to_dtype(DType::F32)?)?
                    .abs()?
                    .max_all()?
                    .to_scalar::<f32>()?;
                if diff != 0.0 {
                    candle::bail!(
                        "d {d} dropout {dropout}: {name} differs from autograd's by up to {diff}"
                    );
                }
            }
        }
        Ok(())
    }

    /// A small model trains on CUDA: gradients reach the projection weights through
    /// flash_attn, and SGD steps lower the loss.
    fn training_step(dev: &Device) -> Result<()> {
        use candle_nn::{Optimizer, SGD};
        let (b, s, h, d) = (2, 67, 4, 32);
        let n = h * d;
        // Kaiming-normal (out, in) weights, as `candle_nn::linear_no_bias` would make them.
        let weights = (0..3)
            .map(|_| {
                let w = (randn((n, n), DType::F32, dev)? * (2.0 / n as f64).sqrt())?;
                Var::from_tensor(&w)
            })
            .collect::<Result<Vec<_>>>()?;
        let x = randn((b, s, n), DType::F32, dev)?;
        let target = randn((b, s, h, d), DType::BF16, dev)?;
        let mut opt = SGD::new(weights.clone(), 0.5)?;
        let loss_of = || -> Result<Tensor> {
            let heads = |i: usize| {
                project(&x, weights[i].as_tensor())?
                    .reshape((b, s, h, d))?
                    .to_dtype(DType::BF16)
            };
            let out = flash_attn(&heads(0)?, &heads(1)?, &heads(2)?, true)?;
            out.sub(&target)?.to_dtype(DType::F32)?.sqr()?.mean_all()
        };
        let first = loss_of()?.to_scalar::<f32>()?;
        for _ in 0..5 {
            let loss = loss_of()?;
            let grads = loss.backward()?;
            for var in &weights {
                match grads.get(var.as_tensor()) {
                    Some(g) if g.abs()?.sum_all()?.to_scalar::<f32>()? > 0.0 => {}
                    _ => candle::bail!("a projection weight got no gradient"),
                }
            }
            opt.step(&grads)?;
        }
        let last = loss_of()?.to_scalar::<f32>()?;
        // NaN must fail too, hence not `last >= first`.
        if last.partial_cmp(&first) != Some(std::cmp::Ordering::Less) {
            candle::bail!("loss did not decrease: {first} -> {last}");
        }
        println!("training step: loss {first:.4} -> {last:.4} after 5 SGD steps");
        Ok(())
    }

    /// `x wᵀ` for x `(b, s, in)` and w `(out, in)`, what `candle_nn::Linear` computes. Under
    /// `--sanitize` as a broadcast product and a sum: a matmul runs cuBLAS, whose output
    /// initcheck does not see written (see `reference_device`), and flash_attn reads it.
    fn project(x: &Tensor, w: &Tensor) -> Result<Tensor> {
        if sanitize() {
            x.unsqueeze(2)?
                .broadcast_mul(&w.unsqueeze(0)?.unsqueeze(0)?)?
                .sum(D::Minus1)
        } else {
            x.broadcast_matmul(&w.t()?)
        }
    }

    /// Device memory in use, sampled every 200 us on another thread while `f` runs; the
    /// peak minus the use before.
    fn peak_extra_memory(dev: &Device, f: impl FnOnce() -> Result<()>) -> Result<usize> {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        use std::sync::Arc;
        let ctx = dev.as_cuda_device()?.cuda_stream().context().clone();
        let used = {
            let ctx = ctx.clone();
            move || {
                ctx.mem_get_info()
                    .map(|(free, total)| total - free)
                    .unwrap_or(0)
            }
        };
        dev.synchronize()?;
        let before = used();
        let (stop, peak) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicUsize::new(before)),
        );
        let sampler = {
            let (stop, peak, used) = (stop.clone(), peak.clone(), used.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    peak.fetch_max(used(), Ordering::Relaxed);
                    std::thread::sleep(std::time::Duration::from_micros(200));
                }
            })
        };
        let result = f().and_then(|_| dev.synchronize());
        peak.fetch_max(used(), Ordering::Relaxed);
        stop.store(true, Ordering::Relaxed);
        let _ = sampler.join();
        result?;
        Ok(peak.load(Ordering::Relaxed).saturating_sub(before))
    }

    /// Forward+backward memory is linear in seqlen (b=1, h=16, d=128 bf16, causal): the peak
    /// beyond the inputs stays within a fixed multiple of the size of q (a seqlen^2 score
    /// buffer would be 8 GiB at 16k and 128 GiB at 64k), and grows ~4x from 16k to 64k.
    fn linear_memory(dev: &Device) -> Result<()> {
        let mut extras = vec![];
        for s in [16384usize, 65536] {
            let (h, d) = (16, 128);
            let mk = || randn((1, s, h, d), DType::BF16, dev);
            let (q, k, v) = (
                Var::from_tensor(&mk()?)?,
                Var::from_tensor(&mk()?)?,
                Var::from_tensor(&mk()?)?,
            );
            let w = mk()?;
            let q_bytes = s * h * d * 2;
            let start = Instant::now();
            let extra = peak_extra_memory(dev, || {
                let out = flash_attn(q.as_tensor(), k.as_tensor(), v.as_tensor(), true)?;
                let grads = out.mul(&w)?.sum_all()?.backward()?;
                for x in [&q, &k, &v] {
                    if grads.get(x.as_tensor()).is_none() {
                        candle::bail!("missing gradient");
                    }
                }
                Ok(())
            })?;
            println!(
                "memory: b=1 h=16 d=128 seqlen {s}: fwd+bwd peak {:.0} MiB beyond inputs ({:.1}x the size of q), {:.2}s",
                extra as f64 / (1 << 20) as f64,
                extra as f64 / q_bytes as f64,
                start.elapsed().as_secs_f32()
            );
            if extra > 16 * q_bytes {
                candle::bail!("seqlen {s}: peak extra memory {extra} B > 16 x q ({q_bytes} B)");
            }
            extras.push(extra as f64);
        }
        let growth = extras[1] / extras[0];
        if growth > 5.0 {
            candle::bail!("memory grew {growth:.1}x from seqlen 16k to 64k (linear is 4x)");
        }
        Ok(())
    }

    pub fn main() -> ExitCode {
        let quick = std::env::args().any(|a| a == "--quick");
        // Every output buffer starts as NaN, so an element a kernel fails to write fails a check.
        std::env::set_var("CANDLE_FLASH_POISON", "1");
        let dev = match Device::new_cuda(0) {
            Ok(dev) => dev,
            Err(e) => {
                println!("gpu: no CUDA device ({e})");
                println!("gpu: 0 passed, 1 failed");
                return ExitCode::FAILURE;
            }
        };
        let sections = match Sections::from_args() {
            Ok(sections) => sections,
            Err(e) => {
                println!("gpu: {e}");
                return ExitCode::FAILURE;
            }
        };
        let mut suite = Suite::default();
        let start = Instant::now();
        for (name, section) in SECTIONS {
            if !sections.run(name) {
                continue;
            }
            let (passed, failed, section_start) = (suite.passed, suite.failed, Instant::now());
            section(&dev, quick, &mut suite);
            // Per section, so that scripts/gpu/sanitize.sh can size its per-section time limit.
            println!(
                "section {name}: {} passed, {} failed, {:.1}s",
                suite.passed - passed,
                suite.failed - failed,
                section_start.elapsed().as_secs_f32()
            );
        }
        println!("elapsed {:.1}s", start.elapsed().as_secs_f32());
        if suite.passed + suite.failed == 0 {
            println!("gpu: no test ran");
            println!("gpu: 0 passed, 1 failed");
            return ExitCode::FAILURE;
        }
        println!("gpu: {} passed, {} failed", suite.passed, suite.failed);
        if suite.failed == 0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }
    }

    type Section = fn(&Device, bool, &mut Suite);

    /// The sections in the order they run; `--only` picks among them.
    const SECTIONS: [(&str, Section); 13] = [
        ("fwd", fwd_section),
        ("bwd", bwd_section),
        ("mods", crate::mods::run),
        ("sparse", crate::block_sparse::run),
        ("varlen", crate::varlen_dropout::run),
        ("sinks", crate::sinks::run),
        ("kvcache", crate::kvcache::run),
        ("fp8", crate::kvcache_fp8::run),
        ("fp8fwd", crate::fwd_fp8::run),
        ("misc", misc_section),
        ("reliability", crate::reliability::run),
        ("train", train_section),
        ("property", crate::property::run),
    ];

    /// The fused training ops (`candle_flash::train`) on the device against plain Candle ops
    /// on the CPU: tests/common/train.rs, plus sizes past one block of every kernel.
    fn train_section(dev: &Device, quick: bool, suite: &mut Suite) {
        let mut report = |name: String, r: Result<()>| suite.record(&format!("train {name}"), r);
        crate::common::train::all(dev, &mut report);
        if !quick {
            crate::common::train::large(dev, &mut report);
        }
    }

    /// The sections `--only` names; all of them without the flag.
    struct Sections(Option<Vec<String>>);

    impl Sections {
        fn from_args() -> std::result::Result<Self, String> {
            let args: Vec<String> = std::env::args().collect();
            let Some(i) = args.iter().position(|a| a == "--only") else {
                return Ok(Self(None));
            };
            let list = args
                .get(i + 1)
                .ok_or("--only needs a comma-separated list of sections")?;
            let names: Vec<String> = list.split(',').map(str::to_string).collect();
            let known: Vec<&str> = SECTIONS.iter().map(|(name, _)| *name).collect();
            if let Some(bad) = names.iter().find(|n| !known.contains(&n.as_str())) {
                return Err(format!(
                    "--only: unknown section {bad:?}, expected one of {known:?}"
                ));
            }
            Ok(Self(Some(names)))
        }

        fn run(&self, name: &str) -> bool {
            self.0
                .as_ref()
                .is_none_or(|names| names.iter().any(|n| n == name))
        }
    }

    fn fwd_section(dev: &Device, quick: bool, suite: &mut Suite) {
        for c in fwd_grid(quick) {
            suite.record(&format!("fwd {c}"), fwd_case(dev, c));
        }
        for c in many_tile_cases() {
            suite.record(&format!("fwd many tiles {c}"), fwd_case(dev, c));
        }
    }

    /// Causal shapes with more work tiles than the H100's and H200's 132 SMs: the Hopper
    /// forward's dynamic walk, whose last heads go query block by query block, heaviest
    /// first (sm90/fwd_ws.cu `WsTile`); a partial last query block, GQA.
    fn many_tile_cases() -> Vec<Case> {
        causal_cases(&[
            // (b, sq, sk, h, hk, d): 128-row tiles
            (4, 1024, 1024, 16, 4, 64),  // 512
            (2, 1000, 1000, 16, 4, 128), // 256
            (2, 1000, 1100, 16, 8, 256), // 256
        ])
    }

    /// Causal shapes with more than two waves of key blocks on 132 SMs: the Hopper backward's
    /// grid, whose last heads go key block by key block, heaviest first
    /// (sm90/bwd_ws.cu `BwdWsBlock::launch_order`), after heads in launch order; a partial last
    /// key block, seqlen_q != seqlen_k, GQA.
    fn many_key_block_cases() -> Vec<Case> {
        causal_cases(&[
            // (b, sq, sk, h, hk, d): blocks of 128 keys (64 at d 256)
            (4, 2048, 2048, 16, 8, 64),   // 512 blocks
            (2, 2000, 2000, 16, 16, 128), // 512
            (2, 1000, 1100, 32, 16, 256), // 576
        ])
    }

    /// Causal cases of the (b, sq, sk, h, hk, d) shapes, in f16 and bf16.
    fn causal_cases(shapes: &[(usize, usize, usize, usize, usize, usize)]) -> Vec<Case> {
        [DType::F16, DType::BF16]
            .into_iter()
            .flat_map(|dtype| {
                shapes.iter().map(move |&(b, sq, sk, h, hk, d)| Case {
                    dtype,
                    b,
                    sq,
                    sk,
                    h,
                    hk,
                    d,
                    causal: true,
                })
            })
            .collect()
    }

    /// Training, memory, strided inputs, repeatability, CPU vs CUDA, input errors.
    fn misc_section(dev: &Device, quick: bool, suite: &mut Suite) {
        suite.record("training step", training_step(dev));
        if !quick {
            suite.record("linear memory", linear_memory(dev));
        }
        suite.record("strided inputs", strided_inputs(dev));
        suite.record(
            "repeatable forward",
            repeatable(dev, if quick { 3 } else { 100 }),
        );
        suite.record("cpu op vs cuda attention_slow", cpu_vs_cuda(dev));
        suite.record("cuda input errors", cuda_errors(dev));
        suite.record("backward api vs autograd", backward_api(dev));
        suite.record("combine of key parts vs whole", combine_parts(dev));
        suite.record("combine kernel vs ops", crate::combine::kernel_vs_ops(dev));
        suite.record(
            "cascade call vs whole caches",
            crate::combine::cascade_call(dev),
        );
        suite.record(
            "combine with a gradient",
            crate::combine::gradient_takes_the_ops(dev),
        );
    }

    /// `combine` on the GPU: bf16 attention over keys cut in three parts (the kernels' LSE
    /// per part), merged, within the output rule (2x the error of the same math in bf16),
    /// and its LSE against the whole attention's.
    fn combine_parts(dev: &Device) -> Result<()> {
        for (d, sk, cuts) in [(128, 1000, [300, 301]), (64, 4096, [1, 2048])] {
            let q = randn((2, 77, 8, d), DType::BF16, dev)?;
            let k = randn((2, sk, 2, d), DType::BF16, dev)?;
            let v = randn((2, sk, 2, d), DType::BF16, dev)?;
            let attn = FlashAttn::new();
            let bounds = [0, cuts[0], cuts[1], sk];
            let mut parts = vec![];
            for w in bounds.windows(2) {
                let kp = k.narrow(1, w[0], w[1] - w[0])?.contiguous()?;
                let vp = v.narrow(1, w[0], w[1] - w[0])?.contiguous()?;
                parts.push(attn.forward_with_lse(&q, &kp, &vp)?);
            }
            let (merged, merged_lse) = candle_flash::combine(&parts)?;
            let (_, lse) = attn.forward_with_lse(&q, &k, &v)?;
            let f32 = |t: &Tensor| t.to_dtype(DType::F32);
            let scale = 1.0 / (d as f32).sqrt();
            let exact = attention_slow(&f32(&q)?, &f32(&k)?, &f32(&v)?, scale, false)?;
            let low = attention_slow(&q, &k, &v, scale, false)?;
            check_output(
                &format!("combine d {d}"),
                &f32(&merged)?,
                &f32(&low)?,
                &exact,
            )?;
            let lse_err = max_abs_diff(&merged_lse, &lse)?;
            if lse_err.is_nan() || lse_err > 1e-3 {
                candle::bail!("combine d {d}: lse differs from the whole's by {lse_err}");
            }
        }
        Ok(())
    }

    /// Shapes with more work tiles than the GPU has SMs, so that the warp-specialized
    /// forward's persistent blocks take several tiles each (under a causal mask from the
    /// dynamic counter) and the backward runs hundreds of key blocks: the grid above stays
    /// under one tile per block. The first has the fine-tuning example's attention shape (16 x
    /// 2048, 4 query heads over 2, head_dim 64), though the example trains on packed batches,
    /// which run other kernels.
    fn persistent_grid() -> Vec<Case> {
        let mut cases = vec![];
        for (b, s, h, hk, d) in [
            (16, 2048, 4, 2, 64),
            (8, 2048, 8, 2, 128),
            (4, 2048, 4, 4, 256),
        ] {
            for causal in [true, false] {
                cases.push(Case {
                    dtype: DType::BF16,
                    b,
                    sq: s,
                    sk: s,
                    h,
                    hk,
                    d,
                    causal,
                });
            }
        }
        cases
    }

    fn bwd_section(dev: &Device, quick: bool, suite: &mut Suite) {
        for c in bwd_grid(quick) {
            suite.record(&format!("bwd {c}"), bwd_case(dev, c));
        }
        if !quick {
            for c in persistent_grid() {
                suite.record(&format!("bwd persistent {c}"), bwd_case(dev, c));
            }
        }
        for c in many_key_block_cases() {
            suite.record(&format!("bwd many key blocks {c}"), bwd_case(dev, c));
        }
        suite.record(
            "repeatable backward",
            repeatable_backward(dev, if quick { 3 } else { 50 }),
        );
        crate::deterministic::run(dev, quick, suite);
    }
}
