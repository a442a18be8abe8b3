//! Cascade attention on the CPU: sequences that share a prompt prefix attend to it once for
//! all of them (their query tokens as the rows of one forward over the prefix), to their own
//! suffixes through the decode API with its LSE, and [`combine`] merges the two. The result is
//! the attention over each sequence's whole cache (prefix then suffix), which the bench's
//! `--cascade-only` table times against on the GPU.

mod common;

use candle::{DType, Result, Tensor};
use candle_flash::{
    attention_slow, combine, flash_attn_with_kvcache, flash_attn_with_kvcache_cascade,
    flash_attn_with_kvcache_lse, FlashAttn,
};
use common::{assert_close, assert_within_budget, randn};

/// One decode step of `b = lens.len()` sequences: q `(b, 1, h, d)`, the shared prefix's
/// `(1, prefix, hk, d)` keys and values, each sequence's suffix cache `(b, capacity, hk, d)`
/// holding `lens[i]` tokens.
struct Step {
    q: Tensor,
    prefix_k: Tensor,
    prefix_v: Tensor,
    suffix_k: Tensor,
    suffix_v: Tensor,
    lens: Vec<u32>,
}

impl Step {
    fn new(
        prefix: usize,
        lens: &[u32],
        h: usize,
        hk: usize,
        d: usize,
        dtype: DType,
    ) -> Result<Self> {
        let b = lens.len();
        let capacity = *lens.iter().max().unwrap_or(&0) as usize + 3;
        Ok(Self {
            q: randn((b, 1, h, d), dtype)?,
            prefix_k: randn((1, prefix, hk, d), dtype)?,
            prefix_v: randn((1, prefix, hk, d), dtype)?,
            suffix_k: randn((b, capacity, hk, d), dtype)?,
            suffix_v: randn((b, capacity, hk, d), dtype)?,
            lens: lens.to_vec(),
        })
    }

    /// The prefix once for every sequence, the suffixes, merged: `(out, lse)`.
    fn cascade(&self, opts: &FlashAttn) -> Result<(Tensor, Tensor)> {
        let (b, _, h, d) = self.q.dims4()?;
        let rows = self.q.reshape((1, b, h, d))?;
        let (out, lse) = opts.forward_with_lse(&rows, &self.prefix_k, &self.prefix_v)?;
        // (1, b, h, d) -> (b, 1, h, d); the lse (1, h, b) -> (b, h, 1), a strided view.
        let prefix = (out.reshape((b, 1, h, d))?, lse.transpose(0, 2)?);
        let suffix = flash_attn_with_kvcache_lse(
            &self.q,
            &self.suffix_k,
            &self.suffix_v,
            None,
            &self.lens,
            opts,
        )?;
        combine(&[prefix, suffix])
    }

    /// Each sequence's cache holding the prefix then its suffix, attended as one: `(out, lse)`.
    fn unshared(&self, opts: &FlashAttn) -> Result<(Tensor, Tensor)> {
        let (b, _, _, _) = self.q.dims4()?;
        let (_, prefix, hk, d) = self.prefix_k.dims4()?;
        let full = |p: &Tensor, s: &Tensor| -> Result<Tensor> {
            Tensor::cat(&[&p.broadcast_as((b, prefix, hk, d))?, s], 1)
        };
        let k = full(&self.prefix_k, &self.suffix_k)?;
        let v = full(&self.prefix_v, &self.suffix_v)?;
        let lens: Vec<u32> = self.lens.iter().map(|&l| l + prefix as u32).collect();
        flash_attn_with_kvcache_lse(&self.q, &k, &v, None, &lens, opts)
    }
}

/// f32: the cascade equals the unshared attention to f32 rounding, out and lse, with a
/// sequence whose suffix is empty (its suffix lse -inf: the prefix alone), GQA, and options
/// both paths apply alike (a softmax scale, a softcap).
#[test]
fn cascade_equals_unshared_attention() -> Result<()> {
    let lens = [5u32, 0, 12, 1, 7];
    for (h, hk, d) in [(4, 2, 16), (6, 6, 40), (8, 1, 64)] {
        let step = Step::new(37, &lens, h, hk, d, DType::F32)?;
        for opts in [
            FlashAttn::new(),
            FlashAttn::new().softmax_scale(0.3).softcap(5.0),
        ] {
            let (out, lse) = step.cascade(&opts)?;
            let (want, want_lse) = step.unshared(&opts)?;
            let what = format!("h={h}/{hk} d={d}");
            assert_close(&format!("{what}: out"), &out, &want, 1e-5)?;
            assert_close(&format!("{what}: lse"), &lse, &want_lse, 1e-5)?;
            // The decode API without its LSE gives the same output.
            let plain = flash_attn_with_kvcache(
                &step.q,
                &step.suffix_k,
                &step.suffix_v,
                None,
                &step.lens,
                &opts,
            )?;
            let (suffix, _) = flash_attn_with_kvcache_lse(
                &step.q,
                &step.suffix_k,
                &step.suffix_v,
                None,
                &step.lens,
                &opts,
            )?;
            assert_close(&format!("{what}: decode with lse"), &suffix, &plain, 0.0)?;
        }
    }
    Ok(())
}

/// bf16: the cascade rounds its two parts and their merge; it stays within the FlashAttention
/// rule: at most 2x as far from the exact attention (f32 math on the same inputs) as the same
/// math done in bf16 ([`attention_slow`] on each sequence's whole cache).
#[test]
fn bf16_cascade_stays_within_the_error_budget() -> Result<()> {
    let lens = [60u32, 3, 17, 128];
    let (h, d) = (8, 64);
    let step = Step::new(300, &lens, h, 2, d, DType::BF16)?;
    let scale = 1.0 / (d as f32).sqrt();
    let f32 = |t: &Tensor| t.to_dtype(DType::F32);
    let (mut exact, mut low) = (vec![], vec![]);
    for (i, &len) in lens.iter().enumerate() {
        let keys = |p: &Tensor, s: &Tensor| -> Result<Tensor> {
            Tensor::cat(&[p, &s.narrow(0, i, 1)?.narrow(1, 0, len as usize)?], 1)
        };
        let q = step.q.narrow(0, i, 1)?;
        let k = keys(&step.prefix_k, &step.suffix_k)?;
        let v = keys(&step.prefix_v, &step.suffix_v)?;
        exact.push(attention_slow(
            &f32(&q)?,
            &f32(&k)?,
            &f32(&v)?,
            scale,
            false,
        )?);
        low.push(attention_slow(&q, &k, &v, scale, false)?);
    }
    let (exact, low) = (Tensor::cat(&exact, 0)?, Tensor::cat(&low, 0)?);
    let (out, _) = step.cascade(&FlashAttn::new())?;
    assert_eq!(out.dtype(), DType::BF16);
    assert_within_budget("bf16 cascade", &f32(&out)?, &f32(&low)?, &exact, 2.0)
}

/// The library call: equal to the unshared attention in f32, one query token or several
/// (causal, appended first), with sinks (counted once), GQA, the prefix given 3-D or 4-D.
#[test]
fn the_cascade_call_equals_unshared_attention() -> Result<()> {
    let lens = [5u32, 0, 12, 1, 7];
    for (h, hk, d) in [(4, 2, 16), (8, 1, 64)] {
        let step = Step::new(37, &lens, h, hk, d, DType::F32)?;
        let sinks = Tensor::new(
            &[0.5f32, -1.0, 2.0, 0.0, 1.0, -0.5, 0.25, 3.0][..h],
            &candle::Device::Cpu,
        )?;
        for opts in [
            FlashAttn::new(),
            FlashAttn::new().softmax_scale(0.3).softcap(5.0),
            FlashAttn::new().sinks(&sinks),
        ] {
            let out = flash_attn_with_kvcache_cascade(
                &step.q,
                &step.prefix_k.squeeze(0)?,
                &step.prefix_v,
                &step.suffix_k,
                &step.suffix_v,
                None,
                &step.lens,
                &opts,
            )?;
            let (want, _) = step.unshared(&opts)?;
            assert_close(&format!("h={h}/{hk} d={d}"), &out, &want, 1e-5)?;
        }
    }
    // Three new tokens per sequence, causal: appended to the own caches, then attended.
    let (h, hk, d, s) = (4, 2, 16, 3);
    let step = Step::new(29, &lens, h, hk, d, DType::F32)?;
    let b = lens.len();
    let q = randn((b, s, h, d), DType::F32)?;
    let k_new = randn((b, s, hk, d), DType::F32)?;
    let v_new = randn((b, s, hk, d), DType::F32)?;
    let opts = FlashAttn::new().causal(true);
    let (k_own, v_own) = (step.suffix_k.copy()?, step.suffix_v.copy()?);
    let out = flash_attn_with_kvcache_cascade(
        &q,
        &step.prefix_k,
        &step.prefix_v,
        &k_own,
        &v_own,
        Some((&k_new, &v_new)),
        &step.lens,
        &opts,
    )?;
    let full = |p: &Tensor, own: &Tensor| -> Result<Tensor> {
        Tensor::cat(&[&p.broadcast_as((b, 29, hk, d))?, own], 1)
    };
    let (k_full, v_full) = (
        full(&step.prefix_k, &step.suffix_k)?,
        full(&step.prefix_v, &step.suffix_v)?,
    );
    let lens_full: Vec<u32> = lens.iter().map(|&l| l + 29).collect();
    let want = flash_attn_with_kvcache(
        &q,
        &k_full,
        &v_full,
        Some((&k_new, &v_new)),
        &lens_full,
        &opts,
    )?;
    assert_close("3 causal tokens, appended", &out, &want, 1e-5)?;
    assert_close(
        "the appended own cache",
        &k_own,
        &k_full.narrow(1, 29, k_own.dim(1)?)?,
        0.0,
    )?;
    Ok(())
}

/// Options the cascade cannot honour, and causal queries that would not all come after the
/// prefix, are errors naming them; nothing is appended then.
#[test]
fn the_cascade_call_refuses_what_it_cannot_split() -> Result<()> {
    let step = Step::new(16, &[2, 0], 4, 2, 16, DType::F32)?;
    let call = |q: &Tensor, opts: &FlashAttn| {
        flash_attn_with_kvcache_cascade(
            q,
            &step.prefix_k,
            &step.prefix_v,
            &step.suffix_k,
            &step.suffix_v,
            None,
            &step.lens,
            opts,
        )
    };
    let err = |r: Result<Tensor>| r.unwrap_err().to_string();
    assert!(err(call(&step.q, &FlashAttn::new().window_size(4, 0))).contains("window_size"));
    let table = Tensor::zeros((64, 8), DType::F32, &candle::Device::Cpu)?;
    assert!(err(call(
        &step.q,
        &FlashAttn::new().rotary(&table, &table, false)
    ))
    .contains("rotary"));
    let q2 = randn((2, 2, 4, 16), DType::F32)?;
    let e = err(call(&q2, &FlashAttn::new().causal(true)));
    assert!(e.contains("sequence 1 holds 0 own tokens"), "{e}");
    let bad = step.prefix_k.narrow(2, 0, 1)?;
    let e = flash_attn_with_kvcache_cascade(
        &step.q,
        &bad,
        &bad,
        &step.suffix_k,
        &step.suffix_v,
        None,
        &step.lens,
        &FlashAttn::new(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("prefix_k has 1 heads"), "{e}");
    Ok(())
}
