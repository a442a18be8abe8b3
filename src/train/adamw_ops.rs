//! The in-place passes of [`super::AdamW`] and [`super::sum_squares`]: each an `InplaceOp2`
//! writing its first operand, on the CPU (f32 loops) and on CUDA (`cuda/train/adamw.cuh`).

use candle::{bail, CpuStorage, DType, Device, InplaceOp2, Layout, Result};

/// Loads the CUDA kernels of an update with gradients of `grad` dtype on `dev` (nothing on
/// the CPU), so that the update's launches cannot fail on a missing or unloadable kernel
/// after some variables were written.
pub(super) fn preload(dev: &Device, grad: DType) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = dev {
        use super::kernels::{Op, TrainKernel};
        use super::launch;
        let moments = TrainKernel::name(Op::AdamwMoments, &[("AdamW: gradient", grad)])?;
        launch::preload(dev, moments)?;
        return launch::preload(dev, TrainKernel::name(Op::AdamwApply, &[])?);
    }
    let _ = (dev, grad);
    Ok(())
}

/// `m = beta1 m + (1 - beta1) g`, `v = beta2 v + (1 - beta2) g^2` with `g` the gradient
/// times `scale`, into the `(2, numel)` moments.
pub(super) struct Moments {
    pub scale: f32,
    pub beta1: f32,
    pub beta2: f32,
}

fn f32_mut<'a>(s: &'a mut CpuStorage, l: &Layout, what: &str) -> Result<&'a mut [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&mut v[a..b]),
        _ => bail!("{what}: expected a contiguous F32 tensor"),
    }
}

impl InplaceOp2 for Moments {
    fn name(&self) -> &'static str {
        "adamw-moments"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        let g = crate::cpu::gather_f32(s2, l2)?;
        let mv = f32_mut(s1, l1, "AdamW moments")?;
        let (m, v) = mv.split_at_mut(g.len());
        for i in 0..g.len() {
            let gi = g[i] * self.scale;
            m[i] = self.beta1 * m[i] + (1.0 - self.beta1) * gi;
            v[i] = self.beta2 * v[i] + (1.0 - self.beta2) * gi * gi;
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle::CudaStorage,
        l1: &Layout,
        s2: &candle::CudaStorage,
        l2: &Layout,
    ) -> Result<()> {
        use super::kernels::{Op, TrainKernel};
        use super::launch::{self, Arg};
        use candle::backend::BackendStorage;
        let dev = s2.device.clone();
        let n = l2.shape().elem_count();
        let name = TrainKernel::name(Op::AdamwMoments, &[("AdamW: gradient", s2.dtype())])?;
        let stream = dev.cuda_stream();
        let (mv, _a) = launch::ptr_mut(s1, l1.start_offset(), &stream)?;
        let (g, _b) = launch::ptr(s2, l2, &stream)?;
        let args = [
            Arg::Ptr(mv),
            Arg::Ptr(g),
            Arg::I64(n as i64),
            Arg::F32(self.scale),
            Arg::F32(self.beta1),
            Arg::F32(self.beta2),
        ];
        launch::launch(&dev, name, launch::stride_blocks(&dev, n, 256)?, 256, &args)
    }
}

/// The weight from the moments: `w * decay - lr * (m / c1) / (sqrt(v / c2) + eps)`.
pub(super) struct Apply {
    pub lr: f32,
    pub decay: f32,
    pub c1: f32,
    pub c2: f32,
    pub eps: f32,
}

impl InplaceOp2 for Apply {
    fn name(&self) -> &'static str {
        "adamw-apply"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        let mv = crate::cpu::gather_f32(s2, l2)?;
        let w = f32_mut(s1, l1, "AdamW variable")?;
        let n = w.len();
        for i in 0..n {
            let (m_hat, v_hat) = (mv[i] / self.c1, mv[n + i] / self.c2);
            w[i] = w[i] * self.decay - self.lr * m_hat / (v_hat.sqrt() + self.eps);
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle::CudaStorage,
        l1: &Layout,
        s2: &candle::CudaStorage,
        l2: &Layout,
    ) -> Result<()> {
        use super::kernels::{Op, TrainKernel};
        use super::launch::{self, Arg};
        let dev = s2.device.clone();
        let n = l1.shape().elem_count();
        let stream = dev.cuda_stream();
        let (w, _a) = launch::ptr_mut(s1, l1.start_offset(), &stream)?;
        let (mv, _b) = launch::ptr(s2, l2, &stream)?;
        let args = [
            Arg::Ptr(w),
            Arg::Ptr(mv),
            Arg::I64(n as i64),
            Arg::F32(self.lr),
            Arg::F32(self.decay),
            Arg::F32(self.c1),
            Arg::F32(self.c2),
            Arg::F32(self.eps),
        ];
        launch::launch(
            &dev,
            TrainKernel::name(Op::AdamwApply, &[])?,
            launch::stride_blocks(&dev, n, 256)?,
            256,
            &args,
        )
    }
}

/// Adds the sum of the squares of the second operand into the accumulator's first element
/// (on CUDA the accumulator also holds a counter and one partial per block).
pub(super) struct SumSquares;

impl InplaceOp2 for SumSquares {
    fn name(&self) -> &'static str {
        "sum-squares"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        let x = crate::cpu::gather_f32(s2, l2)?;
        let acc = f32_mut(s1, l1, "sum_squares accumulator")?;
        acc[0] += x.iter().map(|v| v * v).sum::<f32>();
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle::CudaStorage,
        l1: &Layout,
        s2: &candle::CudaStorage,
        l2: &Layout,
    ) -> Result<()> {
        use super::kernels::{Op, TrainKernel};
        use super::launch::{self, Arg};
        use candle::backend::BackendStorage;
        let dev = s2.device.clone();
        let n = l2.shape().elem_count();
        let name = TrainKernel::name(Op::SumSquares, &[("sum_squares", s2.dtype())])?;
        let blocks = launch::stride_blocks(&dev, n, 256)?;
        if l1.shape().elem_count() < 2 + blocks {
            bail!("sum_squares: the accumulator holds no partial per block (use `sum_squares`)")
        }
        let stream = dev.cuda_stream();
        let (acc, _a) = launch::ptr_mut(s1, l1.start_offset(), &stream)?;
        let (x, _b) = launch::ptr(s2, l2, &stream)?;
        let args = [Arg::Ptr(x), Arg::Ptr(acc), Arg::I64(n as i64)];
        launch::launch(&dev, name, blocks, 256, &args)
    }
}
