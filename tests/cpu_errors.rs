//! One test per bad input: each error names the argument and the offending value.

mod common;

use candle::{DType, Device, Result, Tensor};
use candle_flash::{attention_slow, flash_attn, FlashAttn};
use common::randn;

/// Runs `flash_attn` and asserts it fails with a message containing every part of `expected`.
fn assert_error(q: &Tensor, k: &Tensor, v: &Tensor, expected: &[&str]) {
    assert_message(flash_attn(q, k, v, false), expected);
}

fn assert_message(result: Result<Tensor>, expected: &[&str]) {
    let message = match result {
        Ok(t) => panic!(
            "expected an error containing {expected:?}, got a tensor of shape {:?}",
            t.dims()
        ),
        Err(e) => e.to_string(),
    };
    for part in expected {
        assert!(
            message.contains(part),
            "error {message:?} does not contain {part:?}"
        );
    }
}

fn f32(shape: &[usize]) -> Tensor {
    randn(shape, DType::F32).unwrap()
}

#[test]
fn q_of_wrong_rank() {
    let kv = f32(&[1, 8, 2, 16]);
    assert_error(&f32(&[8, 2, 16]), &kv, &kv, &["q:", "rank 4", "[8, 2, 16]"]);
}

#[test]
fn k_of_wrong_rank() {
    let t = f32(&[1, 8, 2, 16]);
    assert_error(
        &t,
        &f32(&[1, 1, 8, 2, 16]),
        &t,
        &["k:", "rank 4", "[1, 1, 8, 2, 16]"],
    );
}

#[test]
fn v_of_wrong_rank() {
    let t = f32(&[1, 8, 2, 16]);
    assert_error(&t, &t, &f32(&[8, 32]), &["v:", "rank 4", "[8, 32]"]);
}

#[test]
fn batch_mismatch() {
    let q = f32(&[2, 8, 2, 16]);
    let kv = f32(&[3, 8, 2, 16]);
    assert_error(&q, &kv, &q, &["k:", "batch size 3", "q's 2"]);
    assert_error(&q, &q, &kv, &["v:", "batch size 3", "q's 2"]);
}

#[test]
fn seqlen_mismatch_between_k_and_v() {
    let q = f32(&[1, 4, 2, 16]);
    assert_error(
        &q,
        &f32(&[1, 8, 2, 16]),
        &f32(&[1, 7, 2, 16]),
        &["v:", "seqlen 7", "k's seqlen 8"],
    );
}

#[test]
fn num_heads_mismatch_between_k_and_v() {
    let q = f32(&[1, 4, 4, 16]);
    assert_error(
        &q,
        &f32(&[1, 8, 2, 16]),
        &f32(&[1, 8, 4, 16]),
        &["v:", "num_heads 4", "k's num_heads 2"],
    );
}

#[test]
fn head_dim_mismatch() {
    let q = f32(&[1, 4, 2, 16]);
    let other = f32(&[1, 4, 2, 32]);
    assert_error(&q, &other, &q, &["k:", "head_dim 32", "q's head_dim 16"]);
    assert_error(&q, &q, &other, &["v:", "head_dim 32", "q's head_dim 16"]);
}

#[test]
fn num_heads_not_divisible_by_num_heads_k() {
    let q = f32(&[1, 4, 4, 16]);
    let kv = f32(&[1, 4, 3, 16]);
    assert_error(&q, &kv, &kv, &["k:", "num_heads_k 3", "num_heads 4"]);
}

#[test]
fn head_dim_zero() -> Result<()> {
    let t = Tensor::zeros((1, 4, 2, 0), DType::F32, &Device::Cpu)?;
    assert_error(&t, &t, &t, &["q:", "head_dim", "1..=256", "got 0"]);
    Ok(())
}

#[test]
fn head_dim_above_256() {
    let t = f32(&[1, 4, 1, 264]);
    assert_error(&t, &t, &t, &["q:", "head_dim", "1..=256", "got 264"]);
}

#[test]
fn mixed_dtypes() -> Result<()> {
    let q = f32(&[1, 4, 2, 16]);
    let half = q.to_dtype(DType::F16)?;
    assert_error(&q, &half, &q, &["k:", "same dtype as q", "F32", "F16"]);
    assert_error(&q, &q, &half, &["v:", "same dtype as q", "F32", "F16"]);
    Ok(())
}

#[test]
fn unsupported_dtypes() -> Result<()> {
    let t = f32(&[1, 4, 2, 16]).to_dtype(DType::F64)?;
    assert_error(
        &t,
        &t,
        &t,
        &["q:", "F64", "not supported", "F32, F16 or BF16"],
    );
    let t = Tensor::zeros((1, 4, 2, 16), DType::U32, &Device::Cpu)?;
    assert_error(&t, &t, &t, &["q:", "U32", "not supported"]);
    Ok(())
}

#[test]
fn non_contiguous_head_dim() -> Result<()> {
    let t = f32(&[1, 4, 2, 16]);
    // (1, 4, 16, 2) transposed: the head_dim stride is 2.
    let strided = f32(&[1, 4, 16, 2]).transpose(2, 3)?;
    assert_error(
        &strided,
        &t,
        &t,
        &["q:", "last dimension", "contiguous", "[128, 32, 1, 2]"],
    );
    assert_error(&t, &strided, &t, &["k:", "last dimension", "contiguous"]);
    assert_error(&t, &t, &strided, &["v:", "last dimension", "contiguous"]);
    Ok(())
}

#[test]
fn bad_softmax_scale() {
    let t = f32(&[1, 4, 2, 16]);
    for (scale, shown) in [
        (0.0, "got 0"),
        (f32::NAN, "got NaN"),
        (-0.5, "got -0.5"),
        (f32::INFINITY, "got inf"),
    ] {
        let result = FlashAttn::new().softmax_scale(scale).forward(&t, &t, &t);
        assert_message(result, &["softmax_scale:", "finite positive", shown]);
    }
}

#[test]
fn reference_checks_shapes_too() {
    let q = f32(&[1, 4, 4, 16]);
    let kv = f32(&[1, 4, 3, 16]);
    assert_message(
        attention_slow(&q, &kv, &kv, 0.25, false),
        &["k:", "num_heads_k 3"],
    );
    assert_message(attention_slow(&q, &q, &q, 0.0, false), &["softmax_scale:"]);
}
