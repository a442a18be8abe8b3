//! GPU tests for KV-cache decoding: in-place append (contiguous and paged), split-KV decode,
//! GQA packing, against `attention_slow` on each sequence's prefix; lengths and block tables
//! as device tensors (the graph-safe form) with the LSE out, and their clamping; rotary
//! embedding fused into the append; the appends fused into the decode launch; a decoding step
//! captured in a CUDA graph and replayed.

use candle::{DType, Device, IndexOp, Result, Tensor};
use candle_flash::graph::{CapturedGraph, Wiring};
use candle_flash::{
    attention_slow, flash_attn_with_kvcache, flash_attn_with_kvcache_lse,
    flash_attn_with_kvcache_ragged, flash_attn_with_paged_kvcache,
    flash_attn_with_paged_kvcache_lse, flash_attn_with_paged_kvcache_ragged, FlashAttn, KvCache,
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
    /// Lengths and block table as device tensors, and the LSE checked too.
    device: bool,
}

/// The LSE `(b, h, s_q)` of one sequence's decode call checked against the CPU forward's on
/// the same (rounded) inputs in f32: both are f32 sums of exponentials of f32 scores.
fn check_lse(
    what: &str,
    ours: &Tensor,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    causal: bool,
) -> Result<()> {
    let f32_cpu = |t: &Tensor| t.to_device(&Device::Cpu)?.to_dtype(DType::F32);
    let (_, want) = FlashAttn::new().causal(causal).forward_with_lse(
        &f32_cpu(q)?,
        &f32_cpu(k)?,
        &f32_cpu(v)?,
    )?;
    let got = f32_cpu(ours)?;
    let (g, w) = (
        got.flatten_all()?.to_vec1::<f32>()?,
        want.flatten_all()?.to_vec1::<f32>()?,
    );
    for (i, (g, w)) in g.iter().zip(&w).enumerate() {
        let ok = (g == w) || (g - w).abs() <= 1e-3 * (1.0 + w.abs());
        if !ok {
            candle::bail!("{what}: lse[{i}] = {g}, expected {w}");
        }
    }
    Ok(())
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
    let seqlens_dev = Tensor::new(seqlens.as_slice(), dev)?;
    let opts = FlashAttn::new().causal(c.causal);
    let new_ref = new.as_ref().map(|(k, v)| (k, v));

    let (out, lse, k_after, v_after) = match c.page_size {
        None if c.device => {
            let (k_cache, v_cache) = (k_full.copy()?, v_full.copy()?);
            let (out, lse) =
                flash_attn_with_kvcache_lse(&q, &k_cache, &v_cache, new_ref, &seqlens_dev, &opts)?;
            (out, Some(lse), k_cache, v_cache)
        }
        None => {
            let (k_cache, v_cache) = (k_full.copy()?, v_full.copy()?);
            let out = flash_attn_with_kvcache(&q, &k_cache, &v_cache, new_ref, &seqlens, &opts)?;
            (out, None, k_cache, v_cache)
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
            let (out, lse) = if c.device {
                let table_dev = Tensor::from_slice(&table, (b, max_pages), dev)?;
                let (out, lse) = flash_attn_with_paged_kvcache_lse(
                    &q,
                    &k_pages,
                    &v_pages,
                    new_ref,
                    &seqlens_dev,
                    &table_dev,
                    max_pages,
                    &opts,
                )?;
                (out, Some(lse))
            } else {
                let out = flash_attn_with_paged_kvcache(
                    &q, &k_pages, &v_pages, new_ref, &seqlens, &table, max_pages, &opts,
                )?;
                (out, None)
            };
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
            (out, lse, from_pages(&k_pages)?, from_pages(&v_pages)?)
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
            if let Some(lse) = &lse {
                let l = lse.i(i)?.flatten_all()?.to_vec1::<f32>()?;
                if l.iter().any(|&x| x != f32::NEG_INFINITY) {
                    candle::bail!("sequence {i} has an empty cache but a finite lse {l:?}");
                }
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
        if let Some(lse) = &lse {
            let what = format!("sequence {i} (len {total}) lse");
            check_lse(&what, &lse.i(i..i + 1)?, &qi, &ki, &vi, c.causal)?;
        }
    }
    Ok(())
}

/// Rotary embedding fused into the append (one launch for the keys and the queries) against
/// the CPU's rotation by tensor ops: output by the 2x rule (the reference rotates and attends
/// in f32, the low-precision CPU call rounds the rotated rows like the kernel), cache rows
/// within one rounding.
fn rotary_case(
    dev: &Device,
    d: usize,
    rd: usize,
    interleaved: bool,
    causal: bool,
    paged: bool,
) -> Result<()> {
    let (b, cap, h, hk, s_q, s_new, dtype) = (3, 64, 8, 2, 2, 2, DType::BF16);
    let q = randn(&[b, s_q, h, d], dtype, dev)?;
    let k = randn(&[b, cap, hk, d], dtype, dev)?;
    let v = randn(&[b, cap, hk, d], dtype, dev)?;
    let kn = randn(&[b, s_new, hk, d], dtype, dev)?;
    let vn = randn(&[b, s_new, hk, d], dtype, dev)?;
    let (positions, half) = (cap, rd / 2);
    let angles: Vec<f32> = (0..positions * half)
        .map(|i| (i / half) as f32 / 10000f32.powf(2.0 * (i % half) as f32 / rd as f32))
        .collect();
    let cos = Tensor::from_vec(
        angles.iter().map(|a| a.cos()).collect(),
        (positions, half),
        dev,
    )?;
    let sin = Tensor::from_vec(
        angles.iter().map(|a| a.sin()).collect(),
        (positions, half),
        dev,
    )?;
    let lens = [0u32, 9, 61];
    let run = |dev: &Device, dt: DType| -> Result<(Tensor, Tensor)> {
        let on = |t: &Tensor| t.to_device(dev)?.to_dtype(dt);
        let (q, kc, vc, kn, vn) = (on(&q)?, on(&k)?, on(&v)?, on(&kn)?, on(&vn)?);
        let opts = FlashAttn::new().causal(causal).rotary(
            &cos.to_device(dev)?,
            &sin.to_device(dev)?,
            interleaved,
        );
        if !paged {
            let out = flash_attn_with_kvcache(&q, &kc, &vc, Some((&kn, &vn)), &lens, &opts)?;
            return Ok((out, kc));
        }
        let page = 16;
        let max_pages = cap / page;
        let (kp, vp) = (
            kc.reshape((b * max_pages, page, hk, d))?,
            vc.reshape((b * max_pages, page, hk, d))?,
        );
        let table: Vec<u32> = (0..(b * max_pages) as u32).rev().collect();
        // Sequence s's page p sits at slot table[s * max_pages + p]: permute the pool.
        let mut slots = vec![0usize; b * max_pages];
        for (i, &t) in table.iter().enumerate() {
            slots[t as usize] = i;
        }
        let idx = Tensor::from_vec(
            slots.iter().map(|&x| x as u32).collect::<Vec<_>>(),
            b * max_pages,
            dev,
        )?;
        let (kp, vp) = (kp.index_select(&idx, 0)?, vp.index_select(&idx, 0)?);
        let out = flash_attn_with_paged_kvcache(
            &q,
            &kp,
            &vp,
            Some((&kn, &vn)),
            &lens,
            &table,
            max_pages,
            &opts,
        )?;
        let order = Tensor::from_vec(table.clone(), b * max_pages, dev)?;
        Ok((out, kp.index_select(&order, 0)?.reshape((b, cap, hk, d))?))
    };
    let (ours, k_ours) = run(dev, dtype)?;
    let (low, k_low) = run(&Device::Cpu, dtype)?;
    let (reference, _) = run(&Device::Cpu, DType::F32)?;
    check_output("rotary decode", &ours, &low, &reference)?;
    // Rotated rows: f32 math and one rounding on both sides (the kernel may fuse a multiply-add).
    let diff = max_abs_diff(&k_ours, &k_low)?;
    if diff > 0.0625 {
        candle::bail!("rotated cache rows differ from the CPU's by {diff}");
    }
    Ok(())
}

/// Ragged queries (a count per sequence, padded q) on the GPU against the CPU's (itself
/// checked against one call per sequence): outputs by the 2x rule, padding rows exactly 0 with
/// an LSE of -inf, cache rows exactly; host and device counts, contiguous and paged, a tile of
/// padding only, split launches.
fn ragged_case(
    dev: &Device,
    lens: &[u32],
    q_lens: &[u32],
    paged: bool,
    on_device: bool,
) -> Result<()> {
    let (b, s_q, h, hk, d, dtype) = (lens.len(), 8, 16, 4, 128, DType::BF16);
    let cap = *lens.iter().max().unwrap_or(&0) as usize + s_q + 5;
    let cap = cap.next_multiple_of(16);
    let q = randn(&[b, s_q, h, d], dtype, dev)?;
    let k = randn(&[b, cap, hk, d], dtype, dev)?;
    let v = randn(&[b, cap, hk, d], dtype, dev)?;
    let kn = randn(&[b, s_q, hk, d], dtype, dev)?;
    let vn = randn(&[b, s_q, hk, d], dtype, dev)?;
    let run = |dev: &Device, dt: DType| -> Result<(Tensor, Tensor, Tensor)> {
        let on = |t: &Tensor| t.to_device(dev)?.to_dtype(dt);
        let (q, kc, vc, kn, vn) = (on(&q)?, on(&k)?, on(&v)?, on(&kn)?, on(&vn)?);
        let opts = FlashAttn::new().causal(true);
        let (lens_t, q_lens_t) = (Tensor::new(lens, dev)?, Tensor::new(q_lens, dev)?);
        let device = on_device && !dev.is_cpu();
        if !paged {
            let (out, lse) = if device {
                flash_attn_with_kvcache_ragged(
                    &q,
                    &kc,
                    &vc,
                    Some((&kn, &vn)),
                    &lens_t,
                    &q_lens_t,
                    &opts,
                )?
            } else {
                flash_attn_with_kvcache_ragged(&q, &kc, &vc, Some((&kn, &vn)), lens, q_lens, &opts)?
            };
            return Ok((out, lse, kc));
        }
        let page = 16;
        let max_pages = cap / page;
        let kp = kc.reshape((b * max_pages, page, hk, d))?;
        let vp = vc.reshape((b * max_pages, page, hk, d))?;
        let table: Vec<u32> = (0..(b * max_pages) as u32).collect();
        let table_t = Tensor::from_slice(&table, (b, max_pages), dev)?;
        let (out, lse) = if device {
            flash_attn_with_paged_kvcache_ragged(
                &q,
                &kp,
                &vp,
                Some((&kn, &vn)),
                &lens_t,
                &q_lens_t,
                &table_t,
                max_pages,
                &opts,
            )?
        } else {
            flash_attn_with_paged_kvcache_ragged(
                &q,
                &kp,
                &vp,
                Some((&kn, &vn)),
                lens,
                q_lens,
                &table,
                max_pages,
                &opts,
            )?
        };
        Ok((out, lse, kp.reshape((b, cap, hk, d))?))
    };
    let (ours, lse, k_ours) = run(dev, dtype)?;
    let (low, _, k_low) = run(&Device::Cpu, dtype)?;
    let (reference, lse_ref, _) = run(&Device::Cpu, DType::F32)?;
    check_output("ragged decode", &ours, &low, &reference)?;
    if max_abs_diff(&k_ours, &k_low)? != 0.0 {
        candle::bail!("ragged append wrote other rows than the CPU's");
    }
    let (g, w) = (
        lse.to_device(&Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f32>()?,
        lse_ref.flatten_all()?.to_vec1::<f32>()?,
    );
    for (i, (g, w)) in g.iter().zip(&w).enumerate() {
        if !(g == w || (g - w).abs() <= 1e-2 * (1.0 + w.abs())) {
            candle::bail!("ragged lse[{i}] = {g}, expected {w}");
        }
    }
    Ok(())
}

/// Attention sinks in decoding (the fix-up after the kernel, split and unsplit launches)
/// against the CPU's: output by the 2x rule, LSE within f32 sums' rounding.
fn sinks_case(dev: &Device, lens: &[u32]) -> Result<()> {
    let (b, s_q, h, hk, d, dtype) = (lens.len(), 2, 8, 2, 128, DType::BF16);
    let cap = (*lens.iter().max().unwrap_or(&0) as usize + s_q).next_multiple_of(16);
    let q = randn(&[b, s_q, h, d], dtype, dev)?;
    let k = randn(&[b, cap, hk, d], dtype, dev)?;
    let v = randn(&[b, cap, hk, d], dtype, dev)?;
    let kn = randn(&[b, s_q, hk, d], dtype, dev)?;
    let vn = randn(&[b, s_q, hk, d], dtype, dev)?;
    let sinks = [0.5f32, -1.0, 2.0, f32::NEG_INFINITY, 6.0, 0.0, -3.0, 1.0];
    let run = |dev: &Device, dt: DType| -> Result<(Tensor, Tensor)> {
        let on = |t: &Tensor| t.to_device(dev)?.to_dtype(dt);
        let (q, kc, vc, kn, vn) = (on(&q)?, on(&k)?, on(&v)?, on(&kn)?, on(&vn)?);
        let opts = FlashAttn::new()
            .causal(true)
            .sinks(&Tensor::new(&sinks, dev)?);
        flash_attn_with_kvcache_lse(&q, &kc, &vc, Some((&kn, &vn)), lens, &opts)
    };
    let (ours, lse) = run(dev, dtype)?;
    let (low, _) = run(&Device::Cpu, dtype)?;
    let (reference, lse_ref) = run(&Device::Cpu, DType::F32)?;
    check_output("decode with sinks", &ours, &low, &reference)?;
    let (g, w) = (
        lse.to_device(&Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f32>()?,
        lse_ref.flatten_all()?.to_vec1::<f32>()?,
    );
    for (i, (g, w)) in g.iter().zip(&w).enumerate() {
        if !(g == w || (g - w).abs() <= 1e-2 * (1.0 + w.abs())) {
            candle::bail!("decode with sinks: lse[{i}] = {g}, expected {w}");
        }
    }
    Ok(())
}

/// A decoding step (append + attention with device lengths) captured in a CUDA graph and
/// replayed with new lengths and inputs: bitwise equal to the same calls run eagerly, in
/// both wirings of `candle_flash::graph` (as captured, and with the memory nodes out of the
/// kernels' chain and the kernels joined programmatically).
fn graph_replay_equals_eager(dev: &Device, paged: bool, wiring: Wiring) -> Result<()> {
    use candle::cuda_backend::cudarc::driver::sys;
    let (b, cap, h, hk, d, dtype) = (3, 96, 8, 2, 128, DType::BF16);
    let (page, max_pages) = (16, 96 / 16);
    let q = randn(&[b, 1, h, d], dtype, dev)?;
    let kn = randn(&[b, 1, hk, d], dtype, dev)?;
    let vn = randn(&[b, 1, hk, d], dtype, dev)?;
    let lens = Tensor::new(&[0u32, 5, 40], dev)?;
    let shape = if paged {
        vec![b * max_pages, page, hk, d]
    } else {
        vec![b, cap, hk, d]
    };
    let kc = randn(shape.as_slice(), dtype, dev)?;
    let vc = randn(shape.as_slice(), dtype, dev)?;
    let table_host: Vec<u32> = (0..(b * max_pages) as u32).rev().collect();
    let table = Tensor::from_slice(&table_host, (b, max_pages), dev)?;
    let out = Tensor::zeros((b, 1, h, d), dtype, dev)?;
    let step = |kc: &Tensor, vc: &Tensor| -> Result<Tensor> {
        let opts = FlashAttn::new().causal(true);
        if paged {
            flash_attn_with_paged_kvcache(
                &q,
                kc,
                vc,
                Some((&kn, &vn)),
                &lens,
                &table,
                max_pages,
                &opts,
            )
        } else {
            flash_attn_with_kvcache(&q, kc, vc, Some((&kn, &vn)), &lens, &opts)
        }
    };
    step(&kc.copy()?, &vc.copy()?)?; // warm-up: modules, counters
    let (graph, ()) = CapturedGraph::capture_with(dev, wiring, || {
        step(&kc, &vc).and_then(|o| out.slice_set(&o, 0, 0))
    })?;
    for (t, host_lens) in [[0u32, 5, 40], [1, 6, 41], [30, 7, 95], [60, 90, 2]]
        .iter()
        .enumerate()
    {
        lens.slice_set(&Tensor::new(host_lens, dev)?, 0, 0)?;
        for x in [&q, &kn, &vn] {
            x.slice_set(&randn(x.dims(), dtype, dev)?, 0, 0)?;
        }
        let (k_eager, v_eager) = (kc.copy()?, vc.copy()?);
        let eager = step(&k_eager, &v_eager)?;
        graph.launch()?;
        if max_abs_diff(&out, &eager)? != 0.0 {
            candle::bail!("replay {t} (lengths {host_lens:?}): output differs from the eager call");
        }
        if max_abs_diff(&kc, &k_eager)? != 0.0 || max_abs_diff(&vc, &v_eager)? != 0.0 {
            candle::bail!("replay {t} (lengths {host_lens:?}): cache differs from the eager call");
        }
    }
    // Shaped (Hopper, programmatic launch on): kernels are joined programmatically across
    // the memory nodes between them (as captured, none are).
    let major = dev
        .as_cuda_device()?
        .cuda_stream()
        .context()
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        .map_err(candle::Error::wrap)?;
    let pdl = std::env::var("CANDLE_FLASH_PDL").map_or(true, |v| v != "0");
    let stats = graph.stats();
    // The appends inside the decode launch: one kernel for the step (and whatever Candle
    // launches for the slice_set), no kernel pair to join; apart, the two appends and the
    // decode.
    let fused = fused_append();
    let expected = match wiring {
        Wiring::Programmatic if major == 9 && pdl && !fused => 1,
        _ => 0,
    };
    if stats.programmatic < expected {
        candle::bail!("{wiring:?}: expected {expected}+ programmatic edge(s), got {stats}");
    }
    if fused != (stats.kernels <= 2) {
        candle::bail!("{wiring:?}: fused append {fused}, but the step's graph holds {stats}");
    }
    Ok(())
}

/// A split decode's per-stream scratch (merge counters, partial results) is grown outside a
/// capture only: on a fresh thread (its own stream) a first split call made inside a capture
/// is a clear error, not a buffer owned by the graph; run eagerly first, the same call then
/// captures and replays equal to the eager call.
fn scratch_grown_outside_capture(dev: &Device) -> Result<()> {
    let dev = dev.clone();
    let worker = std::thread::spawn(move || -> Result<()> {
        let (h, hk, d, len, dtype) = (8, 2, 128, 4000u32, DType::BF16);
        let q = randn(&[1, 1, h, d], dtype, &dev)?;
        let kc = randn(&[1, 4096, hk, d], dtype, &dev)?;
        let vc = randn(&[1, 4096, hk, d], dtype, &dev)?;
        let out = Tensor::zeros((1, 1, h, d), dtype, &dev)?;
        let opts = FlashAttn::new().causal(true);
        let call = || flash_attn_with_kvcache(&q, &kc, &vc, None, &[len], &opts);
        match CapturedGraph::capture(&dev, || call().map(|_| ())) {
            Err(e) if e.to_string().contains("inside a CUDA graph capture") => {}
            Err(e) => candle::bail!("expected the capture error, got {e}"),
            Ok(_) => candle::bail!("a first split call was captured"),
        }
        let eager = call()?;
        let (graph, ()) =
            CapturedGraph::capture(&dev, || call().and_then(|o| out.slice_set(&o, 0, 0)))?;
        graph.launch()?;
        if max_abs_diff(&out, &eager)? != 0.0 {
            candle::bail!("the replay differs from the eager call");
        }
        Ok(())
    });
    worker
        .join()
        .unwrap_or_else(|_| candle::bail!("the worker thread panicked"))
}

/// Whether this run fuses a decoding call's appends into the decode launch (the default).
fn fused_append() -> bool {
    std::env::var("CANDLE_FLASH_FUSED_APPEND").map_or(true, |v| v != "0")
}

/// New rows no query of the call sees (a sliding window of 3 keys, 16 new rows: part of them
/// in a 16-key tile before the first one any split reads, written by split 0) still land in
/// the cache, exactly, contiguous and paged, split or not; and the attention equals the same
/// call without the append over the cache as it should be afterwards (same plan, so the
/// same bits).
fn append_rows_no_query_sees(dev: &Device, paged: bool, long: bool) -> Result<()> {
    let (h, hk, d, s_new, dtype) = (8, 2, 64, 16, DType::BF16);
    let lens: Vec<u32> = if long { vec![3000, 5] } else { vec![5, 50] };
    let b = lens.len();
    let (page, max_pages) = (16usize, 200usize);
    let cap = page * max_pages;
    let q = randn(&[b, 1, h, d], dtype, dev)?;
    let k_new = randn(&[b, s_new, hk, d], dtype, dev)?;
    let v_new = randn(&[b, s_new, hk, d], dtype, dev)?;
    let k_full = randn(&[b, cap, hk, d], dtype, dev)?;
    let v_full = randn(&[b, cap, hk, d], dtype, dev)?;
    let expected = |full: &Tensor, new: &Tensor| -> Result<Tensor> {
        let rows = (0..b)
            .map(|i| {
                let l = lens[i] as usize;
                Tensor::cat(
                    &[full.i((i, 0..l))?, new.i(i)?, full.i((i, l + s_new..))?],
                    0,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        Tensor::stack(&rows, 0)
    };
    let (k_exp, v_exp) = (expected(&k_full, &k_new)?, expected(&v_full, &v_new)?);
    let after: Vec<u32> = lens.iter().map(|&l| l + s_new as u32).collect();
    let opts = FlashAttn::new().causal(true).window(Some(2), Some(0));
    // Paged: sequence i's page p is pool page p * b + i (interleaved), so the pool is the
    // contiguous caches' pages, reordered.
    let table: Vec<u32> = (0..b as u32)
        .flat_map(|i| (0..max_pages as u32).map(move |p| p * b as u32 + i))
        .collect();
    let to_pages = |t: &Tensor| -> Result<Tensor> {
        t.reshape((b, max_pages, page, hk, d))?
            .transpose(0, 1)?
            .contiguous()?
            .reshape((max_pages * b, page, hk, d))
    };
    let (out, plain, k_after, v_after) = if paged {
        let (kc, vc) = (to_pages(&k_full)?, to_pages(&v_full)?);
        let new_kv = Some((&k_new, &v_new));
        let run = |kc: &Tensor, vc: &Tensor, kv, lens: &[u32]| {
            flash_attn_with_paged_kvcache(&q, kc, vc, kv, lens, &table, max_pages, &opts)
        };
        let out = run(&kc, &vc, new_kv, &lens)?;
        let (ke, ve) = (to_pages(&k_exp)?, to_pages(&v_exp)?);
        let plain = run(&ke, &ve, None, &after)?;
        (out, plain, (kc, ke), (vc, ve))
    } else {
        let (kc, vc) = (k_full.copy()?, v_full.copy()?);
        let out = flash_attn_with_kvcache(&q, &kc, &vc, Some((&k_new, &v_new)), &lens, &opts)?;
        let plain = flash_attn_with_kvcache(&q, &k_exp, &v_exp, None, &after, &opts)?;
        (out, plain, (kc, k_exp.clone()), (vc, v_exp.clone()))
    };
    if max_abs_diff(&k_after.0, &k_after.1)? != 0.0 || max_abs_diff(&v_after.0, &v_after.1)? != 0.0
    {
        candle::bail!("the cache differs from its rows plus the appended ones");
    }
    if max_abs_diff(&out, &plain)? != 0.0 {
        candle::bail!("the attention differs from the same call over the appended cache");
    }
    Ok(())
}

/// Device lengths are read unchecked: past the capacity the append drops rows and the
/// attention reads at most the capacity; a device block-table entry past the pool reads its
/// last page. Memory safety is the sanitizer's to see; here the results are those clamped
/// calls' exactly.
fn device_lengths_clamped(dev: &Device) -> Result<()> {
    let (b, cap, h, hk, d, dtype) = (2, 40, 4, 2, 64, DType::BF16);
    let q = randn(&[b, 1, h, d], dtype, dev)?;
    let k_full = randn(&[b, cap, hk, d], dtype, dev)?;
    let v_full = randn(&[b, cap, hk, d], dtype, dev)?;
    let k_new = randn(&[b, 4, hk, d], dtype, dev)?;
    let v_new = randn(&[b, 4, hk, d], dtype, dev)?;
    let lens = Tensor::new(&[38u32, 45], dev)?;
    let (k_cache, v_cache) = (k_full.copy()?, v_full.copy()?);
    let opts = FlashAttn::new().causal(true);
    let out =
        flash_attn_with_kvcache(&q, &k_cache, &v_cache, Some((&k_new, &v_new)), &lens, &opts)?;
    // Sequence 0 gets rows 38 and 39 (two dropped), sequence 1 nothing.
    let k_exp = Tensor::stack(
        &[
            Tensor::cat(&[k_full.i((0, 0..38))?, k_new.i((0, 0..2))?], 0)?,
            k_full.i(1)?,
        ],
        0,
    )?;
    if max_abs_diff(&k_cache, &k_exp)? != 0.0 {
        candle::bail!("the clamped append wrote other rows than the capacity allows");
    }
    let v_after = v_cache.clone();
    let plain = flash_attn_with_kvcache(&q, &k_cache, &v_after, None, &[cap as u32; 2], &opts)?;
    if max_abs_diff(&out, &plain)? != 0.0 {
        candle::bail!("the clamped attention differs from attention over the capacity");
    }
    // Paged: two pages of 16 per sequence, sequence 1's second entry past the pool.
    let (page, max_pages) = (16usize, 2usize);
    let kp = randn(&[4, page, hk, d], dtype, dev)?;
    let vp = randn(&[4, page, hk, d], dtype, dev)?;
    let table = Tensor::new(&[[0u32, 1], [2, 99]], dev)?;
    // Full sequences: the same split plan as the host call below, so the same bits.
    let lens = Tensor::new(&[32u32, 32], dev)?;
    let out = flash_attn_with_paged_kvcache(&q, &kp, &vp, None, &lens, &table, max_pages, &opts)?;
    let host_table = [0u32, 1, 2, 3];
    let host = flash_attn_with_paged_kvcache(
        &q,
        &kp,
        &vp,
        None,
        &[32u32, 32],
        &host_table,
        max_pages,
        &opts,
    )?;
    if max_abs_diff(&out, &host)? != 0.0 {
        candle::bail!("a device table entry past the pool did not read the last page");
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
            device: false,
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
        device: false,
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
            device: false,
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
                        device: false,
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
            device: false,
        });
    }
    if quick {
        cases.truncate(12);
    }
    // Each case again with device lengths, block tables and the LSE (bf16; a split count
    // planned for the capacity instead of the longest sequence).
    let device_cases: Vec<DecodeCase> = cases
        .iter()
        .map(|c| DecodeCase {
            device: true,
            ..c.clone()
        })
        .collect();
    for c in &cases {
        for dtype in [DType::BF16, DType::F16] {
            suite.record(
                &format!("decode {dtype:?} {c:?}"),
                decode_case(dev, c, dtype),
            );
        }
    }
    for c in &device_cases {
        suite.record(
            &format!("decode BF16 {c:?}"),
            decode_case(dev, c, DType::BF16),
        );
    }
    suite.record("decode device lengths clamped", device_lengths_clamped(dev));
    for (d, rd, interleaved, causal, paged) in [
        (128, 128, false, true, false),
        (128, 64, true, true, true),
        (64, 64, false, false, true),
        (96, 32, true, false, false),
    ] {
        suite.record(
            &format!("decode rotary d {d} rotary_dim {rd} interleaved {interleaved} causal {causal} paged {paged}"),
            rotary_case(dev, d, rd, interleaved, causal, paged),
        );
    }
    for (lens, q_lens) in [
        (vec![5u32, 0, 30, 7], vec![1u32, 8, 0, 3]),
        (vec![3000u32, 17], vec![2u32, 8]),
    ] {
        for (paged, on_device) in [(false, false), (true, false), (false, true), (true, true)] {
            suite.record(
                &format!("decode ragged lens {lens:?} q_lens {q_lens:?} paged {paged} device {on_device}"),
                ragged_case(dev, &lens, &q_lens, paged, on_device),
            );
        }
    }
    for lens in [vec![0u32, 9], vec![4000u32]] {
        suite.record(
            &format!("decode with sinks, lens {lens:?}"),
            sinks_case(dev, &lens),
        );
    }
    for paged in [false, true] {
        for wiring in [Wiring::AsCaptured, Wiring::Programmatic] {
            suite.record(
                &format!("decode step in a CUDA graph, paged {paged}, {wiring:?}"),
                graph_replay_equals_eager(dev, paged, wiring),
            );
        }
    }
    for (paged, long) in [(false, false), (true, false), (false, true), (true, true)] {
        suite.record(
            &format!("decode appends rows no query sees, paged {paged}, long {long}"),
            append_rows_no_query_sees(dev, paged, long),
        );
    }
    suite.record(
        "decode scratch grown outside a capture",
        scratch_grown_outside_capture(dev),
    );
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
