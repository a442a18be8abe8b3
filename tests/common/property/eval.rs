//! One case run twice: through our op ([`ours`]) and through the oracle ([`oracle`]), each
//! giving the output, the LSE (fixed-length and packed batches) and the gradients of
//! `sum(out · w)` with respect to the inputs (for strided inputs, of the views, read off the
//! gradient of the base tensor).
//!
//! The oracle is the crate's `attention_slow_with` (or `attention_slow_dropout`), run on each
//! sequence alone for packed and padded batches. Two parts are written here from the
//! definition, because the crate's oracle has no form for them: dropout combined with a
//! window, softcap, ALiBi or block mask (softmax over the visible keys, then the keep mask of
//! `dropout_mask` scaled by `1 / (1 - p)`), and the LSE. Their window rule is restated from
//! the docs (a side of -1, or at or past the sequence's key count, is open) and checked
//! against `attention_slow_with` in tests/cpu_property.rs.

use candle::{DType, Device, IndexOp, Result, Tensor, Var, D};
use candle_flash::{attention_slow_dropout, attention_slow_with, dropout_mask, FlashAttn};
use rand::{rngs::StdRng, SeedableRng};

use super::{normals, Batch, Config, Grad, View};

/// The inputs of a case: base tensors of which the op reads views (`Config::views`), and
/// the weight `w` of `sum(out · w)`, shaped like the output.
#[derive(Clone)]
pub struct Inputs {
    pub base: [Tensor; 3],
    pub w: Tensor,
}

/// What a run gives: the output, the LSE where the entry point returns one, and the
/// gradients (shaped like the views) where the case takes them.
#[derive(Clone)]
pub struct Outcome {
    pub out: Tensor,
    pub lse: Option<Tensor>,
    pub grads: Option<[Tensor; 3]>,
}

/// The logical shapes of q, k, v: `(b, sq, h, d)` and `(b, sk, hk, d)`, or packed
/// `(total_q, h, d)` and `(total_k, hk, d)`.
fn shapes(cfg: &Config) -> [Vec<usize>; 3] {
    let (q, kv) = match cfg.batch {
        Batch::Varlen { .. } => (vec![cfg.sq, cfg.h, cfg.d], vec![cfg.sk, cfg.hk, cfg.d]),
        _ => (
            vec![cfg.b, cfg.sq, cfg.h, cfg.d],
            vec![cfg.b, cfg.sk, cfg.hk, cfg.d],
        ),
    };
    [q, kv.clone(), kv]
}

/// The shape of the base tensor of which `view` of `dims` is taken.
fn base_dims(dims: &[usize], view: View) -> Vec<usize> {
    let (rows, heads, last) = (dims.len() - 3, dims.len() - 2, dims.len() - 1);
    let mut base = dims.to_vec();
    match view {
        View::Contiguous => {}
        View::HeadsMajor => base.swap(rows, heads),
        View::Rows { before, after } => base[rows] += before + after,
        View::Wide { pad, .. } => base[last] += pad,
    }
    base
}

/// `view` of `base` with logical shape `dims`: a strided tensor whose last dim is contiguous.
fn view_of(base: &Tensor, view: View, dims: &[usize]) -> Result<Tensor> {
    let (rows, heads, last) = (dims.len() - 3, dims.len() - 2, dims.len() - 1);
    match view {
        View::Contiguous => Ok(base.clone()),
        View::HeadsMajor => base.transpose(rows, heads),
        View::Rows { before, .. } => base.narrow(rows, before, dims[rows]),
        View::Wide { off, .. } => base.narrow(last, off, dims[last]),
    }
}

impl Inputs {
    /// Draws the inputs of `cfg` from its seed on the host, as `cfg.dtype` on `dev`.
    pub fn new(cfg: &Config, dev: &Device) -> Result<Self> {
        let rng = &mut StdRng::seed_from_u64(cfg.seed ^ 0xDA7A_DA7A);
        let shapes = shapes(cfg);
        let mut draw = |dims: Vec<usize>, amplitude: f32| -> Result<Tensor> {
            let n = dims.iter().product();
            Tensor::from_vec(normals(rng, n, amplitude), dims, dev)?.to_dtype(cfg.dtype)
        };
        let base = [
            draw(base_dims(&shapes[0], cfg.views[0]), cfg.amplitude)?,
            draw(base_dims(&shapes[1], cfg.views[1]), cfg.amplitude)?,
            draw(base_dims(&shapes[2], cfg.views[2]), 1.0)?,
        ];
        let w = draw(shapes[0].clone(), 1.0)?;
        Ok(Self { base, w })
    }

    /// The same values as `dtype` on `dev` (exact for the f32 reference).
    pub fn to(&self, dtype: DType, dev: &Device) -> Result<Self> {
        let to = |t: &Tensor| t.to_dtype(dtype)?.to_device(dev);
        let [q, k, v] = &self.base;
        Ok(Self {
            base: [to(q)?, to(k)?, to(v)?],
            w: to(&self.w)?,
        })
    }
}

/// The views of `base` (the inputs' bases, or their gradients) that the case reads.
fn views(cfg: &Config, base: &[Tensor; 3]) -> Result<[Tensor; 3]> {
    let shapes = shapes(cfg);
    Ok([
        view_of(&base[0], cfg.views[0], &shapes[0])?,
        view_of(&base[1], cfg.views[1], &shapes[1])?,
        view_of(&base[2], cfg.views[2], &shapes[2])?,
    ])
}

/// `f` on the views of `inputs`, with the gradients of `sum(out · w)` if the case takes
/// them: by autograd through variables of the base tensors. A tensor without a gradient
/// (an empty output, or a result that does not depend on it) gets zeros: a missing gradient
/// where the true one is not zero still fails the comparison.
fn run<F>(cfg: &Config, inputs: &Inputs, f: F) -> Result<Outcome>
where
    F: Fn(&[Tensor; 3]) -> Result<(Tensor, Option<Tensor>)>,
{
    if cfg.grad == Grad::None {
        let (out, lse) = f(&views(cfg, &inputs.base)?)?;
        return Ok(Outcome {
            out,
            lse,
            grads: None,
        });
    }
    let vars = [
        Var::from_tensor(&inputs.base[0])?,
        Var::from_tensor(&inputs.base[1])?,
        Var::from_tensor(&inputs.base[2])?,
    ];
    let bases = vars.each_ref().map(|v| v.as_tensor().clone());
    let (out, lse) = f(&views(cfg, &bases)?)?;
    let store = (&out * &inputs.w)?.sum_all()?.backward()?;
    let grad = |b: &Tensor| match store.get(b) {
        Some(g) => Ok(g.clone()),
        None => b.zeros_like(),
    };
    let grads = [grad(&bases[0])?, grad(&bases[1])?, grad(&bases[2])?];
    // Empty views become fresh zeros: Candle's `to_vec1` slices the storage at a view's
    // offset, which an empty narrowed tensor may have past its end.
    let grads = views(cfg, &grads)?.map(|g| match g.elem_count() {
        0 => g.zeros_like(),
        _ => Ok(g),
    });
    let [dq, dk, dv] = grads;
    Ok(Outcome {
        out,
        lse,
        grads: Some([dq?, dk?, dv?]),
    })
}

/// Our op on `inputs` (on `dev`), through the case's entry point.
pub fn ours(cfg: &Config, inputs: &Inputs, dev: &Device) -> Result<Outcome> {
    let opts = cfg.options(dev)?;
    let (varlen, paddings) = (cfg.varlen()?, cfg.paddings()?);
    if cfg.grad == Grad::Direct {
        let [q, k, v] = views(cfg, &inputs.base)?;
        let (out, lse) = opts.forward_with_lse(&q, &k, &v)?;
        let (dq, dk, dv) = opts.backward(&q, &k, &v, &out, &lse, &inputs.w)?;
        return Ok(Outcome {
            out,
            lse: Some(lse),
            grads: Some([dq, dk, dv]),
        });
    }
    run(cfg, inputs, |[q, k, v]| match (&varlen, &paddings) {
        (Some(varlen), _) => {
            let (out, lse) = opts.forward_varlen_with_lse(q, k, v, varlen)?;
            Ok((out, Some(lse)))
        }
        (_, Some((q_pad, kv_pad))) => Ok((opts.forward_padded(q, k, v, q_pad, kv_pad)?, None)),
        _ => {
            let (out, lse) = opts.forward_with_lse(q, k, v)?;
            Ok((out, Some(lse)))
        }
    })
}

/// The oracle on `inputs` (on `dev`, computing in their dtype): output and gradients, and
/// the LSE in f32 where our entry point returns one.
pub fn oracle(cfg: &Config, inputs: &Inputs, dev: &Device) -> Result<Outcome> {
    let keep = match cfg.dropout {
        Some((p, seed, offset)) => {
            let (mq, mk) = cfg.max_lens();
            Some(dropout_mask(p, seed, offset, cfg.b, cfg.h, mq, mk)?.to_device(dev)?)
        }
        None => None,
    };
    let mut outcome = run(cfg, inputs, |qkv| {
        Ok((
            per_sequence(cfg, qkv, dev, keep.as_ref(), false, slow)?,
            None,
        ))
    })?;
    if !matches!(cfg.batch, Batch::Padded { .. }) {
        let lse = per_sequence(cfg, &views(cfg, &inputs.base)?, dev, None, true, lse_slow)?;
        outcome.lse = Some(lse.to_dtype(DType::F32)?);
    }
    Ok(outcome)
}

/// The row dot products `sum_c a[., c] · b[., c]` of two output-shaped tensors, laid out like
/// the LSE of [`lse_grads`]: `(b, h, sq)`, or `(h, rows)` over the real rows of packed and
/// padded batches.
pub fn row_dots(cfg: &Config, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let dots = (a * b)?.sum(D::Minus1)?; // (b, sq, h) or (total_q, h)
    match &cfg.batch {
        Batch::Fixed => dots.transpose(1, 2)?.contiguous(),
        Batch::Varlen { .. } => dots.t()?.contiguous(),
        Batch::Padded { q_mask, .. } => {
            let real: Vec<u32> = (0..q_mask.len() as u32)
                .filter(|&i| q_mask[i as usize] != 0)
                .collect();
            let real = Tensor::from_slice(&real, real.len(), dots.device())?;
            let flat = dots.reshape((cfg.b * cfg.sq, cfg.h))?;
            flat.index_select(&real, 0)?.t()?.contiguous()
        }
    }
}

/// The gradients of `sum(weight · LSE)` with respect to the views of `inputs` (any float
/// dtype), by autograd through the LSE of the definition; `weight` is laid out as in
/// [`row_dots`].
///
/// It is what a change of the backward's `D_i = rowsum(dO_i ∘ O_i)` (FlashAttention-2
/// Algorithm 2, line 4) by `weight_i` does to dQ and dK: `dS_ij = P_ij (dP_ij - D_i)`, and
/// `P_ij` is the derivative of row i's LSE by `S_ij`. dV does not depend on D (zero here).
pub fn lse_grads(
    cfg: &Config,
    inputs: &Inputs,
    weight: &Tensor,
    dev: &Device,
) -> Result<[Tensor; 3]> {
    let cfg = Config {
        grad: Grad::Autograd,
        ..cfg.clone()
    };
    let inputs = Inputs {
        base: inputs.base.clone(),
        w: weight.clone(),
    };
    let outcome = run(&cfg, &inputs, |qkv| {
        Ok((per_sequence(&cfg, qkv, dev, None, true, lse_slow)?, None))
    })?;
    Ok(outcome.grads.expect("autograd"))
}

/// A per-sequence oracle: q `(b, sq, h, d)` (b = 1 for one sequence), k and v, the
/// options without dropout, and the keep mask `(b, h, sq, sk)` and `p` with dropout.
type SeqFn = fn(&Tensor, &Tensor, &Tensor, &FlashAttn, Option<(&Tensor, f32)>) -> Result<Tensor>;

/// `f` on the whole fixed-length batch, or on each sequence of a packed or padded batch as a
/// batch of one, put back together: packed outputs `(total_q, h, d)`, padded ones
/// `(b, sq, h, d)` with zero rows at the padding, and LSEs (`lse`: `f` gives `(1, h, len_q)`)
/// `(h, rows)` over the real rows in packed order.
fn per_sequence(
    cfg: &Config,
    [q, k, v]: &[Tensor; 3],
    dev: &Device,
    keep: Option<&Tensor>,
    lse: bool,
    f: SeqFn,
) -> Result<Tensor> {
    let p = cfg.dropout.map_or(0.0, |d| d.0);
    if let Batch::Fixed = cfg.batch {
        let keep = keep.cloned();
        return f(
            q,
            k,
            v,
            &cfg.options(dev)?.dropout(0.0),
            keep.as_ref().map(|t| (t, p)),
        );
    }
    let pads = cfg.paddings()?;
    let (h, d, dtype) = (cfg.h, cfg.d, q.dtype());
    let mut parts = vec![];
    for (b, (q0, lq, k0, lk)) in cfg.seqs().into_iter().enumerate() {
        if lq == 0 || lk == 0 {
            // No query (nothing to output) or no key (zeros, LSE -inf), whatever the options,
            // whose block mask could not even be made for it on CUDA (no empty tensors there).
            match (lse, &pads) {
                (true, _) if lq > 0 => {
                    let none = Tensor::full(f32::NEG_INFINITY, (h, lq), dev)?;
                    parts.push(none.to_dtype(dtype)?);
                }
                (false, Some(_)) => parts.push(Tensor::zeros((1, cfg.sq, h, d), dtype, dev)?),
                (false, None) if lq > 0 => parts.push(Tensor::zeros((lq, h, d), dtype, dev)?),
                _ => {}
            }
            continue;
        }
        let opts = cfg.options_with(dev, Some(b), (lq, lk))?.dropout(0.0);
        // Sequence b's dropout mask: the top-left corner of row b of the call's.
        let keep = keep
            .map(|t| t.narrow(0, b, 1)?.narrow(2, 0, lq)?.narrow(3, 0, lk))
            .transpose()?;
        let Some((q_pad, kv_pad)) = &pads else {
            let seq = |t: &Tensor, r0: usize, n: usize| t.narrow(0, r0, n)?.unsqueeze(0);
            let (qb, kb, vb) = (seq(q, q0, lq)?, seq(k, k0, lk)?, seq(v, k0, lk)?);
            parts.push(f(&qb, &kb, &vb, &opts, keep.as_ref().map(|t| (t, p)))?.squeeze(0)?);
            continue;
        };
        // The positions of sequence b's real tokens, in order.
        let positions = |pad: &candle_flash::Padding, s: usize| -> Vec<u32> {
            let flat = pad.indices().iter().filter(|&&i| i as usize / s == b);
            flat.map(|&i| i % s as u32).collect()
        };
        let (real_q, real_k) = (positions(q_pad, cfg.sq), positions(kv_pad, cfg.sk));
        let rows = |t: &Tensor, idx: &[u32]| -> Result<Tensor> {
            let t = t.i(b)?;
            if t.elem_count() == 0 {
                // No heads: Candle's index_select would read the view at its offset.
                let (_, heads, d) = t.dims3()?;
                return Tensor::zeros((1, idx.len(), heads, d), t.dtype(), dev);
            }
            let idx = Tensor::from_slice(idx, idx.len(), dev)?;
            t.contiguous()?.index_select(&idx, 0)?.unsqueeze(0)
        };
        if lse {
            let (qb, kb) = (rows(q, &real_q)?, rows(k, &real_k)?);
            parts.push(f(&qb, &kb, &kb, &opts, None)?.squeeze(0)?);
            continue;
        }
        let (qb, kb, vb) = (rows(q, &real_q)?, rows(k, &real_k)?, rows(v, &real_k)?);
        let out = f(&qb, &kb, &vb, &opts, keep.as_ref().map(|t| (t, p)))?.squeeze(0)?;
        // [real rows..., zero rows...] permuted into place: padded row s takes the real row
        // it holds, or a zero row.
        let zeros = Tensor::zeros((cfg.sq - lq, h, d), dtype, dev)?;
        let (mut next_real, mut next_pad) = (0u32, lq as u32);
        let perm: Vec<u32> = (0..cfg.sq as u32)
            .map(|s| {
                let n = if real_q.contains(&s) {
                    &mut next_real
                } else {
                    &mut next_pad
                };
                *n += 1;
                *n - 1
            })
            .collect();
        let perm = Tensor::from_slice(&perm, cfg.sq, dev)?;
        parts.push(
            Tensor::cat(&[&out, &zeros], 0)?
                .index_select(&perm, 0)?
                .unsqueeze(0)?,
        );
    }
    match (parts.is_empty(), lse) {
        (true, true) => Tensor::zeros((h, 0), dtype, dev),
        (true, false) => Tensor::zeros((0, h, d), dtype, dev),
        (false, true) => Tensor::cat(&parts, 1),
        (false, false) => Tensor::cat(&parts, 0),
    }
}

/// The crate's oracle: `attention_slow_with`; with dropout `attention_slow_dropout` where the
/// options have no window, cap, slopes or block mask, else [`dropout_slow`].
fn slow(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &FlashAttn,
    keep: Option<(&Tensor, f32)>,
) -> Result<Tensor> {
    let plain = opts.window_size == (-1, -1)
        && opts.softcap == 0.0
        && opts.alibi_slopes.is_none()
        && opts.block_mask.is_none();
    match keep {
        None => attention_slow_with(q, k, v, opts),
        Some((keep, p)) if plain => {
            let scale = opts
                .softmax_scale
                .unwrap_or(1.0 / (q.dim(3)? as f32).sqrt());
            attention_slow_dropout(q, k, v, scale, opts.causal, keep, p)
        }
        Some((keep, p)) => dropout_slow(q, k, v, opts, keep, p),
    }
}

/// The scores of the definition in q's dtype, `(b, h, sq, sk)`: `scale · q·k`, capped, biased,
/// `-inf` where the window, the causal mask or the block mask hide the key; and the rows that
/// see no key, 1 (else 0) in q's dtype, `(1, 1 or h, sq, 1)`. Needs `sq, sk > 0`.
fn scores(q: &Tensor, k: &Tensor, opts: &FlashAttn) -> Result<(Tensor, Tensor)> {
    let ((b, sq, h, d), (_, sk, hk, _)) = (q.dims4()?, k.dims4()?);
    let (dev, dtype) = (q.device(), q.dtype());
    let scale = opts.softmax_scale.unwrap_or(1.0 / (d as f32).sqrt()) as f64;
    let q = q.transpose(1, 2)?.contiguous()?;
    let k = heads(k, h, hk)?;
    let mut s = (q.matmul(&k.t()?)? * scale)?;
    if opts.softcap > 0.0 {
        let c = opts.softcap as f64;
        s = ((s / c)?.tanh()? * c)?;
    }
    let diag = |i: usize| i as i128 + sk as i128 - sq as i128;
    if let Some(slopes) = &opts.alibi_slopes {
        let rows = if slopes.rank() == 2 { b } else { 1 };
        let slopes = slopes.to_device(dev)?.reshape((rows, h, 1, 1))?;
        let dist: Vec<f32> = (0..sq)
            .flat_map(|i| (0..sk).map(move |j| (diag(i) - j as i128).abs() as f32))
            .collect();
        let dist = Tensor::from_vec(dist, (1, 1, sq, sk), dev)?;
        s = s.broadcast_add(&slopes.broadcast_mul(&dist)?.neg()?.to_dtype(dtype)?)?;
    }
    // Query i sees key j iff i + sk - sq - left <= j <= i + sk - sq + right, where a side
    // of -1 or at or past sk is open and causal sets right to 0.
    let open = |w: i64| w == -1 || w as i128 >= sk as i128;
    let (left, right) = (
        opts.window_size.0,
        if opts.causal { 0 } else { opts.window_size.1 },
    );
    let sees = |i: usize, j: usize| {
        let j = j as i128;
        (open(left) || j >= diag(i) - left as i128) && (open(right) || j <= diag(i) + right as i128)
    };
    let window: Vec<u8> = (0..sq)
        .flat_map(|i| (0..sk).map(move |j| u8::from(sees(i, j))))
        .collect();
    let mut visible = Tensor::from_vec(window, (1, sq, sk), dev)?;
    if let Some(mask) = &opts.block_mask {
        visible = visible.broadcast_mul(&mask.to_dense(sq, sk)?.to_device(dev)?)?;
    }
    let visible = visible.unsqueeze(0)?; // (1, 1 or h, sq, sk)
    let neg_inf = Tensor::new(f32::NEG_INFINITY, dev)?.to_dtype(dtype)?;
    let s = visible
        .broadcast_as(s.shape())?
        .where_cond(&s, &neg_inf.broadcast_as(s.shape())?)?;
    let dead = visible.max_keepdim(D::Minus1)?.eq(0u8)?.to_dtype(dtype)?;
    Ok((s, dead))
}

/// `(b, s, hk, d)` → `(b, h, s, d)`: query head `i` reads K/V head `i / (h / hk)`.
fn heads(x: &Tensor, h: usize, hk: usize) -> Result<Tensor> {
    let group = h / hk;
    let idx: Vec<u32> = (0..h).map(|i| (i / group) as u32).collect();
    let idx = Tensor::from_vec(idx, h, x.device())?;
    x.contiguous()?
        .index_select(&idx, 2)?
        .transpose(1, 2)?
        .contiguous()
}

/// The row max of `s` with dead rows' set to 0, detached (softmax does not depend on it), so
/// that `exp(s - max)` is 0 rather than NaN on rows that see no key.
fn safe_max(s: &Tensor, dead: &Tensor) -> Result<Tensor> {
    let max = s.max_keepdim(D::Minus1)?.detach();
    let dead = dead.to_dtype(DType::U8)?.broadcast_as(max.shape())?;
    dead.where_cond(&max.zeros_like()?, &max)
}

/// Dropout under any options, from the definition: the softmax over the visible keys, times
/// `keep / (1 - p)`, times v. Rows that see no key give zeros with zero gradients.
pub fn dropout_slow(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &FlashAttn,
    keep: &Tensor,
    p: f32,
) -> Result<Tensor> {
    let ((b, sq, h, d), (_, sk, hk, _)) = (q.dims4()?, k.dims4()?);
    if b * sq * h == 0 || sk == 0 {
        return Tensor::zeros((b, sq, h, d), q.dtype(), q.device());
    }
    let (s, dead) = scores(q, k, opts)?;
    let exp = s.broadcast_sub(&safe_max(&s, &dead)?)?.exp()?;
    let probs = exp.broadcast_div(&exp.sum_keepdim(D::Minus1)?.broadcast_add(&dead)?)?;
    let keep = keep.ne(0u8)?.to_dtype(q.dtype())?;
    let probs = ((probs * keep)? * (1.0 / (1.0 - p as f64)))?;
    probs.matmul(&heads(v, h, hk)?)?.transpose(1, 2)
}

/// The natural-log LSE of the scores of the definition, `(b, h, sq)` in q's dtype, `-inf` on
/// rows that see no key (v and the dropout mask play no part: the LSE is that of the
/// probabilities before dropout).
pub fn lse_slow(
    q: &Tensor,
    k: &Tensor,
    _v: &Tensor,
    opts: &FlashAttn,
    _keep: Option<(&Tensor, f32)>,
) -> Result<Tensor> {
    let ((b, sq, h, _), sk) = (q.dims4()?, k.dim(1)?);
    if b * sq * h == 0 {
        return Tensor::zeros((b, h, sq), q.dtype(), q.device());
    }
    if sk == 0 {
        return Tensor::full(f32::NEG_INFINITY, (b, h, sq), q.device())?.to_dtype(q.dtype());
    }
    let (s, dead) = scores(q, k, opts)?;
    let max = safe_max(&s, &dead)?;
    let sum = s.broadcast_sub(&max)?.exp()?.sum_keepdim(D::Minus1)?;
    sum.log()?.broadcast_add(&max)?.squeeze(D::Minus1)
}
