//! The FP8 conversions on CUDA (`cuda/train/quant.cuh`): candle-core 0.11.1's own casts to
//! and from F8E4M3 fail on CUDA (it asks for `cast_f32_f8e4m3`, its kernels are named
//! `cast_f32_f8_e4m3`), so [`super::quantize_fp8`] and [`super::dequantize_fp8`] launch these.
//! Its strided copy of F8E4M3 fails the same way (`ucopy_f8e4m3` for `ucopy_f8_e4m3`), so
//! [`copy_e4m3`] makes it for `crate::layout`.

use candle::backend::BackendStorage;
use candle::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut};
use candle::{
    bail, CpuStorage, CudaStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor,
};
use float8::F8E4M3;

use super::Fp8Scaling;
use crate::train::kernels::{Op, TrainKernel};
use crate::train::launch::{self, Arg};

/// Which way, and the output's dtype when dequantizing.
#[derive(Clone, Copy)]
pub(super) enum Direction {
    /// x to e4m3 bytes divided by its scales.
    Quantize,
    /// e4m3 bytes times their scales, in this dtype (F32, F16 or BF16).
    Dequantize(DType),
}

/// `(x, scales)` -> e4m3 bytes, or `(bytes, scales)` -> `dtype`, for a contiguous
/// `(b, s, h, d)` tensor and scales shaped for `scaling` (checked by the caller).
struct Fp8Cast {
    direction: Direction,
    scaling: Fp8Scaling,
    dims: [usize; 4],
}

/// `x` `(b, s, h, d)` converted `direction`-wise with `scales` (both checked by the caller).
pub(super) fn cast(
    x: &Tensor,
    scales: &Tensor,
    scaling: Fp8Scaling,
    direction: Direction,
) -> Result<Tensor> {
    let dims = dims4(x)?;
    let op = Fp8Cast {
        direction,
        scaling,
        dims,
    };
    crate::layout::contiguous(x)?.apply_op2_no_bwd(&scales.contiguous()?, &op)
}

/// A contiguous copy of an F8E4M3 tensor of rank 1 to 4 on CUDA, at offset 0.
pub(crate) fn copy_e4m3(x: &Tensor) -> Result<Tensor> {
    x.apply_op1_no_bwd(&Fp8Copy)
}

struct Fp8Copy;

impl CustomOp1 for Fp8Copy {
    fn name(&self) -> &'static str {
        "fp8-copy"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("fp8-copy: the CPU copies with candle's own copy, not this op")
    }

    fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout) -> Result<(CudaStorage, Shape)> {
        let rank = xl.dims().len();
        if !(1..=4).contains(&rank) {
            bail!("fp8-copy: expected a tensor of rank 1 to 4, got rank {rank}")
        }
        // Rank 4 with leading extents of 1 (their strides are never stepped over).
        let mut dims = [1usize; 4];
        let mut strides = [0i64; 4];
        dims[4 - rank..].copy_from_slice(xl.dims());
        for (s, &t) in strides[4 - rank..].iter_mut().zip(xl.stride()) {
            *s = t as i64;
        }
        let n = xl.shape().elem_count();
        let dev = x.device().clone();
        let stream = dev.cuda_stream();
        // SAFETY: the kernel writes every element.
        let mut out = unsafe { dev.alloc::<F8E4M3>(n.max(1))? };
        if n > 0 {
            let name = TrainKernel::name(Op::Fp8Copy, &[])?;
            let src = x.as_cuda_slice::<F8E4M3>()?.slice(xl.start_offset()..);
            let (sp, _s) = src.device_ptr(&stream);
            let (dp, _d) = out.device_ptr_mut(&stream);
            let mut args = vec![Arg::Ptr(sp), Arg::Ptr(dp), Arg::I64(n as i64)];
            args.extend(dims[1..].iter().map(|&d| Arg::I64(d as i64)));
            args.extend(strides.map(Arg::I64));
            let blocks = launch::stride_blocks(&dev, n, 256)?;
            launch::launch(&dev, name, blocks, 256, &args)?;
        }
        Ok((CudaStorage::wrap_cuda_slice(out, dev), xl.shape().clone()))
    }
}

fn dims4(x: &Tensor) -> Result<[usize; 4]> {
    let (b, s, h, d) = x.dims4()?;
    Ok([b, s, h, d])
}

impl CustomOp2 for Fp8Cast {
    fn name(&self) -> &'static str {
        "fp8-cast"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("fp8-cast: the CPU converts with candle's casts, not this op")
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        s: &CudaStorage,
        sl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let dev = x.device().clone();
        let stream = dev.cuda_stream();
        let [b, sq, h, d] = self.dims;
        let n = b * sq * h * d;
        let shape = Shape::from(self.dims.to_vec());
        let (mode, rows) = match self.scaling {
            Fp8Scaling::PerTensor => (0, 1),
            Fp8Scaling::PerHead => (1, 1),
            Fp8Scaling::PerBlock { rows } => (2, rows),
        };
        for (what, v) in [("head_dim", d), ("heads", h), ("seq", sq), ("rows", rows)] {
            if i32::try_from(v).is_err() {
                bail!("fp8: {what} {v} is past the kernel's 32-bit range")
            }
        }
        // After the kernels' two pointers and the scales.
        let sizes = [
            Arg::I64(n as i64),
            Arg::I32(d as i32),
            Arg::I32(h as i32),
            Arg::I32(sq as i32),
            Arg::I32(rows as i32),
            Arg::I32(mode),
        ];
        let args = |a: u64, b: u64, scales: u64| {
            let mut v = vec![Arg::Ptr(a), Arg::Ptr(b), Arg::Ptr(scales)];
            v.extend(sizes);
            v
        };
        let blocks = launch::stride_blocks(&dev, n, 256)?;
        let (scales, _s) = launch::ptr(s, sl, &stream)?;
        match self.direction {
            Direction::Quantize => {
                let name = TrainKernel::name(Op::Fp8Quantize, &[("quantize_fp8: x", x.dtype())])?;
                // SAFETY: the kernel writes every element.
                let mut out = unsafe { dev.alloc::<F8E4M3>(n.max(1))? };
                if n > 0 {
                    let (xp, _x) = launch::ptr(x, xl, &stream)?;
                    let (q, _q) = out.device_ptr_mut(&stream);
                    launch::launch(&dev, name, blocks, 256, &args(xp, q, scales))?;
                }
                Ok((CudaStorage::wrap_cuda_slice(out, dev), shape))
            }
            Direction::Dequantize(dtype) => {
                let name =
                    TrainKernel::name(Op::Fp8Dequantize, &[("dequantize_fp8: dtype", dtype)])?;
                let mut out = launch::alloc(&dev, dtype, n, false)?;
                if n > 0 {
                    let q = x.as_cuda_slice::<F8E4M3>()?.slice(xl.start_offset()..);
                    let (qp, _q) = q.device_ptr(&stream);
                    let (y, _y) = launch::ptr_mut(&mut out, 0, &stream)?;
                    launch::launch(&dev, name, blocks, 256, &args(qp, y, scales))?;
                }
                Ok((out, shape))
            }
        }
    }
}
