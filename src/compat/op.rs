//! The public [`FlashAttn`] struct: candle-flash-attn's op as a [`candle::CustomOp3`], with
//! the copies in and out of `apply_op3`'s storages and a backward that recomputes the forward.

use candle::backend::{BackendDevice, BackendStorage};
use candle::op::BackpropOp;
use candle::{bail, CpuStorage, Layout, Result, Shape, Storage, Tensor, Var};

use super::fixed::fixed;
use super::scores::Scores;

/// candle-flash-attn's op, as a [`candle::CustomOp3`] over `(q, k, v)`: what its
/// [`flash_attn_alibi_windowed_softcap`](super::flash_attn_alibi_windowed_softcap) runs, for code that builds the struct and calls
/// `q.apply_op3(&k, &v, op)` itself. Shapes, dtypes and window conventions as in
/// [`flash_attn_windowed`](super::flash_attn_windowed); `alibi_slopes` f32 `(num_heads)`; `softcap` `Some(c)` with
/// `c > 0` caps the scores.
///
/// Differentiable too, but its backward pass recomputes the forward first (the struct's
/// fields are fixed by candle-flash-attn, so it has nowhere to keep the forward's row
/// statistics); the functions of this module do not pay that, and neither does
/// [`crate::FlashAttn`]. Under `apply_op3` the inputs and the output are also copied once.
///
/// ```
/// # fn main() -> candle::Result<()> {
/// use candle::{Device, Tensor};
/// let dev = Device::Cpu;
/// let q = Tensor::randn(0f32, 1.0, (1, 8, 2, 16), &dev)?;
/// let k = Tensor::randn(0f32, 1.0, (1, 8, 2, 16), &dev)?;
/// let v = Tensor::randn(0f32, 1.0, (1, 8, 2, 16), &dev)?;
/// let op = candle_flash::compat::FlashAttn {
///     softmax_scale: 0.25,
///     alibi_slopes: None,
///     window_size_left: Some(3),
///     window_size_right: Some(0),
///     softcap: None,
/// };
/// let out = q.apply_op3(&k, &v, op)?;
/// let same = candle_flash::compat::flash_attn_windowed(&q, &k, &v, 0.25, Some(3), Some(0))?;
/// assert_eq!((out - same)?.abs()?.max_all()?.to_scalar::<f32>()?, 0.0);
/// # Ok(()) }
/// ```
pub struct FlashAttn {
    /// Multiplies `q·k` before the softmax.
    pub softmax_scale: f32,
    /// ALiBi slopes, f32 `(num_heads)` on q's device.
    pub alibi_slopes: Option<Tensor>,
    /// Keys left of the query's diagonal position that it sees; see the module docs.
    pub window_size_left: Option<usize>,
    /// Keys right of the query's diagonal position that it sees; `Some(0)` with a `None`
    /// left side is the causal mask.
    pub window_size_right: Option<usize>,
    /// Gemma-style cap of the scaled scores, `c · tanh(s / c)`, when `Some(c)` with `c > 0`.
    pub softcap: Option<f32>,
}

impl FlashAttn {
    fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let scores = Scores::new(self.softmax_scale, self.softcap, self.alibi_slopes.as_ref())?;
        fixed(
            q,
            k,
            v,
            &scores,
            self.window_size_left,
            self.window_size_right,
        )
    }
}

impl candle::CustomOp3 for FlashAttn {
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
        let (q, k, v) = (
            detached(s1, l1, Storage::Cpu)?,
            detached(s2, l2, Storage::Cpu)?,
            detached(s3, l3, Storage::Cpu)?,
        );
        let out = self.forward(&q, &k, &v)?;
        let (storage, layout) = out.storage_and_layout();
        match &*storage {
            Storage::Cpu(s) => Ok((copied(s, layout)?, layout.shape().clone())),
            _ => bail!("flash-attn: the CPU forward produced a result on another device"),
        }
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
        let (q, k, v) = (
            detached(s1, l1, Storage::Cuda)?,
            detached(s2, l2, Storage::Cuda)?,
            detached(s3, l3, Storage::Cuda)?,
        );
        let out = self.forward(&q, &k, &v)?;
        let (storage, layout) = out.storage_and_layout();
        match &*storage {
            Storage::Cuda(s) => Ok((copied(s, layout)?, layout.shape().clone())),
            _ => bail!("flash-attn: the CUDA forward produced a result on another device"),
        }
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _out: &Tensor,
        grad_out: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        // The forward again, in a graph of its own, and its gradients by autograd.
        let (qv, kv, vv) = (
            Var::from_tensor(&q.detach())?,
            Var::from_tensor(&k.detach())?,
            Var::from_tensor(&v.detach())?,
        );
        let out = self.forward(qv.as_tensor(), kv.as_tensor(), vv.as_tensor())?;
        let grads = (out * grad_out.detach())?.sum_all()?.backward()?;
        let grad = |var: &Var| match grads.get(var) {
            Some(g) => Ok(g.clone()),
            None => var.zeros_like(),
        };
        Ok((Some(grad(&qv)?), Some(grad(&kv)?), Some(grad(&vv)?)))
    }
}

/// A tensor outside any graph holding a contiguous copy of the view `(storage, layout)`.
fn detached<S: BackendStorage<Device = D>, D: BackendDevice<Storage = S>>(
    storage: &S,
    layout: &Layout,
    wrap: fn(S) -> Storage,
) -> Result<Tensor> {
    let copy = copied(storage, layout)?;
    Ok(Tensor::from_storage(
        wrap(copy),
        layout.shape().clone(),
        BackpropOp::none(),
        false,
    ))
}

/// A contiguous copy of the view `(storage, layout)`.
fn copied<S: BackendStorage<Device = D>, D: BackendDevice<Storage = S>>(
    storage: &S,
    layout: &Layout,
) -> Result<S> {
    let mut dst = storage
        .device()
        .zeros_impl(layout.shape(), storage.dtype())?;
    storage.copy_strided_src(&mut dst, 0, layout)?;
    Ok(dst)
}
