//! Attention sinks (gpt-oss): a learned logit `sink_h` per query head that joins every row's
//! softmax denominator and has no value,
//! `p_ij = exp(s_ij - L_i)`, `L_i = log(exp(sink_h) + sum_j exp(s_ij))`, `out_i = sum_j p_ij v_j`.
//!
//! The attention kernels run without it. Their `(O, lse)` becomes the result with the sink
//! exactly: `O' = O · exp(lse - L)` with `L = log(exp(lse) + exp(sink))` ([`fix_up_host`],
//! `fix_up_cuda`). The forward op does this before it saves the LSE, so its backward
//! recomputes `P = exp(s - L)` and `D = rowsum(dO · O')`, which are the sink problem's, and
//! gives exact gradients for q, k and v unchanged. The sinks' own gradient,
//! `d sink_h = -sum over rows of exp(sink_h - L_i) · rowsum(dO_i · O'_i)` ([`grad`]), enters
//! Candle's graph through [`with_grad`], an identity op over `(O', sinks)`.
//!
//! Layout: every function here takes O as `(outer, rows, heads, d)` and its LSE as
//! `(outer, heads, rows)` ([`SinkLayout`]). KV-cache decoding can reuse the fix-up on its own
//! `(out, lse)` storages the same way: in its `cpu_fwd` / `cuda_fwd`, before the LSE is kept.

use candle::backend::BackendStorage;
use candle::{bail, CpuStorage, CustomOp2, DType, Device, Layout, Result, Shape, Tensor};

use crate::cpu;
use crate::params::Problem;

/// Where the rows of an attention output and of its LSE are: O `(outer, rows, heads, d)`,
/// LSE `(outer, heads, rows)`. The fixed-length forward's `(b, sq, h, d)` and `(b, h, sq)` are
/// `outer = b`, `rows = sq`; the packed `(total_q, h, d)` and `(h, total_q)` are `outer = 1`,
/// `rows = total_q` (see [`Problem::lse_index`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SinkLayout {
    pub outer: usize,
    pub rows: usize,
    pub heads: usize,
    pub d: usize,
}

impl SinkLayout {
    /// The layout of the forward's `(out, lse)` for `p`.
    pub fn of(p: &Problem) -> Self {
        let s = p.shape;
        match p.varlen {
            Some(_) => Self {
                outer: 1,
                rows: s.total_q,
                heads: s.h,
                d: s.d,
            },
            None => Self {
                outer: s.b,
                rows: s.sq,
                heads: s.h,
                d: s.d,
            },
        }
    }

    /// Rows over `outer`: row `r = o · rows + i` of head `h` is O's row `r · heads + h`.
    fn n(&self) -> usize {
        self.outer * self.rows
    }

    fn lse_index(&self, r: usize, h: usize) -> usize {
        (r / self.rows * self.heads + h) * self.rows + r % self.rows
    }

    /// `[n, rows, heads, d]`, the kernels' sizes.
    #[cfg(feature = "cuda")]
    fn sizes(&self) -> [usize; 4] {
        [self.n(), self.rows, self.heads, self.d]
    }
}

/// Checks the sinks of a call with `heads` query heads against q: shape `(num_heads)`, a float
/// dtype (read in f32), q's device. Any value is allowed: `-inf` is no sink, NaN propagates
/// to the rows of its head.
pub(crate) fn check(sinks: &Tensor, q: &Tensor, heads: usize) -> Result<()> {
    if sinks.dims() != [heads] {
        bail!(
            "sinks: expected shape (num_heads) = [{heads}], one logit per query head, got {:?}",
            sinks.dims()
        )
    }
    if !matches!(sinks.dtype(), DType::F32 | DType::F16 | DType::BF16) {
        bail!(
            "sinks: expected dtype F32, F16 or BF16, got {:?}",
            sinks.dtype()
        )
    }
    if !sinks.device().same_device(q.device()) {
        bail!(
            "sinks: expected the same device as q ({:?}), got {:?}",
            q.device().location(),
            sinks.device().location()
        )
    }
    Ok(())
}

/// The sinks as the kernels read them: f32, contiguous, outside any graph.
pub(crate) fn values(sinks: &Tensor) -> Result<Tensor> {
    sinks.detach().to_dtype(DType::F32)?.contiguous()
}

/// `log(exp(a) + exp(b))`: the other where one is `-inf`, NaN where either is.
fn log_add_exp(a: f32, b: f32) -> f32 {
    if a == f32::NEG_INFINITY {
        return b;
    }
    if b == f32::NEG_INFINITY {
        return a;
    }
    if a == b {
        // Also +inf + +inf, where a - b is NaN.
        return a + std::f32::consts::LN_2;
    }
    a.max(b) + (-(a - b).abs()).exp().ln_1p()
}

/// The keys' share `exp(lse - L)` of a row's new denominator: 0 where the row saw no key
/// (`lse = -inf`; its output is zero and stays so), unless a NaN sink made `L` NaN.
fn keys_share(lse: f32, l: f32) -> f32 {
    if lse == f32::NEG_INFINITY && !l.is_nan() {
        0.0
    } else {
        (lse - l).exp()
    }
}

/// The sink's share `exp(sink - L)` of a row's denominator: 0 for a sink of `-inf` (no sink),
/// also on rows without keys, where `L = -inf` too.
fn sink_share(sink: f32, l: f32) -> f32 {
    if sink == f32::NEG_INFINITY {
        0.0
    } else {
        (sink - l).exp()
    }
}

/// Turns a forward's `out` and `lse` (f32, in `layout`) into the result with `sinks` `(heads)`,
/// in place: `lse` becomes `L`, each row of `out` is scaled by `exp(lse - L)`.
pub(crate) fn fix_up_host(out: &mut [f32], lse: &mut [f32], sinks: &[f32], layout: SinkLayout) {
    let SinkLayout { heads, d, .. } = layout;
    for r in 0..layout.n() {
        for (h, &sink) in sinks.iter().enumerate() {
            let li = layout.lse_index(r, h);
            let l = log_add_exp(lse[li], sink);
            let share = keys_share(lse[li], l);
            out[(r * heads + h) * d..][..d]
                .iter_mut()
                .for_each(|o| *o *= share);
            lse[li] = l;
        }
    }
}

/// [`fix_up_host`] on the device: `out` f16/bf16 and `lse` f32, fresh and contiguous from
/// their first element; `sinks` f32 `(heads)` ([`values`]).
#[cfg(feature = "cuda")]
pub(crate) fn fix_up_cuda(
    out: &mut candle::CudaStorage,
    lse: &mut candle::CudaStorage,
    sinks: &Tensor,
    layout: SinkLayout,
) -> Result<()> {
    let (storage, l) = sinks.storage_and_layout();
    let candle::Storage::Cuda(s) = &*storage else {
        bail!("sinks: expected the device of the attention's output")
    };
    crate::train::sinks::fix_up(out, lse, (s, l), layout.sizes())
}

/// The sinks' gradient `(heads)` in f32: `-sum over rows of exp(sink_h - L) · rowsum(dO · O)`
/// over every row of head `h`, from the output `out`, its gradient `grad_out` (of `out`'s
/// shape and dtype), the final `lse` (`L`) and the sinks ([`values`]). Summed in a fixed
/// order on either device.
pub(crate) fn grad(
    out: &Tensor,
    grad_out: &Tensor,
    lse: &Tensor,
    sinks: &Tensor,
    layout: SinkLayout,
) -> Result<Tensor> {
    let (out, grad_out, lse) = (out.contiguous()?, grad_out.contiguous()?, lse.contiguous()?);
    match out.device() {
        Device::Cpu => {
            let host = |t: &Tensor| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
            let g = grad_host(
                &host(&out)?,
                &host(&grad_out)?,
                &host(&lse)?,
                &host(sinks)?,
                layout,
            );
            Tensor::from_vec(g, layout.heads, &Device::Cpu)
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            use candle::Storage;
            let (o, ol) = out.storage_and_layout();
            let (g, gl) = grad_out.storage_and_layout();
            let (l, ll) = lse.storage_and_layout();
            let (s, sl) = sinks.storage_and_layout();
            let (Storage::Cuda(o), Storage::Cuda(g), Storage::Cuda(l), Storage::Cuda(s)) =
                (&*o, &*g, &*l, &*s)
            else {
                bail!("sinks: out, grad_out, lse and sinks must share the CUDA device")
            };
            let d_sinks =
                crate::train::sinks::grad((o, ol), (g, gl), (l, ll), (s, sl), layout.sizes())?;
            Ok(Tensor::from_storage(
                Storage::Cuda(d_sinks),
                layout.heads,
                candle::op::BackpropOp::none(),
                false,
            ))
        }
        dev => bail!(
            "sinks: the gradient is computed on the CPU or CUDA, not {:?}",
            dev.location()
        ),
    }
}

/// [`grad`] on host slices, each row's term in f64.
fn grad_host(o: &[f32], d_o: &[f32], lse: &[f32], sinks: &[f32], layout: SinkLayout) -> Vec<f32> {
    let SinkLayout { heads, d, .. } = layout;
    let mut g = vec![0f64; heads];
    for r in 0..layout.n() {
        for (h, g) in g.iter_mut().enumerate() {
            let row = (r * heads + h) * d;
            let dot: f64 = o[row..][..d]
                .iter()
                .zip(&d_o[row..][..d])
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum();
            *g -= sink_share(sinks[h], lse[layout.lse_index(r, h)]) as f64 * dot;
        }
    }
    g.into_iter().map(|x| x as f32).collect()
}

/// `out` (the forward's output with sinks, fresh) in a graph that also reaches `sinks`, the
/// user's tensor: the backward gives `out`'s gradient through unchanged and the sinks theirs
/// ([`grad`]), in the sinks' dtype. Costs a copy of `out`: only for sinks that track
/// gradients.
pub(crate) fn with_grad(
    out: &Tensor,
    sinks: &Tensor,
    values: &Tensor,
    lse: &Tensor,
    layout: SinkLayout,
) -> Result<Tensor> {
    let op = SinkGrad {
        values: values.clone(),
        lse: lse.clone(),
        layout,
    };
    out.apply_op2(sinks, op)
}

/// The identity on `out` whose backward also yields the sinks' gradient.
struct SinkGrad {
    /// The sinks in f32 ([`values`]).
    values: Tensor,
    /// The final LSE, `L`.
    lse: Tensor,
    layout: SinkLayout,
}

impl CustomOp2 for SinkGrad {
    fn name(&self) -> &'static str {
        "flash-attn-sinks"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        _s2: &CpuStorage,
        _l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = cpu::to_storage(cpu::gather_f32(s1, l1)?, s1.dtype())?;
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle::CudaStorage,
        l1: &Layout,
        _s2: &candle::CudaStorage,
        _l2: &Layout,
    ) -> Result<(candle::CudaStorage, Shape)> {
        use candle::backend::BackendDevice;
        // SAFETY: copy_strided_src writes every element of the fresh buffer.
        let mut out = unsafe { s1.device().alloc_uninit(l1.shape(), s1.dtype())? };
        s1.copy_strided_src(&mut out, 0, l1)?;
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        out: &Tensor,
        sinks: &Tensor,
        _res: &Tensor,
        grad_out: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let d_sinks = grad(out, grad_out, &self.lse, &self.values, self.layout)?;
        Ok((
            Some(grad_out.clone()),
            Some(d_sinks.to_dtype(sinks.dtype())?),
        ))
    }
}
