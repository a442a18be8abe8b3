//! GPU tests for KV-cache decoding: in-place append (contiguous and paged), split-KV decode,
//! GQA packing, against `attention_slow` on each sequence's prefix.

use candle::{DType, Device, IndexOp, Result, Tensor};
use candle_flash::{
    attention_slow, flash_attn_with_kvcache, flash_attn_with_paged_kvcache, FlashAttn, KvCache,
    PagedKvCache,
};

use crate::cuda_suite::{
    check_output, check_rule, has_nan, max_abs_diff, randn, to_reference, Suite,
};

#[derive(Clone, Debug)]
struct DecodeCase {
    lens: Vec<usize>, // tokens in the cache before the call
    s_q: usize,
    s_new: usize, // 0: no new k/v
    h: usize,
    hk: usize,
    d: usize,
    causal: bool,
    page_size: Option<usize>,
}

/// Runs one decode call and checks the output against `attention_slow` on each prefix (2x
/// rule against the f32 reference) and the cache rows the append wrote.
fn decode_case(dev: &Device, c: &DecodeCase, dtype: DType) -> Result<()> {
    let b = c.lens.len();
    let capacity = c.lens.iter().max().copied().unwrap_or(0) + c.s_new + 3;
    let scale = 1.0 / (c.d as f32).sqrt();
    let q = randn(&[b, c.s_q, c.h, c.d], dtype, dev)?;
    // The contiguous view of the cache each sequence sees: (b, capacity, hk, d).
    let k_full = randn(&[b, capacity, c.hk, c.d], dtype, dev)?;
    let v_full = randn(&[b, capacity, c.hk, c.d], dtype, dev)?;
    let new = if c.s_new > 0 {
        Some((
            randn(&[b, c.s_new, c.hk, c.d], dtype, dev)?,
            randn(&[b, c.s_new, c.hk, c.d], dtype, dev)?,
        ))
    } else {
        None
    };
    let seqlens: Vec<u32> = c.lens.iter().map(|&l| l as u32).collect();
    let opts = FlashAttn::new().causal(c.causal);
    let new_ref = new.as_ref().map(|(k, v)| (k, v));

    let (out, k_after, v_after) = match c.page_size {
        None => {
            let (k_cache, v_cache) = (k_full.copy()?, v_full.copy()?);
            let out = flash_attn_with_kvcache(&q, &k_cache, &v_cache, new_ref, &seqlens, &opts)?;
            (out, k_cache, v_cache)
        }
        Some(page) => {
            // Pages in reverse order, one spare page at the front, so page != sequence slot.
            let max_pages = capacity.div_ceil(page);
            let num_pages = b * max_pages + 1;
            let table: Vec<u32> = (0..b * max_pages)
                .map(|i| (num_pages - 1 - i) as u32)
                .collect();
            let to_pages = |full: &Tensor| -> Result<Tensor> {
                let padded = full.pad_with_zeros(1, 0, max_pages * page - capacity)?;
                let pages = padded.reshape((b * max_pages, page, c.hk, c.d))?;
                // page p of sequence s goes to slot table[s * max_pages + p]
                let mut slots = vec![Tensor::zeros((1, page, c.hk, c.d), dtype, dev)?; num_pages];
                for (i, &slot) in table.iter().enumerate() {
                    slots[slot as usize] = pages.i(i..i + 1)?;
                }
                Tensor::cat(&slots, 0)
            };
            let (k_pages, v_pages) = (to_pages(&k_full)?, to_pages(&v_full)?);
            let out = flash_attn_with_paged_kvcache(
                &q, &k_pages, &v_pages, new_ref, &seqlens, &table, max_pages, &opts,
            )?;
            // Back to (b, capacity, hk, d) to check the append.
            let from_pages = |pages: &Tensor| -> Result<Tensor> {
                let rows: Vec<Tensor> = table
                    .iter()
                    .map(|&slot| pages.i(slot as usize..slot as usize + 1))
                    .collect::<Result<_>>()?;
                Tensor::cat(&rows, 0)?
                    .reshape((b, max_pages * page, c.hk, c.d))?
                    .narrow(1, 0, capacity)
            };
            (out, from_pages(&k_pages)?, from_pages(&v_pages)?)
        }
    };
    if has_nan(&out)? {
        candle::bail!("output has NaN");
    }
    for i in 0..b {
        let (len, total) = (c.lens[i], c.lens[i] + c.s_new);
        // The append wrote exactly rows len..len + s_new; the rest is untouched.
        let (k_exp, v_exp) = match &new {
            Some((kn, vn)) => (
                Tensor::cat(
                    &[
                        k_full.i((i, 0..len))?,
                        kn.i(i)?,
                        k_full.i((i, total..capacity))?,
                    ],
                    0,
                )?,
                Tensor::cat(
                    &[
                        v_full.i((i, 0..len))?,
                        vn.i(i)?,
                        v_full.i((i, total..capacity))?,
                    ],
                    0,
                )?,
            ),
            None => (k_full.i(i)?, v_full.i(i)?),
        };
        if max_abs_diff(&k_after.i(i)?, &k_exp)? != 0.0
            || max_abs_diff(&v_after.i(i)?, &v_exp)? != 0.0
        {
            candle::bail!("sequence {i}: cache contents after the append are wrong");
        }
        if total == 0 {
            // Nothing to attend to: zeros. (Converting an empty CUDA tensor would launch an
            // empty grid, which CUDA rejects, so the reference below needs total > 0.)
            let sum = out
                .i(i)?
                .to_dtype(DType::F32)?
                .abs()?
                .sum_all()?
                .to_scalar::<f32>()?;
            if sum != 0.0 {
                candle::bail!("sequence {i} has an empty cache but a nonzero output");
            }
            continue;
        }
        let qi = to_reference(&q.i(i..i + 1)?)?;
        let ki = to_reference(&k_after.i((i..i + 1, 0..total))?)?;
        let vi = to_reference(&v_after.i((i..i + 1, 0..total))?)?;
        let f32_of = |t: &Tensor| t.to_dtype(DType::F32);
        let reference =
            attention_slow(&f32_of(&qi)?, &f32_of(&ki)?, &f32_of(&vi)?, scale, c.causal)?;
        let low = attention_slow(&qi, &ki, &vi, scale, c.causal)?;
        let ours = out.i(i..i + 1)?;
        check_output(
            &format!("sequence {i} (len {total})"),
            &ours,
            &low,
            &reference,
        )?;
    }
    Ok(())
}

/// Token-by-token generation through `KvCache` equals attention over the whole sequence.
fn generation_loop(dev: &Device) -> Result<()> {
    let (b, h, hk, d, steps) = (2, 8, 2, 64, 40);
    let mut cache = KvCache::new(b, 64, hk, d, DType::BF16, dev)?;
    let qs = randn(&[b, steps, h, d], DType::BF16, dev)?;
    let ks = randn(&[b, steps, hk, d], DType::BF16, dev)?;
    let vs = randn(&[b, steps, hk, d], DType::BF16, dev)?;
    let opts = FlashAttn::new().causal(true);
    let mut outs = vec![];
    for t in 0..steps {
        let s = |x: &Tensor| x.narrow(1, t, 1);
        outs.push(cache.append_and_attend(&s(&qs)?, &s(&ks)?, &s(&vs)?, &opts)?);
    }
    let stepwise = Tensor::cat(&outs, 1)?;
    let f32_of = |t: &Tensor| to_reference(t)?.to_dtype(DType::F32);
    let scale = 1.0 / (d as f32).sqrt();
    let full = attention_slow(&f32_of(&qs)?, &f32_of(&ks)?, &f32_of(&vs)?, scale, true)?;
    // The accuracy rule, not a fixed bound: at most twice the error of the same attention
    // computed in bf16.
    let low = attention_slow(
        &to_reference(&qs)?,
        &to_reference(&ks)?,
        &to_reference(&vs)?,
        scale,
        true,
    )?;
    check_rule(
        "generation loop vs full attention",
        &stepwise,
        &low,
        &full,
        2.0,
        1e-5,
    )?;
    if cache.lengths() != [steps as u32, steps as u32] {
        candle::bail!("lengths {:?}", cache.lengths());
    }
    Ok(())
}

pub(crate) fn run(dev: &Device, quick: bool, suite: &mut Suite) {
    let len_sets: Vec<Vec<usize>> = if quick {
        vec![vec![1, 7, 255]]
    } else {
        vec![vec![1, 7, 255, 4097], vec![0, 300, 64], vec![8191]]
    };
    // First (the quick grid keeps the first 12): page sizes that are not a multiple of the
    // kernel's 16-key tile (rows looked up one by one), and a batch past the 128 lengths that
    // travel inline with the launch.
    let mut cases = vec![];
    for page_size in [8, 24] {
        cases.push(DecodeCase {
            lens: vec![1, 7, 255, 100],
            s_q: 4,
            s_new: 3,
            h: 8,
            hk: 2,
            d: 128,
            causal: true,
            page_size: Some(page_size),
        });
    }
    cases.push(DecodeCase {
        lens: (0..130).map(|i| (i * 37) % 300).collect(),
        s_q: 1,
        s_new: 1,
        h: 4,
        hk: 4,
        d: 64,
        causal: true,
        page_size: None,
    });
    // Split launches (8-warp blocks, the merge in the last split; see `block_warps` in
    // src/cuda/decode.rs), contiguous and paged, so that the quick grid (and with it the
    // sanitizer runs) covers them too.
    for (d, page_size) in [(128, None), (64, Some(16))] {
        cases.push(DecodeCase {
            lens: vec![33, 2000],
            s_q: 1,
            s_new: 1,
            h: 8,
            hk: 2,
            d,
            causal: true,
            page_size,
        });
    }
    for lens in &len_sets {
        for &(s_q, s_new) in &[(1usize, 1usize), (4, 4), (16, 0), (1, 0), (4, 9)] {
            for &(h, hk) in &[(8usize, 8usize), (8, 2), (32, 4)] {
                for page_size in [None, Some(16), Some(256)] {
                    cases.push(DecodeCase {
                        lens: lens.clone(),
                        s_q,
                        s_new,
                        h,
                        hk,
                        d: 128,
                        causal: true,
                        page_size,
                    });
                }
            }
        }
    }
    // Other head dims and no mask, on one setting each; 2000 keys make it a split launch
    // with 8-warp blocks up to hd 128 (src/cuda/decode.rs, `block_warps`).
    for d in [32, 40, 64, 96, 160, 256] {
        cases.push(DecodeCase {
            lens: vec![33, 2000],
            s_q: 4,
            s_new: 2,
            h: 8,
            hk: 2,
            d,
            causal: false,
            page_size: Some(16),
        });
    }
    if quick {
        cases.truncate(12);
    }
    for c in &cases {
        for dtype in [DType::BF16, DType::F16] {
            suite.record(
                &format!("decode {dtype:?} {c:?}"),
                decode_case(dev, c, dtype),
            );
        }
    }
    suite.record("decode generation loop", generation_loop(dev));
    for page_size in [None, Some(16), Some(5)] {
        suite.record(
            &format!("ragged append then decode, page_size {page_size:?}"),
            ragged_append(dev, page_size),
        );
    }
}

/// `append_varlen` (a packed prefill of prompts of different lengths, one of them empty)
/// followed by a decoding step: each sequence's output equals attention over exactly its own
/// keys, so no row of another sequence or of stale memory was written or read.
fn ragged_append(dev: &Device, page_size: Option<usize>) -> Result<()> {
    let (h, hk, d, dtype) = (8, 2, 64, DType::BF16);
    let lens = [37usize, 0, 300, 1];
    let total: usize = lens.iter().sum();
    let (b, capacity) = (lens.len(), 320);
    let k_new = randn(&[total, hk, d], dtype, dev)?;
    let v_new = randn(&[total, hk, d], dtype, dev)?;
    let q = randn(&[b, 1, h, d], dtype, dev)?;
    let k_step = randn(&[b, 1, hk, d], dtype, dev)?;
    let v_step = randn(&[b, 1, hk, d], dtype, dev)?;
    let opts = FlashAttn::new().causal(true);
    let out = match page_size {
        None => {
            let mut c = KvCache::new(b, capacity, hk, d, dtype, dev)?;
            c.append_varlen(&k_new, &v_new, &lens)?;
            c.append_and_attend(&q, &k_step, &v_step, &opts)?
        }
        Some(ps) => {
            let per_seq = capacity.div_ceil(ps);
            let mut c = PagedKvCache::new(b, b * per_seq, ps, per_seq, hk, d, dtype, dev)?;
            c.append_varlen(&k_new, &v_new, &lens)?;
            c.append_and_attend(&q, &k_step, &v_step, &opts)?
        }
    };
    let mut start = 0;
    for (s, &len) in lens.iter().enumerate() {
        let keys = |packed: &Tensor, step: &Tensor| -> Result<Tensor> {
            let own = packed.narrow(0, start, len)?.unsqueeze(0)?;
            Tensor::cat(&[&own, &step.i(s..s + 1)?], 1)
        };
        let (k, v) = (keys(&k_new, &k_step)?, keys(&v_new, &v_step)?);
        let qs = q.i(s..s + 1)?;
        let scale = 1.0 / (d as f32).sqrt();
        let (qs, k, v) = (to_reference(&qs)?, to_reference(&k)?, to_reference(&v)?);
        let f32_of = |t: &Tensor| t.to_dtype(DType::F32);
        let reference = attention_slow(&f32_of(&qs)?, &f32_of(&k)?, &f32_of(&v)?, scale, true)?;
        let low = attention_slow(&qs, &k, &v, scale, true)?;
        check_output(
            &format!("sequence {s}"),
            &out.i(s..s + 1)?,
            &low,
            &reference,
        )?;
        start += len;
    }
    Ok(())
}
