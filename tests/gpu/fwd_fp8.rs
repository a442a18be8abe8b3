//! GPU tests for the FP8 (e4m3) forward: q, k and v quantized with per-tensor, per-head or
//! per-block scales, the kernel's output and LSE against attention over the dequantized
//! inputs.
//!
//! Accuracy rule (FP8-aware, FlashAttention's way): the reference is f32 attention over the
//! dequantized q, k, v (exact up to f32); the low-precision baseline is the same math with the
//! probabilities rounded to e4m3 before P V (as the kernel takes them: e4m3(256 p) / 256, the
//! kernel's one rounding inside the attention; the row sums stay f32) and the output rounded to its dtype. Our max error must be at most
//! 2x the baseline's, plus 1e-5. The LSE (from f32 scores of the same inputs) within 2e-3
//! (absolute plus relative). Varlen batches are checked sequence by sequence.

use candle::{DType, Device, Result, Tensor, D};
use candle_flash::quant::{
    dequantize_fp8, fp8_scales, fp8_v_transposed, quantize_fp8, Fp8Scaling, FP8_BLOCK_ROWS,
};
use candle_flash::{FlashAttn, VarLen};

use crate::cuda_suite::{check_output, has_nan, max_abs_diff, randn, reference_device, Suite};

#[derive(Clone, Copy, Debug)]
struct Case {
    b: usize,
    sq: usize,
    sk: usize,
    h: usize,
    hk: usize,
    d: usize,
    causal: bool,
    scaling: Fp8Scaling,
    out: DType,
    /// V transposed (FlashAttn::fp8_v_transposed): the kernels that copy V^T as it is.
    vt: bool,
}

const PER_BLOCK: Fp8Scaling = Fp8Scaling::PerBlock {
    rows: FP8_BLOCK_ROWS,
};

/// One e4m3 input: the bytes and descales on the device, the dequantized values in f32 on
/// the reference device.
struct Quantized {
    x8: Tensor,
    descale: Tensor,
    real: Tensor,
}

fn quantize(x: &Tensor, scaling: Fp8Scaling) -> Result<Quantized> {
    let descale = fp8_scales(x, scaling)?;
    let x8 = quantize_fp8(x, &descale, scaling)?;
    let real = dequantize_fp8(&x8, &descale, scaling, DType::F32)?;
    let real = real.to_device(&reference_device(x.device()))?;
    Ok(Quantized { x8, descale, real })
}

fn per(per_head: bool) -> Fp8Scaling {
    if per_head {
        Fp8Scaling::PerHead
    } else {
        Fp8Scaling::PerTensor
    }
}

/// Random q `(b, s, h, d)`, k and v `(b, s, hk, d)`, quantized per head.
fn random_qkv(
    dev: &Device,
    (b, s, h, hk, d): (usize, usize, usize, usize, usize),
) -> Result<[Quantized; 3]> {
    let x = |heads| quantize(&randn(&[b, s, heads, d], DType::F32, dev)?, per(true));
    Ok([x(h)?, x(hk)?, x(hk)?])
}

/// Standard normal `(b, s, h, d)` whose blocks of 128 rows differ in magnitude (x 1/2, 1, 2,
/// 4 in turn), so that per-block factors differ between key tiles and O's rescaling by their
/// ratios (sm90/fwd_ws.cu: exp_scores) matters.
fn blocky(dims: &[usize], dev: &Device) -> Result<Tensor> {
    let x = randn(dims, DType::F32, dev)?;
    let s = dims[1];
    let f: Vec<f32> = (0..s)
        .map(|r| [0.5, 1.0, 2.0, 4.0][r / FP8_BLOCK_ROWS % 4])
        .collect();
    x.broadcast_mul(&Tensor::from_vec(f, (1, s, 1, 1), dev)?)
}

/// `(b, s, hk, d)` -> `(b, h, s, d)`, each K/V head repeated for its query heads.
fn heads_first(x: &Tensor, h: usize) -> Result<Tensor> {
    let (b, s, hk, d) = x.dims4()?;
    x.transpose(1, 2)?
        .unsqueeze(2)?
        .broadcast_as((b, hk, h / hk, s, d))?
        .reshape((b, h, s, d))
}

/// e4m3 rounding of a rank-4 f32 tensor (scale 1), on its device.
fn round_e4m3(x: &Tensor) -> Result<Tensor> {
    let one = Tensor::new(&[1f32], x.device())?;
    let x8 = quantize_fp8(x, &one, Fp8Scaling::PerTensor)?;
    dequantize_fp8(&x8, &one, Fp8Scaling::PerTensor, DType::F32)
}

/// Attention over f32 `(b, s, h, d)` inputs: `(out, lse)`, out `(b, sq, h, d)` f32, lse
/// `(b, h, sq)`; `round_p` rounds the probabilities to e4m3 before P V (the baseline).
fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f32,
    causal: bool,
    round_p: bool,
) -> Result<(Tensor, Tensor)> {
    let (_, sq, h, _) = q.dims4()?;
    let sk = k.dim(1)?;
    let qh = q.transpose(1, 2)?.contiguous()?;
    let (kh, vh) = (
        heads_first(k, h)?.contiguous()?,
        heads_first(v, h)?.contiguous()?,
    );
    let mut s = (qh.matmul(&kh.t()?)? * scale as f64)?;
    if causal {
        // Bottom-right: row i sees keys j <= i + sk - sq.
        let mask: Vec<f32> = (0..sq)
            .flat_map(|i| {
                (0..sk).map(move |j| {
                    if j as i64 <= i as i64 + sk as i64 - sq as i64 {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (sq, sk), q.device())?;
        s = s.broadcast_add(&mask)?;
    }
    let m = s.max_keepdim(D::Minus1)?;
    // Rows that see no key: max -inf; subtracting 0 keeps their exponentials 0.
    let finite = m.ne(f32::NEG_INFINITY)?;
    let m0 = finite.where_cond(&m, &m.zeros_like()?)?;
    let p = s.broadcast_sub(&m0)?.exp()?;
    let l = p.sum_keepdim(D::Minus1)?;
    // The kernel's P is 256 at the maximum (sm90/softmax_fp8.cuh): e4m3(256 p) / 256.
    let p = if round_p {
        (round_e4m3(&(p * 256.0)?)? / 256.0)?
    } else {
        p
    };
    let l_safe = l.maximum(1e-30)?;
    let o = p.matmul(&vh)?.broadcast_div(&l_safe)?;
    let lse = (m.squeeze(D::Minus1)? + l.squeeze(D::Minus1)?.log()?)?;
    Ok((o.transpose(1, 2)?.contiguous()?, lse))
}

fn check_lse(ours: &Tensor, reference: &Tensor) -> Result<()> {
    let ours = ours.to_device(reference.device())?.to_dtype(DType::F32)?;
    let (a, r) = (
        ours.flatten_all()?.to_vec1::<f32>()?,
        reference.flatten_all()?.to_vec1::<f32>()?,
    );
    for (i, (&a, &r)) in a.iter().zip(&r).enumerate() {
        let ok = if r == f32::NEG_INFINITY {
            a == f32::NEG_INFINITY
        } else {
            (a - r).abs() <= 2e-3 * (1.0 + r.abs())
        };
        if !ok {
            candle::bail!("lse[{i}]: {a} against {r}")
        }
    }
    Ok(())
}

fn fixed_case(dev: &Device, c: &Case) -> Result<()> {
    let scale = 1.0 / (c.d as f32).sqrt();
    let input = |dims: &[usize]| {
        if c.scaling == PER_BLOCK {
            blocky(dims, dev)
        } else {
            randn(dims, DType::F32, dev)
        }
    };
    let q = quantize(&input(&[c.b, c.sq, c.h, c.d])?, c.scaling)?;
    let k = quantize(&input(&[c.b, c.sk, c.hk, c.d])?, c.scaling)?;
    let v = quantize(&input(&[c.b, c.sk, c.hk, c.d])?, c.scaling)?;
    let mut attn = FlashAttn::new()
        .causal(c.causal)
        .fp8_descales(&q.descale, &k.descale, &v.descale)
        .out_dtype(c.out);
    let v8 = if c.vt {
        attn = attn.fp8_v_transposed();
        fp8_v_transposed(&v.x8)?
    } else {
        v.x8.clone()
    };
    let (out, lse) = attn.forward_with_lse(&q.x8, &k.x8, &v8)?;
    if out.dtype() != c.out || out.dims() != [c.b, c.sq, c.h, c.d] {
        candle::bail!("out: {:?} {:?}", out.dtype(), out.dims())
    }
    if has_nan(&out)? {
        candle::bail!("NaN in the output")
    }
    let (reference, lse_ref) = attention(&q.real, &k.real, &v.real, scale, c.causal, false)?;
    let (low, _) = attention(&q.real, &k.real, &v.real, scale, c.causal, true)?;
    let low = low.to_dtype(c.out)?;
    check_output("out", &out, &low, &reference)?;
    check_lse(&lse, &lse_ref)
}

/// Packed sequences of `lens` (queries and keys alike), against each sequence alone.
fn varlen_case(
    dev: &Device,
    lens: &[usize],
    (h, hk, d): (usize, usize, usize),
    causal: bool,
    per_block: bool,
) -> Result<()> {
    let total = lens.iter().sum::<usize>();
    let scale = 1.0 / (d as f32).sqrt();
    let quantized = |heads: usize| {
        let x = randn(&[1, total, heads, d], DType::F32, dev)?;
        if per_block {
            quantize_by_sequence(&x, lens)
        } else {
            quantize(&x, Fp8Scaling::PerHead)
        }
    };
    let (q, k, v) = (quantized(h)?, quantized(hk)?, quantized(hk)?);
    let varlen = VarLen::from_seqlens(lens, lens)?;
    let (out, lse) = FlashAttn::new()
        .causal(causal)
        .fp8_descales(&q.descale, &k.descale, &v.descale)
        .forward_varlen_with_lse(
            &q.x8.squeeze(0)?,
            &k.x8.squeeze(0)?,
            &v.x8.squeeze(0)?,
            &varlen,
        )?;
    let mut start = 0;
    for (i, &n) in lens.iter().enumerate() {
        let part = |t: &Tensor| t.narrow(1, start, n);
        let (reference, lse_ref) = attention(
            &part(&q.real)?,
            &part(&k.real)?,
            &part(&v.real)?,
            scale,
            causal,
            false,
        )?;
        let (low, _) = attention(
            &part(&q.real)?,
            &part(&k.real)?,
            &part(&v.real)?,
            scale,
            causal,
            true,
        )?;
        let ours = out.narrow(0, start, n)?.unsqueeze(0)?;
        check_output(
            &format!("sequence {i}"),
            &ours,
            &low.to_dtype(DType::BF16)?,
            &reference,
        )?;
        check_lse(&lse.narrow(1, start, n)?.unsqueeze(0)?, &lse_ref)?;
        start += n;
    }
    Ok(())
}

/// Packed sequences `(1, total, heads, d)` quantized with per-block scales of each sequence:
/// descales `(sequences, heads, ceil(longest / 128))`, blocks counted from each sequence's
/// first row (ones past a sequence's last block).
fn quantize_by_sequence(x: &Tensor, lens: &[usize]) -> Result<Quantized> {
    let blocks = lens.iter().max().unwrap().div_ceil(FP8_BLOCK_ROWS);
    let (mut x8, mut descales, mut real) = (vec![], vec![], vec![]);
    let mut start = 0;
    for &n in lens {
        let part = quantize(&x.narrow(1, start, n)?, PER_BLOCK)?;
        let have = part.descale.dim(2)?;
        descales.push(if have < blocks {
            // (An empty tensor would be an empty, and on CUDA refused, allocation.)
            let ones = Tensor::ones((1, x.dim(2)?, blocks - have), DType::F32, x.device())?;
            Tensor::cat(&[&part.descale, &ones], 2)?
        } else {
            part.descale
        });
        x8.push(part.x8);
        real.push(part.real);
        start += n;
    }
    Ok(Quantized {
        x8: Tensor::cat(&x8, 1)?,
        descale: Tensor::cat(&descales, 0)?,
        real: Tensor::cat(&real, 1)?,
    })
}

/// A transposed V (copied as V^T tiles, no transpose in the kernel) gives the transposing
/// kernels' output bit for bit where both take the same key tiles (the same P, the same V^T
/// in shared memory in another swizzle): d = 128, and d = 256 up to 512 keys. Past that the
/// `_vt` kernel's 128-key tiles take the rows' running maxima over other key groups than the
/// transposing kernel's 96, so P rounds to e4m3 otherwise; the grid checks them against the
/// reference.
fn transposed_case(dev: &Device) -> Result<()> {
    for &(b, s, h, hk, d, causal) in &[
        (2, 1023, 4, 1, 128, false),
        (1, 2048, 4, 4, 128, true),
        (2, 512, 4, 2, 256, false),
        (1, 500, 2, 2, 256, true),
        (1, 113, 4, 2, 128, true),
        (2, 300, 4, 2, 256, true),
    ] {
        let [q, k, v] = random_qkv(dev, (b, s, h, hk, d))?;
        let attn = FlashAttn::new()
            .causal(causal)
            .fp8_descales(&q.descale, &k.descale, &v.descale);
        let plain = attn.forward(&q.x8, &k.x8, &v.x8)?;
        let vt = fp8_v_transposed(&v.x8)?;
        let ours = attn.clone().fp8_v_transposed().forward(&q.x8, &k.x8, &vt)?;
        let diff = max_abs_diff(&plain, &ours)?;
        if diff != 0.0 {
            candle::bail!("b{b} s{s} h{h}/{hk} d{d} causal={causal}: differs by {diff}")
        }
    }
    Ok(())
}

/// Strided e4m3 views that TMA cannot read in place (columns 8.. of a wider tensor: a start
/// 8 bytes past 16) give the contiguous inputs' output bit for bit, through the crate's own
/// byte copy (candle-core 0.11.1's strided F8E4M3 copy fails on CUDA); so do the
/// dequantization and the transposed-V helper of such a view.
fn strided_case(dev: &Device) -> Result<()> {
    let (b, s, h, d) = (2, 300, 4, 128);
    let wide = randn(&[b, s, 3 * h, d + 8], DType::F32, dev)?;
    let descale = fp8_scales(&wide, Fp8Scaling::PerTensor)?;
    let wide8 = quantize_fp8(&wide, &descale, Fp8Scaling::PerTensor)?;
    let view = |i: usize, t: &Tensor| t.narrow(2, i * h, h)?.narrow(3, 8, d);
    let mut strided = vec![];
    let mut packed = vec![];
    for i in 0..3 {
        strided.push(view(i, &wide8)?);
        let part = view(i, &wide)?.contiguous()?;
        packed.push(quantize_fp8(&part, &descale, Fp8Scaling::PerTensor)?);
    }
    let back = |t: &Tensor| dequantize_fp8(t, &descale, Fp8Scaling::PerTensor, DType::F32);
    let diff = max_abs_diff(&back(&strided[0])?, &back(&packed[0])?)?;
    if diff != 0.0 {
        candle::bail!("dequantize_fp8 of a strided view differs by {diff}")
    }
    let attn = FlashAttn::new()
        .causal(true)
        .fp8_descales(&descale, &descale, &descale);
    let want = attn.forward(&packed[0], &packed[1], &packed[2])?;
    let got = attn.forward(&strided[0], &strided[1], &strided[2])?;
    let diff = max_abs_diff(&want, &got)?;
    if diff != 0.0 {
        candle::bail!("strided q, k, v: the output differs by {diff}")
    }
    let vt = fp8_v_transposed(&strided[2])?;
    let got = attn
        .fp8_v_transposed()
        .forward(&packed[0], &packed[1], &vt)?;
    let diff = max_abs_diff(&want, &got)?;
    if diff != 0.0 {
        candle::bail!("V transposed from a strided view: the output differs by {diff}")
    }
    Ok(())
}

/// Per-block descales whose blocks all hold their head's per-head factor give the per-head
/// call's output bit for bit (the kernel folds either into the same products), where both
/// calls run one kernel: at d = 256 (64-key tiles) for q, k and v; at d = 128 for q only, as
/// per-block k and v descales take the 128-key tiles and per-head ones the widest
/// (src/cuda/fwd_fp8.rs), whose softmax tiles round P differently.
fn block_equals_head_case(dev: &Device) -> Result<()> {
    for (d, kv_blocks) in [(128, false), (256, true)] {
        let (b, s, h, hk) = (2, 300, 4, 2);
        let q = quantize(&randn(&[b, s, h, d], DType::F32, dev)?, Fp8Scaling::PerHead)?;
        let k = quantize(
            &randn(&[b, s, hk, d], DType::F32, dev)?,
            Fp8Scaling::PerHead,
        )?;
        let v = quantize(
            &randn(&[b, s, hk, d], DType::F32, dev)?,
            Fp8Scaling::PerHead,
        )?;
        let blocks = s.div_ceil(FP8_BLOCK_ROWS);
        let spread = |t: &Tensor, heads: usize| {
            t.reshape((1, heads, 1))?
                .broadcast_as((b, heads, blocks))?
                .contiguous()
        };
        let run = |qd: &Tensor, kd: &Tensor, vd: &Tensor| {
            FlashAttn::new()
                .causal(true)
                .fp8_descales(qd, kd, vd)
                .forward(&q.x8, &k.x8, &v.x8)
        };
        let heads = run(&q.descale, &k.descale, &v.descale)?;
        let (kd, vd) = if kv_blocks {
            (spread(&k.descale, hk)?, spread(&v.descale, hk)?)
        } else {
            (k.descale.clone(), v.descale.clone())
        };
        let blocks = run(&spread(&q.descale, h)?, &kd, &vd)?;
        let diff = max_abs_diff(&heads, &blocks)?;
        if diff != 0.0 {
            candle::bail!(
                "d {d}: per-block descales equal to per-head ones: output differs by {diff}"
            )
        }
    }
    Ok(())
}

/// A padded FP8 batch (right, left and holed padding) equals the packed call on the same
/// tokens, zeros in the padded rows (the unpad goes by runs of rows on CUDA: Padding).
fn padded_case(dev: &Device) -> Result<()> {
    let (b, s, h, hk, d) = (3, 200, 4, 2, 128);
    let mask: Vec<u8> = (0..b * s)
        .map(|i| {
            let (row, t) = (i / s, i % s);
            u8::from(match row {
                0 => t < 150,
                1 => t >= 37,
                _ => t % 3 != 1,
            })
        })
        .collect();
    let pad = candle_flash::Padding::from_mask(&Tensor::from_vec(mask.clone(), (b, s), dev)?)?;
    let [q, k, v] = random_qkv(dev, (b, s, h, hk, d))?;
    let opts = FlashAttn::new()
        .causal(true)
        .fp8_descales(&q.descale, &k.descale, &v.descale);
    let padded = opts.forward_padded(&q.x8, &k.x8, &v.x8, &pad, &pad)?;
    // The same tokens packed on the CPU (index_select of F8E4M3 works there).
    let cpu = Device::Cpu;
    let packed = |t: &Tensor| -> Result<Tensor> { pad.unpad(&t.to_device(&cpu)?)?.to_device(dev) };
    let varlen = VarLen::from_padding(&pad, &pad)?;
    let packed_out =
        opts.forward_varlen(&packed(&q.x8)?, &packed(&k.x8)?, &packed(&v.x8)?, &varlen)?;
    let diff = max_abs_diff(&pad.unpad(&padded)?, &packed_out)?;
    if diff != 0.0 {
        candle::bail!("padded against packed: max difference {diff}")
    }
    let zeros: Vec<f32> = padded
        .to_dtype(DType::F32)?
        .abs()?
        .sum_keepdim(3)?
        .sum_keepdim(2)?
        .flatten_all()?
        .to_vec1()?;
    for (i, (&m, &z)) in mask.iter().zip(&zeros).enumerate() {
        if m == 0 && z != 0.0 {
            candle::bail!("padded row {i}: not zero")
        }
    }
    Ok(())
}

/// The descales act as the dequantization says: doubling v's doubles the output, doubling
/// q's doubles the scores (the same as a doubled softmax scale).
fn descale_case(dev: &Device) -> Result<()> {
    let (b, s, h, d) = (1, 300, 4, 128);
    let [q, k, v] = random_qkv(dev, (b, s, h, h, d))?;
    let run = |qd: &Tensor, vd: &Tensor, softmax_scale: f32| {
        FlashAttn::new()
            .softmax_scale(softmax_scale)
            .fp8_descales(qd, &k.descale, vd)
            .out_dtype(DType::F32)
            .forward(&q.x8, &k.x8, &v.x8)
    };
    let base = 1.0 / (d as f32).sqrt();
    let plain = run(&q.descale, &v.descale, base);
    let Err(_) = plain else {
        // F32 output is a CPU-only dtype; on CUDA it must be refused.
        candle::bail!("out_dtype F32 on CUDA: expected an error")
    };
    let run = |qd: &Tensor, vd: &Tensor, softmax_scale: f32| {
        FlashAttn::new()
            .softmax_scale(softmax_scale)
            .fp8_descales(qd, &k.descale, vd)
            .out_dtype(DType::BF16)
            .forward(&q.x8, &k.x8, &v.x8)?
            .to_dtype(DType::F32)
    };
    let plain = run(&q.descale, &v.descale, base)?;
    let v2 = run(&q.descale, &(&v.descale * 2.0)?, base)?;
    let diff = max_abs_diff(&v2, &(&plain * 2.0)?)?;
    let mag = plain.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    if diff > 1e-2 * mag {
        candle::bail!("v descale x2: output off by {diff} (|out| up to {mag})")
    }
    let q2 = run(&(&q.descale * 2.0)?, &v.descale, base)?;
    let scale2 = run(&q.descale, &v.descale, 2.0 * base)?;
    let diff = max_abs_diff(&q2, &scale2)?;
    if diff > 1e-2 * mag {
        candle::bail!("q descale x2 against softmax scale x2: {diff}")
    }
    if max_abs_diff(&q2, &plain)? < 1e-3 * mag {
        candle::bail!("q descale x2 left the output unchanged")
    }
    Ok(())
}

/// Inputs the kernel refuses with an error (never a launch).
fn error_cases(dev: &Device) -> Result<()> {
    let x = quantize(&randn(&[1, 64, 2, 64], DType::F32, dev)?, per(false))?;
    match FlashAttn::new()
        .fp8_descales(&x.descale, &x.descale, &x.descale)
        .forward(&x.x8, &x.x8, &x.x8)
    {
        Err(e) if e.to_string().contains("head_dim") => {}
        Err(e) => candle::bail!("head_dim 64: unexpected error {e}"),
        Ok(_) => candle::bail!("head_dim 64 has no FP8 kernel: expected an error"),
    }
    let y = quantize(&randn(&[1, 64, 2, 128], DType::F32, dev)?, per(true))?;
    let bad = Tensor::ones(3, DType::F32, dev)?;
    match FlashAttn::new()
        .fp8_descales(&bad, &y.descale, &y.descale)
        .forward(&y.x8, &y.x8, &y.x8)
    {
        Err(e) if e.to_string().contains("fp8_descales") => {}
        Err(e) => candle::bail!("descale of 3 heads: unexpected error {e}"),
        Ok(_) => candle::bail!("a q descale of 3 for 2 heads: expected an error"),
    }
    // Per-block descales of 64 rows blocks (2 of them) where 128-row blocks (1) are expected.
    let bad = Tensor::ones((1, 2, 2), DType::F32, dev)?;
    match FlashAttn::new()
        .fp8_descales(&y.descale, &bad, &y.descale)
        .forward(&y.x8, &y.x8, &y.x8)
    {
        Err(e) if e.to_string().contains("fp8_descales") => {}
        Err(e) => candle::bail!("k descale of 2 blocks: unexpected error {e}"),
        Ok(_) => candle::bail!("a k descale of 2 blocks for 64 keys: expected an error"),
    }
    // forward_padded refuses per-block descales (padding moves rows between blocks).
    let pad = candle_flash::Padding::from_mask(&Tensor::ones((1, 64), DType::U8, dev)?)?;
    let good = Tensor::ones((1, 2, 1), DType::F32, dev)?;
    match FlashAttn::new()
        .fp8_descales(&good, &good, &good)
        .forward_padded(&y.x8, &y.x8, &y.x8, &pad, &pad)
    {
        Err(e) if e.to_string().contains("per-block") => {}
        Err(e) => candle::bail!("forward_padded, per-block: unexpected error {e}"),
        Ok(_) => candle::bail!("forward_padded with per-block descales: expected an error"),
    }
    Ok(())
}

pub(crate) fn run(dev: &Device, quick: bool, suite: &mut Suite) {
    let mut cases = vec![];
    // (b, sq, sk, h, hk, d): every compiled head dim (128, 256).
    let shapes: &[(usize, usize, usize, usize, usize, usize)] = &[
        (1, 1, 1, 4, 4, 128),
        (2, 1, 1023, 8, 2, 128),
        (2, 113, 113, 8, 2, 128),
        (1, 113, 1023, 4, 4, 128),
        (2, 1023, 1023, 4, 1, 128),
        (2, 512, 256, 8, 4, 128),
        (1, 2048, 2048, 8, 8, 128),
        (1, 4096, 4096, 2, 2, 128),
        (1, 1, 1, 2, 2, 256),
        (2, 113, 1023, 8, 2, 256),
        (1, 1023, 1023, 4, 4, 256),
        (2, 512, 256, 4, 1, 256),
        (1, 2048, 2048, 4, 4, 256),
    ];
    for &(b, sq, sk, h, hk, d) in shapes {
        if quick && sq * sk > 1 << 20 {
            continue;
        }
        for causal in [false, true] {
            for scaling in [Fp8Scaling::PerTensor, Fp8Scaling::PerHead, PER_BLOCK] {
                for vt in [false, true] {
                    let out = if scaling == Fp8Scaling::PerTensor {
                        DType::F16
                    } else {
                        DType::BF16
                    };
                    cases.push(Case {
                        b,
                        sq,
                        sk,
                        h,
                        hk,
                        d,
                        causal,
                        scaling,
                        out,
                        vt,
                    });
                }
            }
        }
    }
    for c in &cases {
        let name = format!(
            "fp8fwd b{} sq{} sk{} h{}/{} d{} causal={} {:?} {:?}{}",
            c.b,
            c.sq,
            c.sk,
            c.h,
            c.hk,
            c.d,
            c.causal,
            c.scaling,
            c.out,
            if c.vt { " key-major v" } else { "" }
        );
        suite.record(&name, fixed_case(dev, c));
    }
    // Short sequences take the narrowest key tiles; the longest here past 512 keys take the
    // widest packed kernels (d 128: 192 keys with per-tensor and per-head descales; d 256: 96
    // keys, O put out in two halves, copied at a sequence's end).
    let short: &[usize] = &[1, 113, 300, 64, 257];
    let long: &[usize] = &[1, 700, 1030, 257];
    for d in [128, 256] {
        for causal in [false, true] {
            for (lens, per_block) in [(short, false), (short, true), (long, false)] {
                suite.record(
                    &format!("fp8fwd varlen {lens:?} d{d} causal={causal} per_block={per_block}"),
                    varlen_case(dev, lens, (8, 2, d), causal, per_block),
                );
            }
        }
    }
    suite.record("fp8fwd block = head", block_equals_head_case(dev));
    suite.record("fp8fwd transposed v = v", transposed_case(dev));
    suite.record("fp8fwd padded", padded_case(dev));
    suite.record("fp8fwd strided views", strided_case(dev));
    suite.record("fp8fwd descales", descale_case(dev));
    suite.record("fp8fwd errors", error_cases(dev));
    // The same call on the CPU (the op's reference implementation) and on the device agree
    // by the rule too: both round P to e4m3.
    suite.record("fp8fwd cpu vs cuda", cpu_vs_cuda(dev));
}

fn cpu_vs_cuda(dev: &Device) -> Result<()> {
    let (b, s, h, hk, d) = (1, 300, 4, 2, 128);
    let q = quantize(&blocky(&[b, s, h, d], dev)?, PER_BLOCK)?;
    let k = quantize(&blocky(&[b, s, hk, d], dev)?, PER_BLOCK)?;
    let v = quantize(&blocky(&[b, s, hk, d], dev)?, PER_BLOCK)?;
    let cpu = Device::Cpu;
    let on_cpu = |t: &Tensor| t.to_device(&cpu);
    let opts = |qd: &Tensor, kd: &Tensor, vd: &Tensor| {
        FlashAttn::new().causal(true).fp8_descales(qd, kd, vd)
    };
    let ours = opts(&q.descale, &k.descale, &v.descale).forward(&q.x8, &k.x8, &v.x8)?;
    let theirs = opts(
        &on_cpu(&q.descale)?,
        &on_cpu(&k.descale)?,
        &on_cpu(&v.descale)?,
    )
    .forward(&on_cpu(&q.x8)?, &on_cpu(&k.x8)?, &on_cpu(&v.x8)?)?;
    let scale = 1.0 / (d as f32).sqrt();
    let (reference, _) = attention(&q.real, &k.real, &v.real, scale, true, false)?;
    check_output(
        "cuda against the cpu op's error",
        &ours,
        &theirs,
        &reference,
    )
}
