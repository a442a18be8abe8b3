//! The backward op: given q, k, v, the forward's output and LSE and the output gradient,
//! computes dq, dk, dv (FlashAttention-2 Algorithm 2). It never re-runs the forward.
//!
//! A custom op has one output, so the three gradients come back packed in one flat buffer
//! `[dq | dk | dv]` and are split with `narrow` (no copy).

use candle::backend::BackendStorage;
use candle::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Storage, Tensor};

use crate::cpu;
use crate::layout::contiguous_aligned;
use crate::params::Problem;

pub(crate) struct FlashAttnBwdOp {
    problem: Problem,
    deterministic: bool,
}

/// What the backward reads besides q, k, v.
struct BwdInputs<'a> {
    out: &'a Tensor,
    grad_out: &'a Tensor,
    lse: &'a Tensor,
}

struct BwdKernelOp<'a> {
    problem: Problem,
    /// Read by the CUDA kernels only; the CPU backward is always deterministic.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    deterministic: bool,
    inputs: BwdInputs<'a>,
}

impl FlashAttnBwdOp {
    pub fn new(problem: Problem, deterministic: bool) -> Self {
        Self {
            problem,
            deterministic,
        }
    }

    /// Returns `(dq, dk, dv)` shaped like `(q, k, v)`, in their dtype.
    pub fn run(
        self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        grad_out: &Tensor,
        lse: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let s = self.problem.shape;
        let (q_shape, kv_shape) = (self.problem.q_shape(), self.problem.kv_shape());
        // The kernels read dO with the output's (contiguous) layout.
        let grad_out = contiguous_aligned(grad_out)?;
        let out = contiguous_aligned(out)?;
        let lse = contiguous_aligned(lse)?;
        let op = BwdKernelOp {
            problem: self.problem,
            deterministic: self.deterministic,
            inputs: BwdInputs {
                out: &out,
                grad_out: &grad_out,
                lse: &lse,
            },
        };
        let packed = q.apply_op3_no_bwd(k, v, &op)?;
        let (nq, nkv) = (s.q_elems(), s.kv_elems());
        let dq = packed.narrow(0, 0, nq)?.reshape(q_shape)?;
        let dk = packed.narrow(0, nq, nkv)?.reshape(kv_shape.clone())?;
        let dv = packed.narrow(0, nq + nkv, nkv)?.reshape(kv_shape)?;
        Ok((dq, dk, dv))
    }
}

impl BwdKernelOp<'_> {
    fn packed_shape(&self) -> Shape {
        let s = self.problem.shape;
        Shape::from(s.q_elems() + 2 * s.kv_elems())
    }
}

fn cpu_tensor_f32(t: &Tensor, name: &str) -> Result<Vec<f32>> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cpu(s) => cpu::gather_f32(s, layout),
        _ => bail!("flash-attn backward: {name} is not on the CPU like q"),
    }
}

impl CustomOp3 for BwdKernelOp<'_> {
    fn name(&self) -> &'static str {
        "flash-attn-bwd"
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
        let q = cpu::gather_f32(s1, l1)?;
        let k = cpu::gather_f32(s2, l2)?;
        let v = cpu::gather_f32(s3, l3)?;
        let o = cpu_tensor_f32(self.inputs.out, "out")?;
        let d_o = cpu_tensor_f32(self.inputs.grad_out, "grad_out")?;
        let lse = cpu_tensor_f32(self.inputs.lse, "lse")?;
        let (mut dq, dk, dv) = cpu::attn_bwd(&self.problem, &q, &k, &v, &o, &d_o, &lse)?;
        dq.reserve(dk.len() + dv.len());
        dq.extend_from_slice(&dk);
        dq.extend_from_slice(&dv);
        Ok((cpu::to_storage(dq, s1.dtype())?, self.packed_shape()))
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
        let packed = crate::cuda::bwd(
            &self.problem,
            self.deterministic,
            (s1, l1),
            (s2, l2),
            (s3, l3),
            self.inputs.out,
            self.inputs.grad_out,
            self.inputs.lse,
        )?;
        Ok((packed, self.packed_shape()))
    }
}
