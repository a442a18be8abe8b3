//! GPU tests for the FP8 (e4m3) KV cache: the append quantizes each new row with its head's
//! scale (bit for bit the CPU's quantization), and decoding over the cache equals attention
//! over the dequantized cache by the 2x rule, contiguous and paged (pages that split the
//! kernel's 16-key tiles too), GQA packing, split launches, every compiled head dim, host and
//! device lengths with the LSE, rotary embedding fused into the quantizing append.

use candle::{DType, Device, IndexOp, Result, Tensor};
use candle_flash::{
    attention_slow, flash_attn_with_kvcache, flash_attn_with_kvcache_lse,
    flash_attn_with_paged_kvcache, flash_attn_with_paged_kvcache_lse, FlashAttn,
};

use crate::cuda_suite::{check_output, has_nan, max_abs_diff, randn, to_reference, Suite};

#[derive(Clone, Debug)]
struct Fp8Case {
    lens: Vec<usize>,
    s_q: usize,
    s_new: usize,
    h: usize,
    hk: usize,
    d: usize,
    causal: bool,
    page_size: Option<usize>,
    device: bool,
}

/// Per-head scales `(hk,)`: different per head, so a head read with another's scale fails.
fn scales(hk: usize, base: f32, dev: &Device) -> Result<Tensor> {
    let s: Vec<f32> = (0..hk).map(|i| base * (1.0 + 0.37 * i as f32)).collect();
    Tensor::from_vec(s, hk, dev)
}

/// The real values of an e4m3 cache `(.., hk, d)`: each element times its head's scale, f32,
/// on the CPU (candle-core 0.11.1's CUDA casts from F8E4M3 fail; its CPU ones work).
fn dequantize(cache: &Tensor, scale: &Tensor) -> Result<Tensor> {
    let (cpu, hk) = (Device::Cpu, scale.dim(0)?);
    cache
        .to_device(&cpu)?
        .to_dtype(DType::F32)?
        .broadcast_mul(&scale.to_device(&cpu)?.reshape((hk, 1))?)
}

/// What the append must write: `e4m3(x / scale)` computed on the CPU in f32.
fn quantize_cpu(x: &Tensor, scale: &Tensor) -> Result<Tensor> {
    let hk = scale.dim(0)?;
    let cpu = Device::Cpu;
    x.to_device(&cpu)?
        .to_dtype(DType::F32)?
        .broadcast_div(&scale.to_device(&cpu)?.reshape((hk, 1))?)?
        .to_dtype(DType::F8E4M3)
}

fn fp8_case(dev: &Device, c: &Fp8Case, dtype: DType) -> Result<()> {
    let b = c.lens.len();
    let capacity = c.lens.iter().max().copied().unwrap_or(0) + c.s_new + 3;
    let scale = 1.0 / (c.d as f32).sqrt();
    let (k_scale, v_scale) = (scales(c.hk, 0.011, dev)?, scales(c.hk, 0.007, dev)?);
    let q = randn(&[b, c.s_q, c.h, c.d], dtype, dev)?;
    // The cache as the append would have left it: (b, capacity, hk, d) e4m3.
    let k_full =
        quantize_cpu(&randn(&[b, capacity, c.hk, c.d], dtype, dev)?, &k_scale)?.to_device(dev)?;
    let v_full =
        quantize_cpu(&randn(&[b, capacity, c.hk, c.d], dtype, dev)?, &v_scale)?.to_device(dev)?;
    let new = match c.s_new {
        0 => None,
        n => Some((
            randn(&[b, n, c.hk, c.d], dtype, dev)?,
            randn(&[b, n, c.hk, c.d], dtype, dev)?,
        )),
    };
    let seqlens: Vec<u32> = c.lens.iter().map(|&l| l as u32).collect();
    let seqlens_dev = Tensor::new(seqlens.as_slice(), dev)?;
    let opts = FlashAttn::new()
        .causal(c.causal)
        .kv_cache_scales(&k_scale, &v_scale);
    let new_ref = new.as_ref().map(|(k, v)| (k, v));

    let (out, lse, k_after, v_after) = match c.page_size {
        None => {
            let (k_cache, v_cache) = (k_full.copy()?, v_full.copy()?);
            let (out, lse) = if c.device {
                let (o, l) = flash_attn_with_kvcache_lse(
                    &q,
                    &k_cache,
                    &v_cache,
                    new_ref,
                    &seqlens_dev,
                    &opts,
                )?;
                (o, Some(l))
            } else {
                let o = flash_attn_with_kvcache(&q, &k_cache, &v_cache, new_ref, &seqlens, &opts)?;
                (o, None)
            };
            (out, lse, k_cache, v_cache)
        }
        Some(page) => {
            // Pages in reverse order with a spare first page, as in the bf16 tests.
            let max_pages = capacity.div_ceil(page);
            let num_pages = b * max_pages + 1;
            let table: Vec<u32> = (0..b * max_pages)
                .map(|i| (num_pages - 1 - i) as u32)
                .collect();
            // Built on the CPU, where candle's F8E4M3 casts work (e4m3 -> f32 -> e4m3 is
            // exact).
            let to_pages = |full: &Tensor| -> Result<Tensor> {
                let cpu = Device::Cpu;
                let padded = full.to_device(&cpu)?.to_dtype(DType::F32)?.pad_with_zeros(
                    1,
                    0,
                    max_pages * page - capacity,
                )?;
                let pages = padded.reshape((b * max_pages, page, c.hk, c.d))?;
                let mut slots =
                    vec![Tensor::zeros((1, page, c.hk, c.d), DType::F32, &cpu)?; num_pages];
                for (i, &slot) in table.iter().enumerate() {
                    slots[slot as usize] = pages.i(i..i + 1)?;
                }
                Tensor::cat(&slots, 0)?
                    .to_dtype(DType::F8E4M3)?
                    .to_device(dev)
            };
            let (k_pages, v_pages) = (to_pages(&k_full)?, to_pages(&v_full)?);
            let (out, lse) = if c.device {
                let table_dev = Tensor::from_slice(&table, (b, max_pages), dev)?;
                let (o, l) = flash_attn_with_paged_kvcache_lse(
                    &q,
                    &k_pages,
                    &v_pages,
                    new_ref,
                    &seqlens_dev,
                    &table_dev,
                    max_pages,
                    &opts,
                )?;
                (o, Some(l))
            } else {
                let o = flash_attn_with_paged_kvcache(
                    &q, &k_pages, &v_pages, new_ref, &seqlens, &table, max_pages, &opts,
                )?;
                (o, None)
            };
            let from_pages = |pages: &Tensor| -> Result<Tensor> {
                let rows: Vec<Tensor> = table
                    .iter()
                    .map(|&slot| pages.i(slot as usize..slot as usize + 1))
                    .collect::<Result<_>>()?;
                Tensor::cat(&rows, 0)?
                    .reshape((b, max_pages * page, c.hk, c.d))?
                    .narrow(1, 0, capacity)
            };
            (out, lse, from_pages(&k_pages)?, from_pages(&v_pages)?)
        }
    };
    if has_nan(&out)? {
        candle::bail!("output has NaN");
    }
    let f32_of = |t: &Tensor| t.to_dtype(DType::F32);
    for i in 0..b {
        let (len, total) = (c.lens[i], c.lens[i] + c.s_new);
        // The append wrote exactly the quantized new rows; the rest is untouched (compared as
        // f32: e4m3 -> f32 is exact and one-to-one apart from NaN, which no input makes).
        let expect = |full: &Tensor, new: Option<&Tensor>, s: &Tensor| -> Result<Tensor> {
            let full = full.i(i)?.to_device(&Device::Cpu)?;
            match new {
                Some(n) => Tensor::cat(
                    &[
                        full.i(0..len)?,
                        quantize_cpu(&n.i(i)?, s)?,
                        full.i(total..capacity)?,
                    ],
                    0,
                ),
                None => Ok(full),
            }
        };
        let k_exp = expect(&k_full, new.as_ref().map(|n| &n.0), &k_scale)?;
        let v_exp = expect(&v_full, new.as_ref().map(|n| &n.1), &v_scale)?;
        let cpu = |t: &Tensor| t.to_device(&Device::Cpu)?.to_dtype(DType::F32);
        if max_abs_diff(&cpu(&k_after.i(i)?)?, &f32_of(&k_exp)?)? != 0.0
            || max_abs_diff(&cpu(&v_after.i(i)?)?, &f32_of(&v_exp)?)? != 0.0
        {
            candle::bail!("sequence {i}: the quantized cache rows after the append are wrong");
        }
        if total == 0 {
            let sum = out.i(i)?.to_dtype(DType::F32)?.abs()?.sum_all()?;
            if sum.to_scalar::<f32>()? != 0.0 {
                candle::bail!("sequence {i} has an empty cache but a nonzero output");
            }
            continue;
        }
        // The reference attends over the dequantized cache in f32; the low-precision one
        // over the same values rounded to q's dtype.
        let qi = to_reference(&q.i(i..i + 1)?)?;
        // On q's reference device (the dequantization runs on the CPU).
        let on_ref = |t: Tensor| t.to_device(qi.device());
        let ki = on_ref(dequantize(&k_after.i((i..i + 1, 0..total))?, &k_scale)?)?;
        let vi = on_ref(dequantize(&v_after.i((i..i + 1, 0..total))?, &v_scale)?)?;
        let reference = attention_slow(&f32_of(&qi)?, &ki, &vi, scale, c.causal)?;
        let low = attention_slow(
            &qi,
            &ki.to_dtype(dtype)?,
            &vi.to_dtype(dtype)?,
            scale,
            c.causal,
        )?;
        let what = format!("sequence {i} (len {total})");
        check_output(&what, &out.i(i..i + 1)?, &low, &reference)?;
        if let Some(lse) = &lse {
            let (_, want) = FlashAttn::new().causal(c.causal).forward_with_lse(
                &f32_of(&qi)?.to_device(&Device::Cpu)?,
                &ki.to_device(&Device::Cpu)?,
                &vi.to_device(&Device::Cpu)?,
            )?;
            let got = lse.i(i..i + 1)?.to_device(&Device::Cpu)?;
            let (g, w) = (
                got.flatten_all()?.to_vec1::<f32>()?,
                want.flatten_all()?.to_vec1::<f32>()?,
            );
            // q times the K scale is rounded to f16 in the kernel: a relative error of 2^-11
            // in each score.
            for (j, (g, w)) in g.iter().zip(&w).enumerate() {
                if (g - w).abs() > 2e-3 * (1.0 + w.abs()) {
                    candle::bail!("{what}: lse[{j}] = {g}, expected {w}");
                }
            }
        }
    }
    Ok(())
}

/// Rotary embedding in the quantizing append: the GPU's cache rows against the same call on
/// the CPU (which rotates in q's dtype, then quantizes): V equal, K equal but for rare
/// one-step roundings (the two rotate in f32 with different operation orders); the output by
/// the 2x rule against attention over the GPU's cache in f32.
fn rotary_case(dev: &Device, paged: bool) -> Result<()> {
    let (b, h, hk, d, rd, s_new) = (2, 8, 2, 128, 64, 3);
    let lens = [5u32, 40];
    let capacity = 64;
    let dtype = DType::BF16;
    let cpu = Device::Cpu;
    let (k_scale, v_scale) = (scales(hk, 0.013, &cpu)?, scales(hk, 0.009, &cpu)?);
    let q = randn(&[b, s_new, h, d], dtype, &cpu)?;
    let (k_new, v_new) = (
        randn(&[b, s_new, hk, d], dtype, &cpu)?,
        randn(&[b, s_new, hk, d], dtype, &cpu)?,
    );
    let angles = Tensor::arange(0f32, (capacity * rd / 2) as f32, &cpu)?
        .reshape((capacity, rd / 2))?
        .affine(0.01, 0.0)?;
    let (cos, sin) = (angles.cos()?, angles.sin()?);
    let run = |on: &Device| -> Result<(Tensor, Tensor, Tensor)> {
        let t = |x: &Tensor| x.to_device(on);
        let opts = FlashAttn::new()
            .causal(true)
            .kv_cache_scales(&t(&k_scale)?, &t(&v_scale)?)
            .rotary(&t(&cos)?, &t(&sin)?, true);
        let zeros = Tensor::zeros((b, capacity, hk, d), DType::F8E4M3, on)?;
        let (k_cache, v_cache) = (zeros.copy()?, zeros.copy()?);
        let new_kv = Some((&t(&k_new)?, &t(&v_new)?));
        let out = if paged {
            let (k_pages, v_pages) = (
                k_cache.reshape((b * 4, capacity / 4, hk, d))?,
                v_cache.reshape((b * 4, capacity / 4, hk, d))?,
            );
            let table: Vec<u32> = (0..b as u32 * 4).rev().collect();
            let o = flash_attn_with_paged_kvcache(
                &t(&q)?,
                &k_pages,
                &v_pages,
                new_kv,
                &lens,
                &table,
                4,
                &opts,
            )?;
            // Back to sequence order: sequence s's page p is table[s * 4 + p].
            let order = |pages: &Tensor| -> Result<Tensor> {
                let rows: Vec<Tensor> = table
                    .iter()
                    .map(|&p| pages.i(p as usize..p as usize + 1))
                    .collect::<Result<_>>()?;
                Tensor::cat(&rows, 0)?.reshape((b, capacity, hk, d))
            };
            return Ok((o, order(&k_pages)?, order(&v_pages)?));
        } else {
            flash_attn_with_kvcache(&t(&q)?, &k_cache, &v_cache, new_kv, &lens, &opts)?
        };
        Ok((out, k_cache, v_cache))
    };
    let (out_gpu, k_gpu, v_gpu) = run(dev)?;
    let (_, k_cpu, v_cpu) = run(&cpu)?;
    let f32_cpu = |t: &Tensor| t.to_device(&cpu)?.to_dtype(DType::F32);
    // V is not rotated: equal. K: at most a few elements one e4m3 step apart.
    if max_abs_diff(&f32_cpu(&v_gpu)?, &f32_cpu(&v_cpu)?)? != 0.0 {
        candle::bail!("the quantized V rows differ from the CPU's");
    }
    let (kg, kc) = (f32_cpu(&k_gpu)?, f32_cpu(&k_cpu)?);
    let differ = kg
        .ne(&kc)?
        .to_dtype(DType::F32)?
        .sum_all()?
        .to_scalar::<f32>()?;
    let step = (kg.sub(&kc)?.abs()? / kc.abs()?.maximum(1e-3)?)?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()?;
    if differ > 0.01 * kg.elem_count() as f32 || step > 0.13 {
        candle::bail!(
            "quantized K rows: {differ} differ from the CPU's, largest relative gap {step}"
        );
    }
    // The output against attention over the GPU's own cache (dequantized) with the queries
    // rotated in f32; the low-precision reference rounds the rotated queries and the cache
    // values to bf16 as the kernel's inputs are.
    let scale = 1.0 / (d as f32).sqrt();
    for (i, &len) in lens.iter().enumerate() {
        let total = len as usize + s_new;
        let ki = dequantize(&k_gpu.i((i..i + 1, 0..total))?.to_device(&cpu)?, &k_scale)?;
        let vi = dequantize(&v_gpu.i((i..i + 1, 0..total))?.to_device(&cpu)?, &v_scale)?;
        let qi = rotate_interleaved(&q.i(i..i + 1)?, &cos, &sin, len)?;
        let reference = attention_slow(&qi, &ki, &vi, scale, true)?;
        let bf = |t: &Tensor| t.to_dtype(dtype);
        let low = attention_slow(&bf(&qi)?, &bf(&ki)?, &bf(&vi)?, scale, true)?;
        check_output(
            &format!("rotary fp8 sequence {i}"),
            &out_gpu.i(i..i + 1)?.to_device(&cpu)?,
            &low,
            &reference,
        )?;
    }
    Ok(())
}

/// `q` `(1, s_q, h, d)` in f32, its first `2 * cos.dim(1)` columns turned in interleaved
/// pairs by the tables' rows `start..start + s_q`.
fn rotate_interleaved(q: &Tensor, cos: &Tensor, sin: &Tensor, start: u32) -> Result<Tensor> {
    let (b, s_q, h, d) = q.dims4()?;
    let rd2 = cos.dim(1)?;
    let c = cos
        .narrow(0, start as usize, s_q)?
        .reshape((1, s_q, 1, rd2, 1))?;
    let s = sin
        .narrow(0, start as usize, s_q)?
        .reshape((1, s_q, 1, rd2, 1))?;
    let q = q.to_dtype(DType::F32)?;
    let pairs = q.narrow(3, 0, 2 * rd2)?.reshape((b, s_q, h, rd2, 2))?;
    let (x0, x1) = (pairs.narrow(4, 0, 1)?, pairs.narrow(4, 1, 1)?);
    let y0 = (x0.broadcast_mul(&c)? - x1.broadcast_mul(&s)?)?;
    let y1 = (x1.broadcast_mul(&c)? + x0.broadcast_mul(&s)?)?;
    let rotated = Tensor::cat(&[y0, y1], 4)?.reshape((b, s_q, h, 2 * rd2))?;
    Tensor::cat(&[rotated, q.narrow(3, 2 * rd2, d - 2 * rd2)?], 3)
}

/// Errors the CUDA path adds for an e4m3 cache: head dims without a kernel, and the CPU-only
/// f32 queries.
fn errors(dev: &Device) -> Result<()> {
    let try_d = |d: usize, dtype: DType| -> String {
        let run = || -> Result<Tensor> {
            let q = Tensor::zeros((1, 1, 2, d), dtype, dev)?;
            let cache = Tensor::zeros((1, 8, 1, d), DType::F8E4M3, dev)?;
            let s = Tensor::ones(1, DType::F32, dev)?;
            let opts = FlashAttn::new().kv_cache_scales(&s, &s);
            flash_attn_with_kvcache(&q, &cache, &cache, None, &[4u32], &opts)
        };
        match run() {
            Ok(_) => "ok".into(),
            Err(e) => e.to_string(),
        }
    };
    for (d, dtype, want) in [
        (40, DType::BF16, "head_dim"),
        (160, DType::BF16, "head_dim"),
        (32, DType::F16, "head_dim"),
        (128, DType::F32, "dtype"),
    ] {
        let got = try_d(d, dtype);
        if !got.contains(want) {
            candle::bail!("head_dim {d} {dtype:?}: expected an error naming {want}, got {got:?}");
        }
    }
    Ok(())
}

/// The `quant` helpers on CUDA (their own kernels) write the bytes and values the CPU's do,
/// for every scaling, bf16 and f32 inputs, a sequence that is not a multiple of the block.
fn quant_helpers(dev: &Device) -> Result<()> {
    use candle_flash::quant::{dequantize_fp8, fp8_scales, quantize_fp8, Fp8Scaling};
    let cpu = Device::Cpu;
    for dtype in [DType::BF16, DType::F32] {
        let x = (randn(&[2, 37, 3, 64], dtype, dev)? * 3.0)?;
        let x_cpu = x.to_device(&cpu)?;
        for scaling in [
            Fp8Scaling::PerTensor,
            Fp8Scaling::PerHead,
            Fp8Scaling::PerBlock { rows: 16 },
        ] {
            let scales_cpu = fp8_scales(&x_cpu, scaling)?;
            // Candle's CUDA division may be a rounding off the CPU's: within 1e-6, then the
            // CPU's scales on both sides so that the bytes must agree exactly.
            let gap = max_abs_diff(&fp8_scales(&x, scaling)?.to_device(&cpu)?, &scales_cpu)?;
            let largest = scales_cpu
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            if gap > 1e-6 * largest {
                candle::bail!("{dtype:?} {scaling:?}: scales differ from the CPU's by {gap}");
            }
            let scales = scales_cpu.to_device(dev)?;
            let q = quantize_fp8(&x, &scales, scaling)?;
            let q_cpu = quantize_fp8(&x_cpu, &scales_cpu, scaling)?;
            let f32_cpu = |t: &Tensor| t.to_device(&cpu)?.to_dtype(DType::F32);
            if max_abs_diff(&f32_cpu(&q)?, &f32_cpu(&q_cpu)?)? != 0.0 {
                candle::bail!("{dtype:?} {scaling:?}: quantized bytes differ from the CPU's");
            }
            let back = dequantize_fp8(&q, &scales, scaling, DType::F32)?;
            let back_cpu = dequantize_fp8(&q_cpu, &scales_cpu, scaling, DType::F32)?;
            if max_abs_diff(&back.to_device(&cpu)?, &back_cpu)? != 0.0 {
                candle::bail!("{dtype:?} {scaling:?}: dequantized values differ from the CPU's");
            }
        }
    }
    Ok(())
}

pub(crate) fn run(dev: &Device, quick: bool, suite: &mut Suite) {
    let mut cases = vec![];
    // Every compiled head dim (80 runs the 96 kernel), split launches (2000 keys), pages of 16
    // and of 24 (rows looked up one by one), GQA packing of 4 and 8 heads a K/V head.
    for d in [64, 80, 96, 128, 256] {
        for page_size in [None, Some(16), Some(24)] {
            cases.push(Fp8Case {
                lens: vec![33, 2000, 0],
                s_q: 4,
                s_new: 2,
                h: 8,
                hk: 2,
                d,
                causal: true,
                page_size,
                device: false,
            });
        }
    }
    for (h, hk) in [(8, 8), (32, 4)] {
        for (s_q, s_new) in [(1, 1), (1, 0), (5, 5)] {
            cases.push(Fp8Case {
                lens: vec![1, 255, 4097],
                s_q,
                s_new,
                h,
                hk,
                d: 128,
                causal: s_q > 1,
                page_size: None,
                device: false,
            });
        }
    }
    if quick {
        cases.truncate(6);
    }
    let device_cases: Vec<Fp8Case> = cases
        .iter()
        .step_by(2)
        .map(|c| Fp8Case {
            device: true,
            ..c.clone()
        })
        .collect();
    for c in &cases {
        for dtype in [DType::BF16, DType::F16] {
            suite.record(
                &format!("fp8 cache {dtype:?} {c:?}"),
                fp8_case(dev, c, dtype),
            );
        }
    }
    for c in &device_cases {
        suite.record(
            &format!("fp8 cache BF16 {c:?}"),
            fp8_case(dev, c, DType::BF16),
        );
    }
    for paged in [false, true] {
        suite.record(
            &format!("fp8 cache rotary append, paged {paged}"),
            rotary_case(dev, paged),
        );
    }
    suite.record("fp8 cache errors on CUDA", errors(dev));
    suite.record(
        "fp8 quant helpers on CUDA equal the CPU's",
        quant_helpers(dev),
    );
}
