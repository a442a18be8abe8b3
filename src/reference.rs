//! `attention_slow`: attention in plain Candle ops, the oracle the tests compare against.

use candle::{bail, DType, Result, Tensor, D};

use crate::options::FlashAttn;
use crate::params;
use crate::score_mod::ScoreMods;
use crate::BlockMask;

/// Attention computed the obvious way, `softmax(scale · q kᵀ + mask) v`, in plain Candle ops:
/// the reference that [`crate::flash_attn`] is tested against.
///
/// Same contract as [`crate::FlashAttn::forward`]:
/// - `q`: `(batch, seqlen_q, num_heads, head_dim)`;
/// - `k`, `v`: `(batch, seqlen_k, num_heads_k, head_dim)` with `num_heads % num_heads_k == 0`
///   (query head `h` reads K/V head `h / (num_heads / num_heads_k)`);
/// - `causal`: query `i` sees key `j` iff `j <= i + seqlen_k - seqlen_q` (bottom-right);
///   query rows that see no key give zeros, not NaN;
/// - returns `(batch, seqlen_q, num_heads, head_dim)` in the input dtype.
///
/// Unlike the fast op it accepts any float dtype on any device, head_dims above 256 and any strides,
/// and it computes in the input dtype, so in f16/bf16 it is also "the same math at low
/// precision" that the tests' error budgets are measured against. It materialises the
/// `(batch, num_heads, seqlen_q, seqlen_k)` score matrix. It is differentiable with Candle's
/// autograd, including through fully masked rows.
///
/// Errors: the shape, dtype and device mismatches that [`crate::flash_attn`] reports, and a
/// `softmax_scale` that is not finite and positive.
pub fn attention_slow(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    slow(q, k, v, &SlowOpts::plain(softmax_scale, causal), None)
}

/// [`attention_slow`] with dropout given as a mask: the probabilities are multiplied by
/// `keep / (1 - dropout_p)` after the softmax. With `keep` from [`crate::dropout_mask`] and
/// the same `dropout_p`, seed and offset, this is what [`crate::FlashAttn::forward`] with
/// [`crate::FlashAttn::dropout`] computes: the oracle for dropout tests.
///
/// - `keep`: `(batch, num_heads, seqlen_q, seqlen_k)` on q's device, any dtype, 1 (or any
///   nonzero value) keeps an entry, 0 drops it; it is used as a constant (no gradient);
/// - `dropout_p` in `[0, 1)`;
/// - the rest as in [`attention_slow`]; differentiable with Candle's autograd.
///
/// Errors: those of [`attention_slow`], a `keep` of another shape or device, `dropout_p`
/// outside `[0, 1)`.
pub fn attention_slow_dropout(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    causal: bool,
    keep: &Tensor,
    dropout_p: f32,
) -> Result<Tensor> {
    let opts = SlowOpts::plain(softmax_scale, causal);
    slow(q, k, v, &opts, Some((keep, dropout_p)))
}

/// [`attention_slow`] with the options of a [`FlashAttn`]: the oracle for
/// [`FlashAttn::forward`] with a sliding window, softcapping, ALiBi or a block mask.
///
/// For query `i` and key `j`, with `off = seqlen_k - seqlen_q` (bottom-right alignment):
/// - `softmax_scale` (default `1 / sqrt(head_dim)`): `s = scale · q_i·k_j`;
/// - `softcap` `c > 0`: `s = c · tanh(s / c)`;
/// - `alibi_slopes` `(num_heads)` or `(batch, num_heads)`: `s -= slope · |i + off - j|`;
/// - `window_size = (left, right)` and `causal` (which sets right to 0): `j` is visible iff
///   `i + off - left <= j <= i + off + right`, -1 or a side `>= seqlen_k` leaving it
///   unbounded;
/// - `block_mask`: moreover, `j` is visible to query head `h` only where
///   [`BlockMask::to_dense`]`(seqlen_q, seqlen_k)` is 1 at `(h, i, j)` (at `(0, i, j)` for a
///   mask shared by all heads);
/// - `sinks` `(num_heads)`: one more column of every row of head `h` with the score
///   `sinks[h]` as it is (no scale, cap, bias or mask), in the softmax and then dropped,
///   having no value;
///
/// then the softmax over the visible keys (and the sink). Rows that see no key (nor a finite
/// sink) give zeros, with finite (zero) gradients. `deterministic`, `seed` and `rng_offset`
/// are ignored.
///
/// Computed in the input dtype with plain Candle ops, like [`attention_slow`] (any float dtype
/// on any device, any strides), and differentiable with Candle's autograd: through the tanh of
/// the softcap and to the sinks; the ALiBi bias is a constant. The mask and bias are built from the definition
/// above (the block mask through its dense form), not from the kernels' code.
///
/// Errors: those of [`attention_slow`]; those [`FlashAttn::forward`] reports for
/// `window_size`, `softcap`, `alibi_slopes` (which must be f32 on q's device), `block_mask`
/// (whose blocks must cover the call, on q's device) and `sinks`; and `dropout_p` other than
/// 0 (the dropout mask is not a function of the options here: use [`attention_slow_dropout`]
/// with [`crate::dropout_mask`]).
///
/// ```
/// # fn main() -> candle::Result<()> {
/// use candle::{Device, Tensor};
/// use candle_flash::{attention_slow_with, FlashAttn};
/// let dev = Device::Cpu;
/// let q = Tensor::randn(0f32, 1.0, (1, 16, 4, 32), &dev)?;
/// let k = Tensor::randn(0f32, 1.0, (1, 16, 2, 32), &dev)?;
/// let v = Tensor::randn(0f32, 1.0, (1, 16, 2, 32), &dev)?;
/// let slopes = Tensor::new(&[0.5f32, 0.25, 0.125, 0.0625], &dev)?;
/// let attn = FlashAttn::new()
///     .causal(true)
///     .window(Some(4), None)
///     .softcap(30.0)
///     .alibi_slopes(&slopes);
/// let ours = attn.forward(&q, &k, &v)?;
/// let expected = attention_slow_with(&q, &k, &v, &attn)?;
/// let err = (ours - expected)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(err < 1e-5);
/// # Ok(()) }
/// ```
pub fn attention_slow_with(q: &Tensor, k: &Tensor, v: &Tensor, opts: &FlashAttn) -> Result<Tensor> {
    if opts.dropout_p != 0.0 {
        bail!(
            "dropout_p: attention_slow_with does not draw dropout masks, got {}; use \
             attention_slow_dropout with the mask from dropout_mask",
            opts.dropout_p
        )
    }
    let opts = SlowOpts {
        scale: opts.softmax_scale,
        causal: opts.causal,
        window: opts.window_size,
        softcap: opts.softcap,
        alibi: opts.alibi_slopes.as_ref(),
        block_mask: opts.block_mask.as_ref(),
        sinks: opts.sinks.as_ref(),
    };
    slow(q, k, v, &opts, None)
}

/// The oracle's options, as the user gave them (unvalidated).
struct SlowOpts<'a> {
    /// `None`: `1 / sqrt(head_dim)`.
    scale: Option<f32>,
    causal: bool,
    /// FlashAttention 2's `window_size`, -1 = unbounded.
    window: (i64, i64),
    /// 0 = none.
    softcap: f32,
    alibi: Option<&'a Tensor>,
    block_mask: Option<&'a BlockMask>,
    /// `(h)`: one more score per row, with no value.
    sinks: Option<&'a Tensor>,
}

impl SlowOpts<'_> {
    /// Scale and causal mask only.
    fn plain(scale: f32, causal: bool) -> Self {
        Self {
            scale: Some(scale),
            causal,
            window: (-1, -1),
            softcap: 0.0,
            alibi: None,
            block_mask: None,
            sinks: None,
        }
    }
}

fn slow(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    opts: &SlowOpts,
    dropout: Option<(&Tensor, f32)>,
) -> Result<Tensor> {
    let shape = params::validate_shapes(q, k, v)?;
    let softmax_scale = opts.scale.unwrap_or(1.0 / (shape.d as f32).sqrt());
    params::check_scale(softmax_scale)?;
    // The kernels' checks, for the same errors; the values below are taken from `opts`, not
    // from what the check returns, so that a wrong rule there cannot agree with itself here.
    ScoreMods::new(
        opts.causal,
        opts.window,
        opts.softcap,
        opts.alibi,
        &shape,
        q.device(),
    )?;
    if let Some(mask) = opts.block_mask {
        mask.check(&shape, q.device())?;
    }
    if let Some(sinks) = opts.sinks {
        crate::sinks::check(sinks, q, shape.h)?;
    }
    if let Some((keep, p)) = dropout {
        params::check_dropout(p)?;
        let expected = [shape.b, shape.h, shape.sq, shape.sk];
        if keep.dims() != expected {
            bail!(
                "keep: expected shape (batch, num_heads, seqlen_q, seqlen_k) = {expected:?}, got {:?}",
                keep.dims()
            )
        }
        if !keep.device().same_device(q.device()) {
            bail!(
                "keep: expected the same device as q ({:?}), got {:?}",
                q.device().location(),
                keep.device().location()
            )
        }
    }
    let (b, sq, sk, h, d) = (shape.b, shape.sq, shape.sk, shape.h, shape.d);
    let (dev, dtype) = (q.device(), q.dtype());
    if b * sq * h == 0 || sk == 0 {
        // No query, or no key to attend to: every row is empty or fully masked (a sink has no
        // value). With sinks, through them, so that they get their (zero) gradient and a NaN
        // one makes its head NaN.
        let zeros = Tensor::zeros((b, sq, h, d), dtype, dev)?;
        return match opts.sinks {
            Some(s) => {
                let zero = (s.to_dtype(dtype)?.clamp(-1f32, 1f32)? * 0.0)?;
                zeros.broadcast_add(&zero.reshape((1, 1, h, 1))?)
            }
            None => Ok(zeros),
        };
    }
    let q = q.transpose(1, 2)?.contiguous()?; // (b, h, sq, d)
    let k = repeat_kv(k, shape.group())?.transpose(1, 2)?.contiguous()?; // (b, h, sk, d)
    let v = repeat_kv(v, shape.group())?.transpose(1, 2)?.contiguous()?; // (b, h, sk, d)
    let mut scores = (q.matmul(&k.t()?)? * softmax_scale as f64)?; // (b, h, sq, sk)
    if opts.softcap > 0.0 {
        let c = opts.softcap as f64;
        scores = ((scores / c)?.tanh()? * c)?;
    }
    if let Some(slopes) = opts.alibi {
        scores = scores.broadcast_add(&alibi_bias(slopes, h, sq, sk, dtype)?)?;
    }

    // Which keys each query sees, u8 (1 or h, sq, sk), 1 = visible; None: every key.
    let mut visible: Option<Tensor> = None;
    // A side of -1, or at or past the keys (FlashAttention 2's rule), is open.
    let open = |w: i64| w == -1 || w as i128 >= sk as i128;
    let (left, right) = (opts.window.0, if opts.causal { 0 } else { opts.window.1 });
    if !open(left) || !open(right) {
        // Bottom-right alignment, in 128-bit arithmetic (sides reach i64::MAX): query i sees
        // key j iff i + sk - sq - left <= j <= i + sk - sq + right.
        let sees = |i: usize, j: usize| {
            let (diag, j) = (i as i128 + sk as i128 - sq as i128, j as i128);
            (open(left) || j >= diag - left as i128) && (open(right) || j <= diag + right as i128)
        };
        let window: Vec<u8> = (0..sq)
            .flat_map(|i| (0..sk).map(move |j| u8::from(sees(i, j))))
            .collect();
        visible = Some(Tensor::from_vec(window, (1, sq, sk), dev)?);
    }
    if let Some(mask) = opts.block_mask {
        // The mask's dense form, (1 or h, sq, sk) on q's device (checked above), and the
        // window: a key is visible if both allow it.
        let blocks = mask.to_dense(sq, sk)?;
        visible = Some(match visible {
            Some(window) => window.broadcast_mul(&blocks)?,
            None => blocks,
        });
    }
    // Rows that see no key (causal with seqlen_q > seqlen_k, a window past the keys, a block
    // mask that hides the whole row), as 0/1 in the input dtype, shaped to broadcast against
    // (b, h, sq, 1): (sq, 1), or (1, 1 or h, sq, 1).
    let mut dead = Tensor::zeros((sq, 1), dtype, dev)?;
    if let Some(visible) = visible {
        let visible = visible.unsqueeze(0)?; // (1, 1 or h, sq, sk)
        let neg_inf = Tensor::new(f32::NEG_INFINITY, dev)?
            .to_dtype(dtype)?
            .broadcast_as(scores.shape())?;
        scores = visible
            .broadcast_as(scores.shape())?
            .where_cond(&scores, &neg_inf)?;
        dead = visible.max_keepdim(D::Minus1)?.eq(0u8)?.to_dtype(dtype)?;
    }

    if let Some(sinks) = opts.sinks {
        // The sink column, last; rows with a finite sink are not dead (a sink of -inf is
        // none, NaN stays NaN).
        let sinks = sinks.to_dtype(dtype)?.reshape((1, h, 1, 1))?;
        scores = Tensor::cat(&[&scores, &sinks.broadcast_as((b, h, sq, 1))?], D::Minus1)?;
        let no_sink = sinks.eq(f64::NEG_INFINITY)?.to_dtype(dtype)?;
        dead = dead.broadcast_mul(&no_sink)?;
    }
    // Softmax with the row max subtracted for range. The max is detached (softmax does not
    // depend on it, so no gradient is lost) and 0 on dead rows instead of -inf, so that
    // exp(-inf - max) is 0 rather than NaN; adding 1 to dead rows' (zero) denominator then
    // gives p = 0 with finite gradients.
    let row_max = scores.max_keepdim(D::Minus1)?.detach();
    let is_dead = dead.to_dtype(DType::U8)?.broadcast_as(row_max.shape())?;
    let row_max = is_dead.where_cond(&row_max.zeros_like()?, &row_max)?;
    let exp = scores.broadcast_sub(&row_max)?.exp()?;
    let denom = exp.sum_keepdim(D::Minus1)?.broadcast_add(&dead)?;
    let mut probs = exp.broadcast_div(&denom)?;
    if opts.sinks.is_some() {
        probs = probs.narrow(D::Minus1, 0, sk)?.contiguous()?;
    }
    if let Some((keep, p)) = dropout {
        let keep = keep.ne(&keep.zeros_like()?)?.to_dtype(dtype)?.detach();
        probs = ((probs * keep)? * crate::philox::keep_scale(p) as f64)?;
    }
    probs.matmul(&v)?.transpose(1, 2)?.contiguous() // (b, sq, h, d)
}

/// The ALiBi bias `-slope · |i + sk - sq - j|` as a constant `(b or 1, h, sq, sk)` tensor of
/// `dtype`, from slopes `(h)` or `(b, h)` (checked), the distances exact in f32.
fn alibi_bias(slopes: &Tensor, h: usize, sq: usize, sk: usize, dtype: DType) -> Result<Tensor> {
    let dev = slopes.device();
    let dist: Vec<f32> = (0..sq)
        .flat_map(|i| {
            (0..sk).map(move |j| (i as i64 + sk as i64 - sq as i64 - j as i64).abs() as f32)
        })
        .collect();
    let dist = Tensor::from_vec(dist, (1, 1, sq, sk), dev)?;
    let slopes = slopes.to_dtype(DType::F32)?.reshape(((), h, 1, 1))?;
    Ok(slopes
        .broadcast_mul(&dist)?
        .neg()?
        .to_dtype(dtype)?
        .detach())
}

/// `(b, s, hk, d)` → `(b, s, hk · group, d)`, K/V head `j` repeated as query heads
/// `j · group .. (j + 1) · group`. Its gradient sums over each group.
fn repeat_kv(x: &Tensor, group: usize) -> Result<Tensor> {
    if group == 1 {
        return Ok(x.clone());
    }
    let (b, s, hk, d) = x.dims4()?;
    x.unsqueeze(3)?
        .broadcast_as((b, s, hk, group, d))?
        .reshape((b, s, hk * group, d))
}
