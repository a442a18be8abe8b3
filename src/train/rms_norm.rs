//! RMSNorm as one op with its backward: Candle's fused `rms_norm` has none, and the op-by-op
//! form costs about nine kernels forward and twice that backward per call.

use candle::backend::BackendStorage;
use candle::{bail, CpuStorage, CustomOp2, Layout, Result, Shape, Storage, Tensor, D};

use super::host;

/// `x * rsqrt(mean(x^2, last dim) + eps) * weight`, computed in f32 and rounded once to x's
/// dtype. `x` `(..., hidden)` in BF16, F16 or F32; `weight` `(hidden,)` in F32 or x's dtype
/// (f32 master weights under mixed precision). Differentiable in both; the weight's gradient
/// is summed in f32.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f32) -> Result<Tensor> {
    check(x, weight, eps, "rms_norm")?;
    x.contiguous()?
        .apply_op2(&weight.contiguous()?, RmsNorm { eps })
}

/// The checks of a norm of `x` by `weight` (shared with [`super::add_rms_norm`]); `op` names
/// the function in the errors.
pub(crate) fn check(x: &Tensor, weight: &Tensor, eps: f32, op: &str) -> Result<()> {
    host::check_float(x, &format!("{op}: x"))?;
    host::check_same_device(x, weight, &format!("{op}: weight"))?;
    let hidden = x.dim(D::Minus1)?;
    if weight.dims() != [hidden] {
        bail!(
            "{op}: weight has shape {:?}, expected ({hidden},) for x of shape {:?}",
            weight.dims(),
            x.dims()
        )
    }
    if weight.dtype() != candle::DType::F32 && weight.dtype() != x.dtype() {
        bail!(
            "{op}: weight dtype {:?}, expected F32 or x's {:?}",
            weight.dtype(),
            x.dtype()
        )
    }
    if !(eps >= 0.0 && eps.is_finite()) {
        bail!("{op}: eps must be finite and >= 0, got {eps}")
    }
    if i32::try_from(hidden).is_err() {
        bail!("{op}: hidden size {hidden} is past the kernels' 32-bit range")
    }
    Ok(())
}

struct RmsNorm {
    eps: f32,
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, w) = (
            crate::cpu::gather_f32(s1, l1)?,
            crate::cpu::gather_f32(s2, l2)?,
        );
        let cols = w.len();
        let mut y = vec![0f32; x.len()];
        for (xr, yr) in x.chunks(cols.max(1)).zip(y.chunks_mut(cols.max(1))) {
            let rstd = rstd(xr, self.eps);
            for ((yv, xv), wv) in yr.iter_mut().zip(xr).zip(&w) {
                *yv = xv * rstd * wv;
            }
        }
        Ok((crate::cpu::to_storage(y, s1.dtype())?, l1.shape().clone()))
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
        let cols = l2.shape().elem_count();
        let rows = l1.shape().elem_count() / cols.max(1);
        let name = TrainKernel::name(
            Op::RmsFwd,
            &[
                ("rms_norm: x", s1.dtype()),
                ("rms_norm: weight", s2.dtype()),
            ],
        )?;
        let stream = dev.cuda_stream();
        let mut y = launch::alloc(dev, s1.dtype(), rows * cols, false)?;
        {
            let (x, _gx) = launch::ptr(s1, l1, &stream)?;
            let (w, _gw) = launch::ptr(s2, l2, &stream)?;
            let (yp, _gy) = launch::ptr_mut(&mut y, 0, &stream)?;
            let args = [
                Arg::Ptr(x),
                Arg::Ptr(w),
                Arg::Ptr(yp),
                Arg::I64(rows as i64),
                Arg::I32(cols as i32),
                Arg::F32(self.eps),
            ];
            // A block a row for a few rows (the kernel sees gridDim.x >= rows), a warp a row
            // otherwise.
            let blocks = if rows <= 256 { rows } else { rows.div_ceil(8) };
            launch::launch(dev, name, blocks, 256, &args)?;
        }
        Ok((y, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = backward(x, w, &grad.contiguous()?, self.eps)?;
        Ok((Some(dx), Some(dw)))
    }
}

pub(crate) fn rstd(row: &[f32], eps: f32) -> f32 {
    let ss: f32 = row.iter().map(|v| v * v).sum();
    1.0 / (ss / row.len().max(1) as f32 + eps).sqrt()
}

/// `(dx, dw)`: dx in x's dtype, dw in w's (summed in f32).
pub(super) fn backward(x: &Tensor, w: &Tensor, dy: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    let cols = w.elem_count();
    let rows = x.elem_count() / cols.max(1);
    let (dx, dw) = {
        let (xs, xl) = x.storage_and_layout();
        let (ws, wl) = w.storage_and_layout();
        let (gs, gl) = dy.storage_and_layout();
        match (&*xs, &*ws, &*gs) {
            (Storage::Cpu(xs), Storage::Cpu(ws), Storage::Cpu(gs)) => {
                let (xv, wv, gv) = (
                    crate::cpu::gather_f32(xs, xl)?,
                    crate::cpu::gather_f32(ws, wl)?,
                    crate::cpu::gather_f32(gs, gl)?,
                );
                let mut dx = vec![0f32; xv.len()];
                let mut dw = vec![0f32; cols];
                for r in 0..rows {
                    let span = r * cols..(r + 1) * cols;
                    let (xr, gr) = (&xv[span.clone()], &gv[span.clone()]);
                    let rs = rstd(xr, eps);
                    let dot: f32 = (0..cols).map(|c| gr[c] * wv[c] * xr[c]).sum();
                    let coef = rs * rs * rs * dot / cols as f32;
                    for c in 0..cols {
                        dx[r * cols + c] = rs * wv[c] * gr[c] - xr[c] * coef;
                        dw[c] += gr[c] * xr[c] * rs;
                    }
                }
                (
                    Storage::Cpu(crate::cpu::to_storage(dx, xs.dtype())?),
                    Storage::Cpu(crate::cpu::to_storage(dw, ws.dtype())?),
                )
            }
            #[cfg(feature = "cuda")]
            (Storage::Cuda(xs), Storage::Cuda(ws), Storage::Cuda(gs)) => {
                let (dx, dw) = cuda_backward((xs, xl), (ws, wl), (gs, gl), rows, cols, eps)?;
                (Storage::Cuda(dx), Storage::Cuda(dw))
            }
            _ => bail!("rms_norm backward: x, weight and the gradient must share a device"),
        }
    };
    let dw = host::tensor(dw, cols);
    let dw = if dw.dtype() == w.dtype() {
        dw
    } else {
        dw.to_dtype(w.dtype())?
    };
    Ok((host::tensor(dx, x.shape()), dw))
}

#[cfg(feature = "cuda")]
fn cuda_backward(
    (xs, xl): (&candle::CudaStorage, &Layout),
    (ws, wl): (&candle::CudaStorage, &Layout),
    (gs, gl): (&candle::CudaStorage, &Layout),
    rows: usize,
    cols: usize,
    eps: f32,
) -> Result<(candle::CudaStorage, candle::CudaStorage)> {
    use super::kernels::{Op, TrainKernel};
    use super::launch::{self, Arg};
    let dev = &xs.device;
    let name = TrainKernel::name(
        Op::RmsBwd,
        &[
            ("rms_norm: x", xs.dtype()),
            ("rms_norm: weight", ws.dtype()),
        ],
    )?;
    let dw_name = TrainKernel::name(Op::RmsDw, &[])?;
    let stream = dev.cuda_stream();
    let mut dx = launch::alloc(dev, xs.dtype(), rows * cols, false)?;
    // NORM_BWD_ROWS = 32 rows per block (cuda/train/norm.cuh), each writing its partial dw
    // (f32) per column; train_rms_dw sums them in block order (a weight of another dtype
    // gets a cast afterwards).
    // (The first launch bails past CUDA's grid limit, before `blocks` goes in as an i32.)
    let blocks = rows.div_ceil(32);
    let mut dw_part = launch::alloc(dev, candle::DType::F32, blocks * cols, false)?;
    let mut dw = launch::alloc(dev, candle::DType::F32, cols, false)?;
    {
        let (x, _a) = launch::ptr(xs, xl, &stream)?;
        let (w, _b) = launch::ptr(ws, wl, &stream)?;
        let (g, _c) = launch::ptr(gs, gl, &stream)?;
        let (dxp, _d) = launch::ptr_mut(&mut dx, 0, &stream)?;
        let (partp, _e) = launch::ptr_mut(&mut dw_part, 0, &stream)?;
        let args = [
            Arg::Ptr(x),
            Arg::Ptr(w),
            Arg::Ptr(g),
            Arg::Ptr(dxp),
            Arg::Ptr(partp),
            Arg::I64(rows as i64),
            Arg::I32(cols as i32),
            Arg::F32(eps),
        ];
        launch::launch(dev, name, blocks, 256, &args)?;
        let (dwp, _f) = launch::ptr_mut(&mut dw, 0, &stream)?;
        let args = [
            Arg::Ptr(partp),
            Arg::Ptr(dwp),
            Arg::I32(blocks as i32),
            Arg::I32(cols as i32),
        ];
        // NORM_DW_COLS = 32 columns per block of 8 x 32 threads.
        launch::launch(dev, dw_name, cols.div_ceil(32), 256, &args)?;
    }
    Ok((dx, dw))
}
