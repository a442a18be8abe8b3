//! CPU attention sinks (gpt-oss, `FlashAttn::sinks`): outputs, LSE and the gradients of q, k,
//! v and the sinks against `attention_slow_with` (the sink as one more softmax column, in
//! Candle ops, differentiated by Candle's autograd), against host loops from the definition
//! and against finite differences; fixed-length, variable-length and padded batches, rows that
//! see no key, dropout, the direct backward, and argument errors.

mod common;

use candle::{DType, Device, IndexOp, Result, Tensor, Var, D};
use candle_flash::{attention_slow_with, dropout_mask, FlashAttn, Padding, VarLen};
use common::varlen::{packed_qkv, per_sequence};
use common::{assert_close, assert_fails, assert_within_budget, max_abs_diff, randn, Case};

/// f32 on both sides, summed in different orders.
const TOL: f32 = 1e-5;
const NAMES: [&str; 4] = ["dq", "dk", "dv", "dsinks"];

/// One logit per head, of both signs and around the scores' range.
fn sinks_of(h: usize) -> Result<Tensor> {
    let s: Vec<f32> = (0..h).map(|i| 2.0 * (0.9 * i as f32 + 0.3).sin()).collect();
    Tensor::from_vec(s, h, &Device::Cpu)
}

fn with_sinks(opts: &FlashAttn, sinks: &Tensor) -> FlashAttn {
    opts.clone().sinks(sinks)
}

fn without_sinks(opts: &FlashAttn) -> FlashAttn {
    let mut o = opts.clone();
    o.sinks = None;
    o
}

/// Gradients of `sum(attn(q, k, v, sinks) · w)` for q, k, v and the sinks, by Candle's
/// autograd.
fn grads4<F>(
    attn: F,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    s: &Tensor,
    w: &Tensor,
) -> Result<[Tensor; 4]>
where
    F: Fn(&Tensor, &Tensor, &Tensor, &Tensor) -> Result<Tensor>,
{
    let vars = [q, k, v, s].map(|t| Var::from_tensor(t).unwrap());
    let out = attn(&vars[0], &vars[1], &vars[2], &vars[3])?;
    let grads = (out * w)?.sum_all()?.backward()?;
    Ok(vars.map(|x| grads.get(&x).cloned().expect("no gradient")))
}

fn assert_grads(what: &str, ours: &[Tensor; 4], expected: &[Tensor; 4], tol: f32) -> Result<()> {
    for ((name, a), b) in NAMES.iter().zip(ours).zip(expected) {
        assert_close(&format!("{name} {what}"), a, b, tol)?;
    }
    Ok(())
}

/// `log(exp(a) + exp(b))` in f64.
fn log_add_exp(a: f64, b: f64) -> f64 {
    let m = a.max(b);
    if m == f64::NEG_INFINITY {
        return m;
    }
    m + ((a - m).exp() + (b - m).exp()).ln()
}

/// The forward with sinks from the definition, in f64 host loops, causal mask only: the
/// softmax over the visible keys and the sink column, `(out (b, sq, h, d), lse (b, h, sq))`.
fn host_sink_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    sinks: &Tensor,
    causal: bool,
) -> Result<(Tensor, Tensor)> {
    let (b, sq, h, d) = q.dims4()?;
    let (_, sk, hk, _) = k.dims4()?;
    let host =
        |t: &Tensor| -> Result<Vec<f64>> { t.to_dtype(DType::F64)?.flatten_all()?.to_vec1() };
    let (qh, kh, vh, sh) = (host(q)?, host(k)?, host(v)?, host(sinks)?);
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = vec![0f64; b * sq * h * d];
    let mut lse = vec![0f64; b * h * sq];
    for bi in 0..b {
        for hi in 0..h {
            let kv = hi / (h / hk);
            for i in 0..sq {
                let keys: Vec<usize> = (0..sk).filter(|&j| !causal || j + sq <= i + sk).collect();
                let qi = &qh[((bi * sq + i) * h + hi) * d..][..d];
                let scores: Vec<f64> = keys
                    .iter()
                    .map(|&j| {
                        let kj = &kh[((bi * sk + j) * hk + kv) * d..][..d];
                        scale * qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>()
                    })
                    .collect();
                let l = scores.iter().fold(sh[hi], |l, &s| log_add_exp(l, s));
                lse[(bi * h + hi) * sq + i] = l;
                let o = &mut out[((bi * sq + i) * h + hi) * d..][..d];
                for (&j, &s) in keys.iter().zip(&scores) {
                    let p = (s - l).exp();
                    let vj = &vh[((bi * sk + j) * hk + kv) * d..][..d];
                    o.iter_mut().zip(vj).for_each(|(o, v)| *o += p * v);
                }
            }
        }
    }
    let dev = Device::Cpu;
    Ok((
        Tensor::from_vec(out, (b, sq, h, d), &dev)?.to_dtype(DType::F32)?,
        Tensor::from_vec(lse, (b, h, sq), &dev)?.to_dtype(DType::F32)?,
    ))
}

/// f32: output and LSE against the oracle and `log(exp(lse without sinks) + exp(sink))`,
/// gradients of q, k, v and the sinks against the oracle's autograd.
fn check_f32(what: &str, case: &Case, opts: &FlashAttn) -> Result<()> {
    let what = format!("{what} {case:?}");
    let (q, k, v) = case.qkv(DType::F32)?;
    let sinks = sinks_of(case.h)?;
    let opts = with_sinks(opts, &sinks);
    let (out, lse) = opts.forward_with_lse(&q, &k, &v)?;
    let expected = attention_slow_with(&q, &k, &v, &opts)?;
    assert_close(&format!("out {what}"), &out, &expected, TOL)?;
    let (_, lse_plain) = without_sinks(&opts).forward_with_lse(&q, &k, &v)?;
    let plain = lse_plain.flatten_all()?.to_vec1::<f32>()?;
    let ours = lse.flatten_all()?.to_vec1::<f32>()?;
    let s = sinks.to_vec1::<f32>()?;
    let sq = case.sq;
    for (i, (&l, &p)) in ours.iter().zip(&plain).enumerate() {
        let e = log_add_exp(p as f64, s[(i / sq) % case.h] as f64) as f32;
        assert!(
            (l - e).abs() <= 1e-5 * e.abs().max(1.0),
            "lse {what}: [{i}] {l} vs {e}"
        );
    }
    let w = case.out_weight(DType::F32)?;
    let flash =
        |q: &Tensor, k: &Tensor, v: &Tensor, s: &Tensor| with_sinks(&opts, s).forward(q, k, v);
    let slow = |q: &Tensor, k: &Tensor, v: &Tensor, s: &Tensor| {
        attention_slow_with(q, k, v, &with_sinks(&opts, s))
    };
    let ours = grads4(flash, &q, &k, &v, &sinks, &w)?;
    let reference = grads4(slow, &q, &k, &v, &sinks, &w)?;
    assert_grads(&what, &ours, &reference, TOL)
}

/// Sequences of 1 and 113 rows, more keys than queries and fewer (causal rows without keys),
/// GQA and MQA, head dims 8, 40, 64 and 96; causal and not.
#[test]
fn fixed_length_matches_the_oracle() -> Result<()> {
    let cases = [
        Case::new(1, 1, 1, 1, 1, 8),
        Case::new(2, 1, 1, 4, 2, 40),
        Case::new(1, 113, 113, 4, 4, 96),
        Case::new(2, 37, 113, 4, 2, 40),
        Case::new(2, 113, 37, 4, 1, 96),
        Case::new(3, 17, 64, 6, 3, 64),
    ];
    for case in common::with_causal(&cases) {
        check_f32("sinks", &case, &case.flash())?;
    }
    Ok(())
}

/// The oracle's sink column against the definition in f64 host loops (output and LSE), so
/// that the two agree because both are right.
#[test]
fn oracle_and_op_match_the_definition() -> Result<()> {
    for case in common::with_causal(&[Case::new(2, 19, 23, 4, 2, 16), Case::new(1, 30, 9, 2, 1, 8)])
    {
        let (q, k, v) = case.qkv(DType::F32)?;
        let sinks = sinks_of(case.h)?;
        let (out_host, lse_host) = host_sink_attention(&q, &k, &v, &sinks, case.causal)?;
        let opts = case.flash().sinks(&sinks);
        let (out, lse) = opts.forward_with_lse(&q, &k, &v)?;
        assert_close(&format!("out {case:?}"), &out, &out_host, TOL)?;
        assert_close(&format!("lse {case:?}"), &lse, &lse_host, TOL)?;
        let slow = attention_slow_with(&q, &k, &v, &opts)?;
        assert_close(&format!("oracle {case:?}"), &slow, &out_host, TOL)?;
    }
    Ok(())
}

/// The sinks' gradient against central differences of `sum(out · w)` through the oracle in
/// f64 (independent of both autograds). The sinks stay f32, as the op takes them: the step is
/// the exact difference of the two f32 values.
#[test]
fn sinks_gradient_matches_finite_differences() -> Result<()> {
    for case in [
        Case::new(2, 13, 21, 4, 2, 16).causal(true),
        Case::new(1, 40, 8, 2, 2, 8),
    ] {
        let (q, k, v) = case.qkv(DType::F32)?;
        let sinks = sinks_of(case.h)?;
        let w = case.out_weight(DType::F32)?;
        let opts = case.flash();
        let flash =
            |q: &Tensor, k: &Tensor, v: &Tensor, s: &Tensor| with_sinks(&opts, s).forward(q, k, v);
        let ours = grads4(flash, &q, &k, &v, &sinks, &w)?[3].to_vec1::<f32>()?;
        let f64_of = |t: &Tensor| t.to_dtype(DType::F64);
        let (q, k, v, w) = (f64_of(&q)?, f64_of(&k)?, f64_of(&v)?, f64_of(&w)?);
        let s = sinks.to_vec1::<f32>()?;
        let loss = |s: &[f32]| -> Result<f64> {
            let s = Tensor::from_slice(s, s.len(), &Device::Cpu)?;
            let out = attention_slow_with(&q, &k, &v, &with_sinks(&opts, &s))?;
            (out * &w)?.sum_all()?.to_scalar::<f64>()
        };
        let eps = 1e-3;
        for h in 0..case.h {
            let (mut up, mut down) = (s.clone(), s.clone());
            up[h] += eps;
            down[h] -= eps;
            let step = up[h] as f64 - down[h] as f64;
            let fd = (loss(&up)? - loss(&down)?) / step;
            let err = (ours[h] as f64 - fd).abs();
            assert!(
                err <= 1e-4 * fd.abs().max(1.0),
                "dsinks[{h}] {case:?}: {} vs {fd}",
                ours[h]
            );
        }
    }
    Ok(())
}

/// Rows that see no key (a window away from every key, and a causal mask with more queries
/// than keys): zeros, LSE exactly the sink, gradients as the oracle's.
#[test]
fn rows_without_keys() -> Result<()> {
    let case = Case::new(2, 40, 8, 4, 2, 32);
    let window = FlashAttn::new().window(Some(1), Some(1));
    check_f32("window", &case, &window)?;
    let (q, k, v) = case.qkv(DType::F32)?;
    let sinks = sinks_of(case.h)?;
    let (out, lse) = window.clone().sinks(&sinks).forward_with_lse(&q, &k, &v)?;
    // Row i sees keys i - 33 ..= i - 31: rows 0..31 none.
    assert_eq!(
        out.narrow(1, 0, 31)?.abs()?.sum_all()?.to_scalar::<f32>()?,
        0.0
    );
    let s = sinks.to_vec1::<f32>()?;
    for b in 0..case.b {
        for (h, &sink) in s.iter().enumerate() {
            for i in 0..31 {
                let l = lse.i((b, h, i))?.to_scalar::<f32>()?;
                assert_eq!(l, sink, "lse ({b}, {h}, {i})");
            }
        }
    }
    // No key at all.
    let case = Case::new(1, 3, 0, 2, 1, 8);
    let (q, k, v) = case.qkv(DType::F32)?;
    let sinks = sinks_of(2)?;
    let opts = FlashAttn::new().sinks(&sinks);
    let (out, lse) = opts.forward_with_lse(&q, &k, &v)?;
    assert_eq!(common::max_abs(&out)?, 0.0);
    assert_eq!(
        lse.i((0, 1, 2))?.to_scalar::<f32>()?,
        sinks.i(1)?.to_scalar::<f32>()?
    );
    let w = case.out_weight(DType::F32)?;
    let flash =
        |q: &Tensor, k: &Tensor, v: &Tensor, s: &Tensor| FlashAttn::new().sinks(s).forward(q, k, v);
    let g = grads4(flash, &q, &k, &v, &sinks, &w)?;
    assert_eq!(common::max_abs(&g[3])?, 0.0);
    Ok(())
}

/// A sink of -inf is no sink (the same bits); a NaN sink makes its head NaN and only it.
#[test]
fn infinite_and_nan_sinks() -> Result<()> {
    let case = Case::new(2, 20, 30, 3, 1, 16).causal(true);
    let (q, k, v) = case.qkv(DType::F32)?;
    let none = Tensor::new(&[f32::NEG_INFINITY; 3], &Device::Cpu)?;
    let (out, lse) = case.flash().sinks(&none).forward_with_lse(&q, &k, &v)?;
    let (out0, lse0) = case.flash().forward_with_lse(&q, &k, &v)?;
    assert_eq!(max_abs_diff(&out, &out0)?, 0.0);
    assert_eq!(max_abs_diff(&lse, &lse0)?, 0.0);
    let nan = Tensor::new(&[0.5f32, f32::NAN, -1.0], &Device::Cpu)?;
    let out = case.flash().sinks(&nan).forward(&q, &k, &v)?;
    let is_nan = |t: Tensor| -> Result<bool> {
        Ok(t.ne(&t)?
            .to_dtype(DType::F32)?
            .sum_all()?
            .to_scalar::<f32>()?
            > 0.0)
    };
    assert!(!is_nan(out.i((.., .., 0))?)? && !is_nan(out.i((.., .., 2))?)?);
    let head = out.i((.., .., 1))?.flatten_all()?.to_vec1::<f32>()?;
    assert!(
        head.iter().all(|x| x.is_nan()),
        "head 1 is not NaN throughout"
    );
    Ok(())
}

/// Variable-length batches: each sequence against the oracle alone (the sinks shared), with
/// a sequence without queries and one without keys; the sinks' gradient sums over them.
#[test]
fn varlen_matches_per_sequence_oracle() -> Result<()> {
    let varlen = VarLen::from_seqlens(&[37, 1, 0, 64, 3], &[90, 0, 5, 64, 1])?;
    let (h, hk, d) = (4, 2, 40);
    for causal in [false, true] {
        let what = format!("varlen causal={causal}");
        let (q, k, v) = packed_qkv(&varlen, h, hk, d, DType::F32)?;
        let sinks = sinks_of(h)?;
        let opts = FlashAttn::new().causal(causal);
        let flash = |q: &Tensor, k: &Tensor, v: &Tensor, s: &Tensor| {
            with_sinks(&opts, s).forward_varlen(q, k, v, &varlen)
        };
        let slow = |q: &Tensor, k: &Tensor, v: &Tensor, s: &Tensor| {
            per_sequence(&varlen, q, k, v, |_, q, k, v| {
                attention_slow_with(q, k, v, &with_sinks(&opts, s))
            })
        };
        assert_close(
            &what,
            &flash(&q, &k, &v, &sinks)?,
            &slow(&q, &k, &v, &sinks)?,
            TOL,
        )?;
        let w = randn((varlen.total_q(), h, d), DType::F32)?;
        let ours = grads4(flash, &q, &k, &v, &sinks, &w)?;
        let reference = grads4(slow, &q, &k, &v, &sinks, &w)?;
        assert_grads(&what, &ours, &reference, TOL)?;
        // The packed LSE (h, total_q): sequence 1's query sees no key, so its LSE is the sink.
        let (_, lse) = with_sinks(&opts, &sinks).forward_varlen_with_lse(&q, &k, &v, &varlen)?;
        assert_eq!(lse.dims(), &[h, varlen.total_q()]);
        for hi in 0..h {
            assert_eq!(
                lse.i((hi, 37))?.to_scalar::<f32>()?,
                sinks.i(hi)?.to_scalar::<f32>()?
            );
        }
        // The direct gradient of the sinks from the packed layout.
        let out = flash(&q, &k, &v, &sinks)?;
        let direct = with_sinks(&opts, &sinks).backward_sinks(&out, &lse, &w)?;
        assert_close(&format!("backward_sinks {what}"), &direct, &ours[3], TOL)?;
    }
    Ok(())
}

/// Padded batches: real rows against the oracle per sequence, padded rows zero, the sinks'
/// gradient against the oracle's.
#[test]
fn padded_matches_per_sequence_oracle() -> Result<()> {
    let (b, s, h, hk, d) = (3, 12, 4, 4, 16);
    let lengths = [12, 5, 1];
    let pad = Padding::from_lengths(&lengths, s)?;
    let q = randn((b, s, h, d), DType::F32)?;
    let k = randn((b, s, hk, d), DType::F32)?;
    let v = randn((b, s, hk, d), DType::F32)?;
    let sinks = sinks_of(h)?;
    let opts = FlashAttn::new().causal(true);
    let flash = |q: &Tensor, k: &Tensor, v: &Tensor, sk: &Tensor| {
        with_sinks(&opts, sk).forward_padded(q, k, v, &pad, &pad)
    };
    // Each sequence's real tokens alone, scattered back into zeros.
    let slow = |q: &Tensor, k: &Tensor, v: &Tensor, sk: &Tensor| -> Result<Tensor> {
        let mut rows = Vec::new();
        for (bi, &len) in lengths.iter().enumerate() {
            let real = |t: &Tensor| t.narrow(0, bi, 1)?.narrow(1, 0, len);
            let o = attention_slow_with(&real(q)?, &real(k)?, &real(v)?, &with_sinks(&opts, sk))?;
            let zeros = Tensor::zeros((1, s - len, h, d), DType::F32, &Device::Cpu)?;
            rows.push(Tensor::cat(&[&o, &zeros], 1)?);
        }
        Tensor::cat(&rows, 0)
    };
    let out = flash(&q, &k, &v, &sinks)?;
    assert_close("padded", &out, &slow(&q, &k, &v, &sinks)?, TOL)?;
    assert_eq!(
        out.narrow(0, 2, 1)?
            .narrow(1, 1, s - 1)?
            .abs()?
            .sum_all()?
            .to_scalar::<f32>()?,
        0.0
    );
    let w = randn((b, s, h, d), DType::F32)?;
    let ours = grads4(flash, &q, &k, &v, &sinks, &w)?;
    let reference = grads4(slow, &q, &k, &v, &sinks, &w)?;
    assert_grads("padded", &ours, &reference, TOL)
}

/// Dropout drops the keys' probabilities as without sinks: against the oracle written here in
/// Candle ops with the op's own mask (softmax with the sink column, the column dropped, the
/// mask applied).
#[test]
fn dropout_with_sinks() -> Result<()> {
    let (b, sq, sk, h, d) = (2, 33, 47, 2, 16);
    let (p, seed, offset) = (0.17f32, 7u64, 11u64);
    let q = randn((b, sq, h, d), DType::F32)?;
    let k = randn((b, sk, h, d), DType::F32)?;
    let v = randn((b, sk, h, d), DType::F32)?;
    let sinks = sinks_of(h)?;
    let opts = FlashAttn::new().dropout(p).seed(seed).rng_offset(offset);
    let keep = dropout_mask(p, seed, offset, b, h, sq, sk)?.to_dtype(DType::F32)?;
    let flash =
        |q: &Tensor, k: &Tensor, v: &Tensor, s: &Tensor| with_sinks(&opts, s).forward(q, k, v);
    let slow = |q: &Tensor, k: &Tensor, v: &Tensor, s: &Tensor| -> Result<Tensor> {
        let heads = |t: &Tensor| t.transpose(1, 2)?.contiguous(); // (b, h, s, d)
        let (q, k, v) = (heads(q)?, heads(k)?, heads(v)?);
        let scores = (q.matmul(&k.t()?)? / (d as f64).sqrt())?; // (b, h, sq, sk)
        let column = s.reshape((1, h, 1, 1))?.broadcast_as((b, h, sq, 1))?;
        let scores = Tensor::cat(&[&scores, &column], D::Minus1)?.contiguous()?;
        let probs = candle_nn::ops::softmax(&scores, D::Minus1)?;
        let probs = ((probs.narrow(D::Minus1, 0, sk)? * &keep)? / (1.0 - p as f64))?;
        probs.matmul(&v)?.transpose(1, 2)
    };
    assert_close(
        "dropout",
        &flash(&q, &k, &v, &sinks)?,
        &slow(&q, &k, &v, &sinks)?,
        TOL,
    )?;
    let w = randn((b, sq, h, d), DType::F32)?;
    let ours = grads4(flash, &q, &k, &v, &sinks, &w)?;
    let reference = grads4(slow, &q, &k, &v, &sinks, &w)?;
    assert_grads("dropout", &ours, &reference, TOL)
}

/// `backward` on the LSE with sinks and `backward_sinks` give the bits that `backward()`
/// through the forward gives.
#[test]
fn direct_backward_with_sinks() -> Result<()> {
    let case = Case::new(2, 29, 41, 4, 2, 24).causal(true);
    let (q, k, v) = case.qkv(DType::F32)?;
    let sinks = sinks_of(case.h)?;
    let w = case.out_weight(DType::F32)?;
    let opts = case.flash().sinks(&sinks);
    let (out, lse) = opts.forward_with_lse(&q, &k, &v)?;
    let (dq, dk, dv) = opts.backward(&q, &k, &v, &out, &lse, &w)?;
    let d_sinks = opts.backward_sinks(&out, &lse, &w)?;
    let flash =
        |q: &Tensor, k: &Tensor, v: &Tensor, s: &Tensor| case.flash().sinks(s).forward(q, k, v);
    let autograd = grads4(flash, &q, &k, &v, &sinks, &w)?;
    for ((name, a), b) in NAMES.iter().zip([&dq, &dk, &dv, &d_sinks]).zip(&autograd) {
        assert_eq!(max_abs_diff(a, b)?, 0.0, "{name}");
    }
    // Sinks that track no gradient (inference) change nothing for q, k and v.
    let qv = Var::from_tensor(&q)?;
    let grads = (opts.forward(&qv, &k, &v)? * &w)?.sum_all()?.backward()?;
    assert_eq!(max_abs_diff(grads.get(&qv).unwrap(), &autograd[0])?, 0.0);
    Ok(())
}

/// bf16 inputs and sinks: the output within 2x and the gradients within 3x of the oracle's own
/// error in bf16, against the oracle in f32; the sinks' gradient comes back in bf16.
#[test]
fn bf16_within_budget() -> Result<()> {
    let case = Case::new(2, 65, 80, 4, 2, 64).causal(true);
    let dtype = DType::BF16;
    let (q, k, v) = case.qkv(dtype)?;
    let sinks = sinks_of(case.h)?.to_dtype(dtype)?;
    let w = case.out_weight(dtype)?;
    let f32_of = |t: &Tensor| t.to_dtype(DType::F32);
    let (q32, k32, v32, s32, w32) = (
        f32_of(&q)?,
        f32_of(&k)?,
        f32_of(&v)?,
        f32_of(&sinks)?,
        f32_of(&w)?,
    );
    let opts = case.flash();
    let flash =
        |q: &Tensor, k: &Tensor, v: &Tensor, s: &Tensor| with_sinks(&opts, s).forward(q, k, v);
    let slow = |q: &Tensor, k: &Tensor, v: &Tensor, s: &Tensor| {
        attention_slow_with(q, k, v, &with_sinks(&opts, s))
    };
    let ours = flash(&q, &k, &v, &sinks)?;
    assert_eq!(ours.dtype(), dtype);
    let baseline = slow(&q, &k, &v, &sinks)?;
    let exact = slow(&q32, &k32, &v32, &s32)?;
    assert_within_budget("out bf16", &ours, &baseline, &exact, 2.0)?;
    let ours = grads4(flash, &q, &k, &v, &sinks, &w)?;
    let baseline = grads4(slow, &q, &k, &v, &sinks, &w)?;
    let exact = grads4(slow, &q32, &k32, &v32, &s32, &w32)?;
    for (i, name) in NAMES.iter().enumerate() {
        assert_eq!(ours[i].dtype(), dtype, "{name}");
        assert_within_budget(
            &format!("{name} bf16"),
            &ours[i],
            &baseline[i],
            &exact[i],
            3.0,
        )?;
    }
    Ok(())
}

#[test]
fn argument_errors() -> Result<()> {
    let case = Case::new(1, 4, 4, 4, 2, 8);
    let (q, k, v) = case.qkv(DType::F32)?;
    let dev = Device::Cpu;
    let with = |s: Tensor| FlashAttn::new().sinks(&s);
    for (sinks, expected) in [
        (
            Tensor::zeros(3, DType::F32, &dev)?,
            &["sinks", "(num_heads) = [4]", "[3]"][..],
        ),
        (
            Tensor::zeros((1, 4), DType::F32, &dev)?,
            &["sinks", "[1, 4]"],
        ),
        (
            Tensor::zeros((), DType::F32, &dev)?,
            &["sinks", "(num_heads)"],
        ),
        (
            Tensor::zeros(4, DType::U32, &dev)?,
            &["sinks", "F32, F16 or BF16", "U32"],
        ),
        (Tensor::zeros(4, DType::F64, &dev)?, &["sinks", "F64"]),
    ] {
        assert_fails(with(sinks.clone()).forward(&q, &k, &v), expected);
        assert_fails(
            attention_slow_with(&q, &k, &v, &with(sinks.clone())),
            expected,
        );
        let varlen = VarLen::from_seqlens(&[4], &[4])?;
        let packed = |t: &Tensor| t.squeeze(0);
        assert_fails(
            with(sinks.clone()).forward_varlen(&packed(&q)?, &packed(&k)?, &packed(&v)?, &varlen),
            expected,
        );
        let (out, lse) = FlashAttn::new().forward_with_lse(&q, &k, &v)?;
        assert_fails(
            with(sinks.clone()).backward(&q, &k, &v, &out, &lse, &out),
            expected,
        );
        assert_fails(with(sinks).backward_sinks(&out, &lse, &out), expected);
    }
    let sinks = sinks_of(4)?;
    let opts = FlashAttn::new().sinks(&sinks);
    let (out, lse) = opts.forward_with_lse(&q, &k, &v)?;
    assert_fails(
        FlashAttn::new().backward_sinks(&out, &lse, &out),
        &["sinks", "FlashAttn::sinks"],
    );
    assert_fails(
        opts.backward_sinks(&out, &lse.i(0)?, &out),
        &["lse", "(batch, num_heads, seqlen_q)"],
    );
    assert_fails(
        opts.backward_sinks(&out, &lse, &out.to_dtype(DType::BF16)?),
        &["grad_out", "BF16"],
    );
    assert_fails(
        opts.backward_sinks(&out.i(0)?.i(0)?, &lse, &out),
        &["out", "got shape [4, 8]"],
    );
    Ok(())
}

/// k, v and the sinks as views into larger tensors (strides, offsets).
#[test]
fn strided_inputs() -> Result<()> {
    let case = Case::new(2, 9, 9, 4, 2, 16);
    let (q, k, v) = case.qkv(DType::F32)?;
    let kv = Tensor::cat(&[&k, &v], 3)?;
    let (k2, v2) = (kv.narrow(3, 0, 16)?, kv.narrow(3, 16, 16)?);
    let sinks = Tensor::new(&[9.0f32, 0.0, 1.0, -1.0, 2.0, 9.0], &Device::Cpu)?.narrow(0, 1, 4)?;
    let opts = FlashAttn::new().sinks(&sinks);
    let ours = opts.forward(&q, &k2, &v2)?;
    let expected = attention_slow_with(&q, &k, &v, &opts)?;
    assert_close("strided", &ours, &expected, TOL)
}
