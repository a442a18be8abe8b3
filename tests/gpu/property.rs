//! The property test's GPU long mode (issue 53): the generator of tests/common/property.rs
//! with CUDA's contract (f16/bf16, head_dim a multiple of 8, no empty tensor: Candle cannot
//! allocate one there) and GPU-sized sequences (up to 1100 rows and keys, so that every
//! kernel's tiles, partial last tiles and block skips occur), our CUDA op against
//! `attention_slow_with` (and the dropout and LSE oracles of tests/common/property/eval.rs)
//! on the reference device, by the suite's rules: 2x for outputs, 3x for gradients (+ 1e-4),
//! the LSE within 2e-4 relative; the gradients after the backward's D shift, as in
//! tests/cpu_property.rs. Named cases that the section found run first.
//!
//! Each case is one result line; a failure prints the case's configuration and the variable
//! that replays it alone: `CANDLE_FLASH_PROPTEST_REPLAY=<seed> gpu --only property`
//! (`CANDLE_FLASH_PROPTEST_SHRINK=1` beside it minimizes the failure, printing each step).
//! `CANDLE_FLASH_PROPTEST_CASES` and `CANDLE_FLASH_PROPTEST_SEED` make longer or other runs
//! (500 cases by default, about 30 s on the H200; 40 under `--quick`, which also keeps the
//! CPU test's sizes for the sanitizers, whose references run on the CPU).

use std::time::Instant;

use candle::{bail, DType, Device, Result, Tensor};

use crate::common;
use crate::common::property::eval::{self, Inputs};
use crate::common::property::{generate, minimize, Config, Settings, Target};
use crate::cuda_suite::{check_rule, reference_device, Suite};

pub(crate) fn run(dev: &Device, quick: bool, suite: &mut Suite) {
    let settings = Settings::from_env(if quick { 40 } else { 500 });
    let target = Target::Cuda { long: !quick };
    let seeds = settings.case_seeds();
    let start = Instant::now();
    if settings.replay.is_none() {
        for (name, cfg) in named_cases() {
            suite.record(&format!("property {name}: {cfg}"), case(dev, &cfg, target));
        }
    }
    for &seed in &seeds {
        let cfg = generate(seed, target);
        let name = format!("property {cfg} (replay: CANDLE_FLASH_PROPTEST_REPLAY={seed:#x})");
        suite.record(&name, case(dev, &cfg, target));
    }
    if let (Some(seed), true) = (settings.replay, settings.shrink) {
        // Minimizing prints each step; the result lines above already count the failure.
        let fails = |name: &str, variant: &Config| match case(dev, variant, target) {
            Ok(()) => false,
            Err(e) => {
                let e = e.to_string();
                println!(
                    "shrink: {name} still fails: {}",
                    e.lines().next().unwrap_or("")
                );
                true
            }
        };
        let minimal = minimize(&generate(seed, target), target, fails);
        println!("shrink: minimal case {minimal}");
    }
    println!(
        "property: {} cases in {:.1} s",
        seeds.len(),
        start.elapsed().as_secs_f32()
    );
}

/// Cases this section found, kept by name beside the random ones.
///
/// Negative ALiBi slopes (the contract puts no sign on them): the backward left inf/NaN in
/// dV or dK in about 1% of the random cases, mostly f16, also bf16 at long rows; minimized to
/// f16, one query, one key, one head, d 8, slope -0.26. The mma.sync and wgmma dK/dV kernels
/// gave query rows past the sequence LSE 0: their zero Q rows still carry the bias, which a
/// negative slope makes large and positive, so P = exp2(S) overflowed f16 and met dO = 0.
/// Those rows now get LSE -inf (P = 0), as the warp-specialized kernels' did.
fn named_cases() -> Vec<(&'static str, Config)> {
    let alibi = |slopes: &[f32], cfg: Config| Config {
        alibi: Some((false, slopes.to_vec())),
        ..cfg
    };
    let tiny = |h, hk| Config::plain(DType::F16, (1, 1, 1, h, hk, 8));
    vec![
        (
            "negative ALiBi slope, f16, one key",
            alibi(&[-0.26], tiny(1, 1)),
        ),
        (
            "negative ALiBi slope, f16, GQA",
            alibi(&[0.0, -0.26], tiny(2, 1)),
        ),
        (
            "positive ALiBi slope, f16, one key",
            alibi(&[0.26], tiny(1, 1)),
        ),
        (
            "negative ALiBi slope, bf16, 1035 keys",
            generate(0x7194_6a74_5523_84f5, Target::Cuda { long: true }),
        ),
    ]
}

/// The largest absolute value, as f32 (on any device).
fn max_abs(t: &Tensor) -> Result<f32> {
    if t.elem_count() == 0 {
        return Ok(0.0);
    }
    t.to_dtype(DType::F32)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()
}

fn case(dev: &Device, cfg: &Config, target: Target) -> Result<()> {
    let inputs = Inputs::new(cfg, dev)?;
    if let Some(needle) = cfg.expected_error(target) {
        return match eval::ours(cfg, &inputs, dev) {
            Ok(_) => bail!("expected an error mentioning {needle:?}, got Ok"),
            Err(e) if e.to_string().contains(needle) => Ok(()),
            Err(e) => bail!("expected an error mentioning {needle:?}, got: {e}"),
        };
    }
    let ours = eval::ours(cfg, &inputs, dev)?;
    let rdev = reference_device(dev);
    let high = inputs.to(DType::F32, &rdev)?;
    let exact = eval::oracle(cfg, &high, &rdev)?;
    let low = eval::oracle(cfg, &inputs.to(cfg.dtype, &rdev)?, &rdev)?;
    if ours.out.dtype() != cfg.dtype {
        bail!(
            "output dtype {:?}, expected {:?}",
            ours.out.dtype(),
            cfg.dtype
        );
    }
    // Under a softcap the warp-specialized kernels exponentiate against a fixed row max
    // (AttnParams::softcap_max_log2), so a row with one visible key has P = exp(s - max) != 1,
    // and its rounding to the dtype for the P·V product moves the output by up to one ulp,
    // where the oracle (P = 1) is exact: bf16, one key, 7.8e-3 at |out| ~ 1.
    let capped = softcap_rounding(cfg, &exact.out)?;
    check_rule("out", &ours.out, &low.out, &exact.out, 2.0, 1e-5 + capped)?;
    if let (Some(lse), Some(expected)) = (&ours.lse, &exact.lse) {
        check_lse(cfg, lse, expected)?;
    }
    let (Some(grads), Some(expected), Some(low)) = (&ours.grads, &exact.grads, &low.grads) else {
        return Ok(());
    };
    // As in tests/cpu_property.rs: the backward's D = rowsum(dO∘O) reads our stored output,
    // whose rounding moves dQ and dK by `lse_grads` of dO·(O - O_exact); those moves are
    // added back, with their own rounding to the dtype and the f32 rounding of D's sum.
    let moved = (ours.out.to_device(&rdev)?.to_dtype(DType::F32)? - &exact.out)?;
    let shift = eval::lse_grads(cfg, &high, &eval::row_dots(cfg, &high.w, &moved)?, &rdev)?;
    let cancelled = 1e-5 * max_abs(&exact.out)? * max_abs(&high.w)?;
    let half_ulp = common::unit_roundoff(cfg.dtype);
    for (i, name) in ["dq", "dk", "dv"].iter().enumerate() {
        if grads[i].dtype() != cfg.dtype || grads[i].dims() != expected[i].dims() {
            bail!(
                "{name}: {:?} {:?}, expected {:?}",
                grads[i].dtype(),
                grads[i].dims(),
                expected[i].dims()
            );
        }
        // Ours alone first: an inf or NaN there is the op's, not the shift's.
        if non_finite(&grads[i])? && !non_finite(&expected[i])? {
            bail!("{name}: inf/NaN in ours where the f32 reference is finite");
        }
        if non_finite(&shift[i])? {
            bail!("{name}: the D shift (test code) is not finite");
        }
        let unshifted = (grads[i].to_device(&rdev)?.to_dtype(DType::F32)? + &shift[i])?;
        // The same P ~ 1 rounding for dV's P^T dO: a key that one row alone sees has
        // dV = P dO.
        let capped = softcap_rounding(cfg, &expected[i])?;
        let slack = 1e-4 + cancelled + half_ulp * max_abs(&shift[i])? + capped;
        check_rule(name, &unshifted, &low[i], &expected[i], 3.0, slack)?;
    }
    Ok(())
}

/// Under a softcap the slack for P ~ 1 rounded to the dtype where the oracle's P = 1 is exact
/// (see `case`): two unit roundoffs of the largest |exact|; none without one.
fn softcap_rounding(cfg: &Config, exact: &Tensor) -> Result<f32> {
    Ok(match cfg.softcap > 0.0 {
        true => 2.0 * common::unit_roundoff(cfg.dtype) * max_abs(exact)?,
        false => 0.0,
    })
}

/// Whether `t` has an inf or NaN.
fn non_finite(t: &Tensor) -> Result<bool> {
    let host = t
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .flatten_all()?;
    Ok(host.to_vec1::<f32>()?.iter().any(|x| !x.is_finite()))
}

/// The LSE: `-inf` exactly on the rows that see no key (NaN fails both comparisons);
/// elsewhere within 2e-4 relative (the
/// suite's rule: f32 sums of f16/bf16 inputs), plus, under a softcap `c`, `c · 2^-10` for the
/// kernels' `tanh.approx.f32` (at most 2^-11 off per score, and the LSE moves by a
/// probability-weighted mean of the scores' errors).
fn check_lse(cfg: &Config, lse: &Tensor, expected: &Tensor) -> Result<()> {
    if lse.dims() != expected.dims() {
        bail!(
            "lse: shape {:?}, expected {:?}",
            lse.dims(),
            expected.dims()
        );
    }
    let host = |t: &Tensor| t.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>();
    let (ours, expected) = (host(lse)?, host(expected)?);
    let tanh = cfg.softcap.max(0.0) * 2f32.powi(-10);
    for (i, (&a, &e)) in ours.iter().zip(&expected).enumerate() {
        let ok = match e.is_infinite() {
            true => a == e,
            false => (a - e).abs() <= 2e-4 * e.abs().max(1.0) + tanh,
        };
        if !ok {
            bail!("lse[{i}] = {a}, expected {e}");
        }
    }
    Ok(())
}
