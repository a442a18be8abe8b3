//! Decoding with lengths and block tables given as tensors, and with the LSE out, on the CPU:
//! the same results as host slices, the LSE equal to the forward pass's over each prefix, and
//! clear errors for tensors of the wrong dtype, shape or device.

mod common;

use candle::{DType, Device, IndexOp, Result, Tensor};
use candle_flash::{
    flash_attn_with_kvcache, flash_attn_with_kvcache_lse, flash_attn_with_paged_kvcache,
    flash_attn_with_paged_kvcache_lse, FlashAttn,
};
use common::{assert_close, randn};

const TOL: f32 = 1e-5;

fn inputs(b: usize, cap: usize, s_q: usize, h: usize, hk: usize, d: usize) -> Result<[Tensor; 5]> {
    Ok([
        randn((b, s_q, h, d), DType::F32)?,
        randn((b, cap, hk, d), DType::F32)?,
        randn((b, cap, hk, d), DType::F32)?,
        randn((b, s_q, hk, d), DType::F32)?,
        randn((b, s_q, hk, d), DType::F32)?,
    ])
}

#[test]
fn tensor_lengths_equal_host_lengths() -> Result<()> {
    let (b, cap, s_q, h, hk, d) = (3, 50, 2, 8, 2, 32);
    let [q, k, v, kn, vn] = inputs(b, cap, s_q, h, hk, d)?;
    let lens = [0u32, 17, 48];
    let opts = FlashAttn::new().causal(true);
    let (k1, v1) = (k.copy()?, v.copy()?);
    let host = flash_attn_with_kvcache(&q, &k1, &v1, Some((&kn, &vn)), &lens, &opts)?;
    let (k2, v2) = (k.copy()?, v.copy()?);
    let t = Tensor::new(&lens, &Device::Cpu)?;
    let dev = flash_attn_with_kvcache(&q, &k2, &v2, Some((&kn, &vn)), &t, &opts)?;
    assert_close("out", &dev, &host, 0.0)?;
    assert_close("k cache", &k2, &k1, 0.0)?;
    assert_close("v cache", &v2, &v1, 0.0)?;
    Ok(())
}

#[test]
fn tensor_block_table_equals_host_table() -> Result<()> {
    let (b, page, max_pages, h, hk, d) = (2, 8, 3, 4, 4, 16);
    let num_pages = b * max_pages + 1;
    let q = randn((b, 1, h, d), DType::F32)?;
    let kp = randn((num_pages, page, hk, d), DType::F32)?;
    let vp = randn((num_pages, page, hk, d), DType::F32)?;
    let kn = randn((b, 1, hk, d), DType::F32)?;
    let vn = randn((b, 1, hk, d), DType::F32)?;
    let table = [6u32, 0, 4, 1, 5, 3];
    let lens = [9u32, 20];
    let opts = FlashAttn::new().causal(true);
    let (k1, v1) = (kp.copy()?, vp.copy()?);
    let host = flash_attn_with_paged_kvcache(
        &q,
        &k1,
        &v1,
        Some((&kn, &vn)),
        &lens,
        &table,
        max_pages,
        &opts,
    )?;
    let (k2, v2) = (kp.copy()?, vp.copy()?);
    let t_table = Tensor::from_slice(&table, (b, max_pages), &Device::Cpu)?;
    let t_lens = Tensor::new(&lens, &Device::Cpu)?;
    let dev = flash_attn_with_paged_kvcache(
        &q,
        &k2,
        &v2,
        Some((&kn, &vn)),
        &t_lens,
        &t_table,
        max_pages,
        &opts,
    )?;
    assert_close("out", &dev, &host, 0.0)?;
    assert_close("k pages", &k2, &k1, 0.0)?;
    Ok(())
}

/// The decode LSE `(b, h, s_q)` is the forward's LSE over each sequence's prefix (with the
/// causal mask bottom-right aligned), `-inf` where a sequence has no key.
#[test]
fn lse_equals_the_forward_lse_per_prefix() -> Result<()> {
    let (b, cap, s_q, h, hk, d) = (3, 40, 3, 6, 2, 24);
    let [q, k, v, kn, vn] = inputs(b, cap, s_q, h, hk, d)?;
    let lens = [0u32, 5, 30];
    for causal in [false, true] {
        let opts = FlashAttn::new().causal(causal);
        let (kc, vc) = (k.copy()?, v.copy()?);
        let (out, lse) = flash_attn_with_kvcache_lse(&q, &kc, &vc, Some((&kn, &vn)), &lens, &opts)?;
        assert_eq!(lse.dims(), [b, h, s_q]);
        let plain =
            flash_attn_with_kvcache(&q, &k.copy()?, &v.copy()?, Some((&kn, &vn)), &lens, &opts)?;
        assert_close("out with and without lse", &out, &plain, 0.0)?;
        for (i, &len) in lens.iter().enumerate() {
            let total = len as usize + s_q;
            let qi = q.i(i..i + 1)?;
            let (ki, vi) = (kc.i((i..i + 1, 0..total))?, vc.i((i..i + 1, 0..total))?);
            let (_, want) = opts.forward_with_lse(&qi, &ki, &vi)?;
            assert_close(
                &format!("lse of sequence {i}, causal {causal}"),
                &lse.i(i..i + 1)?,
                &want,
                TOL,
            )?;
        }
    }
    // No key at all: every row's LSE is -inf.
    let (kc, vc) = (k.copy()?, v.copy()?);
    let (_, lse) =
        flash_attn_with_kvcache_lse(&q, &kc, &vc, None, &[0u32, 0, 0], &FlashAttn::new())?;
    let l = lse.flatten_all()?.to_vec1::<f32>()?;
    assert!(l.iter().all(|&x| x == f32::NEG_INFINITY), "{l:?}");
    Ok(())
}

#[test]
fn paged_lse_equals_contiguous_lse() -> Result<()> {
    let (b, page, max_pages, h, hk, d) = (2, 4, 3, 4, 2, 16);
    let cap = page * max_pages;
    let q = randn((b, 2, h, d), DType::F32)?;
    let k = randn((b, cap, hk, d), DType::F32)?;
    let v = randn((b, cap, hk, d), DType::F32)?;
    // Page p of sequence s at pool slot s * max_pages + p: the pool is the cache reshaped.
    let kp = k.reshape((b * max_pages, page, hk, d))?;
    let vp = v.reshape((b * max_pages, page, hk, d))?;
    let table: Vec<u32> = (0..(b * max_pages) as u32).collect();
    let lens = [7u32, 12];
    let opts = FlashAttn::new().causal(true);
    let (_, want) = flash_attn_with_kvcache_lse(&q, &k, &v, None, &lens, &opts)?;
    let (_, got) =
        flash_attn_with_paged_kvcache_lse(&q, &kp, &vp, None, &lens, &table, max_pages, &opts)?;
    assert_close("paged lse", &got, &want, 0.0)
}

fn err_of(r: Result<Tensor>) -> String {
    match r {
        Ok(_) => "no error".into(),
        Err(e) => e.to_string(),
    }
}

#[test]
fn bad_tensors_are_named_errors() -> Result<()> {
    let (b, cap, h, hk, d) = (2, 16, 2, 2, 8);
    let [q, k, v, _, _] = inputs(b, cap, 1, h, hk, d)?;
    let opts = FlashAttn::new();
    let cases = [
        (Tensor::new(&[1f32, 2.0], &Device::Cpu)?, "dtype U32"),
        (Tensor::new(&[1u32, 2, 3], &Device::Cpu)?, "shape [2]"),
        (Tensor::new(&[[1u32, 2]], &Device::Cpu)?, "shape [2]"),
    ];
    for (lens, want) in cases {
        let e = err_of(flash_attn_with_kvcache(&q, &k, &v, None, &lens, &opts));
        assert!(e.contains("cache_seqlens") && e.contains(want), "{e}");
    }
    // Checked like a host slice on the CPU: an overflow is an error, nothing written.
    let lens = Tensor::new(&[16u32, 3], &Device::Cpu)?;
    let kn = randn((b, 1, hk, d), DType::F32)?;
    let vn = randn((b, 1, hk, d), DType::F32)?;
    let before = k.copy()?;
    let e = err_of(flash_attn_with_kvcache(
        &q,
        &k,
        &v,
        Some((&kn, &vn)),
        &lens,
        &opts,
    ));
    assert!(e.contains("cache_seqlens") && e.contains("capacity"), "{e}");
    assert_close("cache after the refused call", &k, &before, 0.0)?;
    // A block table of the wrong shape.
    let kp = randn((4, 4, hk, d), DType::F32)?;
    let table = Tensor::new(&[0u32, 1, 2, 3], &Device::Cpu)?;
    let e = err_of(flash_attn_with_paged_kvcache(
        &q,
        &kp,
        &kp,
        None,
        &[1u32, 1],
        &table,
        2,
        &opts,
    ));
    assert!(e.contains("block_table") && e.contains("[2, 2]"), "{e}");
    Ok(())
}

/// Ragged queries (a different count per sequence) equal one call per sequence on its own
/// rows; padding rows give zeros and -inf and write nothing to the cache.
#[test]
fn ragged_queries_equal_per_sequence_calls() -> Result<()> {
    use candle_flash::{flash_attn_with_kvcache_ragged, flash_attn_with_paged_kvcache_ragged};
    let (b, cap, s_q, h, hk, d) = (3, 48, 4, 6, 2, 16);
    let [q, k, v, kn, vn] = inputs(b, cap, s_q, h, hk, d)?;
    let lens = [5u32, 0, 30];
    let q_lens = [1u32, 4, 0];
    for (causal, with_new) in [(true, true), (false, true), (true, false)] {
        let opts = FlashAttn::new().causal(causal);
        let new_kv = with_new.then_some((&kn, &vn));
        let (kc, vc) = (k.copy()?, v.copy()?);
        let (out, lse) =
            flash_attn_with_kvcache_ragged(&q, &kc, &vc, new_kv, &lens, &q_lens, &opts)?;
        // The same through a paged cache (pool = the cache reshaped, tensors for the counts).
        let page = 8;
        let (kp, vp) = (
            k.reshape((b * cap / page, page, hk, d))?.copy()?,
            v.reshape((b * cap / page, page, hk, d))?.copy()?,
        );
        let table: Vec<u32> = (0..(b * cap / page) as u32).collect();
        let t_q_lens = Tensor::new(&q_lens, &Device::Cpu)?;
        let (out_p, lse_p) = flash_attn_with_paged_kvcache_ragged(
            &q,
            &kp,
            &vp,
            new_kv,
            &lens,
            &t_q_lens,
            &table,
            cap / page,
            &opts,
        )?;
        assert_close("paged ragged out", &out_p, &out, 0.0)?;
        let inf_free = |t: &Tensor| t.clamp(-1e30f32, f32::INFINITY);
        assert_close(
            "paged ragged lse",
            &inf_free(&lse_p)?,
            &inf_free(&lse)?,
            0.0,
        )?;
        assert_close("paged ragged k", &kp.reshape((b, cap, hk, d))?, &kc, 0.0)?;
        for i in 0..b {
            let n = q_lens[i] as usize;
            let what = format!("sequence {i}, causal {causal}, new {with_new}");
            let pad_out = out.i((i, n..s_q))?.abs()?.sum_all()?.to_scalar::<f32>()?;
            assert_eq!(pad_out, 0.0, "{what}: padding rows are not zero");
            let pad_lse = lse.i((i, .., n..s_q))?.flatten_all()?.to_vec1::<f32>()?;
            assert!(
                pad_lse.iter().all(|&x| x == f32::NEG_INFINITY),
                "{what}: {pad_lse:?}"
            );
            let (ks, vs) = (k.i(i..i + 1)?.copy()?, v.i(i..i + 1)?.copy()?);
            let new_i = (kn.i((i..i + 1, 0..n))?, vn.i((i..i + 1, 0..n))?);
            let new_i = with_new.then_some((&new_i.0, &new_i.1));
            let (want, want_lse) = flash_attn_with_kvcache_lse(
                &q.i((i..i + 1, 0..n))?,
                &ks,
                &vs,
                new_i,
                &[lens[i]],
                &opts,
            )?;
            assert_close(&format!("{what}: cache"), &kc.i(i..i + 1)?, &ks, 0.0)?;
            if n == 0 {
                continue;
            }
            assert_close(&what, &out.i((i..i + 1, 0..n))?, &want, TOL)?;
            let got_lse = lse.i((i..i + 1, .., 0..n))?;
            let finite = |t: &Tensor| -> Result<Tensor> {
                // -inf rows (no key) compare as equal through a large finite stand-in.
                t.clamp(-1e30f32, f32::INFINITY)
            };
            assert_close(
                &format!("{what}: lse"),
                &finite(&got_lse)?,
                &finite(&want_lse)?,
                TOL,
            )?;
        }
    }
    // Counts past seqlen_q and new tokens that differ from the queries are errors.
    let e =
        flash_attn_with_kvcache_ragged(&q, &k, &v, None, &lens, &[5u32, 0, 0], &FlashAttn::new())
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
    assert!(e.contains("seqlens_q") && e.contains("seqlen_q 4"), "{e}");
    let short = (kn.narrow(1, 0, 2)?, vn.narrow(1, 0, 2)?);
    let e = flash_attn_with_kvcache_ragged(
        &q,
        &k,
        &v,
        Some((&short.0, &short.1)),
        &lens,
        &q_lens,
        &FlashAttn::new(),
    )
    .err()
    .map(|e| e.to_string())
    .unwrap_or_default();
    assert!(e.contains("seqlen_new"), "{e}");
    Ok(())
}

/// Attention sinks in decoding: each sequence's output and LSE equal the forward's with the
/// same sinks over its prefix.
#[test]
fn sinks_equal_the_forward_with_sinks() -> Result<()> {
    let (b, cap, s_q, h, hk, d) = (2, 32, 2, 4, 2, 16);
    let [q, k, v, kn, vn] = inputs(b, cap, s_q, h, hk, d)?;
    let sinks = Tensor::new(&[0.5f32, -1.0, 2.0, f32::NEG_INFINITY], &Device::Cpu)?;
    let lens = [0u32, 11];
    let opts = FlashAttn::new().causal(true).sinks(&sinks);
    let (kc, vc) = (k.copy()?, v.copy()?);
    let (out, lse) = flash_attn_with_kvcache_lse(&q, &kc, &vc, Some((&kn, &vn)), &lens, &opts)?;
    for (i, &len) in lens.iter().enumerate() {
        let total = len as usize + s_q;
        let qi = q.i(i..i + 1)?;
        let (ki, vi) = (kc.i((i..i + 1, 0..total))?, vc.i((i..i + 1, 0..total))?);
        let (want, want_lse) = opts.forward_with_lse(&qi, &ki, &vi)?;
        assert_close(&format!("sinks out {i}"), &out.i(i..i + 1)?, &want, TOL)?;
        assert_close(&format!("sinks lse {i}"), &lse.i(i..i + 1)?, &want_lse, TOL)?;
    }
    let plain =
        flash_attn_with_kvcache(&q, &k.copy()?, &v.copy()?, Some((&kn, &vn)), &lens, &opts)?;
    assert_close("sinks without the lse", &plain, &out, 0.0)
}
