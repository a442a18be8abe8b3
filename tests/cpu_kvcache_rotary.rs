//! Rotary embedding inside the KV-cache calls (`FlashAttn::rotary`) on the CPU: the same
//! result as rotating q and the new keys first (with an independent scalar rotation) and
//! calling without it, for both pair layouts, partial rotary dims, causal and not, paged and
//! contiguous; and the errors.

mod common;

use candle::{DType, Device, Result, Tensor};
use candle_flash::{flash_attn_with_kvcache, flash_attn_with_paged_kvcache, FlashAttn};
use common::{assert_close, randn};

const TOL: f32 = 1e-5;

/// Angles `pos / 10000^(2j / rd)` for `positions` rows: `(cos, sin)` `(positions, rd / 2)`.
fn tables(positions: usize, rd: usize) -> Result<(Tensor, Tensor)> {
    let half = rd / 2;
    let mut c = vec![];
    let mut s = vec![];
    for p in 0..positions {
        for j in 0..half {
            let a = p as f32 / 10000f32.powf(2.0 * j as f32 / rd as f32);
            c.push(a.cos());
            s.push(a.sin());
        }
    }
    Ok((
        Tensor::from_vec(c, (positions, half), &Device::Cpu)?,
        Tensor::from_vec(s, (positions, half), &Device::Cpu)?,
    ))
}

/// `x` `(b, s, heads, d)` rotated element by element: row `i` of sequence `b` at
/// `pos(b, i)`.
fn rotate(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    interleaved: bool,
    pos: impl Fn(usize, usize) -> usize,
) -> Result<Tensor> {
    let (b, s, heads, d) = x.dims4()?;
    let half = cos.dim(1)?;
    let (c, sn) = (cos.to_vec2::<f32>()?, sin.to_vec2::<f32>()?);
    let mut v = x.flatten_all()?.to_vec1::<f32>()?;
    for bi in 0..b {
        for i in 0..s {
            let p = pos(bi, i);
            for h in 0..heads {
                let row = &mut v[((bi * s + i) * heads + h) * d..][..d];
                for j in 0..half {
                    let (a, z) = if interleaved {
                        (2 * j, 2 * j + 1)
                    } else {
                        (j, j + half)
                    };
                    let (x0, x1) = (row[a], row[z]);
                    row[a] = x0 * c[p][j] - x1 * sn[p][j];
                    row[z] = x1 * c[p][j] + x0 * sn[p][j];
                }
            }
        }
    }
    Tensor::from_vec(v, (b, s, heads, d), &Device::Cpu)
}

#[test]
fn rotary_equals_rotating_first() -> Result<()> {
    let (b, cap, h, hk) = (2, 40, 4, 2);
    let lens = [3u32, 20];
    for (d, rd, interleaved, causal, s_q, s_new) in [
        (32, 32, false, true, 3, 3),
        (32, 16, true, true, 2, 2),
        (48, 32, false, false, 2, 1),
        (64, 64, true, false, 1, 1),
    ] {
        let what = format!("d {d} rd {rd} interleaved {interleaved} causal {causal}");
        let q = randn((b, s_q, h, d), DType::F32)?;
        let k = randn((b, cap, hk, d), DType::F32)?;
        let v = randn((b, cap, hk, d), DType::F32)?;
        let kn = randn((b, s_new, hk, d), DType::F32)?;
        let vn = randn((b, s_new, hk, d), DType::F32)?;
        let (cos, sin) = tables(cap, rd)?;
        let opts = FlashAttn::new().causal(causal);
        let (k1, v1) = (k.copy()?, v.copy()?);
        let ours = flash_attn_with_kvcache(
            &q,
            &k1,
            &v1,
            Some((&kn, &vn)),
            &lens,
            &opts.clone().rotary(&cos, &sin, interleaved),
        )?;
        let start = |bi: usize| lens[bi] as usize;
        let q_rot = rotate(&q, &cos, &sin, interleaved, |bi, i| {
            start(bi) + if causal { i } else { 0 }
        })?;
        let k_rot = rotate(&kn, &cos, &sin, interleaved, |bi, i| start(bi) + i)?;
        let (k2, v2) = (k.copy()?, v.copy()?);
        let want = flash_attn_with_kvcache(&q_rot, &k2, &v2, Some((&k_rot, &vn)), &lens, &opts)?;
        assert_close(&what, &ours, &want, TOL)?;
        assert_close(&format!("{what}: k cache"), &k1, &k2, TOL)?;
        assert_close(&format!("{what}: v cache"), &v1, &v2, 0.0)?;
    }
    Ok(())
}

#[test]
fn paged_rotary_equals_contiguous_rotary() -> Result<()> {
    let (b, page, max_pages, h, hk, d) = (2, 8, 4, 4, 2, 32);
    let cap = page * max_pages;
    let q = randn((b, 1, h, d), DType::F32)?;
    let k = randn((b, cap, hk, d), DType::F32)?;
    let v = randn((b, cap, hk, d), DType::F32)?;
    let kn = randn((b, 1, hk, d), DType::F32)?;
    let vn = randn((b, 1, hk, d), DType::F32)?;
    let (cos, sin) = tables(cap, d)?;
    let opts = FlashAttn::new().causal(true).rotary(&cos, &sin, false);
    let lens = [9u32, 30];
    let (k1, v1) = (k.copy()?, v.copy()?);
    let want = flash_attn_with_kvcache(&q, &k1, &v1, Some((&kn, &vn)), &lens, &opts)?;
    let kp = k.reshape((b * max_pages, page, hk, d))?.copy()?;
    let vp = v.reshape((b * max_pages, page, hk, d))?.copy()?;
    let table: Vec<u32> = (0..(b * max_pages) as u32).collect();
    let ours = flash_attn_with_paged_kvcache(
        &q,
        &kp,
        &vp,
        Some((&kn, &vn)),
        &lens,
        &table,
        max_pages,
        &opts,
    )?;
    assert_close("paged rotary", &ours, &want, 0.0)?;
    assert_close("paged k", &kp.reshape((b, cap, hk, d))?, &k1, 0.0)
}

fn err_of(r: Result<Tensor>) -> String {
    match r {
        Ok(_) => "no error".into(),
        Err(e) => e.to_string(),
    }
}

#[test]
fn rotary_errors() -> Result<()> {
    let (b, cap, h, hk, d) = (1, 16, 2, 2, 32);
    let q = randn((b, 1, h, d), DType::F32)?;
    let k = randn((b, cap, hk, d), DType::F32)?;
    let v = randn((b, cap, hk, d), DType::F32)?;
    let kn = randn((b, 1, hk, d), DType::F32)?;
    let vn = randn((b, 1, hk, d), DType::F32)?;
    let call = |cos: &Tensor, sin: &Tensor, new: bool, lens: u32| {
        let opts = FlashAttn::new().rotary(cos, sin, false);
        let new_kv = new.then_some((&kn, &vn));
        err_of(flash_attn_with_kvcache(&q, &k, &v, new_kv, &[lens], &opts))
    };
    let (cos, sin) = tables(cap, d)?;
    let e = call(&cos, &sin, false, 3);
    assert!(e.contains("rotary") && e.contains("k_new"), "{e}");
    let (c24, s24) = tables(cap, 24)?;
    let e = call(&c24, &s24, true, 3);
    assert!(
        e.contains("rotary_dim") && e.contains("multiple of 16"),
        "{e}"
    );
    let (c64, s64) = tables(cap, 64)?;
    let e = call(&c64, &s64, true, 3);
    assert!(e.contains("head_dim"), "{e}");
    let (short_c, short_s) = tables(4, d)?;
    let e = call(&short_c, &short_s, true, 5);
    assert!(
        e.contains("rotary") && e.contains("positions up to 5"),
        "{e}"
    );
    let e = call(&cos, &sin.narrow(0, 0, 8)?, true, 3);
    assert!(e.contains("sin"), "{e}");
    let opts = FlashAttn::new().rotary(&cos, &sin, false);
    let e = err_of(opts.forward(&q, &k, &v));
    assert!(e.contains("rotary") && e.contains("KV-cache"), "{e}");
    Ok(())
}
