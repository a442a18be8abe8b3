//! CPU block-sparse attention (`FlashAttn::block_mask`, the FlashAttention paper's
//! Algorithm 5) against `attention_slow_with` with the same options: outputs, LSE and
//! gradients; densities from 0 to 100 %, shared and per-head masks, element masks
//! (`BlockMask::from_dense`), the built-in patterns, causal, GQA, packed batches, dropout,
//! softcap, ALiBi and a window, f32 and bf16.
//!
//! The CPU tiles are 32 query rows by 64 keys (src/cpu.rs) and blocks are multiples of 64, so
//! the lengths below cut blocks and tiles short (1, 113, 200), and a window moves the key tiles
//! off the block grid (tiles straddling two blocks).

mod common;

use candle::{DType, Device, IndexOp, Result, Tensor, D};
use candle_flash::{dropout_mask, BlockMask, FlashAttn, VarLen};
use common::options::{self, check_low_precision, check_lse, lse_host, F32_TOL, NAMES};
use common::varlen::sequence;
use common::{assert_close, grads, max_abs, max_abs_diff, Case};
use rand::{rngs::StdRng, seq::SliceRandom, Rng, SeedableRng};

/// The smallest difference from dense attention that counts as "the mask changed the result".
const CHANGED: f32 = 1e-3;

fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

/// A random block mask for `(sq, sk)` in blocks of `bq` x `bk`: each block kept with
/// probability `density`; `heads` 1 gives a rank-2 (shared) mask.
fn random_blocks(
    rng: &mut StdRng,
    heads: usize,
    (sq, sk): (usize, usize),
    (bq, bk): (usize, usize),
    density: f64,
) -> Result<BlockMask> {
    let (rows, cols) = (sq.div_ceil(bq), sk.div_ceil(bk));
    let states: Vec<u8> = (0..heads * rows * cols)
        .map(|_| u8::from(rng.random_bool(density)))
        .collect();
    let states = Tensor::from_vec(states, (heads, rows, cols), &Device::Cpu)?;
    let states = if heads == 1 {
        states.squeeze(0)?
    } else {
        states
    };
    BlockMask::new(&states, bq, bk)
}

/// A random element mask `(heads, sq, sk)` (rank 2 for one head) whose blocks of `bq` x `bk`
/// are, at random, empty, full, half-visible entry by entry, or with a single visible entry.
/// The first four blocks take the four kinds in a random order, so that a mask of four
/// blocks or more has all three block states.
fn random_elements(
    rng: &mut StdRng,
    heads: usize,
    (sq, sk): (usize, usize),
    (bq, bk): (usize, usize),
) -> Result<Tensor> {
    let (rows, cols) = (sq.div_ceil(bq), sk.div_ceil(bk));
    let mut kinds: Vec<u8> = (0..heads * rows * cols)
        .map(|_| rng.random_range(0..4))
        .collect();
    let mut first = [0u8, 1, 2, 3];
    first.shuffle(rng);
    let n = kinds.len().min(4);
    kinds[..n].copy_from_slice(&first[..n]);
    let mut m = vec![0u8; heads * sq * sk];
    for h in 0..heads {
        for i in 0..sq {
            for j in 0..sk {
                let (r, c) = (i / bq, j / bk);
                m[(h * sq + i) * sk + j] = match kinds[(h * rows + r) * cols + c] {
                    0 => 0,
                    1 => 1,
                    2 => u8::from(rng.random_bool(0.5)),
                    // One visible entry: the block's first.
                    _ => u8::from(i == r * bq && j == c * bk),
                };
            }
        }
    }
    let m = Tensor::from_vec(m, (heads, sq, sk), &Device::Cpu)?;
    if heads == 1 {
        m.squeeze(0)
    } else {
        Ok(m)
    }
}

/// The block states of `mask` that occur, as a sorted list.
fn states_present(mask: &BlockMask) -> Result<Vec<u8>> {
    let mut s = mask.blocks().flatten_all()?.to_vec1::<u8>()?;
    s.sort_unstable();
    s.dedup();
    Ok(s)
}

/// The options without the block mask.
fn dense(opts: &FlashAttn) -> FlashAttn {
    let mut opts = opts.clone();
    opts.block_mask = None;
    opts
}

/// [`options::check_f32`], returning how far the result is from attention without the block
/// mask (same other options), for the callers to check that the mask mattered.
fn check_f32(what: &str, case: &Case, opts: &FlashAttn) -> Result<f32> {
    let [q, k, v, out] = options::check_f32(what, case, opts)?;
    max_abs_diff(&out, &dense(opts).forward(&q, &k, &v)?)
}

fn all_zero(t: &Tensor) -> Result<bool> {
    Ok(max_abs(t)? == 0.0)
}

/// No block at all (density 0, as a block mask and as an empty element mask): every row sees
/// nothing, so zeros, LSE -inf and zero gradients, with and without the causal mask.
#[test]
fn no_block_gives_zeros_and_neg_inf_lse() -> Result<()> {
    for case in [
        Case::new(2, 113, 200, 4, 2, 32),
        Case::new(1, 200, 113, 2, 1, 40),
    ] {
        let (sq, sk) = (case.sq, case.sk);
        let empty_blocks =
            Tensor::zeros((sq.div_ceil(64), sk.div_ceil(128)), DType::U8, &Device::Cpu)?;
        let empty_elements = Tensor::zeros((case.h, sq, sk), DType::U8, &Device::Cpu)?;
        let masks = [
            BlockMask::new(&empty_blocks, 64, 128)?,
            BlockMask::from_dense(&empty_elements, 64, 64)?,
        ];
        for mask in &masks {
            assert_eq!(mask.density()?, 0.0);
            for causal in [false, true] {
                let case = case.causal(causal);
                let opts = case.flash().block_mask(mask);
                let (q, k, v) = case.qkv(DType::F32)?;
                let (out, lse) = opts.forward_with_lse(&q, &k, &v)?;
                assert!(all_zero(&out)?, "out {case:?}");
                let lse = lse.flatten_all()?.to_vec1::<f32>()?;
                assert!(lse.iter().all(|&x| x == f32::NEG_INFINITY), "lse {case:?}");
                let w = case.out_weight(DType::F32)?;
                let g = grads(|q, k, v| opts.forward(q, k, v), &q, &k, &v, &w)?;
                for (name, g) in NAMES.iter().zip(&g) {
                    assert!(all_zero(g)?, "{name} {case:?}");
                }
                // The oracle agrees (zeros, finite zero gradients).
                check_f32("no block", &case, &opts)?;
            }
        }
    }
    Ok(())
}

/// Every block present (density 100 %, and a full element mask): the same tiles and the same
/// arithmetic as without a mask, so the same bits (output, LSE, gradients).
#[test]
fn every_block_equals_dense_attention_bitwise() -> Result<()> {
    for case in [
        Case::new(2, 113, 200, 4, 2, 32),
        Case::new(1, 200, 113, 4, 4, 96),
        Case::new(1, 1, 200, 2, 1, 40),
    ] {
        let (sq, sk) = (case.sq, case.sk);
        let full_elements = Tensor::ones((sq, sk), DType::U8, &Device::Cpu)?;
        let masks = [
            random_blocks(&mut rng(1), 1, (sq, sk), (64, 64), 1.0)?,
            random_blocks(&mut rng(2), case.h, (sq, sk), (128, 64), 1.0)?,
            BlockMask::from_dense(&full_elements, 64, 128)?,
        ];
        for mask in &masks {
            assert_eq!(states_present(mask)?, [1]);
            for causal in [false, true] {
                let case = case.causal(causal);
                let opts = case.flash().block_mask(mask);
                let (q, k, v) = case.qkv(DType::F32)?;
                let w = case.out_weight(DType::F32)?;
                let (out, lse) = opts.forward_with_lse(&q, &k, &v)?;
                let (out_d, lse_d) = dense(&opts).forward_with_lse(&q, &k, &v)?;
                assert_eq!(max_abs_diff(&out, &out_d)?, 0.0, "out {case:?}");
                assert_eq!(
                    lse.flatten_all()?.to_vec1::<f32>()?,
                    lse_d.flatten_all()?.to_vec1::<f32>()?,
                    "lse {case:?}"
                );
                let ours = grads(|q, k, v| opts.forward(q, k, v), &q, &k, &v, &w)?;
                let plain = grads(|q, k, v| dense(&opts).forward(q, k, v), &q, &k, &v, &w)?;
                for ((name, a), b) in NAMES.iter().zip(&ours).zip(&plain) {
                    assert_eq!(max_abs_diff(a, b)?, 0.0, "{name} {case:?}");
                }
            }
        }
    }
    Ok(())
}

/// Random block masks at ~10 % and 50 %, shared and per head, square and non-square blocks,
/// causal and not, seqlen_q != seqlen_k both ways.
#[test]
fn random_block_masks_match_reference() -> Result<()> {
    let mut rng = rng(10);
    let cases = [
        Case::new(1, 512, 512, 2, 1, 32),
        Case::new(2, 200, 113, 4, 2, 40),
        Case::new(1, 113, 330, 4, 4, 96),
    ];
    for case in cases {
        for (bq, bk) in [(64, 64), (128, 128), (64, 128), (128, 64)] {
            for density in [0.1, 0.5] {
                for heads in [1, case.h] {
                    for causal in [false, true] {
                        let case = case.causal(causal);
                        let mask =
                            random_blocks(&mut rng, heads, (case.sq, case.sk), (bq, bk), density)?;
                        let opts = case.flash().block_mask(&mask);
                        let what = format!("blocks {bq}x{bk} density {density} heads {heads}");
                        let changed = check_f32(&what, &case, &opts)?;
                        // Half of the blocks missing must change the result.
                        if density == 0.5 && mask.density()? < 0.9 {
                            assert!(changed > CHANGED, "{what}: the mask changed nothing");
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// Element masks (`from_dense`) whose blocks are empty, full, partly visible and with a
/// single visible entry; shared and per head, the three block states all present.
#[test]
fn element_masks_match_reference() -> Result<()> {
    let mut rng = rng(20);
    let cases = [
        Case::new(2, 200, 200, 4, 2, 32),
        Case::new(1, 113, 200, 2, 1, 40),
        Case::new(1, 200, 113, 2, 2, 96),
        Case::new(1, 1, 200, 2, 1, 32),
    ];
    for case in cases {
        for (bq, bk) in [(64, 64), (128, 64), (64, 128)] {
            for heads in [1, case.h] {
                let elements = random_elements(&mut rng, heads, (case.sq, case.sk), (bq, bk))?;
                let mask = BlockMask::from_dense(&elements, bq, bk)?;
                if case.sq > 1 {
                    assert_eq!(states_present(&mask)?, [0, 1, 2], "{case:?} {bq}x{bk}");
                }
                // The dense form is the element mask itself.
                let back = mask.to_dense(case.sq, case.sk)?;
                assert_eq!(max_abs_diff(&back, &elements.reshape(back.shape())?)?, 0.0);
                for causal in [false, true] {
                    let case = case.causal(causal);
                    let opts = case.flash().block_mask(&mask);
                    let what = format!("elements {bq}x{bk} heads {heads}");
                    let changed = check_f32(&what, &case, &opts)?;
                    assert!(changed > CHANGED, "{what}: the mask changed nothing");
                }
            }
        }
    }
    Ok(())
}

/// Local + global, strided and butterfly patterns, causal and not, with lengths that cut the
/// last block short.
#[test]
fn patterns_match_reference() -> Result<()> {
    let dev = Device::Cpu;
    let case = Case::new(1, 450, 450, 2, 1, 32);
    let (sq, sk) = (case.sq, case.sk);
    let patterns = [
        (
            "local_global 64 1 1",
            BlockMask::local_global(sq, sk, 64, 1, 1, &dev)?,
        ),
        (
            "local_global 128 0 1",
            BlockMask::local_global(sq, sk, 128, 0, 1, &dev)?,
        ),
        ("strided 64 3", BlockMask::strided(sq, sk, 64, 3, &dev)?),
        ("butterfly 64", BlockMask::butterfly(sq, sk, 64, &dev)?),
        ("butterfly 128", BlockMask::butterfly(sq, sk, 128, &dev)?),
    ];
    for (what, mask) in &patterns {
        assert!(mask.density()? < 1.0, "{what}");
        for causal in [false, true] {
            let case = case.causal(causal);
            let changed = check_f32(what, &case, &case.flash().block_mask(mask))?;
            assert!(changed > CHANGED, "{what}: the mask changed nothing");
        }
    }
    // seqlen_q != seqlen_k: the patterns index blocks from the top-left corner, the causal
    // mask aligns bottom-right.
    let case = Case::new(1, 200, 330, 4, 2, 40);
    for mask in [
        BlockMask::local_global(200, 330, 64, 1, 1, &dev)?,
        BlockMask::strided(200, 330, 64, 2, &dev)?,
        BlockMask::butterfly(200, 330, 64, &dev)?,
    ] {
        for causal in [false, true] {
            let case = case.causal(causal);
            check_f32("pattern sq != sk", &case, &case.flash().block_mask(&mask))?;
        }
    }
    Ok(())
}

/// GQA and MQA with per-query-head masks: query heads that share a K/V head see different
/// blocks (and one of them none: its rows are zeros, LSE -inf).
#[test]
fn gqa_per_head_masks_match_reference() -> Result<()> {
    let mut rng = rng(30);
    for hk in [2, 1] {
        for causal in [false, true] {
            let case = Case::new(2, 200, 160, 4, hk, 32).causal(causal);
            let mut elements = random_elements(&mut rng, 4, (200, 160), (64, 64))?;
            // Query head 1 sees nothing.
            let none = Tensor::zeros((1, 200, 160), DType::U8, &Device::Cpu)?;
            elements = Tensor::cat(&[elements.i(0..1)?, none, elements.i(2..)?], 0)?;
            let mask = BlockMask::from_dense(&elements, 64, 64)?;
            let opts = case.flash().block_mask(&mask);
            let changed = check_f32(&format!("gqa hk={hk}"), &case, &opts)?;
            assert!(changed > CHANGED);
            let (q, k, v) = case.qkv(DType::F32)?;
            let (out, lse) = opts.forward_with_lse(&q, &k, &v)?;
            assert!(all_zero(&out.i((.., .., 1))?)?);
            let lse = lse.i((.., 1))?.flatten_all()?.to_vec1::<f32>()?;
            assert!(lse.iter().all(|&x| x == f32::NEG_INFINITY));
        }
    }
    Ok(())
}

/// Awkward lengths (1, 113, 200 on either side) and head_dims 40 and 96, random element
/// masks, causal and not.
#[test]
fn awkward_lengths_and_head_dims() -> Result<()> {
    let mut rng = rng(40);
    for (sq, sk) in [
        (1, 113),
        (113, 1),
        (113, 200),
        (200, 113),
        (1, 1),
        (200, 200),
    ] {
        for d in [40, 96] {
            for causal in [false, true] {
                let case = Case::new(1, sq, sk, 2, 1, d).causal(causal);
                let elements = random_elements(&mut rng, 2, (sq, sk), (64, 64))?;
                let mask = BlockMask::from_dense(&elements, 64, 64)?;
                check_f32("awkward", &case, &case.flash().block_mask(&mask))?;
                let mask = random_blocks(&mut rng, 1, (sq, sk), (128, 64), 0.5)?;
                check_f32("awkward", &case, &case.flash().block_mask(&mask))?;
            }
        }
    }
    Ok(())
}

/// With a window, the CPU's key tiles start at the window's first key, off the 64-key grid, so
/// they straddle two block columns; with softcap and ALiBi the scores change too.
#[test]
fn window_softcap_and_alibi_with_a_mask() -> Result<()> {
    let mut rng = rng(50);
    let case = Case::new(2, 200, 230, 4, 2, 32);
    let slopes = Tensor::new(&[0.5f32, 0.25, 0.125, 0.0625], &Device::Cpu)?;
    for causal in [false, true] {
        let case = case.causal(causal);
        let blocks = random_blocks(&mut rng, 4, (200, 230), (64, 64), 0.6)?;
        let elements = random_elements(&mut rng, 1, (200, 230), (64, 128))?;
        let elements = BlockMask::from_dense(&elements, 64, 128)?;
        for mask in [&blocks, &elements] {
            let options = [
                case.flash().window(Some(37), Some(11)),
                case.flash().window(Some(100), None),
                case.flash().softcap(2.0).softmax_scale(0.7),
                case.flash().alibi_slopes(&slopes),
                case.flash()
                    .window(Some(90), Some(20))
                    .softcap(3.0)
                    .alibi_slopes(&slopes),
            ];
            for opts in options {
                let opts = opts.block_mask(mask);
                let what = format!(
                    "window {:?} softcap {} alibi {}",
                    opts.window_size,
                    opts.softcap,
                    opts.alibi_slopes.is_some()
                );
                check_f32(&what, &case, &opts)?;
            }
        }
    }
    Ok(())
}

/// bf16 and f16: the suite's low-precision rule (2x the oracle's error for the output, within
/// one ulp of the exact value; 3x for the gradients).
#[test]
fn half_precision_within_budget() -> Result<()> {
    let mut rng = rng(60);
    for dtype in [DType::BF16, DType::F16] {
        let case = Case::new(2, 200, 130, 4, 2, 64).causal(true);
        let elements = random_elements(&mut rng, 4, (200, 130), (64, 64))?;
        let mask = BlockMask::from_dense(&elements, 64, 64)?;
        check_low_precision("elements", &case, &case.flash().block_mask(&mask), dtype)?;
        let case = Case::new(1, 113, 300, 2, 1, 96);
        let mask = BlockMask::butterfly(113, 300, 64, &Device::Cpu)?;
        let opts = case.flash().block_mask(&mask).softcap(5.0);
        check_low_precision("butterfly + softcap", &case, &opts, dtype)?;
    }
    Ok(())
}

/// Packed batches: each sequence uses the top-left part of the mask (sized for the longest
/// sequences), in its own coordinates. The oracle runs each sequence alone with the mask's
/// dense form cut to its lengths.
#[test]
fn varlen_matches_per_sequence_reference() -> Result<()> {
    let mut rng = rng(70);
    let (lens_q, lens_k) = ([113, 1, 200, 0, 64, 150], [200, 70, 130, 5, 64, 0]);
    let (max_q, max_k) = (200, 200);
    let (h, hk, d) = (4, 2, 32);
    let varlen = VarLen::from_seqlens(&lens_q, &lens_k)?;
    let masks = [
        random_blocks(&mut rng, 1, (max_q, max_k), (64, 64), 0.5)?,
        random_blocks(&mut rng, h, (max_q, max_k), (64, 128), 0.6)?,
        BlockMask::from_dense(
            &random_elements(&mut rng, h, (max_q, max_k), (64, 64))?,
            64,
            64,
        )?,
        BlockMask::local_global(max_q, max_k, 64, 0, 1, &Device::Cpu)?,
    ];
    for mask in &masks {
        let (bq, bk) = mask.block_size();
        let full = mask.to_dense(max_q, max_k)?;
        for causal in [false, true] {
            let opts = FlashAttn::new().causal(causal).block_mask(mask);
            let what = format!("varlen {bq}x{bk} heads {} causal={causal}", full.dim(0)?);
            // Sequence b's oracle mask: the top-left (len_q, len_k) of the dense form.
            let for_sequence = |b: usize| -> Result<FlashAttn> {
                let cut = full.narrow(1, 0, lens_q[b])?.narrow(2, 0, lens_k[b])?;
                Ok(FlashAttn::new()
                    .causal(causal)
                    .block_mask(&BlockMask::from_dense(&cut, bq, bk)?))
            };
            let [q, k, v, out] =
                options::check_varlen_f32(&what, &varlen, (h, hk, d), &opts, for_sequence)?;
            let unmasked = dense(&opts).forward_varlen(&q, &k, &v, &varlen)?;
            assert!(
                max_abs_diff(&out, &unmasked)? > CHANGED,
                "{what}: the mask changed nothing"
            );
            // The LSE of each sequence: that of the sequence run alone with its cut mask.
            let (_, lse) = opts.forward_varlen_with_lse(&q, &k, &v, &varlen)?; // (h, total_q)
            let cu_q = varlen.cu_seqlens_q();
            for b in 0..lens_q.len() {
                if lens_q[b] == 0 {
                    continue;
                }
                let (qb, kb) = (
                    sequence(&q, cu_q, b)?,
                    sequence(&k, varlen.cu_seqlens_k(), b)?,
                );
                let ours = lse.narrow(1, cu_q[b] as usize, lens_q[b])?;
                check_lse(
                    &format!("{what} sequence {b}"),
                    &ours,
                    &lse_host(&qb, &kb, &for_sequence(b)?)?,
                )?;
            }
        }
    }
    Ok(())
}

/// Dropout with every block present drops the same entries as without a mask: the same bits.
/// With a partial mask, the result matches a softmax over the visible keys followed by the
/// dropout of `dropout_mask` (a plain-ops oracle written here, on rows that all see a key).
#[test]
fn dropout_with_a_mask() -> Result<()> {
    let (p, seed, offset) = (0.3, 0x5eed, 77);
    let with_dropout = |opts: FlashAttn| opts.dropout(p).seed(seed).rng_offset(offset);
    let case = Case::new(2, 200, 200, 4, 2, 32);
    let (sq, sk) = (case.sq, case.sk);
    for causal in [false, true] {
        let case = case.causal(causal);
        let (q, k, v) = case.qkv(DType::F32)?;
        let w = case.out_weight(DType::F32)?;

        let full = random_blocks(&mut rng(80), 1, (sq, sk), (64, 64), 1.0)?;
        let plain = with_dropout(case.flash());
        let masked = with_dropout(case.flash().block_mask(&full));
        assert_eq!(
            max_abs_diff(&masked.forward(&q, &k, &v)?, &plain.forward(&q, &k, &v)?)?,
            0.0
        );
        let a = grads(|q, k, v| masked.forward(q, k, v), &q, &k, &v, &w)?;
        let b = grads(|q, k, v| plain.forward(q, k, v), &q, &k, &v, &w)?;
        for ((name, a), b) in NAMES.iter().zip(&a).zip(&b) {
            assert_eq!(max_abs_diff(a, b)?, 0.0, "{name} causal={causal}");
        }

        // A random element mask with the diagonal visible, so that every row (causal or not,
        // sq == sk) sees at least its own key.
        let mut elements = random_elements(&mut rng(81), case.h, (sq, sk), (64, 64))?;
        let eye = Tensor::eye(sq, DType::U8, &Device::Cpu)?;
        elements = elements.broadcast_maximum(&eye)?;
        let mask = BlockMask::from_dense(&elements, 64, 64)?;
        assert!(states_present(&mask)?.contains(&2));
        let opts = with_dropout(case.flash().block_mask(&mask));
        let keep = dropout_mask(p, seed, offset, case.b, case.h, sq, sk)?;
        let oracle = |q: &Tensor, k: &Tensor, v: &Tensor| {
            dropout_oracle(q, k, v, &case, &mask.to_dense(sq, sk)?, &keep, p)
        };
        let what = format!("dropout + mask causal={causal}");
        let out = opts.forward(&q, &k, &v)?;
        assert_close(&what, &out, &oracle(&q, &k, &v)?, F32_TOL)?;
        assert!(max_abs_diff(&out, &dense(&opts).forward(&q, &k, &v)?)? > CHANGED);
        let ours = grads(|q, k, v| opts.forward(q, k, v), &q, &k, &v, &w)?;
        let expected = grads(oracle, &q, &k, &v, &w)?;
        for ((name, a), e) in NAMES.iter().zip(&ours).zip(&expected) {
            assert_close(&format!("{name} {what}"), a, e, F32_TOL)?;
        }
    }
    Ok(())
}

/// `softmax(scale · q kᵀ, over the keys `visible` (h, sq, sk) and the causal mask keep) ·
/// keep / (1 - p) · v` in plain ops, for rows that see at least one key.
fn dropout_oracle(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    case: &Case,
    visible: &Tensor,
    keep: &Tensor,
    p: f32,
) -> Result<Tensor> {
    let (b, sq, h, d) = q.dims4()?;
    let (_, sk, hk, _) = k.dims4()?;
    let repeat = |x: &Tensor| -> Result<Tensor> {
        x.unsqueeze(3)?
            .broadcast_as((b, sk, hk, h / hk, d))?
            .reshape((b, sk, h, d))?
            .transpose(1, 2)?
            .contiguous()
    };
    let q = q.transpose(1, 2)?.contiguous()?;
    let (k, v) = (repeat(k)?, repeat(v)?);
    let scores = (q.matmul(&k.t()?)? * case.scale() as f64)?; // (b, h, sq, sk)
    let causal: Vec<u8> = (0..sq)
        .flat_map(|i| (0..sk).map(move |j| u8::from(!case.causal || j + sq <= i + sk)))
        .collect();
    let causal = Tensor::from_vec(causal, (1, 1, sq, sk), &Device::Cpu)?;
    let visible = visible
        .unsqueeze(0)?
        .broadcast_mul(&causal)?
        .broadcast_as(scores.shape())?;
    let neg_inf = Tensor::new(f32::NEG_INFINITY, &Device::Cpu)?.broadcast_as(scores.shape())?;
    let scores = visible.where_cond(&scores, &neg_inf)?;
    let max = scores.max_keepdim(D::Minus1)?.detach();
    let exp = scores.broadcast_sub(&max)?.exp()?;
    let probs = exp.broadcast_div(&exp.sum_keepdim(D::Minus1)?)?;
    let probs = ((probs * keep.to_dtype(DType::F32)?)? / (1.0 - p as f64))?;
    probs.matmul(&v)?.transpose(1, 2)?.contiguous()
}

/// The direct backward gives the same bits as `backward()` through the forward.
#[test]
fn direct_backward_equals_autograd() -> Result<()> {
    let case = Case::new(2, 200, 150, 4, 2, 32).causal(true);
    let elements = random_elements(&mut rng(90), 4, (200, 150), (64, 64))?;
    let mask = BlockMask::from_dense(&elements, 64, 64)?;
    options::check_direct_backward(
        &case,
        &case.flash().block_mask(&mask).window(Some(80), None),
    )
}

/// Hidden entries are never read: NaN keys and values in absent blocks (and in hidden entries
/// of partial blocks) leave the output and gradients finite and equal to those with the
/// NaNs replaced by anything else.
#[test]
fn hidden_keys_are_not_read() -> Result<()> {
    let (sq, sk) = (128, 256);
    let case = Case::new(1, sq, sk, 2, 1, 32);
    // Keys 192..256 hidden to every query; keys 64..128 visible only to the first 64 queries
    // (block (1, 1) absent); everything else in full blocks.
    let mut m = vec![1u8; sq * sk];
    for i in 0..sq {
        for j in 0..sk {
            if j >= 192 || (i >= 64 && (64..128).contains(&j)) {
                m[i * sk + j] = 0;
            }
        }
    }
    // Block (0, 1) partial: key 100 hidden from query 3.
    m[3 * sk + 100] = 0;
    let mask = BlockMask::from_dense(&Tensor::from_vec(m, (sq, sk), &Device::Cpu)?, 64, 64)?;
    let opts = FlashAttn::new().block_mask(&mask);
    let (q, k, v) = case.qkv(DType::F32)?;
    let w = case.out_weight(DType::F32)?;
    let poison = |x: &Tensor| -> Result<Tensor> {
        let tail = Tensor::full(f32::NAN, (1, 64, 1, 32), &Device::Cpu)?;
        Tensor::cat(&[x.narrow(1, 0, 192)?, tail], 1)
    };
    let (kp, vp) = (poison(&k)?, poison(&v)?);
    let clean = opts.forward(&q, &k, &v)?;
    let poisoned = opts.forward(&q, &kp, &vp)?;
    assert_eq!(max_abs_diff(&clean, &poisoned)?, 0.0);
    let a = grads(|q, k, v| opts.forward(q, k, v), &q, &k, &v, &w)?;
    let b = grads(|q, k, v| opts.forward(q, k, v), &q, &kp, &vp, &w)?;
    for ((name, a), b) in NAMES.iter().zip(&a).zip(&b) {
        // dk and dv of the hidden keys are zero either way.
        assert_eq!(max_abs_diff(a, b)?, 0.0, "{name}");
    }
    check_f32("partial visibility", &case, &opts)?;
    Ok(())
}
