//! One layer's attention: q/k/v projections, rotary embeddings, and flash attention over
//! packed sequences or a KV cache (or the naive path in plain Candle ops).

use candle::{DType, Device, Result, Tensor, D};
use candle_flash::{FlashAttn, Padding};
use candle_nn::VarBuilder;

use super::cache::{fill_cache, LayerCache, NaiveCache};
use super::layers::{split_rows, Proj, RmsNorm, Rope};
use super::{AttnImpl, Config, DeviceStep, Pass};

/// The projections of one forward call: q `(n, h, d)`, k and v `(n, hk, d)`. With stacked
/// weights they are views of one matmul's output (no copies), and `qk` `(n, h + hk, d)` views
/// q and k together, for one rotary launch.
struct Qkv {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    qk: Option<Tensor>,
}

#[derive(Clone, Debug)]
pub(super) struct Attention {
    pub(super) q: Proj,
    pub(super) k: Proj,
    pub(super) v: Proj,
    pub(super) o: Proj,
    /// q, k and v weights stacked, for one matmul in inference.
    pub(super) qkv: Option<Proj>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: f64,
}

impl Attention {
    pub(super) fn load(vb: &VarBuilder, cfg: &Config) -> Result<Self> {
        let (h, hk, d) = (cfg.num_attention_heads, cfg.num_kv_heads(), cfg.head_dim());
        let e = cfg.hidden_size;
        Ok(Self {
            q: Proj::load(&vb.pp("q_proj"), h * d, e, cfg.qkv_bias())?,
            k: Proj::load(&vb.pp("k_proj"), hk * d, e, cfg.qkv_bias())?,
            v: Proj::load(&vb.pp("v_proj"), hk * d, e, cfg.qkv_bias())?,
            o: Proj::load(&vb.pp("o_proj"), e, h * d, cfg.o_bias())?,
            qkv: None,
            heads: h,
            kv_heads: hk,
            head_dim: d,
            scale: 1.0 / (d as f64).sqrt(),
        })
    }

    pub(super) fn fuse(&mut self) -> Result<()> {
        let (q, k, v) = (&self.q, &self.k, &self.v);
        if q.lora.is_some() || k.lora.is_some() || v.lora.is_some() {
            self.qkv = None;
            return Ok(());
        }
        let weight = Tensor::cat(&[&q.weight, &k.weight, &v.weight], 0)?;
        let bias = match (&q.bias, &k.bias, &v.bias) {
            (Some(a), Some(b), Some(c)) => Some(Tensor::cat(&[a, b, c], 0)?),
            _ => None,
        };
        let fused = Proj {
            weight,
            bias,
            lora: None,
        };
        let (hq, hk) = (self.heads * self.head_dim, self.kv_heads * self.head_dim);
        [self.q, self.k, self.v] = split_rows(&fused, &[hq, hk, hk])?;
        self.qkv = Some(fused);
        Ok(())
    }

    /// q, k and v of `x`, normalised by `norm` first where given.
    fn project(&self, x: &Tensor, norm: Option<&RmsNorm>) -> Result<Qkv> {
        let n = x.dim(0)?;
        let (h, hk, d) = (self.heads, self.kv_heads, self.head_dim);
        let normed;
        let x = match (norm, &self.qkv) {
            (Some(_), Some(_)) | (None, _) => x,
            (Some(nm), None) => {
                normed = nm.forward(x, false)?;
                &normed
            }
        };
        Ok(match &self.qkv {
            Some(qkv) => {
                let y = qkv.forward_normed(x, norm)?.reshape((n, h + 2 * hk, d))?;
                Qkv {
                    q: y.narrow(1, 0, h)?,
                    k: y.narrow(1, h, hk)?,
                    v: y.narrow(1, h + hk, hk)?,
                    qk: Some(y.narrow(1, 0, h + hk)?),
                }
            }
            None => Qkv {
                q: self.q.forward(x)?.reshape((n, h, d))?,
                k: self.k.forward(x)?.reshape((n, hk, d))?,
                v: self.v.forward(x)?.reshape((n, hk, d))?,
                qk: None,
            },
        })
    }

    /// q and k rotated to their tokens' positions: in inference one launch over both where
    /// they are views of one projection (`rope_thd` rotates each head alike, so this is the
    /// two launches' result bit for bit), else one each.
    fn rotate(
        &self,
        p: &Qkv,
        rope: &Rope,
        (cos, sin): &(Tensor, Tensor),
        train: bool,
    ) -> Result<(Tensor, Tensor)> {
        match (&p.qk, train) {
            (Some(qk), false) => {
                let qk = rope.apply(qk, cos, sin, false)?;
                Ok((
                    qk.narrow(1, 0, self.heads)?,
                    qk.narrow(1, self.heads, self.kv_heads)?,
                ))
            }
            _ => Ok((
                rope.apply(&p.q, cos, sin, train)?,
                rope.apply(&p.k, cos, sin, train)?,
            )),
        }
    }

    /// A decoding step's attention, one token per sequence: q and k rotated, k and v appended
    /// to each sequence's cache at its length, q attending to the cache. Returns
    /// `(b, 1, h, d)`. The rotation is done here so that moving it into the cache append
    /// (FlashAttention's `rotary_cos`/`rotary_sin`, which take the whole tables and each
    /// sequence's length as its position) changes this function only.
    fn step(
        &self,
        p: &Qkv,
        rope: &Rope,
        cos_sin: Option<&(Tensor, Tensor)>,
        cache: &mut LayerCache,
        on_device: Option<&DeviceStep>,
    ) -> Result<Tensor> {
        let opts = FlashAttn::new()
            .causal(true)
            .softmax_scale(self.scale as f32);
        // On the device the rotation happens inside the cache append (the f32 tables, at each
        // sequence's cache length): q and k go in as projected.
        let (q, k, opts) = match on_device {
            Some(_) => (
                p.q.clone(),
                p.k.clone(),
                opts.rotary(&rope.cos, &rope.sin, false),
            ),
            None => {
                let Some(cos_sin) = cos_sin else {
                    candle::bail!("a host step needs the rotary rows of its positions")
                };
                let (q, k) = self.rotate(p, rope, cos_sin, false)?;
                (q, k, opts)
            }
        };
        // (b, 1, heads, d) views: the kernels read strided rows, nothing is copied.
        let (q, k, v) = (q.unsqueeze(1)?, k.unsqueeze(1)?, p.v.unsqueeze(1)?);
        let new_kv = Some((&k, &v));
        match (cache, on_device) {
            (LayerCache::Flash(c), None) => c.append_and_attend(&q, &k, &v, &opts),
            (LayerCache::Paged(c), None) => c.append_and_attend(&q, &k, &v, &opts),
            (LayerCache::Naive(c), None) => self.naive_step(c, &q, &k, &v),
            (LayerCache::Flash(c), Some(s)) => {
                let opts = match c.scales() {
                    Some((ks, vs)) => opts.kv_cache_scales(ks, vs),
                    None => opts,
                };
                candle_flash::flash_attn_with_kvcache(&q, c.k(), c.v(), new_kv, &s.lengths, &opts)
            }
            (LayerCache::Paged(c), Some(s)) => {
                let Some(table) = &s.table else {
                    candle::bail!("a device step over a paged cache needs its block table")
                };
                let pages = c.max_pages_per_seq();
                let opts = match c.scales() {
                    Some((ks, vs)) => opts.kv_cache_scales(ks, vs),
                    None => opts,
                };
                candle_flash::flash_attn_with_paged_kvcache(
                    &q,
                    c.k(),
                    c.v(),
                    new_kv,
                    &s.lengths,
                    table,
                    pages,
                    &opts,
                )
            }
            (LayerCache::Naive(_), Some(_)) => {
                candle::bail!("a device step needs flash attention (--attention flash)")
            }
        }
    }

    /// The attention of `x` (normalised by `norm` first where given; `residual` added to the
    /// output projection where given).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward(
        &self,
        x: &Tensor,
        norm: Option<&RmsNorm>,
        residual: Option<&Tensor>,
        rope: &Rope,
        cos_sin: Option<&(Tensor, Tensor)>,
        pass: &Pass,
        attn: AttnImpl,
        cache: Option<&mut LayerCache>,
        layer: usize,
    ) -> Result<Tensor> {
        let n = x.dim(0)?;
        let p = self.project(x, norm)?;
        let y = match pass {
            Pass::Packed {
                varlen,
                seqlens,
                train,
            } => {
                let Some(cos_sin) = cos_sin else {
                    candle::bail!("a packed pass needs the rotary rows of its positions")
                };
                let (q, k) = self.rotate(&p, rope, cos_sin, train.is_some())?;
                let v = &p.v;
                let y = match attn {
                    AttnImpl::Flash => {
                        let mut opts = FlashAttn::new()
                            .causal(true)
                            .softmax_scale(self.scale as f32)
                            .deterministic(train.is_some_and(|t| t.deterministic));
                        if let Some(t) = train.filter(|t| t.attn_dropout > 0.0) {
                            opts = opts.dropout(t.attn_dropout).seed(t.seed + layer as u64);
                        }
                        opts.forward_varlen(&q, &k, v, varlen)?
                    }
                    AttnImpl::Naive => {
                        let p = train.map(|t| t.attn_dropout).unwrap_or(0.0);
                        self.naive_packed(&q, &k, v, seqlens, p)?
                    }
                };
                if let Some(cache) = cache {
                    fill_cache(cache, &k, v, seqlens)?;
                }
                y
            }
            Pass::Step(on_device) => {
                let Some(cache) = cache else {
                    candle::bail!("a decoding step needs a cache")
                };
                self.step(&p, rope, cos_sin, cache, *on_device)?
            }
        };
        self.o
            .forward_add(&y.reshape((n, self.heads * self.head_dim))?, residual)
    }

    /// `(b, s, hk, d)` → `(b, h, s, d)` with each K/V head copied for its query heads.
    fn repeat_kv(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.transpose(1, 2)?;
        let group = self.heads / self.kv_heads;
        if group == 1 {
            return x.contiguous();
        }
        let (b, hk, s, d) = x.dims4()?;
        x.unsqueeze(2)?
            .broadcast_as((b, hk, group, s, d))?
            .reshape((b, hk * group, s, d))
    }

    /// dropout(softmax(q k^T * scale + mask)) v in plain ops: q `(b, sq, h, d)`, k and v
    /// `(b, h, sk, d)` (heads repeated), mask broadcast to `(b, h, sq, sk)`. Returns
    /// `(b, sq, h, d)`.
    fn naive_core(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &Tensor,
        dropout: f32,
    ) -> Result<Tensor> {
        let dt = q.dtype();
        let q = q.transpose(1, 2)?.contiguous()?;
        let scores = (q.matmul(&k.t()?)? * self.scale)?.to_dtype(DType::F32)?;
        let scores = scores.broadcast_add(mask)?;
        let mut p = candle_nn::ops::softmax(&scores, D::Minus1)?.to_dtype(dt)?;
        if dropout > 0.0 {
            p = candle_nn::ops::dropout(&p, dropout)?;
        }
        p.matmul(v)?.transpose(1, 2)
    }

    fn naive_packed(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        seqlens: &[usize],
        dropout: f32,
    ) -> Result<Tensor> {
        let max = seqlens.iter().copied().max().unwrap_or(0);
        let pad = Padding::from_lengths(seqlens, max)?;
        // Padding scatters contiguous rows (q, k and v may be views of one projection).
        let pad_rows = |t: &Tensor| pad.pad(&t.contiguous()?);
        let (qp, kp, vp) = (pad_rows(q)?, pad_rows(k)?, pad_rows(v)?);
        let mask = packed_mask(seqlens, max, q.device())?;
        let (kr, vr) = (self.repeat_kv(&kp)?, self.repeat_kv(&vp)?);
        let y = self.naive_core(&qp, &kr, &vr, &mask, dropout)?;
        pad.unpad(&y.contiguous()?)
    }

    fn naive_step(
        &self,
        cache: &mut NaiveCache,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Tensor> {
        let (k, v) = (k.transpose(1, 2)?, v.transpose(1, 2)?); // (b, hk, 1, d)
        let (k, v) = match &cache.kv {
            Some((ck, cv)) => (Tensor::cat(&[ck, &k], 2)?, Tensor::cat(&[cv, &v], 2)?),
            None => (k.contiguous()?, v.contiguous()?),
        };
        cache.kv = Some((k.clone(), v.clone()));
        let keys = k.dim(2)?;
        let b = q.dim(0)?;
        // Key j of sequence b is real when it is one of its prompt tokens or a generated one.
        let mut mask = vec![0f32; b * keys];
        for (s, row) in mask.chunks_mut(keys).enumerate() {
            let plen = cache.prompt_lens.get(s).copied().unwrap_or(0);
            for (j, m) in row.iter_mut().enumerate() {
                if j >= plen && j < cache.prompt_max {
                    *m = f32::NEG_INFINITY;
                }
            }
        }
        let mask = Tensor::from_vec(mask, (b, 1, 1, keys), q.device())?;
        let k = self.repeat_kv(&k.transpose(1, 2)?)?;
        let v = self.repeat_kv(&v.transpose(1, 2)?)?;
        self.naive_core(q, &k, &v, &mask, 0.0)
    }
}

/// The additive mask of a right-padded batch `(b, 1, max, max)`: causal within each
/// sequence, padded keys hidden (padded query rows see key 0 so no row is empty).
fn packed_mask(seqlens: &[usize], max: usize, dev: &Device) -> Result<Tensor> {
    let mut m = vec![f32::NEG_INFINITY; seqlens.len() * max * max];
    for (b, &len) in seqlens.iter().enumerate() {
        for i in 0..max {
            let row = &mut m[(b * max + i) * max..][..max];
            let visible = if i < len { i + 1 } else { 1 };
            row[..visible].fill(0.0);
        }
    }
    Tensor::from_vec(m, (seqlens.len(), 1, max, max), dev)
}
