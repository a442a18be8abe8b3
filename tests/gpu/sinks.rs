//! GPU tests for attention sinks (`FlashAttn::sinks`, the fix-up and gradient kernels of
//! cuda/train/sinks.cuh): the output and the gradients of q, k, v and the sinks against
//! `attention_slow_with` (the sink as one more softmax column) in f32, by FlashAttention's
//! rule with the same math in bf16/f16 as the baseline (2x for the output, 3x for every
//! gradient, the sinks' included); over the kernels' head dims, causal bottom-right both ways,
//! GQA/MQA, rows that see no key, variable-length and padded batches. The fix-up itself is
//! checked against the same call without sinks (LSE to f32 accuracy, the output within one
//! rounding), in the fixed-length and the packed LSE layout; the sinks' gradient is bitwise
//! repeatable; sinks on another device are an error naming them.

use candle::{DType, Device, Result, Tensor, Var};
use candle_flash::{attention_slow_with, FlashAttn, Padding, VarLen};

use crate::cuda_suite::{check_output, check_rule, randn, tensor_bits, to_reference, Suite};

const NAMES: [&str; 4] = ["dq", "dk", "dv", "dsinks"];

#[derive(Clone, Copy, Debug)]
struct Case {
    dtype: DType,
    b: usize,
    sq: usize,
    sk: usize,
    h: usize,
    hk: usize,
    d: usize,
    causal: bool,
    /// `(left, right)`, or none.
    window: Option<(usize, usize)>,
}

impl std::fmt::Display for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} b={} sq={} sk={} h={}/{} d={} causal={} window={:?}",
            self.dtype, self.b, self.sq, self.sk, self.h, self.hk, self.d, self.causal, self.window
        )
    }
}

impl Case {
    fn opts(&self) -> FlashAttn {
        let o = FlashAttn::new().causal(self.causal);
        match self.window {
            Some((l, r)) => o.window(Some(l), Some(r)),
            None => o,
        }
    }
}

/// One f32 logit per head, of both signs and around the scores' range.
fn sinks_of(h: usize, dev: &Device) -> Result<Tensor> {
    let s: Vec<f32> = (0..h).map(|i| 2.0 * (0.9 * i as f32 + 0.3).sin()).collect();
    Tensor::from_vec(s, h, dev)
}

type Attn<'a> = &'a dyn Fn(&Tensor, &Tensor, &Tensor, &Tensor) -> Result<Tensor>;

/// Gradients of `sum(attn(q, k, v, sinks) · w)` for q, k, v and the sinks.
fn grads4(qkvw: [&Tensor; 4], sinks: &Tensor, attn: Attn) -> Result<[Tensor; 4]> {
    let [q, k, v, w] = qkvw;
    let vars = [q, k, v, sinks].map(|t| Var::from_tensor(t).expect("a variable"));
    let out = attn(&vars[0], &vars[1], &vars[2], &vars[3])?;
    let grads = out.mul(&w.to_dtype(out.dtype())?)?.sum_all()?.backward()?;
    let get = |i: usize| match grads.get(&vars[i]) {
        Some(g) => Ok(g.clone()),
        None => candle::bail!("no gradient for {}", NAMES[i]),
    };
    Ok([get(0)?, get(1)?, get(2)?, get(3)?])
}

/// `ours` on the device (inputs q, k, v, w of the device, f32 sinks) against `slow` on the
/// reference device: the output by the 2x rule, the four gradients by the 3x rule, with
/// `slow` in the inputs' dtype as the baseline and in f32 as the truth.
fn check(qkvw: [&Tensor; 4], sinks: &Tensor, ours: Attn, slow: Attn) -> Result<()> {
    let [q, k, v, _] = qkvw;
    let out = ours(q, k, v, sinks)?;
    let grads = grads4(qkvw, sinks, ours)?;
    let low = qkvw.map(|t| to_reference(t).expect("a reference copy"));
    let exact = low
        .clone()
        .map(|t| t.to_dtype(DType::F32).expect("an f32 copy"));
    let s = to_reference(sinks)?;
    let [lq, lk, lv, _] = &low;
    let [eq, ek, ev, _] = &exact;
    check_output("out", &out, &slow(lq, lk, lv, &s)?, &slow(eq, ek, ev, &s)?)?;
    let low_grads = grads4([&low[0], &low[1], &low[2], &low[3]], &s, slow)?;
    let exact_grads = grads4([&exact[0], &exact[1], &exact[2], &exact[3]], &s, slow)?;
    for (i, name) in NAMES.iter().enumerate() {
        check_rule(name, &grads[i], &low_grads[i], &exact_grads[i], 3.0, 1e-4)?;
    }
    Ok(())
}

fn case(dev: &Device, c: &Case) -> Result<()> {
    let q = randn((c.b, c.sq, c.h, c.d), c.dtype, dev)?;
    let k = randn((c.b, c.sk, c.hk, c.d), c.dtype, dev)?;
    let v = randn((c.b, c.sk, c.hk, c.d), c.dtype, dev)?;
    let w = randn((c.b, c.sq, c.h, c.d), c.dtype, dev)?;
    let sinks = sinks_of(c.h, dev)?;
    let opts = c.opts();
    let ours =
        |q: &Tensor, k: &Tensor, v: &Tensor, s: &Tensor| opts.clone().sinks(s).forward(q, k, v);
    let slow = |q: &Tensor, k: &Tensor, v: &Tensor, s: &Tensor| {
        attention_slow_with(q, k, v, &opts.clone().sinks(s))
    };
    check([&q, &k, &v, &w], &sinks, &ours, &slow)?;
    fix_up(&q, &k, &v, &sinks, &opts)
}

/// `(out, lse)` with sinks against the same call without: `L = log(exp(lse) + exp(sink))` to
/// f32 accuracy (exactly the sink where the row sees no key), the output
/// `out · exp(lse - L)` within one ulp of its dtype (one rounding, of a share computed in f32). Fixed-length or packed by q's rank.
fn fix_up(q: &Tensor, k: &Tensor, v: &Tensor, sinks: &Tensor, opts: &FlashAttn) -> Result<()> {
    let run = |o: &FlashAttn| -> Result<(Tensor, Tensor)> {
        match q.rank() {
            4 => o.forward_with_lse(q, k, v),
            _ => {
                let (tq, tk) = (q.dim(0)?, k.dim(0)?);
                o.forward_varlen_with_lse(q, k, v, &VarLen::from_seqlens(&[tq], &[tk])?)
            }
        }
    };
    let (out0, lse0) = run(opts)?;
    let (out, lse) = run(&opts.clone().sinks(sinks))?;
    let host = |t: &Tensor| -> Result<Vec<f32>> {
        t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
    };
    let s = host(sinks)?;
    let (lse0, lse) = (host(&lse0)?, host(&lse)?);
    let h = s.len();
    // The LSE's rows are (outer, h, rows): head (i / rows) % h.
    let rows = lse.len() / h / if q.rank() == 4 { q.dim(0)? } else { 1 };
    let mut share = vec![0f32; lse.len()];
    for (i, (&a, &l)) in lse0.iter().zip(&lse).enumerate() {
        let sink = s[(i / rows) % h] as f64;
        let (a64, expected) = if a == f32::NEG_INFINITY {
            (a as f64, sink)
        } else {
            let m = (a as f64).max(sink);
            (a as f64, m + ((a as f64 - m).exp() + (sink - m).exp()).ln())
        };
        if (l as f64 - expected).abs() > 1e-5 * expected.abs().max(1.0) {
            candle::bail!("lse[{i}] = {l}, expected {expected}");
        }
        share[i] = if a == f32::NEG_INFINITY {
            0.0
        } else {
            (a64 - expected).exp() as f32
        };
    }
    // The share per (row, head) in the output's layout: (outer, rows, h) from (outer, h, rows).
    let dev = q.device();
    let share = Tensor::from_vec(share, (lse.len() / (h * rows), h, rows), &Device::Cpu)?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(out.dims()[..out.rank() - 1].to_vec())?
        .unsqueeze(out.rank() - 1)?
        .to_device(dev)?;
    let expected = out0.to_dtype(DType::F32)?.broadcast_mul(&share)?;
    let err = (out.to_dtype(DType::F32)? - &expected)?.abs()?;
    let ulp = match out.dtype() {
        DType::BF16 => 2f64.powi(-7),
        _ => 2f64.powi(-10),
    };
    let bound = (expected.abs()? * ulp)?.affine(1.0, 1e-7)?;
    let over = err
        .gt(&bound)?
        .to_dtype(DType::F32)?
        .sum_all()?
        .to_scalar::<f32>()?;
    if over > 0.0 {
        candle::bail!("out: {over} elements further than one ulp from out · exp(lse - L)");
    }
    Ok(())
}

/// A packed batch (a sequence without keys, one without queries) through `forward_varlen`
/// against the oracle on each sequence alone, the sinks shared.
fn varlen_case(dev: &Device, dtype: DType, d: usize, causal: bool) -> Result<()> {
    let (lens_q, lens_k) = ([37usize, 1, 200, 0, 64], [90usize, 0, 150, 5, 64]);
    let (h, hk) = (8, 2);
    let (tq, tk): (usize, usize) = (lens_q.iter().sum(), lens_k.iter().sum());
    let varlen = VarLen::from_seqlens(&lens_q, &lens_k)?;
    let q = randn((1, tq, h, d), dtype, dev)?;
    let k = randn((1, tk, hk, d), dtype, dev)?;
    let v = randn((1, tk, hk, d), dtype, dev)?;
    let w = randn((1, tq, h, d), dtype, dev)?;
    let sinks = sinks_of(h, dev)?;
    let opts = FlashAttn::new().causal(causal);
    // Both sides on `(1, t, h, d)` tensors.
    let ours = |q: &Tensor, k: &Tensor, v: &Tensor, s: &Tensor| {
        let flat = |t: &Tensor| t.squeeze(0);
        opts.clone()
            .sinks(s)
            .forward_varlen(&flat(q)?, &flat(k)?, &flat(v)?, &varlen)?
            .unsqueeze(0)
    };
    let slow = |q: &Tensor, k: &Tensor, v: &Tensor, s: &Tensor| -> Result<Tensor> {
        let (mut oq, mut ok, mut outs) = (0, 0, vec![]);
        for (&lq, &lk) in lens_q.iter().zip(&lens_k) {
            outs.push(attention_slow_with(
                &q.narrow(1, oq, lq)?,
                &k.narrow(1, ok, lk)?,
                &v.narrow(1, ok, lk)?,
                &opts.clone().sinks(s),
            )?);
            (oq, ok) = (oq + lq, ok + lk);
        }
        Tensor::cat(&outs, 1)
    };
    check([&q, &k, &v, &w], &sinks, &ours, &slow)?;
    fix_up(
        &q.squeeze(0)?,
        &k.squeeze(0)?,
        &v.squeeze(0)?,
        &sinks,
        &opts,
    )
}

/// A padded batch through `forward_padded`: real rows against the oracle per sequence, padded
/// rows zero.
fn padded_case(dev: &Device) -> Result<()> {
    let (b, s, h, hk, d, dtype) = (3, 128, 4, 2, 64, DType::BF16);
    let lengths = [128usize, 37, 1];
    let pad = Padding::from_lengths(&lengths, s)?;
    let q = randn((b, s, h, d), dtype, dev)?;
    let k = randn((b, s, hk, d), dtype, dev)?;
    let v = randn((b, s, hk, d), dtype, dev)?;
    let w = randn((b, s, h, d), dtype, dev)?;
    let sinks = sinks_of(h, dev)?;
    let opts = FlashAttn::new().causal(true);
    let ours = |q: &Tensor, k: &Tensor, v: &Tensor, sk: &Tensor| {
        opts.clone().sinks(sk).forward_padded(q, k, v, &pad, &pad)
    };
    let slow = |q: &Tensor, k: &Tensor, v: &Tensor, sk: &Tensor| -> Result<Tensor> {
        let mut rows = vec![];
        for (bi, &len) in lengths.iter().enumerate() {
            let real = |t: &Tensor| t.narrow(0, bi, 1)?.narrow(1, 0, len);
            let o = attention_slow_with(&real(q)?, &real(k)?, &real(v)?, &opts.clone().sinks(sk))?;
            let zeros = Tensor::zeros((1, s - len, h, d), q.dtype(), q.device())?;
            rows.push(Tensor::cat(&[&o, &zeros], 1)?);
        }
        Tensor::cat(&rows, 0)
    };
    check([&q, &k, &v, &w], &sinks, &ours, &slow)
}

/// The sinks' gradient (per-block partials summed in a fixed order) and everything else of a
/// training step, bitwise the same on a second run.
fn repeatable(dev: &Device) -> Result<()> {
    let (b, sq, h, hk, d) = (2, 1000, 8, 2, 128);
    let q = randn((b, sq, h, d), DType::BF16, dev)?;
    let k = randn((b, sq, hk, d), DType::BF16, dev)?;
    let v = randn((b, sq, hk, d), DType::BF16, dev)?;
    let w = randn((b, sq, h, d), DType::BF16, dev)?;
    let sinks = sinks_of(h, dev)?;
    let ours = |q: &Tensor, k: &Tensor, v: &Tensor, s: &Tensor| {
        FlashAttn::new()
            .causal(true)
            .deterministic(true)
            .sinks(s)
            .forward(q, k, v)
    };
    let first = grads4([&q, &k, &v, &w], &sinks, &ours)?;
    let second = grads4([&q, &k, &v, &w], &sinks, &ours)?;
    for ((name, a), b) in NAMES.iter().zip(&first).zip(&second) {
        if tensor_bits(a)? != tensor_bits(b)? {
            candle::bail!("{name} differs between two runs");
        }
    }
    Ok(())
}

/// Sinks on the CPU for q on the GPU.
fn device_error(dev: &Device) -> Result<()> {
    let q = randn((1, 8, 4, 64), DType::BF16, dev)?;
    let sinks = sinks_of(4, &Device::Cpu)?;
    match FlashAttn::new().sinks(&sinks).forward(&q, &q, &q) {
        Ok(_) => candle::bail!("sinks on the CPU were accepted for q on CUDA"),
        Err(e)
            if e.to_string()
                .contains("sinks: expected the same device as q") =>
        {
            Ok(())
        }
        Err(e) => candle::bail!("unexpected error: {e}"),
    }
}

/// Head dims of every kernel class, causal bottom-right with fewer and with more queries than
/// keys (rows without keys), GQA and MQA, a window that leaves rows without keys; bf16 and
/// f16.
fn cases(quick: bool) -> Vec<Case> {
    let base = Case {
        dtype: DType::BF16,
        b: 2,
        sq: 113,
        sk: 203,
        h: 8,
        hk: 2,
        d: 64,
        causal: true,
        window: None,
    };
    let dims: &[usize] = if quick {
        &[64, 128]
    } else {
        &[40, 64, 96, 128, 160, 256]
    };
    let mut out = vec![];
    for &d in dims {
        out.push(Case { d, ..base });
        out.push(Case {
            d,
            sq: 203,
            sk: 113,
            hk: 1,
            ..base
        });
    }
    out.push(Case {
        sq: 1,
        sk: 517,
        causal: false,
        ..base
    });
    out.push(Case {
        sq: 64,
        sk: 16,
        causal: false,
        window: Some((1, 1)),
        ..base
    });
    out.push(Case {
        dtype: DType::F16,
        ..base
    });
    if !quick {
        out.push(Case {
            dtype: DType::F16,
            d: 128,
            sq: 1024,
            sk: 1024,
            h: 4,
            hk: 4,
            ..base
        });
    }
    out
}

pub(crate) fn run(dev: &Device, quick: bool, suite: &mut Suite) {
    for c in cases(quick) {
        suite.record(&format!("sinks {c}"), case(dev, &c));
    }
    for (dtype, d, causal) in [
        (DType::BF16, 64, true),
        (DType::BF16, 128, false),
        (DType::F16, 96, true),
    ] {
        suite.record(
            &format!("sinks varlen {dtype:?} d={d} causal={causal}"),
            varlen_case(dev, dtype, d, causal),
        );
    }
    suite.record("sinks padded", padded_case(dev));
    suite.record("sinks repeatable", repeatable(dev));
    suite.record("sinks device error", device_error(dev));
}
