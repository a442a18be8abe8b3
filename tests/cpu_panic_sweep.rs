//! The panic sweep: every public entry point, fed adversarial sizes and values (zero and huge
//! sizes, sums that overflow, NaN and infinite parameters, wrong ranks, dtypes and strides,
//! out-of-range ids and pages), returns an error or a result, never unwinds. Each call runs
//! under `catch_unwind`; the test lists every call that panicked. Results that come back are
//! checked where that is cheap: attention outputs against `attention_slow_with` when the
//! oracle accepts the same call.
//!
//! Sizes whose product fits in memory but not in this machine would abort on allocation,
//! which no test can catch: the huge sizes here overflow `usize` or `isize::MAX` bytes, so the
//! entry points must refuse them before allocating.

mod common;

use std::collections::HashMap;
use std::fmt::Display;
use std::panic::{catch_unwind, AssertUnwindSafe};

use candle::{DType, Device, Result, Tensor, Var};
use candle_flash::quant::{dequantize_fp8, fp8_scales, hadamard, quantize_fp8, Fp8Scaling};
use candle_flash::train::{self, AdamW};
use candle_flash::{
    attention_slow, attention_slow_dropout, attention_slow_with, combine, dropout_mask, flash_attn,
    flash_attn_with_kvcache, flash_attn_with_paged_kvcache, BlockMask, FlashAttn, KvCache, Padding,
    PagedKvCache, VarLen,
};
use rand::{rngs::StdRng, Rng, SeedableRng};

const CPU: Device = Device::Cpu;
const HUGE: usize = usize::MAX;
/// Huge, yet its square and its sums with small sizes overflow only in products.
const BIG: usize = 1 << 40;

/// The bits of an f32 tensor.
fn bits(t: &Tensor) -> Vec<u32> {
    let v = t.flatten_all().and_then(|t| t.to_vec1::<f32>()).unwrap();
    v.into_iter().map(f32::to_bits).collect()
}

/// Everything a contiguous cache holds: its keys and values bit for bit, and its lengths.
fn flat_state(c: &KvCache) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    (bits(c.k()), bits(c.v()), c.lengths().to_vec())
}

/// Everything a paged cache holds, its block table and free page count too.
fn paged_state(c: &PagedKvCache) -> (Vec<u32>, Vec<u32>, Vec<u32>, Vec<u32>, usize) {
    let table = c.block_table().to_vec();
    (
        bits(c.k()),
        bits(c.v()),
        c.lengths().to_vec(),
        table,
        c.free_pages(),
    )
}

/// Calls made and the panics seen.
#[derive(Default)]
struct Sweep {
    calls: usize,
    panics: Vec<String>,
}

impl Sweep {
    /// Runs `f`, recording a panic under `what`; the result if it returned `Ok`.
    fn call<T>(&mut self, what: impl Display, f: impl FnOnce() -> Result<T>) -> Option<T> {
        self.calls += 1;
        // An allocation failure aborts the process, past catch_unwind: this names the call.
        if std::env::var_os("CANDLE_FLASH_SWEEP_TRACE").is_some() {
            eprintln!("sweep: {what}");
        }
        match catch_unwind(AssertUnwindSafe(f)) {
            Ok(Ok(v)) => Some(v),
            Ok(Err(_)) => None,
            Err(payload) => {
                let msg = payload
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                self.panics.push(format!("{what}: {msg}"));
                None
            }
        }
    }

    /// Records a wrong result (an `Ok` that the oracle contradicts).
    fn wrong(&mut self, what: impl Display) {
        self.panics.push(format!("wrong result: {what}"));
    }

    fn finish(self, name: &str) {
        println!("{name}: {} calls, {} panics", self.calls, self.panics.len());
        assert!(
            self.panics.is_empty(),
            "{name}: {} of {} calls panicked or were wrong:\n{}",
            self.panics.len(),
            self.calls,
            self.panics.join("\n")
        );
    }
}

/// A random tensor of `shape` and `dtype` (integers: small non-negative values).
fn t(shape: &[usize], dtype: DType) -> Tensor {
    let x = Tensor::randn(0f32, 1.0, shape, &CPU).unwrap();
    match dtype {
        DType::U8 | DType::U32 | DType::I64 => x.abs().unwrap().to_dtype(dtype).unwrap(),
        d => x.to_dtype(d).unwrap(),
    }
}

fn f(shape: &[usize]) -> Tensor {
    t(shape, DType::F32)
}

/// The pool of q/k/v-like tensors: sound ones and every kind of wrong one.
fn pool() -> Vec<(&'static str, Tensor)> {
    let std = f(&[2, 5, 4, 8]);
    vec![
        ("std (2,5,4,8)", std.clone()),
        ("kv (2,7,2,8)", f(&[2, 7, 2, 8])),
        ("mqa kv (2,3,1,8)", f(&[2, 3, 1, 8])),
        ("(1,1,1,1)", f(&[1, 1, 1, 1])),
        ("b0 (0,5,4,8)", f(&[0, 5, 4, 8])),
        ("s0 (2,0,4,8)", f(&[2, 0, 4, 8])),
        ("h0 (2,5,0,8)", f(&[2, 5, 0, 8])),
        ("d0 (2,5,4,0)", f(&[2, 5, 4, 0])),
        ("d257 (1,2,1,257)", f(&[1, 2, 1, 257])),
        ("d3 (2,5,4,3)", f(&[2, 5, 4, 3])),
        ("f16", t(&[2, 5, 4, 8], DType::F16)),
        ("bf16", t(&[2, 5, 4, 8], DType::BF16)),
        ("f64", t(&[2, 5, 4, 8], DType::F64)),
        ("u8", t(&[2, 5, 4, 8], DType::U8)),
        ("u32", t(&[2, 5, 4, 8], DType::U32)),
        ("i64", t(&[2, 5, 4, 8], DType::I64)),
        ("nan", (f(&[2, 5, 4, 8]) * f64::NAN).unwrap()),
        ("inf", (f(&[2, 5, 4, 8]) * f64::INFINITY).unwrap()),
        ("1e30", (f(&[2, 5, 4, 8]) * 1e30).unwrap()),
        (
            "last dim strided",
            f(&[2, 5, 8, 4]).transpose(2, 3).unwrap(),
        ),
        (
            "heads transposed",
            f(&[2, 4, 5, 8]).transpose(1, 2).unwrap(),
        ),
        ("narrowed", f(&[2, 9, 4, 8]).narrow(1, 3, 5).unwrap()),
        ("rank 3 (5,4,8)", f(&[5, 4, 8])),
        ("rank 3 (10,2,8)", f(&[10, 2, 8])),
        ("rank 5", f(&[1, 2, 5, 4, 8])),
        ("rank 0", Tensor::new(1f32, &CPU).unwrap()),
        (
            "broadcast",
            Tensor::new(1f32, &CPU)
                .unwrap()
                .broadcast_as((2, 5, 4, 8))
                .unwrap(),
        ),
    ]
}

/// Adversarial options, each paired with a description.
fn options(rng: &mut StdRng) -> Vec<(String, FlashAttn)> {
    let mut out = vec![("default".to_string(), FlashAttn::new())];
    for s in [0.0, -1.0, f32::NAN, f32::INFINITY, 1e30, f32::MIN_POSITIVE] {
        out.push((format!("scale {s}"), FlashAttn::new().softmax_scale(s)));
    }
    for (l, r) in [
        (i64::MIN, i64::MIN),
        (-2, -1),
        (i64::MAX, 0),
        (0, i64::MAX),
        (0, 0),
        (-1, i64::MAX),
    ] {
        for causal in [false, true] {
            out.push((
                format!("window ({l}, {r}) causal {causal}"),
                FlashAttn::new().window_size(l, r).causal(causal),
            ));
        }
    }
    out.push((
        "window usize::MAX".into(),
        FlashAttn::new().window(Some(HUGE), Some(HUGE)),
    ));
    for c in [f32::NAN, -1.0, f32::INFINITY, 1e-30, f32::MAX] {
        out.push((format!("softcap {c}"), FlashAttn::new().softcap(c)));
    }
    for p in [f32::NAN, -0.1, 1.0, 1.5, 0.999_999, 1e-9, 0.5] {
        let opts = FlashAttn::new().dropout(p).seed(rng.random());
        out.push((format!("dropout {p}"), opts.clone()));
        out.push((format!("dropout {p} offset MAX"), opts.rng_offset(u64::MAX)));
    }
    for (name, slopes) in [
        ("(4)", f(&[4])),
        ("(2,4)", f(&[2, 4])),
        ("(3)", f(&[3])),
        ("(0)", f(&[0])),
        ("f16 (4)", t(&[4], DType::F16)),
        ("nan (4)", (f(&[4]) * f64::NAN).unwrap()),
        ("(2,2,4)", f(&[2, 2, 4])),
    ] {
        out.push((
            format!("alibi {name}"),
            FlashAttn::new().alibi_slopes(&slopes),
        ));
    }
    for (name, sinks) in [
        ("(4)", f(&[4])),
        ("(3)", f(&[3])),
        ("(2,4)", f(&[2, 4])),
        ("bf16 (4)", t(&[4], DType::BF16)),
        ("u32 (4)", t(&[4], DType::U32)),
        (
            "-inf (4)",
            (f(&[4]).ones_like().unwrap() * f64::NEG_INFINITY).unwrap(),
        ),
        ("nan (4)", (f(&[4]) * f64::NAN).unwrap()),
    ] {
        out.push((format!("sinks {name}"), FlashAttn::new().sinks(&sinks)));
    }
    for (name, mask) in block_masks() {
        out.push((
            format!("block mask {name}"),
            FlashAttn::new().block_mask(&mask),
        ));
    }
    out.push(("deterministic".into(), FlashAttn::new().deterministic(true)));
    out
}

/// Block masks that construct: sound ones and ones of the wrong geometry for most calls.
fn block_masks() -> Vec<(String, BlockMask)> {
    let mut out = Vec::new();
    let masks = [
        ("u8 (1,1)", t(&[1, 1], DType::U8).ones_like().unwrap()),
        ("u8 (4,1,1)", t(&[4, 1, 1], DType::U8).ones_like().unwrap()),
        (
            "u8 (2,3) zeros",
            t(&[2, 3], DType::U8).zeros_like().unwrap(),
        ),
    ];
    for (name, m) in masks {
        if let Ok(b) = BlockMask::new(&m, 64, 64) {
            out.push((name.to_string(), b));
        }
    }
    if let Ok(b) = BlockMask::local_global(5, 7, 64, 1, 1, &CPU) {
        out.push(("local_global".into(), b));
    }
    out
}

/// Runs one attention call through every path that takes (q, k, v) and the options, and
/// checks an `Ok` forward against the oracle where the oracle accepts the call.
fn attention_calls(s: &mut Sweep, what: &str, q: &Tensor, k: &Tensor, v: &Tensor, o: &FlashAttn) {
    let out = s.call(format!("forward {what}"), || o.forward(q, k, v));
    s.call(format!("flash_attn {what}"), || {
        flash_attn(q, k, v, o.causal)
    });
    let lse = s.call(format!("forward_with_lse {what}"), || {
        o.forward_with_lse(q, k, v)
    });
    if let Some((out, lse)) = &lse {
        for (gname, g) in [
            ("out", out.clone()),
            ("q", q.clone()),
            ("nan", (out * f64::NAN).unwrap()),
        ] {
            s.call(format!("backward {what} grad {gname}"), || {
                o.backward(q, k, v, out, lse, &g)
            });
            s.call(format!("backward_sinks {what} grad {gname}"), || {
                o.backward_sinks(out, lse, &g)
            });
        }
        s.call(format!("backward {what} lse of q"), || {
            o.backward(q, k, v, out, q, out)
        });
    }
    s.call(format!("autograd {what}"), || {
        let (qv, kv, vv) = (
            Var::from_tensor(q)?,
            Var::from_tensor(k)?,
            Var::from_tensor(v)?,
        );
        o.forward(&qv, &kv, &vv)?.sum_all()?.backward().map(drop)
    });
    let slow = s.call(format!("attention_slow_with {what}"), || {
        attention_slow_with(q, k, v, o)
    });
    s.call(format!("attention_slow {what}"), || {
        attention_slow(q, k, v, o.softmax_scale.unwrap_or(0.125), o.causal)
    });
    if let (Some(out), Some(slow)) = (out, slow) {
        let finite = |x: &Tensor| -> bool {
            x.to_dtype(DType::F32)
                .and_then(|x| x.abs()?.max_all().map(|m| m.to_scalar::<f32>()))
                .and_then(|m| m)
                .map_or(true, |m| m.is_finite() && m < 1e6)
        };
        if finite(q) && finite(k) && finite(v) && o.dropout_p == 0.0 {
            // NaN where both are NaN (NaN slopes, say) agrees; NaN on one side only does not.
            let err = s.call(format!("compare {what}"), || {
                let a = out.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                let b = slow.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                Ok(a.iter()
                    .zip(&b)
                    .fold(0f32, |m, (x, y)| match (x.is_nan(), y.is_nan()) {
                        (true, true) => m,
                        (false, false) => m.max((x - y).abs()),
                        _ => f32::INFINITY,
                    }))
            });
            let tol = if q.dtype() == DType::F32 { 1e-4 } else { 5e-2 };
            if err.is_some_and(|e| e.is_nan() || e > tol) && out.elem_count() > 0 {
                s.wrong(format!(
                    "{what}: max error {err:?} against attention_slow_with"
                ));
            }
        }
    }
}

/// Random q, k, v from the pool under random adversarial options.
#[test]
fn attention_entry_points_never_panic() {
    let mut rng = StdRng::seed_from_u64(0x5eed);
    let pool = pool();
    let opts = options(&mut rng);
    let mut s = Sweep::default();
    // Every option on the sound shapes, then random triples.
    let (q, k) = (&pool[0].1, &pool[1].1);
    for (oname, o) in &opts {
        attention_calls(&mut s, &format!("std/gqa, {oname}"), q, k, k, o);
        attention_calls(&mut s, &format!("std/std, {oname}"), q, q, q, o);
    }
    for _ in 0..1500 {
        let [a, b, c] = [0; 3].map(|_| rng.random_range(0..pool.len()));
        // Mostly sound k = v pairs, so that the calls reach past the shape checks.
        let c = if rng.random_bool(0.7) { b } else { c };
        let (oname, o) = &opts[rng.random_range(0..opts.len())];
        let what = format!("q {}, k {}, v {}, {oname}", pool[a].0, pool[b].0, pool[c].0);
        attention_calls(&mut s, &what, &pool[a].1, &pool[b].1, &pool[c].1, o);
    }
    // attention_slow_dropout's keep mask and probability.
    for keep in [f(&[2, 4, 5, 5]), f(&[2, 4, 5]), f(&[0]), f(&[2, 4, 5, 6])] {
        for p in [0.0, 0.5, 1.0, f32::NAN, -1.0] {
            s.call(
                format!("attention_slow_dropout keep {:?} p {p}", keep.dims()),
                || attention_slow_dropout(q, q, q, 0.1, false, &keep, p),
            );
        }
    }
    // combine: every pool tensor as a part's output, beside LSEs of every kind.
    let lses = [
        ("lse (2,4,5)", f(&[2, 4, 5])),
        ("lse (2,5,4)", f(&[2, 5, 4])),
        ("lse (0)", f(&[0])),
        ("lse f16", t(&[2, 4, 5], DType::F16)),
        (
            "lse -inf",
            Tensor::full(f32::NEG_INFINITY, (2, 4, 5), &CPU).unwrap(),
        ),
        ("lse nan", Tensor::full(f32::NAN, (2, 4, 5), &CPU).unwrap()),
    ];
    for (oname, o) in &pool {
        for (lname, lse) in &lses {
            for n in 1..=3 {
                s.call(format!("combine {n} x ({oname}, {lname})"), || {
                    combine(&vec![(o.clone(), lse.clone()); n])
                });
            }
        }
    }
    s.finish("attention");
}

/// Variable-length descriptions with overflowing sums, unsorted offsets, wrong tensors; then
/// forward_varlen on the pool's rank-3 tensors.
#[test]
fn varlen_and_padding_never_panic() {
    let mut s = Sweep::default();
    let lens: [&[usize]; 9] = [
        &[],
        &[0],
        &[HUGE],
        &[HUGE, 1],
        &[u32::MAX as usize + 1],
        &[u32::MAX as usize, u32::MAX as usize],
        &[3, 2],
        &[5],
        &[BIG, BIG],
    ];
    let mut varlens = Vec::new();
    for a in lens {
        for b in lens {
            if let Some(v) = s.call(format!("from_seqlens {a:?} {b:?}"), || {
                VarLen::from_seqlens(a, b)
            }) {
                varlens.push((format!("seqlens {a:?} {b:?}"), v));
            }
        }
    }
    let cus: [&[u32]; 7] = [
        &[],
        &[0],
        &[1, 2],
        &[0, 5, 3],
        &[0, u32::MAX],
        &[0, 3, 5],
        &[0, 5],
    ];
    for a in cus {
        for b in cus {
            if let Some(v) = s.call(format!("from_cu_seqlens {a:?} {b:?}"), || {
                VarLen::from_cu_seqlens(a, b)
            }) {
                varlens.push((format!("cu {a:?} {b:?}"), v));
            }
        }
    }
    for (name, x) in [
        ("u32 [0,3,5]", Tensor::new(&[0u32, 3, 5], &CPU).unwrap()),
        ("i64 [0,3,5]", Tensor::new(&[0i64, 3, 5], &CPU).unwrap()),
        ("f32 [0,3,5]", Tensor::new(&[0f32, 3., 5.], &CPU).unwrap()),
        ("u32 (1,3)", Tensor::new(&[[0u32, 3, 5]], &CPU).unwrap()),
        ("u32 []", Tensor::new(&[0u32; 0], &CPU).unwrap()),
        ("u32 [5,0]", Tensor::new(&[5u32, 0], &CPU).unwrap()),
    ] {
        s.call(format!("from_tensors {name}"), || {
            VarLen::from_tensors(&x, &x)
        });
    }
    let pads: Vec<(String, Padding)> = [
        (vec![3usize, 2], 5usize),
        (vec![6], 5),
        (vec![HUGE], 5),
        (vec![1], HUGE),
        (vec![BIG; 3], BIG),
        (vec![], 5),
        (vec![0, 0], 0),
    ]
    .into_iter()
    .filter_map(|(l, n)| {
        s.call(format!("from_lengths {l:?} {n}"), || {
            Padding::from_lengths(&l, n)
        })
        .map(|p| (format!("lengths {l:?} seqlen {n}"), p))
    })
    .collect();
    for (name, m) in [
        (
            "prefix",
            Tensor::new(&[[1u8, 1, 1, 0, 0], [1, 1, 0, 0, 0]], &CPU).unwrap(),
        ),
        (
            "holes",
            Tensor::new(&[[1u8, 0, 1, 0, 0], [0, 1, 0, 0, 0]], &CPU).unwrap(),
        ),
        (
            "twos",
            Tensor::new(&[[2u8, 2, 2, 2, 2], [1, 1, 0, 0, 0]], &CPU).unwrap(),
        ),
        ("f32 nan", (f(&[2, 5]) * f64::NAN).unwrap()),
        ("rank 1", Tensor::new(&[1u8, 1], &CPU).unwrap()),
        ("rank 3", t(&[1, 2, 5], DType::U8)),
        ("(0,5)", t(&[0, 5], DType::U8)),
        ("(2,0)", t(&[2, 0], DType::U8)),
    ] {
        s.call(format!("from_mask {name}"), || Padding::from_mask(&m));
    }
    let pool = pool();
    for (pname, p) in &pads {
        for (xname, x) in &pool {
            s.call(format!("unpad {pname} {xname}"), || p.unpad(x));
            s.call(format!("pad {pname} {xname}"), || p.pad(x));
        }
        for (p2name, p2) in &pads {
            s.call(format!("from_padding {pname} {p2name}"), || {
                VarLen::from_padding(p, p2)
            });
            let (q, k) = (&pool[0].1, &pool[1].1);
            s.call(format!("forward_padded {pname} {p2name}"), || {
                FlashAttn::new().forward_padded(q, k, k, p, p2)
            });
        }
    }
    let rank3: Vec<&(&str, Tensor)> = pool.iter().filter(|(_, x)| x.rank() == 3).collect();
    for (vname, v) in &varlens {
        for (qn, q) in &rank3 {
            for (kn, k) in &rank3 {
                for opts in [FlashAttn::new(), FlashAttn::new().causal(true).dropout(0.3)] {
                    s.call(format!("forward_varlen {vname} q {qn} k {kn}"), || {
                        opts.forward_varlen(q, k, k, v)
                    });
                }
            }
        }
    }
    s.finish("varlen/padding");
}

/// Block masks of every geometry, the dropout mask at sizes past memory.
#[test]
fn block_masks_and_dropout_masks_never_panic() {
    let mut s = Sweep::default();
    let sizes = [0usize, 1, 63, 64, 65, 128, BIG, HUGE];
    for (name, m) in [
        ("u8 (2,2)", t(&[2, 2], DType::U8)),
        ("u8 (2,2,2)", t(&[2, 2, 2], DType::U8)),
        ("u8 (0,2)", t(&[0, 2], DType::U8)),
        ("f32 (2,2)", f(&[2, 2])),
        ("u8 (2)", t(&[2], DType::U8)),
        ("u8 (1,2,2,2)", t(&[1, 2, 2, 2], DType::U8)),
        (
            "u8 threes",
            (t(&[2, 2], DType::U8).ones_like().unwrap() * 3.).unwrap(),
        ),
    ] {
        for &bq in &sizes {
            for &bk in &[64usize, 0, HUGE] {
                if let Some(b) = s.call(format!("BlockMask::new {name} {bq} {bk}"), || {
                    BlockMask::new(&m, bq, bk)
                }) {
                    for (sq, sk) in [(5, 7), (0, 0), (BIG, BIG), (HUGE, 1)] {
                        s.call(format!("to_dense {name} {bq} {bk} ({sq}, {sk})"), || {
                            b.to_dense(sq, sk)
                        });
                    }
                    s.call(format!("density {name}"), || b.density());
                }
                s.call(format!("from_dense {name} {bq} {bk}"), || {
                    BlockMask::from_dense(&m, bq, bk)
                });
            }
        }
    }
    for &n in &sizes {
        for &block in &[0usize, 64, HUGE] {
            for &w in &[0usize, 1, HUGE] {
                s.call(format!("local_global {n} {block} {w}"), || {
                    BlockMask::local_global(n, n, block, w, w, &CPU)
                });
                s.call(format!("strided {n} {block} {w}"), || {
                    BlockMask::strided(n, n, block, w, &CPU)
                });
            }
            s.call(format!("butterfly {n} {block}"), || {
                BlockMask::butterfly(n, n, block, &CPU)
            });
        }
    }
    for p in [f32::NAN, -0.5, 1.0, 0.5] {
        for dims in [
            [2, 2, 3, 3],
            [0, 2, 3, 3],
            [1 << 20; 4],
            [HUGE, 2, 1, 1],
            [BIG, BIG, 1, 1],
        ] {
            s.call(format!("dropout_mask p {p} {dims:?}"), || {
                dropout_mask(p, 1, u64::MAX, dims[0], dims[1], dims[2], dims[3])
            });
        }
    }
    s.finish("masks");
}

/// Caches of absurd sizes, lengths and block tables; appends and decoding with the pool.
#[test]
fn kv_cache_entry_points_never_panic() {
    let mut s = Sweep::default();
    let sizes = [0usize, 1, 8, BIG, HUGE];
    for &a in &sizes {
        for &b in &sizes {
            s.call(format!("KvCache::new {a} {b}"), || {
                KvCache::new(a, b, 2, 8, DType::F32, &CPU)
            });
            s.call(format!("KvCache::new heads {a} dim {b}"), || {
                KvCache::new(2, 8, a, b, DType::F32, &CPU)
            });
            s.call(format!("PagedKvCache::new {a} {b}"), || {
                PagedKvCache::new(2, a, b, 4, 2, 8, DType::F32, &CPU)
            });
            s.call(format!("PagedKvCache::new max_pages {a} {b}"), || {
                PagedKvCache::new(a, 8, 4, b, 2, 8, DType::F32, &CPU)
            });
        }
    }
    for dtype in [DType::U8, DType::F64, DType::I64] {
        s.call(format!("KvCache::new {dtype:?}"), || {
            KvCache::new(2, 8, 2, 8, dtype, &CPU)
        });
    }
    let pool = pool();
    let opts = [
        FlashAttn::new(),
        FlashAttn::new().causal(true).window(Some(HUGE), Some(0)),
        FlashAttn::new().dropout(0.5),
        FlashAttn::new().softmax_scale(f32::NAN),
    ];
    // Caches holding 3 and 2 tokens of random rows; every failed call must leave them (rows
    // past the lengths included) bit for bit as they were.
    let prefill = (f(&[5, 2, 8]), f(&[5, 2, 8]));
    let fresh = || -> (KvCache, PagedKvCache) {
        let mut cache = KvCache::new(2, 8, 2, 8, DType::F32, &CPU).unwrap();
        let mut paged = PagedKvCache::new(2, 4, 4, 2, 2, 8, DType::F32, &CPU).unwrap();
        cache
            .append_varlen(&prefill.0, &prefill.1, &[3, 2])
            .unwrap();
        paged
            .append_varlen(&prefill.0, &prefill.1, &[3, 2])
            .unwrap();
        (cache, paged)
    };
    for (qn, q) in &pool {
        for (kn, k) in pool.iter().step_by(3) {
            for o in &opts {
                let (mut cache, mut paged) = fresh();
                let what = format!("KvCache append_and_attend q {qn} k {kn}");
                let before = flat_state(&cache);
                if s.call(&what, || cache.append_and_attend(q, k, k, o))
                    .is_none()
                    && flat_state(&cache) != before
                {
                    s.wrong(format!("{what}: failed, yet the cache changed"));
                }
                let what = format!("PagedKvCache append_and_attend q {qn} k {kn}");
                let before = paged_state(&paged);
                if s.call(&what, || paged.append_and_attend(q, k, k, o))
                    .is_none()
                    && paged_state(&paged) != before
                {
                    s.wrong(format!("{what}: failed, yet the cache changed"));
                }
            }
            if k.rank() == 3 {
                for lens in [&[3usize, 2][..], &[HUGE, 1], &[1, HUGE], &[5], &[]] {
                    let (mut cache, mut paged) = fresh();
                    let what = format!("append_varlen {kn} {lens:?}");
                    let before = flat_state(&cache);
                    if s.call(&what, || cache.append_varlen(k, k, lens)).is_none()
                        && flat_state(&cache) != before
                    {
                        s.wrong(format!("{what}: failed, yet the cache changed"));
                    }
                    let what = format!("paged append_varlen {kn} {lens:?}");
                    let before = paged_state(&paged);
                    if s.call(&what, || paged.append_varlen(k, k, lens)).is_none()
                        && paged_state(&paged) != before
                    {
                        s.wrong(format!("{what}: failed, yet the cache changed"));
                    }
                }
            }
        }
    }
    let (mut cache, mut paged) = fresh();
    for b in [0, 2, HUGE] {
        s.call(format!("reset_sequence {b}"), || cache.reset_sequence(b));
        s.call(format!("paged reset_sequence {b}"), || {
            paged.reset_sequence(b)
        });
    }
    let (q, kc, vc) = (f(&[2, 1, 4, 8]), f(&[2, 8, 2, 8]), f(&[2, 8, 2, 8]));
    let new = f(&[2, 1, 2, 8]);
    for (qn, q) in [("q", &q), ("bad q", &pool[0].1)] {
        for lens in [&[0u32, 0][..], &[u32::MAX, 0], &[8, 8], &[7, 7], &[1], &[]] {
            for new_kv in [None, Some((&new, &new)), Some((&new, &pool[2].1))] {
                let what = format!("flash_attn_with_kvcache {qn} {lens:?} new {new_kv:?}");
                let before = (bits(&kc), bits(&vc));
                let r = s.call(&what, || {
                    flash_attn_with_kvcache(q, &kc, &vc, new_kv, lens, &FlashAttn::new())
                });
                if r.is_none() && (bits(&kc), bits(&vc)) != before {
                    s.wrong(format!("{what}: failed, yet the cache changed"));
                }
            }
        }
    }
    let (kp, vp) = (f(&[4, 4, 2, 8]), f(&[4, 4, 2, 8]));
    for (table, max_pages) in [
        (vec![0u32, 1, 2, 3], 2usize),
        (vec![u32::MAX, 1, 2, 3], 2),
        (vec![0, 0, 0, 0], 2),
        (vec![], 0),
        (vec![], HUGE),
        (vec![0, 1], (1 << 63) + 1),
        (vec![0; 4], BIG),
    ] {
        for lens in [&[0u32, 0][..], &[u32::MAX, 0], &[8, 8], &[7, 3]] {
            for new_kv in [None, Some((&new, &new))] {
                let what = format!("paged {table:?} {max_pages} {lens:?}");
                let before = (bits(&kp), bits(&vp));
                let r = s.call(&what, || {
                    flash_attn_with_paged_kvcache(
                        &q,
                        &kp,
                        &vp,
                        new_kv,
                        lens,
                        &table,
                        max_pages,
                        &FlashAttn::new(),
                    )
                });
                if r.is_none() && (bits(&kp), bits(&vp)) != before {
                    s.wrong(format!("{what}: failed, yet the pages changed"));
                }
            }
        }
    }
    s.finish("kvcache");
}

/// FP8 caches (scales of every wrong kind, appends and decoding with the pool) and the
/// quantization helpers over the pool, with every scaling and scales of the wrong shape.
#[test]
fn fp8_and_quant_entry_points_never_panic() {
    let mut s = Sweep::default();
    let scale_pool = [
        ("(2)", f(&[2])),
        ("(1)", f(&[1])),
        ("(0)", f(&[0])),
        ("(2,1)", f(&[2, 1])),
        ("f16 (2)", t(&[2], DType::F16)),
        ("u32 (2)", t(&[2], DType::U32)),
        ("nan (2)", (f(&[2]) * f64::NAN).unwrap()),
        ("zeros (2)", f(&[2]).zeros_like().unwrap()),
        ("rank 0", Tensor::new(1f32, &CPU).unwrap()),
    ];
    for &a in &[0usize, 1, 8, BIG, HUGE] {
        s.call(format!("KvCache::new F8E4M3 {a}"), || {
            KvCache::new(2, a, 2, 8, DType::F8E4M3, &CPU)
        });
        s.call(format!("PagedKvCache::new F8E4M3 {a}"), || {
            PagedKvCache::new(2, a, 4, 2, 2, 8, DType::F8E4M3, &CPU)
        });
    }
    let pool = pool();
    for (sn, sc) in &scale_pool {
        for (s2n, sc2) in [&scale_pool[0], &scale_pool[3], &scale_pool[6]].map(|p| (&p.0, &p.1)) {
            let Some(mut cache) = s.call(format!("with_scales {sn} {s2n}"), || {
                KvCache::new(2, 8, 2, 8, DType::F8E4M3, &CPU)?.with_scales(sc.clone(), sc2.clone())
            }) else {
                continue;
            };
            let mut paged = PagedKvCache::new(2, 4, 4, 2, 2, 8, DType::F8E4M3, &CPU)
                .and_then(|p| p.with_scales(sc.clone(), sc2.clone()))
                .unwrap();
            for (qn, q) in pool.iter().step_by(2) {
                for (kn, k) in pool.iter().step_by(5) {
                    let what = format!("fp8 KvCache {sn} q {qn} k {kn}");
                    let before = (fp8_bytes(cache.k()), fp8_bytes(cache.v()));
                    let r = s.call(&what, || {
                        cache.append_and_attend(q, k, k, &FlashAttn::new())
                    });
                    if r.is_none() && (fp8_bytes(cache.k()), fp8_bytes(cache.v())) != before {
                        s.wrong(format!("{what}: failed, yet the cache changed"));
                    }
                    s.call(format!("fp8 PagedKvCache {sn} q {qn} k {kn}"), || {
                        paged.append_and_attend(q, k, k, &FlashAttn::new())
                    });
                }
                if q.rank() == 3 {
                    s.call(format!("fp8 append_varlen {sn} {qn}"), || {
                        cache.append_varlen(q, q, &[2, 3])
                    });
                }
            }
            cache.reset();
            paged.reset();
        }
        let (q, kv) = (f(&[2, 1, 4, 8]), f(&[2, 1, 2, 8]));
        let (k8, v8) = (
            t(&[2, 8, 2, 8], DType::F8E4M3),
            t(&[2, 8, 2, 8], DType::F8E4M3),
        );
        for (cn, kc, vc) in [("fp8", &k8, &v8), ("mixed", &k8, &pool[1].1)] {
            for lens in [&[0u32, 0][..], &[u32::MAX, 0], &[7, 7], &[1]] {
                let opts = FlashAttn::new().kv_cache_scales(sc, &scale_pool[0].1);
                let what = format!("flash_attn_with_kvcache {cn} scales {sn} {lens:?}");
                let before = (fp8_bytes(kc), fp8_bytes(&k8));
                let r = s.call(&what, || {
                    flash_attn_with_kvcache(&q, kc, vc, Some((&kv, &kv)), lens, &opts)
                });
                if r.is_none() && (fp8_bytes(kc), fp8_bytes(&k8)) != before {
                    s.wrong(format!("{what}: failed, yet the cache changed"));
                }
                s.call(format!("forward with kv_cache_scales {sn}"), || {
                    opts.forward(&q, &q, &q)
                });
            }
        }
    }
    let scalings = [
        Fp8Scaling::PerTensor,
        Fp8Scaling::PerHead,
        Fp8Scaling::PerBlock { rows: 0 },
        Fp8Scaling::PerBlock { rows: 1 },
        Fp8Scaling::PerBlock { rows: 3 },
        Fp8Scaling::PerBlock { rows: BIG },
        Fp8Scaling::PerBlock { rows: HUGE },
    ];
    for (xn, x) in &pool {
        for &scaling in &scalings {
            let what = format!("fp8_scales {xn} {scaling:?}");
            let scales = s.call(&what, || fp8_scales(x, scaling));
            for (sn, sc) in scales
                .iter()
                .map(|t| ("own", t))
                .chain(scale_pool.iter().map(|(n, t)| (*n, t)))
            {
                let what = format!("quantize_fp8 {xn} {scaling:?} scales {sn}");
                if let Some(q8) = s.call(&what, || quantize_fp8(x, sc, scaling)) {
                    for dtype in [DType::F32, DType::BF16, DType::U8] {
                        s.call(format!("dequantize_fp8 {what} {dtype:?}"), || {
                            dequantize_fp8(&q8, sc, scaling, dtype)
                        });
                    }
                }
                s.call(format!("dequantize_fp8 of {xn} {scaling:?} {sn}"), || {
                    dequantize_fp8(x, sc, scaling, DType::F32)
                });
            }
        }
    }
    s.finish("fp8");
}

/// The real values of an FP8 input `(.., heads, d)` under `descale` (`None`: 1), in f32:
/// the stored values times their head's factor. `None` where the descale does not fit.
fn dequantized(x8: &Tensor, descale: Option<&Tensor>) -> Option<Tensor> {
    let x = x8.to_dtype(DType::F32).ok()?;
    let Some(ds) = descale else { return Some(x) };
    let heads = x.dims().get(x.rank().checked_sub(2)?).copied()?;
    let n = ds.elem_count();
    let mut shape = vec![1; x.rank()];
    if n == heads {
        shape[x.rank() - 2] = heads;
    } else if n != 1 {
        return None;
    }
    x.broadcast_mul(&ds.reshape(shape).ok()?).ok()
}

/// FP8 attention: the pool in F8E4M3 (beside tensors of other dtypes) under descales and
/// output dtypes of every wrong kind and the options FP8 refuses, through every entry point
/// (forward, LSE, varlen, padded, backward, autograd); `Ok` forwards are checked against
/// f32 attention of the dequantized inputs. Then `quant::hadamard` over the pool.
#[test]
fn fp8_attention_and_hadamard_never_panic() {
    let mut rng = StdRng::seed_from_u64(0xf8);
    let mut s = Sweep::default();
    let pool = pool();
    let mut inputs: Vec<(String, Tensor)> = pool
        .iter()
        .filter_map(|(n, x)| {
            let x8 = s.call(format!("to F8E4M3 {n}"), || x.to_dtype(DType::F8E4M3))?;
            Some((format!("fp8 {n}"), x8))
        })
        .collect();
    let fp8_count = inputs.len();
    inputs.extend(
        pool.iter()
            .step_by(3)
            .map(|(n, x)| (n.to_string(), x.clone())),
    );
    let descales = [
        ("(1)", f(&[1]).abs().unwrap()),
        ("(4)", f(&[4]).abs().unwrap()),
        ("(2)", f(&[2]).abs().unwrap()),
        ("(3)", f(&[3])),
        ("(0)", f(&[0])),
        ("rank 0", Tensor::new(0.5f32, &CPU).unwrap()),
        ("(1,4)", f(&[1, 4])),
        ("f16 (1)", t(&[1], DType::F16)),
        ("u32 (4)", t(&[4], DType::U32)),
        ("nan (1)", (f(&[1]) * f64::NAN).unwrap()),
        (
            "inf (4)",
            (f(&[4]).ones_like().unwrap() * f64::INFINITY).unwrap(),
        ),
        ("zeros (2)", f(&[2]).zeros_like().unwrap()),
        // Per block of 128 rows: (batch, heads, blocks), right for some inputs, not others.
        ("(1,4,1)", f(&[1, 4, 1]).abs().unwrap()),
        ("(2,2,1)", f(&[2, 2, 1]).abs().unwrap()),
        ("(2,4,3)", f(&[2, 4, 3]).abs().unwrap()),
        ("(0,4,1)", f(&[0, 4, 1])),
    ];
    let mut opts: Vec<(String, FlashAttn)> = vec![("default".into(), FlashAttn::new())];
    for (n, d) in &descales {
        for (n2, d2) in [&descales[0], &descales[2], &descales[4]].map(|p| (&p.0, &p.1)) {
            for causal in [false, true] {
                opts.push((
                    format!("descales q {n} kv {n2} causal {causal}"),
                    FlashAttn::new().causal(causal).fp8_descales(d, d2, d2),
                ));
            }
        }
    }
    for dt in [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::F64,
        DType::U8,
        DType::F8E4M3,
    ] {
        opts.push((format!("out_dtype {dt:?}"), FlashAttn::new().out_dtype(dt)));
    }
    opts.extend(options(&mut rng));
    let varlens: Vec<(String, VarLen)> = [
        (&[3usize, 2][..], &[5usize, 5][..]),
        (&[5], &[7]),
        (&[0, 5], &[10, 0]),
    ]
    .iter()
    .filter_map(|(a, b)| Some((format!("{a:?} {b:?}"), VarLen::from_seqlens(a, b).ok()?)))
    .collect();
    let pad = Padding::from_lengths(&[5, 2], 5).unwrap();
    let calls = |s: &mut Sweep, what: &str, q: &Tensor, k: &Tensor, v: &Tensor, o: &FlashAttn| {
        let out = s.call(format!("fp8 forward {what}"), || o.forward(q, k, v));
        if let Some((out, lse)) = s.call(format!("fp8 forward_with_lse {what}"), || {
            o.forward_with_lse(q, k, v)
        }) {
            s.call(format!("fp8 backward {what}"), || {
                o.backward(q, k, v, &out, &lse, &out)
            });
        }
        s.call(format!("fp8 autograd {what}"), || {
            let qv = Var::from_tensor(q)?;
            o.forward(&qv, k, v)?
                .to_dtype(DType::F32)?
                .sum_all()?
                .backward()
                .map(drop)
        });
        s.call(format!("fp8 forward_padded {what}"), || {
            o.forward_padded(q, k, v, &pad, &pad)
        });
        for (vn, varlen) in &varlens {
            s.call(format!("fp8 forward_varlen {vn} {what}"), || {
                o.forward_varlen(q, k, v, varlen)
            });
        }
        // An Ok forward of finite FP8 inputs against f32 attention of their real values
        // (e4m3 keeps P to 2^-4 relative: a tenth of max |v| is ample).
        let Some(out) = out else { return };
        let plain = o.fp8_descales.is_none()
            || o.fp8_descales.as_ref().is_some_and(|d| {
                [&d.q, &d.k, &d.v].iter().all(|t| {
                    t.to_vec1::<f32>()
                        .is_ok_and(|v| v.iter().all(|x| x.is_finite()))
                })
            });
        if !plain || o.dropout_p != 0.0 {
            return;
        }
        let ds = o.fp8_descales.as_ref();
        let (Some(qr), Some(kr), Some(vr)) = (
            dequantized(q, ds.map(|d| &d.q)),
            dequantized(k, ds.map(|d| &d.k)),
            dequantized(v, ds.map(|d| &d.v)),
        ) else {
            return;
        };
        let finite = |x: &Tensor| {
            x.abs()
                .and_then(|x| x.flatten_all()?.max(0)?.to_scalar::<f32>())
                .is_ok_and(|m| m.is_finite())
        };
        if !(finite(&qr) && finite(&kr) && finite(&vr)) || out.elem_count() == 0 {
            return;
        }
        let mut exact_opts = FlashAttn::new().causal(o.causal);
        exact_opts.softmax_scale = o.softmax_scale;
        let Some(exact) = s.call(format!("fp8 oracle {what}"), || {
            exact_opts.forward(&qr, &kr, &vr)
        }) else {
            return;
        };
        let err = s.call(format!("fp8 compare {what}"), || {
            let diff = (out.to_dtype(DType::F32)? - &exact)?.abs()?;
            let vmax = vr.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            Ok((diff.flatten_all()?.max(0)?.to_scalar::<f32>()?, vmax))
        });
        if let Some((err, vmax)) = err {
            let close = err <= 0.1 * vmax + 1e-3; // false for NaN
            if !close {
                s.wrong(format!(
                    "{what}: max error {err} against f32 attention (max |v| {vmax})"
                ));
            }
        }
    };
    let (q, k) = (&inputs[0].1, &inputs[1].1);
    for (oname, o) in &opts {
        calls(&mut s, &format!("std/gqa, {oname}"), q, k, k, o);
    }
    for _ in 0..1200 {
        let pick = |rng: &mut StdRng| {
            if rng.random_bool(0.8) {
                rng.random_range(0..fp8_count)
            } else {
                rng.random_range(0..inputs.len())
            }
        };
        let (a, b) = (pick(&mut rng), pick(&mut rng));
        let c = if rng.random_bool(0.7) {
            b
        } else {
            pick(&mut rng)
        };
        let (oname, o) = &opts[rng.random_range(0..opts.len())];
        let what = format!(
            "q {}, k {}, v {}, {oname}",
            inputs[a].0, inputs[b].0, inputs[c].0
        );
        calls(&mut s, &what, &inputs[a].1, &inputs[b].1, &inputs[c].1, o);
    }
    let named = pool.iter().map(|(n, x)| (n.to_string(), x));
    for (n, x) in named.chain(inputs.iter().map(|(n, x)| (n.clone(), x))) {
        s.call(format!("hadamard {n}"), || hadamard(x));
    }
    s.finish("fp8 attention");
}

/// The bytes of an F8E4M3 tensor (others: empty).
fn fp8_bytes(t: &Tensor) -> Vec<u8> {
    match t.flatten_all().and_then(|t| t.to_vec1::<float8::F8E4M3>()) {
        Ok(v) => v.into_iter().map(|x| x.to_bits()).collect(),
        Err(_) => vec![],
    }
}

/// The training ops with mismatched shapes, odd dtypes, out-of-range ids and targets, bad
/// optimizer parameters and states.
#[test]
fn train_entry_points_never_panic() {
    let mut s = Sweep::default();
    let xs = [
        ("(6,8)", f(&[6, 8])),
        ("(6,2,8)", f(&[6, 2, 8])),
        ("(0,8)", f(&[0, 8])),
        ("(6,0)", f(&[6, 0])),
        ("(6,2,7)", f(&[6, 2, 7])),
        ("u32 (6,8)", t(&[6, 8], DType::U32)),
        ("f64 (6,8)", t(&[6, 8], DType::F64)),
        ("nan (6,8)", (f(&[6, 8]) * f64::NAN).unwrap()),
        ("strided (8,6)^T", f(&[8, 6]).t().unwrap()),
        ("scalar", Tensor::new(1f32, &CPU).unwrap()),
    ];
    for (xn, x) in &xs {
        s.call(format!("infer::argmax {xn}"), || {
            candle_flash::infer::argmax(x)
        });
        for (wn, w) in &xs {
            for eps in [1e-6, 0.0, -1.0, f32::NAN, f32::INFINITY] {
                s.call(format!("rms_norm {xn} {wn} {eps}"), || {
                    train::rms_norm(x, w, eps)
                });
            }
            for (rn, r) in &xs {
                s.call(format!("add_rms_norm {xn} {rn} {wn}"), || {
                    train::add_rms_norm(x, r, w, 1e-6)
                });
            }
            s.call(format!("swiglu {xn} {wn}"), || train::swiglu(x, w));
            s.call(format!("infer::linear {xn} {wn}"), || {
                candle_flash::infer::linear(x, w, None)
            });
            s.call(format!("infer::linear add {xn} {wn}"), || {
                candle_flash::infer::linear(x, w, Some(x))
            });
            s.call(format!("infer::linear_swiglu {xn} {wn}"), || {
                candle_flash::infer::linear_swiglu(x, w)
            });
            for (gn, g) in &xs {
                s.call(format!("infer::rms_norm_linear {xn} {gn} {wn}"), || {
                    candle_flash::infer::rms_norm_linear(x, g, 1e-6, w)
                });
                s.call(
                    format!("infer::rms_norm_linear_swiglu {xn} {gn} {wn}"),
                    || candle_flash::infer::rms_norm_linear_swiglu(x, g, f32::NAN, w),
                );
            }
            s.call(format!("rotary {xn} {wn}"), || train::rotary(x, w, w));
            s.call(format!("cross_entropy_rows {xn} {wn}"), || {
                train::cross_entropy_rows(x, w)
            });
            s.call(format!("embedding {xn} {wn}"), || {
                train::embedding(x, w, DType::F32)
            });
        }
    }
    let ids = [
        ("u32 [0,5]", Tensor::new(&[0u32, 5], &CPU).unwrap()),
        ("u32 [0,6]", Tensor::new(&[0u32, 6], &CPU).unwrap()),
        ("u32 MAX", Tensor::new(&[u32::MAX, 1], &CPU).unwrap()),
        ("i64 [-1,0]", Tensor::new(&[-1i64, 0], &CPU).unwrap()),
        ("f32 [0.5]", Tensor::new(&[0.5f32], &CPU).unwrap()),
        ("u32 []", Tensor::new(&[0u32; 0], &CPU).unwrap()),
        ("u32 (1,2)", Tensor::new(&[[0u32, 1]], &CPU).unwrap()),
    ];
    let table = f(&[6, 8]);
    for (iname, i) in &ids {
        for dtype in [DType::F32, DType::BF16, DType::U8] {
            s.call(format!("embedding {iname} {dtype:?}"), || {
                train::embedding(&table, i, dtype)
            });
            s.call(format!("embedding_deterministic {iname} {dtype:?}"), || {
                train::embedding_deterministic(&table, i, dtype)
            });
        }
        let logits = f(&[2, 6]);
        s.call(format!("cross_entropy {iname}"), || {
            train::cross_entropy(&logits, i)
        });
        s.call(format!("cross_entropy_rows {iname}"), || {
            let v = Var::from_tensor(&logits)?;
            let rows = train::cross_entropy_rows(v.as_tensor(), i)?;
            rows.sum_all()?.backward().map(drop)
        });
    }
    s.call("sum_squares []", || train::sum_squares([]));
    s.call("retain_freed_device_memory", || {
        train::retain_freed_device_memory(&CPU)
    });
    optimizer_calls(&mut s);
    s.finish("train");
}

/// AdamW: bad hyper-parameters, gradients and saved states.
fn optimizer_calls(s: &mut Sweep) {
    let var = |shape: &[usize]| Var::from_tensor(&f(shape)).unwrap();
    let (a, b) = (var(&[3]), var(&[2, 2]));
    for lr in [1e-3, f64::NAN, -1.0, f64::INFINITY] {
        s.call(format!("AdamW::new lr {lr}"), || {
            AdamW::new(vec![("a".into(), a.clone())], lr, f64::NAN)
        });
    }
    s.call("AdamW::new f16", || {
        AdamW::new(
            vec![("h".into(), Var::from_tensor(&t(&[2], DType::F16))?)],
            1e-3,
            0.0,
        )
    });
    let Some(mut opt) = s.call("AdamW::new", || {
        AdamW::new(
            vec![("a".into(), a.clone()), ("b".into(), b.clone())],
            1e-3,
            0.01,
        )
    }) else {
        return;
    };
    let loss = |x: &Tensor| (a.as_tensor() * x).and_then(|y| y.sum_all()?.backward());
    for (name, x) in [
        ("ones", f(&[3]).ones_like().unwrap()),
        ("nan", (f(&[3]) * f64::NAN).unwrap()),
    ] {
        if let Some(g) = s.call(format!("grads {name}"), || loss(&x)) {
            for scale in [1.0, 0.0, f64::NAN, -1.0, f64::INFINITY] {
                s.call(format!("update {name} scale {scale}"), || {
                    opt.update(&g, scale)
                });
            }
        }
    }
    for (beta, eps) in [(1.0, 1e-8), (-0.5, 1e-8), (0.9, f64::NAN), (f64::NAN, -1.0)] {
        opt.beta1 = beta;
        opt.beta2 = beta;
        opt.eps = eps;
        if let Some(g) = s.call("grads", || loss(&f(&[3]))) {
            s.call(format!("update betas {beta} eps {eps}"), || {
                opt.update(&g, 1.0)
            });
        }
    }
    (opt.beta1, opt.beta2, opt.eps) = (0.9, 0.999, 1e-8);
    opt.step = usize::MAX;
    if let Some(g) = s.call("grads", || loss(&f(&[3]))) {
        s.call("update at step usize::MAX", || opt.update(&g, 1.0));
    }
    opt.step = 0;
    let good = s.call("state", || opt.state()).unwrap_or_default();
    let mut states: Vec<(String, HashMap<String, Tensor>)> = vec![("empty".into(), HashMap::new())];
    for key in good.keys() {
        for (vname, value) in [
            ("empty", Tensor::new(&[0f32; 0], &CPU).unwrap()),
            ("scalar", Tensor::new(1f32, &CPU).unwrap()),
            ("u32 MAX", Tensor::new(&[u32::MAX], &CPU).unwrap()),
            ("i64 -1", Tensor::new(&[-1i64], &CPU).unwrap()),
            ("f32 nan", Tensor::new(&[f32::NAN], &CPU).unwrap()),
            ("f32 1e30", Tensor::new(&[1e30f32], &CPU).unwrap()),
            ("wrong shape", f(&[7, 7])),
            ("f16", t(&[2, 3], DType::F16)),
        ] {
            let mut st = good.clone();
            st.insert(key.clone(), value);
            states.push((format!("{key} = {vname}"), st));
        }
        let mut st = good.clone();
        st.remove(key);
        states.push((format!("without {key}"), st));
    }
    let mut extra = good.clone();
    extra.insert("nonexistent".into(), f(&[3]));
    states.push(("extra key".into(), extra));
    for (name, st) in &states {
        s.call(format!("load_state {name}"), || opt.load_state(st));
    }
}
