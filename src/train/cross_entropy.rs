//! Cross-entropy from logits without a softmax in memory. The op-by-op form (`log_softmax`
//! in f32, gather, mean) writes and reads several `(tokens, vocab)` f32 buffers, forward and
//! backward: at a 128k vocabulary and 16k tokens, 8 GB each.

use std::sync::Mutex;

use candle::backend::BackendStorage;
use candle::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Storage, Tensor};

use super::host;

/// A target id that contributes no loss and no gradient (prompt tokens, padding).
pub const IGNORE: u32 = u32::MAX;

/// The loss of each row: `logsumexp(logits[r]) - logits[r, targets[r]]`, `(n,)` F32, 0 where
/// the target is [`IGNORE`] and NaN where it is past the vocabulary. `logits` `(n, vocab)` in
/// BF16, F16 or F32 (math in f32), `targets` `(n,)` U32. Differentiable in `logits` (gradient
/// in their dtype): `dloss * (softmax(logits[r]) - onehot(targets[r]))`, from the row's
/// log-sum-exp kept by the forward, so it stays exact however large the loss.
///
/// Extreme logits follow PyTorch: a target logit of `-inf` gives a loss of `inf` and the
/// finite gradient above (`-dloss` at the target); a row holding a NaN or `+inf`, or whose
/// logits are all `-inf`, gives NaN, its loss and its gradient.
pub fn cross_entropy_rows(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    host::check_float(logits, "cross_entropy: logits")?;
    host::check_same_device(logits, targets, "cross_entropy: targets")?;
    let (n, _vocab) = match logits.dims() {
        [n, v] => (*n, *v),
        s => bail!("cross_entropy: logits have shape {s:?}, expected (n, vocab)"),
    };
    if targets.dims() != [n] || targets.dtype() != DType::U32 {
        bail!(
            "cross_entropy: targets are {:?} {:?}, expected ({n},) U32",
            targets.dims(),
            targets.dtype()
        )
    }
    if i32::try_from(n).is_err() {
        bail!("cross_entropy: {n} rows are past the kernels' grid limit")
    }
    logits
        .contiguous()?
        .apply_op2(&targets.contiguous()?, CrossEntropy::default())
}

/// The mean of [`cross_entropy_rows`] over the rows whose target is not [`IGNORE`] (0 when
/// all are), a scalar F32; the count is taken on the device (no synchronisation).
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let rows = cross_entropy_rows(logits, targets)?;
    let ignore = Tensor::full(IGNORE, targets.shape(), targets.device())?;
    let counted = targets
        .ne(&ignore)?
        .to_dtype(DType::F32)?
        .sum_all()?
        .maximum(1f32)?;
    rows.sum_all()?.div(&counted)
}

/// The op keeps each row's log-sum-exp from its forward for its backward: rebuilt there from
/// the f32 loss (`loss + logit[target]`), it lost the loss's rounding (with a target logit of
/// -1e6 a loss near 1e6 is rounded to 1/16, 2.6% off in the softmax) and was NaN for a target
/// logit of -inf (`inf - inf`).
#[derive(Default)]
struct CrossEntropy {
    /// `(n,)` F32 on the logits' device, NaN for a row holding a NaN or +inf.
    lse: Mutex<Option<Tensor>>,
}

impl CrossEntropy {
    fn keep_lse(&self, lse: Storage, n: usize) {
        *self.lse.lock().unwrap_or_else(|p| p.into_inner()) = Some(host::tensor(lse, n));
    }

    fn kept_lse(&self) -> Result<Tensor> {
        match &*self.lse.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(lse) => Ok(lse.clone()),
            None => bail!("cross_entropy backward: the forward kept no log-sum-exp"),
        }
    }
}

/// `max + ln(sum of exp(x - max))` of a row, or NaN when it holds one. The sum runs in f64:
/// in f32, one term after another, a vocabulary's thousands of small terms added to a sum
/// near 1 each lost part of an ulp, and at 5000 columns the LSE was off by up to 2.4e-5 (a
/// 1-in-1500 failure of the 3x rule in `cross_entropy_matches_log_softmax`; 8.8e-7 in f64).
fn lse(row: &[f32]) -> f32 {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if row.iter().any(|x| x.is_nan()) {
        return f32::NAN;
    }
    if m == f32::NEG_INFINITY {
        return m;
    }
    m + row
        .iter()
        .map(|x| f64::from((x - m).exp()))
        .sum::<f64>()
        .ln() as f32
}

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "cross-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = crate::cpu::gather_f32(s1, l1)?;
        let t = host::u32s(s2, l2, "cross_entropy: targets")?;
        let vocab = l1.dims()[1];
        let lses: Vec<f32> = (0..t.len())
            .map(|r| lse(&x[r * vocab..][..vocab]))
            .collect();
        let loss = t
            .iter()
            .zip(&lses)
            .enumerate()
            .map(|(r, (&t, lse))| match t {
                IGNORE => 0.0,
                t if t as usize >= vocab => f32::NAN,
                t => lse - x[r * vocab + t as usize],
            })
            .collect();
        self.keep_lse(Storage::Cpu(CpuStorage::F32(lses)), t.len());
        Ok((CpuStorage::F32(loss), Shape::from(t.len())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle::CudaStorage,
        l1: &Layout,
        s2: &candle::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle::CudaStorage, Shape)> {
        use super::kernels::{Op, TrainKernel};
        use super::launch::{self, Arg};
        let dev = &s1.device;
        let (n, vocab) = (l1.dims()[0], l1.dims()[1]);
        let name = TrainKernel::name(Op::XentFwd, &[("cross_entropy: logits", s1.dtype())])?;
        let stream = dev.cuda_stream();
        let mut loss = launch::alloc(dev, DType::F32, n, false)?;
        let mut lse = launch::alloc(dev, DType::F32, n, false)?;
        {
            let (x, _a) = launch::ptr(s1, l1, &stream)?;
            let (t, _b) = launch::ptr(s2, l2, &stream)?;
            let (lp, _c) = launch::ptr_mut(&mut loss, 0, &stream)?;
            let (sp, _d) = launch::ptr_mut(&mut lse, 0, &stream)?;
            let args = [
                Arg::Ptr(x),
                Arg::Ptr(t),
                Arg::Ptr(lp),
                Arg::Ptr(sp),
                Arg::I64(vocab as i64),
            ];
            launch::launch(dev, name, n, 256, &args)?;
        }
        self.keep_lse(Storage::Cuda(lse), n);
        Ok((loss, Shape::from(n)))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _loss: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dloss = grad.contiguous()?;
        let lse = self.kept_lse()?;
        let (n, vocab) = logits.dims2()?;
        let dx = {
            let (xs, xl) = logits.storage_and_layout();
            let (ts, tl) = targets.storage_and_layout();
            let (ls, ll) = lse.storage_and_layout();
            let (gs, gl) = dloss.storage_and_layout();
            match (&*xs, &*ts, &*ls, &*gs) {
                (Storage::Cpu(xs), Storage::Cpu(ts), Storage::Cpu(ls), Storage::Cpu(gs)) => {
                    let x = crate::cpu::gather_f32(xs, xl)?;
                    let t = host::u32s(ts, tl, "cross_entropy: targets")?;
                    let (l, g) = (
                        crate::cpu::gather_f32(ls, ll)?,
                        crate::cpu::gather_f32(gs, gl)?,
                    );
                    let mut dx = vec![0f32; n * vocab];
                    for r in 0..n {
                        if t[r] == IGNORE {
                            continue;
                        }
                        let row = &x[r * vocab..][..vocab];
                        let out = &mut dx[r * vocab..][..vocab];
                        let lse = if (t[r] as usize) < vocab {
                            l[r]
                        } else {
                            f32::NAN
                        };
                        for (c, (o, xv)) in out.iter_mut().zip(row).enumerate() {
                            let onehot = if c == t[r] as usize { 1.0 } else { 0.0 };
                            *o = g[r] * ((xv - lse).exp() - onehot);
                        }
                    }
                    Storage::Cpu(crate::cpu::to_storage(dx, xs.dtype())?)
                }
                #[cfg(feature = "cuda")]
                (Storage::Cuda(xs), Storage::Cuda(ts), Storage::Cuda(ls), Storage::Cuda(gs)) => {
                    use super::kernels::{Op, TrainKernel};
                    use super::launch::{self, Arg};
                    let dev = &xs.device;
                    let name =
                        TrainKernel::name(Op::XentBwd, &[("cross_entropy: logits", xs.dtype())])?;
                    let stream = dev.cuda_stream();
                    let mut dx = launch::alloc(dev, xs.dtype(), n * vocab, false)?;
                    {
                        let (x, _a) = launch::ptr(xs, xl, &stream)?;
                        let (t, _b) = launch::ptr(ts, tl, &stream)?;
                        let (l, _c) = launch::ptr(ls, ll, &stream)?;
                        let (g, _d) = launch::ptr(gs, gl, &stream)?;
                        let (dxp, _e) = launch::ptr_mut(&mut dx, 0, &stream)?;
                        let args = [
                            Arg::Ptr(x),
                            Arg::Ptr(t),
                            Arg::Ptr(l),
                            Arg::Ptr(g),
                            Arg::Ptr(dxp),
                            Arg::I64(vocab as i64),
                        ];
                        launch::launch(dev, name, n, 256, &args)?;
                    }
                    Storage::Cuda(dx)
                }
                _ => bail!("cross_entropy backward: inputs must share a device"),
            }
        };
        Ok((Some(host::tensor(dx, (n, vocab))), None))
    }
}
