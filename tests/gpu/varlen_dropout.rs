//! GPU tests for packed (variable-length) batches, the padding helpers and dropout.

use candle::{DType, Device, IndexOp, Result, Tensor};
use candle_flash::{
    attention_slow, attention_slow_dropout, dropout_mask, FlashAttn, Padding, VarLen,
};

use crate::cuda_suite::{
    check_grads, check_output, check_rule, grads_of, has_nan, max_abs_diff, randn,
    reference_device, to_reference, Case, Suite,
};

/// Concatenates per-sequence results along dim 0 (rows).
fn cat_rows(parts: &[Tensor]) -> Result<Tensor> {
    Tensor::cat(parts, 0)
}

/// Dropout's probability, seed and RNG offset.
type DropoutOpts = (f32, u64, u64);

/// Packed attention (and its gradients) equals a loop over sequences with `attention_slow`
/// (with `dropout`, `attention_slow_dropout` given each sequence's part of `dropout_mask`):
/// 2x rule for outputs, 3x for gradients, against the f32 loop.
#[allow(clippy::too_many_arguments)]
fn varlen_case(
    dev: &Device,
    dtype: DType,
    lens: &[(usize, usize)],
    h: usize,
    hk: usize,
    d: usize,
    causal: bool,
    dropout: Option<DropoutOpts>,
) -> Result<()> {
    let lens_q: Vec<usize> = lens.iter().map(|l| l.0).collect();
    let lens_k: Vec<usize> = lens.iter().map(|l| l.1).collect();
    let varlen = VarLen::from_seqlens(&lens_q, &lens_k)?;
    let (tq, tk) = (varlen.total_q(), varlen.total_k());
    let q = randn(&[tq, h, d], dtype, dev)?;
    let k = randn(&[tk, hk, d], dtype, dev)?;
    let v = randn(&[tk, hk, d], dtype, dev)?;
    let w = randn(&[tq, h, d], dtype, dev)?;
    let scale = 1.0 / (d as f32).sqrt();
    let mut attn = FlashAttn::new().causal(causal);
    // With dropout, its mask and p: sequence b's mask is the top-left corner of row b of
    // dropout_mask.
    let mut keep = None;
    if let Some((p, seed, offset)) = dropout {
        attn = attn.dropout(p).seed(seed).rng_offset(offset);
        let (max_q, max_k) = (varlen.max_seqlen_q(), varlen.max_seqlen_k());
        let mask = dropout_mask(p, seed, offset, lens.len(), h, max_q, max_k)?
            .to_device(&reference_device(dev))?;
        keep = Some((mask, p));
    }
    let out = attn.forward_varlen(&q, &k, &v, &varlen)?;
    if has_nan(&out)? {
        candle::bail!("output has NaN");
    }
    let ours = grads_of(&q, &k, &v, &w, |q, k, v| {
        attn.forward_varlen(q, k, v, &varlen)
    })?;

    // The loop: each sequence as a batch of one.
    let looped = |q: &Tensor, k: &Tensor, v: &Tensor| -> Result<Tensor> {
        let (cq, ck) = (varlen.cu_seqlens_q(), varlen.cu_seqlens_k());
        let mut outs = vec![];
        for b in 0..lens.len() {
            let (q0, q1, k0, k1) = (
                cq[b] as usize,
                cq[b + 1] as usize,
                ck[b] as usize,
                ck[b + 1] as usize,
            );
            let qb = q.i(q0..q1)?.unsqueeze(0)?;
            let kb = k.i(k0..k1)?.unsqueeze(0)?;
            let vb = v.i(k0..k1)?.unsqueeze(0)?;
            let out = match &keep {
                Some((mask, p)) => {
                    let mask = mask.i((b..b + 1, .., 0..q1 - q0, 0..k1 - k0))?;
                    attention_slow_dropout(&qb, &kb, &vb, scale, causal, &mask, *p)?
                }
                None => attention_slow(&qb, &kb, &vb, scale, causal)?,
            };
            outs.push(out.squeeze(0)?);
        }
        cat_rows(&outs)
    };
    let (q, k, v, w) = (
        to_reference(&q)?,
        to_reference(&k)?,
        to_reference(&v)?,
        to_reference(&w)?,
    );
    let f32_of = |t: &Tensor| t.to_dtype(DType::F32);
    let (q32, k32, v32) = (f32_of(&q)?, f32_of(&k)?, f32_of(&v)?);
    let reference = looped(&q32, &k32, &v32)?;
    let low = looped(&q, &k, &v)?;
    check_output("out", &out, &low, &reference)?;
    let reference = grads_of(&q32, &k32, &v32, &f32_of(&w)?, looped)?;
    let low = grads_of(&q, &k, &v, &w, looped)?;
    check_grads(&ours, &low, &reference)
}

/// A padded batch with a key-padding mask through `forward_padded` equals the per-sequence
/// loop, and padded query rows come back as zeros.
fn padded_batch(dev: &Device) -> Result<()> {
    let (b, s, h, d) = (3, 77, 4, 64);
    let lengths = [77usize, 1, 40];
    let pad = Padding::from_lengths(&lengths, s)?;
    let q = randn(&[b, s, h, d], DType::BF16, dev)?;
    let k = randn(&[b, s, h, d], DType::BF16, dev)?;
    let v = randn(&[b, s, h, d], DType::BF16, dev)?;
    let out = FlashAttn::new()
        .causal(true)
        .forward_padded(&q, &k, &v, &pad, &pad)?;
    let scale = 1.0 / (d as f32).sqrt();
    let (qr, kr, vr) = (to_reference(&q)?, to_reference(&k)?, to_reference(&v)?);
    for (i, &len) in lengths.iter().enumerate() {
        let sl = |t: &Tensor| t.i((i..i + 1, 0..len));
        let expected = attention_slow(
            &sl(&qr)?.to_dtype(DType::F32)?,
            &sl(&kr)?.to_dtype(DType::F32)?,
            &sl(&vr)?.to_dtype(DType::F32)?,
            scale,
            true,
        )?;
        let low = attention_slow(&sl(&qr)?, &sl(&kr)?, &sl(&vr)?, scale, true)?;
        check_rule(
            &format!("sequence {i} vs the per-sequence loop"),
            &sl(&out)?,
            &low,
            &expected,
            2.0,
            1e-5,
        )?;
        if len < s {
            let tail = out
                .i((i, len..s))?
                .to_dtype(DType::F32)?
                .abs()?
                .sum_all()?
                .to_scalar::<f32>()?;
            if tail != 0.0 {
                candle::bail!("sequence {i}: padded query rows are not zero ({tail})");
            }
        }
    }
    Ok(())
}

/// The keep mask the GPU used at head dim d (sk <= d), read back exactly: with q = 0 every
/// visible key gets probability 1/sk, and with v = the identity (one-hot rows) output column
/// j of row i is Z_ij / ((1 - p) sk).
fn gpu_mask(
    dev: &Device,
    (b, h, sq, sk): (usize, usize, usize, usize),
    (p, seed, offset): (f32, u64, u64),
    d: usize,
) -> Result<Tensor> {
    let q = Tensor::zeros((b, sq, h, d), DType::BF16, dev)?;
    let k = randn(&[b, sk, h, d], DType::BF16, dev)?;
    let eye = Tensor::eye(sk, DType::BF16, dev)?.pad_with_zeros(1, 0, d - sk)?; // (sk, d)
    let v = eye
        .unsqueeze(0)?
        .unsqueeze(2)?
        .broadcast_as((b, sk, h, d))?
        .contiguous()?;
    let out = FlashAttn::new()
        .dropout(p)
        .seed(seed)
        .rng_offset(offset)
        .forward(&q, &k, &v)?;
    // (b, sq, h, d) -> (b, h, sq, sk), nonzero = kept
    out.narrow(3, 0, sk)?
        .transpose(1, 2)?
        .to_dtype(DType::F32)?
        .gt(0f64)?
        .to_dtype(DType::U8)
}

/// The masks the backward used, read back exactly (f16): with q = 0 every key gets P = 1 /
/// sk; with v = 1 and dO = the rows of the identity (sq <= d), dV = (P o Z / (1 - p))^T dO
/// gives Z_ij as dv[j, i] > 0 (the mask of dV's P), and dP = 1, so that dS_ij = (Z_ij / (1 -
/// p) - m_i) / sk with m_i = sum_j Z_ij / ((1 - p) sk): >= 0 kept, < 0 dropped (unless a row
/// keeps every key); with k = the identity (sk <= d) dQ = scale dS (the mask of dS's dP).
/// Returns both, (b, h, sq, sk) u8.
fn gpu_bwd_masks(
    dev: &Device,
    (b, h, sq, sk, d): (usize, usize, usize, usize, usize),
    (p, seed, offset): (f32, u64, u64),
) -> Result<(Tensor, Tensor)> {
    let dtype = DType::F16;
    let eye = |n: usize, rows: usize| -> Result<Tensor> {
        Tensor::eye(n, dtype, dev)?
            .pad_with_zeros(1, 0, d - n)?
            .unsqueeze(0)?
            .unsqueeze(2)?
            .broadcast_as((b, rows, h, d))?
            .contiguous()
    };
    let q = Tensor::zeros((b, sq, h, d), dtype, dev)?;
    let k = eye(sk, sk)?;
    let v = Tensor::ones((b, sk, h, d), dtype, dev)?;
    let dout = eye(sq, sq)?;
    let attn = FlashAttn::new().dropout(p).seed(seed).rng_offset(offset);
    let (out, lse) = attn.forward_with_lse(&q, &k, &v)?;
    let (dq, _, dv) = attn.backward(&q, &k, &v, &out, &lse, &dout)?;
    // dv (b, sk, h, d) -> (b, h, sq, sk); dq (b, sq, h, d) -> (b, h, sq, sk).
    let from_dv = dv.narrow(3, 0, sq)?.permute((0, 2, 3, 1))?;
    let from_dq = dq.narrow(3, 0, sk)?.transpose(1, 2)?;
    let (from_dv, from_dq) = (from_dv.to_dtype(DType::F32)?, from_dq.to_dtype(DType::F32)?);
    Ok((
        from_dv.gt(0f64)?.to_dtype(DType::U8)?,
        from_dq.ge(0f64)?.to_dtype(DType::U8)?,
    ))
}

/// The forward's and the backward's masks (P for dV, dP for dS) equal the CPU's bit for bit at
/// head dims 64, 128 and 256: several query and key tiles of each kernel.
fn dropout_masks_bwd(dev: &Device) -> Result<()> {
    let (p, seed, offset) = (0.17f32, 77u64, 5u64);
    for (b, h, sq, sk, d) in [
        (2, 4, 64, 64, 64),
        (2, 4, 128, 113, 128),
        (1, 3, 250, 256, 256),
    ] {
        let cpu = dropout_mask(p, seed, offset, b, h, sq, sk)?;
        let count = |t: &Tensor| -> Result<f32> {
            t.to_device(&Device::Cpu)?
                .ne(&cpu)?
                .to_dtype(DType::F32)?
                .sum_all()?
                .to_scalar::<f32>()
        };
        let (from_dv, from_dq) = gpu_bwd_masks(dev, (b, h, sq, sk, d), (p, seed, offset))?;
        let (dv_differ, dq_differ) = (count(&from_dv)?, count(&from_dq)?);
        if sk <= d {
            let fwd = gpu_mask(dev, (b, h, sq, sk), (p, seed, offset), d)?;
            let fwd_differ = count(&fwd)?;
            if fwd_differ != 0.0 {
                candle::bail!("d={d}: {fwd_differ} entries of the forward's mask differ");
            }
        }
        if dv_differ != 0.0 || dq_differ != 0.0 {
            candle::bail!(
                "d={d}: entries differing from the CPU mask: {dv_differ} in dV's P, {dq_differ} in dS's dP"
            );
        }
    }
    Ok(())
}

/// GPU and CPU masks agree bit for bit, and the dropped fraction is within 0.01 of p over
/// >= 1M entries.
fn dropout_masks(dev: &Device) -> Result<()> {
    let (b, h, sq, sk) = (4, 16, 160, 128); // 1.3M entries
    for (p, seed, offset) in [(0.17f32, 1234u64, 7u64), (0.5, 99, 1 << 33)] {
        let gpu = gpu_mask(dev, (b, h, sq, sk), (p, seed, offset), 128)?.to_device(&Device::Cpu)?;
        let cpu = dropout_mask(p, seed, offset, b, h, sq, sk)?;
        let differ = gpu
            .ne(&cpu)?
            .to_dtype(DType::F32)?
            .sum_all()?
            .to_scalar::<f32>()?;
        if differ != 0.0 {
            candle::bail!("p={p}: {differ} entries of the GPU mask differ from the CPU mask");
        }
        let kept = gpu.to_dtype(DType::F32)?.mean_all()?.to_scalar::<f32>()?;
        let dropped = 1.0 - kept;
        println!(
            "dropout p={p}: dropped fraction {dropped:.4} over {} entries, GPU mask == CPU mask",
            b * h * sq * sk
        );
        if (dropped - p).abs() > 0.01 {
            candle::bail!("p={p}: dropped fraction {dropped}");
        }
    }
    Ok(())
}

/// Output and gradients with dropout match `attention_slow_dropout` given the same mask
/// (2x / 3x rule), causal and GQA; the same seed and offset reproduce, another offset differs.
fn dropout_case(dev: &Device, c: Case) -> Result<()> {
    let Case {
        dtype,
        b,
        sq,
        sk,
        h,
        hk,
        d,
        causal,
    } = c;
    let (p, seed, offset) = (0.17f32, 42u64, 3u64);
    let q = randn(&[b, sq, h, d], dtype, dev)?;
    let k = randn(&[b, sk, hk, d], dtype, dev)?;
    let v = randn(&[b, sk, hk, d], dtype, dev)?;
    let w = randn(&[b, sq, h, d], dtype, dev)?;
    let scale = 1.0 / (d as f32).sqrt();
    let attn = FlashAttn::new()
        .causal(causal)
        .dropout(p)
        .seed(seed)
        .rng_offset(offset);
    let out = attn.forward(&q, &k, &v)?;
    let again = attn.forward(&q, &k, &v)?;
    if max_abs_diff(&out, &again)? != 0.0 {
        candle::bail!("same seed and offset gave different outputs");
    }
    let other = FlashAttn::new()
        .causal(causal)
        .dropout(p)
        .seed(seed)
        .rng_offset(offset + 1)
        .forward(&q, &k, &v)?;
    if max_abs_diff(&out, &other)? == 0.0 {
        candle::bail!("another offset gave the same output");
    }
    let keep = dropout_mask(p, seed, offset, b, h, sq, sk)?.to_device(&reference_device(dev))?;
    let slow = |q: &Tensor, k: &Tensor, v: &Tensor| {
        attention_slow_dropout(q, k, v, scale, causal, &keep, p)
    };
    let (qr, kr, vr, wr) = (
        to_reference(&q)?,
        to_reference(&k)?,
        to_reference(&v)?,
        to_reference(&w)?,
    );
    let f32_of = |t: &Tensor| t.to_dtype(DType::F32);
    let (q32, k32, v32) = (f32_of(&qr)?, f32_of(&kr)?, f32_of(&vr)?);
    let reference = slow(&q32, &k32, &v32)?;
    let low = slow(&qr, &kr, &vr)?;
    check_output("out", &out, &low, &reference)?;
    let ours = grads_of(&q, &k, &v, &w, |q, k, v| attn.forward(q, k, v))?;
    let reference = grads_of(&q32, &k32, &v32, &f32_of(&wr)?, slow)?;
    let low = grads_of(&qr, &kr, &vr, &wr, slow)?;
    check_grads(&ours, &low, &reference)
}

/// Dropout on a packed batch equals dropout on each sequence as a batch of one with the
/// same sequence index (the RNG counter is keyed by the sequence index), forward and dq.
fn varlen_dropout(dev: &Device) -> Result<()> {
    let lens = [(37usize, 37usize), (1, 64), (129, 100)];
    let (h, d, p, seed, offset) = (4, 64, 0.3f32, 5u64, 11u64);
    let lq: Vec<usize> = lens.iter().map(|l| l.0).collect();
    let lk: Vec<usize> = lens.iter().map(|l| l.1).collect();
    let varlen = VarLen::from_seqlens(&lq, &lk)?;
    let q = randn(&[varlen.total_q(), h, d], DType::BF16, dev)?;
    let k = randn(&[varlen.total_k(), h, d], DType::BF16, dev)?;
    let v = randn(&[varlen.total_k(), h, d], DType::BF16, dev)?;
    let attn = FlashAttn::new()
        .causal(true)
        .dropout(p)
        .seed(seed)
        .rng_offset(offset);
    let out = attn.forward_varlen(&q, &k, &v, &varlen)?;
    let scale = 1.0 / (d as f32).sqrt();
    let (cq, ck) = (varlen.cu_seqlens_q(), varlen.cu_seqlens_k());
    let (max_q, max_k) = (varlen.max_seqlen_q(), varlen.max_seqlen_k());
    let full_mask = dropout_mask(p, seed, offset, lens.len(), h, max_q, max_k)?;
    let (qr, kr, vr) = (to_reference(&q)?, to_reference(&k)?, to_reference(&v)?);
    for (b, &(sq, sk)) in lens.iter().enumerate() {
        let keep = full_mask
            .i((b..b + 1, .., 0..sq, 0..sk))?
            .to_device(&reference_device(dev))?;
        let (q0, k0) = (cq[b] as usize, ck[b] as usize);
        let qb = qr.i(q0..q0 + sq)?.unsqueeze(0)?.to_dtype(DType::F32)?;
        let kb = kr.i(k0..k0 + sk)?.unsqueeze(0)?.to_dtype(DType::F32)?;
        let vb = vr.i(k0..k0 + sk)?.unsqueeze(0)?.to_dtype(DType::F32)?;
        let expected = attention_slow_dropout(&qb, &kb, &vb, scale, true, &keep, p)?.squeeze(0)?;
        let low_of = |t: &Tensor, r0: usize, n: usize| t.i(r0..r0 + n)?.unsqueeze(0);
        let low = attention_slow_dropout(
            &low_of(&qr, q0, sq)?,
            &low_of(&kr, k0, sk)?,
            &low_of(&vr, k0, sk)?,
            scale,
            true,
            &keep,
            p,
        )?
        .squeeze(0)?;
        check_rule(
            &format!("sequence {b} vs attention_slow_dropout"),
            &out.i(q0..q0 + sq)?,
            &low,
            &expected,
            2.0,
            1e-5,
        )?;
    }
    Ok(())
}

pub(crate) fn run(dev: &Device, quick: bool, suite: &mut Suite) {
    let lens_sets: Vec<Vec<(usize, usize)>> = vec![
        vec![(1, 1), (17, 113), (255, 255), (64, 63)],
        vec![(113, 7), (1, 1023), (300, 301), (0, 5), (77, 0)],
        // Sequences of several 128-row tiles, ends inside either 64-row half of a tile, more
        // work tiles than SMs at 16 heads (the Hopper forward's `_packed` kernels and their
        // dynamic walk); no queries, no keys.
        vec![
            (700, 700),
            (129, 1000),
            (1000, 129),
            (64, 64),
            (65, 200),
            (0, 50),
            (513, 513),
            (128, 0),
        ],
    ];
    let dims: &[usize] = if quick {
        &[64]
    } else {
        &[32, 40, 64, 80, 96, 128, 256]
    };
    for dtype in [DType::F16, DType::BF16] {
        for &d in dims {
            for causal in [false, true] {
                for (i, lens) in lens_sets.iter().enumerate() {
                    let (h, hk) = [(4, 4), (8, 2), (16, 4)][i];
                    let name =
                        format!("varlen {dtype:?} d={d} causal={causal} h={h}/{hk} lens={lens:?}");
                    suite.record(&name, varlen_case(dev, dtype, lens, h, hk, d, causal, None));
                }
                // Dropout on packed batches of several tiles (the Hopper `_packed_dropout`
                // kernels), output and gradients.
                let name = format!("varlen dropout {dtype:?} d={d} causal={causal} h=16/4");
                let opts = Some((0.17, 42, 9));
                let lens = &lens_sets[2];
                suite.record(&name, varlen_case(dev, dtype, lens, 16, 4, d, causal, opts));
            }
        }
    }
    suite.record("padded batch", padded_batch(dev));
    suite.record("dropout masks", dropout_masks(dev));
    suite.record(
        "dropout masks, forward and backward",
        dropout_masks_bwd(dev),
    );
    let cases: &[(usize, usize, usize, usize, usize, usize, bool)] = if quick {
        &[(2, 113, 203, 4, 2, 64, true)]
    } else {
        &[
            (2, 113, 203, 4, 2, 64, true),
            (2, 203, 113, 4, 4, 128, false),
            (1, 256, 256, 8, 1, 40, true),
            (1, 97, 333, 4, 2, 256, false),
            // Several query and key tiles of the Hopper `_dropout` kernels (d 64, 96 and 128
            // on 128 x 128 tiles, 256 on 128 x 80; the backward's 128- and 64-key blocks):
            // causal bottom-right with seqlen_q != seqlen_k, GQA and MQA.
            (2, 1023, 1023, 4, 2, 64, true),
            (1, 513, 777, 4, 2, 96, false),
            (2, 777, 513, 4, 1, 96, true),
            (1, 700, 1500, 4, 4, 128, true),
            (1, 1023, 513, 8, 2, 128, false),
            (2, 384, 640, 4, 1, 256, true),
            (1, 300, 300, 2, 2, 256, false),
        ]
    };
    for dtype in [DType::F16, DType::BF16] {
        for &(b, sq, sk, h, hk, d, causal) in cases {
            let name =
                format!("dropout {dtype:?} b={b} sq={sq} sk={sk} h={h}/{hk} d={d} causal={causal}");
            suite.record(
                &name,
                dropout_case(
                    dev,
                    Case {
                        dtype,
                        b,
                        sq,
                        sk,
                        h,
                        hk,
                        d,
                        causal,
                    },
                ),
            );
        }
    }
    suite.record("varlen dropout", varlen_dropout(dev));
}
