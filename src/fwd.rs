//! The forward op: `CustomOp3` over (q, k, v). It keeps the row log-sum-exp of its run so
//! that [`CustomOp3::bwd`] can recompute the probabilities without re-running the forward.
//! With attention sinks it turns the kernels' `(out, lse)` into the result with the sinks
//! before it saves them (src/sinks.rs), so that its backward is exact unchanged.

use std::sync::{Arc, Mutex};

use candle::backend::BackendStorage;
use candle::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};

use crate::bwd::FlashAttnBwdOp;
use crate::cpu;
use crate::layout::aligned;
use crate::params::Problem;
use crate::sinks::{self, SinkLayout};

pub(crate) struct FlashAttnOp {
    problem: Problem,
    deterministic: bool,
    /// The attention sinks `(h)` in f32 ([`sinks::values`]), if any.
    sinks: Option<Tensor>,
    /// `(b, h, sq)` (packed: `(h, total_q)`) f32, written by `cpu_fwd` / `cuda_fwd`, read by
    /// `bwd`; with sinks, the LSE of the denominator with the sink.
    lse: LseSlot,
}

/// The LSE a forward op's launch writes and its caller reads back (`apply_op3_arc` returns
/// only the output): the bf16/f16 forward's and the FP8 one's.
#[derive(Default)]
pub(crate) struct LseSlot(Mutex<Option<Tensor>>);

impl LseSlot {
    pub fn store(&self, lse: Tensor) -> Result<()> {
        match self.0.lock() {
            Ok(mut guard) => {
                *guard = Some(lse);
                Ok(())
            }
            Err(_) => bail!("flash-attn: LSE lock poisoned by a panic in another thread"),
        }
    }

    pub fn get(&self) -> Result<Tensor> {
        match self.0.lock() {
            Ok(guard) => match guard.as_ref() {
                Some(lse) => Ok(lse.clone()),
                None => bail!("flash-attn: the forward pass produced no LSE"),
            },
            Err(_) => bail!("flash-attn: LSE lock poisoned by a panic in another thread"),
        }
    }
}

/// A CUDA storage computed by a launcher as a tensor outside any graph.
#[cfg(feature = "cuda")]
pub(crate) fn detached(storage: candle::CudaStorage, shape: Shape) -> Tensor {
    Tensor::from_storage(
        candle::Storage::Cuda(storage),
        shape,
        candle::op::BackpropOp::none(),
        false,
    )
}

impl FlashAttnOp {
    pub fn new(problem: Problem, deterministic: bool) -> Self {
        Self {
            problem,
            deterministic,
            sinks: None,
            lse: LseSlot::default(),
        }
    }

    /// `(b, sq, h, d)`, or `(total_q, h, d)` when packed.
    pub fn out_shape(&self) -> Shape {
        self.problem.q_shape()
    }

    /// `(b, h, sq)`, or `(h, total_q)` when packed (see `Problem::lse_index`).
    fn lse_shape(&self) -> Shape {
        self.problem.lse_shape()
    }

    /// Runs the op, returning `(out, lse)`; with `sinks` (`(h)`, checked by the caller) the
    /// attention with sinks and the LSE with them. Gradients reach the sinks where they track
    /// them.
    pub fn run(
        mut self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        sinks: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        let s = self.problem.shape;
        if s.total_q * s.h == 0 {
            // Nothing to compute: every output dimension product is zero.
            let out = Tensor::zeros(self.out_shape(), q.dtype(), q.device())?;
            let lse = Tensor::zeros(self.lse_shape(), DType::F32, q.device())?;
            return Ok((out, lse));
        }
        self.sinks = sinks.map(sinks::values).transpose()?;
        let (q, k, v) = (aligned(q)?, aligned(k)?, aligned(v)?);
        let op = Arc::new(self);
        let out = q.apply_op3_arc(&k, &v, Arc::new(Box::new(OpHandle(op.clone()))))?;
        let lse = op.lse.get()?;
        let out = match (sinks, &op.sinks) {
            (Some(user), Some(values)) if user.track_op() => {
                sinks::with_grad(&out, user, values, &lse, SinkLayout::of(&op.problem))?
            }
            _ => out,
        };
        Ok((out, lse))
    }
}

/// `apply_op3_arc` takes ownership of a boxed op; the handle shares the op with `run`, which
/// reads the LSE back after the launch.
struct OpHandle(Arc<FlashAttnOp>);

impl CustomOp3 for OpHandle {
    fn name(&self) -> &'static str {
        "flash-attn"
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
        let op = &self.0;
        let q = cpu::gather_f32(s1, l1)?;
        let k = cpu::gather_f32(s2, l2)?;
        let v = cpu::gather_f32(s3, l3)?;
        let (mut out, mut lse) = cpu::attn_fwd(&op.problem, &q, &k, &v)?;
        if let Some(s) = &op.sinks {
            let layout = SinkLayout::of(&op.problem);
            sinks::fix_up_host(&mut out, &mut lse, &s.to_vec1::<f32>()?, layout);
        }
        let lse = Tensor::from_vec(lse, op.lse_shape(), &candle::Device::Cpu)?;
        op.lse.store(lse)?;
        Ok((cpu::to_storage(out, s1.dtype())?, op.out_shape()))
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
        let op = &self.0;
        let (mut out, mut lse) = crate::cuda::fwd(&op.problem, (s1, l1), (s2, l2), (s3, l3))?;
        if let Some(s) = &op.sinks {
            sinks::fix_up_cuda(&mut out, &mut lse, s, SinkLayout::of(&op.problem))?;
        }
        let lse = detached(lse, op.lse_shape());
        op.lse.store(lse)?;
        Ok((out, op.out_shape()))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad_out: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let op = &self.0;
        let lse = op.lse.get()?;
        let (dq, dk, dv) = FlashAttnBwdOp::new(op.problem.clone(), op.deterministic)
            .run(q, k, v, out, grad_out, &lse)?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}
