//! Drawing a case: shapes first (bounded by the oracle's cost), then the options.

use candle::DType;
use rand::{rngs::StdRng, Rng, SeedableRng};

use super::{Batch, BlockKind, Blocks, Config, Grad, Side, Target, View, WindowApi};

/// Sizes the generator stays within.
struct Limits {
    max_seq: usize,
    max_batch: usize,
    max_kv_heads: usize,
    /// Bound on `sum over sequences of h · len_q · len_k · d`, the work of one attention.
    max_work: usize,
}

impl Target {
    fn limits(self) -> Limits {
        match self {
            Target::Cuda { long: true } => Limits {
                max_seq: 1100,
                max_batch: 4,
                max_kv_heads: 8,
                max_work: 400 << 20,
            },
            _ => Limits {
                max_seq: 260,
                max_batch: 3,
                max_kv_heads: 4,
                max_work: 3 << 20,
            },
        }
    }
}

/// `p` percent of the time.
fn chance(rng: &mut StdRng, percent: u32) -> bool {
    rng.random_range(0..100) < percent
}

fn pick<T: Copy>(rng: &mut StdRng, xs: &[T]) -> T {
    xs[rng.random_range(0..xs.len())]
}

/// A sequence length: 0 and 1, the CPU and GPU tile edges, and spread over `1..=max`.
fn seqlen(rng: &mut StdRng, max: usize) -> usize {
    const EDGES: [usize; 12] = [2, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256];
    match rng.random_range(0..100) {
        0..5 => 0,
        5..13 => 1,
        13..25 => pick(rng, &EDGES).min(max),
        25..55 => rng.random_range(2..=40.min(max)),
        55..80 => rng.random_range(2..=140.min(max)),
        _ => rng.random_range(2..=max),
    }
}

fn head_dim(rng: &mut StdRng, target: Target) -> usize {
    match target {
        Target::Cpu if chance(rng, 50) => {
            pick(rng, &[1, 2, 3, 5, 8, 16, 32, 40, 64, 80, 96, 128, 160, 256])
        }
        Target::Cpu => rng.random_range(1..=256),
        Target::Cuda { .. } if chance(rng, 60) => {
            pick(rng, &[8, 32, 40, 64, 96, 128, 160, 192, 256])
        }
        Target::Cuda { .. } => 8 * rng.random_range(1..=32),
    }
}

/// Draws the case of `seed` for `target`.
pub fn generate(seed: u64, target: Target) -> Config {
    let rng = &mut StdRng::seed_from_u64(seed);
    let limits = target.limits();
    let dtype = match (target, rng.random_range(0..10)) {
        (Target::Cpu, 0..4) => DType::F32,
        (_, 0..5) => DType::F16,
        _ => DType::BF16,
    };
    let hk = rng.random_range(1..=limits.max_kv_heads);
    let mut h = hk * pick(rng, &[1, 1, 2, 3, 4]);
    // Empty tensors are valid (an empty output, or zeros), but Candle's CUDA backend cannot
    // make one (cudarc asks cuMemAlloc for 0 bytes: CUDA_ERROR_INVALID_VALUE), so neither our
    // inputs nor the oracle's results exist there: zero sizes are the CPU test's.
    let empty_ok = target == Target::Cpu;
    if chance(rng, 3) && empty_ok {
        h = 0;
    }
    let mut d = head_dim(rng, target);
    let kind = rng.random_range(0..100);
    let b = rng.random_range(1..=limits.max_batch);
    let mut lens: Vec<(usize, usize)> = (0..b)
        .map(|_| {
            let lq = seqlen(rng, limits.max_seq);
            let lk = if chance(rng, 30) {
                lq
            } else {
                seqlen(rng, limits.max_seq)
            };
            (lq, lk)
        })
        .collect();
    if kind < 60 {
        // A fixed-length batch: every sequence has the first one's lengths.
        let first = lens[0];
        lens.iter_mut().for_each(|l| *l = first);
        if chance(rng, 3) && empty_ok {
            lens.clear(); // batch 0
        }
    }
    if !empty_ok {
        // Every tensor non-empty: each side has a row somewhere (packed sequences of length
        // 0 stay), and a fixed-length batch has rows everywhere.
        let (no_q, no_k) = (lens.iter().all(|l| l.0 == 0), lens.iter().all(|l| l.1 == 0));
        for (lq, lk) in &mut lens {
            if kind < 60 || no_q {
                *lq = (*lq).max(1);
            }
            if kind < 60 || no_k {
                *lk = (*lk).max(1);
            }
        }
    }
    // Keep the oracle's cost in bounds: shorter sequences, fewer heads, smaller head dims.
    let work = |lens: &[(usize, usize)], h: usize, d: usize| -> usize {
        lens.iter().map(|(q, k)| q * k).sum::<usize>() * h.max(1) * d
    };
    while work(&lens, h, d) > limits.max_work {
        if d > 64 && chance(rng, 50) {
            d /= 2;
            if target != Target::Cpu {
                d = d.div_ceil(8) * 8;
            }
        } else if h > hk && h > 1 {
            h = hk;
        } else if lens.len() > 1 && chance(rng, 50) {
            lens.pop();
        } else {
            let (q, k) = lens
                .iter_mut()
                .max_by_key(|(q, k)| q * k)
                .expect("a sequence");
            (*q, *k) = (q.div_ceil(2), k.div_ceil(2));
        }
    }
    let (batch, b, sq, sk) = if kind < 60 {
        let (sq, sk) = lens
            .first()
            .copied()
            .unwrap_or((rng.random_range(0..40), 7));
        (Batch::Fixed, lens.len(), sq, sk)
    } else if kind < 85 {
        let (lens_q, lens_k): (Vec<_>, Vec<_>) = lens.iter().copied().unzip();
        let (tq, tk) = (lens_q.iter().sum(), lens_k.iter().sum());
        (Batch::Varlen { lens_q, lens_k }, lens.len(), tq, tk)
    } else {
        let (sq, sk) = lens
            .iter()
            .fold((1, 1), |(a, b), l| (a.max(l.0), b.max(l.1)));
        let (sq, sk) = (sq + rng.random_range(0..4), sk + rng.random_range(0..4));
        let pattern = pick(rng, &["right", "left", "random"]);
        let mask = |rng: &mut StdRng, s: usize, len: usize| -> Vec<u8> {
            match pattern {
                "right" => (0..s).map(|i| u8::from(i < len)).collect(),
                "left" => (0..s).map(|i| u8::from(i >= s - len)).collect(),
                _ => {
                    let mut m: Vec<u8> = (0..s).map(|i| u8::from(i < len)).collect();
                    for i in (1..s).rev() {
                        m.swap(i, rng.random_range(0..=i));
                    }
                    m
                }
            }
        };
        let q_mask = lens.iter().flat_map(|l| mask(rng, sq, l.0)).collect();
        let kv_mask = lens.iter().flat_map(|l| mask(rng, sk, l.1)).collect();
        let batch = Batch::Padded {
            pattern,
            q_mask,
            kv_mask,
        };
        (batch, lens.len(), sq, sk)
    };
    let mut cfg = Config {
        seed,
        dtype,
        batch,
        b,
        sq,
        sk,
        h,
        hk,
        d,
        causal: chance(rng, 40),
        window: None,
        bad_window: None,
        softcap: 0.0,
        scale: None,
        alibi: None,
        blocks: None,
        dropout: None,
        views: [View::Contiguous; 3],
        grad: Grad::Autograd,
        deterministic: chance(rng, 20),
        amplitude: if chance(rng, 15) { 3.0 } else { 1.0 },
    };
    draw_options(rng, &mut cfg, target);
    cfg
}

/// The options: window, softcap, scale, ALiBi, block mask, dropout, views, gradients, and
/// (rarely) one invalid value.
fn draw_options(rng: &mut StdRng, cfg: &mut Config, target: Target) {
    let (mq, mk) = cfg.max_lens();
    let lens_k: Vec<usize> = cfg.seqs().iter().map(|s| s.3).collect();
    if chance(rng, 40) {
        let side = |rng: &mut StdRng| -> Side {
            let near = lens_k
                .get(rng.random_range(0..lens_k.len().max(1)))
                .copied();
            let near = near.unwrap_or(0) as u64;
            match rng.random_range(0..10) {
                0 | 1 => Side::Open,
                2 => Side::Size(0),
                3 => Side::Size(rng.random_range(1..=3)),
                4 => Side::Size(rng.random_range(0..=mk as u64 + 1)),
                5 | 6 => Side::Size((near + rng.random_range(0..3)).saturating_sub(1)),
                7 => Side::Size(pick(rng, &[i64::MAX as u64, u64::MAX])),
                _ => Side::Size(rng.random_range(4..=70)),
            }
        };
        let (left, right) = (side(rng), side(rng));
        let mut api = pick(rng, &[WindowApi::WindowSize, WindowApi::Window]);
        if left == Side::Size(u64::MAX) || right == Side::Size(u64::MAX) {
            api = WindowApi::Window; // usize::MAX only exists as an Option<usize>
        }
        cfg.window = Some((left, right, api));
    }
    if chance(rng, 25) {
        cfg.softcap = 2f32.powf(rng.random_range(-1.0..5.5));
    }
    if chance(rng, 15) {
        cfg.scale = Some(2f32.powf(rng.random_range(-4.0..0.7)));
    }
    if chance(rng, 25) && cfg.h > 0 {
        let per_batch = chance(rng, 50);
        let n = if per_batch { cfg.b * cfg.h } else { cfg.h };
        let slopes = (0..n)
            .map(|_| match rng.random_range(0..10) {
                0 => 0.0,
                1 => -rng.random_range(0.0..0.3f32),
                _ => 2f32.powf(rng.random_range(-8.0..0.5)),
            })
            .collect();
        cfg.alibi = Some((per_batch, slopes));
    }
    if chance(rng, if mq > 64 || mk > 64 { 30 } else { 10 }) {
        cfg.blocks = Some(draw_blocks(rng, cfg.h, (mq, mk)));
    }
    if chance(rng, 25) {
        let p = match rng.random_range(0..4) {
            0 => 0.5,
            1 => 0.17,
            2 => 0.9,
            _ => rng.random_range(0.02..0.6),
        };
        let offset = if chance(rng, 20) {
            u64::MAX - rng.random_range(0..4)
        } else {
            rng.random()
        };
        cfg.dropout = Some((p, rng.random(), offset));
    }
    for view in &mut cfg.views {
        *view = match rng.random_range(0..12) {
            0 | 1 => View::HeadsMajor,
            2 => View::Rows {
                before: rng.random_range(0..5),
                after: rng.random_range(0..5),
            },
            3 => {
                let pad = rng.random_range(1..=9);
                View::Wide {
                    pad,
                    off: rng.random_range(0..=pad),
                }
            }
            _ => View::Contiguous,
        };
    }
    cfg.grad = match rng.random_range(0..10) {
        0 | 1 => Grad::None,
        2 | 3 if matches!(cfg.batch, Batch::Fixed) => Grad::Direct,
        _ => Grad::Autograd,
    };
    if chance(rng, 4) {
        // One value outside the contract: the op must name it in an error.
        match rng.random_range(0..7) {
            0 if target == Target::Cpu => {
                (cfg.hk, cfg.h, cfg.alibi, cfg.blocks) = (0, 2, None, None)
            }
            1 if target == Target::Cpu => cfg.d = 0,
            2 => cfg.d = candle_flash::MAX_HEAD_DIM + pick(rng, &[1, 8]),
            3 if target != Target::Cpu => cfg.d = 8 * rng.random_range(1..=20) + 4,
            3 => cfg.scale = Some(pick(rng, &[0.0, -0.5])),
            4 => cfg.dropout = Some((pick(rng, &[1.0, 1.5, -0.1]), 1, 2)),
            5 => cfg.bad_window = Some(-rng.random_range(2..1000)),
            _ => cfg.softcap = -rng.random_range(0.5..10.0f32),
        }
    }
}

/// A block mask over `(sq, sk)`: random states, a random element mask (blocks empty, full or
/// partial), or one of the named patterns.
fn draw_blocks(rng: &mut StdRng, h: usize, (sq, sk): (usize, usize)) -> Blocks {
    let heads = if h > 1 && chance(rng, 40) { h } else { 1 };
    let (block_q, mut block_k) = (pick(rng, &[64, 64, 128]), pick(rng, &[64, 64, 128]));
    let density = pick(rng, &[0.0, 0.3, 0.6, 0.9, 1.0]);
    let kind = match rng.random_range(0..8) {
        0..3 => {
            let (rows, cols) = (sq.div_ceil(block_q), sk.div_ceil(block_k));
            let states = (0..heads * rows * cols)
                .map(|_| u8::from(rng.random_bool(density)))
                .collect();
            BlockKind::States(states)
        }
        3..6 => {
            // Each block empty, full or partial (then a random element mask inside), so that
            // all three states and blocks cut short by the lengths occur.
            let (rows, cols) = (sq.div_ceil(block_q), sk.div_ceil(block_k));
            let block_state: Vec<u8> = (0..heads * rows * cols)
                .map(|_| rng.random_range(0..3))
                .collect();
            let mut elements = Vec::with_capacity(heads * sq * sk);
            for hh in 0..heads {
                for i in 0..sq {
                    for j in 0..sk {
                        let state = block_state[(hh * rows + i / block_q) * cols + j / block_k];
                        elements.push(match state {
                            0 => 0,
                            1 => 1,
                            _ => u8::from(rng.random_bool(density.max(0.2))),
                        });
                    }
                }
            }
            BlockKind::Dense(elements)
        }
        6 => BlockKind::LocalGlobal {
            local: rng.random_range(0..3),
            global: rng.random_range(0..2),
        },
        _ if chance(rng, 50) => BlockKind::Strided {
            stride: rng.random_range(1..4),
        },
        _ => BlockKind::Butterfly,
    };
    if !matches!(kind, BlockKind::States(_) | BlockKind::Dense(_)) {
        block_k = block_q; // the patterns have square blocks, shared by every head
        return Blocks {
            kind,
            block_q,
            block_k,
            heads: 1,
            full: (sq, sk),
        };
    }
    Blocks {
        kind,
        block_q,
        block_k,
        heads,
        full: (sq, sk),
    }
}

/// `n` standard-normal values times `amplitude`, by Box-Muller from `rng`.
pub fn normals(rng: &mut StdRng, n: usize, amplitude: f32) -> Vec<f32> {
    let mut out = Vec::with_capacity(n + 1);
    while out.len() < n {
        let (u1, u2): (f64, f64) = (rng.random::<f64>().max(1e-300), rng.random());
        let (r, t) = ((-2.0 * u1.ln()).sqrt(), std::f64::consts::TAU * u2);
        out.push((r * t.cos()) as f32 * amplitude);
        out.push((r * t.sin()) as f32 * amplitude);
    }
    out.truncate(n);
    out
}
