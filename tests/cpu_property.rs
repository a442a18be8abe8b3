//! The property test of issue 53 on the CPU: random configurations over the whole option
//! space (tests/common/property.rs draws them: shapes with 0 and 1, seq_q != seq_k, GQA/MQA,
//! causal, windows up to `usize::MAX`, softcap, ALiBi, dropout, block masks, packed and padded
//! batches, strided inputs, f32/f16/bf16, forward, LSE and both backward entry points, and
//! values outside the contract, which must be errors) against the oracle; the rules are those
//! of FlashAttention's tests, see [`check`].
//!
//! CI runs a fixed seed; `CANDLE_FLASH_PROPTEST_CASES=N` and `CANDLE_FLASH_PROPTEST_SEED=S`
//! make long runs, `CANDLE_FLASH_PROPTEST_REPLAY=<case seed>` reruns the case of a failure
//! line (`CANDLE_FLASH_PROPTEST_SHRINK=1` beside it minimizes the failure, printing each
//! step), and `CANDLE_FLASH_PROPTEST_VERBOSE=1` prints
//! every case with its time.

mod common;

use std::io::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

use candle::{DType, Device, Result, Tensor};
use candle_flash::attention_slow_with;
use common::options::{F32_TOL, NAMES};
use common::property::eval::{self, Inputs};
use common::property::{generate, minimize, Config, Grad, Settings, Side, Target, WindowApi};
use common::{assert_close, assert_fails, max_abs, max_abs_diff};

/// `cargo test --release` in CI: about 30 s on two idle cores (70 s shared with builds).
const CI_CASES: usize = 2000;

/// Checks our op on `cfg` against the oracle; `ours_cfg` is `cfg` except in the tests that
/// plant a bug by running our op with other options. Panics (the helpers' assertions) or
/// returns an error on a mismatch.
///
/// The rule, for every dtype: our error against the oracle in a higher precision (f32 for
/// f16/bf16 inputs, f64 for f32 ones) is at most 2x (outputs) or 3x (gradients) the error of
/// the oracle in the inputs' own precision, plus 1e-5 (f16/bf16) or [`F32_TOL`] relative to
/// the largest value (f32). In f32 the oracle's own error only matters where the scores are
/// large (q·k of hundreds: the f32 oracle 1e-4 off, ours 1e-5). f16/bf16 outputs are also
/// within one ulp of the truth (the CPU rounds once), the LSE within 1e-5 relative, and the
/// gradients are compared after the effect of the backward's D (see below) is added back.
fn check(cfg: &Config, ours_cfg: &Config) -> Result<()> {
    let dev = Device::Cpu;
    let inputs = Inputs::new(cfg, &dev)?;
    if let Some(needle) = cfg.expected_error(Target::Cpu) {
        assert_fails(eval::ours(ours_cfg, &inputs, &dev), &[needle]);
        return Ok(());
    }
    let ours = eval::ours(ours_cfg, &inputs, &dev)?;
    let f32_inputs = cfg.dtype == DType::F32;
    let high = inputs.to(if f32_inputs { DType::F64 } else { DType::F32 }, &dev)?;
    let exact = eval::oracle(cfg, &high, &dev)?;
    let low = eval::oracle(cfg, &inputs, &dev)?;
    assert_eq!(ours.out.dims(), exact.out.dims(), "output shape");
    assert_eq!(ours.out.dtype(), cfg.dtype, "output dtype");
    let slack = |exact: &Tensor| -> Result<f32> {
        Ok(match f32_inputs {
            true => F32_TOL * max_abs(exact)?.max(1.0),
            false => 1e-5,
        })
    };
    rule(
        "out",
        &ours.out,
        &low.out,
        &exact.out,
        2.0,
        slack(&exact.out)?,
    )?;
    // The f64 truth of the forward, and the same in f32: the CPU's f32 math may be as far
    // from the truth as twice the f32 oracle (scores in the hundreds move small outputs by
    // more than an f16 ulp, 5e-5 at 0.006, and LSEs of large cancelling dot products by more
    // than 1e-5).
    let (truth, in_f32) = match f32_inputs {
        true => (exact.clone(), low.clone()),
        false => {
            let forward = Config {
                grad: Grad::None,
                ..cfg.clone()
            };
            (
                eval::oracle(&forward, &inputs.to(DType::F64, &dev)?, &dev)?,
                exact.clone(),
            )
        }
    };
    if !f32_inputs {
        // The CPU rounds f32 results once: within one ulp of the truth.
        let f32_err = max_abs_diff(&in_f32.out, &truth.out)?;
        within_one_ulp("out", &ours.out, &truth.out, 2.0 * f32_err)?;
    }
    if let (Some(lse), Some(expected), Some(f32_lse)) = (&ours.lse, &truth.lse, &in_f32.lse) {
        assert_eq!(lse.dims(), expected.dims(), "lse shape");
        check_lse(lse, expected, 2.0 * finite_diff(f32_lse, expected)?)?;
    }
    let (Some(grads), Some(expected), Some(low)) = (&ours.grads, &exact.grads, &low.grads) else {
        return Ok(());
    };
    // The backward takes D_i = rowsum(dO_i ∘ O_i) from our stored output (FlashAttention-2
    // Algorithm 2, line 4; autograd sums P∘dP instead), so the rounding of O to the dtype
    // moves dQ and dK by exactly `lse_grads` of dO·(O - O_exact), whatever else is right: a
    // row with one visible key has zero gradients, autograd's in any precision too, but ours
    // in bf16 were 0.3 off under dropout 0.9 (O = 10 v, rounded). Those moves are added back.
    let high_out = ours.out.to_dtype(high.w.dtype())?;
    let moved = (&high_out - &exact.out)?;
    let shift = eval::lse_grads(cfg, &high, &eval::row_dots(cfg, &high.w, &moved)?, &dev)?;
    // D's dot product, in f32 whatever the dtype, itself rounds by up to about 1e-6 of
    // max|dO|·max|O| (sqrt(256) terms of 2^-24), and dK sums it over hundreds of rows: where
    // the gradients are much smaller (exact zeros with one visible key and dropout 0.9,
    // |O| 25) that is their error (2.6e-5 in f32 over 114 rows, with max|O|·max|dO| 17).
    let cancelled = F32_TOL * max_abs(&exact.out)? * max_abs(&high.w)?;
    // Our gradients are stored in the dtype: the part of them that the shift explains is
    // rounded too (by half a unit in the last place), and where the exact gradients are
    // zero nothing else in the rule allows for it.
    let mantissa = match cfg.dtype {
        DType::BF16 => 7,
        DType::F16 => 10,
        _ => 23,
    };
    let half_ulp = 0.5f32.powi(mantissa + 1);
    for (i, name) in NAMES.iter().enumerate() {
        assert_eq!(grads[i].dims(), expected[i].dims(), "{name} shape");
        assert_eq!(grads[i].dtype(), cfg.dtype, "{name} dtype");
        let unshifted = (grads[i].to_dtype(high.w.dtype())? + &shift[i])?;
        let slack = slack(&expected[i])? + cancelled + half_ulp * max_abs(&shift[i])?;
        rule(name, &unshifted, &low[i], &expected[i], 3.0, slack)?;
    }
    Ok(())
}

/// Every element of `ours` within one unit in the last place of its dtype at the `truth`,
/// plus 1e-5 of the largest |truth| (sums that cancel to near zero differ by f32 summation
/// order) and `extra`; like `common::assert_within_rounding`, with the f32 math's error.
fn within_one_ulp(what: &str, ours: &Tensor, truth: &Tensor, extra: f32) -> Result<()> {
    let mantissa = if ours.dtype() == DType::BF16 { 7 } else { 10 };
    let host = |t: &Tensor| t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>();
    let (got, want) = (host(ours)?, host(truth)?);
    let floor = 1e-5 * max_abs(truth)? + extra;
    for (i, (&a, &b)) in got.iter().zip(&want).enumerate() {
        // f16's smallest normal is 2^-14; below it the spacing stays 2^-24.
        let ulp = b.abs().max(6.1e-5).log2().floor().exp2() / (1 << mantissa) as f32;
        let err = (a - b).abs();
        assert!(
            err <= ulp + floor,
            "{what}: element {i}: {a} vs {b}: error {err:e} > 1 ulp ({ulp:e}) + {floor:e}"
        );
    }
    Ok(())
}

/// Our LSE: `-inf` exactly where the truth is, elsewhere within 1e-5 relative plus `extra`.
fn check_lse(lse: &Tensor, truth: &Tensor, extra: f32) -> Result<()> {
    let host = |t: &Tensor| t.flatten_all()?.to_vec1::<f32>();
    for (i, (&a, &e)) in host(lse)?.iter().zip(&host(truth)?).enumerate() {
        let ok = match e.is_infinite() {
            true => a == e,
            false => (a - e).abs() <= 1e-5 * e.abs().max(1.0) + extra,
        };
        assert!(ok, "lse[{i}] {a} vs {e} (+ {extra:e})");
    }
    Ok(())
}

/// `max |a - b|` over the elements where both are finite (LSEs are `-inf` on rows that see
/// no key).
fn finite_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    let host = |t: &Tensor| t.flatten_all()?.to_vec1::<f32>();
    let diffs = host(a)?
        .into_iter()
        .zip(host(b)?)
        .filter(|(x, y)| x.is_finite() && y.is_finite());
    Ok(diffs.map(|(x, y)| (x - y).abs()).fold(0.0, f32::max))
}

/// `max |ours - exact| <= factor · max |low - exact| + slack`.
fn rule(
    what: &str,
    ours: &Tensor,
    low: &Tensor,
    exact: &Tensor,
    factor: f32,
    slack: f32,
) -> Result<()> {
    let err = max_abs_diff(ours, exact)?;
    let base = max_abs_diff(low, exact)?;
    let bound = factor * base + slack;
    assert!(
        err <= bound,
        "{what}: error {err:e} > {factor} x the oracle's own error {base:e} + {slack:e}"
    );
    Ok(())
}

/// The message of an error or of a panic (an assertion of the helpers), first line only.
fn failure(result: std::thread::Result<Result<()>>) -> Option<String> {
    let message = match result {
        Ok(Ok(())) => return None,
        Ok(Err(e)) => e.to_string(),
        Err(panic) => match (panic.downcast_ref::<String>(), panic.downcast_ref::<&str>()) {
            (Some(s), _) => s.clone(),
            (_, Some(s)) => s.to_string(),
            _ => "panic".to_string(),
        },
    };
    Some(message.lines().next().unwrap_or_default().to_string())
}

#[test]
fn random_cases() {
    let settings = Settings::from_env(CI_CASES);
    let verbose = std::env::var("CANDLE_FLASH_PROPTEST_VERBOSE").is_ok_and(|v| v == "1");
    let seeds = settings.case_seeds();
    let start = Instant::now();
    let mut failed = vec![];
    for (n, &seed) in seeds.iter().enumerate() {
        let cfg = generate(seed, Target::Cpu);
        let case_start = Instant::now();
        let result = catch_unwind(AssertUnwindSafe(|| check(&cfg, &cfg)));
        if verbose {
            eprintln!("case {n} {:.3}s: {cfg}", case_start.elapsed().as_secs_f32());
        }
        if let Some(message) = failure(result) {
            // The first failures in full; a broken op would print hundreds.
            if failed.len() < 20 {
                println!(
                    "property FAIL case {n}: {cfg}: {message}\n  replay: \
                     CANDLE_FLASH_PROPTEST_REPLAY={seed:#x} cargo test --release --test cpu_property random_cases"
                );
            }
            failed.push(format!("{seed:#x}"));
        }
    }
    if let (Some(seed), true, false) = (settings.replay, settings.shrink, failed.is_empty()) {
        let minimal = minimize(
            &generate(seed, Target::Cpu),
            Target::Cpu,
            |name, variant| {
                let result = catch_unwind(AssertUnwindSafe(|| check(variant, variant)));
                let message = failure(result);
                if let Some(message) = &message {
                    println!("shrink: {name} still fails: {message}");
                }
                message.is_some()
            },
        );
        println!("shrink: minimal case {minimal}");
    }
    // Written to the stream itself rather than with eprintln!, which the test harness
    // captures: CI logs show the count and time of passing runs too.
    let summary = format!(
        "property: {} cases in {:.1} s",
        seeds.len(),
        start.elapsed().as_secs_f32()
    );
    let _ = writeln!(std::io::stderr(), "{summary}");
    assert!(
        failed.is_empty(),
        "{summary}: {} failed, seeds {:?}",
        failed.len(),
        &failed[..failed.len().min(20)]
    );
}

/// The two parts of the oracle written in tests/common/property/eval.rs agree with the
/// crate's: dropout under options with nothing dropped (`p` = 0, every entry kept) equals
/// `attention_slow_with`, output and LSE (against `lse_host`, whose window rule is the
/// formula: windows below the key count only), over the generator's fixed-length cases.
#[test]
fn written_oracle_parts_agree_with_attention_slow_with() -> Result<()> {
    let dev = Device::Cpu;
    let mut checked = 0;
    for seed in 0..3000 {
        let cfg = generate(seed, Target::Cpu);
        let fixed = matches!(cfg.batch, common::property::Batch::Fixed);
        if !fixed || cfg.expected_error(Target::Cpu).is_some() || cfg.dropout.is_some() {
            continue;
        }
        let inputs = Inputs::new(&cfg, &dev)?.to(DType::F32, &dev)?;
        let [q, k, v] = inputs
            .base
            .clone()
            .map(|t| t.contiguous().expect("contiguous"));
        if cfg.views != [common::property::View::Contiguous; 3] {
            continue;
        }
        let opts = cfg.options(&dev)?;
        let keep = Tensor::ones((cfg.b, cfg.h, cfg.sq, cfg.sk), DType::U8, &dev)?;
        let ours = eval::dropout_slow(&q, &k, &v, &opts, &keep, 0.0)?;
        assert_close(
            &format!("{cfg}"),
            &ours,
            &attention_slow_with(&q, &k, &v, &opts)?,
            1e-6,
        )?;
        let inside =
            |s: Side| matches!(s, Side::Open) || matches!(s, Side::Size(n) if n < cfg.sk as u64);
        if cfg.window.is_none_or(|(l, r, _)| inside(l) && inside(r)) {
            let lse = eval::lse_slow(&q, &k, &v, &opts, None)?;
            common::options::check_lse(
                &format!("{cfg}"),
                &lse,
                &common::options::lse_host(&q, &k, &opts)?,
            )?;
        }
        checked += 1;
        if checked == 60 {
            break;
        }
    }
    assert_eq!(checked, 60);
    Ok(())
}

/// Whether `check` fails with our op run on `ours` instead of `cfg`.
fn caught(cfg: &Config, ours: &Config) -> bool {
    failure(catch_unwind(AssertUnwindSafe(|| check(cfg, ours)))).is_some()
}

/// Bugs planted by running our op with slightly wrong options are caught by the checks, in
/// f32 and in bf16 (whose budget grows with the keys): the causal diagonal shifted by one,
/// one key of one row dropped, another dropout mask, the first sequence's ALiBi slopes for
/// every sequence, a packed sequence boundary moved by one row, a softcap 1% off. The
/// unchanged cases pass.
#[test]
fn planted_bugs_are_caught() -> Result<()> {
    use common::property::{Batch, Grad};
    for dtype in [DType::F32, DType::BF16] {
        let base = Config::plain(dtype, (2, 150, 150, 4, 2, 64));
        let mut variants: Vec<(&str, Config, Config)> = vec![];

        let causal = Config {
            causal: true,
            ..base.clone()
        };
        let shifted = Config {
            window: Some((Side::Open, Side::Size(1), WindowApi::WindowSize)),
            ..base.clone()
        };
        variants.push(("causal offset + 1", causal, shifted));

        let all = base.clone();
        let one_less = Config {
            window: Some((Side::Size(148), Side::Open, WindowApi::Window)),
            ..base.clone()
        };
        variants.push(("key 0 of row 149 dropped", all, one_less));

        let dropout = Config {
            dropout: Some((0.17, 7, 11)),
            ..base.clone()
        };
        let other_mask = Config {
            dropout: Some((0.17, 7, 12)),
            ..base.clone()
        };
        variants.push(("dropout offset + 1", dropout, other_mask));

        let slopes: Vec<f32> = (0..8)
            .map(|i| 0.5f32.powi(i % 4 + 1) * (1 + i / 4) as f32)
            .collect();
        let per_batch = Config {
            alibi: Some((true, slopes.clone())),
            ..base.clone()
        };
        let first_row = Config {
            alibi: Some((false, slopes[..4].to_vec())),
            ..base.clone()
        };
        variants.push(("ALiBi row 0 for every sequence", per_batch, first_row));

        let lens = |q: Vec<usize>| Batch::Varlen {
            lens_q: q,
            lens_k: vec![70, 90],
        };
        let varlen = Config {
            batch: lens(vec![40, 60]),
            b: 2,
            sq: 100,
            sk: 160,
            ..base.clone()
        };
        let moved = Config {
            batch: lens(vec![41, 59]),
            ..varlen.clone()
        };
        variants.push(("sequence boundary moved", varlen, moved));

        let capped = Config {
            softcap: 5.0,
            grad: Grad::Direct,
            ..base.clone()
        };
        let off = Config {
            softcap: 5.05,
            ..capped.clone()
        };
        variants.push(("softcap 1% off", capped, off));

        for (what, cfg, planted) in variants {
            assert!(
                !caught(&cfg, &cfg),
                "{what} {dtype:?}: the correct case fails"
            );
            assert!(
                caught(&cfg, &planted),
                "{what} {dtype:?}: the planted bug passes"
            );
        }
    }
    Ok(())
}

/// A named property of a case, for [`the_ci_cases_cover_the_option_space`].
type Feature<'a> = (&'a str, &'a dyn Fn(&Config) -> bool);

/// Sanity of the generator: every part of the option space occurs in the CI run's cases.
#[test]
fn the_ci_cases_cover_the_option_space() {
    use common::property::{Batch, BlockKind, Grad, View};
    let cases: Vec<Config> = Settings::from_env(CI_CASES)
        .case_seeds()
        .into_iter()
        .map(|s| generate(s, Target::Cpu))
        .collect();
    let count = |f: &dyn Fn(&Config) -> bool| cases.iter().filter(|c| f(c)).count();
    let huge = |s: Side| matches!(s, Side::Size(n) if n >= i64::MAX as u64);
    let features: [Feature; 23] = [
        ("f32", &|c| c.dtype == DType::F32),
        ("f16", &|c| c.dtype == DType::F16),
        ("bf16", &|c| c.dtype == DType::BF16),
        ("batch 0", &|c| c.b == 0),
        ("seqlen_q 0", &|c| {
            c.seqs().iter().any(|s| s.1 == 0) && c.b > 0
        }),
        ("seqlen_k 1", &|c| c.seqs().iter().any(|s| s.3 == 1)),
        ("heads 0", &|c| c.h == 0),
        ("odd head_dim", &|c| c.d % 2 == 1),
        ("head_dim 256", &|c| c.d == 256),
        ("sq > sk", &|c| c.seqs().iter().any(|s| s.1 > s.3)),
        ("GQA", &|c| c.hk > 1 && c.h > c.hk),
        ("MQA", &|c| c.hk == 1 && c.h > 1),
        ("huge window", &|c| {
            c.window.is_some_and(|(l, r, _)| huge(l) || huge(r))
        }),
        ("softcap + ALiBi (b, h)", &|c| {
            c.softcap > 0.0 && c.alibi.as_ref().is_some_and(|a| a.0)
        }),
        ("dense block mask", &|c| {
            c.blocks
                .as_ref()
                .is_some_and(|m| matches!(m.kind, BlockKind::Dense(_)))
        }),
        ("dropout + block mask", &|c| {
            c.dropout.is_some() && c.blocks.is_some()
        }),
        ("varlen + dropout", &|c| {
            matches!(c.batch, Batch::Varlen { .. }) && c.dropout.is_some()
        }),
        ("padded, random", &|c| {
            matches!(
                c.batch,
                Batch::Padded {
                    pattern: "random",
                    ..
                }
            )
        }),
        ("strided", &|c| c.views.contains(&View::HeadsMajor)),
        ("negative ALiBi slope", &|c| {
            c.alibi
                .as_ref()
                .is_some_and(|a| a.1.iter().any(|&s| s < 0.0))
        }),
        ("direct backward", &|c| c.grad == Grad::Direct),
        ("invalid", &|c| c.expected_error(Target::Cpu).is_some()),
        ("window near sk", &|c| {
            c.window.is_some_and(|(l, _, _)| {
                matches!(l, Side::Size(n) if n.saturating_add(1) >= c.sk as u64 && n <= c.sk as u64 + 1)
            })
        }),
    ];
    for (name, f) in features {
        assert!(count(f) > 0, "no CI case has {name}");
    }
}

/// Regression (property case 0xffc7a7d97acf841b): a view without elements may start past the
/// end of its storage, as k and v narrowed along the head dim from a tensor with no rows;
/// the CPU's gather sliced the storage at that offset and panicked. Such keys are no keys:
/// zeros, LSE -inf, zero gradients, forward and backward, fixed length and packed.
#[test]
fn empty_views_past_their_storage() -> Result<()> {
    let dev = Device::Cpu;
    let q = Tensor::randn(0f32, 1.0, (1, 5, 2, 8), &dev)?;
    let w = Tensor::randn(0f32, 1.0, (1, 5, 2, 8), &dev)?;
    let empty = Tensor::zeros((1, 0, 1, 12), DType::F32, &dev)?.narrow(3, 4, 8)?;
    assert_eq!(empty.layout().start_offset(), 4);
    let attn = candle_flash::FlashAttn::new().causal(true);
    let (out, lse) = attn.forward_with_lse(&q, &empty, &empty)?;
    assert_eq!(common::max_abs(&out)?, 0.0);
    assert!(lse
        .flatten_all()?
        .to_vec1::<f32>()?
        .iter()
        .all(|&l| l == f32::NEG_INFINITY));
    let (dq, dk, dv) = attn.backward(&q, &empty, &empty, &out, &lse, &w)?;
    assert_eq!(
        (common::max_abs(&dq)?, dk.dims(), dv.dims()),
        (0.0, empty.dims(), empty.dims())
    );
    let varlen = candle_flash::VarLen::from_seqlens(&[5], &[0])?;
    let out = attn.forward_varlen(
        &q.squeeze(0)?,
        &empty.squeeze(0)?,
        &empty.squeeze(0)?,
        &varlen,
    )?;
    assert_eq!(common::max_abs(&out)?, 0.0);
    Ok(())
}

/// Regression (property cases 0xd18012c2412097d8, 0xceec0e9c2a975a40): `forward_padded` on
/// an empty view with an offset (no heads, narrowed along the head dim) panicked in the
/// padding's index_select, which read the view at its offset past its storage; with no query
/// head the result is empty, with no K/V head the error names `num_heads_k`.
#[test]
fn padded_empty_views_past_their_storage() -> Result<()> {
    let dev = Device::Cpu;
    let pad = candle_flash::Padding::from_lengths(&[3, 1], 4)?;
    let empty = |heads| -> Result<Tensor> {
        Tensor::zeros((2, 4, heads, 17), DType::F32, &dev)?.narrow(3, 9, 8)
    };
    let kv = Tensor::randn(0f32, 1.0, (2, 4, 2, 8), &dev)?;
    let attn = candle_flash::FlashAttn::new().causal(true);
    let out = attn.forward_padded(&empty(0)?, &kv, &kv, &pad, &pad)?;
    assert_eq!(out.dims(), &[2, 4, 0, 8]);
    let q = Tensor::randn(0f32, 1.0, (2, 4, 2, 8), &dev)?;
    let no_kv_heads = attn.forward_padded(&q, &empty(0)?, &empty(0)?, &pad, &pad);
    assert_fails(no_kv_heads, &["num_heads_k"]);
    Ok(())
}
