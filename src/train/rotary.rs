//! Rotary position embedding as one op with its backward (the inverse rotation). Candle's
//! fused `rope` kernels have no backward; the op-by-op form narrows, negates, concatenates
//! and broadcasts, each a kernel and, backward, a gradient buffer.

use candle::backend::BackendStorage;
use candle::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};

use super::host;

/// Rotates `x` `(tokens, heads, head_dim)` by each token's angles, LLaMA's layout of
/// non-interleaved halves: `(a, b) -> (a cos - b sin, b cos + a sin)` with `a = x[..j]`,
/// `b = x[j + head_dim / 2]`. `cos` and `sin` are `(tokens, head_dim / 2)` F32 (the tables at
/// each token's position). f32 arithmetic, one rounding to x's dtype. Differentiable in `x`
/// (the tables are constants).
pub fn rotary(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    host::check_float(x, "rotary: x")?;
    let (n, _heads, d) = match x.dims() {
        [n, h, d] => (*n, *h, *d),
        s => bail!("rotary: x has shape {s:?}, expected (tokens, heads, head_dim)"),
    };
    if d % 2 != 0 {
        bail!("rotary: head_dim {d} must be even")
    }
    for (t, name) in [(cos, "rotary: cos"), (sin, "rotary: sin")] {
        host::check_same_device(x, t, name)?;
        if t.dims() != [n, d / 2] {
            bail!(
                "{name} has shape {:?}, expected ({n}, {}) for x of shape {:?}",
                t.dims(),
                d / 2,
                x.dims()
            )
        }
        if t.dtype() != DType::F32 {
            bail!("{name}: dtype {:?}, expected F32", t.dtype())
        }
    }
    if i32::try_from(x.dim(1)? * d).is_err() {
        bail!(
            "rotary: heads x head_dim of {:?} is past the kernels' 32-bit range",
            x.dims()
        )
    }
    let (cos, sin) = (cos.detach().contiguous()?, sin.detach().contiguous()?);
    x.contiguous()?.apply_op3(&cos, &sin, Rotary { sign: 1.0 })
}

/// `sign` 1 rotates by the angles, -1 by their opposite (the backward).
struct Rotary {
    sign: f32,
}

impl CustomOp3 for Rotary {
    fn name(&self) -> &'static str {
        "rotary"
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
        let (x, c, s) = (
            crate::cpu::gather_f32(s1, l1)?,
            crate::cpu::gather_f32(s2, l2)?,
            crate::cpu::gather_f32(s3, l3)?,
        );
        let dims = l1.dims();
        let (heads, d) = (dims[1], dims[2]);
        let half = d / 2;
        let mut y = vec![0f32; x.len()];
        for (th, (xr, yr)) in x.chunks(d.max(1)).zip(y.chunks_mut(d.max(1))).enumerate() {
            let tok = th / heads.max(1);
            for j in 0..half {
                let (cv, sv) = (c[tok * half + j], self.sign * s[tok * half + j]);
                let (a, b) = (xr[j], xr[j + half]);
                yr[j] = a * cv - b * sv;
                yr[j + half] = b * cv + a * sv;
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
        s3: &candle::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle::CudaStorage, Shape)> {
        use super::kernels::{Op, TrainKernel};
        use super::launch::{self, Arg};
        let dev = &s1.device;
        let dims = l1.dims();
        let (n, heads, half) = (dims[0], dims[1], dims[2] / 2);
        let name = TrainKernel::name(Op::Rotary, &[("rotary: x", s1.dtype())])?;
        let stream = dev.cuda_stream();
        let mut y = launch::alloc(dev, s1.dtype(), l1.shape().elem_count(), false)?;
        {
            let (x, _a) = launch::ptr(s1, l1, &stream)?;
            let (c, _b) = launch::ptr(s2, l2, &stream)?;
            let (s, _c) = launch::ptr(s3, l3, &stream)?;
            let (yp, _d) = launch::ptr_mut(&mut y, 0, &stream)?;
            let args = [
                Arg::Ptr(x),
                Arg::Ptr(c),
                Arg::Ptr(s),
                Arg::Ptr(yp),
                Arg::I64(n as i64),
                Arg::I32(heads as i32),
                Arg::I32(half as i32),
                Arg::F32(self.sign),
            ];
            launch::launch(dev, name, (n * heads * half).div_ceil(256), 256, &args)?;
        }
        Ok((y, l1.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let inverse = Rotary { sign: -self.sign };
        let dx = grad.contiguous()?.apply_op3_no_bwd(cos, sin, &inverse)?;
        Ok((Some(dx), None, None))
    }
}
