//! FP8 (e4m3) KV caches on the CPU: the append writes exactly `e4m3(x / scale[head])`
//! (compared bit for bit with float8's rounding, contiguous and paged, GQA, host and tensor
//! lengths, ragged, rotary); decoding over an FP8 cache equals `attention_slow` over the
//! dequantized cache; `KvCache` and `PagedKvCache` with scales over generation steps;
//! cascade attention over FP8 own caches; the errors; and the quantization helpers.

mod common;

use candle::{DType, Device, IndexOp, Result, Tensor};
use candle_flash::quant::{dequantize_fp8, fp8_scales, quantize_fp8, Fp8Scaling};
use candle_flash::{
    attention_slow, flash_attn_with_kvcache, flash_attn_with_kvcache_cascade,
    flash_attn_with_kvcache_ragged, flash_attn_with_paged_kvcache, FlashAttn, KvCache,
    PagedKvCache,
};
use common::{assert_close, assert_fails, assert_within_rounding, max_abs_diff, randn};
use float8::F8E4M3;
use rand::{rngs::StdRng, seq::SliceRandom, SeedableRng};

const CPU: Device = Device::Cpu;
/// f32 queries: the op and the oracle do f32 math over the same dequantized values, in a
/// different order.
const F32_TOL: f32 = 1e-5;

/// The bytes of an F8E4M3 tensor.
fn bits(t: &Tensor) -> Result<Vec<u8>> {
    let v = t.flatten_all()?.to_vec1::<F8E4M3>()?;
    Ok(v.into_iter().map(|x| x.to_bits()).collect())
}

fn to_f32_vec(t: &Tensor) -> Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()
}

/// Random e4m3 contents (standard normal, rounded).
fn fp8_randn(shape: &[usize]) -> Result<Tensor> {
    randn(shape, DType::F32)?.to_dtype(DType::F8E4M3)
}

/// Per-head scales, different per head: `(hk,)` F32.
fn scales(hk: usize, base: f32) -> Result<Tensor> {
    let v: Vec<f32> = (0..hk).map(|h| base * (1.0 + 0.37 * h as f32)).collect();
    Tensor::from_vec(v, hk, &CPU)
}

/// A cache `(b, cap, hk, d)` as it is, or scattered over shuffled pages of `page_size` with
/// spare pages; the block table maps sequence `b`'s page `p` to `table[b * max_pages + p]`.
struct Layout {
    page_size: Option<usize>,
    table: Vec<u32>,
    max_pages: usize,
    num_pages: usize,
}

impl Layout {
    fn contiguous() -> Self {
        Self {
            page_size: None,
            table: vec![],
            max_pages: 0,
            num_pages: 0,
        }
    }

    fn paged(b: usize, cap: usize, page_size: usize, rng: &mut StdRng) -> Self {
        let max_pages = cap / page_size;
        let num_pages = b * max_pages + 3;
        let mut pages: Vec<u32> = (0..num_pages as u32).collect();
        pages.shuffle(rng);
        pages.truncate(b * max_pages);
        Self {
            page_size: Some(page_size),
            table: pages,
            max_pages,
            num_pages,
        }
    }

    /// The storage row of token `j` of sequence `b` (`cap` rows per sequence if contiguous).
    fn row(&self, b: usize, j: usize, cap: usize) -> usize {
        match self.page_size {
            None => b * cap + j,
            Some(ps) => self.table[b * self.max_pages + j / ps] as usize * ps + j % ps,
        }
    }

    /// Fresh random FP8 storage: `(b, cap, hk, d)` or `(num_pages, ps, hk, d)`.
    fn storage(&self, b: usize, cap: usize, hk: usize, d: usize) -> Result<Tensor> {
        match self.page_size {
            None => fp8_randn(&[b, cap, hk, d]),
            Some(ps) => fp8_randn(&[self.num_pages, ps, hk, d]),
        }
    }

    /// The storage read back as `(b, cap, hk, d)`.
    fn gather(&self, storage: &Tensor, b: usize) -> Result<Tensor> {
        if self.page_size.is_none() {
            return Ok(storage.clone());
        }
        let seqs = (0..b)
            .map(|s| {
                let pages = self.table[s * self.max_pages..][..self.max_pages]
                    .iter()
                    .map(|&p| storage.i(p as usize))
                    .collect::<Result<Vec<_>>>()?;
                Tensor::cat(&pages, 0)
            })
            .collect::<Result<Vec<_>>>()?;
        Tensor::stack(&seqs, 0)
    }

    /// One decoding call over this layout.
    #[allow(clippy::too_many_arguments)]
    fn call(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        new_kv: Option<(&Tensor, &Tensor)>,
        lens: &[u32],
        device_lens: bool,
        opts: &FlashAttn,
    ) -> Result<Tensor> {
        let lens_t = Tensor::new(lens, &CPU)?;
        match (self.page_size, device_lens) {
            (None, false) => flash_attn_with_kvcache(q, k, v, new_kv, lens, opts),
            (None, true) => flash_attn_with_kvcache(q, k, v, new_kv, &lens_t, opts),
            (Some(_), false) => flash_attn_with_paged_kvcache(
                q,
                k,
                v,
                new_kv,
                lens,
                &self.table,
                self.max_pages,
                opts,
            ),
            (Some(_), true) => {
                let table =
                    Tensor::from_vec(self.table.clone(), (lens.len(), self.max_pages), &CPU)?;
                flash_attn_with_paged_kvcache(
                    q,
                    k,
                    v,
                    new_kv,
                    &lens_t,
                    &table,
                    self.max_pages,
                    opts,
                )
            }
        }
    }
}

/// The storage bytes `before` with the new rows `new` `(b, s_new, hk, d)` written as
/// `e4m3(x / scale[head])` at tokens `lens[b] + i` (`n_new[b]` rows of sequence `b`).
#[allow(clippy::too_many_arguments)]
fn expected_bytes(
    before: &[u8],
    new: &Tensor,
    scale: &Tensor,
    lens: &[u32],
    n_new: &[usize],
    layout: &Layout,
    cap: usize,
) -> Result<Vec<u8>> {
    let (_, s_new, hk, d) = new.dims4()?;
    let x = to_f32_vec(new)?;
    let scale = scale.to_vec1::<f32>()?;
    let mut out = before.to_vec();
    for (b, (&len, &n)) in lens.iter().zip(n_new).enumerate() {
        for i in 0..n {
            let row = layout.row(b, len as usize + i, cap);
            for h in 0..hk {
                for e in 0..d {
                    let xv = x[((b * s_new + i) * hk + h) * d + e];
                    out[(row * hk + h) * d + e] = F8E4M3::from_f32(xv / scale[h]).to_bits();
                }
            }
        }
    }
    Ok(out)
}

/// `x` with values e4m3 must saturate, flush, or keep as NaN planted in row 0 of
/// sequence 0, head 0.
fn plant_specials(x: &Tensor) -> Result<Tensor> {
    let mut v = to_f32_vec(x)?;
    let specials = [1e6, -1e6, 1e-9, -3e-4, f32::NAN, f32::INFINITY, 0.0, -0.0];
    v[..specials.len()].copy_from_slice(&specials);
    Tensor::from_vec(v, x.shape(), &CPU)
}

/// The append writes `e4m3(x / scale)` bit for bit and nothing else: contiguous and paged,
/// GQA, f32/f16/bf16 new rows, host and tensor lengths (saturation, NaN and tiny values
/// planted in the f32 rows).
#[test]
fn append_writes_the_rounded_quotient() -> Result<()> {
    let mut rng = StdRng::seed_from_u64(1);
    let (b, h, hk, d, cap, s_new) = (3, 8, 2, 16, 16, 3);
    let lens = [0u32, 5, 13];
    for paged in [false, true] {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for device_lens in [false, true] {
                let layout = match paged {
                    false => Layout::contiguous(),
                    true => Layout::paged(b, cap, 4, &mut rng),
                };
                let (k, v) = (
                    layout.storage(b, cap, hk, d)?,
                    layout.storage(b, cap, hk, d)?,
                );
                let (k0, v0) = (bits(&k)?, bits(&v)?);
                let q = randn((b, 1, h, d), dtype)?;
                let mut k_new = randn((b, s_new, hk, d), dtype)?;
                if dtype == DType::F32 {
                    k_new = plant_specials(&k_new)?;
                }
                let v_new = (randn((b, s_new, hk, d), dtype)? * 3.0)?;
                let (ks, vs) = (scales(hk, 0.01)?, scales(hk, 0.02)?);
                let opts = FlashAttn::new().causal(true).kv_cache_scales(&ks, &vs);
                let what = format!("paged {paged} {dtype:?} device lens {device_lens}");
                layout.call(
                    &q,
                    &k,
                    &v,
                    Some((&k_new, &v_new)),
                    &lens,
                    device_lens,
                    &opts,
                )?;
                let n = [s_new; 3];
                let want_k = expected_bytes(&k0, &k_new, &ks, &lens, &n, &layout, cap)?;
                let want_v = expected_bytes(&v0, &v_new, &vs, &lens, &n, &layout, cap)?;
                assert_eq!(bits(&k)?, want_k, "k cache: {what}");
                assert_eq!(bits(&v)?, want_v, "v cache: {what}");
            }
        }
    }
    // The planted values themselves: saturated, NaN kept, tiny ones rounded to 0 or a
    // subnormal.
    let x = [1e6f32, -1e6, f32::NAN, f32::INFINITY, 1e-9];
    let y: Vec<u8> = x.iter().map(|&x| F8E4M3::from_f32(x).to_bits()).collect();
    assert_eq!(y, [0x7e, 0xfe, 0x7f, 0x7e, 0x00]);
    Ok(())
}

/// Ragged appends write only each sequence's real rows.
#[test]
fn ragged_append_writes_only_real_rows() -> Result<()> {
    let (b, h, hk, d, cap, s) = (3, 4, 2, 16, 12, 3);
    let lens = [2u32, 0, 7];
    let q_lens = [3u32, 1, 0];
    let layout = Layout::contiguous();
    let (k, v) = (
        layout.storage(b, cap, hk, d)?,
        layout.storage(b, cap, hk, d)?,
    );
    let (k0, v0) = (bits(&k)?, bits(&v)?);
    let q = randn((b, s, h, d), DType::F32)?;
    let (k_new, v_new) = (
        randn((b, s, hk, d), DType::F32)?,
        randn((b, s, hk, d), DType::F32)?,
    );
    let (ks, vs) = (scales(hk, 0.05)?, scales(hk, 0.03)?);
    let opts = FlashAttn::new().causal(true).kv_cache_scales(&ks, &vs);
    let new_kv = Some((&k_new, &v_new));
    flash_attn_with_kvcache_ragged(&q, &k, &v, new_kv, &lens, &q_lens, &opts)?;
    let n = q_lens.map(|n| n as usize);
    assert_eq!(
        bits(&k)?,
        expected_bytes(&k0, &k_new, &ks, &lens, &n, &layout, cap)?
    );
    assert_eq!(
        bits(&v)?,
        expected_bytes(&v0, &v_new, &vs, &lens, &n, &layout, cap)?
    );
    Ok(())
}

/// With rotary embedding the rotated keys (in q's dtype, as a cache of q's dtype stores
/// them) are what gets quantized.
#[test]
fn rotary_keys_are_rotated_then_quantized() -> Result<()> {
    let (b, h, hk, d, cap) = (2, 4, 2, 32, 16);
    let lens = [3u32, 9];
    let (cos, sin) = {
        let ang = Tensor::arange(0f32, (cap * 8) as f32, &CPU)?.reshape((cap, 8))?;
        let ang = (ang * 0.1)?;
        (ang.cos()?, ang.sin()?)
    };
    for dtype in [DType::F32, DType::BF16] {
        let q = randn((b, 1, h, d), dtype)?;
        let (k_new, v_new) = (randn((b, 1, hk, d), dtype)?, randn((b, 1, hk, d), dtype)?);
        let rot = FlashAttn::new().causal(true).rotary(&cos, &sin, false);
        // The reference: a cache in q's dtype receives the rotated rows.
        let plain = Tensor::zeros((b, cap, hk, d), dtype, &CPU)?;
        let plain_v = plain.zeros_like()?;
        flash_attn_with_kvcache(&q, &plain, &plain_v, Some((&k_new, &v_new)), &lens, &rot)?;
        let rotated = Tensor::cat(
            &(0..b)
                .map(|s| plain.i(s)?.narrow(0, lens[s] as usize, 1)?.unsqueeze(0))
                .collect::<Result<Vec<_>>>()?,
            0,
        )?;
        let (ks, vs) = (scales(hk, 0.01)?, scales(hk, 0.01)?);
        let k = fp8_randn(&[b, cap, hk, d])?;
        let v = fp8_randn(&[b, cap, hk, d])?;
        let k0 = bits(&k)?;
        let opts = rot.clone().kv_cache_scales(&ks, &vs);
        flash_attn_with_kvcache(&q, &k, &v, Some((&k_new, &v_new)), &lens, &opts)?;
        let layout = Layout::contiguous();
        let want = expected_bytes(&k0, &rotated, &ks, &lens, &[1, 1], &layout, cap)?;
        assert_eq!(bits(&k)?, want, "{dtype:?}");
    }
    Ok(())
}

/// `cache` `(b, cap, hk, d)` F8E4M3 as real values: each byte as f32 times its head's
/// scale (the oracle's own dequantization, not the crate's).
fn dequantized(cache: &Tensor, scale: &Tensor) -> Result<Tensor> {
    let hk = scale.dim(0)?;
    cache
        .to_dtype(DType::F32)?
        .broadcast_mul(&scale.reshape((1, 1, hk, 1))?)
}

/// `attention_slow` of each sequence over its first `lens[b]` tokens of the dequantized
/// caches `(b, cap, hk, d)`.
fn oracle(q: &Tensor, k: &Tensor, v: &Tensor, lens: &[usize], causal: bool) -> Result<Tensor> {
    let scale = 1.0 / (q.dim(3)? as f32).sqrt();
    let q = q.to_dtype(DType::F32)?;
    let outs = lens
        .iter()
        .enumerate()
        .map(|(b, &len)| {
            let prefix = |c: &Tensor| c.narrow(0, b, 1)?.narrow(1, 0, len);
            attention_slow(&q.narrow(0, b, 1)?, &prefix(k)?, &prefix(v)?, scale, causal)
        })
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&outs, 0)
}

/// Decoding over FP8 caches equals the oracle over the dequantized caches (after the
/// append): contiguous and paged, GQA, causal or not, with and without new tokens; f32
/// queries tightly, bf16 ones within a rounding of the output.
#[test]
fn decode_equals_attention_over_the_dequantized_cache() -> Result<()> {
    let mut rng = StdRng::seed_from_u64(2);
    let (b, hk, d, cap) = (3, 2, 32, 48);
    let lens = [1u32, 7, 40];
    for paged in [false, true] {
        for (h, s_q, causal, s_new) in [
            (8, 1, true, 1),
            (8, 4, true, 4),
            (2, 4, false, 0),
            (4, 1, false, 1),
        ] {
            for dtype in [DType::F32, DType::BF16] {
                let layout = match paged {
                    false => Layout::contiguous(),
                    true => Layout::paged(b, cap, 16, &mut rng),
                };
                let (k, v) = (
                    layout.storage(b, cap, hk, d)?,
                    layout.storage(b, cap, hk, d)?,
                );
                let q = randn((b, s_q, h, d), dtype)?;
                let new = (
                    randn((b, s_new, hk, d), dtype)?,
                    randn((b, s_new, hk, d), dtype)?,
                );
                let new_kv = (s_new > 0).then_some((&new.0, &new.1));
                let (ks, vs) = (scales(hk, 0.004)?, scales(hk, 0.006)?);
                let opts = FlashAttn::new().causal(causal).kv_cache_scales(&ks, &vs);
                let out = layout.call(&q, &k, &v, new_kv, &lens, false, &opts)?;
                let final_lens: Vec<usize> = lens.iter().map(|&l| l as usize + s_new).collect();
                let (kd, vd) = (
                    dequantized(&layout.gather(&k, b)?, &ks)?,
                    dequantized(&layout.gather(&v, b)?, &vs)?,
                );
                let want = oracle(&q, &kd, &vd, &final_lens, causal)?;
                let what = format!("paged {paged} h {h} s_q {s_q} causal {causal} {dtype:?}");
                match dtype {
                    DType::F32 => assert_close(&what, &out, &want, F32_TOL)?,
                    _ => assert_within_rounding(&what, &out, &want, 1.0)?,
                }
            }
        }
    }
    Ok(())
}

/// Cascade attention over FP8 own caches: the prefix (in q's dtype) and each sequence's
/// dequantized own tokens, attended as one.
#[test]
fn cascade_over_fp8_own_caches() -> Result<()> {
    let (b, h, hk, d, cap, plen) = (2, 4, 2, 32, 16, 9);
    let lens = [3u32, 6];
    for causal in [false, true] {
        let (pk, pv) = (
            randn((plen, hk, d), DType::F32)?,
            randn((plen, hk, d), DType::F32)?,
        );
        let (k, v) = (fp8_randn(&[b, cap, hk, d])?, fp8_randn(&[b, cap, hk, d])?);
        let q = randn((b, 1, h, d), DType::F32)?;
        let (k_new, v_new) = (
            randn((b, 1, hk, d), DType::F32)?,
            randn((b, 1, hk, d), DType::F32)?,
        );
        let (ks, vs) = (scales(hk, 0.01)?, scales(hk, 0.01)?);
        let opts = FlashAttn::new().causal(causal).kv_cache_scales(&ks, &vs);
        let new_kv = Some((&k_new, &v_new));
        let out = flash_attn_with_kvcache_cascade(&q, &pk, &pv, &k, &v, new_kv, &lens, &opts)?;
        let (kd, vd) = (dequantized(&k, &ks)?, dequantized(&v, &vs)?);
        let scale = 1.0 / (d as f32).sqrt();
        let want = (0..b)
            .map(|s| {
                let own = |c: &Tensor| c.narrow(0, s, 1)?.narrow(1, 0, lens[s] as usize + 1);
                let full = |p: &Tensor, c: &Tensor| Tensor::cat(&[p.unsqueeze(0)?, own(c)?], 1);
                let q = q.narrow(0, s, 1)?;
                attention_slow(&q, &full(&pk, &kd)?, &full(&pv, &vd)?, scale, causal)
            })
            .collect::<Result<Vec<_>>>()?;
        assert_close("cascade", &out, &Tensor::cat(&want, 0)?, F32_TOL)?;
    }
    Ok(())
}

/// Every argument error names its argument and leaves the caches untouched.
#[test]
fn errors_name_the_argument_and_write_nothing() -> Result<()> {
    let (b, h, hk, d, cap) = (2, 4, 2, 16, 8);
    let q = randn((b, 1, h, d), DType::F32)?;
    let (k_new, v_new) = (
        randn((b, 1, hk, d), DType::F32)?,
        randn((b, 1, hk, d), DType::F32)?,
    );
    let new_kv = Some((&k_new, &v_new));
    let (k8, v8) = (fp8_randn(&[b, cap, hk, d])?, fp8_randn(&[b, cap, hk, d])?);
    let before = (bits(&k8)?, bits(&v8)?);
    let lens = [1u32, 2];
    let good = scales(hk, 0.01)?;
    let call = |k: &Tensor, v: &Tensor, opts: &FlashAttn| {
        flash_attn_with_kvcache(&q, k, v, new_kv, &lens, opts).map(|_| ())
    };
    let with = |ks: &Tensor, vs: &Tensor| FlashAttn::new().kv_cache_scales(ks, vs);
    assert_fails(
        call(&k8, &v8, &FlashAttn::new()),
        &["kv_cache_scales", "F8E4M3"],
    );
    assert_fails(
        call(&k8, &v8, &with(&scales(hk + 1, 0.01)?, &good)),
        &["kv_cache_scales: k", "shape (2,)", "[3]"],
    );
    assert_fails(
        call(
            &k8,
            &v8,
            &with(&good, &scales(hk, 0.01)?.to_dtype(DType::F16)?),
        ),
        &["kv_cache_scales: v", "dtype F32", "F16"],
    );
    assert_fails(
        call(&k8, &v8, &with(&good, &scales(1, 0.01)?.reshape((1, 1))?)),
        &["kv_cache_scales: v", "shape"],
    );
    let (kb, vb) = (
        randn((b, cap, hk, d), DType::F32)?,
        randn((b, cap, hk, d), DType::F32)?,
    );
    assert_fails(
        call(&kb, &vb, &with(&good, &good)),
        &["kv_cache_scales", "F8E4M3 caches"],
    );
    assert_fails(
        call(&k8, &vb, &with(&good, &good)),
        &["v_cache", "differs from k_cache's F8E4M3"],
    );
    assert_fails(
        call(&kb, &v8, &with(&good, &good)),
        &["v_cache", "F8E4M3 differs from k_cache's"],
    );
    assert_eq!((bits(&k8)?, bits(&v8)?), before, "a failed call wrote");
    // The plain attention entry points refuse the option, as they refuse rotary.
    let (k, v) = (
        randn((b, 3, hk, d), DType::F32)?,
        randn((b, 3, hk, d), DType::F32)?,
    );
    assert_fails(with(&good, &good).forward(&q, &k, &v), &["kv_cache_scales"]);
    Ok(())
}

/// Scales from the first tokens' keys and values, one per head, with a headroom of 2 so that
/// later (larger) tokens do not saturate.
fn sample_scales(k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
    Ok((
        (fp8_scales(k, Fp8Scaling::PerHead)? * 2.0)?,
        (fp8_scales(v, Fp8Scaling::PerHead)? * 2.0)?,
    ))
}

/// `KvCache` and `PagedKvCache` in FP8 over a prompt and decoding steps: each output equals
/// the oracle over the cache's dequantized contents, the two caches agree exactly, and both
/// stay close to an f32 cache (within what e4m3's 3 mantissa bits explain).
#[test]
fn fp8_cache_types_over_generation_steps() -> Result<()> {
    let (b, h, hk, d) = (2, 4, 2, 32);
    let prompt = (
        randn((b, 10, hk, d), DType::F32)?,
        randn((b, 10, hk, d), DType::F32)?,
    );
    let (ks, vs) = sample_scales(&prompt.0, &prompt.1)?;
    let mut flat =
        KvCache::new(b, 32, hk, d, DType::F8E4M3, &CPU)?.with_scales(ks.clone(), vs.clone())?;
    let mut paged = PagedKvCache::new(b, 9, 4, 8, hk, d, DType::F8E4M3, &CPU)?
        .with_scales(ks.clone(), vs.clone())?;
    let mut exact = KvCache::new(b, 32, hk, d, DType::F32, &CPU)?;
    assert_eq!(
        flat.scales().unwrap().0.to_vec1::<f32>()?,
        ks.to_vec1::<f32>()?
    );
    assert!(exact.scales().is_none());
    let opts = FlashAttn::new().causal(true);
    let (mut worst, mut v_max) = (0f32, 0f32);
    for (step, s) in [10usize, 1, 1, 3].into_iter().enumerate() {
        let q = randn((b, s, h, d), DType::F32)?;
        let (k, v) = match step {
            0 => prompt.clone(),
            _ => (
                randn((b, s, hk, d), DType::F32)?,
                randn((b, s, hk, d), DType::F32)?,
            ),
        };
        let out = flat.append_and_attend(&q, &k, &v, &opts)?;
        let out_p = paged.append_and_attend(&q, &k, &v, &opts)?;
        let out_x = exact.append_and_attend(&q, &k, &v, &opts)?;
        let lens: Vec<usize> = flat.lengths().iter().map(|&l| l as usize).collect();
        let want = oracle(
            &q,
            &dequantized(flat.k(), &ks)?,
            &dequantized(flat.v(), &vs)?,
            &lens,
            true,
        )?;
        assert_close(&format!("step {step}"), &out, &want, F32_TOL)?;
        assert_close(&format!("paged step {step}"), &out_p, &out, 0.0)?;
        worst = worst.max(max_abs_diff(&out, &out_x)?);
        v_max = v_max.max(common::max_abs(&v)?);
    }
    // Each K/V element moves by at most 2^-4 of itself. An output is an average of V rows:
    // their rounding moves it by at most max |v| / 16, the scores' shift (a few hundredths
    // here) by about as much again at most. Measured: up to 0.05 max |v| over repeated runs.
    println!("FP8 vs f32 cache: max output difference {worst} (max |v| {v_max})");
    assert!(
        worst <= v_max / 8.0,
        "FP8 vs f32 cache: max difference {worst} > max |v| / 8 = {}",
        v_max / 8.0
    );
    Ok(())
}

/// The cache types' own errors: scales on a non-FP8 cache, bad scales, an FP8 cache without
/// scales, scales passed in the options too; none changes the cache.
#[test]
fn fp8_cache_type_errors() -> Result<()> {
    let (b, h, hk, d) = (2, 4, 2, 16);
    let good = scales(hk, 0.01)?;
    let bf = KvCache::new(b, 8, hk, d, DType::BF16, &CPU)?;
    assert_fails(
        bf.with_scales(good.clone(), good.clone()),
        &["KvCache::with_scales", "BF16"],
    );
    let fp8 = || KvCache::new(b, 8, hk, d, DType::F8E4M3, &CPU);
    assert_fails(
        fp8()?.with_scales(scales(3, 0.1)?, good.clone()),
        &["k_scale", "shape (2,)"],
    );
    assert_fails(
        fp8()?.with_scales(good.clone(), good.to_dtype(DType::BF16)?),
        &["v_scale", "dtype F32"],
    );
    let pfp8 = PagedKvCache::new(b, 4, 4, 2, hk, d, DType::F8E4M3, &CPU)?;
    assert_fails(
        pfp8.with_scales(good.clone(), scales(1, 0.1)?),
        &["v_scale", "shape"],
    );
    let q = randn((b, 1, h, d), DType::F32)?;
    let kv = randn((b, 1, hk, d), DType::F32)?;
    let mut bare = fp8()?;
    assert_fails(
        bare.append_and_attend(&q, &kv, &kv, &FlashAttn::new()),
        &["kv_cache_scales", "KvCache::with_scales"],
    );
    let mut bare_paged = PagedKvCache::new(b, 4, 4, 2, hk, d, DType::F8E4M3, &CPU)?;
    assert_fails(
        bare_paged.append_and_attend(&q, &kv, &kv, &FlashAttn::new()),
        &["kv_cache_scales", "PagedKvCache::with_scales"],
    );
    assert_eq!(bare_paged.free_pages(), 4);
    let packed = randn((3, hk, d), DType::F32)?;
    assert_fails(
        bare.append_varlen(&packed, &packed, &[2, 1]),
        &["KvCache", "with_scales"],
    );
    let mut scaled = fp8()?.with_scales(good.clone(), good.clone())?;
    let both = FlashAttn::new().kv_cache_scales(&good, &good);
    let before = bits(scaled.k())?;
    assert_fails(
        scaled.append_and_attend(&q, &kv, &kv, &both),
        &["kv_cache_scales", "keeps its scales"],
    );
    assert_eq!(bits(scaled.k())?, before);
    assert_eq!(scaled.lengths(), &[0, 0]);
    for c in [&bare, &scaled] {
        assert_eq!(c.lengths(), &[0, 0]);
    }
    // Rows in a dtype no call takes for q.
    assert_fails(
        scaled.append_varlen(&packed.to_dtype(DType::F64)?, &packed, &[2, 1]),
        &["k_new: dtype", "F64"],
    );
    Ok(())
}

/// A ragged (varlen) append into an FP8 cache stores the bytes the decoding append would,
/// contiguous and paged.
#[test]
fn append_varlen_quantizes_like_the_append() -> Result<()> {
    let (b, hk, d) = (2, 2, 16);
    let (ks, vs) = (scales(hk, 0.01)?, scales(hk, 0.02)?);
    let (k, v) = (
        randn((7, hk, d), DType::BF16)?,
        randn((7, hk, d), DType::BF16)?,
    );
    let mut flat =
        KvCache::new(b, 8, hk, d, DType::F8E4M3, &CPU)?.with_scales(ks.clone(), vs.clone())?;
    let mut paged = PagedKvCache::new(b, 6, 4, 2, hk, d, DType::F8E4M3, &CPU)?
        .with_scales(ks.clone(), vs.clone())?;
    flat.append_varlen(&k, &v, &[5, 2])?;
    paged.append_varlen(&k, &v, &[5, 2])?;
    let expect = |x: &Tensor, scale: &Tensor, rows: std::ops::Range<usize>| -> Result<Vec<u8>> {
        let x = to_f32_vec(&x.narrow(0, rows.start, rows.len())?)?;
        let s = scale.to_vec1::<f32>()?;
        Ok(x.iter()
            .enumerate()
            .map(|(i, &x)| F8E4M3::from_f32(x / s[(i / d) % hk]).to_bits())
            .collect())
    };
    for (cache, x, s) in [(flat.k(), &k, &ks), (flat.v(), &v, &vs)] {
        assert_eq!(bits(&cache.i((0, 0..5))?)?, expect(x, s, 0..5)?);
        assert_eq!(bits(&cache.i((1, 0..2))?)?, expect(x, s, 5..7)?);
    }
    // The paged pool hands out pages 0, 1 to sequence 0 and 2 to sequence 1.
    let rows = |p: &Tensor, page: usize, n: usize| bits(&p.i(page)?.narrow(0, 0, n)?);
    assert_eq!(rows(paged.k(), 0, 4)?, expect(&k, &ks, 0..4)?);
    assert_eq!(rows(paged.k(), 1, 1)?, expect(&k, &ks, 4..5)?);
    assert_eq!(rows(paged.v(), 2, 2)?, expect(&v, &vs, 5..7)?);
    // Then decoding over it matches the contiguous cache.
    let q = randn((b, 1, 4, d), DType::BF16)?;
    let kv = randn((b, 1, hk, d), DType::BF16)?;
    let opts = FlashAttn::new().causal(true);
    let out = flat.append_and_attend(&q, &kv, &kv, &opts)?;
    let out_p = paged.append_and_attend(&q, &kv, &kv, &opts)?;
    assert_close("paged after varlen", &out_p, &out, 0.0)?;
    Ok(())
}

/// `|deq - x| <= max(2^-4 |x|, 2^-10 scale)` (e4m3: 3 mantissa bits for normals, a spacing
/// of 2^-9 among subnormals), plus f32 rounding of the division and the product.
fn assert_round_trip(what: &str, x: &Tensor, scaling: Fp8Scaling) -> Result<()> {
    let s = fp8_scales(x, scaling)?;
    let q = quantize_fp8(x, &s, scaling)?;
    assert_eq!(q.dtype(), DType::F8E4M3);
    assert_eq!(q.dims(), x.dims());
    let back = dequantize_fp8(&q, &s, scaling, DType::F32)?;
    // Each element's scale, broadcast by hand.
    let (bn, sn, hn, dn) = x.dims4()?;
    let sv = s.flatten_all()?.to_vec1::<f32>()?;
    let scale_of = |b: usize, t: usize, h: usize| match scaling {
        Fp8Scaling::PerTensor => sv[0],
        Fp8Scaling::PerHead => sv[h],
        Fp8Scaling::PerBlock { rows } => sv[(b * hn + h) * sn.div_ceil(rows) + t / rows],
    };
    let (xv, bv, qv) = (to_f32_vec(x)?, to_f32_vec(&back)?, bits(&q)?);
    for b in 0..bn {
        for t in 0..sn {
            for h in 0..hn {
                let sc = scale_of(b, t, h);
                for e in 0..dn {
                    let i = ((b * sn + t) * hn + h) * dn + e;
                    let (x, y) = (xv[i], bv[i]);
                    assert_eq!(
                        qv[i],
                        F8E4M3::from_f32(x / sc).to_bits(),
                        "{what}: byte {i}"
                    );
                    let bound = (x.abs() / 16.0).max(sc / 1024.0) + 1e-6 * (x.abs() + sc);
                    assert!(
                        (x - y).abs() <= bound,
                        "{what}: element {i}: {x} came back as {y} (scale {sc})"
                    );
                }
            }
        }
    }
    Ok(())
}

/// Round trips within e4m3's error for every scaling, on data whose magnitude varies by head
/// and token (so that groups differ, and small values reach the subnormals).
#[test]
fn quant_round_trip_within_e4m3_error() -> Result<()> {
    let (b, s, h, d) = (2, 10, 3, 16);
    let mag: Vec<f32> = (0..b * s * h)
        .map(|i| 10f32.powi((i % 7) as i32 - 3))
        .collect();
    let mag = Tensor::from_vec(mag, (b, s, h, 1), &CPU)?;
    let x = randn((b, s, h, d), DType::F32)?.broadcast_mul(&mag)?;
    for scaling in [
        Fp8Scaling::PerTensor,
        Fp8Scaling::PerHead,
        Fp8Scaling::PerBlock { rows: 1 },
        Fp8Scaling::PerBlock { rows: 4 },
        Fp8Scaling::PerBlock { rows: 10 },
        Fp8Scaling::PerBlock { rows: 64 },
    ] {
        assert_round_trip(&format!("{scaling:?}"), &x, scaling)?;
    }
    for dtype in [DType::F16, DType::BF16] {
        assert_round_trip(
            &format!("{dtype:?}"),
            &x.to_dtype(dtype)?,
            Fp8Scaling::PerHead,
        )?;
    }
    Ok(())
}

/// Scales are each group's `max |x| / 448`, shaped as documented, seq not a multiple of the
/// block; a group of zeros gets 1.
#[test]
fn quant_scales_shapes_and_values() -> Result<()> {
    let (b, s, h, d) = (2, 10, 3, 8);
    let x = randn((b, s, h, d), DType::F32)?;
    let xv = to_f32_vec(&x)?;
    let amax = |f: &dyn Fn(usize, usize, usize) -> bool| {
        let mut m = 0f32;
        for bi in 0..b {
            for t in 0..s {
                for hi in 0..h {
                    if f(bi, t, hi) {
                        for e in 0..d {
                            m = m.max(xv[((bi * s + t) * h + hi) * d + e].abs());
                        }
                    }
                }
            }
        }
        m / 448.0
    };
    let per_tensor = fp8_scales(&x, Fp8Scaling::PerTensor)?;
    assert_eq!(per_tensor.dims(), &[1]);
    assert_eq!(per_tensor.to_vec1::<f32>()?, [amax(&|_, _, _| true)]);
    let per_head = fp8_scales(&x, Fp8Scaling::PerHead)?;
    let want: Vec<f32> = (0..h).map(|hh| amax(&|_, _, hi| hi == hh)).collect();
    assert_eq!(per_head.to_vec1::<f32>()?, want);
    let per_block = fp8_scales(&x, Fp8Scaling::PerBlock { rows: 4 })?;
    assert_eq!(per_block.dims(), &[b, h, 3]);
    let got = per_block.flatten_all()?.to_vec1::<f32>()?;
    let want: Vec<f32> = (0..b * h * 3)
        .map(|i| {
            let (bb, hh, blk) = (i / (h * 3), (i / 3) % h, i % 3);
            amax(&|bi, t, hi| bi == bb && hi == hh && t / 4 == blk)
        })
        .collect();
    assert_eq!(got, want, "PerBlock {{ rows: 4 }} over seq 10");
    // Zeros: scale 1, never 0 or NaN; one zero head among others.
    let zeros = Tensor::zeros((b, s, h, d), DType::F32, &CPU)?;
    for scaling in [
        Fp8Scaling::PerTensor,
        Fp8Scaling::PerHead,
        Fp8Scaling::PerBlock { rows: 3 },
    ] {
        let sc = fp8_scales(&zeros, scaling)?;
        assert!(to_f32_vec(&sc)?.iter().all(|&v| v == 1.0), "{scaling:?}");
        let q = quantize_fp8(&zeros, &sc, scaling)?;
        assert!(bits(&q)?.iter().all(|&v| v == 0));
    }
    let one_zero_head = Tensor::cat(&[x.narrow(2, 0, 2)?, zeros.narrow(2, 0, 1)?], 2)?;
    let sc = fp8_scales(&one_zero_head, Fp8Scaling::PerHead)?.to_vec1::<f32>()?;
    assert_eq!(sc[2], 1.0);
    assert!(sc[0] > 0.0 && sc[0] < 1.0);
    // Empty tensors: scales of the documented shape.
    let empty = Tensor::zeros((b, 0, h, d), DType::F32, &CPU)?;
    assert_eq!(fp8_scales(&empty, Fp8Scaling::PerHead)?.dims(), &[h]);
    assert_eq!(
        fp8_scales(&empty, Fp8Scaling::PerBlock { rows: 4 })?.dims(),
        &[b, h, 0]
    );
    Ok(())
}

/// Values past ±448 · scale saturate; NaN stays NaN; the helpers' argument errors.
#[test]
fn quant_saturation_and_errors() -> Result<()> {
    let x = Tensor::new(
        &[1000f32, -1e30, f32::INFINITY, f32::NAN, 447.0, 1e-9],
        &CPU,
    )?
    .reshape((1, 6, 1, 1))?;
    let one = Tensor::new(&[1f32], &CPU)?;
    let q = quantize_fp8(&x, &one, Fp8Scaling::PerTensor)?;
    assert_eq!(bits(&q)?, [0x7e, 0xfe, 0x7e, 0x7f, 0x7e, 0x00]);
    assert_fails(
        fp8_scales(&x, Fp8Scaling::PerHead),
        &["x", "NaN or an infinite"],
    );
    let inf = Tensor::new(&[1f32, f32::INFINITY], &CPU)?.reshape((1, 2, 1, 1))?;
    assert_fails(
        fp8_scales(&inf, Fp8Scaling::PerTensor),
        &["NaN or an infinite"],
    );
    let x = randn((2, 5, 3, 4), DType::F32)?;
    let s = fp8_scales(&x, Fp8Scaling::PerHead)?;
    assert_fails(fp8_scales(&x.i(0)?, Fp8Scaling::PerHead), &["x", "rank 4"]);
    assert_fails(
        fp8_scales(&x, Fp8Scaling::PerBlock { rows: 0 }),
        &["PerBlock", "rows > 0"],
    );
    assert_fails(
        fp8_scales(&x.to_dtype(DType::U32)?, Fp8Scaling::PerHead),
        &["x", "float dtype", "U32"],
    );
    assert_fails(
        quantize_fp8(&x, &s, Fp8Scaling::PerTensor),
        &["scales", "shape [1]", "[3]"],
    );
    assert_fails(
        quantize_fp8(&x, &s.to_dtype(DType::F16)?, Fp8Scaling::PerHead),
        &["scales", "dtype F32"],
    );
    assert_fails(
        quantize_fp8(&x, &s, Fp8Scaling::PerBlock { rows: 2 }),
        &["scales", "shape [2, 3, 3]"],
    );
    let q = quantize_fp8(&x, &s, Fp8Scaling::PerHead)?;
    assert_fails(
        dequantize_fp8(&x, &s, Fp8Scaling::PerHead, DType::F32),
        &["x", "F8E4M3"],
    );
    assert_fails(
        dequantize_fp8(&q, &s, Fp8Scaling::PerHead, DType::U8),
        &["dtype", "U8"],
    );
    assert_eq!(
        dequantize_fp8(&q, &s, Fp8Scaling::PerHead, DType::BF16)?.dtype(),
        DType::BF16
    );
    Ok(())
}
