//! `candle_flash::compat`, candle-flash-attn 0.11's API: every function against
//! `attention_slow` / `attention_slow_with` where our conventions and upstream's agree, and
//! against a dense oracle whose mask follows upstream's code (the window conversions of its
//! lib.rs, the visibility rule of its kernels' mask.h) everywhere, including the window edge
//! cases where they differ; gradients through autograd; the exact signatures; and
//! candle-transformers' call sites compiled against `use candle_flash::compat as
//! candle_flash_attn;`.

mod common;

use candle::{DType, Device, IndexOp, Result, Tensor, Var, D};
use candle_flash::compat as candle_flash_attn;
use candle_flash::{attention_slow, attention_slow_with, FlashAttn};
use common::{assert_close, assert_fails, grads, randn};

/// f32 results against the f64 oracle.
const TOL: f32 = 2e-5;
/// Gradients: longer f32 sums (dS over the keys, dK over the queries and the group).
const GRAD_TOL: f32 = 1e-4;
const NAMES: [&str; 3] = ["dq", "dk", "dv"];

// ---------------------------------------------------------------------------------------
// The oracle
// ---------------------------------------------------------------------------------------

/// candle-flash-attn's window after its lib.rs conversions, in its i32 convention (-1 = none):
/// sides past `limit` (seqlen_k, or max_seqlen_k for varlen) become -1; with prefix ranges a
/// causal window gets left = limit; causal = left < 0 and right == 0; then a -1 side facing a
/// bounded one becomes `limit`.
#[derive(Clone, Copy, Debug)]
struct Upstream {
    left: i64,
    right: i64,
    causal: bool,
}

impl Upstream {
    fn new(left: Option<usize>, right: Option<usize>, limit: usize, ranges: bool) -> Self {
        let side = |w: Option<usize>| w.filter(|&w| w <= limit).map_or(-1, |w| w as i64);
        let (mut left, mut right) = (side(left), side(right));
        if ranges && left < 0 && right == 0 {
            left = limit as i64;
        }
        let causal = left < 0 && right == 0;
        if left < 0 && right >= 0 {
            left = limit as i64;
        }
        if left >= 0 && right < 0 {
            right = limit as i64;
        }
        Self {
            left,
            right,
            causal,
        }
    }

    /// mask.h: whether row `i` of a sequence of `sq` queries and `sk` keys sees key `j`, with
    /// the sequence's prefix ranges `[start, end)`.
    fn sees(&self, sq: usize, sk: usize, i: usize, j: usize, ranges: &[(i64, i64)]) -> bool {
        let (i, j, sq, sk) = (i as i64, j as i64, sq as i64, sk as i64);
        let p = i + sk - sq;
        let local = !self.causal && (self.left >= 0 || self.right >= 0);
        let prefix = || {
            ranges
                .iter()
                .any(|&(s, e)| s < e && p >= s && p < e && j >= s && j < e)
        };
        if self.causal {
            j <= p || prefix()
        } else if local {
            (j < p + 1 + self.right && j >= p - self.left) || prefix()
        } else {
            true
        }
    }
}

/// Score modifiers of the oracle.
#[derive(Clone, Copy)]
struct Dense<'a> {
    scale: f64,
    softcap: Option<f64>,
    slopes: Option<&'a [f32]>,
}

impl<'a> Dense<'a> {
    fn scale(scale: f32) -> Self {
        Self {
            scale: scale as f64,
            softcap: None,
            slopes: None,
        }
    }

    /// Attention of one sequence, q `(sq, h, d)`, k and v `(sk, hk, d)`, in f64 plain ops:
    /// scale, cap, ALiBi `-slope[h] · |i + sk - sq - j|`, the keys `visible(i, j)` allows,
    /// softmax; rows that see no key give zeros. Returned in f32; differentiable.
    fn attend(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        visible: &dyn Fn(usize, usize) -> bool,
    ) -> Result<Tensor> {
        let (sq, h, d) = q.dims3()?;
        let (sk, hk, _) = k.dims3()?;
        let dev = q.device();
        if sq == 0 || sk == 0 {
            return Tensor::zeros((sq, h, d), DType::F32, dev);
        }
        let heads = |t: &Tensor| -> Result<Tensor> {
            let t = t.to_dtype(DType::F64)?;
            let per_head = (0..h)
                .map(|x| t.narrow(1, x / (h / hk), 1))
                .collect::<Result<Vec<_>>>()?;
            Tensor::cat(&per_head, 1)?.transpose(0, 1)?.contiguous() // (h, sk, d)
        };
        let (kh, vh) = (heads(k)?, heads(v)?);
        let qh = q.to_dtype(DType::F64)?.transpose(0, 1)?.contiguous()?; // (h, sq, d)
        let mut s = (qh.matmul(&kh.t()?)? * self.scale)?; // (h, sq, sk)
        if let Some(c) = self.softcap {
            s = ((s / c)?.tanh()? * c)?;
        }
        if let Some(slopes) = self.slopes {
            let bias: Vec<f64> = (0..h)
                .flat_map(|x| {
                    (0..sq).flat_map(move |i| {
                        (0..sk).map(move |j| {
                            -(slopes[x] as f64)
                                * (i as f64 + sk as f64 - sq as f64 - j as f64).abs()
                        })
                    })
                })
                .collect();
            s = (s + Tensor::from_vec(bias, (h, sq, sk), dev)?)?;
        }
        let vis: Vec<u8> = (0..sq)
            .flat_map(|i| (0..sk).map(move |j| u8::from(visible(i, j))))
            .collect();
        let dead: Vec<f64> = (0..sq)
            .map(|i| f64::from(u8::from((0..sk).all(|j| !visible(i, j)))))
            .collect();
        let vis = Tensor::from_vec(vis, (1, sq, sk), dev)?.broadcast_as((h, sq, sk))?;
        let dead = Tensor::from_vec(dead, (1, sq, 1), dev)?;
        let neg_inf = Tensor::new(f64::NEG_INFINITY, dev)?.broadcast_as((h, sq, sk))?;
        let s = vis.where_cond(&s, &neg_inf)?;
        let max = s.max_keepdim(D::Minus1)?.detach();
        let max = dead
            .ne(0f64)?
            .broadcast_as(max.shape())?
            .where_cond(&max.zeros_like()?, &max)?;
        let e = s.broadcast_sub(&max)?.exp()?;
        let denom = e.sum_keepdim(D::Minus1)?.broadcast_add(&dead)?;
        let p = e.broadcast_div(&denom)?;
        p.matmul(&vh)?.transpose(0, 1)?.to_dtype(DType::F32) // (sq, h, d)
    }

    /// A fixed-length batch `(b, s, h, d)` under upstream's window with `limit = seqlen_k`.
    fn fixed(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        left: Option<usize>,
        right: Option<usize>,
    ) -> Result<Tensor> {
        let (b, sq, _, _) = q.dims4()?;
        let sk = k.dim(1)?;
        let up = Upstream::new(left, right, sk, false);
        let outs = (0..b)
            .map(|x| {
                self.attend(&q.i(x)?, &k.i(x)?, &v.i(x)?, &|i, j| {
                    up.sees(sq, sk, i, j, &[])
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Tensor::stack(&outs, 0)
    }

    /// A packed batch: sequence `s` is q rows `cu_q[s]..cu_q[s + 1]` and keys `keys(s)`
    /// (`(len_k, hk, d)` each), under upstream's window with `limit = max_seqlen_k` and the
    /// sequences' prefix ranges.
    #[allow(clippy::too_many_arguments)]
    fn varlen(
        &self,
        q: &Tensor,
        cu_q: &[u32],
        keys: &dyn Fn(usize) -> Result<(Tensor, Tensor)>,
        left: Option<usize>,
        right: Option<usize>,
        max_seqlen_k: usize,
        ranges: Option<&[Vec<(i64, i64)>]>,
    ) -> Result<Tensor> {
        let up = Upstream::new(left, right, max_seqlen_k, ranges.is_some());
        let mut outs = Vec::new();
        for s in 0..cu_q.len() - 1 {
            let sq = (cu_q[s + 1] - cu_q[s]) as usize;
            let (k, v) = keys(s)?;
            let sk = k.dim(0)?;
            let r: &[(i64, i64)] = ranges.map_or(&[], |r| &r[s]);
            let q_s = q.narrow(0, cu_q[s] as usize, sq)?;
            outs.push(self.attend(&q_s, &k, &v, &|i, j| up.sees(sq, sk, i, j, r))?);
        }
        Tensor::cat(&outs, 0)
    }
}

// ---------------------------------------------------------------------------------------
// Problems
// ---------------------------------------------------------------------------------------

/// Fixed-length shapes `(b, sq, sk, h, hk, d)`: seq_q < seq_k, seq_q > seq_k + 1 (where a
/// right side at seqlen_k still masks the first rows), decode, odd head_dims, MHA/GQA/MQA.
const FIXED: [(usize, usize, usize, usize, usize, usize); 4] = [
    (2, 13, 17, 6, 2, 40),
    (1, 23, 7, 4, 4, 24),
    (3, 1, 9, 2, 1, 8),
    (1, 9, 9, 3, 1, 33),
];

fn qkv(shape: (usize, usize, usize, usize, usize, usize)) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, sq, sk, h, hk, d) = shape;
    Ok((
        randn((b, sq, h, d), DType::F32)?,
        randn((b, sk, hk, d), DType::F32)?,
        randn((b, sk, hk, d), DType::F32)?,
    ))
}

/// Windows in upstream's `Option<usize>` form for a key count `sk`: none, causal, both sides,
/// one side (the other becomes `sk`), sides at and past `sk`.
fn windows(sk: usize) -> Vec<(Option<usize>, Option<usize>)> {
    vec![
        (None, None),
        (None, Some(0)),
        (Some(3), Some(0)),
        (Some(2), Some(1)),
        (Some(4), None),
        (None, Some(2)),
        (Some(0), Some(0)),
        (Some(sk), Some(sk)),
        (Some(sk + 1), Some(0)),
        (Some(1), Some(sk)),
        (None, Some(sk)),
        (Some(1000), Some(1000)),
    ]
}

fn slopes(h: usize) -> Result<Tensor> {
    let s: Vec<f32> = (0..h).map(|x| 0.5f32.powi(x as i32 + 1) * 1.7).collect();
    Tensor::new(s, &Device::Cpu)
}

fn host(t: &Tensor) -> Result<Vec<f32>> {
    t.to_vec1::<f32>()
}

/// A packed batch: per-sequence lengths, with a sequence without queries, sequences with
/// more queries than keys + 1, a single query.
struct Packed {
    lens_q: Vec<usize>,
    lens_k: Vec<usize>,
    h: usize,
    hk: usize,
    d: usize,
}

impl Packed {
    fn new() -> Self {
        Self {
            lens_q: vec![5, 0, 17, 1, 30, 8],
            lens_k: vec![5, 9, 3, 12, 4, 8],
            h: 4,
            hk: 2,
            d: 16,
        }
    }

    fn cu(lens: &[usize]) -> Vec<u32> {
        let mut cu = vec![0u32];
        for &l in lens {
            cu.push(cu[cu.len() - 1] + l as u32);
        }
        cu
    }

    fn cu_q(&self) -> Vec<u32> {
        Self::cu(&self.lens_q)
    }

    fn cu_k(&self) -> Vec<u32> {
        Self::cu(&self.lens_k)
    }

    fn max_k(&self) -> usize {
        self.lens_k.iter().copied().max().unwrap_or(0)
    }

    fn max_q(&self) -> usize {
        self.lens_q.iter().copied().max().unwrap_or(0)
    }

    fn seqlens(&self) -> Result<(Tensor, Tensor)> {
        let dev = Device::Cpu;
        Ok((
            Tensor::new(self.cu_q(), &dev)?,
            Tensor::new(self.cu_k(), &dev)?,
        ))
    }

    fn qkv(&self) -> Result<(Tensor, Tensor, Tensor)> {
        let (tq, tk) = (
            self.cu_q()[self.lens_q.len()],
            self.cu_k()[self.lens_k.len()],
        );
        Ok((
            randn((tq as usize, self.h, self.d), DType::F32)?,
            randn((tk as usize, self.hk, self.d), DType::F32)?,
            randn((tk as usize, self.hk, self.d), DType::F32)?,
        ))
    }

    /// Sequence `s`'s keys and values from packed k and v.
    fn keys<'a>(
        &'a self,
        k: &'a Tensor,
        v: &'a Tensor,
    ) -> impl Fn(usize) -> Result<(Tensor, Tensor)> + 'a {
        move |s| {
            let cu = self.cu_k();
            let (start, len) = (cu[s] as usize, self.lens_k[s]);
            Ok((k.narrow(0, start, len)?, v.narrow(0, start, len)?))
        }
    }
}

/// `attention_slow_with` on each sequence of a packed batch, concatenated.
fn per_sequence_slow(
    p: &Packed,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &FlashAttn,
) -> Result<Tensor> {
    let (cu_q, cu_k) = (p.cu_q(), p.cu_k());
    let mut outs = Vec::new();
    for s in 0..p.lens_q.len() {
        let q_s = q.narrow(0, cu_q[s] as usize, p.lens_q[s])?.unsqueeze(0)?;
        let k_s = k.narrow(0, cu_k[s] as usize, p.lens_k[s])?.unsqueeze(0)?;
        let v_s = v.narrow(0, cu_k[s] as usize, p.lens_k[s])?.unsqueeze(0)?;
        outs.push(attention_slow_with(&q_s, &k_s, &v_s, o)?.squeeze(0)?);
    }
    Tensor::cat(&outs, 0)
}

// ---------------------------------------------------------------------------------------
// Signatures and call sites
// ---------------------------------------------------------------------------------------

type R = candle::Result<Tensor>;

/// Every public function of candle-flash-attn 0.11 with its exact signature, and its op
/// struct with its five public fields and `CustomOp3`: a mismatch fails to compile.
#[test]
// The point is to spell every signature out in full.
#[allow(clippy::type_complexity)]
fn signatures_are_candle_flash_attn_s() {
    let _: fn(&Tensor, &Tensor, &Tensor, f32, bool) -> R = candle_flash_attn::flash_attn;
    let _: fn(&Tensor, &Tensor, &Tensor, f32, Option<usize>, Option<usize>) -> R =
        candle_flash_attn::flash_attn_windowed;
    let _: fn(&Tensor, &Tensor, &Tensor, &Tensor, f32, bool) -> R =
        candle_flash_attn::flash_attn_alibi;
    let _: fn(&Tensor, &Tensor, &Tensor, &Tensor, f32, Option<usize>, Option<usize>) -> R =
        candle_flash_attn::flash_attn_alibi_windowed;
    let _: fn(
        &Tensor,
        &Tensor,
        &Tensor,
        Option<&Tensor>,
        f32,
        Option<usize>,
        Option<usize>,
        f32,
    ) -> R = candle_flash_attn::flash_attn_alibi_windowed_softcap;
    let _: fn(&Tensor, &Tensor, &Tensor, &Tensor, &Tensor, usize, usize, f32, bool) -> R =
        candle_flash_attn::flash_attn_varlen;
    let _: fn(
        &Tensor,
        &Tensor,
        &Tensor,
        &Tensor,
        &Tensor,
        usize,
        usize,
        f32,
        Option<usize>,
        Option<usize>,
    ) -> R = candle_flash_attn::flash_attn_varlen_windowed;
    let _: fn(
        &Tensor,
        &Tensor,
        &Tensor,
        &Tensor,
        &Tensor,
        &Tensor,
        Option<&Tensor>,
        usize,
        usize,
        f32,
        Option<usize>,
        Option<usize>,
        usize,
        Option<f32>,
    ) -> R = candle_flash_attn::flash_attn_varlen_paged_windowed;
    let _: fn(&Tensor, &Tensor, &Tensor, &Tensor, &Tensor, &Tensor, usize, usize, f32, bool) -> R =
        candle_flash_attn::flash_attn_varlen_alibi;
    let _: fn(
        &Tensor,
        &Tensor,
        &Tensor,
        &Tensor,
        &Tensor,
        &Tensor,
        usize,
        usize,
        f32,
        Option<usize>,
        Option<usize>,
    ) -> R = candle_flash_attn::flash_attn_varlen_alibi_windowed;
    let _: fn(
        &Tensor,
        &Tensor,
        &Tensor,
        Option<&Tensor>,
        &Tensor,
        &Tensor,
        usize,
        usize,
        f32,
        Option<usize>,
        Option<usize>,
        f32,
    ) -> R = candle_flash_attn::flash_attn_varlen_alibi_windowed_softcap;

    fn custom_op3<T: candle::CustomOp3 + Send + Sync + 'static>(_: &T) {}
    let op = candle_flash_attn::FlashAttn {
        softmax_scale: 0.5f32,
        alibi_slopes: None::<Tensor>,
        window_size_left: None::<usize>,
        window_size_right: Some(0usize),
        softcap: None::<f32>,
    };
    custom_op3(&op);
}

/// candle-transformers' code, verbatim but for the import: the `flash_attn` wrapper of its
/// llama/mistral/gemma2 models and the call shapes of its models (transposed q, k, v; a scale
/// cast from f64; qwen3's direct call).
mod candle_transformers_style {
    use candle::{Result, Tensor};
    use candle_flash::compat as candle_flash_attn;

    pub fn flash_attn(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        softmax_scale: f32,
        causal: bool,
    ) -> Result<Tensor> {
        candle_flash_attn::flash_attn(q, k, v, softmax_scale, causal)
    }

    /// llama.rs's attention: q, k, v arrive as `(b, heads, seq, d)` and are transposed.
    pub fn llama(q: &Tensor, k: &Tensor, v: &Tensor, head_dim: usize) -> Result<Tensor> {
        let seq_len = q.dim(2)?;
        let q = q.transpose(1, 2)?;
        let k = k.transpose(1, 2)?;
        let v = v.transpose(1, 2)?;
        let softmax_scale = 1f32 / (head_dim as f32).sqrt();
        flash_attn(&q, &k, &v, softmax_scale, seq_len > 1)?.transpose(1, 2)
    }

    /// wuerstchen / mmdit: a scale stored as f64.
    pub fn scaled(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
        flash_attn(q, k, v, scale as f32, false)
    }

    /// qwen3.rs: the crate function called directly.
    pub fn qwen3(q: &Tensor, k: &Tensor, v: &Tensor, head_dim: usize, l: usize) -> Result<Tensor> {
        let scale = 1.0 / (head_dim as f32).sqrt();
        let causal = l > 1;
        let ctx = candle_flash_attn::flash_attn(q, k, v, scale, causal)?;
        Ok(ctx)
    }
}

#[test]
fn candle_transformers_call_sites_run() -> Result<()> {
    let (b, h, s, d) = (2, 4, 11, 32);
    let q = randn((b, h, s, d), DType::F32)?;
    let k = randn((b, h, s, d), DType::F32)?;
    let v = randn((b, h, s, d), DType::F32)?;
    let scale = 1.0 / (d as f32).sqrt();
    let out = candle_transformers_style::llama(&q, &k, &v, d)?;
    let (qt, kt, vt) = (q.transpose(1, 2)?, k.transpose(1, 2)?, v.transpose(1, 2)?);
    let expected = attention_slow(&qt, &kt, &vt, scale, true)?.transpose(1, 2)?;
    assert_close("llama", &out, &expected, TOL)?;
    let out = candle_transformers_style::scaled(&qt, &kt, &vt, 0.125f64)?;
    assert_close(
        "scaled",
        &out,
        &attention_slow(&qt, &kt, &vt, 0.125, false)?,
        TOL,
    )?;
    let out = candle_transformers_style::qwen3(&qt, &kt, &vt, d, s)?;
    assert_close(
        "qwen3",
        &out,
        &attention_slow(&qt, &kt, &vt, scale, true)?,
        TOL,
    )?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Fixed length
// ---------------------------------------------------------------------------------------

/// The oracle itself against `attention_slow_with` where upstream's window conventions and
/// ours agree (no sequence with more than seqlen_k + 1 queries; our `window` with
/// upstream's sides after its conversions, a side equal to seqlen_k included).
#[test]
fn oracle_agrees_with_attention_slow_with() -> Result<()> {
    for shape in [FIXED[0], FIXED[2], FIXED[3]] {
        let (q, k, v) = qkv(shape)?;
        let sk = shape.2;
        let s = slopes(shape.3)?;
        let s_host = host(&s)?;
        for (left, right) in windows(sk) {
            let up = Upstream::new(left, right, sk, false);
            let side = |w: i64| (w >= 0).then_some(w as usize);
            let ours = FlashAttn::new()
                .softmax_scale(0.3)
                .causal(up.causal)
                .window(side(up.left), side(up.right))
                .softcap(2.5)
                .alibi_slopes(&s);
            let dense = Dense {
                scale: 0.3,
                softcap: Some(2.5),
                slopes: Some(&s_host),
            };
            let what = format!("{shape:?} {left:?} {right:?}");
            let expected = attention_slow_with(&q, &k, &v, &ours)?;
            assert_close(
                &what,
                &dense.fixed(&q, &k, &v, left, right)?,
                &expected,
                TOL,
            )?;
        }
    }
    Ok(())
}

#[test]
fn flash_attn_matches_attention_slow() -> Result<()> {
    for shape in FIXED {
        let (q, k, v) = qkv(shape)?;
        for causal in [false, true] {
            let scale = 1.0 / (shape.5 as f32).sqrt();
            let out = candle_flash_attn::flash_attn(&q, &k, &v, scale, causal)?;
            let expected = attention_slow(&q, &k, &v, scale, causal)?;
            assert_close(&format!("{shape:?} causal {causal}"), &out, &expected, TOL)?;
        }
    }
    Ok(())
}

#[test]
fn flash_attn_windowed_follows_upstream_conventions() -> Result<()> {
    for shape in FIXED {
        let (q, k, v) = qkv(shape)?;
        for (left, right) in windows(shape.2) {
            let out = candle_flash_attn::flash_attn_windowed(&q, &k, &v, 0.2, left, right)?;
            let expected = Dense::scale(0.2).fixed(&q, &k, &v, left, right)?;
            assert_close(
                &format!("{shape:?} {left:?} {right:?}"),
                &out,
                &expected,
                TOL,
            )?;
        }
    }
    Ok(())
}

/// Where the conventions differ: 23 queries, 7 keys, a left side only. Upstream sets the
/// right side to 7, so rows 0..=8 (position p = i - 16 <= -8) see no key and rows 9..=14 see
/// keys 0..=p + 7; `FlashAttn::window` would leave the right side unbounded.
#[test]
fn one_sided_window_masks_the_first_rows_like_upstream() -> Result<()> {
    let (q, k, v) = qkv((1, 23, 7, 2, 1, 16))?;
    let out = candle_flash_attn::flash_attn_windowed(&q, &k, &v, 0.25, Some(2), None)?;
    let zeros = out.narrow(1, 0, 9)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert_eq!(zeros, 0.0, "rows before key 0's reach must be zeros");
    // Row 9 (p = -7) sees key 0 only.
    let row9 = out.i((0, 9))?;
    assert_close(
        "row 9",
        &row9,
        &v.i((0, 0))?.broadcast_as(row9.shape())?,
        TOL,
    )?;
    let ours = FlashAttn::new().softmax_scale(0.25).window(Some(2), None);
    let unbounded = attention_slow_with(&q, &k, &v, &ours)?;
    let differ = (out.narrow(1, 0, 15)? - unbounded.narrow(1, 0, 15)?)?
        .abs()?
        .max_all()?
        .to_scalar::<f32>()?;
    assert!(
        differ > 0.1,
        "upstream's rows must differ from an unbounded right side"
    );
    assert_close(
        "rows 15..",
        &out.narrow(1, 15, 8)?,
        &unbounded.narrow(1, 15, 8)?,
        TOL,
    )?;
    Ok(())
}

#[test]
fn flash_attn_alibi_matches_attention_slow_with() -> Result<()> {
    for shape in FIXED {
        let (q, k, v) = qkv(shape)?;
        let s = slopes(shape.3)?;
        for causal in [false, true] {
            let out = candle_flash_attn::flash_attn_alibi(&q, &k, &v, &s, 0.3, causal)?;
            let opts = FlashAttn::new()
                .softmax_scale(0.3)
                .causal(causal)
                .alibi_slopes(&s);
            let expected = attention_slow_with(&q, &k, &v, &opts)?;
            assert_close(&format!("{shape:?} causal {causal}"), &out, &expected, TOL)?;
        }
    }
    Ok(())
}

#[test]
fn flash_attn_alibi_windowed_follows_upstream_conventions() -> Result<()> {
    for shape in FIXED {
        let (q, k, v) = qkv(shape)?;
        let s = slopes(shape.3)?;
        let s_host = host(&s)?;
        let dense = Dense {
            slopes: Some(&s_host),
            ..Dense::scale(0.3)
        };
        for (left, right) in windows(shape.2) {
            let out =
                candle_flash_attn::flash_attn_alibi_windowed(&q, &k, &v, &s, 0.3, left, right)?;
            let expected = dense.fixed(&q, &k, &v, left, right)?;
            assert_close(
                &format!("{shape:?} {left:?} {right:?}"),
                &out,
                &expected,
                TOL,
            )?;
        }
    }
    Ok(())
}

/// A cap and ALiBi, or a cap alone; a softcap <= 0 (or NaN) is no cap, as upstream.
#[test]
fn flash_attn_alibi_windowed_softcap_follows_upstream_conventions() -> Result<()> {
    for shape in FIXED {
        let (q, k, v) = qkv(shape)?;
        let s = slopes(shape.3)?;
        let s_host = host(&s)?;
        for (with_slopes, softcap) in [(true, 1.5f32), (false, 4.0), (true, 0.0), (false, -2.0)] {
            let dense = Dense {
                scale: 0.5,
                softcap: (softcap > 0.0).then_some(softcap as f64),
                slopes: with_slopes.then_some(s_host.as_slice()),
            };
            for (left, right) in windows(shape.2) {
                let out = candle_flash_attn::flash_attn_alibi_windowed_softcap(
                    &q,
                    &k,
                    &v,
                    with_slopes.then_some(&s),
                    0.5,
                    left,
                    right,
                    softcap,
                )?;
                let expected = dense.fixed(&q, &k, &v, left, right)?;
                let what = format!("{shape:?} {left:?} {right:?} cap {softcap} {with_slopes}");
                assert_close(&what, &out, &expected, TOL)?;
            }
        }
    }
    let (q, k, v) = qkv(FIXED[0])?;
    let nan_cap = candle_flash_attn::flash_attn_alibi_windowed_softcap(
        &q,
        &k,
        &v,
        None,
        0.5,
        None,
        None,
        f32::NAN,
    )?;
    assert_close(
        "NaN cap",
        &nan_cap,
        &attention_slow(&q, &k, &v, 0.5, false)?,
        TOL,
    )?;
    Ok(())
}

/// Upstream takes any scale: a negative one reverses the scores, zero averages the keys.
#[test]
fn any_finite_scale() -> Result<()> {
    let (q, k, v) = qkv(FIXED[0])?;
    for scale in [-0.4f32, 0.0] {
        for causal in [false, true] {
            let out = candle_flash_attn::flash_attn(&q, &k, &v, scale, causal)?;
            let right = causal.then_some(0);
            let expected = Dense::scale(scale).fixed(&q, &k, &v, None, right)?;
            assert_close(&format!("scale {scale} {causal}"), &out, &expected, TOL)?;
        }
    }
    let (q, k, v) = (
        Var::from_tensor(&q)?,
        Var::from_tensor(&k)?,
        Var::from_tensor(&v)?,
    );
    let w = randn(q.shape(), DType::F32)?;
    let f = |q: &Tensor, k: &Tensor, v: &Tensor| candle_flash_attn::flash_attn(q, k, v, -0.4, true);
    let r = |q: &Tensor, k: &Tensor, v: &Tensor| Dense::scale(-0.4).fixed(q, k, v, None, Some(0));
    let (ours, theirs) = (grads(f, &q, &k, &v, &w)?, grads(r, &q, &k, &v, &w)?);
    for ((n, a), b) in NAMES.iter().zip(&ours).zip(&theirs) {
        assert_close(n, a, b, GRAD_TOL)?;
    }
    Ok(())
}

/// f16 and bf16 in, the same dtype out, close to the f32 result.
#[test]
fn half_precision_on_the_cpu() -> Result<()> {
    let (q, k, v) = qkv(FIXED[0])?;
    let expected = attention_slow(&q, &k, &v, 0.3, true)?;
    for dt in [DType::F16, DType::BF16] {
        let out = candle_flash_attn::flash_attn(
            &q.to_dtype(dt)?,
            &k.to_dtype(dt)?,
            &v.to_dtype(dt)?,
            0.3,
            true,
        )?;
        assert_eq!(out.dtype(), dt);
        assert_close(
            &format!("{dt:?}"),
            &out.to_dtype(DType::F32)?,
            &expected,
            2e-2,
        )?;
    }
    Ok(())
}

/// Gradients of the fixed-length functions, through autograd: the plain causal call against
/// `attention_slow`, and the split paths (the first rows of a one-sided window, with negated
/// ALiBi slopes) against the oracle.
#[test]
fn fixed_length_gradients() -> Result<()> {
    for shape in FIXED {
        let (q, k, v) = qkv(shape)?;
        let (q, k, v) = (
            Var::from_tensor(&q)?,
            Var::from_tensor(&k)?,
            Var::from_tensor(&v)?,
        );
        let w = randn(q.shape(), DType::F32)?;
        let check = |what: &str, ours: [Tensor; 3], theirs: [Tensor; 3]| -> Result<()> {
            for ((n, a), b) in NAMES.iter().zip(&ours).zip(&theirs) {
                assert_close(&format!("{shape:?} {what} {n}"), a, b, GRAD_TOL)?;
            }
            Ok(())
        };
        let f =
            |q: &Tensor, k: &Tensor, v: &Tensor| candle_flash_attn::flash_attn(q, k, v, 0.3, true);
        let r = |q: &Tensor, k: &Tensor, v: &Tensor| attention_slow(q, k, v, 0.3, true);
        check(
            "flash_attn",
            grads(f, &q, &k, &v, &w)?,
            grads(r, &q, &k, &v, &w)?,
        )?;

        let s = slopes(shape.3)?;
        let s_host = host(&s)?;
        let dense = Dense {
            softcap: Some(3.0),
            slopes: Some(&s_host),
            ..Dense::scale(0.3)
        };
        for (left, right) in [(Some(2), None), (None, Some(shape.2)), (Some(3), Some(1))] {
            let f = |q: &Tensor, k: &Tensor, v: &Tensor| {
                candle_flash_attn::flash_attn_alibi_windowed_softcap(
                    q,
                    k,
                    v,
                    Some(&s),
                    0.3,
                    left,
                    right,
                    3.0,
                )
            };
            let r = |q: &Tensor, k: &Tensor, v: &Tensor| dense.fixed(q, k, v, left, right);
            let what = format!("{left:?} {right:?}");
            check(&what, grads(f, &q, &k, &v, &w)?, grads(r, &q, &k, &v, &w)?)?;
        }
    }
    Ok(())
}

/// The op struct under `apply_op3`: the function's result and gradients.
#[test]
fn op_struct_applies_and_differentiates() -> Result<()> {
    let shape = FIXED[1];
    let (q, k, v) = qkv(shape)?;
    let s = slopes(shape.3)?;
    let op = || candle_flash_attn::FlashAttn {
        softmax_scale: 0.3,
        alibi_slopes: Some(s.clone()),
        window_size_left: Some(3),
        window_size_right: None,
        softcap: Some(2.0),
    };
    // A strided q: the op copies the view, not the storage.
    let qt = q.transpose(1, 2)?.contiguous()?.transpose(1, 2)?;
    let out = qt.apply_op3(&k, &v, op())?;
    let f = |q: &Tensor, k: &Tensor, v: &Tensor| {
        candle_flash_attn::flash_attn_alibi_windowed_softcap(
            q,
            k,
            v,
            Some(&s),
            0.3,
            Some(3),
            None,
            2.0,
        )
    };
    assert_close("forward", &out, &f(&q, &k, &v)?, 0.0)?;
    let (q, k, v) = (
        Var::from_tensor(&q)?,
        Var::from_tensor(&k)?,
        Var::from_tensor(&v)?,
    );
    let w = randn(q.shape(), DType::F32)?;
    let apply = |q: &Tensor, k: &Tensor, v: &Tensor| q.apply_op3(k, v, op());
    let (ours, theirs) = (grads(apply, &q, &k, &v, &w)?, grads(f, &q, &k, &v, &w)?);
    for ((n, a), b) in NAMES.iter().zip(&ours).zip(&theirs) {
        assert_close(n, a, b, 1e-6)?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Variable length
// ---------------------------------------------------------------------------------------

#[test]
fn flash_attn_varlen_matches_attention_slow() -> Result<()> {
    let p = Packed::new();
    let (q, k, v) = p.qkv()?;
    let (sq, sk) = p.seqlens()?;
    for causal in [false, true] {
        let out = candle_flash_attn::flash_attn_varlen(
            &q,
            &k,
            &v,
            &sq,
            &sk,
            p.max_q(),
            p.max_k(),
            0.3,
            causal,
        )?;
        let opts = FlashAttn::new().softmax_scale(0.3).causal(causal);
        let expected = per_sequence_slow(&p, &q, &k, &v, &opts)?;
        assert_close(&format!("causal {causal}"), &out, &expected, TOL)?;
    }
    Ok(())
}

#[test]
fn flash_attn_varlen_alibi_matches_attention_slow_with() -> Result<()> {
    let p = Packed::new();
    let (q, k, v) = p.qkv()?;
    let (sq, sk) = p.seqlens()?;
    let s = slopes(p.h)?;
    for causal in [false, true] {
        let out = candle_flash_attn::flash_attn_varlen_alibi(
            &q,
            &k,
            &v,
            &s,
            &sq,
            &sk,
            p.max_q(),
            p.max_k(),
            0.3,
            causal,
        )?;
        let opts = FlashAttn::new()
            .softmax_scale(0.3)
            .causal(causal)
            .alibi_slopes(&s);
        let expected = per_sequence_slow(&p, &q, &k, &v, &opts)?;
        assert_close(&format!("causal {causal}"), &out, &expected, TOL)?;
    }
    Ok(())
}

/// The varlen windows against the oracle, with `max_seqlen_k` the longest key sequence, a
/// larger value, and one below some sequences' lengths (upstream compares and fills the
/// sides with it, whatever it is).
#[test]
fn varlen_windowed_functions_follow_upstream_conventions() -> Result<()> {
    let p = Packed::new();
    let (q, k, v) = p.qkv()?;
    let (sq, sk) = p.seqlens()?;
    let s = slopes(p.h)?;
    let s_host = host(&s)?;
    let cu_q = p.cu_q();
    let keys = p.keys(&k, &v);
    for max_k in [p.max_k(), 40, 6] {
        for (left, right) in windows(max_k) {
            let what = format!("max_k {max_k} {left:?} {right:?}");
            let plain = Dense::scale(0.3);
            let out = candle_flash_attn::flash_attn_varlen_windowed(
                &q,
                &k,
                &v,
                &sq,
                &sk,
                p.max_q(),
                max_k,
                0.3,
                left,
                right,
            )?;
            let expected = plain.varlen(&q, &cu_q, &keys, left, right, max_k, None)?;
            assert_close(&format!("windowed {what}"), &out, &expected, TOL)?;

            let biased = Dense {
                slopes: Some(&s_host),
                ..plain
            };
            let out = candle_flash_attn::flash_attn_varlen_alibi_windowed(
                &q,
                &k,
                &v,
                &s,
                &sq,
                &sk,
                p.max_q(),
                max_k,
                0.3,
                left,
                right,
            )?;
            let expected = biased.varlen(&q, &cu_q, &keys, left, right, max_k, None)?;
            assert_close(&format!("alibi {what}"), &out, &expected, TOL)?;

            for (with_slopes, cap) in [(true, 2.0f32), (false, 0.0)] {
                let dense = Dense {
                    softcap: (cap > 0.0).then_some(cap as f64),
                    slopes: with_slopes.then_some(s_host.as_slice()),
                    ..plain
                };
                let out = candle_flash_attn::flash_attn_varlen_alibi_windowed_softcap(
                    &q,
                    &k,
                    &v,
                    with_slopes.then_some(&s),
                    &sq,
                    &sk,
                    p.max_q(),
                    max_k,
                    0.3,
                    left,
                    right,
                    cap,
                )?;
                let expected = dense.varlen(&q, &cu_q, &keys, left, right, max_k, None)?;
                assert_close(
                    &format!("softcap {cap} {with_slopes} {what}"),
                    &out,
                    &expected,
                    TOL,
                )?;
            }
        }
    }
    Ok(())
}

/// No query row at all: an empty result, whatever the keys.
#[test]
fn varlen_without_queries() -> Result<()> {
    let dev = Device::Cpu;
    let q = randn((0, 4, 16), DType::F32)?;
    let (k, v) = (
        randn((7, 2, 16), DType::F32)?,
        randn((7, 2, 16), DType::F32)?,
    );
    let sq = Tensor::new(&[0u32, 0, 0], &dev)?;
    let sk = Tensor::new(&[0u32, 3, 7], &dev)?;
    for (left, right) in [(None, None), (Some(1), None)] {
        let out = candle_flash_attn::flash_attn_varlen_windowed(
            &q, &k, &v, &sq, &sk, 0, 4, 0.3, left, right,
        )?;
        assert_eq!(out.dims(), &[0, 4, 16]);
    }
    Ok(())
}

/// `seqlens_k` may start past row 0 and end before k's last row: those rows are not read.
#[test]
fn varlen_keys_may_leave_rows_unused() -> Result<()> {
    let p = Packed::new();
    let (q, k, v) = p.qkv()?;
    let (sq, sk) = p.seqlens()?;
    let pad = |t: &Tensor| -> Result<Tensor> {
        let (_, h, d) = t.dims3()?;
        Tensor::cat(
            &[
                randn((3, h, d), DType::F32)?,
                t.clone(),
                randn((5, h, d), DType::F32)?,
            ],
            0,
        )
    };
    let shifted = (sk.clone() + 3.0)?;
    for (left, right) in [(None, Some(0)), (Some(2), None)] {
        let call = |k: &Tensor, v: &Tensor, sk: &Tensor| {
            candle_flash_attn::flash_attn_varlen_windowed(
                &q,
                k,
                v,
                &sq,
                sk,
                p.max_q(),
                p.max_k(),
                0.3,
                left,
                right,
            )
        };
        let expected = call(&k, &v, &sk)?;
        assert_close(
            "padded",
            &call(&pad(&k)?, &pad(&v)?, &shifted)?,
            &expected,
            0.0,
        )?;
    }
    Ok(())
}

/// Gradients through the varlen functions: the plain causal call against `attention_slow`
/// per sequence; a one-sided window with ALiBi (split sequences, gathered rows, negated
/// slopes) against the oracle.
#[test]
fn varlen_gradients() -> Result<()> {
    let p = Packed::new();
    let (q, k, v) = p.qkv()?;
    let (sq, sk) = p.seqlens()?;
    let (q, k, v) = (
        Var::from_tensor(&q)?,
        Var::from_tensor(&k)?,
        Var::from_tensor(&v)?,
    );
    let w = randn(q.shape(), DType::F32)?;
    let check = |what: &str, ours: [Tensor; 3], theirs: [Tensor; 3]| -> Result<()> {
        for ((n, a), b) in NAMES.iter().zip(&ours).zip(&theirs) {
            assert_close(&format!("{what} {n}"), a, b, GRAD_TOL)?;
        }
        Ok(())
    };
    let f = |q: &Tensor, k: &Tensor, v: &Tensor| {
        candle_flash_attn::flash_attn_varlen(q, k, v, &sq, &sk, p.max_q(), p.max_k(), 0.3, true)
    };
    let opts = FlashAttn::new().softmax_scale(0.3).causal(true);
    let r = |q: &Tensor, k: &Tensor, v: &Tensor| per_sequence_slow(&p, q, k, v, &opts);
    check(
        "varlen",
        grads(f, &q, &k, &v, &w)?,
        grads(r, &q, &k, &v, &w)?,
    )?;

    let s = slopes(p.h)?;
    let s_host = host(&s)?;
    let dense = Dense {
        slopes: Some(&s_host),
        ..Dense::scale(0.3)
    };
    let cu_q = p.cu_q();
    for (left, right) in [(Some(2), None), (Some(1), Some(3))] {
        let f = |q: &Tensor, k: &Tensor, v: &Tensor| {
            candle_flash_attn::flash_attn_varlen_alibi_windowed(
                q,
                k,
                v,
                &s,
                &sq,
                &sk,
                p.max_q(),
                p.max_k(),
                0.3,
                left,
                right,
            )
        };
        let r = |q: &Tensor, k: &Tensor, v: &Tensor| {
            dense.varlen(q, &cu_q, &p.keys(k, v), left, right, p.max_k(), None)
        };
        let what = format!("alibi {left:?} {right:?}");
        check(&what, grads(f, &q, &k, &v, &w)?, grads(r, &q, &k, &v, &w)?)?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Paged
// ---------------------------------------------------------------------------------------

/// A paged cache of `num_blocks` blocks of `page` rows holding the keys of `p`'s sequences in
/// shuffled blocks, sequences 4 and 5 sharing their first block.
struct Paged {
    page: usize,
    num_blocks: usize,
    /// `(batch, width)` row-major.
    table: Vec<u32>,
    width: usize,
}

impl Paged {
    fn new(p: &Packed) -> Self {
        let page = 4;
        let width = p.max_k().div_ceil(page) + 1;
        let mut table = vec![0u32; p.lens_k.len() * width];
        let mut next = 0u32;
        for (s, &len) in p.lens_k.iter().enumerate() {
            for c in 0..len.div_ceil(page) {
                table[s * width + c] = if s == 5 && c == 0 {
                    table[4 * width]
                } else {
                    next += 1;
                    next - 1
                };
            }
        }
        let num_blocks = next as usize + 2;
        // A fixed shuffle of the block ids, so that sequences' blocks are not in order.
        let shuffle = |b: u32| (b * 7 + 3) % num_blocks as u32;
        let table = table.into_iter().map(shuffle).collect();
        Self {
            page,
            num_blocks,
            table,
            width,
        }
    }

    fn cache(&self, hk: usize, d: usize) -> Result<Tensor> {
        randn((self.num_blocks, self.page, hk, d), DType::F32)
    }

    /// Sequence `s`'s `len` keys from a cache, gathered by the test's own indexing.
    fn gather(&self, cache: &Tensor, s: usize, len: usize) -> Result<Tensor> {
        let rows: Vec<u32> = (0..len)
            .map(|j| {
                self.table[s * self.width + j / self.page] * self.page as u32
                    + (j % self.page) as u32
            })
            .collect();
        let flat = cache.flatten(0, 1)?;
        flat.index_select(&Tensor::new(rows, &Device::Cpu)?, 0)
    }

    fn table(&self, batch: usize, dtype: DType) -> Result<Tensor> {
        Tensor::from_vec(self.table.clone(), (batch, self.width), &Device::Cpu)?.to_dtype(dtype)
    }
}

/// Prefix ranges per sequence of [`Packed::new`]: one covering positions of a long-query
/// sequence, overlapping ones, one starting before 0, an empty one (`start >= end`, ignored).
fn ranges() -> Vec<Vec<(i64, i64)>> {
    vec![
        vec![(1, 4), (0, 0)],
        vec![(2, 7), (3, 9)],
        vec![(-20, 2), (5, 3)],
        vec![(4, 9), (0, 0)],
        vec![(-3, 3), (1, 2)],
        vec![(2, 6), (0, 0)],
    ]
}

#[test]
fn paged_matches_the_oracle() -> Result<()> {
    let p = Packed::new();
    let paged = Paged::new(&p);
    let (q, _, _) = p.qkv()?;
    let (kc, vc) = (paged.cache(p.hk, p.d)?, paged.cache(p.hk, p.d)?);
    let (sq, sk) = p.seqlens()?;
    let cu_q = p.cu_q();
    let keys = |s: usize| -> Result<(Tensor, Tensor)> {
        let len = p.lens_k[s];
        Ok((paged.gather(&kc, s, len)?, paged.gather(&vc, s, len)?))
    };
    let r = ranges();
    let range_flat: Vec<i32> = r
        .iter()
        .flatten()
        .flat_map(|&(s, e)| [s as i32, e as i32])
        .collect();
    let range_t = Tensor::from_vec(range_flat, (p.lens_k.len(), 2, 2), &Device::Cpu)?;
    let mut wins = windows(p.max_k());
    wins.push((Some(2), Some(100)));
    for dtype in [DType::U32, DType::I32] {
        let table = paged.table(p.lens_k.len(), dtype)?;
        for with_ranges in [false, true] {
            for &(left, right) in &wins {
                for cap in [None, Some(2.0f32)] {
                    let out = candle_flash_attn::flash_attn_varlen_paged_windowed(
                        &q,
                        &kc,
                        &vc,
                        &sq,
                        &sk,
                        &table,
                        with_ranges.then_some(&range_t),
                        p.max_q(),
                        p.max_k(),
                        0.3,
                        left,
                        right,
                        paged.page,
                        cap,
                    )?;
                    let dense = Dense {
                        softcap: cap.map(f64::from),
                        ..Dense::scale(0.3)
                    };
                    let rr = with_ranges.then_some(r.as_slice());
                    let expected = dense.varlen(&q, &cu_q, &keys, left, right, p.max_k(), rr)?;
                    let what = format!("{dtype:?} ranges {with_ranges} {left:?} {right:?} {cap:?}");
                    assert_close(&what, &out, &expected, TOL)?;
                }
            }
        }
    }
    Ok(())
}

/// Gradients reach the cache blocks (summed over the two sequences sharing one), with and
/// without prefix ranges.
#[test]
fn paged_gradients() -> Result<()> {
    let p = Packed::new();
    let paged = Paged::new(&p);
    let (q, _, _) = p.qkv()?;
    let (kc, vc) = (paged.cache(p.hk, p.d)?, paged.cache(p.hk, p.d)?);
    let (sq, sk) = p.seqlens()?;
    let table = paged.table(p.lens_k.len(), DType::U32)?;
    let cu_q = p.cu_q();
    let r = ranges();
    let range_flat: Vec<i32> = r
        .iter()
        .flatten()
        .flat_map(|&(s, e)| [s as i32, e as i32])
        .collect();
    let range_t = Tensor::from_vec(range_flat, (p.lens_k.len(), 2, 2), &Device::Cpu)?;
    let (q, kc, vc) = (
        Var::from_tensor(&q)?,
        Var::from_tensor(&kc)?,
        Var::from_tensor(&vc)?,
    );
    let w = randn(q.shape(), DType::F32)?;
    for with_ranges in [false, true] {
        for (left, right) in [(None, Some(0)), (Some(3), Some(1))] {
            let f = |q: &Tensor, k: &Tensor, v: &Tensor| {
                candle_flash_attn::flash_attn_varlen_paged_windowed(
                    q,
                    k,
                    v,
                    &sq,
                    &sk,
                    &table,
                    with_ranges.then_some(&range_t),
                    p.max_q(),
                    p.max_k(),
                    0.3,
                    left,
                    right,
                    paged.page,
                    None,
                )
            };
            let rr = with_ranges.then_some(r.as_slice());
            let reference = |q: &Tensor, k: &Tensor, v: &Tensor| {
                let keys = |s: usize| -> Result<(Tensor, Tensor)> {
                    let len = p.lens_k[s];
                    Ok((paged.gather(k, s, len)?, paged.gather(v, s, len)?))
                };
                Dense::scale(0.3).varlen(q, &cu_q, &keys, left, right, p.max_k(), rr)
            };
            let ours = grads(f, &q, &kc, &vc, &w)?;
            let theirs = grads(reference, &q, &kc, &vc, &w)?;
            for ((n, a), b) in NAMES.iter().zip(&ours).zip(&theirs) {
                let what = format!("ranges {with_ranges} {left:?} {right:?} {n}");
                assert_close(&what, a, b, GRAD_TOL)?;
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------

#[test]
fn errors_name_the_argument() -> Result<()> {
    let (q, k, v) = qkv(FIXED[0])?;
    assert_fails(
        candle_flash_attn::flash_attn(&q, &k, &v, f32::NAN, false),
        &["softmax_scale"],
    );
    let bad = Tensor::ones(5, DType::F32, &Device::Cpu)?;
    assert_fails(
        candle_flash_attn::flash_attn_alibi(&q, &k, &v, &bad, 0.3, false),
        &["alibi_slopes", "(num_heads)"],
    );
    let half = slopes(6)?.to_dtype(DType::F16)?;
    assert_fails(
        candle_flash_attn::flash_attn_alibi(&q, &k, &v, &half, 0.3, false),
        &["alibi_slopes", "F32"],
    );
    assert_fails(
        candle_flash_attn::flash_attn(&q, &k.i(0)?, &v, 0.3, false),
        &["k:", "rank 4"],
    );
    assert_fails(
        candle_flash_attn::flash_attn_alibi_windowed_softcap(
            &q,
            &k,
            &v,
            None,
            0.3,
            None,
            None,
            f32::INFINITY,
        ),
        &["softcap"],
    );

    let p = Packed::new();
    let (q, k, v) = p.qkv()?;
    let (sq, sk) = p.seqlens()?;
    let varlen = |sq: &Tensor, sk: &Tensor, max_q: usize| {
        candle_flash_attn::flash_attn_varlen(&q, &k, &v, sq, sk, max_q, p.max_k(), 0.3, true)
    };
    assert_fails(varlen(&sq, &sk, p.max_q() - 1), &["max_seqlen_q", "30"]);
    assert_fails(
        varlen(&sq.to_dtype(DType::I64)?, &sk, 30),
        &["seqlens_q", "U32"],
    );
    assert_fails(
        varlen(&sq, &sk.narrow(0, 0, 3)?, 30),
        &["seqlens_k", "entries"],
    );
    let short = Tensor::new(&[0u32, 5, 9], &Device::Cpu)?;
    assert_fails(
        varlen(&short, &sk.narrow(0, 0, 3)?, 30),
        &["seqlens_q", "total rows"],
    );
    let past = (sk.clone() + 1.0)?;
    assert_fails(varlen(&sq, &past, 30), &["seqlens_k", "exceeds"]);
    let down = Tensor::new(&[0u32, 5, 4, 22, 23, 53, 61], &Device::Cpu)?;
    assert_fails(varlen(&sq, &down, 30), &["seqlens_k", "non-decreasing"]);
    assert_fails(
        candle_flash_attn::flash_attn_varlen(&q.unsqueeze(0)?, &k, &v, &sq, &sk, 30, 12, 0.3, true),
        &["q:", "rank 3"],
    );

    let paged = Paged::new(&p);
    let (kc, vc) = (paged.cache(p.hk, p.d)?, paged.cache(p.hk, p.d)?);
    let table = paged.table(p.lens_k.len(), DType::U32)?;
    let call = |table: &Tensor, page: usize, ranges: Option<&Tensor>| {
        candle_flash_attn::flash_attn_varlen_paged_windowed(
            &q,
            &kc,
            &vc,
            &sq,
            &sk,
            table,
            ranges,
            30,
            12,
            0.3,
            None,
            Some(0),
            page,
            None,
        )
    };
    assert_fails(call(&table, 8, None), &["page_block_size"]);
    assert_fails(
        call(&table.narrow(0, 0, 2)?, 4, None),
        &["block_table", "rows"],
    );
    assert_fails(
        call(&table.narrow(1, 0, 1)?, 4, None),
        &["block_table", "columns"],
    );
    let far = (table.clone() + 100.0)?;
    assert_fails(call(&far, 4, None), &["block_table", "entry"]);
    let negative = (table.to_dtype(DType::I32)? - 1000.0)?;
    assert_fails(call(&negative, 4, None), &["block_table", "-"]);
    let wrong = Tensor::zeros((6, 2, 3), DType::I32, &Device::Cpu)?;
    assert_fails(
        call(&table, 4, Some(&wrong)),
        &["mm_prefix_ranges", "shape"],
    );
    let wrong = Tensor::zeros((6, 2, 2), DType::U32, &Device::Cpu)?;
    assert_fails(call(&table, 4, Some(&wrong)), &["mm_prefix_ranges", "I32"]);
    Ok(())
}
