//! The FP8 (e4m3) forward: `CustomOp3` over q, k, v in `DType::F8E4M3`, with dequantization
//! factors ("descales") and an output in BF16, F16 (or F32 on the CPU). Inference only: the
//! op keeps the row log-sum-exp for [`crate::FlashAttn::forward_with_lse`], and its backward
//! is an error.
//!
//! The CPU path ([`attn_fwd_fp8`]) defines the semantics the CUDA kernel
//! (`crate::cuda::fwd_fp8`) implements, FlashAttention-3's FP8 forward (§3.3): scores from the
//! dequantized q and k, the softmax's numerator rounded to e4m3 before it multiplies the raw
//! e4m3 V, V's descale applied with the normalisation at the end. The public contract is on
//! [`crate::FlashAttn::fp8_descales`].

use std::sync::Arc;

use candle::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};
use float8::F8E4M3;

use crate::cpu;
use crate::fwd::LseSlot;
use crate::layout::aligned_to;
use crate::options::FlashAttn;
use crate::params::{self, AttnShape, Problem};
use crate::varlen::VarLen;

/// e4m3 elements per 16 bytes: the CUDA kernels' alignment of every stride but the last.
const E4M3_PER_16_BYTES: usize = 16;

/// The dequantization factors of one FP8 call, complete and checked: F32, rank 1, on q's
/// device, contiguous from the start of their storage (offset 0); `q` of length 1 (per
/// tensor) or num_heads (per query head), `k` and `v` of length 1 or num_heads_k (per K/V
/// head). A stored e4m3 value, as f32, times its factor is the real value.
pub(crate) struct Fp8Descales {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
}

/// The factor of `head` in a descale vector of length 1 (per tensor) or one per head.
fn descale_of(descale: &[f32], head: usize) -> f32 {
    if descale.len() == 1 {
        descale[0]
    } else {
        descale[head]
    }
}

/// Whether a call is an FP8 one: any of q, k, v in F8E4M3 (the others are then an error that
/// names them, [`check_dtypes`]).
pub(crate) fn is_fp8(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    [q, k, v].iter().any(|t| t.dtype() == DType::F8E4M3)
}

/// The options only FP8 calls take: an error naming them for any other call.
pub(crate) fn refuse_fp8_options(opts: &FlashAttn, q: &Tensor, call: &str) -> Result<()> {
    if opts.fp8_descales.is_some() {
        bail!(
            "fp8_descales: the dequantization factors are for F8E4M3 q, k and v, but {call} \
             got q of dtype {:?}; leave the option unset",
            q.dtype()
        )
    }
    if let Some(dt) = opts.out_dtype {
        bail!(
            "out_dtype: the output dtype ({dt:?}) is an option of F8E4M3 q, k and v, but {call} \
             got q of dtype {:?}, whose output has q's dtype; leave the option unset",
            q.dtype()
        )
    }
    Ok(())
}

/// [`FlashAttn::forward_with_lse`] (`varlen` None) and [`FlashAttn::forward_varlen_with_lse`]
/// with F8E4M3 inputs: every check, then the op.
pub(crate) fn forward(
    opts: &FlashAttn,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    varlen: Option<&VarLen>,
) -> Result<(Tensor, Tensor)> {
    check_dtypes(q, k, v)?;
    refuse_unsupported(opts)?;
    let shape = match varlen {
        None => params::validate_shapes(q, k, v)?,
        Some(varlen) => params::validate_varlen_shapes(q, k, v, varlen)?,
    };
    params::check_head_dim(q.device(), shape.d, "q: head_dim")?;
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        params::check_last_dim_contiguous(t, name)?;
    }
    let out_dtype = opts.out_dtype.unwrap_or(DType::BF16);
    params::check_dtype(q.device(), out_dtype, "out_dtype:")?;
    let descales = checked_descales(opts, q, &shape)?;
    let problem = opts.problem(shape, varlen, q.device())?;
    Fp8FwdOp::new(problem, descales, out_dtype).run(q, k, v)
}

/// All three of q, k, v in F8E4M3; the error names the first that is not.
fn check_dtypes(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<()> {
    let fp8 = [("q", q), ("k", k), ("v", v)]
        .into_iter()
        .find(|(_, t)| t.dtype() == DType::F8E4M3)
        .map_or("q", |(name, _)| name);
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        if t.dtype() != DType::F8E4M3 {
            bail!(
                "{name}: dtype {:?}, but {fp8} is F8E4M3; FP8 attention takes q, k and v all \
                 F8E4M3 (candle_flash::quant::quantize_fp8 makes them)",
                t.dtype()
            )
        }
    }
    Ok(())
}

/// The options the FP8 forward does not implement: an error naming the first one set.
fn refuse_unsupported(opts: &FlashAttn) -> Result<()> {
    let set = [
        ("dropout_p", opts.dropout_p != 0.0),
        ("window_size", opts.window_size != (-1, -1)),
        ("softcap", opts.softcap != 0.0),
        ("alibi_slopes", opts.alibi_slopes.is_some()),
        ("block_mask", opts.block_mask.is_some()),
        ("sinks", opts.sinks.is_some()),
        ("rotary", opts.rotary.is_some()),
        ("kv_cache_scales", opts.kv_cache_scales.is_some()),
    ];
    if let Some((name, _)) = set.iter().find(|(_, on)| *on) {
        bail!(
            "{name}: not supported with FP8 (F8E4M3) inputs, whose forward takes causal, \
             softmax_scale, MQA/GQA and variable-length batches only; run {name} with BF16 or \
             F16 inputs"
        )
    }
    Ok(())
}

/// The call's descales: the user's, checked (F32 `(1,)` or one per head, on q's device), or
/// 1 for all three.
fn checked_descales(opts: &FlashAttn, q: &Tensor, shape: &AttnShape) -> Result<Fp8Descales> {
    let Some(user) = &opts.fp8_descales else {
        let one = Tensor::ones(1, DType::F32, q.device())?;
        return Ok(Fp8Descales {
            q: one.clone(),
            k: one.clone(),
            v: one,
        });
    };
    Ok(Fp8Descales {
        q: check_descale(&user.q, "q", (shape.h, "num_heads"), q)?,
        k: check_descale(&user.k, "k", (shape.hk, "num_heads_k"), q)?,
        v: check_descale(&user.v, "v", (shape.hk, "num_heads_k"), q)?,
    })
}

/// One descale: F32, `(1,)` or `(heads,)`, on q's device. Returned detached, contiguous and
/// at the start of its storage (the kernel reads a plain array).
fn check_descale(
    t: &Tensor,
    name: &str,
    (heads, heads_name): (usize, &str),
    q: &Tensor,
) -> Result<Tensor> {
    let shape_ok = matches!(t.dims(), &[n] if n == 1 || n == heads);
    if t.dtype() != DType::F32 || !shape_ok {
        bail!(
            "fp8_descales: {name}'s descale must be F32 of shape (1,) (per tensor) or \
             ({heads},) (one per head, {heads_name}), got {:?} of shape {:?}",
            t.dtype(),
            t.dims()
        )
    }
    if !t.device().same_device(q.device()) {
        bail!(
            "fp8_descales: {name}'s descale must be on q's device ({:?}), got {:?}",
            q.device().location(),
            t.device().location()
        )
    }
    let t = t.detach().contiguous()?;
    if t.layout().start_offset() == 0 {
        Ok(t)
    } else {
        t.force_contiguous()
    }
}

/// The FP8 forward op over (q, k, v). Like [`crate::fwd::FlashAttnOp`] it keeps the LSE of
/// its run, read back by [`Fp8FwdOp::run`].
struct Fp8FwdOp {
    problem: Problem,
    descales: Fp8Descales,
    out_dtype: DType,
    /// `(b, h, sq)` (packed: `(h, total_q)`) f32, written by `cpu_fwd` / `cuda_fwd`.
    lse: LseSlot,
}

impl Fp8FwdOp {
    fn new(problem: Problem, descales: Fp8Descales, out_dtype: DType) -> Self {
        Self {
            problem,
            descales,
            out_dtype,
            lse: LseSlot::default(),
        }
    }

    /// Runs the op, returning `(out, lse)`.
    fn run(self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let s = self.problem.shape;
        if s.total_q * s.h == 0 {
            // Nothing to compute: every output dimension product is zero.
            let out = Tensor::zeros(self.problem.q_shape(), self.out_dtype, q.device())?;
            let lse = Tensor::zeros(self.problem.lse_shape(), DType::F32, q.device())?;
            return Ok((out, lse));
        }
        let align = |t: &Tensor| aligned_to(t, E4M3_PER_16_BYTES);
        let (q, k, v) = (align(q)?, align(k)?, align(v)?);
        let op = Arc::new(self);
        let out = q.apply_op3_arc(&k, &v, Arc::new(Box::new(OpHandle(op.clone()))))?;
        Ok((out, op.lse.get()?))
    }
}

/// `apply_op3_arc` takes ownership of a boxed op; the handle shares the op with `run`, which
/// reads the LSE back after the launch.
struct OpHandle(Arc<Fp8FwdOp>);

impl CustomOp3 for OpHandle {
    fn name(&self) -> &'static str {
        "flash-attn-fp8"
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
        let q = cpu::gather_e4m3(s1, l1)?;
        let k = cpu::gather_e4m3(s2, l2)?;
        let v = cpu::gather_e4m3(s3, l3)?;
        let d = &op.descales;
        let descales = HostDescales {
            q: d.q.to_vec1()?,
            k: d.k.to_vec1()?,
            v: d.v.to_vec1()?,
        };
        let (out, lse) = attn_fwd_fp8(&op.problem, &descales, &q, &k, &v);
        let lse = Tensor::from_vec(lse, op.problem.lse_shape(), &candle::Device::Cpu)?;
        op.lse.store(lse)?;
        Ok((cpu::to_storage(out, op.out_dtype)?, op.problem.q_shape()))
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
        let (out, lse) = crate::cuda::fwd_fp8(
            &op.problem,
            &op.descales,
            op.out_dtype,
            (s1, l1),
            (s2, l2),
            (s3, l3),
        )?;
        let lse = crate::fwd::detached(lse, op.problem.lse_shape());
        op.lse.store(lse)?;
        Ok((out, op.problem.q_shape()))
    }

    fn bwd(
        &self,
        _q: &Tensor,
        _k: &Tensor,
        _v: &Tensor,
        _out: &Tensor,
        _grad_out: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        bail!(
            "backward: the FP8 (F8E4M3) forward is inference only and has no backward pass; \
             train with BF16 or F16 q, k and v"
        )
    }
}

/// The descales on the host.
struct HostDescales {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

/// The FP8 forward on the CPU, the semantics of the op (see [`FlashAttn::fp8_descales`]).
/// `q` `(total_q, h, d)`, `k` and `v` `(total_k, hk, d)`: the stored e4m3 values as f32,
/// contiguous. Returns `out` shaped like `q` (f32, before the rounding to the output dtype)
/// and the natural-log LSE in the layout of [`Problem::lse_index`].
///
/// Per query head `h` of sequence `b` and query row `i` (K/V head `g = h / (num_heads /
/// num_heads_k)`), in f32: `q_i = q8_i · qd[h]`, `k_j = k8_j · kd[g]`, `S_j = scale · (q_i ·
/// k_j)` over the keys `j` the causal mask shows; `m = max_j S_j`; `P_j = exp(S_j - m)`;
/// `l = Σ_j P_j` (the unrounded P); `O_i = (Σ_j e4m3(256 P_j) / 256 · v8_j) · (vd[g] / l)`;
/// `LSE_i = m + ln(l)`. A row that sees no key gets `O_i = 0`, `LSE_i = -inf`.
fn attn_fwd_fp8(
    p: &Problem,
    descales: &HostDescales,
    q: &[f32],
    k: &[f32],
    v: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let s = p.shape;
    let work: usize = (0..s.b).map(|b| p.seq_q(b).1 * p.seq_k(b).1).sum();
    // One task per (sequence, head); task t = b * h + head.
    let heads = cpu::par_map(s.b * s.h, work * s.h * s.d, |t| {
        let (b, head) = (t / s.h, t % s.h);
        let ((q0, sq), (k0, sk)) = (p.seq_q(b), p.seq_k(b));
        let kv_head = head / s.group();
        let dequantized = |rows: Vec<f32>, descale: f32| -> Vec<f32> {
            rows.into_iter().map(|x| x * descale).collect()
        };
        let q = dequantized(
            cpu::head_rows(q, q0, sq, head, s.h, s.d),
            descale_of(&descales.q, head),
        );
        let k = dequantized(
            cpu::head_rows(k, k0, sk, kv_head, s.hk, s.d),
            descale_of(&descales.k, kv_head),
        );
        let v = cpu::head_rows(v, k0, sk, kv_head, s.hk, s.d);
        fwd_head(p, (sq, sk), &q, &k, &v, descale_of(&descales.v, kv_head))
    });
    let mut out = vec![0f32; s.q_elems()];
    let mut lse = vec![f32::NEG_INFINITY; s.h * s.total_q];
    for (t, (o, l)) in heads.into_iter().enumerate() {
        let (b, head) = (t / s.h, t % s.h);
        let (q0, sq) = p.seq_q(b);
        cpu::put_head_rows(&mut out, &o, q0, sq, head, s.h, s.d);
        lse[p.lse_index(b, head, 0)..][..sq].copy_from_slice(&l);
    }
    (out, lse)
}

/// One query head of one sequence, `(sq, sk)` rows: dequantized `q` `(sq, d)` and `k`
/// `(sk, d)`, raw e4m3 `v` `(sk, d)` and its descale `vd`. Returns `(out (sq, d), lse (sq))`.
/// Two passes over each row's scores (max, then exponentials), so every probability is rounded
/// to e4m3 relative to the row's own maximum.
fn fwd_head(
    p: &Problem,
    (sq, sk): (usize, usize),
    q: &[f32],
    k: &[f32],
    v: &[f32],
    vd: f32,
) -> (Vec<f32>, Vec<f32>) {
    let d = p.shape.d;
    let mut out = vec![0f32; sq * d];
    let mut lse = vec![f32::NEG_INFINITY; sq];
    let mut scores = Vec::with_capacity(sk);
    for i in 0..sq {
        let (lo, hi) = p.key_range(i, sq, sk);
        if hi <= lo {
            continue; // no key: zeros and -inf
        }
        let q_i = &q[i * d..][..d];
        scores.clear();
        scores.extend((lo..hi).map(|j| p.scale * cpu::dot(q_i, &k[j * d..][..d])));
        let m = scores.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let acc = &mut out[i * d..][..d];
        let mut l = 0f32;
        for (j, &s_j) in (lo..hi).zip(&scores) {
            let p_j = (s_j - m).exp();
            l += p_j;
            // The kernel's offset: P in [0, 256] (sm90/softmax_fp8.cuh), exact powers of two.
            let p8 = F8E4M3::from_f32(p_j * 256.0).to_f32() / 256.0;
            cpu::axpy(acc, p8, &v[j * d..][..d]);
        }
        let norm = vd / l;
        acc.iter_mut().for_each(|o| *o *= norm);
        lse[i] = m + l.ln();
    }
    (out, lse)
}
