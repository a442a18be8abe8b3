//! Reliability checks (issue "Reliability"), one suite result per check:
//! - bad input: one case per rule, each a `candle::Error` that names the argument;
//! - defined results: batch 0 / seqlen_q 0 give empty outputs, seqlen_k 0 gives zeros, LSE
//!   `-inf` and a backward with zero dq;
//! - numerics at the edges: logits scaled by 100, fully masked rows, a 64k-key row, f16
//!   values near ±200; no inf/NaN where the f32 reference has none, and the accuracy rule
//!   (2x the error of `attention_slow` in the same precision for outputs, 3x for gradients);
//! - NaN in, NaN out: a NaN score gives NaN output, LSE and gradients in its rows only, apart
//!   from rows that see no key (tests/common/nan.rs, shared with the CPU tests);
//! - concurrency: four threads call the op at once on one `Device`, bitwise equal to
//!   single-threaded runs (atomic dQ within rounding; dropout offsets drawn from the counter
//!   never repeat);
//! - leaks: 10,000 forward+backward calls leave device memory use flat.
//!
//! With `--sanitize` (scripts/gpu/sanitize.sh, with `--quick`) the repeated and long checks
//! shrink so that the section runs under compute-sanitizer in a minute or two, and inputs and
//! references come from the CPU as everywhere in the suite (`cuda_suite::reference_device`).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

use candle::{DType, Device, Result, Tensor};
use candle_flash::{attention_slow, flash_attn, FlashAttn, KvCache};

use crate::cuda_suite::{
    attention_low, check_rule as rule, grads_of, randn, sanitize, tensor_bits, tensors_bits,
    to_reference, Suite,
};

/// How much of the repeated and long checks to run.
#[derive(Clone, Copy, Debug)]
struct Budget {
    /// Forward+backward calls of the leak check.
    leak_calls: usize,
    /// Calls per thread in the concurrency check.
    thread_calls: usize,
    /// seqlen_k of the long-row check.
    long_row: usize,
}

impl Budget {
    fn new(quick: bool, sanitize: bool) -> Self {
        match (quick, sanitize) {
            (_, true) => Self {
                leak_calls: 30,
                thread_calls: 2,
                long_row: 4096,
            },
            (true, false) => Self {
                leak_calls: 1000,
                thread_calls: 5,
                long_row: 65536,
            },
            (false, false) => Self {
                leak_calls: 10_000,
                thread_calls: 25,
                long_row: 65536,
            },
        }
    }
}

/// Device memory the leak check tolerates growing by between its two samples.
const LEAK_SLACK_BYTES: usize = 64 << 20;
/// Absolute slack of the accuracy rule, outputs and gradients (as in the grid of gpu.rs).
const OUT_ABS_SLACK: f32 = 1e-5;
const GRAD_ABS_SLACK: f32 = 1e-4;

pub fn run(dev: &Device, quick: bool, suite: &mut Suite) {
    let sanitize = sanitize();
    let budget = Budget::new(quick, sanitize);
    let start = Instant::now();
    let (passed, failed) = (suite.passed, suite.failed);

    bad_inputs(dev, suite);
    suite.record(
        "reliability: batch 0 and seqlen_q 0 give empty outputs",
        guarded(|| empty_outputs(dev)),
    );
    suite.record(
        "reliability: seqlen_k 0 gives zeros, LSE -inf and zero dq",
        guarded(|| no_keys(dev)),
    );
    numerics(dev, budget, suite);
    suite.record(
        "reliability: a NaN query row gives NaN output, LSE and gradients there only",
        guarded(|| crate::common::nan::nan_query(dev)),
    );
    suite.record(
        "reliability: a NaN key (causal): NaN rows, finite rows, rows without keys apart",
        guarded(|| crate::common::nan::nan_key_causal(dev)),
    );
    suite.record(
        "reliability: a NaN key in a 3000-token cache: split-KV decode keeps it",
        guarded(|| crate::common::nan::nan_in_cache(dev)),
    );
    suite.record(
        "reliability: inputs starting at an odd element offset (forward, backward, decode)",
        guarded(|| misaligned_offsets(dev)),
    );
    suite.record(
        "reliability: 4 threads on one device, bitwise equal to one thread",
        guarded(|| threads(dev, budget.thread_calls)),
    );
    suite.record(
        "reliability: 4 threads: atomic-dQ backward and split-KV decodes against one thread",
        guarded(|| threads_atomic_and_decode(dev, budget.thread_calls)),
    );
    suite.record(
        "reliability: 4 threads: dropout offsets from the counter never repeat, fixed ones agree",
        guarded(|| threads_dropout(dev, budget.thread_calls)),
    );
    // Under scripts/gpu/sanitize.sh other processes share the GPU: device-wide memory use says
    // nothing about this one, so the calls run but memory is not compared.
    suite.record(
        "reliability: device memory flat over repeated forward+backward",
        guarded(|| leaks(dev, budget.leak_calls, !sanitize)),
    );

    println!(
        "reliability: {} checks, {} failed ({:.1}s{})",
        suite.passed + suite.failed - passed - failed,
        suite.failed - failed,
        start.elapsed().as_secs_f32(),
        if sanitize { ", --sanitize sizes" } else { "" }
    );
}

/// Runs `f`, turning a panic into an error: a bad input must never take the process down.
fn guarded<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(result) => result,
        Err(panic) => {
            let message = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)");
            candle::bail!("panicked: {message}")
        }
    }
}

/// Prefixes an error with what was being done, keeping it on one line.
fn doing<T>(what: &str, result: Result<T>) -> Result<T> {
    result.map_err(|e| {
        let first = e.to_string().lines().next().unwrap_or_default().to_string();
        candle::Error::Msg(format!("{what}: {first}"))
    })
}

fn bf16(shape: &[usize], dev: &Device) -> Result<Tensor> {
    randn(shape, DType::BF16, dev)
}

/// Host copy of a tensor as f32.
fn host(t: &Tensor) -> Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()
}

// ---------------------------------------------------------------------------------------
// Bad input

/// `result` must be an error whose message contains every needle.
fn expect_error(result: Result<Tensor>, needles: &[&str]) -> Result<()> {
    match result {
        Ok(t) => candle::bail!(
            "expected an error naming {needles:?}, got a tensor {:?}",
            t.dims()
        ),
        Err(e) => {
            let message = e.to_string();
            match needles.iter().find(|n| !message.contains(*n)) {
                None => Ok(()),
                Some(missing) => candle::bail!(
                    "error lacks {missing:?}: {}",
                    message.lines().next().unwrap_or_default()
                ),
            }
        }
    }
}

type Call<'a> = Box<dyn FnOnce() -> Result<Tensor> + 'a>;

/// `flash_attn` on fresh bf16 tensors of these shapes, not causal.
fn shapes<'a>(dev: &'a Device, q: &[usize], k: &[usize], v: &[usize]) -> Call<'a> {
    let (q, k, v) = (q.to_vec(), k.to_vec(), v.to_vec());
    Box::new(move || flash_attn(&bf16(&q, dev)?, &bf16(&k, dev)?, &bf16(&v, dev)?, false))
}

fn head_dim(dev: &Device, d: usize) -> Call<'_> {
    Box::new(move || {
        let t = bf16(&[1, 8, 2, d], dev)?;
        flash_attn(&t, &t, &t, false)
    })
}

fn dtypes(dev: &Device, [dq, dk, dv]: [DType; 3]) -> Call<'_> {
    Box::new(move || {
        let s = [1, 8, 2, 64];
        flash_attn(
            &randn(&s, dq, dev)?,
            &randn(&s, dk, dev)?,
            &randn(&s, dv, dev)?,
            false,
        )
    })
}

fn devices(devs: [&Device; 3]) -> Call<'static> {
    let [dq, dk, dv] = devs.map(Device::clone);
    Box::new(move || {
        let s = [1, 8, 2, 64];
        flash_attn(&bf16(&s, &dq)?, &bf16(&s, &dk)?, &bf16(&s, &dv)?, false)
    })
}

/// q, k or v (`which` = 0, 1, 2) of shape (1, 8, 2, 64) with head_dim stride 2: a
/// (1, 8, 64, 2) tensor transposed.
fn strided(dev: &Device, which: usize) -> Call<'_> {
    Box::new(move || {
        let mut t = [
            bf16(&[1, 8, 2, 64], dev)?,
            bf16(&[1, 8, 2, 64], dev)?,
            bf16(&[1, 8, 2, 64], dev)?,
        ];
        t[which] = bf16(&[1, 8, 64, 2], dev)?.transpose(2, 3)?;
        flash_attn(&t[0], &t[1], &t[2], false)
    })
}

fn scale(dev: &Device, scale: f32) -> Call<'_> {
    Box::new(move || {
        let t = bf16(&[1, 8, 2, 64], dev)?;
        FlashAttn::new().softmax_scale(scale).forward(&t, &t, &t)
    })
}

/// One case per validation rule, on CUDA (and across devices).
fn bad_inputs(dev: &Device, suite: &mut Suite) {
    let cpu = &Device::Cpu;
    let base = [1, 8, 2, 64];
    let (bf, half, single, double) = (DType::BF16, DType::F16, DType::F32, DType::F64);
    let zero_head_dim: Call = Box::new(|| {
        // A view of zero elements: no zero-byte allocation needed.
        let t = bf16(&[1, 8, 2, 8], dev)?.narrow(3, 0, 0)?;
        flash_attn(&t, &t, &t, false)
    });
    let cases: Vec<(&str, Call, &[&str])> = vec![
        (
            "q of rank 3",
            shapes(dev, &[8, 2, 64], &base, &base),
            &["q:", "rank 4", "[8, 2, 64]"],
        ),
        (
            "k of rank 5",
            shapes(dev, &base, &[1, 1, 8, 2, 64], &base),
            &["k:", "rank 4"],
        ),
        (
            "v of rank 2",
            shapes(dev, &base, &base, &[8, 128]),
            &["v:", "rank 4", "[8, 128]"],
        ),
        (
            "k batch 3, q batch 2",
            shapes(dev, &[2, 8, 2, 64], &[3, 8, 2, 64], &[2, 8, 2, 64]),
            &["k:", "batch size 3", "q's 2"],
        ),
        (
            "v batch 3, q batch 2",
            shapes(dev, &[2, 8, 2, 64], &[2, 8, 2, 64], &[3, 8, 2, 64]),
            &["v:", "batch size 3", "q's 2"],
        ),
        (
            "v seqlen 7, k seqlen 8",
            shapes(dev, &base, &base, &[1, 7, 2, 64]),
            &["v:", "seqlen 7", "k's seqlen 8"],
        ),
        (
            "v num_heads 4, k num_heads 2",
            shapes(dev, &[1, 8, 4, 64], &base, &[1, 8, 4, 64]),
            &["v:", "num_heads 4", "k's num_heads 2"],
        ),
        (
            "k head_dim 32, q head_dim 64",
            shapes(dev, &base, &[1, 8, 2, 32], &base),
            &["k:", "head_dim 32", "q's head_dim 64"],
        ),
        (
            "v head_dim 32, q head_dim 64",
            shapes(dev, &base, &base, &[1, 8, 2, 32]),
            &["v:", "head_dim 32", "q's head_dim 64"],
        ),
        (
            "num_heads 4 % num_heads_k 3 != 0",
            shapes(dev, &[1, 8, 4, 64], &[1, 8, 3, 64], &[1, 8, 3, 64]),
            &["k:", "num_heads_k 3", "num_heads 4"],
        ),
        ("head_dim 0", zero_head_dim, &["q:", "head_dim", "got 0"]),
        (
            "head_dim 264",
            head_dim(dev, 264),
            &["q:", "head_dim", "1..=256", "got 264"],
        ),
        (
            "head_dim 36 on CUDA",
            head_dim(dev, 36),
            &["q:", "multiple of 8", "got 36"],
        ),
        (
            "head_dim 4 on CUDA",
            head_dim(dev, 4),
            &["q:", "multiple of 8", "got 4"],
        ),
        (
            "f32 on CUDA",
            dtypes(dev, [single; 3]),
            &["q:", "F32", "not supported"],
        ),
        (
            "f64 on CUDA",
            dtypes(dev, [double; 3]),
            &["q:", "F64", "not supported"],
        ),
        (
            "k f16, q bf16",
            dtypes(dev, [bf, half, bf]),
            &["k:", "same dtype as q", "BF16", "F16"],
        ),
        (
            "v f32, q bf16",
            dtypes(dev, [bf, bf, single]),
            &["v:", "same dtype as q", "BF16", "F32"],
        ),
        (
            "k on the CPU, q on CUDA",
            devices([dev, cpu, dev]),
            &["k:", "same device as q"],
        ),
        (
            "v on the CPU, q on CUDA",
            devices([dev, dev, cpu]),
            &["v:", "same device as q"],
        ),
        (
            "q on the CPU, k and v on CUDA",
            devices([cpu, dev, dev]),
            &["k:", "same device as q"],
        ),
        (
            "q head_dim stride 2",
            strided(dev, 0),
            &["q:", "last dimension", "contiguous"],
        ),
        (
            "k head_dim stride 2",
            strided(dev, 1),
            &["k:", "last dimension", "contiguous"],
        ),
        (
            "v head_dim stride 2",
            strided(dev, 2),
            &["v:", "last dimension", "contiguous"],
        ),
        (
            "softmax_scale 0",
            scale(dev, 0.0),
            &["softmax_scale:", "finite positive", "got 0"],
        ),
        (
            "softmax_scale NaN",
            scale(dev, f32::NAN),
            &["softmax_scale:", "finite positive", "got NaN"],
        ),
        (
            "softmax_scale -1",
            scale(dev, -1.0),
            &["softmax_scale:", "finite positive", "got -1"],
        ),
        (
            "softmax_scale inf",
            scale(dev, f32::INFINITY),
            &["softmax_scale:", "finite positive", "got inf"],
        ),
    ];
    for (name, call, needles) in cases {
        suite.record(
            &format!("reliability: bad input: {name}"),
            guarded(|| expect_error(call(), needles)),
        );
    }
}

// ---------------------------------------------------------------------------------------
// Defined results for empty shapes

/// batch 0 and seqlen_q 0: an empty output `(b, sq, h, d)` in the input dtype and an empty
/// `(b, h, sq)` LSE, with and without the causal mask.
fn empty_outputs(dev: &Device) -> Result<()> {
    for (b, sq) in [(0, 9), (2, 0)] {
        for causal in [false, true] {
            let what = format!("b={b} sq={sq} causal={causal}");
            let q = doing(
                "creating an empty q",
                Tensor::zeros((b, sq, 4, 64), DType::BF16, dev),
            )?;
            let kv = doing("creating k", Tensor::zeros((b, 9, 2, 64), DType::BF16, dev))?;
            let (out, lse) = doing(
                &what,
                FlashAttn::new()
                    .causal(causal)
                    .forward_with_lse(&q, &kv, &kv),
            )?;
            if out.dims() != [b, sq, 4, 64] || out.dtype() != DType::BF16 {
                candle::bail!("{what}: output {:?} {:?}", out.dims(), out.dtype());
            }
            if lse.dims() != [b, 4, sq] || lse.dtype() != DType::F32 {
                candle::bail!("{what}: lse {:?} {:?}", lse.dims(), lse.dtype());
            }
        }
    }
    Ok(())
}

/// seqlen_k 0: every row sees no key, so the output is zeros and the LSE `-inf`; the
/// backward gives zero dq and empty dk, dv.
fn no_keys(dev: &Device) -> Result<()> {
    let (b, sq, h, hk, d) = (2, 130, 4, 2, 64);
    let q = bf16(&[b, sq, h, d], dev)?;
    let kv = doing(
        "creating an empty k",
        Tensor::zeros((b, 0, hk, d), DType::BF16, dev),
    )?;
    let w = bf16(&[b, sq, h, d], dev)?;
    for causal in [false, true] {
        let attn = FlashAttn::new().causal(causal);
        let (out, lse) = doing(
            &format!("forward causal={causal}"),
            attn.forward_with_lse(&q, &kv, &kv),
        )?;
        if out.dims() != [b, sq, h, d] {
            candle::bail!("causal={causal}: output shape {:?}", out.dims());
        }
        if let Some(x) = host(&out)?.into_iter().find(|&x| x != 0.0) {
            candle::bail!("causal={causal}: output has {x}, expected zeros");
        }
        if let Some(x) = host(&lse)?.into_iter().find(|&x| x != f32::NEG_INFINITY) {
            candle::bail!("causal={causal}: lse has {x}, expected -inf");
        }
        let [dq, dk, dv] = doing(
            &format!("backward causal={causal}"),
            grads_of(&q, &kv, &kv, &w, |q, k, v| attn.forward(q, k, v)),
        )?;
        if dq.dims() != [b, sq, h, d] || dk.dims() != [b, 0, hk, d] || dv.dims() != [b, 0, hk, d] {
            candle::bail!(
                "causal={causal}: gradient shapes dq {:?} dk {:?} dv {:?}",
                dq.dims(),
                dk.dims(),
                dv.dims()
            );
        }
        if let Some(x) = host(&dq)?.into_iter().find(|&x| x != 0.0) {
            candle::bail!("causal={causal}: dq has {x}, expected zeros");
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Numerics at the edges

type AttnFn<'a> = &'a dyn Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>;

/// One numerics case: the output against the f32 reference and the low-precision `low`
/// (same math in the inputs' dtype; both on the reference device), and with `grads` the
/// gradients of `sum(out * w)` too.
fn check_case(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    attn: &FlashAttn,
    grads: bool,
    low: AttnFn,
) -> Result<String> {
    let scale = match attn.softmax_scale {
        Some(s) => s,
        None => 1.0 / (q.dim(3)? as f32).sqrt(),
    };
    let (qr, kr, vr) = (to_reference(q)?, to_reference(k)?, to_reference(v)?);
    let f32_of = |t: &Tensor| t.to_dtype(DType::F32);
    let (qf, kf, vf) = (f32_of(&qr)?, f32_of(&kr)?, f32_of(&vr)?);
    let exact = |q: &Tensor, k: &Tensor, v: &Tensor| attention_slow(q, k, v, scale, attn.causal);
    let ours = attn.forward(q, k, v)?;
    let mut notes = vec![rule(
        "out",
        &ours,
        &low(&qr, &kr, &vr)?,
        &exact(&qf, &kf, &vf)?,
        2.0,
        OUT_ABS_SLACK,
    )?];
    if grads {
        let w = randn(ours.dims(), q.dtype(), q.device())?;
        let ours = grads_of(q, k, v, &w, |q, k, v| attn.forward(q, k, v))?;
        let wr = to_reference(&w)?;
        let reference = grads_of(&qf, &kf, &vf, &f32_of(&wr)?, exact)?;
        let lows = grads_of(&qr, &kr, &vr, &wr, low)?;
        for (i, name) in ["dq", "dk", "dv"].iter().enumerate() {
            notes.push(rule(
                name,
                &ours[i],
                &lows[i],
                &reference[i],
                3.0,
                GRAD_ABS_SLACK,
            )?);
        }
    }
    Ok(notes.join(", "))
}

fn numerics(dev: &Device, budget: Budget, suite: &mut Suite) {
    let mut record = |name: &str, result: Result<String>| {
        let result = result.map(|notes| println!("reliability: {name}: {notes}"));
        suite.record(&format!("reliability: numerics: {name}"), result);
    };

    // Logits 100x the usual: the softmax is nearly one-hot. bf16 through the scale...
    record(
        "logits x100 (scale 100/sqrt(d)) bf16 d=128 GQA 8/2",
        guarded(|| {
            let (q, k, v) = (
                bf16(&[2, 203, 8, 128], dev)?,
                bf16(&[2, 311, 2, 128], dev)?,
                bf16(&[2, 311, 2, 128], dev)?,
            );
            let scale = 100.0 / 128f32.sqrt();
            let attn = FlashAttn::new().softmax_scale(scale);
            check_case(&q, &k, &v, &attn, true, &|q, k, v| {
                attention_slow(q, k, v, scale, false)
            })
        }),
    );
    // ...and f16 through the inputs: q and k times 10 (|values| up to ~50).
    record(
        "logits x100 (q, k x10) f16 d=64 causal",
        guarded(|| {
            let ten = |t: Tensor| t.affine(10.0, 0.0);
            let q = ten(randn(&[2, 257, 4, 64], DType::F16, dev)?)?;
            let k = ten(randn(&[2, 257, 4, 64], DType::F16, dev)?)?;
            let v = randn(&[2, 257, 4, 64], DType::F16, dev)?;
            let attn = FlashAttn::new().causal(true);
            check_case(&q, &k, &v, &attn, true, &|q, k, v| {
                attention_slow(q, k, v, 0.125, true)
            })
        }),
    );

    // Causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows see no key.
    for (dtype, sq, sk, h, hk, d) in [
        (DType::BF16, 300, 17, 4, 1, 64),
        (DType::F16, 129, 1, 4, 4, 128),
    ] {
        record(
            &format!("fully masked rows {dtype:?} sq={sq} sk={sk} h={h}/{hk} d={d}"),
            guarded(|| masked_rows(dev, dtype, (sq, sk, h, hk, d))),
        );
    }

    // One very long row: 64 queries over 64k keys (4k with --sanitize).
    let sk = budget.long_row;
    let long_row = || -> Result<[Tensor; 3]> {
        Ok([
            bf16(&[1, 64, 4, 128], dev)?,
            bf16(&[1, sk, 1, 128], dev)?,
            bf16(&[1, sk, 1, 128], dev)?,
        ])
    };
    let attn = FlashAttn::new().causal(true);
    let scale = 1.0 / 128f32.sqrt();
    record(
        &format!("long row bf16 sq=64 sk={sk} h=4/1 d=128 causal"),
        guarded(|| {
            let [q, k, v] = long_row()?;
            check_case(&q, &k, &v, &attn, true, &|q, k, v| {
                attention_low(q, k, v, scale, true)
            })
        }),
    );

    // The same rule must see a kernel that loses one 16-key tile of that row.
    record(
        &format!("planted: the long row (sk={sk}) without one 16-key tile fails the rule"),
        guarded(|| {
            let [q, k, v] = long_row()?;
            let cut = |t: &Tensor| {
                let at = sk / 2;
                Tensor::cat(
                    &[t.narrow(1, 0, at)?, t.narrow(1, at + 16, sk - at - 16)?],
                    1,
                )
            };
            let bad = attn.forward(&q, &cut(&k)?, &cut(&v)?)?;
            let (qr, kr, vr) = (to_reference(&q)?, to_reference(&k)?, to_reference(&v)?);
            let f32_of = |t: &Tensor| t.to_dtype(DType::F32);
            let exact = attention_slow(&f32_of(&qr)?, &f32_of(&kr)?, &f32_of(&vr)?, scale, true)?;
            let low = attention_low(&qr, &kr, &vr, scale, true)?;
            match rule("out", &bad, &low, &exact, 2.0, OUT_ABS_SLACK) {
                Err(e) => Ok(format!("caught: {e}")),
                Ok(notes) => candle::bail!("a lost tile passed the rule: {notes}"),
            }
        }),
    );

    record(
        "f16 values near ±200 (logits ~±40) d=64 GQA 4/2",
        guarded(|| f16_near_range(dev)),
    );
}

/// Causal, seqlen_q > seqlen_k: rows that see no key are exactly zero with LSE `-inf` and
/// zero dq; the rest keep the accuracy rule.
fn masked_rows(
    dev: &Device,
    dtype: DType,
    (sq, sk, h, hk, d): (usize, usize, usize, usize, usize),
) -> Result<String> {
    let b = 2;
    let (q, k, v) = (
        randn(&[b, sq, h, d], dtype, dev)?,
        randn(&[b, sk, hk, d], dtype, dev)?,
        randn(&[b, sk, hk, d], dtype, dev)?,
    );
    let attn = FlashAttn::new().causal(true);
    let dead = sq - sk; // query i sees key j iff j <= i + sk - sq
    let (out, lse) = attn.forward_with_lse(&q, &k, &v)?;
    if let Some(x) = host(&out.narrow(1, 0, dead)?)?
        .into_iter()
        .find(|&x| x != 0.0)
    {
        candle::bail!("a row that sees no key has output {x}, expected 0");
    }
    let lse = lse.to_dtype(DType::F32)?;
    if let Some(x) = host(&lse.narrow(2, 0, dead)?)?
        .into_iter()
        .find(|&x| x != f32::NEG_INFINITY)
    {
        candle::bail!("a row that sees no key has LSE {x}, expected -inf");
    }
    if let Some(x) = host(&lse.narrow(2, dead, sk)?)?
        .into_iter()
        .find(|x| !x.is_finite())
    {
        candle::bail!("a row that sees keys has LSE {x}");
    }
    let w = randn(&[b, sq, h, d], dtype, dev)?;
    let [dq, _, _] = grads_of(&q, &k, &v, &w, |q, k, v| attn.forward(q, k, v))?;
    if let Some(x) = host(&dq.narrow(1, 0, dead)?)?
        .into_iter()
        .find(|&x| x != 0.0)
    {
        candle::bail!("a row that sees no key has dq {x}, expected 0");
    }
    let scale = 1.0 / (d as f32).sqrt();
    check_case(&q, &k, &v, &attn, true, &|q, k, v| {
        attention_slow(q, k, v, scale, true)
    })
}

/// f16 inputs of magnitude ~±200 (normal with std 64): q·k reaches ~1e5, beyond f16's
/// 65504, so `attention_slow` in f16 would overflow on the scores. The kernels accumulate
/// q·k in f32 and must stay finite and accurate. Baseline: the same math in f16 on inputs
/// divided by 64 (exact, a power of two), with the scale and the output multiplied back:
/// identical rounding, values in range.
fn f16_near_range(dev: &Device) -> Result<String> {
    const SHIFT: f64 = 64.0;
    let big = |shape: &[usize]| randn(shape, DType::F16, dev)?.affine(SHIFT, 0.0);
    let (q, k, v) = (
        big(&[2, 203, 4, 64])?,
        big(&[2, 177, 2, 64])?,
        big(&[2, 177, 2, 64])?,
    );
    // q·k has std 64 * 64 * sqrt(64) = 32768; this scale makes the logits' std 8.
    let scale = 8.0 / 32768.0;
    let attn = FlashAttn::new().softmax_scale(scale);
    let shifted = |q: &Tensor, k: &Tensor, v: &Tensor| -> Result<Tensor> {
        let down = |t: &Tensor| t.affine(1.0 / SHIFT, 0.0);
        let scale = scale * (SHIFT * SHIFT) as f32;
        attention_slow(&down(q)?, &down(k)?, &down(v)?, scale, false)?.affine(SHIFT, 0.0)
    };
    check_case(&q, &k, &v, &attn, true, &shifted)
}

// ---------------------------------------------------------------------------------------
// Concurrency

/// Every bit of the output and the three gradients of one call.
fn bits_of(attn: &FlashAttn, inputs: &[Tensor; 4]) -> Result<Vec<u32>> {
    let [q, k, v, w] = inputs;
    let out = attn.forward(q, k, v)?;
    let grads = grads_of(q, k, v, w, |q, k, v| attn.forward(q, k, v))?;
    tensors_bits(std::iter::once(&out).chain(&grads))
}

/// Four threads call forward+backward at once on clones of one `Device`, each with its own
/// inputs (head dims 64/128, f16/bf16, causal or not); every result is bitwise equal to a
/// single-threaded run of the same inputs.
fn threads(dev: &Device, calls: usize) -> Result<()> {
    let configs = [
        (DType::BF16, 64, false),
        (DType::F16, 128, true),
        (DType::BF16, 128, true),
        (DType::F16, 64, false),
    ];
    let mut work = vec![];
    for (i, &(dtype, d, causal)) in configs.iter().enumerate() {
        let (sq, sk) = (97 + 64 * i, 203 - 32 * i);
        let inputs = [
            randn(&[2, sq, 8, d], dtype, dev)?,
            randn(&[2, sk, 2, d], dtype, dev)?,
            randn(&[2, sk, 2, d], dtype, dev)?,
            randn(&[2, sq, 8, d], dtype, dev)?,
        ];
        let attn = FlashAttn::new().causal(causal).deterministic(true);
        let expected = bits_of(&attn, &inputs)?;
        work.push((attn, inputs, expected));
    }
    on_four_threads(|i| {
        let (attn, inputs, expected) = &work[i];
        for call in 0..calls {
            if bits_of(attn, inputs)? != *expected {
                candle::bail!("thread {i}, call {call}: differs from the single-threaded run");
            }
        }
        dev.synchronize()
    })
}

/// Dropout on four threads. Calls without an explicit offset draw theirs from the
/// process-wide counter: no two of the 4 x `calls` outputs may be equal (a lost increment
/// would repeat a mask). With an explicit offset, each thread's forward+backward
/// (deterministic) is bitwise equal to the one-thread run.
fn threads_dropout(dev: &Device, calls: usize) -> Result<()> {
    let inputs = [
        randn(&[2, 97, 8, 64], DType::BF16, dev)?,
        randn(&[2, 131, 2, 64], DType::BF16, dev)?,
        randn(&[2, 131, 2, 64], DType::BF16, dev)?,
        randn(&[2, 97, 8, 64], DType::BF16, dev)?,
    ];
    let fixed: Vec<FlashAttn> = (0..4u64)
        .map(|i| {
            FlashAttn::new()
                .dropout(0.2)
                .seed(7)
                .rng_offset(1000 + i)
                .deterministic(true)
        })
        .collect();
    let expected = fixed
        .iter()
        .map(|attn| bits_of(attn, &inputs))
        .collect::<Result<Vec<_>>>()?;
    let drawn = std::sync::Mutex::new(Vec::new());
    on_four_threads(|i| {
        let counter = FlashAttn::new().dropout(0.2).seed(7);
        for call in 0..calls {
            if bits_of(&fixed[i], &inputs)? != expected[i] {
                candle::bail!(
                    "thread {i}, call {call}: fixed-offset dropout differs from one thread"
                );
            }
            let out = counter.forward(&inputs[0], &inputs[1], &inputs[2])?;
            let bits = tensor_bits(&out)?;
            drawn.lock().unwrap().push(bits);
        }
        dev.synchronize()
    })?;
    let mut drawn = drawn.into_inner().unwrap();
    let n = drawn.len();
    drawn.sort();
    drawn.dedup();
    if drawn.len() != n {
        candle::bail!(
            "{} of {n} counter-offset dropout calls repeated a mask",
            n - drawn.len()
        );
    }
    Ok(())
}

/// Runs `f(i)` on four threads at once; the first error, or a panic, fails.
fn on_four_threads(f: impl Fn(usize) -> Result<()> + Sync) -> Result<()> {
    std::thread::scope(|scope| {
        let f = &f;
        let handles: Vec<_> = (0..4).map(|i| scope.spawn(move || f(i))).collect();
        let mut first_error = Ok(());
        for (i, handle) in handles.into_iter().enumerate() {
            let result = handle
                .join()
                .unwrap_or_else(|_| Err(candle::Error::Msg(format!("thread {i} panicked"))));
            if first_error.is_ok() {
                first_error = result;
            }
        }
        first_error
    })
}

/// The paths the deterministic thread test leaves out, four threads at once: the default
/// backward (f32 atomics for dQ, so equal to the one-thread run within rounding, not
/// bitwise) and split-KV decoding (2000 cached keys: several blocks per sequence merged by
/// the last one through per-stream counters), bitwise equal to one thread.
fn threads_atomic_and_decode(dev: &Device, calls: usize) -> Result<()> {
    let (b, h, hk, d) = (2, 8, 2, 128);
    let decode_once = |cached: &[Tensor; 2], step: &[Tensor; 3]| -> Result<Vec<f32>> {
        let mut cache = KvCache::new(1, 2048, hk, d, DType::BF16, dev)?;
        cache.append_varlen(&cached[0].squeeze(0)?, &cached[1].squeeze(0)?, &[2000])?;
        let opts = FlashAttn::new().causal(true);
        host(&cache.append_and_attend(&step[0], &step[1], &step[2], &opts)?)
    };
    let mut work = vec![];
    for i in 0..4 {
        let (sq, sk) = (113 + 40 * i, 257 + 64 * i);
        let fwd = [
            randn(&[b, sq, h, d], DType::BF16, dev)?,
            randn(&[b, sk, hk, d], DType::BF16, dev)?,
            randn(&[b, sk, hk, d], DType::BF16, dev)?,
            randn(&[b, sq, h, d], DType::BF16, dev)?,
        ];
        let exact = bits_of(&FlashAttn::new().causal(true).deterministic(true), &fwd)?;
        let cached = [
            randn(&[1, 2000, hk, d], DType::BF16, dev)?,
            randn(&[1, 2000, hk, d], DType::BF16, dev)?,
        ];
        let step = [
            randn(&[1, 1, h, d], DType::BF16, dev)?,
            randn(&[1, 1, hk, d], DType::BF16, dev)?,
            randn(&[1, 1, hk, d], DType::BF16, dev)?,
        ];
        let decoded = decode_once(&cached, &step)?;
        work.push((fwd, exact, cached, step, decoded));
    }
    on_four_threads(|i| {
        let (fwd, exact, cached, step, decoded) = &work[i];
        let atomic = FlashAttn::new().causal(true);
        for call in 0..calls.div_ceil(4) {
            let got = bits_of(&atomic, fwd)?;
            // bits_of returns the f32 bit patterns of out, dq, dk, dv, concatenated.
            let (got, want): (Vec<f32>, Vec<f32>) = (
                got.iter().map(|&x| f32::from_bits(x)).collect(),
                exact.iter().map(|&x| f32::from_bits(x)).collect(),
            );
            let scale = want.iter().fold(1f32, |m, x| m.max(x.abs()));
            let worst = got.iter().zip(&want).fold(0f32, |m, (a, b)| {
                if a.is_nan() || m.is_nan() {
                    f32::NAN
                } else {
                    m.max((a - b).abs())
                }
            });
            if worst.is_nan() || worst > 1e-2 * scale {
                candle::bail!(
                    "thread {i}, call {call}: atomic backward differs by {worst} (scale {scale})"
                );
            }
            if decode_once(cached, step)? != *decoded {
                candle::bail!("thread {i}, call {call}: split-KV decode differs from one thread");
            }
        }
        dev.synchronize()
    })
}

// ---------------------------------------------------------------------------------------
// Leaks

/// `calls` forward+backward calls (b=1 s=128 h=4 d=64 bf16, causal), each with a varlen
/// forward+backward and a KV-cache decoding step, leave the device memory in use
/// (cuMemGetInfo) flat between an early call and the last, after synchronising.
/// With `compare` false the calls run and the figures are printed, nothing more.
fn leaks(dev: &Device, calls: usize, compare: bool) -> Result<()> {
    let ctx = dev.as_cuda_device()?.cuda_stream().context().clone();
    let used = || -> Result<usize> {
        dev.synchronize()?;
        match ctx.mem_get_info() {
            Ok((free, total)) => Ok(total - free),
            Err(e) => candle::bail!("cuMemGetInfo: {e:?}"),
        }
    };
    let shape = [1, 128, 4, 64];
    let (q, k, v, w) = (
        bf16(&shape, dev)?,
        bf16(&shape, dev)?,
        bf16(&shape, dev)?,
        bf16(&shape, dev)?,
    );
    let attn = FlashAttn::new().causal(true);
    let early = (calls / 10).clamp(1, 100);
    let start = Instant::now();
    let mut after_early = 0;
    // A packed batch (forward+backward) and KV-cache decoding go through the loop too.
    let varlen = candle_flash::VarLen::from_seqlens(&[100, 28], &[100, 28])?;
    let packed = |t: &Tensor| t.squeeze(0);
    let mut cache = KvCache::new(2, 64, 4, 64, DType::BF16, dev)?;
    let step = bf16(&[2, 1, 4, 64], dev)?;
    for call in 1..=calls {
        grads_of(&q, &k, &v, &w, |q, k, v| attn.forward(q, k, v))?;
        let (qp, kp, vp) = (packed(&q)?, packed(&k)?, packed(&v)?);
        let wp = packed(&w)?;
        grads_of(&qp, &kp, &vp, &wp, |q, k, v| {
            attn.forward_varlen(q, k, v, &varlen)
        })?;
        if cache.lengths()[0] as usize == cache.capacity() {
            cache.reset();
        }
        cache.append_and_attend(&step, &step, &step, &attn)?;
        if call == early {
            after_early = used()?;
        }
    }
    let after_last = used()?;
    let mib = |x: usize| x as f64 / (1 << 20) as f64;
    println!(
        "reliability: {calls} forward+backward calls in {:.1}s; device memory in use after call {early}: {:.0} MiB, after call {calls}: {:.0} MiB",
        start.elapsed().as_secs_f32(),
        mib(after_early),
        mib(after_last)
    );
    if compare && after_last > after_early + LEAK_SLACK_BYTES {
        candle::bail!(
            "device memory grew by {:.0} MiB from call {early} to call {calls} (slack {:.0} MiB)",
            mib(after_last - after_early),
            mib(LEAK_SLACK_BYTES)
        );
    }
    Ok(())
}

/// `shape` of random bf16 values viewed at element offset 1 of a larger buffer: contiguous,
/// so `Tensor::contiguous` keeps it, but not 16-byte aligned.
fn at_offset_1(shape: &[usize], dev: &Device) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    Tensor::randn(0f32, 1.0, n + 1, dev)?
        .to_dtype(DType::BF16)?
        .narrow(0, 1, n)?
        .reshape(shape)
}

/// Every tensor the kernels read with 16-byte loads (q, k, v, out, dO, LSE, k_new, v_new)
/// given at an odd offset: the results equal those of aligned copies, bitwise, and the
/// context survives (a misaligned load would poison it).
fn misaligned_offsets(dev: &Device) -> Result<()> {
    let shape = [2, 77, 4, 64];
    let (q, k, v) = (
        at_offset_1(&shape, dev)?,
        at_offset_1(&shape, dev)?,
        at_offset_1(&shape, dev)?,
    );
    let copy = |t: &Tensor| t.force_contiguous();
    // Deterministic: the default backward's atomic dQ is not bitwise repeatable.
    let attn = FlashAttn::new().causal(true).deterministic(true);
    let (out, lse) = attn.forward_with_lse(&q, &k, &v)?;
    let (out_ref, lse_ref) = attn.forward_with_lse(&copy(&q)?, &copy(&k)?, &copy(&v)?)?;
    let same = |a: &Tensor, b: &Tensor, what: &str| -> Result<()> {
        if host(a)? != host(b)? {
            candle::bail!("{what}: differs from the aligned run")
        }
        Ok(())
    };
    same(&out, &out_ref, "out")?;
    let dout = at_offset_1(&shape, dev)?;
    // out and LSE at odd offsets too.
    let out_odd = at_offset_1(&shape, dev)?;
    out_odd.slice_set(&out, 0, 0)?;
    let n = lse.elem_count();
    let lse_odd = Tensor::zeros(n + 1, DType::F32, dev)?
        .narrow(0, 1, n)?
        .reshape(lse.dims())?;
    lse_odd.slice_set(&lse, 0, 0)?;
    let (dq, dk, dv) = attn.backward(&q, &k, &v, &out_odd, &lse_odd, &dout)?;
    let (dq2, dk2, dv2) = attn.backward(
        &copy(&q)?,
        &copy(&k)?,
        &copy(&v)?,
        &out_ref,
        &lse_ref,
        &copy(&dout)?,
    )?;
    for (a, b, what) in [(&dq, &dq2, "dq"), (&dk, &dk2, "dk"), (&dv, &dv2, "dv")] {
        same(a, b, what)?;
    }
    // Decode: q, k_new and v_new at odd offsets.
    let mut cache = KvCache::new(2, 64, 4, 64, DType::BF16, dev)?;
    let mut cache_ref = KvCache::new(2, 64, 4, 64, DType::BF16, dev)?;
    let step = [2, 3, 4, 64];
    let (qs, ks, vs) = (
        at_offset_1(&step, dev)?,
        at_offset_1(&step, dev)?,
        at_offset_1(&step, dev)?,
    );
    let o1 = cache.append_and_attend(&qs, &ks, &vs, &attn)?;
    let o2 = cache_ref.append_and_attend(&copy(&qs)?, &copy(&ks)?, &copy(&vs)?, &attn)?;
    same(&o1, &o2, "decode out")?;
    same(cache.k(), cache_ref.k(), "k_cache")?;
    same(cache.v(), cache_ref.v(), "v_cache")?;
    // What the first call rejects, the constructor rejects too.
    match KvCache::new(1, 16, 2, 64, DType::F32, dev) {
        Err(e)
            if e.to_string()
                .contains("dtype: F32 is not supported on this device") => {}
        other => candle::bail!("KvCache::new with F32 on CUDA: {other:?}"),
    }
    match KvCache::new(1, 16, 2, 36, DType::BF16, dev) {
        Err(e) if e.to_string().contains("multiple of 8 on CUDA") => Ok(()),
        other => candle::bail!("KvCache::new with head_dim 36 on CUDA: {other:?}"),
    }
}
