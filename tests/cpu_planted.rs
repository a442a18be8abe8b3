//! Planted bugs: each check the suites rely on is shown to fail on the class of bug it guards
//! against (NaN or inf in an output, a dropped key, a wrong causal alignment), so that a green
//! suite means something.

mod common;

use candle::{DType, Device, Result, Tensor};
use candle_flash::{attention_slow, flash_attn, FlashAttn};
use common::{
    assert_close, assert_within_budget, assert_within_rounding, max_abs, max_abs_diff, randn,
};

/// Whether `f` panics (an assertion failed); the panic message is printed as usual.
fn fails(f: impl FnOnce()) -> bool {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err()
}

#[test]
fn helpers_see_nan_and_inf_anywhere() -> Result<()> {
    let dev = Device::Cpu;
    let reference = Tensor::new(&[0f32, 1.0, 2.0], &dev)?;
    for bad in [
        [f32::NAN, 1.0, 2.0],
        [0.0, f32::NAN, 2.0],
        [0.0, 1.0, f32::INFINITY],
    ] {
        let ours = Tensor::new(&bad, &dev)?;
        let diff = max_abs_diff(&ours, &reference)?;
        assert!(
            diff.is_nan() || diff.is_infinite(),
            "{bad:?}: max_abs_diff {diff}"
        );
        assert!(diff != 0.0, "a bitwise check written as == 0.0 must fail");
        assert!(fails(
            || assert_close("planted", &ours, &reference, 1e-3).unwrap()
        ));
    }
    assert!(max_abs(&Tensor::new(&[f32::NAN, 5.0], &dev)?)?.is_nan());
    Ok(())
}

#[test]
fn the_oracle_is_bottom_right_aligned_by_its_own_rule() -> Result<()> {
    // One query over three keys, causal: bottom-right alignment lets it see all three, so the
    // output is the plain softmax average; top-left alignment would see key 0 only.
    let dev = Device::Cpu;
    let q = Tensor::zeros((1, 1, 1, 2), DType::F32, &dev)?; // equal scores: uniform weights
    let k = randn((1, 3, 1, 2), DType::F32)?;
    let v = Tensor::new(&[[[[3f32, 0.0]], [[0.0, 3.0]], [[6.0, 3.0]]]], &dev)?;
    let out = attention_slow(&q, &k, &v, 1.0, true)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    assert!(
        (out[0] - 3.0).abs() < 1e-6 && (out[1] - 2.0).abs() < 1e-6,
        "{out:?}"
    );
    // Three queries over one key: only the last query sees it; the others output zeros.
    let q = randn((1, 3, 1, 2), DType::F32)?;
    let k1 = randn((1, 1, 1, 2), DType::F32)?;
    let v1 = Tensor::new(&[[[[1f32, -1.0]]]], &dev)?;
    let out = attention_slow(&q, &k1, &v1, 1.0, true)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    assert_eq!(out, vec![0.0, 0.0, 0.0, 0.0, 1.0, -1.0]);
    Ok(())
}

#[test]
fn a_dropped_key_or_a_shifted_mask_fails_the_f32_tolerance() -> Result<()> {
    let (b, sq, sk, h, d) = (2, 37, 300, 4, 32);
    let q = randn((b, sq, h, d), DType::F32)?;
    let k = randn((b, sk, h, d), DType::F32)?;
    let v = randn((b, sk, h, d), DType::F32)?;
    let scale = 1.0 / (d as f32).sqrt();
    let good = flash_attn(&q, &k, &v, true)?;
    assert_close(
        "ours vs oracle",
        &good,
        &attention_slow(&q, &k, &v, scale, true)?,
        1e-5,
    )?;
    // A tile of 16 keys skipped (as a kernel that mis-counts its blocks would).
    let keep = |t: &Tensor| Tensor::cat(&[&t.narrow(1, 0, 128)?, &t.narrow(1, 144, sk - 144)?], 1);
    let skipped = attention_slow(&q, &keep(&k)?, &keep(&v)?, scale, false)?;
    let full = attention_slow(&q, &k, &v, scale, false)?;
    assert!(fails(|| assert_close(
        "tile skipped",
        &skipped,
        &full,
        1e-5
    )
    .unwrap()));
    // One key dropped.
    let drop1 = |t: &Tensor| t.narrow(1, 1, sk - 1);
    let dropped = attention_slow(&q, &drop1(&k)?, &drop1(&v)?, scale, false)?;
    assert!(fails(
        || assert_close("key dropped", &dropped, &full, 1e-5).unwrap()
    ));
    // Keys shifted by one row (what an off-by-one causal offset or row index reads).
    let shifted = FlashAttn::new().causal(true).forward(
        &q,
        &k.narrow(1, 0, sk - 1)?.pad_with_zeros(1, 0, 1)?,
        &v.narrow(1, 0, sk - 1)?.pad_with_zeros(1, 0, 1)?,
    )?;
    assert!(fails(
        || assert_close("offset", &shifted, &good, 1e-5).unwrap()
    ));
    Ok(())
}

/// At 4096 keys the low-precision rule is loose (the bf16 baseline's own error grows with
/// the row), so the half-precision CPU tests also hold the output to one ulp of the exact
/// value: the correct result passes it, a skipped 16-key tile or a dropped key does not.
#[test]
fn a_skipped_tile_at_4096_keys_fails_the_rounding_rule() -> Result<()> {
    let (b, sq, sk, h, d) = (1, 16, 4096, 2, 64);
    let q = randn((b, sq, h, d), DType::BF16)?;
    let k = randn((b, sk, h, d), DType::BF16)?;
    let v = randn((b, sk, h, d), DType::BF16)?;
    let scale = 1.0 / (d as f32).sqrt();
    let f32 = |t: &Tensor| t.to_dtype(DType::F32);
    let exact = attention_slow(&f32(&q)?, &f32(&k)?, &f32(&v)?, scale, false)?;
    let ours = flash_attn(&q, &k, &v, false)?;
    assert_within_rounding("ours, bf16, 4096 keys", &ours, &exact, 1.0)?;
    let baseline = attention_slow(&q, &k, &v, scale, false)?;
    for (what, keep) in [("tile skipped", (2048, 16)), ("key dropped", (100, 1))] {
        let cut = |t: &Tensor| {
            Tensor::cat(
                &[
                    &t.narrow(1, 0, keep.0)?,
                    &t.narrow(1, keep.0 + keep.1, sk - keep.0 - keep.1)?,
                ],
                1,
            )
        };
        let bad = flash_attn(&q, &cut(&k)?, &cut(&v)?, false)?;
        assert!(
            fails(|| assert_within_rounding(what, &bad, &exact, 1.0).unwrap()),
            "{what}: passed the rounding rule"
        );
        // What the 2x rule alone says of it (printed, not asserted: it is the loose one).
        let caught = fails(|| assert_within_budget(what, &bad, &baseline, &exact, 2.0).unwrap());
        println!("{what}: the 2x rule alone catches it: {caught}");
    }
    Ok(())
}
