//! The FP8 (e4m3) forward on the CPU, which defines what the CUDA kernel computes
//! (`FlashAttn::fp8_descales`): against an f64 oracle written here from the dequantized inputs
//! over a grid of shapes (seqlens 1..1023, head dims 40..256, MHA/GQA/MQA, causal or not,
//! per-tensor and per-head descales, packed batches, output dtypes); the descales' meaning;
//! rows that see no key; the options it refuses and every error; and `quant::hadamard`.
//!
//! The error rule. FP8 attention rounds the softmax's numerator P to e4m3 before P·V, so it
//! cannot match exact attention on the dequantized inputs; the oracle computes both that
//! exact attention (`exact`) and, in f64, the documented math with P rounded to e4m3
//! (`emulated`, its own round-to-nearest-even e4m3, checked against float8's below). For
//! every case:
//! 1. `max |op - exact| <= 2 · max |emulated - exact| + eps`: the op's error is what P's
//!    rounding explains (a masking, head-mapping or descale bug costs far more);
//! 2. `max |op - emulated| <= max |emulated - exact| / 4 + eps`, each row allowed the
//!    effect of its probabilities that lie within 1e-5 of an e4m3 midpoint (f32 may round
//!    those the other way; a handful per grid): the op rounds P as documented, against the
//!    row maximum (an op without the rounding, or rounding with another maximum, lands about
//!    as far from `emulated` as `exact` does);
//! 3. the LSE equals the f64 LSE to 1e-5 relative, `-inf` exactly where a row sees no key.
//!
//! Here `eps = 1e-5 · max |v|` for f32 outputs, plus half an ulp of the output dtype at
//! `max |exact|` for BF16 and F16. `the_rules_catch_planted_bugs` shows each rule failing
//! on a wrong output.

mod common;

use candle::{DType, Device, Tensor, Var};
use candle_flash::quant::{
    dequantize_fp8, fp8_scales, hadamard, quantize_fp8, Fp8Scaling, FP8_BLOCK_ROWS,
    MAX_HADAMARD_DIM,
};
use candle_flash::{flash_attn, flash_attn_with_kvcache, FlashAttn, Padding, VarLen};
use common::assert_fails;
use float8::F8E4M3;

const CPU: Device = Device::Cpu;

/// A seeded normal generator (splitmix64 + Box–Muller): the grid is the same every run.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    fn normal(&mut self) -> f64 {
        let (u1, u2) = (self.uniform(), self.uniform());
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// An f32 tensor of `shape` with standard normal entries times `std`.
    fn randn(&mut self, shape: &[usize], std: f64) -> Tensor {
        let n = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| (self.normal() * std) as f32).collect();
        Tensor::from_vec(v, shape, &CPU).unwrap()
    }
}

/// e4m3 rounding written from the format's definition (1 sign, 4 exponent bits with bias 7,
/// 3 mantissa bits; smallest normal 2^-6, subnormals in steps of 2^-9; largest finite 448,
/// saturating), round to nearest, ties to even: the oracle's own, independent of float8's.
fn e4m3(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    let a = x.abs();
    let quantum = if a < 2f64.powi(-6) {
        2f64.powi(-9)
    } else {
        2f64.powi(a.log2().floor() as i32 - 3)
    };
    let n = a / quantum;
    let mut r = n.round();
    if (n - n.floor() - 0.5).abs() == 0.0 && r % 2.0 != 0.0 {
        r -= 1.0; // a tie: to even
    }
    (r * quantum).min(448.0).copysign(x)
}

/// One FP8 input: the e4m3 tensor, its descale tensor and its real values (each stored value
/// as f64 times its head's descale), row-major like the tensor.
struct Fp8Input {
    x8: Tensor,
    descale: Tensor,
    real: Vec<f64>,
}

/// `x` (rank 4, or rank 3 packed) quantized with `quant`'s scales for `scaling`.
fn quantize(x: &Tensor, scaling: Fp8Scaling) -> Fp8Input {
    let packed = x.rank() == 3;
    let x4 = if packed {
        x.unsqueeze(0).unwrap()
    } else {
        x.clone()
    };
    let descale = fp8_scales(&x4, scaling).unwrap();
    let mut x8 = quantize_fp8(&x4, &descale, scaling).unwrap();
    if packed {
        x8 = x8.squeeze(0).unwrap();
    }
    let real = real_values(&x8, &descale);
    Fp8Input { x8, descale, real }
}

/// The real values of an e4m3 tensor `(.., heads, d)` with per-tensor `(1,)`, per-head
/// `(heads,)` or per-block `(batch, heads, blocks)` descales (per block: `(batch, seq, heads,
/// d)` tensors, row `r` in block `r / 128`).
fn real_values(x8: &Tensor, descale: &Tensor) -> Vec<f64> {
    let dims = x8.dims();
    let (heads, d) = (dims[dims.len() - 2], dims[dims.len() - 1]);
    let stored: Vec<f32> = x8
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let ds: Vec<f32> = descale.flatten_all().unwrap().to_vec1().unwrap();
    let (seq, blocks) = match descale.dims() {
        &[_, _, nb] => (dims[1], nb),
        _ => (1, 1),
    };
    stored
        .iter()
        .enumerate()
        .map(|(i, &x)| {
            let head = (i / d.max(1)) % heads.max(1);
            let at = match descale.rank() {
                3 => {
                    let token = i / (d * heads);
                    let (b, row) = (token / seq, token % seq);
                    (b * heads + head) * blocks + row / FP8_BLOCK_ROWS
                }
                _ if ds.len() == 1 => 0,
                _ => head,
            };
            x as f64 * ds[at] as f64
        })
        .collect()
}

/// Sequences of a problem: `(first query row, queries, first key row, keys)`.
type Seqs = Vec<(usize, usize, usize, usize)>;

/// What the oracle computes: outputs `(rows, h, d)` row-major and the LSE in the op's layout.
struct Oracle {
    exact: Vec<f64>,
    emulated: Vec<f64>,
    lse: Vec<f64>,
    /// Per `(row, head)`: how far the op's row may move from `emulated` because a
    /// probability lies so close to a midpoint of e4m3 values (within [`TIE_BAND`]) that f32
    /// scores may round it to the other neighbour: the gap times `max |v_j| / l` per such key.
    slack: Vec<f64>,
}

/// The relative distance to an e4m3 midpoint under which the op's f32 probability may round
/// the other way than the oracle's f64 one (f32 scores of 256-term dot products are good to
/// a few 1e-7 relative, their exponentials alike).
const TIE_BAND: f64 = 1e-5;

/// Attention in f64 from the real values: q `(total_q, h, d)`, k and v `(total_k, hk, d)`;
/// the causal mask from indices (query `i` of a sequence with `sq` queries and `sk` keys sees
/// key `j` iff `j + sq <= i + sk`); query head `hq` reads K/V head `hq / (h / hk)`. The LSE
/// is `(b, h, sq)` (fixed length, every sequence `sq` long) or `(h, total_q)` (`packed`).
#[allow(clippy::too_many_arguments)]
fn oracle(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    seqs: &Seqs,
    (h, hk, d): (usize, usize, usize),
    scale: f64,
    causal: bool,
    packed: bool,
) -> Oracle {
    let total_q: usize = seqs.iter().map(|s| s.1).sum();
    let mut exact = vec![0f64; total_q * h * d];
    let mut emulated = exact.clone();
    let mut lse = vec![f64::NEG_INFINITY; total_q * h];
    let mut slack = vec![0f64; total_q * h];
    let mut scores = Vec::new();
    for (b, &(q0, sq, k0, sk)) in seqs.iter().enumerate() {
        for hq in 0..h {
            let g = hq / (h / hk);
            for i in 0..sq {
                let qi = &q[((q0 + i) * h + hq) * d..][..d];
                let visible: Vec<usize> = (0..sk)
                    .filter(|&j| !causal || j as i64 + sq as i64 <= i as i64 + sk as i64)
                    .collect();
                let li = if packed {
                    hq * total_q + q0 + i
                } else {
                    (b * h + hq) * sq + i
                };
                if visible.is_empty() {
                    continue;
                }
                scores.clear();
                for &j in &visible {
                    let kj = &k[((k0 + j) * hk + g) * d..][..d];
                    scores.push(scale * qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>());
                }
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let l: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                lse[li] = m + l.ln();
                let o = ((q0 + i) * h + hq) * d;
                for (&j, &s) in visible.iter().zip(&scores) {
                    let p = (s - m).exp();
                    let p8 = e4m3(p * 256.0) / 256.0;
                    let vj = &v[((k0 + j) * hk + g) * d..][..d];
                    for c in 0..d {
                        exact[o + c] += p * vj[c] / l;
                        emulated[o + c] += p8 * vj[c] / l;
                    }
                    let gap = (e4m3(256.0 * p * (1.0 + TIE_BAND))
                        - e4m3(256.0 * p * (1.0 - TIE_BAND)))
                        / 256.0;
                    slack[o / d] += gap * max_abs(vj) / l;
                }
            }
        }
    }
    Oracle {
        exact,
        emulated,
        lse,
        slack,
    }
}

fn host(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0.0, |m: f64, (x, y)| {
        let e = (x - y).abs();
        if e.is_nan() || m.is_nan() {
            f64::NAN
        } else {
            m.max(e)
        }
    })
}

fn max_abs(a: &[f64]) -> f64 {
    a.iter().fold(0.0, |m: f64, x| m.max(x.abs()))
}

/// Which of the module doc's rules an output breaks (empty: none).
fn broken_rules(
    what: &str,
    out: &[f64],
    lse: &[f64],
    oracle: &Oracle,
    v: &[f64],
    dtype: DType,
) -> Vec<String> {
    let eps = 1e-5 * max_abs(v).max(1.0)
        + f64::from(common::unit_roundoff(dtype)) * max_abs(&oracle.exact);
    let rounding = max_diff(&oracle.emulated, &oracle.exact);
    let vs_exact = max_diff(out, &oracle.exact);
    // Each element's distance to `emulated` beyond the slack of its row.
    let d = out.len() / oracle.slack.len().max(1);
    let vs_emulated = out
        .iter()
        .zip(&oracle.emulated)
        .enumerate()
        .fold(0f64, |m, (i, (x, y))| {
            let e = ((x - y).abs() - oracle.slack[i / d.max(1)]).max(0.0);
            if e.is_nan() || m.is_nan() || x.is_nan() {
                f64::NAN
            } else {
                m.max(e)
            }
        });
    let mut broken = Vec::new();
    // `a <= b` is false for NaN: a NaN breaks the rule.
    let rule1 = vs_exact <= 2.0 * rounding + eps;
    let rule2 = vs_emulated <= rounding / 4.0 + eps;
    if !rule1 {
        broken.push(format!(
            "{what}: rule 1: max |op - exact| {vs_exact:e} > 2 x {rounding:e} + {eps:e}"
        ));
    }
    if !rule2 {
        broken.push(format!(
            "{what}: rule 2: max |op - emulated| {vs_emulated:e} > {rounding:e} / 4 + {eps:e}"
        ));
    }
    for (i, (&ours, &want)) in lse.iter().zip(&oracle.lse).enumerate() {
        let ok = if want == f64::NEG_INFINITY {
            ours == f64::NEG_INFINITY
        } else {
            (ours - want).abs() <= 1e-5 * want.abs().max(1.0)
        };
        if !ok {
            broken.push(format!(
                "{what}: rule 3: lse[{i}] = {ours}, expected {want}"
            ));
            break;
        }
    }
    broken
}

fn assert_rules(what: &str, out: &Tensor, lse: &Tensor, oracle: &Oracle, v: &[f64]) {
    assert!(out.dtype() != DType::F8E4M3);
    let broken = broken_rules(what, &host(out), &host(lse), oracle, v, out.dtype());
    assert!(broken.is_empty(), "{}", broken.join("\n"));
}

/// One fixed-length case.
#[derive(Clone, Copy, Debug)]
struct Case {
    b: usize,
    sq: usize,
    sk: usize,
    h: usize,
    hk: usize,
    d: usize,
    causal: bool,
    scaling: Fp8Scaling,
    out: DType,
}

/// Runs one case against the oracle (data from `seed`).
fn check_case(c: Case, seed: u64) {
    let mut rng = Rng(seed);
    let mut input = |shape: &[usize]| {
        if c.scaling == PER_BLOCK {
            blocky(&mut rng, shape)
        } else {
            rng.randn(shape, 1.0)
        }
    };
    let q = quantize(&input(&[c.b, c.sq, c.h, c.d]), c.scaling);
    let k = quantize(&input(&[c.b, c.sk, c.hk, c.d]), c.scaling);
    let v = quantize(&input(&[c.b, c.sk, c.hk, c.d]), c.scaling);
    if c.scaling == PER_BLOCK {
        assert_eq!(q.descale.dims(), &[c.b, c.h, c.sq.div_ceil(FP8_BLOCK_ROWS)]);
    }
    let attn = FlashAttn::new()
        .causal(c.causal)
        .fp8_descales(&q.descale, &k.descale, &v.descale)
        .out_dtype(c.out);
    let (out, lse) = attn.forward_with_lse(&q.x8, &k.x8, &v.x8).unwrap();
    assert_eq!(out.dims(), &[c.b, c.sq, c.h, c.d]);
    assert_eq!(lse.dims(), &[c.b, c.h, c.sq]);
    assert_eq!((out.dtype(), lse.dtype()), (c.out, DType::F32));
    let seqs = (0..c.b).map(|b| (b * c.sq, c.sq, b * c.sk, c.sk)).collect();
    let scale = 1.0 / (c.d as f64).sqrt();
    let oracle = oracle(
        &q.real,
        &k.real,
        &v.real,
        &seqs,
        (c.h, c.hk, c.d),
        scale,
        c.causal,
        false,
    );
    assert_rules(&format!("{c:?}"), &out, &lse, &oracle, &v.real);
}

const HEADS: [(usize, usize); 3] = [(8, 2), (4, 1), (2, 2)];
const SCALINGS: [Fp8Scaling; 2] = [Fp8Scaling::PerTensor, Fp8Scaling::PerHead];

/// The grid: seqlens 1 and 113 (equal or not), every head dim, GQA 8/2, MQA 4/1 and MHA
/// (cycled), causal or not, per-tensor and per-head descales, F32 outputs.
#[test]
fn grid_matches_the_f64_oracle() {
    let seqs = [(1, 1), (1, 113), (113, 1), (113, 113), (64, 113), (113, 64)];
    let mut n = 0;
    for (sq, sk) in seqs {
        for d in [40, 64, 96, 128, 256] {
            for causal in [false, true] {
                for scaling in SCALINGS {
                    let (h, hk) = HEADS[n % HEADS.len()];
                    let b = if sq * sk > 1000 { 1 } else { 2 };
                    let case = Case {
                        b,
                        sq,
                        sk,
                        h,
                        hk,
                        d,
                        causal,
                        scaling,
                        out: DType::F32,
                    };
                    check_case(case, n as u64);
                    n += 1;
                }
            }
        }
    }
}

/// Long sequences with few heads: 1023 queries and keys, one query over 1023 keys, and more
/// queries than keys (causal: the first rows see no key).
#[test]
fn long_sequences_match_the_f64_oracle() {
    for (i, (sq, sk, causal)) in [
        (1023, 1023, false),
        (1023, 1023, true),
        (1, 1023, false),
        (1023, 200, true),
    ]
    .into_iter()
    .enumerate()
    {
        let case = Case {
            b: 1,
            sq,
            sk,
            h: 2,
            hk: 1,
            d: 64,
            causal,
            scaling: SCALINGS[i % 2],
            out: DType::F32,
        };
        check_case(case, 100 + i as u64);
    }
}

/// BF16 (the default) and F16 outputs: the same rules with the output's rounding in eps.
#[test]
fn bf16_and_f16_outputs_match_the_f64_oracle() {
    for (i, out) in [DType::BF16, DType::F16].into_iter().enumerate() {
        for causal in [false, true] {
            let case = Case {
                b: 2,
                sq: 77,
                sk: 130,
                h: 8,
                hk: 2,
                d: 128,
                causal,
                scaling: SCALINGS[i],
                out,
            };
            check_case(case, 200 + i as u64);
        }
    }
    // Without out_dtype the output is BF16.
    let mut rng = Rng(7);
    let x = quantize(&rng.randn(&[1, 5, 2, 16], 1.0), Fp8Scaling::PerTensor);
    let out = FlashAttn::new().forward(&x.x8, &x.x8, &x.x8).unwrap();
    assert_eq!(out.dtype(), DType::BF16);
}

/// Packed batches: sequences with no query, no key, one of each, more queries than keys.
#[test]
fn varlen_matches_the_f64_oracle() {
    let lens_q = [1usize, 113, 0, 37, 64, 9];
    let lens_k = [5usize, 113, 10, 0, 200, 3];
    let varlen = VarLen::from_seqlens(&lens_q, &lens_k).unwrap();
    let (cu_q, cu_k) = (varlen.cu_seqlens_q(), varlen.cu_seqlens_k());
    let seqs: Seqs = (0..lens_q.len())
        .map(|b| (cu_q[b] as usize, lens_q[b], cu_k[b] as usize, lens_k[b]))
        .collect();
    let (tq, tk) = (varlen.total_q(), varlen.total_k());
    let mut n = 0;
    for d in [64, 128] {
        for causal in [false, true] {
            for scaling in SCALINGS {
                let (h, hk) = HEADS[n % 2];
                let mut rng = Rng(300 + n as u64);
                let q = quantize(&rng.randn(&[tq, h, d], 1.0), scaling);
                let k = quantize(&rng.randn(&[tk, hk, d], 1.0), scaling);
                let v = quantize(&rng.randn(&[tk, hk, d], 1.0), scaling);
                let attn = FlashAttn::new()
                    .causal(causal)
                    .out_dtype(DType::F32)
                    .fp8_descales(&q.descale, &k.descale, &v.descale);
                let (out, lse) = attn
                    .forward_varlen_with_lse(&q.x8, &k.x8, &v.x8, &varlen)
                    .unwrap();
                assert_eq!((out.dims(), lse.dims()), (&[tq, h, d][..], &[h, tq][..]));
                let scale = 1.0 / (d as f64).sqrt();
                let o = oracle(
                    &q.real,
                    &k.real,
                    &v.real,
                    &seqs,
                    (h, hk, d),
                    scale,
                    causal,
                    true,
                );
                let what = format!("varlen d {d} causal {causal} {scaling:?} heads {h}/{hk}");
                assert_rules(&what, &out, &lse, &o, &v.real);
                // forward_varlen is the same call without the LSE.
                let plain = attn.forward_varlen(&q.x8, &k.x8, &v.x8, &varlen).unwrap();
                assert_eq!(host(&plain), host(&out), "{what}: forward_varlen");
                n += 1;
            }
        }
    }
}

const PER_BLOCK: Fp8Scaling = Fp8Scaling::PerBlock {
    rows: FP8_BLOCK_ROWS,
};

/// Normal `shape` `(b, s, h, d)` whose blocks of 128 rows differ in magnitude (x 1/2, 1, 2,
/// 4 in turn): per-block factors then differ from one key tile to the next.
fn blocky(rng: &mut Rng, shape: &[usize]) -> Tensor {
    let x = rng.randn(shape, 1.0);
    let f: Vec<f32> = (0..shape[1])
        .map(|r| [0.5, 1.0, 2.0, 4.0][r / FP8_BLOCK_ROWS % 4])
        .collect();
    x.broadcast_mul(&Tensor::from_vec(f, (1, shape[1], 1, 1), &CPU).unwrap())
        .unwrap()
}

/// Per-block descales (one per 128 rows of each sequence and head): longer sequences than
/// one block, q, k and v of differing magnitude per block, GQA, causal or not, against the
/// oracle over the per-block real values.
#[test]
fn per_block_descales_match_the_f64_oracle() {
    let cases = [
        (1, 300, 300, 4, 2, 64, false),
        (1, 300, 300, 4, 2, 64, true),
        (2, 129, 385, 2, 1, 128, true),
        (1, 400, 130, 2, 2, 40, false),
        (2, 1, 257, 4, 4, 256, false),
    ];
    for (n, (b, sq, sk, h, hk, d, causal)) in cases.into_iter().enumerate() {
        let case = Case {
            b,
            sq,
            sk,
            h,
            hk,
            d,
            causal,
            scaling: PER_BLOCK,
            out: DType::F32,
        };
        check_case(case, 500 + n as u64);
    }
}

/// Per-block descales with packed sequences: each sequence quantized alone, its blocks
/// counted from its first row, descales `(sequences, heads, blocks of the longest)`.
#[test]
fn per_block_descales_in_packed_batches() {
    let lens_q = [130usize, 1, 0, 300];
    let lens_k = [257usize, 129, 4, 300];
    let varlen = VarLen::from_seqlens(&lens_q, &lens_k).unwrap();
    let (cu_q, cu_k) = (varlen.cu_seqlens_q(), varlen.cu_seqlens_k());
    let seqs: Seqs = (0..lens_q.len())
        .map(|b| (cu_q[b] as usize, lens_q[b], cu_k[b] as usize, lens_k[b]))
        .collect();
    let (h, hk, d) = (4, 2, 64);
    let mut rng = Rng(600);
    // One sequence's rows quantized with its own per-block scales, padded to `blocks` with 1s.
    let mut by_sequence = |lens: &[usize], heads: usize| {
        let blocks = lens.iter().max().unwrap().div_ceil(FP8_BLOCK_ROWS);
        let (mut x8, mut descales, mut real) = (vec![], vec![], vec![]);
        for &n in lens {
            let x = quantize(&blocky(&mut rng, &[1, n, heads, d]), PER_BLOCK);
            let have = x.descale.dim(2).unwrap();
            let ones = Tensor::ones((1, heads, blocks - have), DType::F32, &CPU).unwrap();
            descales.push(Tensor::cat(&[&x.descale, &ones], 2).unwrap());
            x8.push(x.x8.squeeze(0).unwrap());
            real.extend(x.real);
        }
        Fp8Input {
            x8: Tensor::cat(&x8, 0).unwrap(),
            descale: Tensor::cat(&descales, 0).unwrap(),
            real,
        }
    };
    let q = by_sequence(&lens_q, h);
    let k = by_sequence(&lens_k, hk);
    let v = by_sequence(&lens_k, hk);
    for causal in [false, true] {
        let attn = FlashAttn::new()
            .causal(causal)
            .out_dtype(DType::F32)
            .fp8_descales(&q.descale, &k.descale, &v.descale);
        let (out, lse) = attn
            .forward_varlen_with_lse(&q.x8, &k.x8, &v.x8, &varlen)
            .unwrap();
        let scale = 1.0 / (d as f64).sqrt();
        let o = oracle(
            &q.real,
            &k.real,
            &v.real,
            &seqs,
            (h, hk, d),
            scale,
            causal,
            true,
        );
        assert_rules(
            &format!("packed per block causal {causal}"),
            &out,
            &lse,
            &o,
            &v.real,
        );
    }
    // More blocks than the longest sequence needs are accepted (the extra ones unread).
    let pad_blocks = |t: &Tensor| {
        let (n, heads, _) = t.dims3().unwrap();
        Tensor::cat(
            &[t, &Tensor::ones((n, heads, 1), DType::F32, &CPU).unwrap()],
            2,
        )
        .unwrap()
    };
    let attn = FlashAttn::new().out_dtype(DType::F32);
    let plain = attn
        .clone()
        .fp8_descales(&q.descale, &k.descale, &v.descale)
        .forward_varlen(&q.x8, &k.x8, &v.x8, &varlen)
        .unwrap();
    let wider = attn
        .fp8_descales(&pad_blocks(&q.descale), &pad_blocks(&k.descale), &v.descale)
        .forward_varlen(&q.x8, &k.x8, &v.x8, &varlen)
        .unwrap();
    assert_eq!(host(&plain), host(&wider));
}

/// Per-block descales of the wrong shape, and with forward_padded, are errors that say so.
#[test]
fn per_block_descale_errors() {
    let mut rng = Rng(700);
    let x = quantize(&rng.randn(&[2, 200, 2, 32], 1.0), PER_BLOCK);
    let one = Tensor::ones(1, DType::F32, &CPU).unwrap();
    let run = |qd: &Tensor| {
        FlashAttn::new()
            .fp8_descales(qd, &one, &one)
            .forward(&x.x8, &x.x8, &x.x8)
    };
    assert!(run(&x.descale).is_ok());
    for bad in [(2, 2, 1), (2, 2, 3), (1, 2, 2), (2, 1, 2)] {
        let t = Tensor::ones(bad, DType::F32, &CPU).unwrap();
        assert_fails(run(&t), &["fp8_descales", "q's descale", "(2, 2, 2)"]);
    }
    let pad = Padding::from_lengths(&[200, 100], 200).unwrap();
    let padded = FlashAttn::new()
        .fp8_descales(&x.descale, &one, &one)
        .forward_padded(&x.x8, &x.x8, &x.x8, &pad, &pad);
    assert_fails(padded, &["fp8_descales", "per-block", "forward_varlen"]);
}

/// A transposed V (`quant::fp8_v_transposed`, what the Hopper kernels read without a
/// transpose) is the same V: the same output at lengths that are and are not multiples of 16;
/// its shape, varlen and padded calls, and the option without FP8 inputs are errors that say
/// so.
#[test]
fn transposed_v_is_the_same_v() {
    let mut rng = Rng(73);
    for s in [37, 48, 1] {
        let (b, h, hk, d) = (2, 4, 2, 32);
        let q = quantize(&rng.randn(&[b, s, h, d], 1.0), Fp8Scaling::PerHead);
        let k = quantize(&rng.randn(&[b, s, hk, d], 1.0), Fp8Scaling::PerHead);
        let v = quantize(&rng.randn(&[b, s, hk, d], 1.0), Fp8Scaling::PerHead);
        let attn = FlashAttn::new()
            .causal(true)
            .out_dtype(DType::F32)
            .fp8_descales(&q.descale, &k.descale, &v.descale);
        let vt = candle_flash::quant::fp8_v_transposed(&v.x8).unwrap();
        let keys = s.next_multiple_of(16);
        assert_eq!(vt.dims(), &[b, hk, d, keys]);
        // Key 8 of the first 16 is stored third (the kernels' P order), padding is zero.
        if s > 8 {
            // (Strided F8E4M3 views are widened whole first.)
            let wide = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            let stored = host(&wide(&vt).narrow(3, 2, 1).unwrap());
            let key8 = host(
                &wide(&v.x8)
                    .narrow(1, 8, 1)
                    .unwrap()
                    .permute((0, 2, 3, 1))
                    .unwrap(),
            );
            assert_eq!(stored, key8);
        }
        let plain = attn.forward(&q.x8, &k.x8, &v.x8).unwrap();
        let ours = attn
            .clone()
            .fp8_v_transposed()
            .forward(&q.x8, &k.x8, &vt)
            .unwrap();
        assert_eq!(host(&ours), host(&plain), "seqlen {s}");
    }
    let mut rng = Rng(74);
    let x = quantize(&rng.randn(&[1, 20, 2, 32], 1.0), Fp8Scaling::PerTensor);
    let one = Tensor::ones(1, DType::F32, &CPU).unwrap();
    let attn = FlashAttn::new()
        .fp8_descales(&one, &one, &one)
        .fp8_v_transposed();
    // V as it was, not transposed.
    assert_fails(
        attn.forward(&x.x8, &x.x8, &x.x8),
        &["v:", "fp8_v_transposed", "[1, 2, 32, 32]"],
    );
    let vt = candle_flash::quant::fp8_v_transposed(&x.x8).unwrap();
    let flat = |t: &Tensor| t.squeeze(0).unwrap();
    let varlen = VarLen::from_seqlens(&[20], &[20]).unwrap();
    assert_fails(
        attn.forward_varlen(&flat(&x.x8), &flat(&x.x8), &flat(&vt), &varlen),
        &["fp8_v_transposed", "fixed-length"],
    );
    let pad = Padding::from_lengths(&[20], 20).unwrap();
    assert_fails(
        attn.forward_padded(&x.x8, &x.x8, &vt, &pad, &pad),
        &["fp8_v_transposed", "forward_padded"],
    );
    let f32s = x.x8.to_dtype(DType::F32).unwrap();
    assert_fails(
        FlashAttn::new()
            .fp8_v_transposed()
            .forward(&f32s, &f32s, &f32s),
        &["fp8_v_transposed", "F8E4M3"],
    );
    assert_fails(
        candle_flash::quant::fp8_v_transposed(&f32s),
        &["v:", "F8E4M3"],
    );
}

/// forward_padded packs FP8 inputs, runs the varlen op and scatters back: each sequence as if
/// alone, padded query rows zero.
#[test]
fn forward_padded_equals_a_loop_over_sequences() {
    let mut rng = Rng(11);
    let (b, s, h, hk, d) = (3, 9, 4, 2, 32);
    let q = quantize(&rng.randn(&[b, s, h, d], 1.0), Fp8Scaling::PerHead);
    let k = quantize(&rng.randn(&[b, s, hk, d], 1.0), Fp8Scaling::PerHead);
    let v = quantize(&rng.randn(&[b, s, hk, d], 1.0), Fp8Scaling::PerHead);
    let lens = [9, 4, 1];
    let pad = Padding::from_lengths(&lens, s).unwrap();
    let attn = FlashAttn::new()
        .causal(true)
        .out_dtype(DType::F32)
        .fp8_descales(&q.descale, &k.descale, &v.descale);
    let out = attn
        .forward_padded(&q.x8, &k.x8, &v.x8, &pad, &pad)
        .unwrap();
    assert_eq!(out.dims(), &[b, s, h, d]);
    for (i, &len) in lens.iter().enumerate() {
        let part = |t: &Tensor| t.narrow(0, i, 1).unwrap().narrow(1, 0, len).unwrap();
        let alone = attn
            .forward(&part(&q.x8), &part(&k.x8), &part(&v.x8))
            .unwrap();
        let padded = out.narrow(0, i, 1).unwrap();
        assert_eq!(
            host(&padded.narrow(1, 0, len).unwrap()),
            host(&alone),
            "sequence {i}"
        );
        let rest = host(&padded.narrow(1, len, s - len).unwrap());
        assert!(rest.iter().all(|&x| x == 0.0), "sequence {i}: padded rows");
    }
}

/// A hand-made row whose result is known in closed form: two keys with scores 0 and -1.25
/// (softmax_scale 1), values 0 and 1. P = (1, exp(-1.25)); e4m3(exp(-1.25) = 0.2865) =
/// 0.28125; the output is 0.28125 / (1 + 0.2865), the LSE ln(1 + 0.2865). Not rounding P
/// gives 0.2227, rounding l too 0.2195.
#[test]
fn p_is_rounded_to_e4m3_and_l_is_not() {
    let d = 16;
    let mut q = vec![0f32; d];
    q[0] = 1.0;
    let mut k = vec![0f32; 2 * d];
    k[d] = -1.25;
    let mut v = vec![0f32; 2 * d];
    v[d] = 1.0;
    let fp8 = |x: Vec<f32>, s: usize| {
        Tensor::from_vec(x, (1, s, 1, d), &CPU)
            .unwrap()
            .to_dtype(DType::F8E4M3)
            .unwrap()
    };
    let (out, lse) = FlashAttn::new()
        .softmax_scale(1.0)
        .out_dtype(DType::F32)
        .forward_with_lse(&fp8(q, 1), &fp8(k, 2), &fp8(v, 2))
        .unwrap();
    let p = (-1.25f64).exp();
    assert_eq!(e4m3(p), 0.28125);
    let got = host(&out)[0];
    let want = 0.28125 / (1.0 + p);
    assert!((got - want).abs() < 1e-6, "out {got}, expected {want}");
    let got = host(&lse)[0];
    assert!((got - (1.0 + p).ln()).abs() < 1e-6, "lse {got}");
}

/// The oracle's e4m3 rounding and float8's (the op's) agree on every representable value,
/// every midpoint between neighbours (ties to even), and values around them.
#[test]
fn e4m3_rounding_matches_float8() {
    let values: Vec<f64> = (0..=0x7eu8)
        .map(|b| F8E4M3::from_bits(b).to_f32() as f64)
        .collect();
    let mut probes = values.clone();
    for w in values.windows(2) {
        let mid = (w[0] + w[1]) / 2.0;
        probes.extend([mid, mid * (1.0 + 1e-6), mid * (1.0 - 1e-6)]);
    }
    probes.extend([500.0, 1e6, 1e-5, 2f64.powi(-10), 2f64.powi(-10) * 1.001]);
    for x in probes {
        for x in [x, -x] {
            let ours = e4m3(x);
            let theirs = F8E4M3::from_f32(x as f32).to_f32() as f64;
            assert_eq!(ours, theirs, "e4m3({x:e})");
        }
    }
}

/// Runs an FP8 call with F32 output on (q, k, v) tensors and descale vectors.
fn run(q: &Tensor, k: &Tensor, v: &Tensor, ds: [&[f32]; 3], scale: f32) -> Vec<f64> {
    let t = |x: &[f32]| Tensor::new(x, &CPU).unwrap();
    FlashAttn::new()
        .softmax_scale(scale)
        .causal(true)
        .out_dtype(DType::F32)
        .fp8_descales(&t(ds[0]), &t(ds[1]), &t(ds[2]))
        .forward(q, k, v)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f64::from)
        .collect()
}

/// Descales multiply the stored values: doubling q's (or k's) descale is doubling the
/// scores, i.e. doubling softmax_scale (bit for bit: powers of two round alike); doubling v's
/// doubles the output; a per-head descale reaches exactly the heads that read its head
/// (query head h, K/V head h / (h / hk)).
#[test]
fn descales_act_as_documented() {
    let mut rng = Rng(21);
    let (h, hk, d) = (8, 2, 64);
    let fp8 = |x: Tensor| x.to_dtype(DType::F8E4M3).unwrap();
    let q = fp8(rng.randn(&[2, 19, h, d], 4.0));
    let k = fp8(rng.randn(&[2, 23, hk, d], 4.0));
    let v = fp8(rng.randn(&[2, 23, hk, d], 4.0));
    let s = 0.1;
    let base = run(&q, &k, &v, [&[0.3], &[0.2], &[0.5]], s);
    assert_eq!(
        run(&q, &k, &v, [&[0.6], &[0.2], &[0.5]], s),
        run(&q, &k, &v, [&[0.3], &[0.2], &[0.5]], 2.0 * s)
    );
    assert_eq!(
        run(&q, &k, &v, [&[0.3], &[0.4], &[0.5]], s),
        run(&q, &k, &v, [&[0.3], &[0.2], &[0.5]], 2.0 * s)
    );
    let doubled: Vec<f64> = base.iter().map(|x| 2.0 * x).collect();
    assert_eq!(run(&q, &k, &v, [&[0.3], &[0.2], &[1.0]], s), doubled);
    assert_ne!(run(&q, &k, &v, [&[0.6], &[0.2], &[0.5]], s), base);
    // Per head: the same values as the per-tensor ones give the same result.
    assert_eq!(run(&q, &k, &v, [&[0.3; 8], &[0.2; 2], &[0.5; 2]], s), base);
    // K/V head 1's descales doubled: query heads 4..8 change as above, heads 0..4 do not.
    let sharper = run(&q, &k, &v, [&[0.3], &[0.2], &[0.5]], 2.0 * s);
    let per_head = run(&q, &k, &v, [&[0.3], &[0.2, 0.4], &[0.5, 1.0]], s);
    let head_of = |i: usize| (i / d) % h;
    for (i, &x) in per_head.iter().enumerate() {
        let want = if head_of(i) < 4 {
            base[i]
        } else {
            2.0 * sharper[i]
        };
        assert_eq!(x, want, "element {i} (query head {})", head_of(i));
    }
    // Query head 5's descale doubled: only head 5 changes.
    let mut qd = [0.3f32; 8];
    qd[5] = 0.6;
    let per_q_head = run(&q, &k, &v, [&qd, &[0.2], &[0.5]], s);
    for (i, &x) in per_q_head.iter().enumerate() {
        let want = if head_of(i) == 5 { sharper[i] } else { base[i] };
        assert_eq!(x, want, "element {i} (query head {})", head_of(i));
    }
}

/// quant's scales and this option round-trip: FP8 attention of quantized inputs is close to
/// f32 attention of the originals (a descale applied as a divisor would be far off), and
/// without descales the stored values are taken as they are.
#[test]
fn quantized_attention_approximates_f32_attention() {
    let mut rng = Rng(31);
    let (q, k, v) = (
        rng.randn(&[2, 40, 4, 64], 3.0),
        rng.randn(&[2, 50, 2, 64], 0.5),
        rng.randn(&[2, 50, 2, 64], 7.0),
    );
    let exact = FlashAttn::new().causal(true).forward(&q, &k, &v).unwrap();
    for scaling in SCALINGS {
        let (q8, k8, v8) = (
            quantize(&q, scaling),
            quantize(&k, scaling),
            quantize(&v, scaling),
        );
        let out = FlashAttn::new()
            .causal(true)
            .fp8_descales(&q8.descale, &k8.descale, &v8.descale)
            .forward(&q8.x8, &k8.x8, &v8.x8)
            .unwrap();
        let err = max_diff(&host(&out), &host(&exact));
        // e4m3 keeps 2^-4 relative of P and v: a few percent of max |v|.
        let vmax = max_abs(&host(&v));
        assert!(
            err < 0.1 * vmax,
            "{scaling:?}: max error {err} (max |v| {vmax})"
        );
        // The dequantized values through the f32 op: closer still (P unrounded).
        let deq = |x: &Fp8Input| dequantize_fp8(&x.x8, &x.descale, scaling, DType::F32).unwrap();
        let f32_out = FlashAttn::new()
            .causal(true)
            .forward(&deq(&q8), &deq(&k8), &deq(&v8))
            .unwrap();
        assert!(max_diff(&host(&out), &host(&f32_out)) < err);
    }
    // flash_attn on FP8 inputs: descales of 1.
    let x8 = quantize(&q, Fp8Scaling::PerTensor).x8;
    let one = Tensor::new(&[1f32], &CPU).unwrap();
    let ones = FlashAttn::new().causal(true).fp8_descales(&one, &one, &one);
    assert_eq!(
        host(&flash_attn(&x8, &x8, &x8, true).unwrap()),
        host(&ones.forward(&x8, &x8, &x8).unwrap())
    );
}

/// Rows that see no key: zeros and an LSE of -inf (causal with more queries than keys, no
/// keys at all); no query: an empty result.
#[test]
fn rows_without_keys_give_zeros_and_minus_infinity() {
    let mut rng = Rng(41);
    let fp8 = |t: Tensor| t.to_dtype(DType::F8E4M3).unwrap();
    let (q, k) = (
        fp8(rng.randn(&[2, 10, 4, 32], 1.0)),
        fp8(rng.randn(&[2, 4, 2, 32], 1.0)),
    );
    let (out, lse) = FlashAttn::new()
        .causal(true)
        .forward_with_lse(&q, &k, &k)
        .unwrap();
    let (out, lse) = (host(&out), host(&lse));
    for (i, row) in out.chunks(4 * 32).enumerate() {
        let zero = row.iter().all(|&x| x == 0.0);
        assert_eq!(zero, i % 10 < 6, "row {} of sequence {}", i % 10, i / 10);
    }
    for (i, l) in lse.iter().enumerate() {
        let row = i % 10;
        assert_eq!(*l == f64::NEG_INFINITY, row < 6, "lse {i}: {l}");
        assert!(!l.is_nan());
    }
    let none = fp8(rng.randn(&[2, 0, 2, 32], 1.0));
    let (out, lse) = FlashAttn::new().forward_with_lse(&q, &none, &none).unwrap();
    assert!(host(&out).iter().all(|&x| x == 0.0));
    assert!(host(&lse).iter().all(|&x| x == f64::NEG_INFINITY));
    let no_query = fp8(rng.randn(&[2, 0, 4, 32], 1.0));
    let (out, lse) = FlashAttn::new()
        .forward_with_lse(&no_query, &k, &k)
        .unwrap();
    assert_eq!(
        (out.dims(), out.dtype(), lse.dims()),
        (&[2, 0, 4, 32][..], DType::BF16, &[2, 4, 0][..])
    );
}

/// Strided q, k, v (only the last dimension contiguous) read like contiguous copies.
#[test]
fn strided_inputs_equal_contiguous_ones() {
    let mut rng = Rng(51);
    let fp8 = |t: Tensor| t.to_dtype(DType::F8E4M3).unwrap();
    let q = fp8(rng.randn(&[2, 4, 12, 32], 1.0))
        .transpose(1, 2)
        .unwrap();
    let k = fp8(rng.randn(&[2, 15, 2, 32], 1.0))
        .narrow(1, 2, 12)
        .unwrap();
    let v = fp8(rng.randn(&[2, 2, 12, 32], 1.0))
        .transpose(1, 2)
        .unwrap();
    assert!(!q.is_contiguous() && !k.is_contiguous() && !v.is_contiguous());
    let attn = FlashAttn::new().causal(true);
    let (a, la) = attn.forward_with_lse(&q, &k, &v).unwrap();
    let c = |t: &Tensor| t.contiguous().unwrap();
    let (b, lb) = attn.forward_with_lse(&c(&q), &c(&k), &c(&v)).unwrap();
    assert_eq!((host(&a), host(&la)), (host(&b), host(&lb)));
}

/// Each rule fails on an output with a planted bug: no P rounding (rule 2), a shifted
/// causal diagonal, the wrong K/V head for GQA, v's descale left out, and a wrong LSE.
#[test]
fn the_rules_catch_planted_bugs() {
    let mut rng = Rng(61);
    let (b, s, h, hk, d) = (1, 64, 4, 2, 64);
    let q = quantize(&rng.randn(&[b, s, h, d], 1.0), Fp8Scaling::PerHead);
    let k = quantize(&rng.randn(&[b, s, hk, d], 1.0), Fp8Scaling::PerHead);
    let v = quantize(&rng.randn(&[b, s, hk, d], 1.0), Fp8Scaling::PerHead);
    let seqs = vec![(0, s, 0, s)];
    let scale = 1.0 / (d as f64).sqrt();
    let o = oracle(
        &q.real,
        &k.real,
        &v.real,
        &seqs,
        (h, hk, d),
        scale,
        true,
        false,
    );
    let attn = FlashAttn::new()
        .causal(true)
        .out_dtype(DType::F32)
        .fp8_descales(&q.descale, &k.descale, &v.descale);
    let (out, lse) = attn.forward_with_lse(&q.x8, &k.x8, &v.x8).unwrap();
    let (out, lse) = (host(&out), host(&lse));
    let broken = |what: &str, out: &[f64], lse: &[f64]| {
        broken_rules(what, out, lse, &o, &v.real, DType::F32)
    };
    assert!(
        broken("the op", &out, &lse).is_empty(),
        "{:?}",
        broken("the op", &out, &lse)
    );
    let expect = |what: &str, out: &[f64], lse: &[f64], rule: &str| {
        let b = broken(what, out, lse);
        assert!(
            b.iter().any(|m| m.contains(rule)),
            "{what}: expected {rule} to fail, got {b:?}"
        );
    };
    // No P rounding: the exact attention itself.
    expect("unrounded P", &o.exact, &lse, "rule 2");
    // A shifted causal diagonal: each row sees one key more (the oracle of s + 1 keys,
    // key s a copy of key 0).
    let shifted = {
        let (mut kk, mut vv) = (k.real.clone(), v.real.clone());
        kk.extend_from_within(..hk * d);
        vv.extend_from_within(..hk * d);
        let seqs = vec![(0, s, 0, s + 1)];
        oracle(&q.real, &kk, &vv, &seqs, (h, hk, d), scale, true, false).emulated
    };
    expect("shifted diagonal", &shifted, &lse, "rule 1");
    // The wrong K/V head: query head h reads K/V head h % hk.
    let wrong_head = {
        let mut out = vec![0f64; out.len()];
        for hq in 0..h {
            let g = hq % hk;
            let pick = |x: &[f64], heads: usize, head: usize| -> Vec<f64> {
                (0..s)
                    .flat_map(|r| x[(r * heads + head) * d..][..d].to_vec())
                    .collect()
            };
            let one = oracle(
                &pick(&q.real, h, hq),
                &pick(&k.real, hk, g),
                &pick(&v.real, hk, g),
                &seqs,
                (1, 1, d),
                scale,
                true,
                false,
            );
            for r in 0..s {
                out[(r * h + hq) * d..][..d].copy_from_slice(&one.emulated[r * d..][..d]);
            }
        }
        out
    };
    expect("wrong K/V head", &wrong_head, &lse, "rule 1");
    // v's descale left out.
    let vd: Vec<f32> = v.descale.to_vec1().unwrap();
    let no_vd: Vec<f64> = out
        .iter()
        .enumerate()
        .map(|(i, x)| x / vd[(i / d) % h / (h / hk)] as f64)
        .collect();
    expect("no v descale", &no_vd, &lse, "rule 1");
    // An LSE off by 1e-4.
    let off: Vec<f64> = lse.iter().map(|l| l + 1e-4).collect();
    expect("lse + 1e-4", &out, &off, "rule 3");
}

/// Every error: the dtypes of q, k, v, the options FP8 refuses, descales and out_dtype of the
/// wrong kind, FP8 options on other inputs, the backward, head dims, strides.
#[test]
fn errors_name_the_argument() {
    let mut rng = Rng(71);
    let f32s = rng.randn(&[1, 8, 4, 16], 1.0);
    let x8 = f32s.to_dtype(DType::F8E4M3).unwrap();
    let kv8 = rng
        .randn(&[1, 8, 2, 16], 1.0)
        .to_dtype(DType::F8E4M3)
        .unwrap();
    let bf = f32s.to_dtype(DType::BF16).unwrap();
    let fa = FlashAttn::new();
    // All three F8E4M3.
    assert_fails(fa.forward(&x8, &bf, &x8), &["k: dtype BF16", "q is F8E4M3"]);
    assert_fails(fa.forward(&x8, &x8, &f32s), &["v: dtype F32", "F8E4M3"]);
    assert_fails(fa.forward(&bf, &x8, &x8), &["q: dtype BF16", "k is F8E4M3"]);
    let packed = x8.squeeze(0).unwrap();
    let varlen = VarLen::from_seqlens(&[8], &[8]).unwrap();
    assert_fails(
        fa.forward_varlen(
            &packed,
            &packed.to_dtype(DType::F32).unwrap(),
            &packed,
            &varlen,
        ),
        &["k: dtype F32"],
    );
    // Options FP8 does not take.
    let slopes = Tensor::ones(4, DType::F32, &CPU).unwrap();
    let mask = candle_flash::BlockMask::local_global(8, 8, 64, 1, 1, &CPU).unwrap();
    let table = Tensor::ones((8, 8), DType::F32, &CPU).unwrap();
    let refused = [
        ("dropout_p", FlashAttn::new().dropout(0.1)),
        ("window_size", FlashAttn::new().window(Some(2), Some(0))),
        ("softcap", FlashAttn::new().softcap(30.0)),
        ("alibi_slopes", FlashAttn::new().alibi_slopes(&slopes)),
        ("block_mask", FlashAttn::new().block_mask(&mask)),
        ("sinks", FlashAttn::new().sinks(&slopes)),
        ("rotary", FlashAttn::new().rotary(&table, &table, false)),
        (
            "kv_cache_scales",
            FlashAttn::new().kv_cache_scales(&slopes, &slopes),
        ),
    ];
    for (name, opts) in &refused {
        let expected = [&format!("{name}:")[..], "FP8 (F8E4M3)"];
        assert_fails(opts.forward(&x8, &kv8, &kv8), &expected);
        assert_fails(
            opts.forward_varlen(&packed, &packed, &packed, &varlen),
            &expected,
        );
    }
    // The backward: direct and through autograd.
    let (out, lse) = fa.forward_with_lse(&x8, &kv8, &kv8).unwrap();
    assert_fails(
        fa.backward(&x8, &kv8, &kv8, &out, &lse, &out),
        &["backward", "inference only"],
    );
    let qv = Var::from_tensor(&x8).unwrap();
    let traced = fa.forward(&qv, &kv8, &kv8).unwrap();
    assert_fails(
        traced
            .to_dtype(DType::F32)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward(),
        &["backward", "inference only"],
    );
    // Descales of the wrong dtype, rank, length; k's and v's are per K/V head.
    let t = |v: &[f32]| Tensor::new(v, &CPU).unwrap();
    let one = t(&[1.0]);
    let bad = [
        ("q", t(&[1.0]).to_dtype(DType::F16).unwrap(), "(4,)"),
        ("q", Tensor::new(1f32, &CPU).unwrap(), "(4,)"),
        ("q", t(&[1.0; 3]), "(4,)"),
        ("q", Tensor::ones((1, 4), DType::F32, &CPU).unwrap(), "(4,)"),
        ("k", t(&[1.0; 4]), "(2,)"),
        ("v", t(&[1.0; 4]), "(2,)"),
        ("v", t(&[]), "(2,)"),
    ];
    for (name, d, shape) in &bad {
        let opts = match *name {
            "q" => fa.clone().fp8_descales(d, &one, &one),
            "k" => fa.clone().fp8_descales(&one, d, &one),
            _ => fa.clone().fp8_descales(&one, &one, d),
        };
        let expected = [
            "fp8_descales",
            &format!("{name}'s descale")[..],
            "(1,)",
            shape,
        ];
        assert_fails(opts.forward(&x8, &kv8, &kv8), &expected);
    }
    // Output dtypes the device does not write.
    for dt in [DType::U8, DType::F64, DType::F8E4M3] {
        assert_fails(
            fa.clone().out_dtype(dt).forward(&x8, &kv8, &kv8),
            &["out_dtype", &format!("{dt:?}")],
        );
    }
    // FP8 options with other inputs.
    let fd = fa.clone().fp8_descales(&one, &one, &one);
    assert_fails(fd.forward(&f32s, &f32s, &f32s), &["fp8_descales", "F32"]);
    assert_fails(
        fd.forward_varlen(
            &packed.to_dtype(DType::F32).unwrap(),
            &packed.to_dtype(DType::F32).unwrap(),
            &packed.to_dtype(DType::F32).unwrap(),
            &varlen,
        ),
        &["fp8_descales"],
    );
    let od = fa.clone().out_dtype(DType::F32);
    assert_fails(od.forward(&bf, &bf, &bf), &["out_dtype", "BF16"]);
    let g = f32s.clone();
    assert_fails(
        od.backward(&f32s, &f32s, &f32s, &g, &g.narrow(3, 0, 1).unwrap(), &g),
        &["out_dtype"],
    );
    // ... and in the KV-cache calls.
    let cache = Tensor::zeros((1, 8, 4, 16), DType::F32, &CPU).unwrap();
    let q1 = f32s.narrow(1, 0, 1).unwrap();
    for opts in [&fd, &od] {
        assert_fails(
            flash_attn_with_kvcache(&q1, &cache, &cache, None, &[4u32][..], opts),
            &["fp8_descales / out_dtype"],
        );
    }
    // Head dims and strides.
    let wide = Tensor::zeros((1, 2, 1, 257), DType::F32, &CPU)
        .unwrap()
        .to_dtype(DType::F8E4M3)
        .unwrap();
    assert_fails(fa.forward(&wide, &wide, &wide), &["head_dim", "1..=256"]);
    let strided = Tensor::zeros((1, 2, 16, 2), DType::F32, &CPU)
        .unwrap()
        .to_dtype(DType::F8E4M3)
        .unwrap()
        .transpose(2, 3)
        .unwrap();
    assert_fails(
        fa.forward(&strided, &strided, &strided),
        &["q:", "contiguous"],
    );
    // Shapes: the usual messages.
    assert_fails(
        fa.forward(&x8, &kv8.narrow(1, 0, 3).unwrap(), &kv8),
        &["v:", "seqlen"],
    );
    assert_fails(fa.forward(&packed, &packed, &packed), &["q:", "rank 4"]);
}

/// The Walsh–Hadamard matrix from Sylvester's recursion `H_2n = [[H, H], [H, -H]]`,
/// normalised: `(d, d)` row-major.
fn sylvester(d: usize) -> Vec<f64> {
    let mut h = vec![1f64];
    let mut n = 1;
    while n < d {
        let mut next = vec![0f64; 4 * n * n];
        for i in 0..n {
            for j in 0..n {
                let x = h[i * n + j];
                next[i * 2 * n + j] = x;
                next[i * 2 * n + j + n] = x;
                next[(i + n) * 2 * n + j] = x;
                next[(i + n) * 2 * n + j + n] = -x;
            }
        }
        h = next;
        n *= 2;
    }
    let norm = 1.0 / (d as f64).sqrt();
    h.into_iter().map(|x| x * norm).collect()
}

/// hadamard of the identity is the normalised Sylvester matrix; applied twice it is the
/// identity; it keeps row norms.
#[test]
fn hadamard_is_the_orthonormal_walsh_matrix() {
    for d in [1, 2, 4, 8, 16, 64, 128, 256] {
        let eye = Tensor::eye(d, DType::F64, &CPU).unwrap();
        let h = host(&hadamard(&eye).unwrap());
        assert!(max_diff(&h, &sylvester(d)) < 1e-15, "d {d}");
        let mut rng = Rng(d as u64);
        let x = rng.randn(&[3, 5, 2, d], 2.0);
        let hx = hadamard(&x).unwrap();
        assert_eq!((hx.dims(), hx.dtype()), (x.dims(), DType::F32));
        let back = hadamard(&hx).unwrap();
        let (xs, bs) = (host(&x), host(&back));
        assert!(
            max_diff(&xs, &bs) <= 1e-5 * max_abs(&xs),
            "d {d}: round trip"
        );
        let norms = |v: &[f64]| -> Vec<f64> {
            v.chunks(d)
                .map(|r| r.iter().map(|x| x * x).sum::<f64>().sqrt())
                .collect()
        };
        assert!(
            max_diff(&norms(&xs), &norms(&host(&hx))) < 1e-4,
            "d {d}: norms"
        );
        if d > 1 {
            assert!(max_diff(&xs, &host(&hx)) > 0.1, "d {d}: not the identity");
        }
    }
}

/// Rotating q and k leaves their scores unchanged; an outlier feature spreads evenly over
/// the rotated row; the dtype is kept; strided and rank-2 inputs work; gradients flow.
#[test]
fn hadamard_keeps_scores_and_spreads_outliers() {
    let mut rng = Rng(81);
    let (q, k) = (
        rng.randn(&[1, 16, 2, 128], 1.0),
        rng.randn(&[1, 16, 2, 128], 1.0),
    );
    let scores = |q: &Tensor, k: &Tensor| {
        let (q, k) = (q.transpose(1, 2).unwrap(), k.transpose(1, 2).unwrap());
        host(&q.matmul(&k.t().unwrap()).unwrap())
    };
    let (qh, kh) = (hadamard(&q).unwrap(), hadamard(&k).unwrap());
    assert!(max_diff(&scores(&q, &k), &scores(&qh, &kh)) < 1e-4);
    let mut spike = vec![0f32; 128];
    spike[17] = 100.0;
    let rotated = host(&hadamard(&Tensor::new(spike.as_slice(), &CPU).unwrap()).unwrap());
    let flat = 100.0 / 128f64.sqrt();
    assert!(
        rotated.iter().all(|x| (x.abs() - flat).abs() < 1e-4),
        "{rotated:?}"
    );
    for dt in [DType::BF16, DType::F16, DType::F64] {
        let x = q.to_dtype(dt).unwrap();
        let y = hadamard(&x).unwrap();
        assert_eq!(y.dtype(), dt);
        let tol = if dt == DType::F64 { 1e-5 } else { 0.05 };
        assert!(max_diff(&host(&y), &host(&qh)) < tol, "{dt:?}");
    }
    let strided = rng.randn(&[2, 128, 3], 1.0).transpose(1, 2).unwrap();
    let want = hadamard(&strided.contiguous().unwrap()).unwrap();
    assert_eq!(host(&hadamard(&strided).unwrap()), host(&want));
    let var = Var::from_tensor(&rng.randn(&[4, 8], 1.0)).unwrap();
    let grads = hadamard(&var)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    // d/dx sum(x H) = the row sums of H: sqrt(8) for column 0, 0 for the others.
    let g = host(grads.get(&var).unwrap());
    for (i, x) in g.iter().enumerate() {
        let want = if i % 8 == 0 { 8f64.sqrt() } else { 0.0 };
        assert!((x - want).abs() < 1e-5, "grad {i}: {x}");
    }
    assert_eq!(
        hadamard(&Tensor::zeros((0, 4), DType::F32, &CPU).unwrap())
            .unwrap()
            .dims(),
        &[0, 4]
    );
}

#[test]
fn hadamard_errors() {
    for d in [0, 3, 6, 96, 2 * MAX_HADAMARD_DIM] {
        let x = Tensor::zeros((2, d), DType::F32, &CPU).unwrap();
        assert_fails(hadamard(&x), &["x:", "power of two", &format!("got {d}")]);
    }
    assert_fails(hadamard(&Tensor::new(1f32, &CPU).unwrap()), &["x:", "rank"]);
    let x8 = Tensor::zeros((2, 8), DType::F32, &CPU)
        .unwrap()
        .to_dtype(DType::F8E4M3)
        .unwrap();
    assert_fails(hadamard(&x8), &["x:", "F8E4M3", "before quantizing"]);
    assert_fails(
        hadamard(&Tensor::zeros((2, 8), DType::U32, &CPU).unwrap()),
        &["x:", "U32"],
    );
}
