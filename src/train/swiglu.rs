//! SwiGLU, `silu(gate) * up`, as one op: both gradients from one kernel.

use candle::backend::BackendStorage;
use candle::{bail, CpuStorage, CustomOp2, Layout, Result, Shape, Storage, Tensor};

use super::host;

/// `silu(gate) * up` for two tensors of one shape and dtype (BF16, F16 or F32), computed in
/// f32. Differentiable in both.
///
/// Rows further apart than their length are read in place: the two halves of one fused
/// gate-and-up projection, `y.narrow(D::Minus1, 0, i)` and `y.narrow(D::Minus1, i, i)` of a
/// `(tokens, 2 * i)` output, cost no copy (any other layout is made contiguous first).
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    host::check_float(gate, "swiglu: gate")?;
    host::check_same_device(gate, up, "swiglu: up")?;
    if gate.dims() != up.dims() || gate.dtype() != up.dtype() {
        bail!(
            "swiglu: up is {:?} {:?}, expected gate's {:?} {:?}",
            up.dims(),
            up.dtype(),
            gate.dims(),
            gate.dtype()
        )
    }
    let rows_or_copy = |t: &Tensor| match rows_of(t.layout()) {
        Some(_) => Ok(t.clone()),
        None => t.contiguous(),
    };
    rows_or_copy(gate)?.apply_op2(&rows_or_copy(up)?, SwiGlu)
}

/// `(rows, cols, row stride)` of a layout whose last dim is dense and whose rows are evenly
/// spaced (a contiguous tensor, or a narrowing of its last dim).
fn rows_of(l: &Layout) -> Option<(usize, usize, usize)> {
    let (dims, strides) = (l.dims(), l.stride());
    let Some((&cols, lead)) = dims.split_last() else {
        return Some((1, 1, 1));
    };
    if cols > 1 && strides[dims.len() - 1] != 1 {
        return None;
    }
    // The leading dims (those of size 1 aside, whose strides mean nothing) must collapse
    // into one: each stride the next one's times its size.
    let lead: Vec<(usize, usize)> = lead
        .iter()
        .zip(strides)
        .filter(|(&d, _)| d > 1)
        .map(|(&d, &s)| (d, s))
        .collect();
    if lead.windows(2).any(|w| w[0].1 != w[1].1 * w[1].0) {
        return None;
    }
    let rows = lead.iter().map(|&(d, _)| d).product();
    let row_stride = lead.last().map_or(cols, |&(_, s)| s);
    Some((rows, cols, row_stride))
}

struct SwiGlu;

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "swiglu"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (g, u) = (
            crate::cpu::gather_f32(s1, l1)?,
            crate::cpu::gather_f32(s2, l2)?,
        );
        let y = g.iter().zip(&u).map(|(g, u)| g * sigmoid(*g) * u).collect();
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
        let n = l1.shape().elem_count();
        let (Some((rows, cols, g_row)), Some((_, _, u_row))) = (rows_of(l1), rows_of(l2)) else {
            bail!("swiglu: gate and up must be rows of a dense last dim (made so by `swiglu`)")
        };
        if i32::try_from(cols).is_err() {
            bail!("swiglu: last dim {cols} is past the kernel's 32-bit range")
        }
        let name = TrainKernel::name(Op::SwigluFwd, &[("swiglu", s1.dtype())])?;
        let stream = dev.cuda_stream();
        let mut y = launch::alloc(dev, s1.dtype(), n, false)?;
        {
            let (g, _a) = launch::ptr(s1, l1, &stream)?;
            let (u, _b) = launch::ptr(s2, l2, &stream)?;
            let (yp, _c) = launch::ptr_mut(&mut y, 0, &stream)?;
            let args = [
                Arg::Ptr(g),
                Arg::I64(g_row as i64),
                Arg::Ptr(u),
                Arg::I64(u_row as i64),
                Arg::Ptr(yp),
                Arg::I64(rows as i64),
                Arg::I32(cols as i32),
            ];
            launch::launch(dev, name, launch::stride_blocks(dev, n, 256)?, 256, &args)?;
        }
        Ok((y, l1.shape().clone()))
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // The backward kernel reads dense operands (the forward took rows in place).
        let (gate, up) = (&gate.contiguous()?, &up.contiguous()?);
        let dy = grad.contiguous()?;
        let n = gate.elem_count();
        let (dg, du) = {
            let (gs, gl) = gate.storage_and_layout();
            let (us, ul) = up.storage_and_layout();
            let (ds, dl) = dy.storage_and_layout();
            match (&*gs, &*us, &*ds) {
                (Storage::Cpu(gs), Storage::Cpu(us), Storage::Cpu(ds)) => {
                    let (g, u, d) = (
                        crate::cpu::gather_f32(gs, gl)?,
                        crate::cpu::gather_f32(us, ul)?,
                        crate::cpu::gather_f32(ds, dl)?,
                    );
                    let mut dg = Vec::with_capacity(n);
                    let mut du = Vec::with_capacity(n);
                    for i in 0..n {
                        let s = sigmoid(g[i]);
                        dg.push(d[i] * u[i] * s * (1.0 + g[i] * (1.0 - s)));
                        du.push(d[i] * g[i] * s);
                    }
                    (
                        Storage::Cpu(crate::cpu::to_storage(dg, gs.dtype())?),
                        Storage::Cpu(crate::cpu::to_storage(du, gs.dtype())?),
                    )
                }
                #[cfg(feature = "cuda")]
                (Storage::Cuda(gs), Storage::Cuda(us), Storage::Cuda(ds)) => {
                    use super::kernels::{Op, TrainKernel};
                    use super::launch::{self, Arg};
                    let dev = &gs.device;
                    let name = TrainKernel::name(Op::SwigluBwd, &[("swiglu", gs.dtype())])?;
                    let stream = dev.cuda_stream();
                    let mut dg = launch::alloc(dev, gs.dtype(), n, false)?;
                    let mut du = launch::alloc(dev, gs.dtype(), n, false)?;
                    {
                        let (g, _a) = launch::ptr(gs, gl, &stream)?;
                        let (u, _b) = launch::ptr(us, ul, &stream)?;
                        let (d, _c) = launch::ptr(ds, dl, &stream)?;
                        let (dgp, _d) = launch::ptr_mut(&mut dg, 0, &stream)?;
                        let (dup, _e) = launch::ptr_mut(&mut du, 0, &stream)?;
                        let args = [
                            Arg::Ptr(g),
                            Arg::Ptr(u),
                            Arg::Ptr(d),
                            Arg::Ptr(dgp),
                            Arg::Ptr(dup),
                            Arg::I64(n as i64),
                        ];
                        launch::launch(dev, name, launch::stride_blocks(dev, n, 256)?, 256, &args)?;
                    }
                    (Storage::Cuda(dg), Storage::Cuda(du))
                }
                _ => bail!("swiglu backward: gate, up and the gradient must share a device"),
            }
        };
        Ok((
            Some(host::tensor(dg, gate.shape())),
            Some(host::tensor(du, gate.shape())),
        ))
    }
}
