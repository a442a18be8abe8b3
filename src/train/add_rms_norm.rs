//! A transformer block's residual add and the RMSNorm after it as one op: at a decoding step
//! each is a launch over a few rows, and a step has two per layer.

use candle::backend::BackendStorage;
use candle::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

use super::rms_norm;

/// `(h, rms_norm(h, weight, eps))` with `h = x + residual`: the residual stream and its
/// normalised copy, from one kernel. `h` is summed in f32, rounded to x's dtype and the
/// norm is taken of that rounded `h`, as `x + residual` followed by [`rms_norm`] would. `x` and `residual` `(..., hidden)` of one shape and dtype
/// (BF16, F16 or F32); `weight` `(hidden,)` in F32 or x's dtype. Differentiable in all three.
///
/// [`rms_norm`]: super::rms_norm
pub fn add_rms_norm(
    x: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
    eps: f32,
) -> Result<(Tensor, Tensor)> {
    rms_norm::check(x, weight, eps, "add_rms_norm")?;
    super::host::check_same_device(x, residual, "add_rms_norm: residual")?;
    if residual.dims() != x.dims() || residual.dtype() != x.dtype() {
        bail!(
            "add_rms_norm: residual is {:?} {:?}, expected x's {:?} {:?}",
            residual.dims(),
            residual.dtype(),
            x.dims(),
            x.dtype()
        )
    }
    // One output holding both results, (2, ..x's dims): h, then the norm.
    let both = x.contiguous()?.apply_op3(
        &residual.contiguous()?,
        &weight.contiguous()?,
        AddRmsNorm { eps },
    )?;
    Ok((both.get(0)?, both.get(1)?))
}

struct AddRmsNorm {
    eps: f32,
}

fn stacked(l: &Layout) -> Shape {
    let mut dims = vec![2];
    dims.extend_from_slice(l.dims());
    Shape::from(dims)
}

impl CustomOp3 for AddRmsNorm {
    fn name(&self) -> &'static str {
        "add-rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dtype = s1.dtype();
        let (x, r, w) = (
            crate::cpu::gather_f32(s1, l1)?,
            crate::cpu::gather_f32(s2, l2)?,
            crate::cpu::gather_f32(s3, l3)?,
        );
        let cols = w.len().max(1);
        let h: Vec<f32> = x
            .iter()
            .zip(&r)
            .map(|(a, b)| crate::cpu::round_to(a + b, dtype))
            .collect();
        let mut out = h.clone();
        out.reserve(h.len());
        for row in h.chunks(cols) {
            let rstd = rms_norm::rstd(row, self.eps);
            out.extend(row.iter().zip(&w).map(|(v, wv)| v * rstd * wv));
        }
        Ok((crate::cpu::to_storage(out, dtype)?, stacked(l1)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle::CudaStorage,
        l1: &Layout,
        s2: &candle::CudaStorage,
        l2: &Layout,
        s3: &candle::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle::CudaStorage, Shape)> {
        use super::kernels::{Op, TrainKernel};
        use super::launch::{self, Arg};
        let dev = &s1.device;
        let cols = l3.shape().elem_count();
        let n = l1.shape().elem_count();
        let rows = n / cols.max(1);
        let name = TrainKernel::name(
            Op::AddRmsFwd,
            &[
                ("add_rms_norm: x", s1.dtype()),
                ("add_rms_norm: weight", s3.dtype()),
            ],
        )?;
        let stream = dev.cuda_stream();
        let mut out = launch::alloc(dev, s1.dtype(), 2 * n, false)?;
        {
            let (x, _a) = launch::ptr(s1, l1, &stream)?;
            let (r, _b) = launch::ptr(s2, l2, &stream)?;
            let (w, _c) = launch::ptr(s3, l3, &stream)?;
            let (h, _d) = launch::ptr_mut(&mut out, 0, &stream)?;
            let y = h + (n * s1.dtype().size_in_bytes()) as u64;
            let args = [
                Arg::Ptr(x),
                Arg::Ptr(r),
                Arg::Ptr(w),
                Arg::Ptr(h),
                Arg::Ptr(y),
                Arg::I64(rows as i64),
                Arg::I32(cols as i32),
                Arg::F32(self.eps),
            ];
            // A block of 256 threads per row (grid-stride past CUDA's grid limit), launched
            // programmatically: the dispatch overlaps the kernel ahead (the kernel waits for
            // it before touching memory).
            launch::launch_programmatic(dev, name, rows.min(1 << 30), 256, 0, &args)?;
        }
        Ok((out, stacked(l1)))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        _residual: &Tensor,
        w: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // d(x + residual) = dh + the norm's dx at the stored (rounded) h.
        let h = res.get(0)?;
        let (dh, dy) = (grad.get(0)?, grad.get(1)?.contiguous()?);
        let (dnorm, dw) = rms_norm::backward(&h, w, &dy, self.eps)?;
        let d = (dnorm + dh)?;
        Ok((Some(d.clone()), Some(d), Some(dw)))
    }
}
