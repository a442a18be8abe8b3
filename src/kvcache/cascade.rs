//! Cascade attention (FlashInfer's): a decoding step whose sequences share a prompt attends to
//! the prompt's keys once for the whole batch and to each sequence's own cache apart, the two
//! merged exactly by their LSE.

use candle::{bail, Device, Result, Tensor};

use super::{flash_attn_with_kvcache_lse, CacheSeqlens, HostOrDevice};
use crate::combine::combine;
use crate::options::FlashAttn;

/// [`flash_attn_with_kvcache`](super::flash_attn_with_kvcache) for sequences that all begin
/// with the same prefix (a system prompt, a few-shot preamble), kept once in `prefix_k` and
/// `prefix_v` instead of once per sequence: the result equals attention over each sequence's
/// cache with the prefix in front of it. The prefix is read once for the whole batch (every
/// query token of the batch is a row of one forward over it, its keys split in chunks where
/// that fills the GPU better), the own caches by the decode kernels, and
/// [`combine`](crate::combine) merges the two by their LSE.
///
/// - `q`: `(batch, seqlen_q, num_heads, head_dim)`, already rotated to its positions (which
///   start after the prefix).
/// - `prefix_k`, `prefix_v`: `(prefix_len, num_heads_k, head_dim)` (or with a leading batch
///   dim of 1); every query sees all of it (the prefix comes before every query token, so
///   the causal mask hides none of it).
/// - `k_cache`, `v_cache`, `new_kv`, `cache_seqlens`: each sequence's own tokens, as for
///   [`flash_attn_with_kvcache`](super::flash_attn_with_kvcache); `new_kv` is appended first
///   (already rotated).
/// - `opts`: the softmax scale, `causal` (within the own tokens), the softcap and sinks
///   (counted once). Causal, every query token must come after the prefix: a sequence holds
///   at least `seqlen_q` own tokens after the append (checked for host lengths; with fewer,
///   attention over the whole cache would hide the prefix's last keys from the first
///   queries, which the cascade does not). Rotary embedding inside the append, windows and ALiBi depend on
///   positions the own cache does not know (they start after the prefix) and are refused.
/// - FP8: the own caches may be F8E4M3 with `opts.kv_cache_scales`, as for
///   [`flash_attn_with_kvcache`](super::flash_attn_with_kvcache); the prefix stays in q's
///   dtype (it is read once per batch, so quantizing it saves little).
#[allow(clippy::too_many_arguments)]
pub fn flash_attn_with_kvcache_cascade<'a>(
    q: &Tensor,
    prefix_k: &Tensor,
    prefix_v: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    new_kv: Option<(&Tensor, &Tensor)>,
    cache_seqlens: impl Into<CacheSeqlens<'a>>,
    opts: &FlashAttn,
) -> Result<Tensor> {
    if opts.rotary.is_some() {
        bail!(
            "cascade: opts.rotary: the own cache's positions start after the prefix; rotate q \
             and the new keys before the call"
        )
    }
    if opts.window_size != (-1, -1) || opts.alibi_slopes.is_some() {
        bail!(
            "cascade: opts.window_size / opts.alibi_slopes depend on key positions across the \
             prefix and the own cache, which the cascade attends apart; expected neither"
        )
    }
    let (b, s_q, h, d) = q.dims4().map_err(|_| {
        candle::Error::Msg(format!(
            "cascade: q has shape {:?}, expected (batch, seqlen_q, num_heads, head_dim)",
            q.dims()
        ))
    })?;
    let prefix = |t: &Tensor, what: &str| -> Result<Tensor> {
        match t.dims() {
            &[_, _, dd] if dd == d => t.unsqueeze(0),
            &[1, _, _, dd] if dd == d => Ok(t.clone()),
            dims => bail!(
                "cascade: {what} has shape {dims:?}, expected (prefix_len, num_heads_k, {d}) \
                 (or with a leading 1)"
            ),
        }
    };
    let (pk, pv) = (prefix(prefix_k, "prefix_k")?, prefix(prefix_v, "prefix_v")?);
    if pk.dims() != pv.dims() {
        bail!(
            "cascade: prefix_v has shape {:?}, expected prefix_k's {:?}",
            prefix_v.dims(),
            prefix_k.dims()
        )
    }
    // Everything the prefix's forward needs is checked before the own call appends to the
    // caches, so that an error leaves them unchanged.
    let hk = pk.dim(2)?;
    if pk.dtype() != q.dtype() || !pk.device().same_device(q.device()) {
        bail!(
            "cascade: prefix_k is {:?} on {:?}, expected q's {:?} on its device",
            pk.dtype(),
            pk.device().location(),
            q.dtype()
        )
    }
    if pv.dtype() != q.dtype() || !pv.device().same_device(q.device()) {
        bail!("cascade: prefix_v's dtype and device must be q's")
    }
    if hk == 0 || h % hk != 0 || k_cache.dims().get(2) != Some(&hk) {
        bail!(
            "cascade: prefix_k has {hk} heads, expected the caches' num_heads_k ({:?}), a \
             divisor of q's {h}",
            k_cache.dims().get(2)
        )
    }
    let lens = cache_seqlens.into();
    if let (true, HostOrDevice::Host(lens)) = (opts.causal, &lens) {
        let s_new = match new_kv {
            Some((k, _)) => k.dim(1)?,
            None => 0,
        };
        if let Some(i) = lens.iter().position(|&l| (l as usize) + s_new < s_q) {
            bail!(
                "cascade: sequence {i} holds {} own tokens after the append, fewer than the \
                 {s_q} causal query tokens (each must come after the prefix)",
                lens[i] as usize + s_new
            )
        }
    }
    // The own tokens: their call checks the caches, lengths and options, and appends.
    let own = flash_attn_with_kvcache_lse(q, k_cache, v_cache, new_kv, lens, opts)?;
    let len = pk.dim(1)?;
    if len == 0 {
        return Ok(own.0);
    }
    // The prefix: every query row of the batch sees all of it, and the sinks join the
    // denominator once, through the own part.
    let whole = FlashAttn {
        causal: false,
        sinks: None,
        kv_cache_scales: None,
        ..opts.clone()
    };
    let rows = b * s_q;
    let chunks = prefix_chunks(q.device(), rows, h, len)?;
    let chunk = len / chunks;
    let (k, v) = (
        pk.reshape((chunks, chunk, hk, d))?,
        pv.reshape((chunks, chunk, hk, d))?,
    );
    let q_rows = q.reshape((1, rows, h, d))?;
    let q_rows = match chunks {
        1 => q_rows,
        n => q_rows.broadcast_as((n, rows, h, d))?.contiguous()?,
    };
    let (out, lse) = whole.forward_with_lse(&q_rows, &k, &v)?;
    let mut parts = Vec::with_capacity(chunks + 1);
    for c in 0..chunks {
        // (rows, h, d) -> (b, s_q, h, d); the lse (h, rows) -> (b, h, s_q), a strided view.
        let o = out.get(c)?.reshape((b, s_q, h, d))?;
        let l = lse.get(c)?.reshape((h, b, s_q))?.transpose(0, 1)?;
        parts.push((o, l));
    }
    parts.push(own);
    Ok(combine(&parts)?.0)
}

/// Chunks the prefix's keys are split into: one forward's grid is a block per 128 query rows
/// per head, few for a decoding batch, so on CUDA the keys are cut (up to 16 chunks of at least
/// 512 keys, a divisor of the prefix length) until the launch has about two blocks per
/// multiprocessor (the bench's cascade: 64 sequences over an 8k prompt, 8 chunks, 5.56x the
/// unshared step against 4.07x unsplit).
fn prefix_chunks(dev: &Device, rows: usize, heads: usize, len: usize) -> Result<usize> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = dev {
        let sms = crate::cuda::device_facts(cuda)?.sms;
        let blocks = rows.div_ceil(128) * heads;
        let want = (2 * sms).div_ceil(blocks.max(1)).clamp(1, 16);
        return Ok((1..=want)
            .rev()
            .find(|&c| len.is_multiple_of(c) && len / c >= 512)
            .unwrap_or(1));
    }
    let _ = (dev, rows, heads, len);
    Ok(1)
}
