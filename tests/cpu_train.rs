//! `candle_flash::train` on the CPU: every fused op against its plain-Candle form (outputs and
//! gradients, f32/bf16/f16, the 2x/3x rule), AdamW against the formula, and bad input.

mod common;

use candle::{DType, Device, Tensor, Var};
use candle_flash::train;
use common::assert_fails;

use common::train as train_checks;

fn run(check: fn(&Device, train_checks::Report)) {
    let mut failures = vec![];
    let mut count = 0;
    check(&Device::Cpu, &mut |name, r| {
        count += 1;
        if let Err(e) = r {
            failures.push(format!("{name}: {e}"));
        }
    });
    assert!(count > 0, "no check ran");
    assert!(
        failures.is_empty(),
        "{} of {count} failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn rms_norm_matches_plain_ops() {
    run(train_checks::rms_norm)
}

#[test]
fn add_rms_norm_matches_plain_ops() {
    run(train_checks::add_rms_norm)
}

#[test]
fn infer_linear_matches_plain_ops() {
    run(train_checks::linear)
}

#[test]
fn infer_argmax_matches_its_definition() {
    run(train_checks::argmax)
}

#[test]
fn rotary_matches_plain_ops() {
    run(train_checks::rotary)
}

#[test]
fn swiglu_matches_plain_ops() {
    run(train_checks::swiglu)
}

#[test]
fn embedding_matches_index_select() {
    run(train_checks::embedding)
}

#[test]
fn cross_entropy_matches_log_softmax() {
    run(train_checks::cross_entropy)
}

#[test]
fn cross_entropy_at_extreme_logits() {
    run(train_checks::cross_entropy_extreme)
}

#[test]
fn adamw_state_is_a_copy() {
    run(train_checks::adamw_state::snapshot)
}

#[test]
fn adamw_update_is_all_or_nothing() {
    run(train_checks::adamw_state::all_or_nothing)
}

#[test]
fn adamw_load_state_refuses_malformed_states() {
    run(train_checks::adamw_state::malformed)
}

#[test]
fn fixed_order_sums_repeat() {
    run(train_checks::repeatable);
}

#[test]
fn embedding_past_the_table_has_no_gradient() {
    run(train_checks::embedding_past_the_table);
}

#[test]
fn adamw_matches_the_formula() {
    run(train_checks::adamw)
}

#[test]
fn embedding_past_the_table_is_nan_not_a_crash() -> candle::Result<()> {
    let table = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
    let ids = Tensor::new(&[0u32, 3, 2], &Device::Cpu)?;
    let y = train::embedding(&table, &ids, DType::F32)?.to_vec2::<f32>()?;
    assert!(y[1].iter().all(|v| v.is_nan()));
    assert!(y[0].iter().chain(&y[2]).all(|v| *v == 1.0));
    Ok(())
}

#[test]
fn bad_input_names_the_argument() -> candle::Result<()> {
    let cpu = Device::Cpu;
    let x = Tensor::zeros((4, 8), DType::F32, &cpu)?;
    let w8 = Tensor::ones(8, DType::F32, &cpu)?;
    assert_fails(
        train::rms_norm(&x, &Tensor::ones(7, DType::F32, &cpu)?, 1e-5),
        &["rms_norm: weight", "(8,)"],
    );
    assert_fails(
        train::rms_norm(&x.to_dtype(DType::F64)?, &w8, 1e-5),
        &["rms_norm: x", "F64"],
    );
    assert_fails(
        train::rms_norm(&x.to_dtype(DType::BF16)?, &w8.to_dtype(DType::F16)?, 1e-5),
        &["rms_norm: weight dtype"],
    );
    assert_fails(train::rms_norm(&x, &w8, f32::NAN), &["rms_norm: eps"]);
    let q = Tensor::zeros((4, 2, 8), DType::BF16, &cpu)?;
    let cs = Tensor::zeros((4, 4), DType::F32, &cpu)?;
    assert_fails(
        train::rotary(&q, &cs.narrow(0, 0, 3)?, &cs),
        &["rotary: cos", "(4, 4)"],
    );
    assert_fails(
        train::rotary(&q, &cs, &cs.to_dtype(DType::BF16)?),
        &["rotary: sin", "F32"],
    );
    assert_fails(
        train::rotary(&x, &cs, &cs),
        &["rotary: x", "(tokens, heads, head_dim)"],
    );
    assert_fails(
        train::rotary(&Tensor::zeros((4, 2, 7), DType::F32, &cpu)?, &cs, &cs),
        &["head_dim 7"],
    );
    assert_fails(train::swiglu(&x, &x.narrow(1, 0, 4)?), &["swiglu: up"]);
    let lin = candle_flash::infer::linear;
    assert_fails(
        lin(&x, &x.narrow(1, 0, 4)?, None),
        &["linear: weight has shape", "(n, 8)"],
    );
    assert_fails(
        lin(&x, &x.to_dtype(DType::BF16)?, None),
        &["linear: weight dtype"],
    );
    assert_fails(
        lin(&x, &x, Some(&x.narrow(1, 0, 3)?)),
        &["linear: add is", "[4, 4]"],
    );
    assert_fails(
        candle_flash::infer::linear_swiglu(&x, &x.narrow(0, 0, 3)?),
        &["linear_swiglu: weight has 3 rows"],
    );
    let normed = candle_flash::infer::rms_norm_linear;
    assert_fails(
        normed(&x, &w8.narrow(0, 0, 4)?, 1e-5, &x),
        &["rms_norm_linear: weight has shape"],
    );
    assert_fails(
        normed(&x, &w8, 1e-5, &x.narrow(1, 0, 4)?),
        &["rms_norm_linear: weight has shape", "(n, 8)"],
    );
    assert_fails(
        candle_flash::infer::rms_norm_linear_swiglu(&x, &w8, 1e-5, &x.narrow(0, 0, 3)?),
        &["rms_norm_linear_swiglu: weight has 3 rows"],
    );
    let argmax = candle_flash::infer::argmax;
    assert_fails(
        argmax(&Tensor::new(1f32, &cpu)?),
        &["argmax: x is a scalar"],
    );
    assert_fails(
        argmax(&x.narrow(1, 0, 0)?),
        &["argmax: x has shape", "[4, 0]"],
    );
    assert_fails(argmax(&x.to_dtype(DType::U32)?), &["argmax: x is U32"]);
    assert_fails(
        train::add_rms_norm(&x, &x.narrow(1, 0, 4)?, &w8, 1e-5),
        &["add_rms_norm: residual"],
    );
    assert_fails(
        train::add_rms_norm(&x, &x, &w8.narrow(0, 0, 4)?, 1e-5),
        &["add_rms_norm: weight has shape"],
    );
    let ids = Tensor::new(&[0u32, 1], &cpu)?;
    assert_fails(
        train::embedding(&x, &ids.to_dtype(DType::I64)?, DType::F32),
        &["embedding: ids", "U32"],
    );
    assert_fails(
        train::embedding(&x.to_dtype(DType::BF16)?, &ids, DType::F32),
        &["embedding", "BF16"],
    );
    assert_fails(train::embedding(&x, &ids, DType::U8), &["embedding: dtype"]);
    assert_fails(
        train::cross_entropy_rows(&x, &ids),
        &["cross_entropy: targets", "(4,)"],
    );
    assert_fails(
        train::cross_entropy_rows(&x.flatten_all()?, &ids),
        &["cross_entropy: logits"],
    );
    let v = Var::from_tensor(&Tensor::zeros(3, DType::BF16, &cpu)?)?;
    assert_fails(
        train::AdamW::new(vec![("w".into(), v)], 1e-3, 0.0),
        &["AdamW: variable w", "F32"],
    );
    let (a, b) = (
        Var::zeros(3, DType::F32, &cpu)?,
        Var::zeros(3, DType::F32, &cpu)?,
    );
    assert_fails(
        train::AdamW::new(vec![("w".into(), a.clone()), ("w".into(), b)], 1e-3, 0.0),
        &["AdamW: two variables are named w"],
    );
    assert_fails(
        train::AdamW::new(vec![("a".into(), a.clone()), ("b".into(), a)], 1e-3, 0.0),
        &["AdamW: variables a and b are the same Var"],
    );
    Ok(())
}
