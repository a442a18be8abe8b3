//! Helpers shared by the CPU test binaries: problem sizes, random inputs, error measures and
//! the low-precision error-budget rule.
#![allow(dead_code)] // each test binary uses a different subset

use candle::{DType, Device, Result, Tensor, Var, D};
use candle_flash::{attention_slow, FlashAttn};

pub mod nan;
pub mod options;
pub mod property;
pub mod train;
pub mod varlen;

/// One attention problem: q `(b, sq, h, d)`, k and v `(b, sk, hk, d)`.
#[derive(Clone, Copy, Debug)]
pub struct Case {
    pub b: usize,
    pub sq: usize,
    pub sk: usize,
    pub h: usize,
    pub hk: usize,
    pub d: usize,
    pub causal: bool,
}

impl Case {
    /// `(b, sq, sk, h, hk, d)`, not causal.
    pub const fn new(b: usize, sq: usize, sk: usize, h: usize, hk: usize, d: usize) -> Self {
        Self {
            b,
            sq,
            sk,
            h,
            hk,
            d,
            causal: false,
        }
    }

    pub fn causal(self, causal: bool) -> Self {
        Self { causal, ..self }
    }

    /// The default softmax scale, `1 / sqrt(head_dim)`.
    pub fn scale(&self) -> f32 {
        1.0 / (self.d as f32).sqrt()
    }

    /// Fresh standard-normal q, k, v of `dtype` (drawn in f32, then rounded).
    pub fn qkv(&self, dtype: DType) -> Result<(Tensor, Tensor, Tensor)> {
        let q = randn((self.b, self.sq, self.h, self.d), dtype)?;
        let k = randn((self.b, self.sk, self.hk, self.d), dtype)?;
        let v = randn((self.b, self.sk, self.hk, self.d), dtype)?;
        Ok((q, k, v))
    }

    /// A random output-gradient weight shaped like the output.
    pub fn out_weight(&self, dtype: DType) -> Result<Tensor> {
        randn((self.b, self.sq, self.h, self.d), dtype)
    }

    pub fn flash(&self) -> FlashAttn {
        FlashAttn::new().causal(self.causal)
    }
}

/// Every case of `shapes`, causal and not.
pub fn with_causal(shapes: &[Case]) -> Vec<Case> {
    shapes
        .iter()
        .flat_map(|c| [c.causal(false), c.causal(true)])
        .collect()
}

/// Standard-normal values of `dtype` on the CPU.
pub fn randn<S: Into<candle::Shape>>(shape: S, dtype: DType) -> Result<Tensor> {
    let shape = shape.into();
    let values: Vec<f32> = (0..shape.elem_count()).map(|_| normal()).collect();
    Tensor::from_vec(values, shape, &Device::Cpu)?.to_dtype(dtype)
}

thread_local! {
    /// This thread's generator state: each test runs on a thread of its own, so its inputs
    /// are the same in every run (candle's CPU `randn` cannot be seeded, and a check near its
    /// rule's edge passed or failed by the draw).
    static RNG: std::cell::Cell<u64> = const { std::cell::Cell::new(0x9E37_79B9_7F4A_7C15) };
}

/// The next value of this thread's splitmix64 stream.
fn next_u64() -> u64 {
    RNG.with(|state| {
        let s = state.get().wrapping_add(0x9E37_79B9_7F4A_7C15);
        state.set(s);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    })
}

/// A standard normal value (Box-Muller) from this thread's stream.
fn normal() -> f32 {
    let uniform = || ((next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    let (u, v) = (uniform(), uniform());
    ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
}

/// The largest of `xs`, NaN as soon as one is NaN (`f32::max` would drop it: a NaN anywhere
/// must fail every `err <= bound` and `err == 0.0` check).
pub fn nan_max(xs: impl IntoIterator<Item = f32>) -> f32 {
    xs.into_iter().fold(0.0, |m: f32, x| {
        if m.is_nan() || x.is_nan() {
            f32::NAN
        } else {
            m.max(x)
        }
    })
}

/// `max |a - b|`, the difference taken in f64 so that an f64 reference (tests/common/train.rs)
/// keeps its digits (0 for empty tensors); NaN if any difference is NaN, inf if one side is
/// infinite where the other is finite.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let a = a.to_dtype(DType::F64)?.flatten_all()?;
    let b = b.to_dtype(DType::F64)?.flatten_all()?;
    let diffs = (a - b)?.abs()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    Ok(nan_max(diffs))
}

/// `max |a|`, computed in f32; NaN if any element is NaN.
pub fn max_abs(a: &Tensor) -> Result<f32> {
    let a = a.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    Ok(nan_max(a.into_iter().map(f32::abs)))
}

/// Asserts that `result` is an error whose message contains every part of `expected`.
pub fn assert_fails<T>(result: Result<T>, expected: &[&str]) {
    let message = match result {
        Ok(_) => panic!("expected an error containing {expected:?}, got Ok"),
        Err(e) => e.to_string(),
    };
    for part in expected {
        assert!(
            message.contains(part),
            "error {message:?} does not contain {part:?}"
        );
    }
}

/// Asserts `max |ours - reference| <= tol · max(1, max |reference|)`.
pub fn assert_close(what: &str, ours: &Tensor, reference: &Tensor, tol: f32) -> Result<()> {
    let err = max_abs_diff(ours, reference)?;
    let bound = tol * max_abs(reference)?.max(1.0);
    assert!(err <= bound, "{what}: max abs error {err:e} > {bound:e}");
    Ok(())
}

/// The low-precision rule: `ours` (computed from low-precision inputs) may be at most
/// `factor` times as far from `exact` (f32 math on the same, upcast inputs) as `baseline`
/// (the same math done in the low precision), plus 1e-5.
pub fn assert_within_budget(
    what: &str,
    ours: &Tensor,
    baseline: &Tensor,
    exact: &Tensor,
    factor: f32,
) -> Result<()> {
    let ours_err = max_abs_diff(ours, exact)?;
    let base_err = max_abs_diff(baseline, exact)?;
    let bound = factor * base_err + 1e-5;
    assert!(
        ours_err <= bound,
        "{what}: error {ours_err:e} > {factor} x baseline error {base_err:e} + 1e-5"
    );
    Ok(())
}

/// Explicit mantissa bits of a floating dtype (f32's for anything wider than 16 bits).
pub fn mantissa_bits(dtype: DType) -> u32 {
    match dtype {
        DType::BF16 => 7,
        DType::F16 => 10,
        _ => 23,
    }
}

/// The unit roundoff of `dtype`: half the spacing of its values just above 1, the largest
/// relative error of one rounding.
pub fn unit_roundoff(dtype: DType) -> f32 {
    (-(mantissa_bits(dtype) as f32 + 1.0)).exp2()
}

/// The rounding rule for results computed in f32 and stored in a low precision (the CPU
/// implementation): every element within `ulps` units in the last place of `ours`' dtype at
/// the exact value, plus 1e-5 of the largest |exact| (sums that cancel to near zero differ by
/// f32 summation order). Much tighter than [`assert_within_budget`] at long rows, where the
/// low-precision baseline's own error grows with the number of keys: a skipped tile of 16
/// keys among 4096 passes that rule but not this one (tests/cpu_planted.rs).
pub fn assert_within_rounding(what: &str, ours: &Tensor, exact: &Tensor, ulps: f32) -> Result<()> {
    let mantissa = mantissa_bits(ours.dtype());
    let got = ours.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let want = exact
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let floor = 1e-5 * nan_max(want.iter().map(|x| x.abs()));
    for (i, (&a, &b)) in got.iter().zip(&want).enumerate() {
        // f16's smallest normal is 2^-14; below it the spacing stays 2^-24.
        let ulp = (b.abs().max(6.1e-5)).log2().floor().exp2() / (1 << mantissa) as f32;
        let bound = ulps * ulp + floor;
        let err = (a - b).abs();
        assert!(
            err <= bound,
            "{what}: element {i}: {a} vs exact {b}: error {err:e} > {ulps} ulp ({bound:e})"
        );
    }
    Ok(())
}

/// Natural-log logsumexp of the scaled, masked scores in plain ops: `(b, h, sq)` f32, `-inf`
/// for rows that see no key. It skips the usual max subtraction: test scores are O(1), and
/// `ln(sum(exp(-inf)))` is then exactly `-inf` for fully masked rows.
pub fn lse_slow(q: &Tensor, k: &Tensor, scale: f32, causal: bool) -> Result<Tensor> {
    let (_, sq, h, _) = q.dims4()?;
    let (_, sk, hk, _) = k.dims4()?;
    let q = q.to_dtype(DType::F32)?.transpose(1, 2)?.contiguous()?; // (b, h, sq, d)
    let k = k.to_dtype(DType::F32)?.transpose(1, 2)?; // (b, hk, sk, d)
                                                      // Query head `i` reads K head `i / (h / hk)`.
    let k = Tensor::cat(
        &(0..h)
            .map(|i| k.narrow(1, i / (h / hk), 1))
            .collect::<Result<Vec<_>>>()?,
        1,
    )?
    .contiguous()?;
    let scores = (q.matmul(&k.t()?)? * scale as f64)?; // (b, h, sq, sk)
    let visible: Vec<u8> = (0..sq)
        .flat_map(|i| (0..sk).map(move |j| u8::from(!causal || j + sq <= i + sk)))
        .collect();
    let visible =
        Tensor::from_vec(visible, (sq, sk), &Device::Cpu)?.broadcast_as(scores.shape())?;
    let neg_inf = Tensor::new(f32::NEG_INFINITY, &Device::Cpu)?.broadcast_as(scores.shape())?;
    visible
        .where_cond(&scores, &neg_inf)?
        .exp()?
        .sum(D::Minus1)?
        .log()
}

/// Gradients of `sum(attn(q, k, v) · weight)` with respect to q, k and v, by Candle's autograd.
pub fn grads<F>(attn: F, q: &Tensor, k: &Tensor, v: &Tensor, weight: &Tensor) -> Result<[Tensor; 3]>
where
    F: Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
{
    let (q, k, v) = (
        Var::from_tensor(q)?,
        Var::from_tensor(k)?,
        Var::from_tensor(v)?,
    );
    let out = attn(&q, &k, &v)?;
    let grads = (out * weight)?.sum_all()?.backward()?;
    let get = |x: &Var| grads.get(x).cloned().expect("no gradient");
    Ok([get(&q), get(&k), get(&v)])
}

/// `attention_slow` with the case's mask and the default scale.
pub fn slow(case: &Case, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    attention_slow(q, k, v, case.scale(), case.causal)
}
