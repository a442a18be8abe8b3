//! The Walsh–Hadamard rotation of FlashAttention-3's incoherent processing (§3.3).

use candle::{bail, DType, Result, Tensor};

/// The largest last dimension [`hadamard`] rotates: its `(d, d)` matrix is then 64 MiB of f32.
pub const MAX_HADAMARD_DIM: usize = 4096;

/// `x` times the orthonormal Walsh–Hadamard matrix `H_d / sqrt(d)` over its last dimension
/// `d`: entry `(i, j)` of the matrix is `(-1)^popcount(i & j) / sqrt(d)` (Sylvester's order).
///
/// The matrix is symmetric and orthonormal, so `hadamard(hadamard(x)) == x` up to rounding,
/// and rotating both q and k leaves `q · kᵀ`, the attention scores, unchanged. What changes
/// is how the values spread: a feature (head_dim column) with outliers, common in the keys
/// and queries of trained models, is mixed into every column, so each row's maximum, and with
/// it an FP8 scale, shrinks toward the row's typical magnitude and the quantization error of
/// the other entries with it (FlashAttention-3's incoherent processing). Rotate q and k,
/// never v (the output would come out rotated).
///
/// - `x`: any rank >= 1, any device; F32, F16 or BF16 (computed in f32) or F64 (in f64);
/// - `d`, the last dimension, a power of two in `1..=MAX_HADAMARD_DIM` (head dims 64, 128,
///   256 are).
///
/// Returns x's shape and dtype. A matmul with the matrix, built on x's device at each call
/// (`d²` elements); differentiable. Errors: rank 0, a last dimension that is not a power of two
/// or above [`MAX_HADAMARD_DIM`], another dtype (F8E4M3 included: rotate before quantizing).
///
/// ```
/// # fn main() -> candle::Result<()> {
/// use candle::{DType, Device, Tensor, D};
/// use candle_flash::quant::{fp8_scales, hadamard, quantize_fp8, Fp8Scaling};
/// use candle_flash::FlashAttn;
/// let dev = Device::Cpu;
/// let q = Tensor::randn(0f32, 1.0, (1, 32, 4, 64), &dev)?;
/// let k = Tensor::randn(0f32, 1.0, (1, 32, 4, 64), &dev)?;
/// let v = Tensor::randn(0f32, 1.0, (1, 32, 4, 64), &dev)?;
/// // The scores do not change...
/// let (qh, kh) = (hadamard(&q)?, hadamard(&k)?);
/// let scores = |q: &Tensor, k: &Tensor| q.transpose(1, 2)?.matmul(&k.transpose(1, 2)?.t()?);
/// let diff = (scores(&q, &k)? - scores(&qh, &kh)?)?.abs()?.max_all()?.to_scalar::<f32>()?;
/// assert!(diff < 1e-4);
/// // ...so quantize the rotated q and k (v as it is) and attend.
/// let s = Fp8Scaling::PerHead;
/// let (sq, sk, sv) = (fp8_scales(&qh, s)?, fp8_scales(&kh, s)?, fp8_scales(&v, s)?);
/// let out = FlashAttn::new().fp8_descales(&sq, &sk, &sv).forward(
///     &quantize_fp8(&qh, &sq, s)?,
///     &quantize_fp8(&kh, &sk, s)?,
///     &quantize_fp8(&v, &sv, s)?,
/// )?;
/// assert_eq!(out.dims(), q.dims());
/// # Ok(()) }
/// ```
pub fn hadamard(x: &Tensor) -> Result<Tensor> {
    let Some(&d) = x.dims().last() else {
        bail!("x: expected rank >= 1 (the last dimension is rotated), got a scalar")
    };
    if !d.is_power_of_two() || d > MAX_HADAMARD_DIM {
        bail!(
            "x: the last dimension must be a power of two in 1..={MAX_HADAMARD_DIM} (the \
             Walsh-Hadamard matrix's size), got {d} (shape {:?})",
            x.dims()
        )
    }
    let compute = match x.dtype() {
        DType::F32 | DType::F16 | DType::BF16 => DType::F32,
        DType::F64 => DType::F64,
        dt => bail!(
            "x: expected F32, F16, BF16 or F64, got {dt:?} (rotate q and k before quantizing \
             them to F8E4M3)"
        ),
    };
    if x.elem_count() == 0 {
        return Ok(x.clone());
    }
    let rows = x.elem_count() / d;
    let flat = x.to_dtype(compute)?.reshape((rows, d))?;
    flat.matmul(&matrix(d, compute, x.device())?)?
        .reshape(x.shape())?
        .to_dtype(x.dtype())
}

/// `H_d / sqrt(d)`, `(d, d)` in `dtype` (F32 or F64) on `device`:
/// `(-1)^popcount(i & j) / sqrt(d)`.
fn matrix(d: usize, dtype: DType, device: &candle::Device) -> Result<Tensor> {
    let norm = 1.0 / (d as f64).sqrt();
    let entry = |ij: usize| {
        let (i, j) = (ij / d, ij % d);
        if (i & j).count_ones() % 2 == 0 {
            norm
        } else {
            -norm
        }
    };
    let cpu = &candle::Device::Cpu;
    let h = match dtype {
        DType::F64 => Tensor::from_vec((0..d * d).map(entry).collect::<Vec<f64>>(), (d, d), cpu)?,
        _ => Tensor::from_vec(
            (0..d * d).map(|ij| entry(ij) as f32).collect::<Vec<f32>>(),
            (d, d),
            cpu,
        )?,
    };
    h.to_device(device)
}
