//! FP8 (e4m3) quantization helpers for keys and values laid out `(batch, seq, heads,
//! head_dim)`: scales from the data, and the conversions to and from `DType::F8E4M3`.
//!
//! A quantized element is `e4m3(x / scale)` and its real value `e4m3 · scale`, with one
//! scale per group of elements ([`Fp8Scaling`]). The scale of a group is its absolute
//! maximum over 448, e4m3's largest finite value, so the group's largest element lands on
//! it and nothing saturates. Everything is written in candle tensor ops (abs, max, division,
//! casts), so it runs wherever candle does, on the CPU and on CUDA, without kernels of its
//! own.
//!
//! The FP8 KV cache ([`crate::FlashAttn::kv_cache_scales`], [`crate::KvCache::with_scales`])
//! takes [`Fp8Scaling::PerHead`] scales; [`quantize_fp8`] with them writes the bytes its
//! append writes. FP8 attention ([`crate::FlashAttn::fp8_descales`]) takes
//! [`Fp8Scaling::PerTensor`], [`Fp8Scaling::PerHead`] or `Fp8Scaling::PerBlock { rows:
//! FP8_BLOCK_ROWS }` scales of q, k and v, and [`hadamard`] rotates q and k before they are
//! quantized, against outlier features.
//!
//! ```
//! # fn main() -> candle::Result<()> {
//! use candle::{DType, Device, Tensor};
//! use candle_flash::quant::{dequantize_fp8, fp8_scales, quantize_fp8, Fp8Scaling};
//! let k = Tensor::randn(0f32, 1.0, (2, 10, 4, 64), &Device::Cpu)?; // (batch, seq, heads, d)
//! let scaling = Fp8Scaling::PerBlock { rows: 4 };
//! let scales = fp8_scales(&k, scaling)?; // (batch, heads, ceil(seq / rows))
//! assert_eq!(scales.dims(), &[2, 4, 3]);
//! let q8 = quantize_fp8(&k, &scales, scaling)?;
//! assert_eq!(q8.dtype(), DType::F8E4M3);
//! let back = dequantize_fp8(&q8, &scales, scaling, DType::F32)?;
//! // e4m3 keeps 3 mantissa bits: an element moves by at most 2^-4 of itself (or, for the
//! // smallest, e4m3's subnormals, 2^-10 of its group's scale), so by at most max |k| / 16.
//! let max_abs = |t: &Tensor| t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>();
//! assert!(max_abs(&(&back - &k)?)? <= max_abs(&k)? / 16.0);
//! # Ok(()) }
//! ```

use candle::{bail, DType, Result, Tensor};

mod hadamard;
#[cfg(feature = "cuda")]
mod kernel;
#[cfg(feature = "cuda")]
pub(crate) use kernel::copy_e4m3;

pub use hadamard::{hadamard, MAX_HADAMARD_DIM};

/// e4m3's largest finite magnitude: a group's absolute maximum maps onto it.
pub const E4M3_MAX: f32 = 448.0;

/// The rows per block of FP8 attention's per-block descales ([`crate::FlashAttn::fp8_descales`]):
/// the scales of `Fp8Scaling::PerBlock { rows: FP8_BLOCK_ROWS }` (one per 128 tokens of each
/// sequence and head), the kernels' tile of query rows and a whole number of their key
/// tiles, so that a block's factor folds into the softmax scale of a tile.
pub const FP8_BLOCK_ROWS: usize = 128;

/// How elements of a `(batch, seq, heads, head_dim)` tensor share a scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Scaling {
    /// One scale for the whole tensor: scales of shape `(1,)`.
    PerTensor,
    /// One scale per head, over every batch, token and element: `(heads,)`, the form the FP8
    /// KV cache takes.
    PerHead,
    /// One scale per block of `rows` consecutive tokens of one (batch, head), across
    /// head_dim: `(batch, heads, ceil(seq / rows))`; the last block of a sequence may be
    /// shorter. `rows` must be > 0.
    PerBlock {
        /// Tokens per block.
        rows: usize,
    },
}

/// The input of every helper: rank 4 of a float dtype. Returns its dims.
fn check_input(x: &Tensor, name: &str) -> Result<[usize; 4]> {
    let &[b, s, h, d] = x.dims() else {
        bail!(
            "{name}: expected rank 4 (batch, seq, heads, head_dim), got shape {:?}",
            x.dims()
        )
    };
    match x.dtype() {
        DType::F32 | DType::F16 | DType::BF16 | DType::F64 | DType::F8E4M3 => Ok([b, s, h, d]),
        dt => bail!("{name}: expected a float dtype (F32, F16, BF16, F64, F8E4M3), got {dt:?}"),
    }
}

impl Fp8Scaling {
    /// The scales' shape for a tensor of `dims`; checks `rows`.
    fn scales_shape(self, [b, s, h, _]: [usize; 4]) -> Result<Vec<usize>> {
        Ok(match self {
            Fp8Scaling::PerTensor => vec![1],
            Fp8Scaling::PerHead => vec![h],
            Fp8Scaling::PerBlock { rows: 0 } => {
                bail!("scaling: PerBlock needs rows > 0, got 0")
            }
            Fp8Scaling::PerBlock { rows } => vec![b, h, s.div_ceil(rows)],
        })
    }

    /// `scales`, checked against `dims`, as a tensor that broadcasts over the elements:
    /// `(1, 1, 1, 1)`, `(1, 1, heads, 1)` or `(batch, seq, heads, 1)`.
    fn broadcastable(self, scales: &Tensor, x: &Tensor, dims: [usize; 4]) -> Result<Tensor> {
        let want = self.scales_shape(dims)?;
        if scales.dtype() != DType::F32 {
            bail!("scales: expected dtype F32, got {:?}", scales.dtype())
        }
        if scales.dims() != want.as_slice() {
            bail!(
                "scales: expected shape {want:?} for {self:?} of x {:?}, got {:?}",
                x.dims(),
                scales.dims()
            )
        }
        if !scales.device().same_device(x.device()) {
            bail!(
                "scales: expected x's device ({:?}), got {:?}",
                x.device().location(),
                scales.device().location()
            )
        }
        let [b, s, h, _] = dims;
        match self {
            Fp8Scaling::PerTensor => scales.reshape((1, 1, 1, 1)),
            Fp8Scaling::PerHead => scales.reshape((1, 1, h, 1)),
            Fp8Scaling::PerBlock { rows } => {
                // Token t of a sequence reads its block's scale, t / rows.
                let blocks: Vec<u32> = (0..s).map(|t| (t / rows) as u32).collect();
                let blocks = Tensor::from_vec(blocks, s, x.device())?;
                // (b, h, nb) -> (b, h, s) -> (b, s, h, 1)
                scales
                    .index_select(&blocks, 2)?
                    .transpose(1, 2)?
                    .reshape((b, s, h, 1))
            }
        }
    }
}

/// FP8 scales of `x` `(batch, seq, heads, head_dim)` (any float dtype): each group's
/// `max |x| / 448` in F32, shaped as [`Fp8Scaling`] says. A group whose absolute maximum is 0
/// (or so small that the division underflows) gets scale 1, never 0.
///
/// Errors: `x` not rank 4 or not a float; `PerBlock { rows: 0 }`; `x` holding a NaN or an
/// infinity (no scale represents it). That check reads one scalar back, so on a GPU the call
/// waits for the device once.
pub fn fp8_scales(x: &Tensor, scaling: Fp8Scaling) -> Result<Tensor> {
    let dims = check_input(x, "x")?;
    if x.dtype() == DType::F8E4M3 {
        bail!("x: already F8E4M3; take the scales of the values it came from")
    }
    let shape = scaling.scales_shape(dims)?;
    if x.elem_count() == 0 {
        return Tensor::ones(shape, DType::F32, x.device());
    }
    let xa = x.detach().to_dtype(DType::F32)?.abs()?;
    // NaN · 0 and inf · 0 are NaN, finite · 0 is 0: the sum is finite iff every element is
    // (a max would skip a NaN; a plain sum could overflow on large, finite data).
    let probe = xa.affine(0.0, 0.0)?.sum_all()?.to_scalar::<f32>()?;
    if !probe.is_finite() {
        bail!("x: holds a NaN or an infinite value; FP8 scales need finite data")
    }
    let [b, s, h, d] = dims;
    let amax = match scaling {
        Fp8Scaling::PerTensor => xa.flatten_all()?.max_keepdim(0)?,
        Fp8Scaling::PerHead => xa.max(3)?.max(1)?.max(0)?,
        Fp8Scaling::PerBlock { rows } => {
            // A block longer than the sequence is the sequence (no padding past it).
            let rows = rows.min(s);
            let nb = s.div_ceil(rows);
            // Zero rows pad the last block; they do not change its maximum.
            xa.pad_with_zeros(1, 0, nb * rows - s)?
                .reshape((b, nb, rows, h, d))?
                .max(4)?
                .max(2)?
                .transpose(1, 2)?
                .contiguous()?
        }
    };
    // A true division (`Tensor / f64` multiplies by the reciprocal): amax / scale rounds to
    // 448, never past e4m3's saturation threshold.
    let scale = amax.broadcast_div(&Tensor::new(E4M3_MAX, x.device())?)?;
    let ones = scale.ones_like()?;
    scale.eq(0f32)?.where_cond(&ones, &scale)
}

/// The order of the keys of each 16 in a transposed V ([`fp8_v_transposed`]): stored
/// position `p` holds key `V_ORDER[p]`. The Hopper kernels' P V takes P's registers as they
/// come from the softmax, where a thread holds keys 2t, 2t + 1, 8 + 2t and 9 + 2t of each 16
/// at the e4m3 wgmma's positions 4t..4t + 3 (cuda/sm90/wgmma_fp8.cuh); V^T's keys follow.
const V_ORDER: [u32; 16] = [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15];
/// `V_ORDER`'s inverse: key `k` is stored at position `V_POSITION[k]`.
const V_POSITION: [u32; 16] = {
    let mut position = [0u32; 16];
    let mut p = 0;
    while p < 16 {
        position[V_ORDER[p] as usize] = p as u32;
        p += 1;
    }
    position
};

/// The keys a transposed V stores for `seqlen_k` ([`fp8_v_transposed`]): rounded up to
/// whole groups of 16.
pub(crate) fn fp8_v_transposed_keys(seqlen_k: usize) -> usize {
    seqlen_k.next_multiple_of(V_ORDER.len())
}

/// An F8E4M3 `v` `(batch, seqlen_k, num_heads_k, head_dim)` transposed for
/// [`crate::FlashAttn::fp8_v_transposed`]: `(batch, num_heads_k, head_dim, keys)` contiguous,
/// `keys` = seqlen_k rounded up to 16 (zeros past seqlen_k), the keys of each 16 in the order
/// the Hopper kernels' P V reads them. FP8 attention on Hopper then copies V^T's tiles as
/// they are instead of transposing every tile of V in shared memory. Transpose once, reuse
/// for every call on the same V (a prefill's V^T GEMM can write this layout directly).
///
/// ```
/// # fn main() -> candle::Result<()> {
/// use candle::{DType, Device, Tensor};
/// use candle_flash::quant::{fp8_scales, fp8_v_transposed, quantize_fp8, Fp8Scaling};
/// use candle_flash::FlashAttn;
/// let dev = Device::Cpu;
/// let x = |h| Tensor::randn(0f32, 1.0, (1, 40, h, 64), &dev);
/// let (q, k, v) = (x(4)?, x(2)?, x(2)?);
/// let s = Tensor::ones(1, DType::F32, &dev)?;
/// let f8 = |t: &Tensor| quantize_fp8(t, &s, Fp8Scaling::PerTensor);
/// let (q8, k8, v8) = (f8(&q)?, f8(&k)?, f8(&v)?);
/// let vt = fp8_v_transposed(&v8)?;
/// assert_eq!(vt.dims(), &[1, 2, 64, 48]); // keys rounded up to 16
/// let attn = FlashAttn::new().fp8_descales(&s, &s, &s);
/// let a = attn.forward(&q8, &k8, &v8)?;
/// let b = attn.clone().fp8_v_transposed().forward(&q8, &k8, &vt)?;
/// let diff = (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?.abs()?.max_all()?;
/// assert_eq!(diff.to_scalar::<f32>()?, 0.0);
/// # Ok(()) }
/// ```
///
/// Errors: `v` not F8E4M3 of rank 4.
pub fn fp8_v_transposed(v: &Tensor) -> Result<Tensor> {
    let (b, s, h, d) = v.dims4().map_err(|_| {
        candle::Error::Msg(format!(
            "v: expected F8E4M3 (batch, seqlen_k, num_heads_k, head_dim), got shape {:?}",
            v.dims()
        ))
    })?;
    if v.dtype() != DType::F8E4M3 {
        bail!("v: expected dtype F8E4M3, got {:?}", v.dtype())
    }
    let keys = fp8_v_transposed_keys(s);
    let order = Tensor::new(&V_ORDER, v.device())?;
    let store = |t: &Tensor| -> Result<Tensor> {
        let t = t.permute((0, 2, 3, 1))?.contiguous()?;
        let t = if keys == s {
            t
        } else {
            t.pad_with_zeros(3, 0, keys - s)?
        };
        t.reshape((b, h, d, keys / 16, 16))?
            .index_select(&order, 4)?
            .reshape((b, h, d, keys))
    };
    relayout_e4m3(v, store)
}

/// [`fp8_v_transposed`]'s inverse for `seqlen_k` keys: `(batch, seqlen_k, num_heads_k,
/// head_dim)` contiguous (the CPU path's V).
pub(crate) fn fp8_v_untransposed(vt: &Tensor, seqlen_k: usize) -> Result<Tensor> {
    let (b, h, d, keys) = vt.dims4()?;
    let position = Tensor::new(&V_POSITION, vt.device())?;
    let natural = |t: &Tensor| -> Result<Tensor> {
        t.reshape((b, h, d, keys / 16, 16))?
            .index_select(&position, 4)?
            .reshape((b, h, d, keys))?
            .narrow(3, 0, seqlen_k)?
            .permute((0, 3, 1, 2))?
            .contiguous()
    };
    relayout_e4m3(vt, natural)
}

/// `relayout` (permutes, pads, gathers: value-preserving) applied to the values of an
/// F8E4M3 tensor `(batch, seq, heads, head_dim)`, back in F8E4M3: on CUDA through F16 with
/// this crate's casts ([`e4m3_on_cuda`]), on the CPU through F32.
fn relayout_e4m3(x: &Tensor, relayout: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    if e4m3_on_cuda(x) {
        let one = Tensor::ones(1, DType::F32, x.device())?;
        let wide = dequantize_fp8(x, &one, Fp8Scaling::PerTensor, DType::F16)?;
        quantize_fp8(&relayout(&wide)?, &one, Fp8Scaling::PerTensor)
    } else {
        relayout(&x.to_dtype(DType::F32)?)?.to_dtype(DType::F8E4M3)
    }
}

/// F8E4M3 on CUDA, which candle-core 0.11.1 can neither cast nor copy strided (it looks up
/// `ucopy_f8e4m3` where candle-kernels has `ucopy_f8_e4m3`): plain copies go through
/// `crate::layout::contiguous_copy`; the helpers above that permute, pad and gather move the
/// values through F16 with this crate's casts, exactly (every e4m3 value is an f16, and
/// quantizing it again with scale 1 gives the same byte).
pub(crate) fn e4m3_on_cuda(x: &Tensor) -> bool {
    x.dtype() == DType::F8E4M3 && x.device().is_cuda()
}

/// `x` `(batch, seq, heads, head_dim)` (any float dtype) as F8E4M3: each element is
/// `e4m3(x / scale)` in f32 (a true division), rounded to nearest even, saturating at ±448
/// (NaN stays NaN). `scales` is F32 on x's device, shaped as [`fp8_scales`] returns them for
/// `scaling`; they should be positive and finite (they are not read back to check: a 0 gives
/// ±448 or NaN bytes).
///
/// No clamp precedes the rounding: it saturates by itself, on the CPU (float8's `from_f32`)
/// and on CUDA (this crate's kernel, `cvt` with `satfinite`; candle-core 0.11.1's own CUDA
/// casts to F8E4M3 fail), with the same rule, and a clamp would turn NaN into a number.
///
/// Errors: `x` not rank 4 or not a float; `scales` of another dtype, shape or device;
/// `PerBlock { rows: 0 }`.
pub fn quantize_fp8(x: &Tensor, scales: &Tensor, scaling: Fp8Scaling) -> Result<Tensor> {
    let dims = check_input(x, "x")?;
    let s = scaling.broadcastable(scales, x, dims)?;
    if x.dtype() == DType::F8E4M3 {
        bail!("x: already F8E4M3; quantize the values it came from")
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && x.dtype() != DType::F64 {
        return kernel::cast(&x.detach(), scales, scaling, kernel::Direction::Quantize);
    }
    x.detach()
        .to_dtype(DType::F32)?
        .broadcast_div(&s)?
        .to_dtype(DType::F8E4M3)
}

/// The real values of an F8E4M3 tensor `x` `(batch, seq, heads, head_dim)`: each element as
/// f32 times its group's scale, returned in `dtype` (F32, F16, BF16 or F64). `scales` as for
/// [`quantize_fp8`].
///
/// Errors: `x` not rank 4 or not F8E4M3; `scales` of another dtype, shape or device;
/// `PerBlock { rows: 0 }`; another `dtype`.
pub fn dequantize_fp8(
    x: &Tensor,
    scales: &Tensor,
    scaling: Fp8Scaling,
    dtype: DType,
) -> Result<Tensor> {
    let dims = check_input(x, "x")?;
    if x.dtype() != DType::F8E4M3 {
        bail!("x: expected dtype F8E4M3, got {:?}", x.dtype())
    }
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16 | DType::F64) {
        bail!("dtype: expected F32, F16, BF16 or F64, got {dtype:?}")
    }
    let s = scaling.broadcastable(scales, x, dims)?;
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        let wide = if dtype == DType::F64 {
            DType::F32
        } else {
            dtype
        };
        let to = kernel::Direction::Dequantize(wide);
        return kernel::cast(&x.detach(), scales, scaling, to)?.to_dtype(dtype);
    }
    x.detach()
        .to_dtype(DType::F32)?
        .broadcast_mul(&s)?
        .to_dtype(dtype)
}
