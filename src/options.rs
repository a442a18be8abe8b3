//! The options type: one configuration for every attention entry point.

use std::sync::atomic::{AtomicU64, Ordering};

use candle::{bail, DType, Result, Tensor};

use crate::bwd::FlashAttnBwdOp;
use crate::fp8_fwd;
use crate::fwd::FlashAttnOp;
use crate::layout::aligned;
use crate::padding::Padding;
use crate::params::{self, AttnShape, Dropout, Problem};
use crate::varlen::VarLen;
use crate::BlockMask;

/// The next RNG offset of calls that do not fix one: advanced by 1 per call with dropout, so
/// two calls with the same seed drop different entries.
static NEXT_RNG_OFFSET: AtomicU64 = AtomicU64::new(0);

/// FlashAttention options. Build with [`FlashAttn::new`] and the builder methods, then call
/// [`FlashAttn::forward`].
///
/// ```
/// # fn main() -> candle::Result<()> {
/// use candle::{Device, Tensor};
/// let dev = Device::Cpu;
/// let q = Tensor::randn(0f32, 1.0, (2, 16, 8, 64), &dev)?; // (batch, seqlen_q, heads, head_dim)
/// let k = Tensor::randn(0f32, 1.0, (2, 32, 2, 64), &dev)?; // (batch, seqlen_k, heads_k, head_dim)
/// let v = Tensor::randn(0f32, 1.0, (2, 32, 2, 64), &dev)?;
/// let out = candle_flash::FlashAttn::new().causal(true).forward(&q, &k, &v)?;
/// assert_eq!(out.dims(), &[2, 16, 8, 64]);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct FlashAttn {
    /// Multiplies q·kᵀ before the softmax; `None` means `1 / sqrt(head_dim)`. Must be > 0.
    pub softmax_scale: Option<f32>,
    /// Causal mask aligned to the bottom-right corner: query `i` sees key `j` iff
    /// `j <= i + seqlen_k - seqlen_q`. Query rows that see no key output zeros.
    pub causal: bool,
    /// Makes the CUDA backward pass bitwise reproducible: dQ's sums run in a fixed order (on
    /// Hopper without a block mask the key blocks add into each dQ tile one at a time;
    /// elsewhere kernels without atomics), at some cost in speed (0.84-0.98x the default on
    /// the H100; docs/archive/PERF.md, "Key blocks in descending order"). The forward pass and
    /// the CPU backward are always deterministic.
    pub deterministic: bool,
    /// Probability of dropping each attention probability (after the softmax), in `[0, 1)`;
    /// kept ones are scaled by `1 / (1 - dropout_p)`. 0 (the default) disables dropout.
    pub dropout_p: f32,
    /// Seed of the dropout RNG (Philox4x32-7); [`FlashAttn::DEFAULT_SEED`] by default.
    pub seed: u64,
    /// RNG offset of the dropout mask. `None` (the default): every call with dropout takes
    /// the next value of a process-wide counter, so two calls drop different entries. `Some`:
    /// the given offset, so that the same `(seed, offset)` reproduces a mask (and
    /// [`crate::dropout_mask`] can show it to tests).
    pub rng_offset: Option<u64>,
    /// Local (sliding-window) attention, FlashAttention 2's `window_size = (left, right)`:
    /// query `i` sees key `j` iff `i + sk - sq - left <= j <= i + sk - sq + right`
    /// (bottom-right aligned like the causal mask); -1 leaves that side unbounded, and so does
    /// a side at or past the sequence's key count `sk` (FlashAttention 2's rule). Causal sets
    /// right to 0. `(-1, -1)` (the default) is no window.
    pub window_size: (i64, i64),
    /// Softcapping (Gemma 2): scores `s` become `softcap · tanh(s / softcap)` before the
    /// softmax (after the scale). 0 (the default) disables it.
    pub softcap: f32,
    /// ALiBi slopes, f32 `(num_heads)` or `(batch, num_heads)` on q's device: the score of
    /// query `i`, key `j` of head `h` gets `-slope[h] · |i + sk - sq - j|` (after the softcap).
    pub alibi_slopes: Option<Tensor>,
    /// Block-sparse attention: only the blocks of the attention matrix that the mask keeps
    /// are visible (and computed); see [`BlockMask`].
    pub block_mask: Option<BlockMask>,
    /// Attention sinks (gpt-oss), one logit per query head, `(num_heads)`: see
    /// [`FlashAttn::sinks`].
    pub sinks: Option<Tensor>,
    /// Rotary embedding applied by the KV-cache calls to the new keys and the queries: see
    /// [`FlashAttn::rotary`].
    pub rotary: Option<Rotary>,
    /// The dequantization scales of an F8E4M3 KV cache, read by the KV-cache calls: see
    /// [`FlashAttn::kv_cache_scales`].
    pub kv_cache_scales: Option<KvCacheScales>,
    /// The dequantization factors of F8E4M3 q, k and v: see [`FlashAttn::fp8_descales`].
    /// `None`: 1 for all three.
    pub fp8_descales: Option<QkvDescales>,
    /// The output dtype of FP8 attention: see [`FlashAttn::out_dtype`]. `None`: BF16.
    pub out_dtype: Option<DType>,
    /// FP8 attention's V given transposed: see [`FlashAttn::fp8_v_transposed`].
    pub fp8_v_transposed: bool,
}

/// The dequantization factors ("descales") of F8E4M3 (FP8) q, k and v for
/// [`FlashAttn::fp8_descales`]: a stored value, as f32, times its factor is the real value.
#[derive(Clone, Debug)]
pub struct QkvDescales {
    /// q's factors, F32 `(1,)` (per tensor), `(num_heads,)` (per query head) or `(batch,
    /// num_heads, ceil(seqlen_q / 128))` (per block of 128 rows), on q's device.
    pub q: Tensor,
    /// k's factors, F32 `(1,)`, `(num_heads_k,)` (per K/V head) or `(batch, num_heads_k,
    /// ceil(seqlen_k / 128))`.
    pub k: Tensor,
    /// v's factors, as k's.
    pub v: Tensor,
}

/// Per-head scales of an F8E4M3 (FP8) KV cache for [`FlashAttn::kv_cache_scales`]: a cached
/// value, as f32, times its head's scale is the real key or value.
#[derive(Clone, Debug)]
pub struct KvCacheScales {
    /// The key cache's scales, F32 `(num_heads_k,)` on q's device.
    pub k: Tensor,
    /// The value cache's scales, the same shape.
    pub v: Tensor,
}

/// Rotary embedding tables for [`FlashAttn::rotary`].
#[derive(Clone, Debug)]
pub struct Rotary {
    /// `(positions, rotary_dim / 2)`, the cosines of each position's angles.
    pub cos: Tensor,
    /// The sines, the same shape.
    pub sin: Tensor,
    /// Rotates pairs `(2j, 2j + 1)` (GPT-J) instead of `(j, j + rotary_dim / 2)` (GPT-NeoX,
    /// LLaMA).
    pub interleaved: bool,
}

impl PartialEq for FlashAttn {
    /// Equal options; ALiBi slopes, sinks, rotary tables, KV-cache scales and FP8 descales
    /// compare by tensor identity.
    fn eq(&self, other: &Self) -> bool {
        let same = |a: &Option<Tensor>, b: &Option<Tensor>| match (a, b) {
            (None, None) => true,
            (Some(a), Some(b)) => a.id() == b.id(),
            _ => false,
        };
        self.softmax_scale == other.softmax_scale
            && self.causal == other.causal
            && self.deterministic == other.deterministic
            && self.dropout_p == other.dropout_p
            && self.seed == other.seed
            && self.rng_offset == other.rng_offset
            && self.window_size == other.window_size
            && self.softcap == other.softcap
            && same(&self.alibi_slopes, &other.alibi_slopes)
            && self.block_mask == other.block_mask
            && same(&self.sinks, &other.sinks)
            && match (&self.rotary, &other.rotary) {
                (None, None) => true,
                (Some(a), Some(b)) => {
                    a.cos.id() == b.cos.id()
                        && a.sin.id() == b.sin.id()
                        && a.interleaved == b.interleaved
                }
                _ => false,
            }
            && match (&self.kv_cache_scales, &other.kv_cache_scales) {
                (None, None) => true,
                (Some(a), Some(b)) => a.k.id() == b.k.id() && a.v.id() == b.v.id(),
                _ => false,
            }
            && match (&self.fp8_descales, &other.fp8_descales) {
                (None, None) => true,
                (Some(a), Some(b)) => {
                    (a.q.id(), a.k.id(), a.v.id()) == (b.q.id(), b.k.id(), b.v.id())
                }
                _ => false,
            }
            && self.out_dtype == other.out_dtype
    }
}

impl Default for FlashAttn {
    fn default() -> Self {
        Self {
            softmax_scale: None,
            causal: false,
            deterministic: false,
            dropout_p: 0.0,
            seed: Self::DEFAULT_SEED,
            rng_offset: None,
            window_size: (-1, -1),
            softcap: 0.0,
            alibi_slopes: None,
            block_mask: None,
            sinks: None,
            rotary: None,
            kv_cache_scales: None,
            fp8_descales: None,
            out_dtype: None,
            fp8_v_transposed: false,
        }
    }
}

impl FlashAttn {
    /// The dropout seed used unless [`FlashAttn::seed`] sets one (the first 64 bits of the
    /// fractional part of pi).
    pub const DEFAULT_SEED: u64 = 0x243F_6A88_85A3_08D3;

    /// Default options: scale `1 / sqrt(head_dim)`, no mask, no dropout, non-deterministic
    /// backward.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the causal (bottom-right aligned) mask.
    pub fn causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }

    /// Sets the softmax scale (must be finite and > 0).
    pub fn softmax_scale(mut self, scale: f32) -> Self {
        self.softmax_scale = Some(scale);
        self
    }

    /// Asks for a bitwise reproducible backward pass.
    pub fn deterministic(mut self, deterministic: bool) -> Self {
        self.deterministic = deterministic;
        self
    }

    /// Sets the dropout probability `p` in `[0, 1)` (checked when the op runs). Entry
    /// (query `i`, key `j`) of batch `b`, query head `h` is dropped by a counter-based RNG
    /// keyed by `(seed, offset, b, h, i, j)`; the backward regenerates the same mask, and the
    /// CPU and CUDA paths drop the same entries. Each entry is dropped with probability `p`
    /// rounded to a multiple of 2^-16 (16 random bits per entry; FlashAttention-2 uses 8), so
    /// `p` below 2^-17 drops nothing; kept entries are scaled by `1 / (1 - p)`. The row
    /// log-sum-exp of [`FlashAttn::forward_with_lse`] is that of the probabilities before
    /// dropout.
    pub fn dropout(mut self, p: f32) -> Self {
        self.dropout_p = p;
        self
    }

    /// Sets the dropout seed.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Fixes the dropout RNG offset instead of taking the next value of the process-wide
    /// counter: with the same seed, the same mask every call.
    pub fn rng_offset(mut self, offset: u64) -> Self {
        self.rng_offset = Some(offset);
        self
    }

    /// Sets a local attention window (FlashAttention 2's `window_size`): query `i` sees keys
    /// `i + sk - sq - left ..= i + sk - sq + right`; `None` leaves a side unbounded, and so does
    /// a side `>= sk`, the sequence's key count (as in FlashAttention 2; with more queries than
    /// keys this differs from the formula for the right side). Key blocks outside every row's
    /// window are never read, so the cost grows with the window.
    pub fn window(mut self, left: Option<usize>, right: Option<usize>) -> Self {
        let side = |w: Option<usize>| w.map_or(-1, |w| w.min(i64::MAX as usize) as i64);
        self.window_size = (side(left), side(right));
        self
    }

    /// Sets the window in FlashAttention 2's convention: `-1` is unbounded; other negative
    /// values are an error when the op runs.
    pub fn window_size(mut self, left: i64, right: i64) -> Self {
        self.window_size = (left, right);
        self
    }

    /// Caps the scores: `s` becomes `softcap · tanh(s / softcap)` before the softmax (Gemma 2).
    /// Must be finite and > 0 (checked when the op runs); 0 turns it off.
    pub fn softcap(mut self, softcap: f32) -> Self {
        self.softcap = softcap;
        self
    }

    /// Adds ALiBi biases `-slope[h] · |i + sk - sq - j|` to the scores; `slopes` is f32,
    /// `(num_heads)` or `(batch, num_heads)`, on q's device (checked when the op runs).
    pub fn alibi_slopes(mut self, slopes: &Tensor) -> Self {
        self.alibi_slopes = Some(slopes.clone());
        self
    }

    /// Block-sparse attention: queries see only the keys of the blocks `mask` keeps (with
    /// any element mask inside them), on top of the causal mask and the window. Blocks the
    /// mask drops are never read, so the cost falls with the fraction of blocks kept. Checked
    /// when the op runs: the mask must cover `(seqlen_q, seqlen_k)` in its blocks and be on
    /// q's device. Not for KV-cache decoding (an error there).
    pub fn block_mask(mut self, mask: &BlockMask) -> Self {
        self.block_mask = Some(mask.clone());
        self
    }

    /// Attention sinks (gpt-oss's learned per-head logits): `sinks[h]` joins the softmax
    /// denominator of every query row of head `h` as one more score with no value vector,
    /// `p_ij = exp(s_ij - L_i)` with `L_i = log(exp(sinks[h]) + sum_j exp(s_ij))`, so each
    /// row's probabilities sum to less than 1. The sink is a logit as it is: not multiplied
    /// by the softmax scale, not capped, not masked, no ALiBi bias, outside every window and
    /// block mask. A row that sees no key gives zeros (and an LSE of `sinks[h]`). Dropout
    /// drops the keys' probabilities as without sinks.
    ///
    /// `sinks` is `(num_heads)`, one logit per query head, F32, F16 or BF16 (read in f32), on
    /// q's device (checked when the op runs). `-inf` is no sink; NaN makes its head's rows
    /// NaN. Differentiable: where `sinks` tracks gradients (a `Var`, or computed from one),
    /// `backward()` gives its gradient, `-sum over rows of p_sink · rowsum(dO · out)` per
    /// head, summed over the batch, in its dtype (at the cost of one copy of the output in the
    /// forward). Sinks that track no gradient cost a scaling of the output and LSE rows.
    ///
    /// Applies to [`FlashAttn::forward`], [`FlashAttn::forward_with_lse`] (whose LSE is then
    /// `L`, the sinks included), [`FlashAttn::forward_varlen`], [`FlashAttn::forward_padded`]
    /// and [`FlashAttn::backward`] (which takes that `L`); [`FlashAttn::backward_sinks`]
    /// gives the sinks' gradient there. The KV-cache calls apply them too (inference: no
    /// gradient).
    ///
    /// ```
    /// # fn main() -> candle::Result<()> {
    /// use candle::{DType, Device, Tensor, Var};
    /// let dev = Device::Cpu;
    /// let q = Tensor::randn(0f32, 1.0, (1, 16, 4, 32), &dev)?;
    /// let k = Tensor::randn(0f32, 1.0, (1, 16, 2, 32), &dev)?;
    /// let v = Tensor::randn(0f32, 1.0, (1, 16, 2, 32), &dev)?;
    /// let sinks = Var::zeros(4, DType::F32, &dev)?; // one logit per query head
    /// let attn = candle_flash::FlashAttn::new().causal(true).sinks(&sinks);
    /// let out = attn.forward(&q, &k, &v)?;
    /// let grads = out.sqr()?.sum_all()?.backward()?;
    /// assert_eq!(grads.get(&sinks).unwrap().dims(), &[4]);
    /// # Ok(()) }
    /// ```
    pub fn sinks(mut self, sinks: &Tensor) -> Self {
        self.sinks = Some(sinks.clone());
        self
    }

    /// Rotary position embedding inside the KV-cache calls ([`crate::flash_attn_with_kvcache`]
    /// and the paged form, FlashAttention's `rotary_cos` / `rotary_sin`): the new keys are
    /// rotated at their positions `cache_seqlens[b] + i` as they are written to the cache, and
    /// the queries at `cache_seqlens[b] + i` when causal or windowed, else all at
    /// `cache_seqlens[b]`, so that the caller passes unrotated q and k and saves the launches
    /// and copies of a separate rotary op. The first `rotary_dim` elements of each head turn,
    /// in pairs `(j, j + rotary_dim / 2)` (LLaMA, GPT-NeoX) or, `interleaved`, `(2j, 2j + 1)`
    /// (GPT-J); the rest is copied. `cos` and `sin` are `(positions, rotary_dim / 2)`, float
    /// (F32 avoids a conversion per call), on q's device, with `rotary_dim` a multiple of 16
    /// and at most `head_dim`. Needs new keys and values in the call; every position must be
    /// below `positions` (checked with host lengths; with device lengths a position past the
    /// tables takes the last row). Other entry points report an error.
    pub fn rotary(mut self, cos: &Tensor, sin: &Tensor, interleaved: bool) -> Self {
        self.rotary = Some(Rotary {
            cos: cos.clone(),
            sin: sin.clone(),
            interleaved,
        });
        self
    }

    /// The dequantization scales of an F8E4M3 (FP8 e4m3) KV cache, for the KV-cache calls
    /// ([`crate::flash_attn_with_kvcache`], its `_lse`, `_ragged` and paged forms, and
    /// [`crate::flash_attn_with_kvcache_cascade`]'s own caches). `k_scale` and `v_scale` are
    /// F32 `(num_heads_k,)` on q's device, one per cache head: a cached byte read as f32 times
    /// its head's scale is the real key or value, and the call's append writes new rows as
    /// `e4m3(x / scale[head])` (x after any rotary embedding, rounded to q's dtype, divided
    /// in f32; round to nearest even, saturating at ±448, NaN kept). [`crate::quant::fp8_scales`] with
    /// [`crate::quant::Fp8Scaling::PerHead`] computes such scales from sample keys or values.
    ///
    /// Required when the caches are `DType::F8E4M3` (an error naming `kv_cache_scales`
    /// otherwise), an error with caches of any other dtype. [`crate::KvCache`] and
    /// [`crate::PagedKvCache`] keep their scales themselves (`with_scales`) and refuse this
    /// option. Other entry points report an error.
    pub fn kv_cache_scales(mut self, k_scale: &Tensor, v_scale: &Tensor) -> Self {
        self.kv_cache_scales = Some(KvCacheScales {
            k: k_scale.clone(),
            v: v_scale.clone(),
        });
        self
    }

    /// FP8 attention: the dequantization factors of F8E4M3 (FP8 e4m3) q, k and v, for
    /// [`FlashAttn::forward`], [`FlashAttn::forward_with_lse`], [`FlashAttn::forward_varlen`]
    /// (and its `_with_lse`) and [`FlashAttn::forward_padded`]. A stored byte, as f32, times
    /// its factor is the real value: exactly the scales [`crate::quant::fp8_scales`] returns
    /// for [`crate::quant::Fp8Scaling::PerTensor`], [`crate::quant::Fp8Scaling::PerHead`] or
    /// `Fp8Scaling::PerBlock { rows: `[`crate::quant::FP8_BLOCK_ROWS`]` }`, so that
    /// [`crate::quant::quantize_fp8`] with those scales and this option round-trip. Each of
    /// q, k and v takes any of the three forms (F32, on q's device):
    ///
    /// - per tensor: `(1,)`;
    /// - per head: `(num_heads,)` for q, `(num_heads_k,)` for k and v;
    /// - per block: `(batch, num_heads, ceil(seqlen_q / 128))` for q, `(batch, num_heads_k,
    ///   ceil(seqlen_k / 128))` for k and v, a factor per block of 128 rows of each sequence
    ///   and head (block quantization: an outlier coarsens its block's scale only). With
    ///   [`FlashAttn::forward_varlen`] a sequence's blocks count from its first row and the
    ///   last dimension is at least ceil(max_seqlen / 128); [`FlashAttn::forward_padded`]
    ///   refuses them (padding moves rows between blocks).
    ///
    /// Without this option the factors are 1. They should be positive and finite; they are
    /// not read back to check (a NaN or an infinity goes into the result).
    ///
    /// What FP8 attention computes, per query head `h`, its K/V head `g = h / (num_heads /
    /// num_heads_k)` and query row `i`, in f32 (the CPU computes exactly this; the CUDA kernel
    /// the same with its own summation order and an online softmax, which rounds each key
    /// tile's probabilities against the row's maximum so far, never above the row's):
    /// 1. dequantize q and k: `q_i = q8_i · qd_i`, `k_j = k8_j · kd_j` (`qd_i` q's factor for
    ///    head `h` and row `i`, `kd_j` k's for head `g` and key `j`); v stays raw;
    /// 2. `S_ij = scale · q_i · k_j` over the keys the causal mask (bottom-right aligned) shows
    ///    row `i` (`scale` = `softmax_scale`, by default `1 / sqrt(head_dim)`);
    /// 3. `m_i = max_j S_ij`, `P_ij = exp(S_ij - m_i)`, `l_i = Σ_j P_ij` (before rounding);
    /// 4. `O_i = (Σ_j e4m3(256 · P_ij) / 256 · vd_j · v8_j) / l_i`, with `e4m3` rounding
    ///    to nearest even, as the FP8 tensor cores take `P` (FlashAttention-3's FP8 forward,
    ///    whose offset of 2^8 keeps probabilities down to 2^-17 of the maximum in e4m3's
    ///    range); `O` is then rounded to the output dtype ([`FlashAttn::out_dtype`], BF16 by
    ///    default);
    /// 5. the LSE of [`FlashAttn::forward_with_lse`] is `m_i + ln(l_i)` in f32, natural log;
    ///    a row that sees no key gets `O_i = 0` and LSE `-inf`.
    ///
    /// Rounding `P` to e4m3 (3 mantissa bits) is the error FP8 adds beyond that of the
    /// quantized inputs. Outlier features of q and k make per-tensor scales coarse:
    /// [`crate::quant::hadamard`] applied to q and k before quantizing spreads them
    /// (FlashAttention-3's incoherent processing) and leaves `q · kᵀ` unchanged.
    ///
    /// V may come transposed ([`FlashAttn::fp8_v_transposed`]), which spares the Hopper
    /// kernels their transpose of every V tile in shared memory.
    ///
    /// FP8 calls take `causal`, `softmax_scale`, MQA/GQA and variable-length batches;
    /// dropout, windows, softcap, ALiBi, block masks, sinks, rotary and KV-cache scales are an
    /// error with FP8 inputs, and so is the backward (FP8 attention is inference only: train
    /// in BF16 or F16). With inputs that are not F8E4M3 this option is an error.
    ///
    /// ```
    /// # fn main() -> candle::Result<()> {
    /// use candle::{DType, Device, Tensor};
    /// use candle_flash::quant::{fp8_scales, quantize_fp8, Fp8Scaling};
    /// use candle_flash::FlashAttn;
    /// let dev = Device::Cpu;
    /// let q = Tensor::randn(0f32, 1.0, (1, 64, 8, 64), &dev)?;
    /// let k = Tensor::randn(0f32, 1.0, (1, 64, 2, 64), &dev)?;
    /// let v = Tensor::randn(0f32, 1.0, (1, 64, 2, 64), &dev)?;
    /// let scaling = Fp8Scaling::PerHead; // or PerTensor
    /// let (sq, sk, sv) = (
    ///     fp8_scales(&q, scaling)?, // (num_heads,) F32: max |q| / 448 per head
    ///     fp8_scales(&k, scaling)?,
    ///     fp8_scales(&v, scaling)?,
    /// );
    /// let (q8, k8, v8) = (
    ///     quantize_fp8(&q, &sq, scaling)?, // F8E4M3
    ///     quantize_fp8(&k, &sk, scaling)?,
    ///     quantize_fp8(&v, &sv, scaling)?,
    /// );
    /// let attn = FlashAttn::new().causal(true).fp8_descales(&sq, &sk, &sv);
    /// let out = attn.forward(&q8, &k8, &v8)?;
    /// assert_eq!((out.dims(), out.dtype()), (&[1, 64, 8, 64][..], DType::BF16));
    /// let exact = FlashAttn::new().causal(true).forward(&q, &k, &v)?;
    /// let diff = (out.to_dtype(DType::F32)? - exact)?;
    /// let rmse = diff.sqr()?.mean_all()?.sqrt()?.to_scalar::<f32>()?;
    /// assert!(rmse < 0.05); // e4m3 keeps 3 mantissa bits: about 0.015 here
    /// # Ok(()) }
    /// ```
    pub fn fp8_descales(mut self, q: &Tensor, k: &Tensor, v: &Tensor) -> Self {
        self.fp8_descales = Some(QkvDescales {
            q: q.clone(),
            k: k.clone(),
            v: v.clone(),
        });
        self
    }

    /// FP8 attention's `v` is given transposed, as [`crate::quant::fp8_v_transposed`] stores
    /// it: F8E4M3 `(batch, num_heads_k, head_dim, keys)`, contiguous, `keys` = seqlen_k
    /// rounded up to a multiple of 16 (zeros past seqlen_k), the keys of each 16 in the order
    /// in which the Hopper kernels' P V reads them. The e4m3 wgmma takes V^T only; with V
    /// `(batch, seqlen_k, num_heads_k, head_dim)` the kernels transpose every tile of it in
    /// shared memory, with this layout they copy V^T's tiles as they are. Same values, same
    /// result (bit for bit on CUDA). Fixed-length batches (`forward`, `forward_with_lse`) only.
    pub fn fp8_v_transposed(mut self) -> Self {
        self.fp8_v_transposed = true;
        self
    }

    /// The output dtype of FP8 attention (F8E4M3 q, k and v): BF16 (the default) or F16, and
    /// F32 on the CPU (checked when the op runs). Other calls return q's dtype and report this
    /// option as an error.
    pub fn out_dtype(mut self, dtype: DType) -> Self {
        self.out_dtype = Some(dtype);
        self
    }

    /// The window, cap, slopes and block mask of a KV-cache decoding call with this shape,
    /// checked (the decoding call checks its sinks itself).
    pub(crate) fn score_mods(
        &self,
        shape: &AttnShape,
        device: &candle::Device,
    ) -> Result<crate::score_mod::ScoreMods> {
        self.checked_mods(shape, device)
    }

    /// The window, cap, slopes and block mask of a call with this shape, checked.
    fn checked_mods(
        &self,
        shape: &AttnShape,
        device: &candle::Device,
    ) -> Result<crate::score_mod::ScoreMods> {
        let mut mods = crate::score_mod::ScoreMods::new(
            self.causal,
            self.window_size,
            self.softcap,
            self.alibi_slopes.as_ref(),
            shape,
            device,
        )?;
        if let Some(mask) = &self.block_mask {
            mask.check(shape, device)?;
            mods.sparse = Some(mask.clone());
        }
        Ok(mods)
    }

    /// The problem description of one call: checks the scale and dropout probability, draws
    /// the RNG offset.
    pub(crate) fn problem(
        &self,
        shape: AttnShape,
        varlen: Option<&VarLen>,
        device: &candle::Device,
    ) -> Result<Problem> {
        self.problem_with_offset(shape, varlen, device, || {
            Ok(self
                .rng_offset
                .unwrap_or_else(|| NEXT_RNG_OFFSET.fetch_add(1, Ordering::Relaxed)))
        })
    }

    /// [`FlashAttn::problem`] with the dropout RNG offset from `offset`, asked only when
    /// dropout is on and the scale and probability are valid.
    fn problem_with_offset(
        &self,
        shape: AttnShape,
        varlen: Option<&VarLen>,
        device: &candle::Device,
        offset: impl FnOnce() -> Result<u64>,
    ) -> Result<Problem> {
        let scale = self.softmax_scale.unwrap_or(1.0 / (shape.d as f32).sqrt());
        params::check_scale(scale)?;
        params::check_dropout(self.dropout_p)?;
        if self.rotary.is_some() {
            bail!(
                "rotary: only the KV-cache calls apply rotary embedding; rotate q and k before \
                 this call (candle_flash::train::rotary)"
            )
        }
        if self.kv_cache_scales.is_some() {
            bail!(
                "kv_cache_scales: only the KV-cache calls read FP8 cache scales; dequantize K \
                 and V before this call (candle_flash::quant::dequantize_fp8)"
            )
        }
        let mods = self.checked_mods(&shape, device)?;
        let dropout = if self.dropout_p > 0.0 {
            Some(Dropout {
                p: self.dropout_p,
                seed: self.seed,
                offset: offset()?,
            })
        } else {
            None
        };
        Ok(Problem {
            shape,
            scale,
            causal: self.causal,
            dropout,
            mods,
            varlen: varlen.map(VarLen::offsets),
        })
    }

    /// Exact attention `softmax(scale · q kᵀ + mask) v`.
    ///
    /// - `q`: `(batch, seqlen_q, num_heads, head_dim)`
    /// - `k`, `v`: `(batch, seqlen_k, num_heads_k, head_dim)`, `num_heads % num_heads_k == 0`
    ///   (MQA/GQA: query head `h` reads K/V head `h / (num_heads / num_heads_k)`).
    /// - dtypes: f16 or bf16 on CUDA; f32, f16 or bf16 on CPU (computed in f32). All three
    ///   tensors share dtype and device. Only the last dimension must be contiguous.
    /// - FP8: q, k and v all F8E4M3 (e4m3, inference only) with their dequantization factors
    ///   ([`FlashAttn::fp8_descales`]) give the output in [`FlashAttn::out_dtype`] (BF16 by
    ///   default), on the CPU and on Hopper GPUs; see [`FlashAttn::fp8_descales`] for what it
    ///   computes and which options it takes.
    /// - `head_dim` in `1..=256`; on CUDA a multiple of 8. FP8 on CUDA: a Hopper GPU (sm_90)
    ///   and head_dim 128 or 256 (an error names the head dims compiled otherwise), q, k and v
    ///   with 16-byte aligned strides (the call copies those that are not).
    ///
    /// Returns `(batch, seqlen_q, num_heads, head_dim)` in the input dtype (FP8: the
    /// [`FlashAttn::out_dtype`]). Differentiable (FP8 inputs excepted): `backward()` through
    /// the result gives gradients for q, k and v. A seqlen of 0 gives an empty result;
    /// `seqlen_k == 0` gives zeros.
    ///
    /// With [`FlashAttn::dropout`], kept probabilities are scaled by `1 / (1 - p)`; the
    /// backward uses the same mask. [`FlashAttn::window`] restricts each query to a band of
    /// keys (rows that see no key give zeros), [`FlashAttn::softcap`] caps the scores and
    /// [`FlashAttn::alibi_slopes`] biases them, in that order after the scale; the gradients
    /// go through the cap. [`crate::attention_slow_with`] computes the same in plain ops.
    ///
    /// Errors name the argument and the expected value (rank, shapes, dtypes, devices,
    /// head_dim, contiguity, scale, dropout_p, `window_size` with a negative side other than
    /// -1, a `softcap` that is negative or not finite, `alibi_slopes` that are not f32
    /// `(num_heads)` or `(batch, num_heads)` on q's device, `sinks` that are not F32, F16 or
    /// BF16 `(num_heads)` on q's device; with FP8 inputs, one of q, k, v that is not F8E4M3,
    /// an option FP8 does not take, `fp8_descales` of the wrong dtype, shape or device and an
    /// `out_dtype` the device does not write; with other inputs, `fp8_descales` or
    /// `out_dtype` set).
    pub fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        Ok(self.forward_with_lse(q, k, v)?.0)
    }

    /// Like [`FlashAttn::forward`], also returning the row log-sum-exp of the scaled scores,
    /// `(batch, num_heads, seqlen_q)` in f32 (`-inf` for rows that see no key). The LSE is
    /// what merging partial attentions (split-KV, ring attention) needs. It carries no
    /// gradient. With [`FlashAttn::sinks`] it is `log(exp(sinks[h]) + sum_j exp(s_ij))`, the
    /// log of the denominator with the sink (`sinks[h]` for rows that see no key).
    pub fn forward_with_lse(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        if fp8_fwd::is_fp8(q, k, v) {
            return fp8_fwd::forward(self, q, k, v, None);
        }
        fp8_fwd::refuse_fp8_options(self, q, "forward")?;
        let shape = params::validate(q, k, v)?;
        let sinks = self.checked_sinks(q, shape.h)?;
        FlashAttnOp::new(self.problem(shape, None, q.device())?, self.deterministic)
            .run(q, k, v, sinks)
    }

    /// The sinks, checked against q and its `heads`.
    fn checked_sinks(&self, q: &Tensor, heads: usize) -> Result<Option<&Tensor>> {
        if let Some(s) = &self.sinks {
            crate::sinks::check(s, q, heads)?;
        }
        Ok(self.sinks.as_ref())
    }

    /// The backward pass of [`FlashAttn::forward`], called directly: given q, k, v, the `out`
    /// and `lse` that [`FlashAttn::forward_with_lse`] returned for them with the same options,
    /// and the output gradient `grad_out`, returns `(dq, dk, dv)` shaped like q, k, v, in
    /// their dtype (dK and dV summed over each MQA/GQA group).
    ///
    /// It is the same computation that `backward()` through [`FlashAttn::forward`] runs (the
    /// same kernels, so the same gradients), without Candle's autograd: no graph is recorded
    /// and the results are plain tensors. Call it to write a custom autograd function, for
    /// gradient checkpointing, or to avoid Candle's bookkeeping around each gradient (a
    /// `zeros_like` + `add` per tensor, which dominates short sequences on a GPU).
    ///
    /// - `q`, `k`, `v`: as in [`FlashAttn::forward`];
    /// - `out`, `grad_out`: q's shape, dtype and device;
    /// - `lse`: f32 `(batch, num_heads, seqlen_q)` on q's device; with [`FlashAttn::sinks`],
    ///   the LSE that includes them, as [`FlashAttn::forward_with_lse`] returns it with the
    ///   same sinks (the gradients of q, k and v need nothing else from the sinks;
    ///   [`FlashAttn::backward_sinks`] gives theirs).
    ///
    /// Dropout: the backward must drop the forward's entries, so with `dropout_p > 0`
    /// [`FlashAttn::rng_offset()`] must be set (to the same value for both calls); it is an
    /// error otherwise, as the process-wide counter would give a different mask.
    ///
    /// Errors: the errors of [`FlashAttn::forward`], and `out`, `grad_out` or `lse` of the
    /// wrong shape, dtype or device (each naming the argument and the expected value).
    ///
    /// ```
    /// # fn main() -> candle::Result<()> {
    /// use candle::{Device, Tensor};
    /// let dev = Device::Cpu;
    /// let q = Tensor::randn(0f32, 1.0, (1, 16, 4, 32), &dev)?;
    /// let k = Tensor::randn(0f32, 1.0, (1, 16, 2, 32), &dev)?;
    /// let v = Tensor::randn(0f32, 1.0, (1, 16, 2, 32), &dev)?;
    /// let attn = candle_flash::FlashAttn::new().causal(true);
    /// let (out, lse) = attn.forward_with_lse(&q, &k, &v)?;
    /// let grad_out = Tensor::randn(0f32, 1.0, out.shape(), &dev)?;
    /// let (dq, dk, dv) = attn.backward(&q, &k, &v, &out, &lse, &grad_out)?;
    /// assert_eq!((dq.dims(), dk.dims(), dv.dims()), (q.dims(), k.dims(), v.dims()));
    /// # Ok(()) }
    /// ```
    pub fn backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        lse: &Tensor,
        grad_out: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        if fp8_fwd::is_fp8(q, k, v) {
            bail!(
                "backward: FP8 (F8E4M3) attention is inference only and has no backward pass; \
                 train with BF16 or F16 q, k and v"
            )
        }
        fp8_fwd::refuse_fp8_options(self, q, "backward")?;
        let shape = params::validate(q, k, v)?;
        params::validate_bwd_inputs(q, out, lse, grad_out, &shape)?;
        self.checked_sinks(q, shape.h)?;
        // Not the process-wide counter: its next offset is a mask the forward never used.
        let problem =
            self.problem_with_offset(shape, None, q.device(), || match self.rng_offset {
                Some(offset) => Ok(offset),
                None => bail!(
                    "rng_offset: backward with dropout_p {} needs the forward's dropout mask; set \
                 FlashAttn::rng_offset to the same value for forward_with_lse and backward",
                    self.dropout_p
                ),
            })?;
        if shape.total_q * shape.h == 0 {
            // No query row: the forward computed nothing, and nothing depends on k or v.
            let zeros = |t: &Tensor| t.zeros_like();
            return Ok((zeros(q)?, zeros(k)?, zeros(v)?));
        }
        let (q, k, v) = (aligned(q)?, aligned(k)?, aligned(v)?);
        // The CUDA kernels read the LSE with its contiguous layout (as the forward writes it).
        let lse = crate::layout::contiguous_aligned(lse)?;
        FlashAttnBwdOp::new(problem, self.deterministic).run(&q, &k, &v, out, grad_out, &lse)
    }

    /// The gradient of the [`FlashAttn::sinks`], the counterpart of [`FlashAttn::backward`]
    /// for them: `d sinks[h] = -sum over rows of exp(sinks[h] - lse) · rowsum(grad_out · out)`
    /// over every row of head `h` (every sequence), the same that `backward()` through the
    /// forward gives them. Returns `(num_heads)` in the sinks' dtype.
    ///
    /// - `out`, `lse`: what [`FlashAttn::forward_with_lse`] returned with these sinks,
    ///   `(batch, seqlen_q, num_heads, head_dim)` and f32 `(batch, num_heads, seqlen_q)`, or
    ///   [`FlashAttn::forward_varlen_with_lse`]'s `(total_q, num_heads, head_dim)` and
    ///   `(num_heads, total_q)`;
    /// - `grad_out`: out's shape, dtype and device.
    ///
    /// Errors: no sinks set, and arguments of other shapes, dtypes or devices than those
    /// (each naming the argument and the expected value).
    pub fn backward_sinks(&self, out: &Tensor, lse: &Tensor, grad_out: &Tensor) -> Result<Tensor> {
        let Some(sinks) = &self.sinks else {
            bail!("sinks: backward_sinks needs the sinks of the forward, set with FlashAttn::sinks")
        };
        let (layout, lse_dims, what) = match *out.dims() {
            [b, sq, h, d] => (
                crate::sinks::SinkLayout {
                    outer: b,
                    rows: sq,
                    heads: h,
                    d,
                },
                vec![b, h, sq],
                "(batch, num_heads, seqlen_q)",
            ),
            [total_q, h, d] => (
                crate::sinks::SinkLayout {
                    outer: 1,
                    rows: total_q,
                    heads: h,
                    d,
                },
                vec![h, total_q],
                "(num_heads, total_q)",
            ),
            ref dims => bail!(
                "out: expected (batch, seqlen_q, num_heads, head_dim) or (total_q, num_heads, \
                 head_dim), got shape {dims:?}"
            ),
        };
        params::check_dtype(out.device(), out.dtype(), "out: dtype")?;
        crate::sinks::check(sinks, out, layout.heads)?;
        if grad_out.dims() != out.dims()
            || grad_out.dtype() != out.dtype()
            || !grad_out.device().same_device(out.device())
        {
            bail!(
                "grad_out: expected out's shape {:?}, dtype {:?} and device {:?}, got {:?} {:?} \
                 on {:?}",
                out.dims(),
                out.dtype(),
                out.device().location(),
                grad_out.dims(),
                grad_out.dtype(),
                grad_out.device().location()
            )
        }
        if lse.dtype() != DType::F32 || lse.dims() != lse_dims.as_slice() {
            bail!(
                "lse: expected F32 {what} = {lse_dims:?} as forward_with_lse returns it, got {:?} \
                 {:?}",
                lse.dtype(),
                lse.dims()
            )
        }
        if !lse.device().same_device(out.device()) {
            bail!(
                "lse: expected out's device ({:?}), got {:?}",
                out.device().location(),
                lse.device().location()
            )
        }
        let values = crate::sinks::values(sinks)?;
        crate::sinks::grad(out, grad_out, lse, &values, layout)?.to_dtype(sinks.dtype())
    }

    /// Attention over a packed batch of variable-length sequences (no work is spent on
    /// padding): sequence `b` attends with its query rows `cu_seqlens_q[b]..cu_seqlens_q[b +
    /// 1]` to its key rows `cu_seqlens_k[b]..cu_seqlens_k[b + 1]` only, as if each were its
    /// own batch of 1 (causal and window alignment, MQA/GQA, dropout per sequence; ALiBi
    /// slopes of shape `(batch, num_heads)` give sequence `b` row `b`, with
    /// `batch = num_seqs`).
    ///
    /// - `q`: `(total_q, num_heads, head_dim)`; `k`, `v`: `(total_k, num_heads_k, head_dim)`;
    /// - `varlen`: the offsets, with `total_q = cu_seqlens_q[num_seqs]` and
    ///   `total_k = cu_seqlens_k[num_seqs]`.
    ///
    /// Returns `(total_q, num_heads, head_dim)` in the input dtype (FP8: the
    /// [`FlashAttn::out_dtype`]); differentiable like [`FlashAttn::forward`]. Query rows that
    /// see no key (a sequence with no key, or the causal mask) give zeros. Dtypes, head_dim and the other options as in
    /// [`FlashAttn::forward`]. Dropout: see [`crate::dropout_mask`] for the mask of each
    /// sequence.
    ///
    /// Inputs must be finite in every sequence: on Hopper the warp-specialized kernels read a
    /// tile's rows past its sequence's end from the next sequence and weight them by zero, so
    /// a NaN or infinity there (0 x NaN) can reach a neighbour's output or gradients.
    ///
    /// Errors: the errors of [`FlashAttn::forward`] (with rank 3 instead of 4), and a last
    /// offset of `cu_seqlens_q` (`cu_seqlens_k`) that differs from q's (k's) rows.
    pub fn forward_varlen(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        varlen: &VarLen,
    ) -> Result<Tensor> {
        Ok(self.forward_varlen_with_lse(q, k, v, varlen)?.0)
    }

    /// Like [`FlashAttn::forward_varlen`], also returning the row log-sum-exp of the scaled
    /// scores, `(num_heads, total_q)` in f32 (`-inf` for rows that see no key), FlashAttention's
    /// packed LSE layout. It carries no gradient. With [`FlashAttn::sinks`] it includes them
    /// as in [`FlashAttn::forward_with_lse`].
    pub fn forward_varlen_with_lse(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        varlen: &VarLen,
    ) -> Result<(Tensor, Tensor)> {
        if fp8_fwd::is_fp8(q, k, v) {
            return fp8_fwd::forward(self, q, k, v, Some(varlen));
        }
        fp8_fwd::refuse_fp8_options(self, q, "forward_varlen")?;
        let shape = params::validate_varlen(q, k, v, varlen)?;
        let sinks = self.checked_sinks(q, shape.h)?;
        FlashAttnOp::new(
            self.problem(shape, Some(varlen), q.device())?,
            self.deterministic,
        )
        .run(q, k, v, sinks)
    }

    /// Attention over a padded batch: packs the real tokens ([`Padding::unpad`]), runs
    /// [`FlashAttn::forward_varlen`] and scatters the result back ([`Padding::pad`]).
    ///
    /// - `q`: `(batch, seqlen_q, num_heads, head_dim)` with `q_pad` its `(batch, seqlen_q)`
    ///   padding; `k`, `v`: `(batch, seqlen_k, num_heads_k, head_dim)` with `kv_pad`.
    ///
    /// Returns `(batch, seqlen_q, num_heads, head_dim)`: each sequence's real query tokens
    /// attend to its real key tokens only (causal masks align each sequence's real tokens
    /// bottom-right), and padded query rows are zeros. The same result as a loop over the
    /// sequences; differentiable (padded positions get zero gradients).
    ///
    /// Errors: tensors whose first two dimensions do not match their padding, paddings of
    /// different batch sizes, and the errors of [`FlashAttn::forward_varlen`].
    pub fn forward_padded(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        q_pad: &Padding,
        kv_pad: &Padding,
    ) -> Result<Tensor> {
        if self.fp8_v_transposed {
            candle::bail!(
                "fp8_v_transposed: a transposed V is for fixed-length batches; with \
                 forward_padded pass V as (batch, seqlen_k, num_heads_k, head_dim)"
            )
        }
        if let Some(d) = &self.fp8_descales {
            if [&d.q, &d.k, &d.v].iter().any(|t| t.rank() == 3) {
                candle::bail!(
                    "fp8_descales: per-block descales index each sequence's rows from its \
                     first token, which padding moves; with forward_padded pass per-tensor or \
                     per-head descales, or unpad and call forward_varlen"
                )
            }
        }
        let varlen = VarLen::from_padding(q_pad, kv_pad)?;
        let (q, k, v) = (
            q_pad.unpad_named(q, "q")?,
            kv_pad.unpad_named(k, "k")?,
            kv_pad.unpad_named(v, "v")?,
        );
        q_pad.pad(&self.forward_varlen(&q, &k, &v, &varlen)?)
    }
}

/// Exact attention with default options: `softmax(q kᵀ / sqrt(head_dim) + mask) v`.
///
/// Shapes `(batch, seqlen, num_heads, head_dim)`; see [`FlashAttn::forward`] for the
/// contract and errors. Works in training graphs (gradients for q, k and v).
pub fn flash_attn(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Result<Tensor> {
    FlashAttn::new().causal(causal).forward(q, k, v)
}
