//! GPU tests for block-sparse attention (issue 20): forward and gradients against
//! `attention_slow_with` with the same `BlockMask` (the oracle expands it to a dense mask),
//! at 0%, ~10%, 50% and 100% of blocks, per-head and shared masks, masks from a dense boolean
//! mask (element masks inside blocks) and the pattern constructors, with causal, GQA, packed
//! batches and deterministic backwards. The head dims reach every kernel the router picks: 40
//! and 96 the mma.sync kernels, 64, 128 and 256 the warp-specialized forward and backward
//! (`_sparse`), packed batches the first wgmma kernels, deterministic backwards the
//! warp-specialized `_sparse_det` kernels at 64, 128 and 256 (dQ added in key-block order,
//! each key block after the next one above it that sees the tile) and the separate mma.sync
//! kernels at 40 and 96; each deterministic case runs its backward twice for the same bits.
//! Block sizes of 64 and 192 make the kernels' tiles straddle blocks.

use candle::{DType, Device, Result, Tensor};
use candle_flash::{attention_slow_with, BlockMask, FlashAttn};

use crate::cuda_suite::{
    check_against_slow, check_varlen_against_slow, grads_of, randn, reference_device, tensor_bits,
    Suite,
};

/// A block mask, built the same way on any device.
#[derive(Clone, Copy, Debug)]
enum Kind {
    /// Random blocks kept with this probability (per head when `per_head`); 0 and 1 are the
    /// empty and the full mask.
    Random {
        density: f64,
        per_head: bool,
    },
    /// From a random dense element mask in which a third of the blocks are entirely visible, a
    /// third hidden and a third half visible.
    Dense,
    LocalGlobal,
    Butterfly,
    Strided,
}

/// A deterministic pseudo-random stream (the masks must be equal on every device).
fn lcg(seed: u64) -> impl FnMut() -> f64 {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    move || {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (x >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn build(
    kind: Kind,
    sq: usize,
    sk: usize,
    h: usize,
    bs: (usize, usize),
    dev: &Device,
) -> Result<BlockMask> {
    let (rows, cols) = (sq.div_ceil(bs.0), sk.div_ceil(bs.1));
    match kind {
        Kind::Random { density, per_head } => {
            let heads = if per_head { h } else { 1 };
            let mut next = lcg(rows as u64 * 131 + cols as u64);
            let v: Vec<u8> = (0..heads * rows * cols)
                .map(|_| u8::from(next() < density))
                .collect();
            BlockMask::new(&Tensor::from_vec(v, (heads, rows, cols), dev)?, bs.0, bs.1)
        }
        Kind::Dense => {
            let mut next = lcg(sq as u64 * 7 + sk as u64);
            let v: Vec<u8> = (0..h * sq * sk)
                .map(|x| {
                    let (i, j) = (x / sk % sq, x % sk);
                    match (i / bs.0 + j / bs.1 + x / (sq * sk)) % 3 {
                        0 => 1,
                        1 => 0,
                        _ => u8::from(next() < 0.5),
                    }
                })
                .collect();
            BlockMask::from_dense(&Tensor::from_vec(v, (h, sq, sk), dev)?, bs.0, bs.1)
        }
        Kind::LocalGlobal => BlockMask::local_global(sq, sk, bs.0, 1, 1, dev),
        Kind::Butterfly => BlockMask::butterfly(sq, sk, bs.0, dev),
        Kind::Strided => BlockMask::strided(sq, sk, bs.0, 3, dev),
    }
}

#[derive(Clone, Copy, Debug)]
struct Case {
    b: usize,
    sq: usize,
    sk: usize,
    h: usize,
    hk: usize,
    d: usize,
    causal: bool,
    kind: Kind,
    block: (usize, usize),
    deterministic: bool,
}

impl std::fmt::Display for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "b={} sq={} sk={} h={}/{} d={} causal={} {:?} block={:?} det={}",
            self.b,
            self.sq,
            self.sk,
            self.h,
            self.hk,
            self.d,
            self.causal,
            self.kind,
            self.block,
            self.deterministic
        )
    }
}

/// Output (2x rule) and gradients of `sum(out * w)` (3x rule) against the f32 oracle, with the
/// same math in bf16 as the baseline. An empty mask must give zeros, LSE -inf and zero
/// gradients exactly.
fn case(dev: &Device, c: &Case) -> Result<()> {
    let dtype = DType::BF16;
    let q = randn((c.b, c.sq, c.h, c.d), dtype, dev)?;
    let k = randn((c.b, c.sk, c.hk, c.d), dtype, dev)?;
    let v = randn((c.b, c.sk, c.hk, c.d), dtype, dev)?;
    let w = randn((c.b, c.sq, c.h, c.d), dtype, dev)?;
    let mask = build(c.kind, c.sq, c.sk, c.h, c.block, dev)?;
    let ours_opts = FlashAttn::new()
        .causal(c.causal)
        .deterministic(c.deterministic)
        .block_mask(&mask);
    let (out, lse) = ours_opts.forward_with_lse(&q, &k, &v)?;
    let ours = grads_of(&q, &k, &v, &w, |q, k, v| ours_opts.forward(q, k, v))?;
    if c.deterministic {
        let again = grads_of(&q, &k, &v, &w, |q, k, v| ours_opts.forward(q, k, v))?;
        for (name, (a, b)) in ["dq", "dk", "dv"].iter().zip(ours.iter().zip(&again)) {
            if tensor_bits(a)? != tensor_bits(b)? {
                candle::bail!("deterministic: a second backward gives another {name}");
            }
        }
    }
    if let Kind::Random { density, .. } = c.kind {
        if density == 0.0 {
            let max_abs = |t: &Tensor| -> Result<f32> {
                t.to_dtype(DType::F32)?
                    .abs()?
                    .flatten_all()?
                    .max(0)?
                    .to_scalar::<f32>()
            };
            let lse_max = lse.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            if max_abs(&out)? != 0.0 || lse_max != f32::NEG_INFINITY {
                candle::bail!("empty mask: output or LSE not zeros / -inf");
            }
            for g in &ours {
                if max_abs(g)? != 0.0 {
                    candle::bail!("empty mask: a gradient is not zero");
                }
            }
            return Ok(());
        }
    }

    let ref_mask = build(c.kind, c.sq, c.sk, c.h, c.block, &reference_device(dev))?;
    let ref_opts = FlashAttn::new().causal(c.causal).block_mask(&ref_mask);
    check_against_slow(&out, &ours, [&q, &k, &v, &w], |q, k, v| {
        attention_slow_with(q, k, v, &ref_opts)
    })
}

/// A packed batch through `forward_varlen` against each sequence on its own, with the top-left
/// part of the mask that its lengths cover.
fn varlen_case(dev: &Device, d: usize, kind: Kind, causal: bool) -> Result<()> {
    let (lens_q, lens_k) = ([37usize, 1, 300], [90usize, 64, 250]);
    let (h, bs, (mq, mk)) = (4, (64, 64), (300, 250));
    let opts = FlashAttn::new()
        .causal(causal)
        .block_mask(&build(kind, mq, mk, h, bs, dev)?);
    let full = build(kind, mq, mk, h, bs, &reference_device(dev))?;
    check_varlen_against_slow(dev, d, (h, 2), (&lens_q, &lens_k), &opts, |_, lq, lk| {
        let mask = BlockMask::from_dense(&full.to_dense(lq, lk)?, bs.0, bs.1)?;
        Ok(FlashAttn::new().causal(causal).block_mask(&mask))
    })
}

/// Dropout with a block mask: the CUDA kernels and the CPU path drop the same entries, so the
/// CPU's f32 result on the same bf16 inputs is the reference; the bound is what bf16 rounding
/// of P and the output allows at these sizes (a lost block or a wrong dropped entry moves
/// outputs by ~0.1 and more).
fn dropout_case(dev: &Device) -> Result<()> {
    let (b, s, h, hk, d) = (2, 300, 4, 2, 64);
    let q = randn((b, s, h, d), DType::BF16, dev)?;
    let k = randn((b, s, hk, d), DType::BF16, dev)?;
    let v = randn((b, s, hk, d), DType::BF16, dev)?;
    let kind = Kind::Random {
        density: 0.5,
        per_head: true,
    };
    let opts = |dev: &Device| -> Result<FlashAttn> {
        Ok(FlashAttn::new()
            .causal(true)
            .dropout(0.2)
            .rng_offset(7)
            .block_mask(&build(kind, s, s, h, (64, 64), dev)?))
    };
    let ours = opts(dev)?.forward(&q, &k, &v)?;
    let cpu = Device::Cpu;
    let f32_cpu = |t: &Tensor| t.to_device(&cpu)?.to_dtype(DType::F32);
    let reference = opts(&cpu)?.forward(&f32_cpu(&q)?, &f32_cpu(&k)?, &f32_cpu(&v)?)?;
    let err = (f32_cpu(&ours)? - &reference)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()?;
    if err.is_nan() || err >= 3e-2 {
        candle::bail!("dropout + block mask: CUDA vs CPU max error {err:.3e}");
    }
    Ok(())
}

/// A mask on the CPU for CUDA inputs, and a mask that does not cover the call: errors naming
/// `block_mask`.
fn bad_masks(dev: &Device) -> Result<()> {
    let q = randn((1, 128, 4, 64), DType::BF16, dev)?;
    let (k, v) = (q.copy()?, q.copy()?);
    let check = |r: Result<Tensor>, what: &str| match r {
        Err(e) if e.to_string().contains("block_mask") => Ok(()),
        Err(e) => candle::bail!("{what}: error does not name block_mask: {e}"),
        Ok(_) => candle::bail!("{what}: accepted"),
    };
    let on_cpu = BlockMask::local_global(128, 128, 64, 1, 0, &Device::Cpu)?;
    check(
        FlashAttn::new().block_mask(&on_cpu).forward(&q, &k, &v),
        "mask on the CPU",
    )?;
    let small = BlockMask::local_global(64, 128, 64, 1, 0, dev)?;
    check(
        FlashAttn::new().block_mask(&small).forward(&q, &k, &v),
        "mask too small",
    )
}

pub(crate) fn run(dev: &Device, quick: bool, suite: &mut Suite) {
    let random = |density: f64, per_head: bool| Kind::Random { density, per_head };
    let kinds = [
        random(0.0, false),
        random(0.1, true),
        random(0.5, false),
        random(0.5, true),
        random(1.0, false),
        Kind::Dense,
        Kind::LocalGlobal,
        Kind::Butterfly,
        Kind::Strided,
    ];
    let dims: &[usize] = if quick {
        &[64, 128]
    } else {
        &[40, 64, 96, 128, 256]
    };
    let seqs: &[(usize, usize)] = if quick {
        &[(203, 300)]
    } else {
        &[(203, 300), (300, 203), (1, 17), (1023, 1024)]
    };
    for &d in dims {
        for (i, kind) in kinds.iter().enumerate() {
            for &(sq, sk) in seqs {
                // The long rows with a few masks: the section stays short.
                if sq == 1023 && !matches!(kind, Kind::Dense | Kind::Random { density: 0.1, .. }) {
                    continue;
                }
                for causal in [false, true] {
                    // Blocks of 64 (tiles that span several), 128 (the fast kernels' tiles) and
                    // 192 x 64 (tiles that straddle block rows), in turn.
                    let block = [(64, 64), (128, 128), (192, 64)][(i + usize::from(causal)) % 3];
                    let c = Case {
                        b: 2,
                        sq,
                        sk,
                        h: 4,
                        hk: 2,
                        d,
                        causal,
                        kind: *kind,
                        block,
                        deterministic: false,
                    };
                    suite.record(&format!("sparse {c}"), case(dev, &c));
                }
            }
        }
        // Deterministic backwards: rows whose kept blocks leave gaps (10% and half of the
        // blocks, element masks, local + global), tiles straddling block rows (192 x 64), key
        // blocks wider than a tile (64 x 256: several tiles per block column), GQA.
        let det = |kind, causal, block, (sq, sk), hk| Case {
            b: 2,
            sq,
            sk,
            h: 4,
            hk,
            d,
            causal,
            kind,
            block,
            deterministic: true,
        };
        let det_cases = [
            det(kinds[1], true, (64, 128), (300, 203), 1),
            det(kinds[5], true, (64, 128), (300, 203), 1),
            det(kinds[3], false, (192, 64), (203, 300), 2),
            det(kinds[6], true, (64, 64), (1023, 1024), 2),
            det(kinds[1], false, (128, 128), (1023, 1024), 4),
            det(kinds[3], true, (64, 256), (1023, 1024), 2),
        ];
        for c in &det_cases[..if quick { 3 } else { det_cases.len() }] {
            suite.record(&format!("sparse {c}"), case(dev, c));
        }
    }
    if !quick {
        // Deterministic with many key blocks: 2 x 2 KV heads x 32 key blocks of 128 (d 64),
        // 64 of 64 (d 256), chains across waves of blocks.
        for (d, kind) in [(64, kinds[3]), (256, kinds[1])] {
            let c = Case {
                b: 2,
                sq: 4096,
                sk: 4096,
                h: 8,
                hk: 2,
                d,
                causal: true,
                kind,
                block: (128, 128),
                deterministic: true,
            };
            suite.record(&format!("sparse {c}"), case(dev, &c));
        }
    }
    for d in [64, 128] {
        for (kind, causal) in [(kinds[3], false), (kinds[5], true), (kinds[6], true)] {
            suite.record(
                &format!("sparse varlen d={d} {kind:?} causal={causal}"),
                varlen_case(dev, d, kind, causal),
            );
        }
    }
    suite.record("sparse dropout vs CPU", dropout_case(dev));
    suite.record("sparse bad masks", bad_masks(dev));
}
