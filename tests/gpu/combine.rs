//! `candle_flash::combine`'s kernel (cuda/train/combine.cuh) against its op-by-op form on the
//! CPU, on the same inputs: bf16, f16 and f32 parts, 1 part (returned as it is), 2 and 5
//! (one launch), 17 and 300 (merged in groups into f32 partial results, in one and in two
//! rounds); rows that no part reaches, a row one part alone reaches, a NaN lse, a NaN output
//! element; parts of every layout the kernel reads (vector loads over contiguous and strided
//! rows, element loads at a misaligned offset, a transposed lse) and one it copies first (a
//! strided head_dim). Parts that carry a gradient
//! take Candle's ops, whose gradient must arrive.

use candle::{DType, Device, Result, Tensor, Var};
use candle_flash::combine;

/// Random f32 parts on the CPU, `(b, s, h, d)` outputs and `(b, h, s)` LSEs, with special rows:
/// (batch 0, head 0, query 0) is -inf in every part (no keys anywhere); (batch 0, head h-1,
/// query 0) is -inf in every part but the last; (batch b-1, head h-1, query s-1) has a NaN lse
/// in part 0 (with more than one part); the last part's output is NaN at (0, s-1, 0, 0).
fn cpu_parts(n: usize, (b, s, h, d): Shape4) -> Result<Vec<(Tensor, Tensor)>> {
    let cpu = Device::Cpu;
    let lse_at = |bb: usize, hh: usize, ss: usize| (bb * h + hh) * s + ss;
    (0..n)
        .map(|i| {
            let mut o = Tensor::randn(0f32, 1.0, (b, s, h, d), &cpu)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let mut lse = (Tensor::randn(0f32, 1.0, (b, h, s), &cpu)? * 3.0)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            lse[lse_at(0, 0, 0)] = f32::NEG_INFINITY;
            if i + 1 < n {
                lse[lse_at(0, h - 1, 0)] = f32::NEG_INFINITY;
            }
            if i == 0 && n > 1 {
                lse[lse_at(b - 1, h - 1, s - 1)] = f32::NAN;
            }
            if i + 1 == n && d > 0 {
                o[((s - 1) * h) * d] = f32::NAN;
            }
            Ok((
                Tensor::from_vec(o, (b, s, h, d), &cpu)?,
                Tensor::from_vec(lse, (b, h, s), &cpu)?,
            ))
        })
        .collect()
}

/// Every element of `gpu` as `cpu`'s: NaN where it is NaN, the same infinity, else within
/// `rel · |cpu| + 1e-4 · max |cpu|` (the kernel's exponentials and sums differ from Candle's
/// by a few f32 ulps, which can move one rounding to the stored dtype by one place).
fn same(what: &str, gpu: &Tensor, cpu: &Tensor, rel: f32) -> Result<()> {
    if gpu.dims() != cpu.dims() || gpu.dtype() != cpu.dtype() {
        candle::bail!(
            "{what}: {:?} {:?}, expected {:?} {:?}",
            gpu.dims(),
            gpu.dtype(),
            cpu.dims(),
            cpu.dtype()
        )
    }
    let vec = |t: &Tensor| -> Result<Vec<f32>> {
        t.to_device(&Device::Cpu)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()
    };
    let (g, c) = (vec(gpu)?, vec(cpu)?);
    let scale = c
        .iter()
        .filter(|x| x.is_finite())
        .fold(0f32, |m, x| m.max(x.abs()));
    for (i, (&g, &c)) in g.iter().zip(&c).enumerate() {
        let ok = if c.is_nan() {
            g.is_nan()
        } else if c.is_infinite() {
            g == c
        } else {
            (g - c).abs() <= rel * c.abs() + 1e-4 * scale
        };
        if !ok {
            candle::bail!("{what}: element {i} is {g} on the GPU, {c} on the CPU")
        }
    }
    Ok(())
}

/// The tolerance of one rounding to `dtype`, relative.
fn ulp(dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => 1.0 / 128.0,
        DType::F16 => 1.0 / 1024.0,
        _ => 1e-5,
    }
}

/// How [`device_parts`] lays the parts out on the device.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Layout {
    Contiguous,
    /// Part 1 with strided rows and a transposed lse, part 2 with a strided head_dim (copied
    /// before the launch): the kernel's vector loads still apply.
    Strided,
    /// Those, and part 0 cut at an offset from a wider output: rows a multiple of no vector,
    /// so the launch reads element by element.
    Misaligned,
}

/// The parts on the device in `dtype`, laid out as `layout` says.
fn device_parts(
    parts: &[(Tensor, Tensor)],
    dtype: DType,
    dev: &Device,
    layout: Layout,
) -> Result<Vec<(Tensor, Tensor)>> {
    parts
        .iter()
        .enumerate()
        .map(|(i, (o, l))| {
            let o = o.to_dtype(dtype)?.to_device(dev)?;
            let l = l.to_device(dev)?;
            let (b, s, h, d) = o.dims4()?;
            Ok(match (i, layout) {
                (_, Layout::Contiguous) => (o, l),
                (0, Layout::Misaligned) => {
                    let wide = Tensor::cat(&[&Tensor::zeros((b, s, h, 1), dtype, dev)?, &o], 3)?;
                    (wide.narrow(3, 1, d)?, l)
                }
                (1, _) => (
                    o.transpose(1, 2)?.contiguous()?.transpose(1, 2)?,
                    l.transpose(1, 2)?.contiguous()?.transpose(1, 2)?,
                ),
                (2, _) if d > 1 => (o.transpose(2, 3)?.contiguous()?.transpose(2, 3)?, l),
                _ => (o, l),
            })
        })
        .collect()
}

/// `(batch, seqlen_q, num_heads, head_dim)`.
type Shape4 = (usize, usize, usize, usize);

/// The kernel against the CPU's ops over dtypes, part counts and layouts.
pub(crate) fn kernel_vs_ops(dev: &Device) -> Result<()> {
    use Layout::{Contiguous, Misaligned, Strided};
    let cases: &[(usize, Shape4, Layout)] = &[
        (1, (2, 7, 3, 64), Misaligned),
        (2, (2, 7, 3, 64), Contiguous),
        (5, (2, 7, 3, 64), Contiguous),
        (5, (2, 7, 3, 64), Strided),
        (5, (1, 9, 4, 40), Misaligned),
        (5, (3, 2, 2, 3), Strided),
        (17, (2, 5, 3, 32), Contiguous),
        (17, (2, 5, 3, 32), Misaligned),
        (300, (1, 3, 2, 8), Contiguous),
    ];
    for &(n, shape, layout) in cases {
        let parts = cpu_parts(n, shape)?;
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            let what = format!("combine kernel {n} parts {shape:?} {layout:?} {dtype:?}");
            // The CPU merges the parts as the device holds them (rounded to dtype).
            let rounded = parts
                .iter()
                .map(|(o, l)| Ok((o.to_dtype(dtype)?, l.clone())))
                .collect::<Result<Vec<_>>>()?;
            let (o_cpu, l_cpu) = combine(&rounded)?;
            let (o_gpu, l_gpu) = combine(&device_parts(&parts, dtype, dev, layout)?)?;
            if !o_gpu.device().same_device(dev) || !l_gpu.device().same_device(dev) {
                candle::bail!("{what}: the result left the device")
            }
            same(&format!("{what}: out"), &o_gpu, &o_cpu, ulp(dtype))?;
            same(&format!("{what}: lse"), &l_gpu, &l_cpu, 2e-5)?;
        }
    }
    Ok(())
}

/// A part in a training graph takes Candle's ops: the merged output equals the kernel's and
/// the gradient reaches the part (`d out / d o_i = exp(lse_i - lse)`, summed over head_dim
/// by the loss `sum(out)`).
pub(crate) fn gradient_takes_the_ops(dev: &Device) -> Result<()> {
    let shape = (2, 3, 2, 16);
    let parts = cpu_parts(2, shape)?
        .into_iter()
        .map(|(o, l)| Ok((o.to_device(dev)?, l.to_device(dev)?)))
        .collect::<Result<Vec<_>>>()?;
    // No NaN here: the gradient is compared.
    let parts: Vec<(Tensor, Tensor)> = parts
        .iter()
        .map(|(o, l)| {
            let clean = |t: &Tensor| -> Result<Tensor> {
                let nan = t.ne(t)?;
                nan.where_cond(&t.zeros_like()?, t)
            };
            Ok((clean(o)?, clean(l)?))
        })
        .collect::<Result<Vec<_>>>()?;
    let (kernel_out, lse) = combine(&parts)?;
    let var = Var::from_tensor(&parts[0].0)?;
    let (ops_out, _) = combine(&[
        (var.as_tensor().clone(), parts[0].1.clone()),
        parts[1].clone(),
    ])?;
    same("combine with a gradient: out", &ops_out, &kernel_out, 1e-5)?;
    let grads = ops_out.sum_all()?.backward()?;
    let Some(g) = grads.get(&var) else {
        candle::bail!("combine with a gradient: no gradient reached the part")
    };
    // exp(lse_0 - lse) broadcast over head_dim; 0 where the merged lse is -inf.
    let w = (parts[0].1.clone() - &lse)?.exp()?;
    let finite = lse.ne(f64::NEG_INFINITY)?;
    let w = finite.where_cond(&w, &w.zeros_like()?)?;
    let want = w
        .transpose(1, 2)?
        .unsqueeze(3)?
        .broadcast_as(g.dims())?
        .contiguous()?;
    same("combine with a gradient: d o_0", g, &want, 1e-5)
}

/// `flash_attn_with_kvcache_cascade` on the GPU, bf16: a batch of 64 over an 8192-token prefix
/// (its keys split in chunks to fill the GPU) and of 3 over a 1000-token one (not split), each
/// sequence with its own cache: within the output rule of the same attention over each
/// sequence's whole cache (prefix then own tokens) computed by the decode kernel in bf16, both
/// measured against f32 math on the CPU.
pub fn cascade_call(dev: &Device) -> Result<()> {
    use candle_flash::{flash_attn_with_kvcache, flash_attn_with_kvcache_cascade, FlashAttn};
    for (b, prefix, h, hk, d) in [
        (64usize, 8192usize, 32usize, 8usize, 128usize),
        (3, 1000, 8, 2, 64),
    ] {
        let cpu = Device::Cpu;
        let lens: Vec<u32> = (0..b).map(|i| (i * 37 % 150) as u32).collect();
        let cap = 160;
        let r = |shape: &[usize]| Tensor::randn(0f32, 1.0, shape, &cpu);
        let (q, pk, pv) = (
            r(&[b, 1, h, d])?,
            r(&[prefix, hk, d])?,
            r(&[prefix, hk, d])?,
        );
        let (ok, ov) = (r(&[b, cap, hk, d])?, r(&[b, cap, hk, d])?);
        let full = |p: &Tensor, o: &Tensor| -> Result<Tensor> {
            Tensor::cat(&[&p.unsqueeze(0)?.broadcast_as((b, prefix, hk, d))?, o], 1)
        };
        let (fk, fv) = (full(&pk, &ok)?, full(&pv, &ov)?);
        let full_lens: Vec<u32> = lens.iter().map(|&l| l + prefix as u32).collect();
        let opts = FlashAttn::new();
        let exact = flash_attn_with_kvcache(&q, &fk, &fv, None, &full_lens, &opts)?;
        let g = |t: &Tensor| t.to_dtype(DType::BF16)?.to_device(dev);
        let ours = flash_attn_with_kvcache_cascade(
            &g(&q)?,
            &g(&pk)?,
            &g(&pv)?,
            &g(&ok)?,
            &g(&ov)?,
            None,
            &lens,
            &opts,
        )?;
        let base = flash_attn_with_kvcache(&g(&q)?, &g(&fk)?, &g(&fv)?, None, &full_lens, &opts)?;
        let err = |t: &Tensor| -> Result<f32> {
            (t.to_device(&cpu)?.to_dtype(DType::F32)? - &exact)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()
        };
        let (e_ours, e_base) = (err(&ours)?, err(&base)?);
        let scale = exact.abs()?.max_all()?.to_scalar::<f32>()?;
        if e_ours.is_nan() || e_ours > 2.0 * e_base + 1e-5 * scale {
            candle::bail!("cascade b={b} prefix={prefix}: error {e_ours:e} > 2 x the whole-cache decode's {e_base:e}")
        }
    }
    Ok(())
}
