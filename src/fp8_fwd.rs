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
use crate::quant::FP8_BLOCK_ROWS;
use crate::varlen::VarLen;

/// e4m3 elements per 16 bytes: the CUDA kernels' alignment of every stride but the last.
const E4M3_PER_16_BYTES: usize = 16;

/// The dequantization factors of one FP8 call, complete and checked: F32 on q's device,
/// contiguous from the start of their storage (offset 0), each of one of three forms:
/// `(1,)` (per tensor), `(heads,)` (per head: num_heads for q, num_heads_k for k and v) or
/// `(batch, heads, blocks)` (per block of [`FP8_BLOCK_ROWS`] rows of one sequence and head).
/// A stored e4m3 value, as f32, times its factor is the real value.
pub(crate) struct Fp8Descales {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
}

impl Fp8Descales {
    /// Element strides of a descale over (sequence, head, block of [`FP8_BLOCK_ROWS`] rows):
    /// the factor of row `r` of sequence `b`, head `h` is at `b s[0] + h s[1] + r / 128 s[2]`.
    pub fn strides(t: &Tensor) -> [usize; 3] {
        match *t.dims() {
            [1] => [0, 0, 0],
            [_] => [0, 1, 0],
            [_, h, nb] => [h * nb, nb, 1],
            _ => unreachable!("checked by check_descale"),
        }
    }
}

/// One descale on the host with its [`Fp8Descales::strides`].
struct HostDescale {
    data: Vec<f32>,
    strides: [usize; 3],
}

impl HostDescale {
    fn new(t: &Tensor) -> Result<Self> {
        Ok(Self {
            data: t.flatten_all()?.to_vec1()?,
            strides: Fp8Descales::strides(t),
        })
    }

    /// The factor of row `row` (of its sequence) of sequence `b`, head `head`.
    fn at(&self, b: usize, head: usize, row: usize) -> f32 {
        let [sb, sh, sr] = self.strides;
        self.data[b * sb + head * sh + row / FP8_BLOCK_ROWS * sr]
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
    if opts.fp8_v_transposed {
        bail!(
            "fp8_v_transposed: a transposed V is for F8E4M3 q, k and v, but {call} got q of \
             dtype {:?}; leave the option unset",
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
    let transposed = opts.fp8_v_transposed;
    if transposed && varlen.is_some() {
        bail!(
            "fp8_v_transposed: a transposed V is for fixed-length batches (forward, \
             forward_with_lse); with forward_varlen pass V as (total_k, num_heads_k, head_dim)"
        )
    }
    // A transposed V is checked against k on its own; the shapes against k in its place.
    let v_as = if transposed { k } else { v };
    let shape = match varlen {
        None => params::validate_shapes(q, k, v_as)?,
        Some(varlen) => params::validate_varlen_shapes(q, k, v_as, varlen)?,
    };
    params::check_head_dim(q.device(), shape.d, "q: head_dim")?;
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        params::check_last_dim_contiguous(t, name)?;
    }
    if transposed {
        check_transposed_v(v, &shape)?;
    }
    let out_dtype = opts.out_dtype.unwrap_or(DType::BF16);
    params::check_dtype(q.device(), out_dtype, "out_dtype:")?;
    let descales = checked_descales(opts, q, &shape, varlen.is_some())?;
    let problem = opts.problem(shape, varlen, q.device())?;
    if transposed && !q.device().is_cuda() {
        // The CPU op reads V as it is: the transposition undone first.
        let v = crate::quant::fp8_v_untransposed(v, shape.sk)?;
        return Fp8FwdOp::new(problem, descales, out_dtype, false).run(q, k, &v);
    }
    Fp8FwdOp::new(problem, descales, out_dtype, transposed).run(q, k, v)
}

/// A transposed V ([`FlashAttn::fp8_v_transposed`]): `(batch, num_heads_k, head_dim,
/// seqlen_k rounded up to 16)` on k's device, contiguous.
fn check_transposed_v(v: &Tensor, shape: &AttnShape) -> Result<()> {
    let want = [
        shape.b,
        shape.hk,
        shape.d,
        crate::quant::fp8_v_transposed_keys(shape.sk),
    ];
    if v.dims() != want || !v.is_contiguous() {
        bail!(
            "v: with fp8_v_transposed, V must be contiguous of shape {want:?} (batch, \
             num_heads_k, head_dim, seqlen_k rounded up to 16: candle_flash::quant::\
             fp8_v_transposed makes it), got shape {:?} with strides {:?}",
            v.dims(),
            v.stride()
        )
    }
    Ok(())
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
fn checked_descales(
    opts: &FlashAttn,
    q: &Tensor,
    shape: &AttnShape,
    varlen: bool,
) -> Result<Fp8Descales> {
    let Some(user) = &opts.fp8_descales else {
        let one = Tensor::ones(1, DType::F32, q.device())?;
        return Ok(Fp8Descales {
            q: one.clone(),
            k: one.clone(),
            v: one,
        });
    };
    let check = |t: &Tensor, name: &str, heads: (usize, &str), seqlen: usize| {
        let blocks = seqlen.div_ceil(FP8_BLOCK_ROWS);
        check_descale(t, name, heads, (shape.b, blocks), varlen, q)
    };
    Ok(Fp8Descales {
        q: check(&user.q, "q", (shape.h, "num_heads"), shape.sq)?,
        k: check(&user.k, "k", (shape.hk, "num_heads_k"), shape.sk)?,
        v: check(&user.v, "v", (shape.hk, "num_heads_k"), shape.sk)?,
    })
}

/// One descale: F32 on q's device, `(1,)`, `(heads,)` or `(batch, heads, blocks)` with
/// `blocks` = ceil(seqlen / [`FP8_BLOCK_ROWS`]) (variable-length batches: at least that for
/// the longest sequence). Returned detached, contiguous and at the start of its storage (the
/// kernel reads a plain array).
fn check_descale(
    t: &Tensor,
    name: &str,
    (heads, heads_name): (usize, &str),
    (batch, blocks): (usize, usize),
    varlen: bool,
    q: &Tensor,
) -> Result<Tensor> {
    let shape_ok = match *t.dims() {
        [n] => n == 1 || n == heads,
        [b, h, nb] => b == batch && h == heads && (nb == blocks || (varlen && nb > blocks)),
        _ => false,
    };
    if t.dtype() != DType::F32 || !shape_ok {
        let at_least = if varlen { "at least " } else { "" };
        bail!(
            "fp8_descales: {name}'s descale must be F32 of shape (1,) (per tensor), \
             ({heads},) (one per head, {heads_name}) or ({batch}, {heads}, {at_least}{blocks}) \
             (one per block of {FP8_BLOCK_ROWS} rows of each sequence and head), got {:?} of \
             shape {:?}",
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
    /// V comes transposed ([`FlashAttn::fp8_v_transposed`]; CUDA only: the CPU path undoes
    /// it before the op).
    v_transposed: bool,
    /// `(b, h, sq)` (packed: `(h, total_q)`) f32, written by `cpu_fwd` / `cuda_fwd`.
    lse: LseSlot,
}

impl Fp8FwdOp {
    fn new(problem: Problem, descales: Fp8Descales, out_dtype: DType, v_transposed: bool) -> Self {
        Self {
            problem,
            descales,
            out_dtype,
            v_transposed,
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
        if op.v_transposed {
            // `forward` undoes the transposition before a CPU call reaches the op.
            bail!("v: a transposed V on the CPU op; call FlashAttn::forward")
        }
        let q = cpu::gather_e4m3(s1, l1)?;
        let k = cpu::gather_e4m3(s2, l2)?;
        let v = cpu::gather_e4m3(s3, l3)?;
        let d = &op.descales;
        let descales = HostDescales {
            q: HostDescale::new(&d.q)?,
            k: HostDescale::new(&d.k)?,
            v: HostDescale::new(&d.v)?,
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
            op.v_transposed,
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
    q: HostDescale,
    k: HostDescale,
    v: HostDescale,
}

/// The FP8 forward on the CPU, the semantics of the op (see [`FlashAttn::fp8_descales`]).
/// `q` `(total_q, h, d)`, `k` and `v` `(total_k, hk, d)`: the stored e4m3 values as f32,
/// contiguous. Returns `out` shaped like `q` (f32, before the rounding to the output dtype)
/// and the natural-log LSE in the layout of [`Problem::lse_index`].
///
/// Per query head `h` of sequence `b` and query row `i` (K/V head `g = h / (num_heads /
/// num_heads_k)`), in f32, with `qd_i`, `kd_j`, `vd_j` the descales of row `i` and key `j`
/// (the same for every row but per block): `q_i = q8_i · qd_i`, `k_j = k8_j · kd_j`, `S_j =
/// scale · (q_i · k_j)` over the keys `j` the causal mask shows; `m = max_j S_j`; `P_j =
/// exp(S_j - m)`; `l = Σ_j P_j` (the unrounded P); `O_i = (Σ_j e4m3(256 P_j) / 256 · vd_j ·
/// v8_j) / l`; `LSE_i = m + ln(l)`. A row that sees no key gets `O_i = 0`, `LSE_i = -inf`.
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
        // Row r of the sequence times its descale.
        let dequantized = |rows: Vec<f32>, descale: &HostDescale, head: usize| -> Vec<f32> {
            rows.chunks(s.d)
                .enumerate()
                .flat_map(|(r, row)| {
                    let f = descale.at(b, head, r);
                    row.iter().map(move |&x| x * f)
                })
                .collect()
        };
        let q = dequantized(cpu::head_rows(q, q0, sq, head, s.h, s.d), &descales.q, head);
        let k = dequantized(
            cpu::head_rows(k, k0, sk, kv_head, s.hk, s.d),
            &descales.k,
            kv_head,
        );
        let v = cpu::head_rows(v, k0, sk, kv_head, s.hk, s.d);
        let vd: Vec<f32> = (0..sk).map(|j| descales.v.at(b, kv_head, j)).collect();
        fwd_head(p, (sq, sk), &q, &k, &v, &vd)
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
/// `(sk, d)`, raw e4m3 `v` `(sk, d)` and each key's descale `vd` `(sk)`. Returns `(out (sq,
/// d), lse (sq))`. Two passes over each row's scores (max, then exponentials), so every
/// probability is rounded to e4m3 relative to the row's own maximum.
fn fwd_head(
    p: &Problem,
    (sq, sk): (usize, usize),
    q: &[f32],
    k: &[f32],
    v: &[f32],
    vd: &[f32],
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
            cpu::axpy(acc, p8 * vd[j], &v[j * d..][..d]);
        }
        let norm = 1.0 / l;
        acc.iter_mut().for_each(|o| *o *= norm);
        lse[i] = m + l.ln();
    }
    (out, lse)
}
