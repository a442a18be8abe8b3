//! CPU sliding window, softcapping and ALiBi (FlashAttention 2's `window_size`, `softcap`,
//! `alibi_slopes`) against `attention_slow_with`: outputs, LSE and gradients, fixed-length,
//! variable-length and KV-cache decoding, rows that see no key.
//!
//! The CPU tiles are 32 query rows by 64 keys (src/cpu.rs), so the windows below are smaller
//! than, equal to and larger than a key tile, and than the sequences.

mod common;

use candle::{DType, Device, IndexOp, Result, Tensor};
use candle_flash::{
    attention_slow, attention_slow_with, flash_attn_with_kvcache, flash_attn_with_paged_kvcache,
    FlashAttn, VarLen,
};
use common::options::{self, check_low_precision, F32_TOL};
use common::{assert_close, grads, max_abs, max_abs_diff, randn, Case};

/// Keys per CPU tile (src/cpu.rs).
const KEY_BLOCK: usize = 64;

/// ALiBi's geometric slopes for `h` heads, `(h)`.
fn slopes(h: usize) -> Result<Tensor> {
    let s: Vec<f32> = (0..h).map(|i| 0.5f32.powi(i as i32 + 1)).collect();
    Tensor::from_vec(s, h, &Device::Cpu)
}

/// Different slopes per sequence and head, `(b, h)`, one of them 0 and one negative.
fn batch_slopes(b: usize, h: usize) -> Result<Tensor> {
    let s: Vec<f32> = (0..b * h)
        .map(|i| match i {
            1 => 0.0,
            2 => -0.05,
            i => 0.03 * (i + 1) as f32,
        })
        .collect();
    Tensor::from_vec(s, (b, h), &Device::Cpu)
}

/// The options with sequence `b`'s row of per-batch ALiBi slopes as a batch of one.
fn for_sequence(opts: &FlashAttn, b: usize) -> Result<FlashAttn> {
    let mut opts = opts.clone();
    if let Some(s) = &opts.alibi_slopes {
        if s.rank() == 2 {
            opts.alibi_slopes = Some(s.narrow(0, b, 1)?);
        }
    }
    Ok(opts)
}

/// [`options::check_f32`], its tensors dropped.
fn check_f32(what: &str, case: &Case, opts: &FlashAttn) -> Result<()> {
    options::check_f32(what, case, opts).map(drop)
}

/// Windows smaller than, equal to and larger than a key tile and the sequence, both sides,
/// one side, the diagonal only, with and without the causal mask (which sets right to 0).
#[test]
fn windows_match_reference() -> Result<()> {
    let case = Case::new(1, 150, 150, 2, 1, 32);
    let windows = [
        (Some(5), Some(5)),
        (Some(KEY_BLOCK), Some(KEY_BLOCK)),
        (Some(KEY_BLOCK - 1), Some(KEY_BLOCK + 1)),
        (Some(100), Some(70)),
        (Some(300), Some(300)),
        (Some(20), None),
        (None, Some(20)),
        (Some(0), Some(0)),
        (Some(0), None),
        (None, Some(0)),
        (None, None),
    ];
    for causal in [false, true] {
        for (left, right) in windows {
            let opts = FlashAttn::new().causal(causal).window(left, right);
            let what = format!("window ({left:?}, {right:?}) causal={causal}");
            check_f32(&what, &case.causal(causal), &opts)?;
        }
    }
    Ok(())
}

/// A window wider than the sequence, on either side, is no window: the same keys in the same
/// order, so the same bits.
#[test]
fn window_wider_than_the_sequence_is_no_window() -> Result<()> {
    let case = Case::new(2, 70, 90, 4, 2, 32);
    let (q, k, v) = case.qkv(DType::F32)?;
    for causal in [false, true] {
        let plain = FlashAttn::new().causal(causal).forward(&q, &k, &v)?;
        for (left, right) in [(1000, 1000), (90, 90), (-1, -1), (1000, -1)] {
            let windowed = FlashAttn::new()
                .causal(causal)
                .window_size(left, right)
                .forward(&q, &k, &v)?;
            assert_eq!(
                max_abs_diff(&plain, &windowed)?,
                0.0,
                "({left}, {right}) causal={causal}"
            );
        }
        let reference = attention_slow(&q, &k, &v, case.scale(), causal)?;
        assert_close("wide window", &plain, &reference, F32_TOL)?;
    }
    Ok(())
}

/// seqlen_q != seqlen_k both ways (bottom-right alignment of the window), GQA and MQA, batch 2.
#[test]
fn windows_with_other_shapes() -> Result<()> {
    let shapes = [
        Case::new(1, 40, 150, 4, 2, 16),
        Case::new(1, 150, 40, 4, 2, 16),
        Case::new(2, 100, 100, 8, 2, 16),
        Case::new(2, 33, 97, 4, 1, 40),
        Case::new(1, 1, 130, 2, 2, 64),
    ];
    for case in shapes {
        for causal in [false, true] {
            for (left, right) in [(Some(16), Some(8)), (Some(70), None), (None, Some(3))] {
                let opts = FlashAttn::new().causal(causal).window(left, right);
                let what = format!("window ({left:?}, {right:?}) causal={causal}");
                check_f32(&what, &case.causal(causal), &opts)?;
            }
        }
    }
    Ok(())
}

/// Softcapping, at caps the scores reach (softmax_scale 1 gives scores of several units), and
/// at head_dim 256.
#[test]
fn softcap_matches_reference() -> Result<()> {
    let cases = [
        (Case::new(1, 70, 90, 4, 2, 16), 5.0, Some(1.0)),
        (Case::new(2, 40, 40, 2, 2, 32), 1.0, Some(0.5)),
        (Case::new(1, 33, 70, 2, 1, 256), 10.0, None),
        (Case::new(1, 90, 33, 4, 4, 256), 0.5, Some(0.2)),
    ];
    for (case, cap, scale) in cases {
        for causal in [false, true] {
            let mut opts = FlashAttn::new().causal(causal).softcap(cap);
            if let Some(s) = scale {
                opts = opts.softmax_scale(s);
            }
            check_f32(
                &format!("softcap {cap} causal={causal}"),
                &case.causal(causal),
                &opts,
            )?;
        }
    }
    Ok(())
}

/// ALiBi with `(num_heads)` and `(batch, num_heads)` slopes, seqlen_q != seqlen_k both ways.
#[test]
fn alibi_matches_reference() -> Result<()> {
    for case in [
        Case::new(2, 80, 100, 4, 2, 32),
        Case::new(2, 100, 37, 4, 4, 16),
    ] {
        for causal in [false, true] {
            let per_head = FlashAttn::new()
                .causal(causal)
                .alibi_slopes(&slopes(case.h)?);
            check_f32(
                &format!("alibi (h) causal={causal}"),
                &case.causal(causal),
                &per_head,
            )?;
            let per_seq = FlashAttn::new()
                .causal(causal)
                .alibi_slopes(&batch_slopes(case.b, case.h)?);
            check_f32(
                &format!("alibi (b, h) causal={causal}"),
                &case.causal(causal),
                &per_seq,
            )?;
        }
    }
    Ok(())
}

/// All three together: a window, a cap and per-sequence slopes, with and without causal.
fn combined(case: &Case) -> Result<FlashAttn> {
    Ok(FlashAttn::new()
        .causal(case.causal)
        .window(Some(50), Some(10))
        .softcap(3.0)
        .softmax_scale(0.6)
        .alibi_slopes(&batch_slopes(case.b, case.h)?))
}

#[test]
fn window_softcap_and_alibi_together() -> Result<()> {
    for case in [
        Case::new(2, 100, 130, 4, 2, 32),
        Case::new(2, 130, 70, 4, 1, 64),
    ] {
        for causal in [false, true] {
            let case = case.causal(causal);
            check_f32(
                &format!("combined causal={causal}"),
                &case,
                &combined(&case)?,
            )?;
        }
    }
    Ok(())
}

#[test]
fn half_precision_within_budget() -> Result<()> {
    for dtype in [DType::F16, DType::BF16] {
        let case = Case::new(2, 70, 100, 4, 2, 32).causal(true);
        check_low_precision("combined", &case, &combined(&case)?, dtype)?;
        let case = Case::new(1, 100, 70, 2, 2, 64);
        let opts = FlashAttn::new().window(Some(20), Some(5)).softcap(2.0);
        check_low_precision("window + softcap", &case, &opts, dtype)?;
    }
    Ok(())
}

/// A window that leaves the first rows without keys (seqlen_q > seqlen_k): those rows are
/// zeros with LSE -inf and zero dq; every gradient is finite, and the rest matches.
#[test]
fn rows_that_see_no_key() -> Result<()> {
    // off = -20: row i sees keys i - 23 ..= i - 17, so rows 0..17 see none.
    let case = Case::new(2, 40, 20, 4, 2, 16);
    let dead = 17;
    let options = [
        FlashAttn::new().window(Some(3), Some(3)),
        FlashAttn::new()
            .window(Some(3), Some(3))
            .softcap(2.0)
            .alibi_slopes(&batch_slopes(2, 4)?),
    ];
    for opts in options {
        let (q, k, v) = case.qkv(DType::F32)?;
        let (out, lse) = opts.forward_with_lse(&q, &k, &v)?;
        let zero = |t: Tensor| -> Result<bool> {
            Ok(t.flatten_all()?.to_vec1::<f32>()?.iter().all(|&x| x == 0.0))
        };
        assert!(
            zero(out.i((.., ..dead))?)?,
            "rows without keys must be zero"
        );
        let dead_lse = lse.i((.., .., ..dead))?.flatten_all()?.to_vec1::<f32>()?;
        assert!(dead_lse.iter().all(|&x| x == f32::NEG_INFINITY));
        let live_lse = lse.i((.., .., dead..))?.flatten_all()?.to_vec1::<f32>()?;
        assert!(live_lse.iter().all(|x| x.is_finite()));
        let w = case.out_weight(DType::F32)?;
        let [dq, dk, dv] = grads(|q, k, v| opts.forward(q, k, v), &q, &k, &v, &w)?;
        assert!(
            zero(dq.i((.., ..dead))?)?,
            "dq of rows without keys must be zero"
        );
        for g in [&dq, &dk, &dv] {
            let g = g.flatten_all()?.to_vec1::<f32>()?;
            assert!(g.iter().all(|x| x.is_finite()));
        }
        check_f32("rows without keys", &case, &opts)?;
    }
    Ok(())
}

/// The direct backward gives the same bits as `backward()` through the forward.
#[test]
fn direct_backward_equals_autograd() -> Result<()> {
    let case = Case::new(2, 70, 90, 4, 2, 32).causal(true);
    options::check_direct_backward(&case, &combined(&case)?)
}

/// Packed batches: each sequence aligns its window bottom-right with its own lengths and
/// reads its own row of `(batch, num_heads)` slopes. Lengths around a tile, 0 on either side,
/// seqlen_q != seqlen_k both ways.
#[test]
fn varlen_matches_per_sequence_loop() -> Result<()> {
    let (lens_q, lens_k) = ([17, 113, 0, 5, 70], [113, 17, 9, 0, 70]);
    let (h, hk, d) = (4, 2, 16);
    let varlen = VarLen::from_seqlens(&lens_q, &lens_k)?;
    let b = lens_q.len();
    let options = [
        FlashAttn::new().window(Some(8), Some(4)),
        FlashAttn::new().causal(true).window(Some(30), None),
        FlashAttn::new().alibi_slopes(&slopes(h)?),
        FlashAttn::new()
            .causal(true)
            .window(Some(40), None)
            .softcap(2.0)
            .alibi_slopes(&batch_slopes(b, h)?),
    ];
    for opts in &options {
        let what = format!(
            "varlen window {:?} causal={} alibi={}",
            opts.window_size,
            opts.causal,
            opts.alibi_slopes.is_some()
        );
        options::check_varlen_f32(&what, &varlen, (h, hk, d), opts, |b| for_sequence(opts, b))?;
    }
    Ok(())
}

/// One decoding call's inputs: q `(b, s_q, h, d)`, caches `(b, cap, hk, d)` holding `lens[b]`
/// tokens, `s_new` new ones.
struct Decode {
    lens: Vec<usize>,
    s_q: usize,
    s_new: usize,
    h: usize,
    hk: usize,
    d: usize,
}

const PAGE: usize = 16;

impl Decode {
    fn b(&self) -> usize {
        self.lens.len()
    }

    /// Whole pages, with room for the longest sequence.
    fn capacity(&self) -> usize {
        (self.lens.iter().max().unwrap_or(&0) + self.s_new + 1).next_multiple_of(PAGE)
    }

    /// Output of the contiguous and the paged call, and the oracle: `attention_slow_with` of
    /// each sequence over its first `lens[b] + s_new` tokens.
    fn run(&self, opts: &FlashAttn) -> Result<[Tensor; 3]> {
        let (b, cap, hk, d) = (self.b(), self.capacity(), self.hk, self.d);
        let q = randn((b, self.s_q, self.h, d), DType::F32)?;
        let k0 = randn((b, cap, hk, d), DType::F32)?;
        let v0 = randn((b, cap, hk, d), DType::F32)?;
        let k_new = randn((b, self.s_new, hk, d), DType::F32)?;
        let v_new = randn((b, self.s_new, hk, d), DType::F32)?;
        let new_kv = (self.s_new > 0).then_some((&k_new, &v_new));
        let lens: Vec<u32> = self.lens.iter().map(|&l| l as u32).collect();

        let (k, v) = (k0.copy()?, v0.copy()?);
        let contiguous = flash_attn_with_kvcache(&q, &k, &v, new_kv, &lens, opts)?;

        // Pages of sequence b are the reversed run b * max_pages .. (b + 1) * max_pages.
        let max_pages = cap / PAGE;
        let table: Vec<u32> = (0..b * max_pages)
            .map(|s| ((s / max_pages) * max_pages + max_pages - 1 - s % max_pages) as u32)
            .collect();
        let pages = |c: &Tensor| -> Result<Tensor> {
            let mut by_id = vec![None; b * max_pages];
            for (slot, &page) in table.iter().enumerate() {
                let (seq, p) = (slot / max_pages, slot % max_pages);
                by_id[page as usize] = Some(c.i(seq)?.narrow(0, p * PAGE, PAGE)?);
            }
            Tensor::stack(&by_id.into_iter().flatten().collect::<Vec<_>>(), 0)
        };
        let (kp, vp) = (pages(&k0)?, pages(&v0)?);
        let paged =
            flash_attn_with_paged_kvcache(&q, &kp, &vp, new_kv, &lens, &table, max_pages, opts)?;

        let expected = (0..b)
            .map(|s| {
                let len = self.lens[s];
                let prefix = |c: &Tensor, new: &Tensor| {
                    Tensor::cat(&[c.i(s)?.narrow(0, 0, len)?, new.i(s)?], 0)?.unsqueeze(0)
                };
                let q = q.narrow(0, s, 1)?;
                let (k, v) = (prefix(&k0, &k_new)?, prefix(&v0, &v_new)?);
                attention_slow_with(&q, &k, &v, &for_sequence(opts, s)?)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok([contiguous, paged, Tensor::cat(&expected, 0)?])
    }
}

/// KV-cache decoding (contiguous and paged) with a sliding window over the newest tokens,
/// softcapping and ALiBi, one query and a few, with new tokens and without.
#[test]
fn kvcache_decoding_matches_prefix_reference() -> Result<()> {
    let (h, hk) = (4, 2);
    let b = 3;
    let options = [
        FlashAttn::new().causal(true).window(Some(16), None),
        FlashAttn::new().window(Some(KEY_BLOCK + 5), Some(0)),
        FlashAttn::new()
            .causal(true)
            .softcap(2.0)
            .softmax_scale(1.0),
        FlashAttn::new().causal(true).alibi_slopes(&slopes(h)?),
        FlashAttn::new()
            .causal(true)
            .window(Some(40), None)
            .softcap(3.0)
            .alibi_slopes(&batch_slopes(b, h)?),
    ];
    for opts in &options {
        for (s_q, s_new) in [(1, 1), (4, 4), (4, 0), (1, 0)] {
            let case = Decode {
                lens: vec![30, 150, 6],
                s_q,
                s_new,
                h,
                hk,
                d: 32,
            };
            let [contiguous, paged, expected] = case.run(opts)?;
            let what = format!(
                "decode s_q={s_q} s_new={s_new} window {:?} causal={} softcap={} alibi={}",
                opts.window_size,
                opts.causal,
                opts.softcap,
                opts.alibi_slopes.is_some()
            );
            assert_close(
                &format!("{what} contiguous"),
                &contiguous,
                &expected,
                F32_TOL,
            )?;
            assert_close(&format!("{what} paged"), &paged, &expected, F32_TOL)?;
        }
    }
    Ok(())
}

/// Window sides at the integer limit, and at or past the keys, are no window (FlashAttention
/// 2's rule): outputs and gradients equal the unwindowed call's, on the fixed-length, varlen
/// and decode paths and in the oracle. Before the rule, `key_range`'s sums wrapped and these
/// rows saw no key (all-zero outputs).
#[test]
fn huge_window_sides_are_no_window() -> Result<()> {
    let huge = [
        (None, Some(usize::MAX)),
        (Some(usize::MAX), None),
        (Some(usize::MAX), Some(usize::MAX)),
        (Some(i64::MAX as usize), Some(i64::MAX as usize)),
    ];
    for case in [
        Case::new(2, 70, 90, 4, 2, 32),
        Case::new(1, 150, 40, 2, 1, 16),
        Case::new(1, 1, 33, 2, 2, 8),
    ] {
        let (q, k, v) = case.qkv(DType::F32)?;
        let w = case.out_weight(DType::F32)?;
        for causal in [false, true] {
            let plain = FlashAttn::new().causal(causal);
            let out = plain.forward(&q, &k, &v)?;
            let g = grads(|q, k, v| plain.forward(q, k, v), &q, &k, &v, &w)?;
            let reference = attention_slow(&q, &k, &v, case.scale(), causal)?;
            assert_close("plain", &out, &reference, F32_TOL)?;
            let at_keys = Some(case.sk);
            for (left, right) in huge.into_iter().chain([(at_keys, at_keys)]) {
                let what = format!("{case:?} window ({left:?}, {right:?}) causal={causal}");
                let opts = plain.clone().window(left, right);
                assert_eq!(
                    max_abs_diff(&opts.forward(&q, &k, &v)?, &out)?,
                    0.0,
                    "{what}"
                );
                let gw = grads(|q, k, v| opts.forward(q, k, v), &q, &k, &v, &w)?;
                for (a, b) in gw.iter().zip(&g) {
                    assert_eq!(max_abs_diff(a, b)?, 0.0, "{what}: gradients");
                }
                let slow = attention_slow_with(&q, &k, &v, &opts)?;
                assert_close(&format!("{what}: oracle"), &slow, &reference, F32_TOL)?;
            }
        }
    }
    // Decoding: contiguous and paged caches, a window side past every sequence's keys.
    for (left, right) in huge {
        let opts = FlashAttn::new().causal(true).window(left, right);
        let case = Decode {
            lens: vec![30, 150, 6],
            s_q: 3,
            s_new: 2,
            h: 4,
            hk: 2,
            d: 16,
        };
        let [contiguous, paged, expected] = case.run(&opts)?;
        let what = format!("decode window ({left:?}, {right:?})");
        assert_close(
            &format!("{what} contiguous"),
            &contiguous,
            &expected,
            F32_TOL,
        )?;
        assert_close(&format!("{what} paged"), &paged, &expected, F32_TOL)?;
        assert!(
            max_abs(&expected)? > 0.1,
            "{what}: the oracle's rows are empty"
        );
    }
    Ok(())
}

/// The right side at `seqlen_k` with more queries than keys: unbounded by the rule, where the
/// formula alone would hide every key from the first `seqlen_q - 2 seqlen_k` rows; one key
/// less and the formula applies.
#[test]
fn right_side_at_the_keys_is_unbounded() -> Result<()> {
    let case = Case::new(1, 100, 20, 2, 2, 16);
    let (q, k, v) = case.qkv(DType::F32)?;
    let plain = FlashAttn::new().forward(&q, &k, &v)?;
    let at = FlashAttn::new()
        .window(None, Some(20))
        .forward(&q, &k, &v)?;
    assert_eq!(max_abs_diff(&at, &plain)?, 0.0);
    let below = FlashAttn::new().window(None, Some(19));
    check_f32("right 19 of 20 keys", &case, &below)?;
    // Row 0 sees keys up to 0 + 20 - 100 + 19 < 0: none, so its output is zero.
    let row0 = below.forward(&q, &k, &v)?.narrow(1, 0, 1)?;
    assert_eq!(max_abs(&row0)?, 0.0);
    Ok(())
}
