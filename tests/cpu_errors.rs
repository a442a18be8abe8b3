//! One test per bad input: each error names the argument and the offending value.

mod common;

use candle::{DType, Device, Result, Tensor};
use candle_flash::{attention_slow, attention_slow_with, flash_attn, FlashAttn};
use common::{assert_fails, randn};

/// Runs `flash_attn` and asserts it fails with a message containing every part of `expected`.
fn assert_error(q: &Tensor, k: &Tensor, v: &Tensor, expected: &[&str]) {
    assert_fails(flash_attn(q, k, v, false), expected);
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
        assert_fails(result, &["softmax_scale:", "finite positive", shown]);
    }
}

// ---------------------------------------------------------------------------------------------
// Sliding window, softcap and ALiBi: each error names the option, on the op, its varlen path
// and the oracle alike.
// ---------------------------------------------------------------------------------------------

/// Asserts that `opts` fails with `expected` on the forward, the varlen forward and the
/// oracle `attention_slow_with`, for q `(2, 4, 2, 16)` and k, v alike.
fn assert_opts_fail(opts: &FlashAttn, expected: &[&str]) {
    let t = f32(&[2, 4, 2, 16]);
    assert_fails(opts.forward(&t, &t, &t), expected);
    assert_fails(attention_slow_with(&t, &t, &t, opts), expected);
    let packed = f32(&[8, 2, 16]);
    let varlen = candle_flash::VarLen::from_seqlens(&[3, 5], &[3, 5]).unwrap();
    assert_fails(
        opts.forward_varlen(&packed, &packed, &packed, &varlen),
        expected,
    );
}

#[test]
fn window_size_with_a_negative_side_other_than_minus_one() {
    for (window, shown) in [
        ((-2, 0), "got -2"),
        ((0, -5), "got -5"),
        ((-3, -1), "got -3"),
    ] {
        let opts = FlashAttn::new().window_size(window.0, window.1);
        assert_opts_fail(&opts, &["window_size:", "-1 for unbounded", shown]);
    }
    // The causal mask overrides the right side, not the check.
    let opts = FlashAttn::new().causal(true).window_size(4, -7);
    assert_opts_fail(&opts, &["window_size:", "right", "got -7"]);
}

#[test]
fn softcap_negative_or_not_finite() {
    for (cap, shown) in [
        (f32::NAN, "got NaN"),
        (f32::INFINITY, "got inf"),
        (f32::NEG_INFINITY, "got -inf"),
        (-1.0, "got -1"),
    ] {
        let opts = FlashAttn::new().softcap(cap);
        assert_opts_fail(&opts, &["softcap:", "finite value > 0", shown]);
    }
}

#[test]
fn alibi_slopes_of_wrong_shape() -> Result<()> {
    for (shape, shown) in [
        (vec![3], "[3]"),
        (vec![1, 2], "[1, 2]"),
        (vec![2, 3], "[2, 3]"),
        (vec![2, 2, 1], "[2, 2, 1]"),
    ] {
        let slopes = Tensor::ones(shape, DType::F32, &Device::Cpu)?;
        let opts = FlashAttn::new().alibi_slopes(&slopes);
        let expected = [
            "alibi_slopes:",
            "(num_heads) = (2)",
            "(batch, num_heads)",
            shown,
        ];
        assert_opts_fail(&opts, &expected);
    }
    Ok(())
}

#[test]
fn alibi_slopes_of_wrong_dtype() -> Result<()> {
    for dtype in [DType::F16, DType::BF16, DType::F64] {
        let slopes = Tensor::ones(2, dtype, &Device::Cpu)?;
        let opts = FlashAttn::new().alibi_slopes(&slopes);
        assert_opts_fail(&opts, &["alibi_slopes:", "F32", &format!("{dtype:?}")]);
    }
    Ok(())
}

#[test]
fn reference_with_options_rejects_dropout() {
    let t = f32(&[1, 4, 2, 16]);
    assert_fails(
        attention_slow_with(&t, &t, &t, &FlashAttn::new().dropout(0.1)),
        &["dropout_p:", "0.1", "attention_slow_dropout"],
    );
}

#[test]
fn reference_checks_shapes_too() {
    let q = f32(&[1, 4, 4, 16]);
    let kv = f32(&[1, 4, 3, 16]);
    assert_fails(
        attention_slow(&q, &kv, &kv, 0.25, false),
        &["k:", "num_heads_k 3"],
    );
    assert_fails(attention_slow(&q, &q, &q, 0.0, false), &["softmax_scale:"]);
}

// ---------------------------------------------------------------------------------------------
// Block masks: building one names the argument (`block_q`, `block_k`, `mask`, `stride`); a
// mask that does not fit the call names `block_mask`, on the op, its varlen path, the direct
// backward and the oracle alike.
// ---------------------------------------------------------------------------------------------

fn u8s(shape: &[usize]) -> Tensor {
    Tensor::ones(shape, DType::U8, &Device::Cpu).unwrap()
}

/// [`assert_opts_fail`] and the direct backward, for q `(2, 4, 2, 16)` (one 64 x 64 block).
fn assert_block_mask_fails(mask: &candle_flash::BlockMask, expected: &[&str]) {
    let opts = FlashAttn::new().block_mask(mask);
    assert_opts_fail(&opts, expected);
    let t = f32(&[2, 4, 2, 16]);
    let (out, lse) = FlashAttn::new().forward_with_lse(&t, &t, &t).unwrap();
    assert_fails(opts.backward(&t, &t, &t, &out, &lse, &t), expected);
}

#[test]
fn block_mask_with_the_wrong_number_of_blocks() -> Result<()> {
    use candle_flash::BlockMask;
    // The calls need ceil(4 / 64) = 1 (varlen: ceil(5 / 64) = 1) block each way.
    for (shape, shown) in [
        (vec![2, 1], "got (1, 2, 1)"),
        (vec![1, 2], "got (1, 1, 2)"),
        (vec![2, 3, 3], "got (2, 3, 3)"),
    ] {
        let mask = BlockMask::new(&u8s(&shape), 64, 64)?;
        let expected = [
            "block_mask:",
            "(num_row_blocks, num_col_blocks) = (1, 1)",
            shown,
        ];
        assert_block_mask_fails(&mask, &expected);
    }
    // Blocks of 128 x 64 over 200 x 200 need 2 x 4, not 4 x 4.
    let t = f32(&[1, 200, 2, 16]);
    let mask = BlockMask::new(&u8s(&[4, 4]), 128, 64)?;
    assert_fails(
        FlashAttn::new().block_mask(&mask).forward(&t, &t, &t),
        &[
            "block_mask:",
            "= (2, 4)",
            "blocks of 128 x 64",
            "got (1, 4, 4)",
        ],
    );
    Ok(())
}

#[test]
fn block_mask_with_the_wrong_number_of_heads() -> Result<()> {
    use candle_flash::BlockMask;
    // 1 (shared) or num_heads = 2 (per query head); num_heads_k does not count.
    for heads in [3, 4] {
        let mask = BlockMask::new(&u8s(&[heads, 1, 1]), 64, 64)?;
        let shown = format!("got ({heads}, 1, 1)");
        assert_block_mask_fails(
            &mask,
            &["block_mask:", "(num_heads, ..) = (2, 1, 1)", &shown],
        );
    }
    let q = f32(&[1, 4, 4, 16]);
    let kv = f32(&[1, 4, 1, 16]);
    let shared = BlockMask::new(&u8s(&[1, 1, 1]), 64, 64)?;
    let per_query_head = BlockMask::from_dense(&u8s(&[4, 4, 4]), 64, 64)?;
    FlashAttn::new().block_mask(&shared).forward(&q, &kv, &kv)?;
    FlashAttn::new()
        .block_mask(&per_query_head)
        .forward(&q, &kv, &kv)?;
    let two = BlockMask::new(&u8s(&[2, 1, 1]), 64, 64)?;
    assert_fails(
        FlashAttn::new().block_mask(&two).forward(&q, &kv, &kv),
        &[
            "block_mask:",
            "(num_heads, ..) = (4, 1, 1)",
            "got (2, 1, 1)",
        ],
    );
    Ok(())
}

#[test]
fn element_mask_of_the_wrong_size() -> Result<()> {
    use candle_flash::BlockMask;
    // The blocks fit (one), the element mask does not: it must be seqlen_q x seqlen_k (the
    // longest sequences of a packed batch).
    for (dims, shown) in [([4, 8], "4 x 8"), ([3, 4], "3 x 4"), ([5, 5], "5 x 5")] {
        let mask = BlockMask::from_dense(&u8s(&dims), 64, 64)?;
        let t = f32(&[2, 4, 2, 16]);
        let opts = FlashAttn::new().block_mask(&mask);
        let expected = ["block_mask:", "element mask is", shown, "is 4 x 4"];
        assert_fails(opts.forward(&t, &t, &t), &expected);
        assert_fails(attention_slow_with(&t, &t, &t, &opts), &expected);
    }
    let packed = f32(&[8, 2, 16]);
    let varlen = candle_flash::VarLen::from_seqlens(&[3, 5], &[3, 5])?;
    let mask = BlockMask::from_dense(&u8s(&[4, 4]), 64, 64)?;
    assert_fails(
        FlashAttn::new()
            .block_mask(&mask)
            .forward_varlen(&packed, &packed, &packed, &varlen),
        &["block_mask:", "element mask is 4 x 4", "is 5 x 5"],
    );
    Ok(())
}

#[test]
fn block_sizes_not_multiples_of_64() -> Result<()> {
    use candle_flash::BlockMask;
    let m = u8s(&[2, 2]);
    for (bq, bk, expected) in [
        (32, 64, ["block_q:", "multiple of 64", "got 32"]),
        (0, 64, ["block_q:", "multiple of 64", "got 0"]),
        (64, 100, ["block_k:", "multiple of 64", "got 100"]),
        (128, 16, ["block_k:", "multiple of 64", "got 16"]),
    ] {
        assert_fails(BlockMask::new(&m, bq, bk), &expected);
        assert_fails(BlockMask::from_dense(&m, bq, bk), &expected);
    }
    let dev = Device::Cpu;
    let expected = ["block_q:", "multiple of 64", "got 96"];
    assert_fails(BlockMask::local_global(256, 256, 96, 1, 1, &dev), &expected);
    assert_fails(BlockMask::strided(256, 256, 96, 2, &dev), &expected);
    assert_fails(BlockMask::butterfly(256, 256, 96, &dev), &expected);
    assert_fails(
        BlockMask::strided(256, 256, 64, 0, &dev),
        &["stride:", ">= 1", "got 0"],
    );
    Ok(())
}

#[test]
fn block_mask_of_wrong_dtype_or_rank() -> Result<()> {
    use candle_flash::BlockMask;
    for dtype in [DType::F32, DType::U32, DType::I64] {
        let m = Tensor::ones((2, 2), dtype, &Device::Cpu)?;
        let expected = ["mask:", "U8", &format!("{dtype:?}")];
        assert_fails(BlockMask::new(&m, 64, 64), &expected);
        assert_fails(BlockMask::from_dense(&m, 64, 64), &expected);
    }
    for shape in [vec![4], vec![1, 1, 2, 2]] {
        let shown = format!("{shape:?}");
        let expected = ["mask:", "rank 2", "rank 3", &shown];
        assert_fails(BlockMask::new(&u8s(&shape), 64, 64), &expected);
        assert_fails(BlockMask::from_dense(&u8s(&shape), 64, 64), &expected);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Variable-length batches, padding helpers and dropout: one test per bad input.
// ---------------------------------------------------------------------------------------------
mod varlen_padding_dropout {
    use super::*;
    use candle_flash::{attention_slow_dropout, dropout_mask, Padding, VarLen};

    #[test]
    fn cu_seqlens_not_starting_at_zero() {
        assert_fails(
            VarLen::from_cu_seqlens(&[1, 4], &[0, 4]),
            &["cu_seqlens_q:", "first offset", "0", "got 1"],
        );
        assert_fails(
            VarLen::from_cu_seqlens(&[0, 4], &[2, 4]),
            &["cu_seqlens_k:", "first offset", "got 2"],
        );
    }

    #[test]
    fn cu_seqlens_decreasing() {
        assert_fails(
            VarLen::from_cu_seqlens(&[0, 4, 2], &[0, 4, 8]),
            &[
                "cu_seqlens_q:",
                "non-decreasing",
                "got 2 at index 2 after 4",
            ],
        );
        assert_fails(
            VarLen::from_cu_seqlens(&[0, 4, 8], &[0, 5, 3]),
            &[
                "cu_seqlens_k:",
                "non-decreasing",
                "got 3 at index 2 after 5",
            ],
        );
    }

    #[test]
    fn cu_seqlens_too_short_or_of_different_lengths() {
        assert_fails(
            VarLen::from_cu_seqlens(&[0], &[0]),
            &["cu_seqlens_q:", "at least 2 entries", "got 1"],
        );
        assert_fails(
            VarLen::from_cu_seqlens(&[0, 1, 2], &[0, 2]),
            &["cu_seqlens_k:", "expected 3 entries", "got 2"],
        );
        assert_fails(
            VarLen::from_seqlens(&[1, 2], &[1, 2, 3]),
            &["seqlens_k:", "expected 2 lengths", "got 3"],
        );
    }

    #[test]
    fn cu_seqlens_tensor_of_wrong_dtype_or_rank() -> Result<()> {
        let good = Tensor::new(&[0u32, 4], &Device::Cpu)?;
        let wide = Tensor::new(&[0i64, 4], &Device::Cpu)?;
        assert_fails(
            VarLen::from_tensors(&wide, &good),
            &["cu_seqlens_q:", "rank-1 U32", "I64"],
        );
        assert_fails(
            VarLen::from_tensors(&good, &good.reshape((1, 2))?),
            &["cu_seqlens_k:", "rank-1 U32", "[1, 2]"],
        );
        Ok(())
    }

    #[test]
    fn last_offset_differs_from_total_rows() -> Result<()> {
        let (q, kv) = (f32(&[10, 2, 16]), f32(&[8, 2, 16]));
        let varlen = VarLen::from_cu_seqlens(&[0, 4, 12], &[0, 3, 8])?;
        assert_fails(
            FlashAttn::new().forward_varlen(&q, &kv, &kv, &varlen),
            &["cu_seqlens_q:", "last offset 12", "q's total rows 10"],
        );
        let varlen = VarLen::from_cu_seqlens(&[0, 4, 10], &[0, 3, 9])?;
        assert_fails(
            FlashAttn::new().forward_varlen(&q, &kv, &kv, &varlen),
            &["cu_seqlens_k:", "last offset 9", "k's total rows 8"],
        );
        Ok(())
    }

    #[test]
    fn varlen_tensors_of_wrong_rank_or_shape() -> Result<()> {
        let varlen = VarLen::from_seqlens(&[4, 4], &[4, 4])?;
        let (q, kv) = (f32(&[8, 4, 16]), f32(&[8, 2, 16]));
        let run =
            |q: &Tensor, k: &Tensor, v: &Tensor| FlashAttn::new().forward_varlen(q, k, v, &varlen);
        assert_fails(
            run(&f32(&[2, 4, 4, 16]), &kv, &kv),
            &[
                "q:",
                "rank 3",
                "(total_q, num_heads, head_dim)",
                "[2, 4, 4, 16]",
            ],
        );
        assert_fails(run(&q, &f32(&[8, 32]), &kv), &["k:", "rank 3", "[8, 32]"]);
        assert_fails(
            run(&q, &kv, &f32(&[7, 2, 16])),
            &["v:", "total rows 7", "k's total rows 8"],
        );
        assert_fails(
            run(&q, &f32(&[8, 3, 16]), &f32(&[8, 3, 16])),
            &["k:", "num_heads_k 3", "num_heads 4"],
        );
        assert_fails(
            run(&q, &f32(&[8, 2, 8]), &kv),
            &["k:", "head_dim 8", "q's head_dim 16"],
        );
        let t = f32(&[8, 2, 16]).to_dtype(DType::F64)?;
        assert_fails(run(&t, &t, &t), &["q:", "F64", "not supported"]);
        Ok(())
    }

    #[test]
    fn dropout_p_outside_zero_one() {
        let t = f32(&[1, 4, 2, 16]);
        for (p, shown) in [
            (-0.1, "got -0.1"),
            (1.0, "got 1"),
            (1.5, "got 1.5"),
            (f32::NAN, "got NaN"),
        ] {
            let expected = ["dropout_p:", "expected a value in [0, 1)", shown];
            assert_fails(FlashAttn::new().dropout(p).forward(&t, &t, &t), &expected);
            assert_fails(dropout_mask(p, 0, 0, 1, 2, 4, 4), &expected);
            let keep = Tensor::ones((1, 2, 4, 4), DType::U8, &Device::Cpu).unwrap();
            assert_fails(
                attention_slow_dropout(&t, &t, &t, 0.25, false, &keep, p),
                &expected,
            );
        }
    }

    #[test]
    fn dropout_keep_mask_of_wrong_shape() -> Result<()> {
        let t = f32(&[1, 4, 2, 16]);
        let keep = Tensor::ones((1, 2, 4, 5), DType::U8, &Device::Cpu)?;
        assert_fails(
            attention_slow_dropout(&t, &t, &t, 0.25, false, &keep, 0.1),
            &[
                "keep:",
                "(batch, num_heads, seqlen_q, seqlen_k)",
                "[1, 2, 4, 4]",
                "[1, 2, 4, 5]",
            ],
        );
        Ok(())
    }

    #[test]
    fn padding_lengths_larger_than_seqlen_or_no_sequence() {
        assert_fails(
            Padding::from_lengths(&[3, 5], 4),
            &["lengths:", "sequence 1 has length 5", "seqlen 4"],
        );
        assert_fails(
            Padding::from_lengths(&[], 4),
            &["lengths:", "at least one sequence"],
        );
    }

    #[test]
    fn padding_mask_of_wrong_rank() -> Result<()> {
        let mask = Tensor::ones(4, DType::U8, &Device::Cpu)?;
        assert_fails(
            Padding::from_mask(&mask),
            &["mask:", "rank 2", "(batch, seqlen)", "[4]"],
        );
        Ok(())
    }

    #[test]
    fn unpad_and_pad_of_wrong_shapes() -> Result<()> {
        let pad = Padding::from_lengths(&[1, 2], 4)?;
        assert_fails(
            pad.unpad(&f32(&[2, 5, 3])),
            &["x:", "batch=2, seqlen=4", "[2, 5, 3]"],
        );
        assert_fails(pad.pad(&f32(&[4, 3])), &["x:", "total=3", "[4, 3]"]);
        Ok(())
    }

    #[test]
    fn padded_forward_with_mismatched_padding() -> Result<()> {
        let (pad2, pad3) = (
            Padding::from_lengths(&[1, 2], 4)?,
            Padding::from_lengths(&[1, 2, 3], 4)?,
        );
        let t = f32(&[2, 4, 2, 16]);
        assert_fails(
            FlashAttn::new().forward_padded(&t, &t, &t, &pad2, &pad3),
            &["kv_pad:", "batch size 3", "q_pad's 2"],
        );
        assert_fails(
            FlashAttn::new().forward_padded(&f32(&[2, 5, 2, 16]), &t, &t, &pad2, &pad2),
            &["q:", "batch=2, seqlen=4", "like the padding mask"],
        );
        Ok(())
    }
}

#[test]
fn scalar_q() -> Result<()> {
    let kv = f32(&[1, 8, 2, 16]);
    assert_error(
        &Tensor::new(1f32, &Device::Cpu)?,
        &kv,
        &kv,
        &["q:", "rank 4", "[]"],
    );
    Ok(())
}

#[test]
fn zero_kv_heads() -> Result<()> {
    let q = f32(&[1, 4, 4, 16]);
    let kv = Tensor::zeros((1, 4, 0, 16), DType::F32, &Device::Cpu)?;
    assert_error(&q, &kv, &kv, &["k:", "num_heads_k 0", "num_heads 4"]);
    Ok(())
}

#[test]
fn errors_are_the_same_with_a_causal_mask_and_the_lse() {
    let q = f32(&[1, 4, 4, 16]);
    let kv = f32(&[1, 4, 3, 16]);
    let result = FlashAttn::new().causal(true).forward_with_lse(&q, &kv, &kv);
    assert_fails(result.map(|(out, _)| out), &["k:", "num_heads_k 3"]);
}

/// The multiple-of-8 rule is CUDA's (16-byte loads); the CPU takes any head_dim up to 256.
#[test]
fn head_dim_not_a_multiple_of_8_is_fine_on_the_cpu() -> Result<()> {
    for d in [1, 4, 36, 100] {
        let t = f32(&[1, 5, 2, d]);
        let out = flash_attn(&t, &t, &t, true)?;
        assert_eq!(out.dims(), &[1, 5, 2, d]);
    }
    Ok(())
}

/// seqlen_k 0 is not an error: every row sees no key, so the output is zeros and the
/// backward gives zero dq and empty dk, dv.
#[test]
fn seqlen_k_zero_backward_gives_zero_dq() -> Result<()> {
    let q = candle::Var::from_tensor(&f32(&[2, 7, 4, 16]))?;
    let k = candle::Var::from_tensor(&Tensor::zeros((2, 0, 2, 16), DType::F32, &Device::Cpu)?)?;
    let v = candle::Var::from_tensor(&Tensor::zeros((2, 0, 2, 16), DType::F32, &Device::Cpu)?)?;
    for causal in [false, true] {
        let out = FlashAttn::new().causal(causal).forward(&q, &k, &v)?;
        let grads = (out * f32(&[2, 7, 4, 16]))?.sum_all()?.backward()?;
        let dq = grads.get(&q).expect("dq");
        assert_eq!(dq.dims(), &[2, 7, 4, 16]);
        assert!(dq
            .flatten_all()?
            .to_vec1::<f32>()?
            .iter()
            .all(|&x| x == 0.0));
        for (name, x) in [("dk", &k), ("dv", &v)] {
            assert_eq!(grads.get(x).expect(name).dims(), &[2, 0, 2, 16], "{name}");
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// KV-cache decoding (flash_attn_with_kvcache, paged, KvCache, PagedKvCache): one test per bad
// input; on every error the cache is left untouched.
// ---------------------------------------------------------------------------------------------
mod kvcache {
    use super::*;
    use candle_flash::{
        flash_attn_with_kvcache, flash_attn_with_paged_kvcache, KvCache, PagedKvCache,
    };

    /// q `(2, 1, 4, 16)` over caches `(2, 8, 2, 16)` holding 3 and 5 tokens, one new token.
    struct Call {
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        k_new: Tensor,
        v_new: Tensor,
        lens: Vec<u32>,
        opts: FlashAttn,
    }

    impl Call {
        fn new() -> Self {
            Self {
                q: f32(&[2, 1, 4, 16]),
                k_cache: f32(&[2, 8, 2, 16]),
                v_cache: f32(&[2, 8, 2, 16]),
                k_new: f32(&[2, 1, 2, 16]),
                v_new: f32(&[2, 1, 2, 16]),
                lens: vec![3, 5],
                opts: FlashAttn::new().causal(true),
            }
        }

        fn run(&self) -> Result<Tensor> {
            flash_attn_with_kvcache(
                &self.q,
                &self.k_cache,
                &self.v_cache,
                Some((&self.k_new, &self.v_new)),
                &self.lens,
                &self.opts,
            )
        }

        /// Asserts the call fails naming `expected`, without writing to the caches.
        fn fails(&self, expected: &[&str]) {
            let before = [contents(&self.k_cache), contents(&self.v_cache)];
            assert_fails(self.run(), expected);
            let after = [contents(&self.k_cache), contents(&self.v_cache)];
            assert!(before == after, "the cache was written despite the error");
        }
    }

    fn contents(t: &Tensor) -> Vec<f32> {
        t.to_dtype(DType::F32)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1())
            .unwrap_or_default()
    }

    #[test]
    fn the_valid_call_succeeds() -> Result<()> {
        assert_eq!(Call::new().run()?.dims(), &[2, 1, 4, 16]);
        Ok(())
    }

    #[test]
    fn dropout_is_rejected() {
        let call = Call {
            opts: FlashAttn::new().dropout(0.1),
            ..Call::new()
        };
        call.fails(&["dropout_p:", "not supported", "0.1"]);
    }

    #[test]
    fn bad_softmax_scale() {
        let call = Call {
            opts: FlashAttn::new().softmax_scale(-1.0),
            ..Call::new()
        };
        call.fails(&["softmax_scale:", "-1"]);
    }

    #[test]
    fn bad_window_softcap_or_alibi_slopes() -> Result<()> {
        let bad_slopes = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
        for (opts, expected) in [
            (FlashAttn::new().window_size(-2, 0), ["window_size:", "-2"]),
            (FlashAttn::new().softcap(f32::NAN), ["softcap:", "NaN"]),
            (
                FlashAttn::new().alibi_slopes(&bad_slopes),
                ["alibi_slopes:", "[3, 4]"],
            ),
        ] {
            let call = Call {
                opts: opts.causal(true),
                ..Call::new()
            };
            call.fails(&expected);
        }
        Ok(())
    }

    #[test]
    fn block_mask_is_rejected() -> Result<()> {
        let mask = candle_flash::BlockMask::new(&u8s(&[1, 1]), 64, 64)?;
        let call = Call {
            opts: FlashAttn::new().causal(true).block_mask(&mask),
            ..Call::new()
        };
        call.fails(&["block_mask:", "not supported", "KV-cache"]);
        // Paged and the cache types too.
        let pages = f32(&[6, 4, 2, 16]);
        let (k_new, v_new) = (f32(&[2, 1, 2, 16]), f32(&[2, 1, 2, 16]));
        let result = flash_attn_with_paged_kvcache(
            &f32(&[2, 1, 4, 16]),
            &pages,
            &pages.copy()?,
            Some((&k_new, &v_new)),
            &[3, 5],
            &[4, 1, 0, 5],
            2,
            &call.opts,
        );
        assert_fails(result, &["block_mask:", "not supported"]);
        let mut cache = KvCache::new(2, 8, 2, 16, DType::F32, &Device::Cpu)?;
        let result = cache.append_and_attend(&call.q, &k_new, &v_new, &call.opts);
        assert_fails(result, &["block_mask:", "not supported"]);
        assert_eq!(cache.lengths(), &[0, 0]);
        Ok(())
    }

    #[test]
    fn q_of_wrong_rank() {
        let call = Call {
            q: f32(&[2, 4, 16]),
            ..Call::new()
        };
        call.fails(&["q:", "rank 4", "[2, 4, 16]"]);
    }

    #[test]
    fn cache_of_wrong_rank() {
        let call = Call {
            k_cache: f32(&[16, 2, 16]),
            ..Call::new()
        };
        call.fails(&[
            "k_cache:",
            "rank 4",
            "(batch, capacity, num_heads_k, head_dim)",
        ]);
    }

    #[test]
    fn v_cache_shape_differs_from_k_cache() {
        let call = Call {
            v_cache: f32(&[2, 9, 2, 16]),
            ..Call::new()
        };
        call.fails(&["v_cache:", "[2, 9, 2, 16]", "k_cache's [2, 8, 2, 16]"]);
    }

    #[test]
    fn cache_batch_differs_from_q() {
        let call = Call {
            k_cache: f32(&[3, 8, 2, 16]),
            v_cache: f32(&[3, 8, 2, 16]),
            ..Call::new()
        };
        call.fails(&["k_cache:", "batch size 3", "q's 2"]);
    }

    #[test]
    fn cache_head_dim_differs_from_q() {
        let call = Call {
            k_cache: f32(&[2, 8, 2, 8]),
            v_cache: f32(&[2, 8, 2, 8]),
            ..Call::new()
        };
        call.fails(&["k_cache:", "head_dim 8", "q's head_dim 16"]);
    }

    #[test]
    fn num_heads_k_does_not_divide_num_heads() {
        let call = Call {
            k_cache: f32(&[2, 8, 3, 16]),
            v_cache: f32(&[2, 8, 3, 16]),
            ..Call::new()
        };
        call.fails(&["k_cache:", "num_heads_k 3", "num_heads 4"]);
    }

    #[test]
    fn cache_dtype_differs_from_q() {
        let call = Call {
            v_cache: Call::new().v_cache.to_dtype(DType::F16).unwrap(),
            ..Call::new()
        };
        call.fails(&["v_cache:", "dtype", "F16"]);
    }

    #[test]
    fn head_dim_too_large() {
        let call = Call {
            q: f32(&[2, 1, 2, 264]),
            k_cache: f32(&[2, 8, 2, 264]),
            v_cache: f32(&[2, 8, 2, 264]),
            k_new: f32(&[2, 1, 2, 264]),
            v_new: f32(&[2, 1, 2, 264]),
            ..Call::new()
        };
        call.fails(&["q:", "head_dim", "264"]);
    }

    #[test]
    fn non_contiguous_cache() {
        let call = Call {
            k_cache: f32(&[2, 2, 8, 16]).transpose(1, 2).unwrap(),
            ..Call::new()
        };
        call.fails(&["k_cache:", "contiguous", "written in place"]);
    }

    #[test]
    fn overlapping_caches() {
        let cache = f32(&[2, 8, 2, 16]);
        let call = Call {
            k_cache: cache.clone(),
            v_cache: cache,
            ..Call::new()
        };
        call.fails(&["v_cache:", "shares its memory with k_cache"]);
    }

    #[test]
    fn k_new_of_wrong_shape() {
        let call = Call {
            k_new: f32(&[2, 1, 4, 16]),
            v_new: f32(&[2, 1, 4, 16]),
            ..Call::new()
        };
        call.fails(&["k_new:", "(2, seqlen_new, 2, 16)", "[2, 1, 4, 16]"]);
        let call = Call {
            k_new: f32(&[2, 1, 2]),
            ..Call::new()
        };
        call.fails(&["k_new:", "rank 4"]);
    }

    #[test]
    fn v_new_differs_from_k_new() {
        let call = Call {
            v_new: f32(&[2, 2, 2, 16]),
            ..Call::new()
        };
        call.fails(&["v_new:", "[2, 2, 2, 16]", "k_new's [2, 1, 2, 16]"]);
    }

    #[test]
    fn k_new_dtype_differs_from_q() {
        let call = Call {
            k_new: Call::new().k_new.to_dtype(DType::BF16).unwrap(),
            ..Call::new()
        };
        call.fails(&["k_new:", "dtype", "BF16"]);
    }

    #[test]
    fn cache_seqlens_of_wrong_length() {
        let call = Call {
            lens: vec![3],
            ..Call::new()
        };
        call.fails(&["cache_seqlens:", "expected 2 entries", "got 1"]);
    }

    #[test]
    fn sequence_over_capacity() {
        let call = Call {
            lens: vec![3, 8],
            ..Call::new()
        };
        call.fails(&["cache_seqlens:", "sequence 1", "8 + 1 = 9", "capacity of 8"]);
        // Without new tokens too: a length past the capacity cannot be read.
        let call = Call {
            lens: vec![9, 0],
            ..Call::new()
        };
        let result = flash_attn_with_kvcache(
            &call.q,
            &call.k_cache,
            &call.v_cache,
            None,
            &call.lens,
            &call.opts,
        );
        assert_fails(result, &["cache_seqlens:", "sequence 0", "9 + 0 = 9"]);
    }

    /// Paged call: pages `(6, 4, 2, 16)`, max_pages 2 (capacity 8), block table [[4, 1], [0, 5]].
    fn paged(
        pages: &Tensor,
        lens: &[u32],
        block_table: &[u32],
        max_pages: usize,
    ) -> Result<Tensor> {
        let (k_new, v_new) = (f32(&[2, 1, 2, 16]), f32(&[2, 1, 2, 16]));
        flash_attn_with_paged_kvcache(
            &f32(&[2, 1, 4, 16]),
            pages,
            &pages.copy()?,
            Some((&k_new, &v_new)),
            lens,
            block_table,
            max_pages,
            &FlashAttn::new(),
        )
    }

    #[test]
    fn the_valid_paged_call_succeeds() -> Result<()> {
        let pages = f32(&[6, 4, 2, 16]);
        assert_eq!(
            paged(&pages, &[3, 5], &[4, 1, 0, 5], 2)?.dims(),
            &[2, 1, 4, 16]
        );
        Ok(())
    }

    #[test]
    fn block_table_of_wrong_length() {
        let pages = f32(&[6, 4, 2, 16]);
        assert_fails(
            paged(&pages, &[3, 5], &[4, 1, 0], 2),
            &["block_table:", "2 * 2 = 4 entries", "got 3"],
        );
    }

    #[test]
    fn block_table_entry_out_of_range() {
        let pages = f32(&[6, 4, 2, 16]);
        let before = contents(&pages);
        // Sequence 1 uses 2 pages after the append (5 + 1 tokens); its second is page 6.
        assert_fails(
            paged(&pages, &[3, 5], &[4, 1, 0, 6], 2),
            &["block_table:", "sequence 1, page 1", "is 6", "6 pages"],
        );
        assert!(
            contents(&pages) == before,
            "pages written despite the error"
        );
        // Entries past the pages a sequence uses are ignored.
        assert!(paged(&pages, &[3, 2], &[4, 1, 0, 99], 2).is_ok());
    }

    #[test]
    fn paged_sequence_over_capacity() {
        let pages = f32(&[6, 4, 2, 16]);
        assert_fails(
            paged(&pages, &[8, 0], &[4, 1, 0, 5], 2),
            &[
                "cache_seqlens:",
                "sequence 0",
                "capacity of 8",
                "max_pages 2 x page_size 4",
            ],
        );
    }

    #[test]
    fn page_size_zero() {
        let pages = f32(&[6, 0, 2, 16]);
        assert_fails(
            paged(&pages, &[0, 0], &[4, 1, 0, 5], 2),
            &["k_pages:", "page_size", "> 0"],
        );
        assert_fails(
            PagedKvCache::new(2, 6, 0, 2, 2, 16, DType::F32, &Device::Cpu).map(|_| ()),
            &["page_size:", "> 0"],
        );
    }

    #[test]
    fn pages_of_wrong_rank() {
        assert_fails(
            paged(&f32(&[6, 4, 32]), &[0, 0], &[4, 1, 0, 5], 2),
            &[
                "k_pages:",
                "rank 4",
                "(num_pages, page_size, num_heads_k, head_dim)",
            ],
        );
    }

    #[test]
    fn reset_sequence_out_of_range() -> Result<()> {
        let mut cache = KvCache::new(2, 8, 2, 16, DType::F32, &Device::Cpu)?;
        assert_fails(
            cache.reset_sequence(2),
            &["reset_sequence:", "sequence 2", "batch of 2"],
        );
        let mut paged = PagedKvCache::new(2, 4, 4, 2, 2, 16, DType::F32, &Device::Cpu)?;
        assert_fails(
            paged.reset_sequence(5),
            &["reset_sequence:", "sequence 5", "batch of 2"],
        );
        Ok(())
    }

    #[test]
    fn kv_cache_with_a_mismatched_q() -> Result<()> {
        let mut cache = KvCache::new(2, 8, 2, 16, DType::F32, &Device::Cpu)?;
        let (k, v) = (f32(&[2, 1, 2, 16]), f32(&[2, 1, 2, 16]));
        let result = cache.append_and_attend(&f32(&[3, 1, 4, 16]), &k, &v, &FlashAttn::new());
        assert_fails(result, &["k_cache:", "batch size 2", "q's 3"]);
        assert_eq!(cache.lengths(), &[0, 0]);
        Ok(())
    }
}
