//! GPU tests for the score modifications (issue 19): local windows, softcapping and ALiBi,
//! forward and gradients against `attention_slow_with` with the same options. The head dims
//! and modes reach every kernel the router picks: 40, 64, 96, 128 and 256 the
//! warp-specialized forward and backward (the backward's `_cap` kernels under a cap alone at
//! 40-128, `_mods` under slopes and at 256, or everywhere with `CANDLE_FLASH_BWD_CAP=0`,
//! which the device runs pass to a second run of this section; 40 on the d 64 kernels, 96 on
//! the d 128 ones), 160 the mma.sync kernels, packed batches the first
//! wgmma kernels (`_mods`), deterministic backwards the warp-specialized kernels'
//! deterministic mode (at 160 the separate mma.sync kernels); then KV-cache decoding,
//! contiguous and paged, with GQA-packed rows (one slope per packed row).

use candle::{DType, Device, IndexOp, Result, Tensor};
use candle_flash::{
    attention_slow_with, flash_attn_with_kvcache, flash_attn_with_paged_kvcache, FlashAttn,
};

use crate::cuda_suite::{
    check_against_slow, check_output, check_varlen_against_slow, grads_of, randn, reference_device,
    to_reference, Suite,
};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Slopes {
    None,
    PerHead,
    PerBatch,
}

#[derive(Clone, Copy, Debug)]
struct Mods {
    causal: bool,
    window: (i64, i64),
    softcap: f32,
    slopes: Slopes,
}

impl std::fmt::Display for Mods {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "causal={} window={:?} softcap={} alibi={:?}",
            self.causal, self.window, self.softcap, self.slopes
        )
    }
}

/// ALiBi's geometric slopes `2^(-8 (i + 1) / h)`, times 1 + b / 4 per sequence when
/// `per_batch` (so that a wrong batch index shows).
fn slopes(b: usize, h: usize, per_batch: bool, dev: &Device) -> Result<Tensor> {
    let head = |i: usize| 2f32.powf(-8.0 * (i + 1) as f32 / h as f32);
    if per_batch {
        let v: Vec<f32> = (0..b)
            .flat_map(|s| (0..h).map(move |i| head(i) * (1.0 + s as f32 / 4.0)))
            .collect();
        Tensor::from_vec(v, (b, h), dev)
    } else {
        Tensor::from_vec((0..h).map(head).collect::<Vec<_>>(), h, dev)
    }
}

/// The options of `m` for batch `b`, `h` heads, with the slopes on `dev`.
fn options(m: &Mods, b: usize, h: usize, dev: &Device) -> Result<FlashAttn> {
    let mut o = FlashAttn::new()
        .causal(m.causal)
        .window_size(m.window.0, m.window.1)
        .softcap(m.softcap);
    if m.slopes != Slopes::None {
        o = o.alibi_slopes(&slopes(b, h, m.slopes == Slopes::PerBatch, dev)?);
    }
    Ok(o)
}

#[derive(Clone, Copy, Debug)]
struct Case {
    b: usize,
    sq: usize,
    sk: usize,
    h: usize,
    hk: usize,
    d: usize,
    mods: Mods,
    deterministic: bool,
}

impl std::fmt::Display for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "b={} sq={} sk={} h={}/{} d={} {} det={}",
            self.b, self.sq, self.sk, self.h, self.hk, self.d, self.mods, self.deterministic
        )
    }
}

/// Output (2x rule) and gradients of `sum(out * w)` (3x rule) against the f32 oracle, with the
/// same math in bf16 as the baseline.
fn case(dev: &Device, c: &Case) -> Result<()> {
    case_in(dev, c, DType::BF16)
}

/// [`case`] with inputs of `dtype`, the baseline the same math in `dtype`.
fn case_in(dev: &Device, c: &Case, dtype: DType) -> Result<()> {
    let q = randn((c.b, c.sq, c.h, c.d), dtype, dev)?;
    let k = randn((c.b, c.sk, c.hk, c.d), dtype, dev)?;
    let v = randn((c.b, c.sk, c.hk, c.d), dtype, dev)?;
    let w = randn((c.b, c.sq, c.h, c.d), dtype, dev)?;
    let ours_opts = options(&c.mods, c.b, c.h, dev)?.deterministic(c.deterministic);
    let ref_opts = options(&c.mods, c.b, c.h, &reference_device(dev))?;
    check_inputs([&q, &k, &v, &w], &ours_opts, &ref_opts)
}

/// Output and gradients of `sum(out * w)` with `ours` against `attention_slow_with` and
/// `reference` (the same options, with their tensors on the reference device).
fn check_inputs(qkvw: [&Tensor; 4], ours: &FlashAttn, reference: &FlashAttn) -> Result<()> {
    let [q, k, v, w] = qkvw;
    let out = ours.forward(q, k, v)?;
    let grads = grads_of(q, k, v, w, |q, k, v| ours.forward(q, k, v))?;
    check_against_slow(&out, &grads, qkvw, |q, k, v| {
        attention_slow_with(q, k, v, reference)
    })
}

/// Every score of every row far below -cap (q and k near opposite directions), under a cap
/// of 50 (Gemma 2's): scaled scores near -65, capped ones near -43 (-46 to -39 at d 64,
/// three standard deviations). The bf16 warp-specialized forward at d 128 and 256 then
/// exponentiates against a fixed row max (AttnParams::softcap_max_log2, 27.9 log2 units
/// here); a max taken at the cap's 72.1 instead would underflow every P (capped scores below
/// 50 - 126 / log2 e = -37.3) and give an output of zeros. d 64 keeps the running max.
/// Not closer to -50: where every capped score lies within 0.5 of -cap, tanh.approx.f32's
/// 2^-11 error (0.025 in score units, as with FlashAttention 2's fast tanh) is as large as
/// the scores' differences, and the case missed the 2x rule once in ~190 runs
/// (docs/archive/PERF.md, "The saturated-softcap test, less saturated").
fn saturated_softcap_case(dev: &Device, d: usize, causal: bool) -> Result<()> {
    let (b, sq, sk, h, hk) = (2, 203, 203, 4, 2);
    let near = |shape: (usize, usize, usize, usize), sign: f64| -> Result<Tensor> {
        (randn(shape, DType::F32, dev)? * 0.3)?
            .affine(sign, sign)?
            .to_dtype(DType::BF16)
    };
    // q.k / sqrt(d) = -65 (1 + e), e's deviation 0.054 at d 64, half that at d 256.
    let q = near((b, sq, h, d), -65.0 / (d as f64).sqrt())?;
    let k = near((b, sk, hk, d), 1.0)?;
    let v = randn((b, sk, hk, d), DType::BF16, dev)?;
    let w = randn((b, sq, h, d), DType::BF16, dev)?;
    let opts = FlashAttn::new().causal(causal).softcap(50.0);
    check_inputs([&q, &k, &v, &w], &opts, &opts)
}

/// A packed batch through `forward_varlen` against each sequence on its own (the slopes row
/// of sequence `b` for per-batch ALiBi), output and gradients.
fn varlen_case(dev: &Device, d: usize, m: &Mods) -> Result<()> {
    let (lens_q, lens_k) = ([37usize, 1, 200], [90usize, 64, 150]);
    let h = 4;
    let opts = options(m, lens_q.len(), h, dev)?;
    let all_slopes = match m.slopes {
        Slopes::None => None,
        s => Some(slopes(
            lens_q.len(),
            h,
            s == Slopes::PerBatch,
            &reference_device(dev),
        )?),
    };
    check_varlen_against_slow(dev, d, (h, 2), (&lens_q, &lens_k), &opts, |b, _, _| {
        let mut o = FlashAttn::new()
            .causal(m.causal)
            .window_size(m.window.0, m.window.1)
            .softcap(m.softcap);
        if let Some(s) = &all_slopes {
            o = o.alibi_slopes(&if m.slopes == Slopes::PerBatch {
                s.i(b)?
            } else {
                s.clone()
            });
        }
        Ok(o)
    })
}

/// Decoding `s_q` tokens per sequence over a cache (paged when `page_size`), against the
/// oracle on each sequence's prefix.
fn decode_case(
    dev: &Device,
    lens: &[usize],
    s_q: usize,
    page_size: Option<usize>,
    m: &Mods,
) -> Result<()> {
    let (h, hk, d, dtype) = (8, 2, 128, DType::BF16);
    let b = lens.len();
    let capacity = lens.iter().max().copied().unwrap_or(0).next_multiple_of(64);
    let q = randn((b, s_q, h, d), dtype, dev)?;
    let k_full = randn((b, capacity, hk, d), dtype, dev)?;
    let v_full = randn((b, capacity, hk, d), dtype, dev)?;
    let opts = options(m, b, h, dev)?;
    let seqlens: Vec<u32> = lens.iter().map(|&l| l as u32).collect();
    let out = match page_size {
        None => flash_attn_with_kvcache(&q, &k_full, &v_full, None, &seqlens, &opts)?,
        Some(ps) => {
            // Pages of each sequence in reverse order, so that the table matters.
            let per_seq = capacity / ps;
            let paged = |t: &Tensor| -> Result<Tensor> {
                let pages: Vec<Tensor> = (0..b * per_seq)
                    .rev()
                    .map(|p| t.i((p / per_seq, (p % per_seq) * ps..(p % per_seq + 1) * ps)))
                    .collect::<Result<_>>()?;
                Tensor::stack(&pages, 0)?.contiguous()
            };
            let table: Vec<u32> = (0..b * per_seq)
                .map(|i| (b * per_seq - 1 - i) as u32)
                .collect();
            flash_attn_with_paged_kvcache(
                &q,
                &paged(&k_full)?,
                &paged(&v_full)?,
                None,
                &seqlens,
                &table,
                per_seq,
                &opts,
            )?
        }
    };
    let (q, k_full, v_full) = (
        to_reference(&q)?,
        to_reference(&k_full)?,
        to_reference(&v_full)?,
    );
    let rdev = q.device().clone();
    let mut low = vec![];
    let mut reference = vec![];
    for (s, &len) in lens.iter().enumerate() {
        let mut o = FlashAttn::new()
            .causal(m.causal)
            .window_size(m.window.0, m.window.1)
            .softcap(m.softcap);
        if m.slopes != Slopes::None {
            let all = slopes(b, h, m.slopes == Slopes::PerBatch, &rdev)?;
            o = o.alibi_slopes(&if m.slopes == Slopes::PerBatch {
                all.i(s)?
            } else {
                all
            });
        }
        let (qs, ks, vs) = (
            q.narrow(0, s, 1)?,
            k_full.i((s..s + 1, ..len))?,
            v_full.i((s..s + 1, ..len))?,
        );
        low.push(attention_slow_with(&qs, &ks, &vs, &o)?);
        let f32_of = |t: &Tensor| t.to_dtype(DType::F32);
        reference.push(attention_slow_with(
            &f32_of(&qs)?,
            &f32_of(&ks)?,
            &f32_of(&vs)?,
            &o,
        )?);
    }
    check_output(
        "decode out",
        &out,
        &Tensor::cat(&low, 0)?,
        &Tensor::cat(&reference, 0)?,
    )
}

/// Slopes on the CPU for CUDA inputs: an error naming `alibi_slopes`, from the forward and
/// from decoding.
fn slopes_on_wrong_device(dev: &Device) -> Result<()> {
    let q = randn((1, 16, 4, 64), DType::BF16, dev)?;
    let opts = FlashAttn::new().alibi_slopes(&slopes(1, 4, false, &Device::Cpu)?);
    let check = |r: Result<Tensor>, what: &str| match r {
        Err(e) if e.to_string().contains("alibi_slopes") => Ok(()),
        Err(e) => candle::bail!("{what}: error does not name alibi_slopes: {e}"),
        Ok(_) => candle::bail!("{what}: accepted slopes on the CPU"),
    };
    let (k, v) = (q.copy()?, q.copy()?);
    check(opts.forward(&q, &k, &v), "forward")?;
    check(
        flash_attn_with_kvcache(&q, &k, &v, None, &[16], &opts),
        "flash_attn_with_kvcache",
    )
}

pub(crate) fn run(dev: &Device, quick: bool, suite: &mut Suite) {
    let none = Mods {
        causal: false,
        window: (-1, -1),
        softcap: 0.0,
        slopes: Slopes::None,
    };
    let mods = [
        Mods {
            causal: true,
            window: (16, 0),
            ..none
        }, // narrower than a block
        Mods {
            window: (100, 50),
            ..none
        }, // both sides, about a block
        Mods {
            window: (-1, 7),
            ..none
        }, // right side only
        Mods {
            window: (300, -1),
            ..none
        }, // left side only
        Mods {
            window: (0, 0),
            ..none
        }, // the diagonal alone
        Mods {
            window: (5000, 5000),
            ..none
        }, // wider than the sequence
        Mods {
            softcap: 30.0,
            ..none
        },
        Mods {
            causal: true,
            softcap: 5.0,
            ..none
        }, // a cap that bites
        Mods {
            causal: true,
            slopes: Slopes::PerHead,
            ..none
        },
        Mods {
            slopes: Slopes::PerBatch,
            ..none
        },
        Mods {
            causal: true,
            window: (64, 0),
            softcap: 20.0,
            slopes: Slopes::PerHead,
        },
        Mods {
            causal: true,
            window: (128, 0),
            ..none
        }, // a 128-key tile exactly
    ];
    let dims: &[usize] = if quick {
        &[64, 128, 256]
    } else {
        &[32, 40, 64, 96, 128, 160, 256]
    };
    let seqs: &[(usize, usize)] = if quick {
        &[(113, 203)]
    } else {
        &[(113, 203), (203, 113), (1, 17), (1023, 1024)]
    };
    for &d in dims {
        for m in &mods {
            for &(sq, sk) in seqs {
                // The long rows with every option: one per head dim keeps the section short.
                if sq == 1023 && m.softcap == 0.0 && m.slopes == Slopes::None && m.window != (16, 0)
                {
                    continue;
                }
                let c = Case {
                    b: 2,
                    sq,
                    sk,
                    h: 4,
                    hk: 2,
                    d,
                    mods: *m,
                    deterministic: false,
                };
                suite.record(&format!("mods {c}"), case(dev, &c));
            }
        }
        // Deterministic: the warp-specialized kernels' ordered mode (at 160 the separate
        // mma.sync kernels).
        for m in [&mods[1], &mods[7], &mods[10]] {
            let c = Case {
                b: 2,
                sq: 203,
                sk: 113,
                h: 4,
                hk: 2,
                d,
                mods: *m,
                deterministic: true,
            };
            suite.record(&format!("mods {c}"), case(dev, &c));
        }
    }
    // Rows of 8200 keys (65 key tiles, the last one partial) through the `_mods` kernels
    // (the softcap alone through the backward's `_cap` ones, or `_mods` with
    // `CANDLE_FLASH_BWD_CAP=0`), each option alone and together.
    let long_dims: &[usize] = if quick { &[128] } else { &[96, 128] };
    for &d in long_dims {
        let long_mods = [
            mods[6],
            mods[9],
            Mods {
                window: (300, 200),
                softcap: 20.0,
                slopes: Slopes::PerHead,
                ..none
            },
        ];
        for m in &long_mods {
            let c = Case {
                b: 2,
                sq: 200,
                sk: 8200,
                h: 4,
                hk: 2,
                d,
                mods: *m,
                deterministic: false,
            };
            suite.record(&format!("mods {c}"), case(dev, &c));
        }
    }
    // The softcap forward's running max, where the tanh waits for the exponentials' loop and
    // the max comes from the raw scores (two-warpgroup kernels: f16, and bf16 caps above
    // 56.8, whose range the fixed max does not hold), over 1024 keys: unmasked key tiles after
    // the first. The f16 backward's `_cap` kernels read K times the softcap's scale.
    for d in [64, 128, 256] {
        for (dtype, cap) in [(DType::F16, 5.0), (DType::BF16, 80.0)] {
            for causal in [false, true] {
                let c = Case {
                    b: 2,
                    sq: 203,
                    sk: 1024,
                    h: 4,
                    hk: 2,
                    d,
                    mods: Mods {
                        causal,
                        softcap: cap,
                        ..none
                    },
                    deterministic: false,
                };
                suite.record(&format!("mods {dtype:?} {c}"), case_in(dev, &c, dtype));
            }
        }
    }
    for d in [64, 128, 256] {
        for causal in [false, true] {
            suite.record(
                &format!("mods saturated softcap 50 d={d} causal={causal}"),
                saturated_softcap_case(dev, d, causal),
            );
        }
    }
    for d in [64, 128] {
        for m in [&mods[0], &mods[7], &mods[9], &mods[10]] {
            suite.record(&format!("mods varlen d={d} {m}"), varlen_case(dev, d, m));
        }
    }
    suite.record("mods alibi_slopes on the CPU", slopes_on_wrong_device(dev));
    let decode_mods = [
        Mods {
            causal: true,
            window: (64, 0),
            ..none
        },
        Mods {
            causal: true,
            softcap: 10.0,
            ..none
        },
        Mods {
            causal: true,
            slopes: Slopes::PerBatch,
            ..none
        },
        Mods {
            causal: true,
            window: (200, 0),
            softcap: 30.0,
            slopes: Slopes::PerHead,
        },
    ];
    for m in &decode_mods {
        for (s_q, page) in [(1, None), (4, None), (1, Some(64)), (3, Some(16))] {
            let lens = [300, 4097, 17];
            suite.record(
                &format!("mods decode s_q={s_q} page={page:?} {m}"),
                decode_case(dev, &lens, s_q, page, m),
            );
        }
    }
}
