//! Checks of `candle_flash::train` on any device, shared by the CPU tests (tests/cpu_train.rs)
//! and the GPU suite (its `train` section). Inputs are drawn on the CPU and moved to the
//! device; the references are the same functions written in plain Candle ops (autograd for
//! the gradients), computed on the CPU in f64 (exact) and in the inputs' dtype (baseline).
//! The exact side is f64 even for f32 inputs, so that the f32 baseline carries the rounding
//! of the same math (RMSNorm's one-column dx cancels to ~eps/x^2 of its terms, and a bound
//! of the floor alone failed on a 2-ulp `rsqrtf`).
//! Rule as for the attention: our error at most 2x (outputs) / 3x (gradients) the baseline's,
//! plus 1e-5 relative to the largest reference value; `infer::linear`'s outputs get half a
//! unit roundoff of their dtype more, since they are compared over few elements, each
//! rounded once by both sides (see `untracked`).

use candle::{DType, Device, Result, Tensor, Var, D};
use candle_flash::train;

use super::{max_abs, max_abs_diff, randn, unit_roundoff};

pub mod adamw_state;

/// Reports each named check's outcome.
pub type Report<'a> = &'a mut dyn FnMut(String, Result<()>);

const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// `slack`: unit roundoffs of `base`'s dtype, relative to the largest exact value, added to
/// the bound (see [`untracked`]).
fn within(
    what: &str,
    ours: &Tensor,
    base: &Tensor,
    exact: &Tensor,
    factor: f32,
    slack: f32,
) -> Result<()> {
    let ours_err = max_abs_diff(&ours.to_device(&Device::Cpu)?, exact)?;
    let base_err = max_abs_diff(base, exact)?;
    let bound =
        factor * base_err + (slack * unit_roundoff(base.dtype()) + 1e-5) * max_abs(exact)?.max(1.0);
    if ours_err <= bound {
        Ok(())
    } else {
        candle::bail!("{what}: error {ours_err:e} > {factor} x baseline {base_err:e} + floor")
    }
}

/// Output and input gradients of `f` at `inputs` for the loss `sum(f(inputs) * weight)`.
fn run(
    f: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    inputs: &[Tensor],
    weight: &Tensor,
) -> Result<(Tensor, Vec<Option<Tensor>>)> {
    let vars = inputs
        .iter()
        .map(Var::from_tensor)
        .collect::<Result<Vec<_>>>()?;
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&ts)?;
    let acc = if y.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let loss = y
        .to_dtype(acc)?
        .mul(&weight.to_dtype(acc)?.to_device(y.device())?)?
        .sum_all()?;
    let grads = loss.backward()?;
    let g = vars
        .iter()
        .map(|v| grads.get(v.as_tensor()).cloned())
        .collect();
    Ok((y, g))
}

/// Runs `ours` on `dev` and `reference` on the CPU in f64 and in `dtype` from the same
/// rounded inputs (`differentiable[i]`: compare input i's gradient), applying the rule, with
/// `output_slack` unit roundoffs of slack on the output's bound ([`within`]).
#[allow(clippy::too_many_arguments)]
fn compare(
    name: &str,
    dev: &Device,
    ours: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    reference: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    inputs: &[Tensor],
    differentiable: &[bool],
    out_shape: &[usize],
    dtype: DType,
    output_slack: f32,
) -> Result<()> {
    compare_base_on(
        name,
        dev,
        &Device::Cpu,
        ours,
        reference,
        inputs,
        differentiable,
        out_shape,
        dtype,
        output_slack,
    )
}

/// [`compare`] with the `dtype` baseline run on `base_dev` (the exact reference stays on the
/// CPU in f64): for an op that composes Candle's own ops with ours, the baseline takes the
/// same device's kernels for Candle's part, so that the rule judges ours.
#[allow(clippy::too_many_arguments)]
fn compare_base_on(
    name: &str,
    dev: &Device,
    base_dev: &Device,
    ours: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    reference: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    inputs: &[Tensor],
    differentiable: &[bool],
    out_shape: &[usize],
    dtype: DType,
    output_slack: f32,
) -> Result<()> {
    let weight = randn(out_shape, dtype)?;
    let to = |d: &Device| {
        inputs
            .iter()
            .map(|t| t.to_device(d))
            .collect::<Result<Vec<_>>>()
    };
    let (y, g) = run(ours, &to(dev)?, &weight)?;
    let up = |t: &Tensor| match t.dtype() {
        DType::BF16 | DType::F16 | DType::F32 => t.to_dtype(DType::F64),
        _ => Ok(t.clone()),
    };
    let exact_in = inputs.iter().map(up).collect::<Result<Vec<_>>>()?;
    let (ye, ge) = run(reference, &exact_in, &weight)?;
    let (yb, gb) = run(reference, &to(base_dev)?, &weight)?;
    let yb = yb.to_device(&Device::Cpu)?;
    let gb = gb
        .into_iter()
        .map(|g| g.map(|g| g.to_device(&Device::Cpu)).transpose())
        .collect::<Result<Vec<_>>>()?;
    if y.dtype() != yb.dtype() || y.dims() != ye.dims() {
        candle::bail!(
            "{name}: output {:?} {:?}, expected {:?} {:?}",
            y.dtype(),
            y.dims(),
            yb.dtype(),
            ye.dims()
        )
    }
    within(&format!("{name} output"), &y, &yb, &ye, 2.0, output_slack)?;
    for (i, d) in differentiable.iter().enumerate() {
        if !d {
            continue;
        }
        match (&g[i], &gb[i], &ge[i]) {
            (Some(g), Some(gb), Some(ge)) => {
                if g.dtype() != inputs[i].dtype() {
                    candle::bail!(
                        "{name}: gradient {i} is {:?}, expected {:?}",
                        g.dtype(),
                        inputs[i].dtype()
                    )
                }
                within(&format!("{name} grad {i}"), g, gb, ge, 3.0, 0.0)?
            }
            _ => candle::bail!("{name}: gradient of input {i} missing"),
        }
    }
    Ok(())
}

/// One RMSNorm check: x of `shape` in `dtype`, the weight in f32 or in x's dtype.
fn rms_norm_case(dev: &Device, dtype: DType, shape: &[usize], w_f32: bool) -> (String, Result<()>) {
    let name = format!("rms_norm {dtype:?} {shape:?} weight_f32={w_f32}");
    let r = (|| {
        let hidden = *shape.last().unwrap();
        let x = randn(shape, dtype)?;
        let w_dtype = if w_f32 { DType::F32 } else { dtype };
        let w = randn(hidden, DType::F32)?
            .affine(0.5, 1.0)?
            .to_dtype(w_dtype)?;
        let ours = |t: &[Tensor]| train::rms_norm(&t[0], &t[1], 1e-5);
        // Candle's op-by-op form in x's dtype, weight cast to it.
        let reference = |t: &[Tensor]| {
            let w = t[1].to_dtype(t[0].dtype())?;
            candle_nn::ops::rms_norm_slow(&t[0], &w, 1e-5)
        };
        let dw_compared = w_f32 || dtype == DType::F32;
        compare(
            &name,
            dev,
            &ours,
            &reference,
            &[x, w],
            &[true, dw_compared],
            shape,
            dtype,
            0.0,
        )
    })();
    (name, r)
}

pub fn rms_norm(dev: &Device, report: Report) {
    for dtype in DTYPES {
        for shape in [vec![1, 1], vec![13, 7], vec![2, 5, 96], vec![64, 768]] {
            for w_f32 in [true, false] {
                let (name, r) = rms_norm_case(dev, dtype, &shape, w_f32);
                report(name, r);
            }
        }
    }
}

/// The op-by-op rotary of a LLaMA model (`rotate_half`).
fn rotary_slow(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let cos = Tensor::cat(&[cos, cos], D::Minus1)?
        .unsqueeze(1)?
        .to_dtype(x.dtype())?;
    let sin = Tensor::cat(&[sin, sin], D::Minus1)?
        .unsqueeze(1)?
        .to_dtype(x.dtype())?;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?
}

fn rotary_case(
    dev: &Device,
    dtype: DType,
    (n, h, d): (usize, usize, usize),
) -> (String, Result<()>) {
    let name = format!("rotary {dtype:?} ({n}, {h}, {d})");
    let r = (|| {
        let x = randn((n, h, d), dtype)?;
        let angles = (randn((n, d / 2), DType::F32)? * 3.0)?;
        let (cos, sin) = (angles.cos()?, angles.sin()?);
        let (c2, s2) = (cos.to_device(dev)?, sin.to_device(dev)?);
        let ours = move |t: &[Tensor]| train::rotary(&t[0], &c2, &s2);
        let reference = move |t: &[Tensor]| rotary_slow(&t[0], &cos, &sin);
        compare(
            &name,
            dev,
            &ours,
            &reference,
            &[x],
            &[true],
            &[n, h, d],
            dtype,
            0.0,
        )
    })();
    (name, r)
}

pub fn rotary(dev: &Device, report: Report) {
    for dtype in DTYPES {
        for shape in [(1, 1, 2), (13, 3, 64), (33, 4, 128), (5, 2, 40)] {
            let (name, r) = rotary_case(dev, dtype, shape);
            report(name, r);
        }
    }
}

fn swiglu_case(dev: &Device, dtype: DType, shape: &[usize]) -> (String, Result<()>) {
    let name = format!("swiglu {dtype:?} {shape:?}");
    let r = (|| {
        let g = (randn(shape, dtype)? * 2.0)?;
        let u = randn(shape, dtype)?;
        let ours = |t: &[Tensor]| train::swiglu(&t[0], &t[1]);
        let reference = |t: &[Tensor]| t[0].silu()? * &t[1];
        compare(
            &name,
            dev,
            &ours,
            &reference,
            &[g, u],
            &[true, true],
            shape,
            dtype,
            0.0,
        )
    })();
    (name, r)
}

pub fn swiglu(dev: &Device, report: Report) {
    for dtype in DTYPES {
        for shape in [vec![1, 1], vec![17, 33], vec![64, 2048]] {
            let (name, r) = swiglu_case(dev, dtype, &shape);
            report(name, r);
        }
        for (rows, cols) in [(1, 1), (1, 40), (17, 33), (16, 2048)] {
            let (name, r) = swiglu_halves_case(dev, dtype, rows, cols);
            report(name, r);
        }
    }
}

/// SwiGLU of the two halves of one `(rows, 2 * cols)` tensor (a fused gate-and-up
/// projection), which the op reads in place: outputs and gradients through the views.
fn swiglu_halves_case(
    dev: &Device,
    dtype: DType,
    rows: usize,
    cols: usize,
) -> (String, Result<()>) {
    let name = format!("swiglu halves of {dtype:?} ({rows}, 2 x {cols})");
    let r = (|| {
        let g = (randn((rows, cols), dtype)? * 2.0)?;
        let u = randn((rows, cols), dtype)?;
        let ours = move |t: &[Tensor]| {
            let gu = Tensor::cat(&[&t[0], &t[1]], 1)?;
            train::swiglu(&gu.narrow(1, 0, cols)?, &gu.narrow(1, cols, cols)?)
        };
        let reference = |t: &[Tensor]| t[0].silu()? * &t[1];
        compare(
            &name,
            dev,
            &ours,
            &reference,
            &[g, u],
            &[true, true],
            &[rows, cols],
            dtype,
            0.0,
        )
    })();
    (name, r)
}

/// `(x + r, rms_norm(x + r))` stacked, the reference in plain ops (the sum rounded to the
/// inputs' dtype first, as the fused op stores it).
fn add_rms_norm_slow(t: &[Tensor]) -> Result<Tensor> {
    let h = (&t[0] + &t[1])?;
    let y = candle_nn::ops::rms_norm_slow(&h, &t[2].to_dtype(h.dtype())?, 1e-5)?;
    Tensor::stack(&[h, y], 0)
}

/// The fused residual add and norm: outputs untracked (the kernel alone), and outputs and
/// gradients of all three inputs through autograd, by the 2x/3x rule.
fn add_rms_norm_case(
    dev: &Device,
    dtype: DType,
    shape: &[usize],
    w_f32: bool,
) -> (String, Result<()>) {
    let name = format!("add_rms_norm {dtype:?} {shape:?} weight_f32={w_f32}");
    let r = (|| {
        let hidden = *shape.last().unwrap();
        let x = randn(shape, dtype)?;
        let res = randn(shape, dtype)?;
        let w_dtype = if w_f32 { DType::F32 } else { dtype };
        let w = randn(hidden, DType::F32)?
            .affine(0.5, 1.0)?
            .to_dtype(w_dtype)?;
        let ours = |t: &[Tensor]| {
            let (h, y) = train::add_rms_norm(&t[0], &t[1], &t[2], 1e-5)?;
            Tensor::stack(&[h, y], 0)
        };
        let mut out_shape = vec![2];
        out_shape.extend_from_slice(shape);
        // Untracked: the forward alone (the kernel) against the f64 and same-dtype references.
        let inputs = [x.clone(), res.clone(), w.clone()];
        untracked(&name, dev, &ours, &add_rms_norm_slow, &inputs)?;
        let dw_compared = w_f32 || dtype == DType::F32;
        compare(
            &name,
            dev,
            &ours,
            &add_rms_norm_slow,
            &[x, res, w],
            &[true, true, dw_compared],
            &out_shape,
            dtype,
            0.0,
        )
    })();
    (name, r)
}

/// `f` on untracked inputs on `dev` (the path a decoding step takes) against `reference` in
/// f64 and in the inputs' dtype on the CPU, by the 2x rule with half a unit roundoff of the dtype
/// (relative to the largest exact value) of slack: a few outputs whose rounding differs
/// from the baseline's by luck (the kernel rounds once where Candle's ops round twice) are
/// not a fault, an index off by one is.
fn untracked(
    name: &str,
    dev: &Device,
    f: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    reference: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    inputs: &[Tensor],
) -> Result<()> {
    let on_dev = inputs
        .iter()
        .map(|t| t.to_device(dev))
        .collect::<Result<Vec<_>>>()?;
    let y = f(&on_dev)?;
    let exact_in = inputs
        .iter()
        .map(|t| t.to_dtype(DType::F64))
        .collect::<Result<Vec<_>>>()?;
    let base = reference(inputs)?;
    if y.dims() != base.dims() || y.dtype() != base.dtype() {
        candle::bail!(
            "{name}: output {:?} {:?}, expected {:?} {:?}",
            y.dims(),
            y.dtype(),
            base.dims(),
            base.dtype()
        )
    }
    let exact = reference(&exact_in)?;
    within(&format!("{name} untracked"), &y, &base, &exact, 2.0, 0.5)
}

/// `x @ w^T (+ add)` in plain ops: the product rounded, then the add.
fn linear_slow(t: &[Tensor]) -> Result<Tensor> {
    let k = t[0].dim(D::Minus1)?;
    let mut dims = t[0].dims().to_vec();
    *dims.last_mut().unwrap() = t[1].dim(0)?;
    let y = t[0].reshape(((), k))?.matmul(&t[1].t()?)?.reshape(dims)?;
    match t.get(2) {
        Some(a) => y + a,
        None => Ok(y),
    }
}

/// `silu(x @ gate^T) * (x @ up^T)` in plain ops, `t[1]` stacking gate's rows and up's: the
/// same math as the op in the inputs' precision, the products rounded to it, the SwiGLU in
/// f32 (f64 for f64 inputs) and rounded once.
fn linear_swiglu_slow(t: &[Tensor]) -> Result<Tensor> {
    let y = linear_slow(&t[..2])?;
    let dtype = y.dtype();
    let wide = if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let y = y.to_dtype(wide)?;
    let i = y.dim(D::Minus1)? / 2;
    (y.narrow(D::Minus1, 0, i)?.silu()? * y.narrow(D::Minus1, i, i)?)?.to_dtype(dtype)
}

/// `infer::linear` and `infer::linear_swiglu` at x of `dims` (..., k) and a weight of `n`
/// rows: untracked (the few-row kernel where it applies), and with gradients (the matmul).
fn linear_case(
    dev: &Device,
    dtype: DType,
    dims: &[usize],
    n: usize,
    mode: &str,
) -> (String, Result<()>) {
    let name = format!("infer::linear {mode} {dtype:?} x {dims:?} weight ({n}, k)");
    let r = (|| {
        let k = *dims.last().unwrap();
        let x = randn(dims, dtype)?;
        // Weights of a linear layer's scale, so that sums over k stay near one.
        let w = (randn((n, k), DType::F32)? * (1.0 / (k as f64).sqrt()))?.to_dtype(dtype)?;
        let swiglu = mode.ends_with("swiglu");
        let mut out = dims.to_vec();
        *out.last_mut().unwrap() = if swiglu { n / 2 } else { n };
        let mut inputs = vec![x, w];
        if mode == "add" {
            inputs.push(randn(out.as_slice(), dtype)?);
        }
        if mode.starts_with("norm") {
            // A norm weight near one, as trained ones are.
            inputs.push(((randn(k, DType::F32)? * 0.1)? + 1.0)?.to_dtype(dtype)?);
        }
        let ours = |t: &[Tensor]| match mode {
            "swiglu" => candle_flash::infer::linear_swiglu(&t[0], &t[1]),
            "norm" => candle_flash::infer::rms_norm_linear(&t[0], &t[2], 1e-5, &t[1]),
            "norm_swiglu" => candle_flash::infer::rms_norm_linear_swiglu(&t[0], &t[2], 1e-5, &t[1]),
            _ => candle_flash::infer::linear(&t[0], &t[1], t.get(2)),
        };
        let reference = |t: &[Tensor]| {
            // The norm as the op specifies it (train::rms_norm's math: f32, one rounding).
            let normed = |t: &[Tensor]| -> Result<Vec<Tensor>> {
                let dtype = t[0].dtype();
                let wide = if dtype == DType::F64 {
                    DType::F64
                } else {
                    DType::F32
                };
                let x = t[0].to_dtype(wide)?;
                let k = x.dim(D::Minus1)? as f64;
                let rstd = ((x.sqr()?.sum_keepdim(D::Minus1)? / k)? + 1e-5)?
                    .sqrt()?
                    .recip()?;
                let h = x
                    .broadcast_mul(&rstd)?
                    .broadcast_mul(&t[2].to_dtype(wide)?)?
                    .to_dtype(dtype)?;
                Ok(vec![h, t[1].clone()])
            };
            match mode {
                "swiglu" => linear_swiglu_slow(t),
                "norm" => linear_slow(&normed(t)?),
                "norm_swiglu" => linear_swiglu_slow(&normed(t)?),
                _ => linear_slow(t),
            }
        };
        untracked(&name, dev, &ours, &reference, &inputs)?;
        let differentiable = vec![true; inputs.len()];
        // Tracked, the op is Candle's matmul between our norm and SwiGLU, each rounding where
        // the baseline's ops round: the same slack on the output as untracked. The baseline
        // runs on `dev` too, so that both take Candle's matmul there (cuBLAS): at (2, 3000) x
        // (3000, 70) in bf16 the op erred three times a CPU baseline summed in f32.
        compare_base_on(
            &name,
            dev,
            dev,
            &ours,
            &reference,
            &inputs,
            &differentiable,
            &out,
            dtype,
            0.5,
        )
    })();
    (name, r)
}

pub fn linear(dev: &Device, report: Report) {
    for dtype in DTYPES {
        // One to four rows (the CUDA-core kernel on CUDA in bf16/f16), five to sixteen (the
        // tensor-core kernel: k past and short of its 64-element chunks, columns short of a
        // 16-column tile, long rows split over up to sixteen warps, the norm's padded rows in
        // shared memory up to 96 KB and the matmul past it, the matmul past 32768 columns),
        // then the matmul's row counts.
        let shapes: [(&[usize], usize); 20] = [
            (&[1, 8], 1),
            (&[1, 2048], 3072),
            (&[2, 40], 3),
            (&[3, 64], 130),
            (&[4, 1, 256], 64),
            (&[1, 1, 8192], 96),
            (&[5, 64], 32),
            (&[16, 128], 48),
            (&[8, 2048], 3072),
            (&[9, 1, 8200], 40),
            (&[12, 40], 20),
            (&[16, 8192], 64),
            (&[16, 2048], 2048),
            (&[11, 1000], 40),
            (&[6, 64], 32776),
            (&[2, 7, 24], 530),
            (&[17, 64], 32),
            (&[2, 36], 16),
            // More column groups than the few-row kernel's grid holds (grid-stride).
            (&[1, 64], 40000),
            (&[2, 3000], 70),
        ];
        for (dims, n) in shapes {
            for mode in ["plain", "add", "swiglu", "norm", "norm_swiglu"] {
                // SwiGLU's weight stacks two halves: an even row count.
                let n = if mode.ends_with("swiglu") {
                    n + n % 2
                } else {
                    n
                };
                let (name, r) = linear_case(dev, dtype, dims, n, mode);
                report(name, r);
            }
        }
        // x starting off a 16-byte boundary: the matmul's path, same results.
        let name = format!("infer::linear {dtype:?} x at an odd offset");
        let r = (|| {
            let x = randn((1, 72), dtype)?;
            let w = randn((24, 64), dtype)?;
            let ours =
                |t: &[Tensor]| candle_flash::infer::linear(&t[0].narrow(1, 4, 64)?, &t[1], None);
            let reference = |t: &[Tensor]| linear_slow(&[t[0].narrow(1, 4, 64)?, t[1].clone()]);
            untracked(&name, dev, &ours, &reference, &[x, w])
        })();
        report(name, r);
    }
}

/// The first index of each row's largest value, NaN above every number: the definition, in
/// plain Rust over f32 (every value of the three dtypes).
fn argmax_slow(x: &Tensor) -> Result<Vec<u32>> {
    let rows = x.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    Ok(rows
        .iter()
        .map(|r| {
            let mut at = 0;
            for (i, &v) in r.iter().enumerate() {
                let best = r[at];
                if (v.is_nan() && !best.is_nan()) || v > best {
                    at = i;
                }
            }
            at as u32
        })
        .collect())
}

/// `infer::argmax` equal to [`argmax_slow`]: random rows (a 128k vocabulary among them),
/// rows full of ties (values rounded to integers), NaN and -inf, rows starting off a 16-byte
/// boundary (the scalar loads), and the leading dims kept.
pub fn argmax(dev: &Device, report: Report) {
    for dtype in DTYPES {
        for (rows, n, kind) in [
            (1, 1, "random"),
            (3, 7, "random"),
            (16, 128256, "random"),
            (5, 32003, "random"),
            (8, 1000, "ties"),
            (4, 64, "special"),
            (6, 200, "offset"),
        ] {
            let name = format!("infer::argmax {dtype:?} ({rows}, {n}) {kind}");
            let r = (|| {
                let mut x = randn((rows, n + usize::from(kind == "offset")), DType::F32)?;
                if kind == "ties" {
                    x = (x * 2.0)?.round()?;
                }
                if kind == "special" {
                    let mut v = x.to_vec2::<f32>()?;
                    v[0][10] = f32::NAN;
                    v[0][20] = f32::NAN;
                    v[1].iter_mut().for_each(|e| *e = f32::NEG_INFINITY);
                    v[2][63] = f32::INFINITY;
                    v[3][0] = f32::INFINITY;
                    v[3][5] = f32::INFINITY;
                    x = Tensor::new(v, &Device::Cpu)?;
                }
                let x = x.to_dtype(dtype)?;
                let x = if kind == "offset" {
                    x.narrow(1, 1, n)?
                } else {
                    x
                };
                let want = argmax_slow(&x)?;
                let got = candle_flash::infer::argmax(&x.to_device(dev)?)?;
                if got.dims() != [rows] || got.dtype() != DType::U32 {
                    candle::bail!(
                        "output {:?} {:?}, expected ({rows},) U32",
                        got.dims(),
                        got.dtype()
                    )
                }
                let got = got.to_vec1::<u32>()?;
                if got != want {
                    candle::bail!("indices {got:?}, expected {want:?}")
                }
                let x3 = x.reshape((1, rows, n))?.to_device(dev)?;
                let got3 = candle_flash::infer::argmax(&x3)?;
                if got3.dims() != [1, rows] || got3.flatten_all()?.to_vec1::<u32>()? != want {
                    candle::bail!("(1, rows, n): {:?}, expected the same indices", got3.dims())
                }
                Ok(())
            })();
            report(name, r);
        }
    }
}

pub fn add_rms_norm(dev: &Device, report: Report) {
    for dtype in DTYPES {
        for shape in [
            vec![1, 1],
            vec![1, 2048],
            vec![13, 7],
            vec![2, 5, 96],
            vec![64, 768],
        ] {
            for w_f32 in [true, false] {
                let (name, r) = add_rms_norm_case(dev, dtype, &shape, w_f32);
                report(name, r);
            }
        }
    }
}

/// `n` ids into a table of `vocab` rows, with repeats (so the backward must add rows).
fn embedding_case(
    dev: &Device,
    dtype: DType,
    (vocab, hidden, n): (usize, usize, usize),
    deterministic: bool,
) -> (String, Result<()>) {
    let name = format!(
        "embedding f32 table -> {dtype:?} ({vocab}, {hidden}) x {n}{}",
        if deterministic { " deterministic" } else { "" }
    );
    let r = (|| {
        let table = randn((vocab, hidden), DType::F32)?;
        let ids: Vec<u32> = (0..n).map(|i| ((i * 7 + i / 3) % vocab) as u32).collect();
        let ids_cpu = Tensor::new(ids, &Device::Cpu)?;
        let ids_dev = ids_cpu.to_device(dev)?;
        let ours = move |t: &[Tensor]| match deterministic {
            true => train::embedding_deterministic(&t[0], &ids_dev, dtype),
            false => train::embedding(&t[0], &ids_dev, dtype),
        };
        let reference = move |t: &[Tensor]| t[0].index_select(&ids_cpu, 0)?.to_dtype(dtype);
        compare(
            &name,
            dev,
            &ours,
            &reference,
            &[table],
            &[true],
            &[n, hidden],
            dtype,
            0.0,
        )
    })();
    (name, r)
}

pub fn embedding(dev: &Device, report: Report) {
    for dtype in DTYPES {
        for shape in [(11, 7, 20), (300, 64, 1000), (1, 5, 3)] {
            for deterministic in [false, true] {
                let (name, r) = embedding_case(dev, dtype, shape, deterministic);
                report(name, r);
            }
        }
    }
}

/// Per-row cross-entropy in plain ops (ignored rows give 0).
fn xent_slow(logits: &Tensor, targets: &[u32]) -> Result<Tensor> {
    let n = targets.len();
    let safe: Vec<u32> = targets
        .iter()
        .map(|&t| if t == train::IGNORE { 0 } else { t })
        .collect();
    let mask: Vec<f32> = targets
        .iter()
        .map(|&t| if t == train::IGNORE { 0.0 } else { 1.0 })
        .collect();
    let safe = Tensor::new(safe, logits.device())?.unsqueeze(1)?;
    let mask = Tensor::new(mask, logits.device())?.to_dtype(logits.dtype())?;
    let lsm = candle_nn::ops::log_softmax(logits, D::Minus1)?;
    let picked = lsm.gather(&safe, 1)?.reshape(n)?;
    (picked.neg()? * mask)?.to_dtype(DType::F32)
}

/// Every fifth row's target is ignored.
fn cross_entropy_case(
    dev: &Device,
    dtype: DType,
    (n, vocab): (usize, usize),
) -> (String, Result<()>) {
    let name = format!("cross_entropy {dtype:?} ({n}, {vocab})");
    let r = (|| {
        let logits = (randn((n, vocab), dtype)? * 3.0)?;
        let targets: Vec<u32> = (0..n)
            .map(|i| {
                if i % 5 == 4 {
                    train::IGNORE
                } else {
                    ((i * 31 + 7) % vocab) as u32
                }
            })
            .collect();
        let t_dev = Tensor::new(targets.clone(), dev)?;
        let ours = move |t: &[Tensor]| train::cross_entropy_rows(&t[0], &t_dev);
        let reference = move |t: &[Tensor]| xent_slow(&t[0], &targets);
        // The loss is f32 in both; compare with f32 weights on the rows.
        compare(
            &name,
            dev,
            &ours,
            &reference,
            &[logits],
            &[true],
            &[n],
            DType::F32,
            0.0,
        )
    })();
    (name, r)
}

pub fn cross_entropy(dev: &Device, report: Report) {
    for dtype in DTYPES {
        for shape in [(1, 2), (13, 37), (64, 2048), (3, 5000)] {
            let (name, r) = cross_entropy_case(dev, dtype, shape);
            report(name, r);
        }
    }
    let name = "cross_entropy mean, ignored rows, bad target".to_string();
    let r = (|| {
        let logits = randn((4, 6), DType::F32)?.to_device(dev)?;
        let t = Tensor::new(&[1u32, train::IGNORE, 5, train::IGNORE], dev)?;
        let mean = train::cross_entropy(&logits, &t)?.to_scalar::<f32>()?;
        let rows = train::cross_entropy_rows(&logits, &t)?.to_vec1::<f32>()?;
        if (mean - (rows[0] + rows[2]) / 2.0).abs() > 1e-5 || rows[1] != 0.0 || rows[3] != 0.0 {
            candle::bail!("mean {mean} of rows {rows:?} should skip the ignored rows")
        }
        let bad = Tensor::new(&[1u32, 6, 0, 2], dev)?;
        let rows = train::cross_entropy_rows(&logits, &bad)?.to_vec1::<f32>()?;
        if !rows[1].is_nan() || rows[0].is_nan() {
            candle::bail!("a target past the vocabulary must give NaN in its row only: {rows:?}")
        }
        let mut nan_logits = logits.to_device(&Device::Cpu)?.to_vec2::<f32>()?;
        nan_logits[2][3] = f32::NAN;
        let nan_logits = Tensor::new(nan_logits, dev)?;
        let rows = train::cross_entropy_rows(&nan_logits, &t)?.to_vec1::<f32>()?;
        if !rows[2].is_nan() || rows[0].is_nan() {
            candle::bail!("NaN logits must give NaN in their row only: {rows:?}")
        }
        Ok(())
    })();
    report(name, r);
}

/// Extreme logits, checked against f64 from the logits as rounded to `dtype`: target logits
/// of -1e6 (a loss near 1e6, whose f32 rounding must not reach the gradient; -inf in F16)
/// and -inf (loss inf, gradient `dloss * (softmax - onehot)`, finite, as in PyTorch), a -inf
/// beside the target, and rows of NaN (a +inf logit, all logits -inf).
pub fn cross_entropy_extreme(dev: &Device, report: Report) {
    for dtype in DTYPES {
        let name = format!("cross_entropy {dtype:?} at extreme logits");
        report(name, cross_entropy_extreme_case(dev, dtype));
    }
}

fn cross_entropy_extreme_case(dev: &Device, dtype: DType) -> Result<()> {
    let (n, vocab) = (10, 37);
    let targets: Vec<u32> = (0..n).map(|r| ((r * 7 + 3) % vocab) as u32).collect();
    let mut x = (randn((n, vocab), DType::F32)? * 3.0)?.to_vec2::<f32>()?;
    // Row 0 all zeros but the target: lse = ln(36), a loss of 1e6 + 3.58 rounds 2% off.
    x[0].iter_mut().for_each(|v| *v = 0.0);
    for (r, row) in x.iter_mut().enumerate() {
        let t = targets[r] as usize;
        match r {
            0..=3 => row[t] = -1e6,
            4..=6 => row[t] = f32::NEG_INFINITY,
            _ => {}
        }
    }
    x[6][(targets[6] as usize + 1) % vocab] = f32::NEG_INFINITY;
    x[7][(targets[7] as usize + 1) % vocab] = f32::INFINITY;
    x[8].iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
    let logits = Tensor::new(x, &Device::Cpu)?.to_dtype(dtype)?;
    let w = randn(n, DType::F32)?;
    let var = Var::from_tensor(&logits.to_device(dev)?)?;
    let t_dev = Tensor::new(targets.clone(), dev)?;
    let loss = train::cross_entropy_rows(var.as_tensor(), &t_dev)?;
    let grads = loss.mul(&w.to_device(dev)?)?.sum_all()?.backward()?;
    let Some(g) = grads.get(var.as_tensor()) else {
        candle::bail!("no gradient for the logits")
    };
    let g = g
        .to_dtype(DType::F32)?
        .to_device(&Device::Cpu)?
        .to_vec2::<f32>()?;
    let loss = loss.to_device(&Device::Cpu)?.to_vec1::<f32>()?;
    let x = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let w = w.to_vec1::<f32>()?;
    // Relative error of the gradient: the output's rounding, and f32 math (CUDA's `__expf`).
    let rel = match dtype {
        DType::BF16 => 2f64.powi(-8),
        DType::F16 => 2f64.powi(-10),
        _ => 2e-5,
    };
    // ...and below the dtype's normal range its rounding is absolute: half the subnormal step
    // (f16's is 2^-24; a gradient of 4e-7 stored in f16 moved by 2.4e-8 and failed a
    // relative bound once).
    let subnormal = match dtype {
        DType::F16 => 2f64.powi(-25),
        DType::BF16 => 2f64.powi(-134),
        _ => 2f64.powi(-150),
    };
    for r in 0..n {
        let (t, row) = (targets[r] as usize, &x[r]);
        let max = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
        if row.iter().any(|v| v.is_nan() || *v == f32::INFINITY) || max == f64::NEG_INFINITY {
            if !loss[r].is_nan() || g[r].iter().any(|v| !v.is_nan()) {
                candle::bail!("row {r} must be NaN: loss {}, gradient {:?}", loss[r], g[r])
            }
            continue;
        }
        let lse = max
            + row
                .iter()
                .map(|&v| (v as f64 - max).exp())
                .sum::<f64>()
                .ln();
        let want = lse - row[t] as f64;
        let loss_ok = if want.is_finite() {
            (loss[r] as f64 - want).abs() <= 1e-5 * want.abs().max(1.0)
        } else {
            loss[r] == f32::INFINITY
        };
        if !loss_ok {
            candle::bail!(
                "row {r} (target logit {}): loss {}, expected {want}",
                row[t],
                loss[r]
            )
        }
        for (c, (&ours, &xc)) in g[r].iter().zip(row).enumerate() {
            let onehot = if c == t { 1.0 } else { 0.0 };
            let want = w[r] as f64 * ((xc as f64 - lse).exp() - onehot);
            let tol = rel * want.abs() + 1e-6 * (w[r] as f64).abs() + subnormal;
            let err = (ours as f64 - want).abs();
            if err.is_nan() || err > tol {
                candle::bail!(
                    "row {r} (target logit {}): gradient {ours} at column {c}, expected {want}",
                    row[t]
                )
            }
        }
    }
    Ok(())
}

/// AdamW as the textbook formula in plain ops.
fn adamw_slow(
    w: &Tensor,
    m: &Tensor,
    v: &Tensor,
    g: &Tensor,
    t: i32,
    lr: f64,
    wd: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (b1, b2, eps) = (0.9, 0.999, 1e-8);
    let m = ((m * b1)? + (g * (1.0 - b1))?)?;
    let v = ((v * b2)? + (g.sqr()? * (1.0 - b2))?)?;
    let m_hat = (&m / (1.0 - b1.powi(t)))?;
    let v_hat = (&v / (1.0 - b2.powi(t)))?;
    let w = ((w * (1.0 - lr * wd))? - ((m_hat / (v_hat.sqrt()? + eps)?)? * lr)?)?;
    Ok((w, m, v))
}

pub fn adamw(dev: &Device, report: Report) {
    for gdtype in DTYPES {
        let name = format!("AdamW 3 steps, {gdtype:?} gradients, scale 0.5, state round trip");
        let r = (|| {
            let shapes = [vec![7], vec![13, 5], vec![1]];
            let inits = shapes
                .iter()
                .map(|s| randn(s.as_slice(), DType::F32))
                .collect::<Result<Vec<_>>>()?;
            let vars = inits
                .iter()
                .enumerate()
                .map(|(i, t)| Ok((format!("w{i}"), Var::from_tensor(&t.to_device(dev)?)?)))
                .collect::<Result<Vec<_>>>()?;
            let mut opt = train::AdamW::new(vars.clone(), 1e-2, 0.1)?;
            let mut slow: Vec<(Tensor, Tensor, Tensor)> = inits
                .iter()
                .map(|w| Ok((w.clone(), w.zeros_like()?, w.zeros_like()?)))
                .collect::<Result<_>>()?;
            for step in 1..=3 {
                // Gradients as a backward pass would give them, of each variable's dtype.
                let gs = shapes
                    .iter()
                    .map(|s| randn(s.as_slice(), gdtype))
                    .collect::<Result<Vec<_>>>()?;
                let loss = vars
                    .iter()
                    .zip(&gs)
                    .map(|((_, v), g)| {
                        v.as_tensor()
                            .mul(&g.to_dtype(DType::F32)?.to_device(dev)?)?
                            .sum_all()
                    })
                    .collect::<Result<Vec<_>>>()?;
                let loss = Tensor::stack(&loss, 0)?.sum_all()?;
                let grads = loss.backward()?;
                if step == 2 {
                    // Save and restore into a fresh optimiser in the middle.
                    let state = opt.state()?;
                    let mut fresh = train::AdamW::new(vars.clone(), 1e-2, 0.1)?;
                    fresh.load_state(&state)?;
                    opt = fresh;
                }
                opt.update(&grads, 0.5)?;
                for (s, g) in slow.iter_mut().zip(&gs) {
                    let g = (g.to_dtype(DType::F32)? * 0.5)?;
                    *s = adamw_slow(&s.0, &s.1, &s.2, &g, step, 1e-2, 0.1)?;
                }
            }
            for ((name, v), s) in vars.iter().zip(&slow) {
                let err = max_abs_diff(&v.as_tensor().to_device(&Device::Cpu)?, &s.0)?;
                if !within_bound(err, 1e-5) {
                    candle::bail!("{name}: {err:e} from the formula")
                }
                let st = opt.state()?;
                let m = st[&format!("m.{name}")].to_device(&Device::Cpu)?;
                if !within_bound(max_abs_diff(&m, &s.1)?, 1e-6) {
                    candle::bail!("{name}: first moment differs from the formula")
                }
            }
            Ok(())
        })();
        report(name, r);
    }
    let name = "sum_squares over tensors of mixed dtypes".to_string();
    let r = (|| {
        let ts = [
            randn(1000, DType::F32)?,
            randn((7, 9), DType::BF16)?,
            randn(1, DType::F16)?,
        ];
        let exact: f32 = ts
            .iter()
            .map(|t| t.to_dtype(DType::F32)?.sqr()?.sum_all()?.to_scalar::<f32>())
            .sum::<Result<f32>>()?;
        let on_dev = ts
            .iter()
            .map(|t| t.to_device(dev))
            .collect::<Result<Vec<_>>>()?;
        let ours = train::sum_squares(&on_dev)?.to_scalar::<f32>()?;
        if !within_bound((ours - exact).abs(), 1e-4 * exact) {
            candle::bail!("sum_squares {ours} against {exact}")
        }
        Ok(())
    })();
    report(name, r);
}

/// Sizes past one block of every kernel (the GPU suite; slow on the CPU references).
pub fn large(dev: &Device, report: Report) {
    for dtype in [DType::BF16, DType::F16] {
        let cases = [
            rms_norm_case(dev, dtype, &[4097, 768], true),
            add_rms_norm_case(dev, dtype, &[4097, 768], true),
            swiglu_case(dev, dtype, &[4097, 2048]),
            swiglu_halves_case(dev, dtype, 4097, 2048),
            rotary_case(dev, dtype, (4097, 12, 64)),
            cross_entropy_case(dev, dtype, (2049, 32003)),
            embedding_case(dev, dtype, (2048, 768, 16384), false),
            embedding_case(dev, dtype, (2048, 768, 16384), true),
        ];
        for (name, r) in cases {
            report(format!("large {name}"), r);
        }
    }
}

/// Ids past the table: NaN rows forward, and no gradient from them (both backwards): the
/// table's gradient counts each valid id's rows exactly.
pub fn embedding_past_the_table(dev: &Device, report: Report) {
    for deterministic in [false, true] {
        let name = format!("embedding ids past the table, deterministic={deterministic}");
        let r = (|| {
            let table = Var::from_tensor(&Tensor::ones((5, 8), DType::F32, dev)?)?;
            let ids = Tensor::new(&[0u32, 7, 2, 0, 9, 2, 2], dev)?;
            let y = match deterministic {
                true => train::embedding_deterministic(table.as_tensor(), &ids, DType::F32)?,
                false => train::embedding(table.as_tensor(), &ids, DType::F32)?,
            };
            let rows = y.to_device(&Device::Cpu)?.to_vec2::<f32>()?;
            for (i, row) in rows.iter().enumerate() {
                let nan = i == 1 || i == 4;
                if row.iter().any(|v| v.is_nan() != nan) {
                    candle::bail!("row {i}: {row:?}")
                }
            }
            let valid = Tensor::new(&[0u32, 2, 3, 5, 6], dev)?;
            let grads = y.index_select(&valid, 0)?.sum_all()?.backward()?;
            let g = grads.get(table.as_tensor()).expect("a gradient");
            let g = g.to_device(&Device::Cpu)?.to_vec2::<f32>()?;
            let want = [2f32, 0.0, 3.0, 0.0, 0.0];
            for (id, (row, w)) in g.iter().zip(want).enumerate() {
                if row.iter().any(|v| *v != w) {
                    candle::bail!("gradient of id {id}: {row:?}, expected {w}")
                }
            }
            Ok(())
        })();
        report(name, r);
    }
}

/// The ops whose CUDA sums run in a fixed order give the same bits on every run: the
/// deterministic embedding's gradient with ids repeated thousands of times, RMSNorm's dw over
/// many blocks of rows, sum_squares over many blocks.
pub fn repeatable(dev: &Device, report: Report) {
    let name = "repeatable embedding_deterministic, rms_norm dw, sum_squares".to_string();
    let r = (|| {
        let table = randn((50, 300), DType::F32)?.to_device(dev)?;
        let ids: Vec<u32> = (0..20000).map(|i| (i % 5 + i / 4000) as u32).collect();
        let ids = Tensor::new(ids, dev)?;
        let x = randn((5000, 768), DType::BF16)?.to_device(dev)?;
        let w = randn(768, DType::F32)?.to_device(dev)?;
        let big = randn(3_000_000, DType::F32)?.to_device(dev)?;
        let weights = [
            randn((20000, 300), DType::BF16)?.to_device(dev)?,
            randn((5000, 768), DType::BF16)?.to_device(dev)?,
        ];
        let once = || -> Result<Vec<u32>> {
            let (tv, wv) = (Var::from_tensor(&table)?, Var::from_tensor(&w)?);
            let e = train::embedding_deterministic(tv.as_tensor(), &ids, DType::BF16)?;
            let y = train::rms_norm(&x, wv.as_tensor(), 1e-5)?;
            let loss = (e.mul(&weights[0])?.to_dtype(DType::F32)?.sum_all()?
                + y.mul(&weights[1])?.to_dtype(DType::F32)?.sum_all()?)?;
            let grads = loss.backward()?;
            let mut bits = vec![];
            for v in [&tv, &wv] {
                let g = grads.get(v.as_tensor()).expect("a gradient");
                bits.extend(
                    g.flatten_all()?
                        .to_vec1::<f32>()?
                        .iter()
                        .map(|v| v.to_bits()),
                );
            }
            let s = train::sum_squares([&big, &x])?.to_scalar::<f32>()?;
            bits.push(s.to_bits());
            Ok(bits)
        };
        let first = once()?;
        for run in 1..3 {
            if once()? != first {
                candle::bail!("run {run} differs from run 0")
            }
        }
        Ok(())
    })();
    report(name, r);
}

/// `err <= bound`, false for NaN.
fn within_bound(err: f32, bound: f32) -> bool {
    err <= bound
}

/// Every check of this file.
pub fn all(dev: &Device, report: Report) {
    rms_norm(dev, report);
    add_rms_norm(dev, report);
    linear(dev, report);
    argmax(dev, report);
    rotary(dev, report);
    swiglu(dev, report);
    embedding(dev, report);
    cross_entropy(dev, report);
    cross_entropy_extreme(dev, report);
    adamw(dev, report);
    adamw_state::snapshot(dev, report);
    adamw_state::all_or_nothing(dev, report);
    adamw_state::malformed(dev, report);
    repeatable(dev, report);
    embedding_past_the_table(dev, report);
}
