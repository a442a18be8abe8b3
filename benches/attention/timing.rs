//! Input sets, the timed passes and the timing loops, and the ops that isolate a backward.

#[allow(unused_imports)]
use super::*;

/// One set of fresh random inputs, in the crate's (batch, seqlen, heads, head_dim) layout.
pub(crate) struct Inputs {
    pub(crate) q: Var,
    pub(crate) k: Var,
    pub(crate) v: Var,
    /// The output gradient fed to the backward pass.
    pub(crate) dout: Tensor,
}

impl Inputs {
    pub(crate) fn new(case: &Case, dtype: DType, dev: &Device) -> Result<Self> {
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
pub(crate) type Attn<'a> = dyn Fn(&Tensor, &Tensor, &Tensor, bool) -> Result<Tensor> + 'a;

/// Forward only, on detached inputs: no graph is recorded (like torch.no_grad()).
pub(crate) fn time_fwd(dev: &Device, sets: &[Inputs], attn: &Attn) -> Result<f64> {
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
pub(crate) fn time_bwd_direct(dev: &Device, sets: &[Inputs], opts: &FlashAttn) -> Result<f64> {
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
pub(crate) fn time_bwd(dev: &Device, sets: &[Inputs], attn: &Attn) -> Result<f64> {
    let losses = sets
        .iter()
        .map(|s| grad_loss(&attn(&s.q, &s.k, &s.v, true)?, &s.dout))
        .collect::<Result<Vec<_>>>()?;
    time_ms(dev, |i| losses[i % losses.len()].backward().map(drop))
}

pub(crate) fn time_fwd_bwd(dev: &Device, sets: &[Inputs], attn: &Attn) -> Result<f64> {
    time_ms(dev, |i| {
        let s = &sets[i % sets.len()];
        grad_loss(&attn(&s.q, &s.k, &s.v, true)?, &s.dout)?
            .backward()
            .map(drop)
    })
}

/// The same backward as [`time_bwd`] with the attention kernel taken out: what Candle's
/// autograd itself costs around it.
pub(crate) fn time_autograd_overhead(dev: &Device, sets: &[Inputs]) -> Result<f64> {
    let losses = sets
        .iter()
        .map(|s| grad_loss(&s.q.apply_op3(&s.k, &s.v, FixedGrads)?, &s.dout))
        .collect::<Result<Vec<_>>>()?;
    time_ms(dev, |i| losses[i % losses.len()].backward().map(drop))
}

/// Median milliseconds per call of `step(i)`, i = 0, 1, 2, ... Each repetition runs enough
/// calls to last >= TARGET_MS, with the device synchronised at both ends, so that launch
/// overhead overlaps GPU work as it would in a model.
pub(crate) fn time_ms(dev: &Device, step: impl FnMut(usize) -> Result<()>) -> Result<f64> {
    Ok(time_ms_with(dev, PREFILL_TIMING, step)?.ms)
}

/// Milliseconds per call, medians over the repetitions.
#[derive(Clone, Copy)]
pub(crate) struct Timed {
    /// Per call, the device synchronised at both ends of each repetition.
    pub(crate) ms: f64,
    /// Per call, until the host had queued the repetition's calls (before the final
    /// synchronisation). About `ms` when the host (launches, allocations, copies of the
    /// lengths) rather than the GPU is the bottleneck, or when the launch queue is full.
    pub(crate) host_ms: f64,
}

/// [`time_ms`] with the warm-up, calibration, iteration cap and repetitions of `timing`.
pub(crate) fn time_ms_with(
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

pub(crate) fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// Runs a measurement, turning errors (unsupported shape, backward not implemented, out of
/// memory) and panics into the error's first line, so that one failure costs one row.
/// The forward and the direct backward of `opts` on `sets`, timed: `[("fwd", ms), ("bwd", ms)]`.
pub(crate) fn time_option_passes(
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
pub(crate) fn baseline_passes(
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

pub(crate) fn try_time(f: impl FnOnce() -> Result<f64>) -> std::result::Result<f64, String> {
    match try_run(f)? {
        ms if ms.is_finite() && ms > 0.0 => Ok(ms),
        ms => Err(format!("bad timing {ms}")),
    }
}

/// Runs `f`, turning an error or a panic into its first line.
pub(crate) fn try_run<T>(f: impl FnOnce() -> Result<T>) -> std::result::Result<T, String> {
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

pub(crate) fn first_line(e: &dyn fmt::Display) -> String {
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
pub(crate) fn grad_loss(out: &Tensor, dout: &Tensor) -> Result<Tensor> {
    out.apply_op1(GradInject(dout.clone()))
}

/// See [`grad_loss`]: forward gives a scalar zero, backward hands back the stored gradient.
pub(crate) struct GradInject(pub(crate) Tensor);

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
pub(crate) struct FixedGrads;

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
