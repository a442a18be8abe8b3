//! The two KV-cache ops behind [`crate::flash_attn_with_kvcache`]:
//!
//! - [`AppendOp`], an in-place op (`InplaceOp2`) that writes new keys or values into the
//!   cache at each sequence's current length (applied once to k, once to v);
//! - [`DecodeOp`], a `CustomOp3` over `(q, k_cache, v_cache)`: the `s_q` query tokens of
//!   every sequence attend to that sequence's cached prefix.
//!
//! Both read the cache through a [`Paging`]: contiguous `(b, capacity, hk, d)` or vLLM-style
//! pages `(num_pages, page_size, hk, d)` with a block table. The CPU attention gathers each
//! sequence's prefix into a packed batch and runs the forward pass of `cpu.rs` on it as a
//! variable-length problem, so decoding and prefill share one online-softmax loop.

use std::sync::{Arc, Mutex};

use candle::backend::BackendStorage;
use candle::{bail, CpuStorage, CustomOp3, DType, InplaceOp2, Layout, Result, Shape, Tensor};
use float8::F8E4M3;
use half::{bf16, f16};

use crate::cpu;
use crate::params::cumulative;
use crate::params::{AppendProblem, AttnShape, DecodeProblem, Paging, Problem, SeqOffsets};

/// How the CPU finds a cache row: the paging with its block table on the host.
enum HostPaging<'a> {
    Contiguous {
        capacity: usize,
    },
    Paged {
        page_size: usize,
        max_pages: usize,
        block_table: &'a [u32],
    },
}

impl<'a> HostPaging<'a> {
    fn of(paging: &'a Paging) -> Result<Self> {
        Ok(match paging {
            Paging::Contiguous { capacity } => HostPaging::Contiguous {
                capacity: *capacity,
            },
            Paging::Paged {
                page_size,
                max_pages,
                block_table,
                ..
            } => HostPaging::Paged {
                page_size: *page_size,
                max_pages: *max_pages,
                block_table: block_table.host("block_table")?,
            },
        })
    }

    /// Row of the cache (in units of `hk · d` elements from the cache's first element) that
    /// holds token `j` of sequence `b`.
    fn row(&self, b: usize, j: usize) -> usize {
        match *self {
            HostPaging::Contiguous { capacity } => b * capacity + j,
            HostPaging::Paged {
                page_size,
                max_pages,
                block_table,
            } => block_table[b * max_pages + j / page_size] as usize * page_size + j % page_size,
        }
    }
}

/// Rows the cache tensor has: `b · capacity`, or `num_pages · page_size`.
fn cache_rows(paging: &Paging, b: usize) -> usize {
    match paging {
        Paging::Contiguous { capacity } => b * capacity,
        Paging::Paged {
            page_size,
            num_pages,
            ..
        } => num_pages * page_size,
    }
}

/// The cache's elements as a slice of `rows · row_len` (it must be contiguous; it may start
/// at an offset).
fn cache_range(layout: &Layout, rows: usize, row_len: usize, len: usize) -> Result<(usize, usize)> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        bail!(
            "kv-cache: the cache must be contiguous, got strides {:?}",
            layout.stride()
        )
    };
    if end - start != rows * row_len || end > len {
        bail!(
            "kv-cache: the cache has {} elements, expected {rows} rows of {row_len}",
            end - start
        )
    }
    Ok((start, end))
}

/// Writes `new` `(b, s_new, hk, d)` into the cache at rows `start[b]..start[b] + s_new` of
/// each sequence, in place. The caller has checked that the rows fit. With rotary embedding
/// (CUDA only: the CPU rotates with tensor ops first) the rows are rotated on the way and the
/// launch also returns the rotated queries.
pub(crate) struct AppendOp {
    problem: AppendProblem,
    /// The rotated queries `(b, s_q, h, d)`, written by `cuda_fwd` when rotary is set.
    q_rot: Mutex<Option<Tensor>>,
    /// An FP8 cache on the CPU: the problem's per-head scales, read before the op runs (not
    /// inside it, where the new rows' storage is locked and might be the scales').
    host_scale: Option<Vec<f32>>,
}

impl AppendOp {
    pub fn new(problem: AppendProblem) -> Result<Self> {
        let host_scale = host_scale(problem.quant.as_ref().map(|s| &s.0))?;
        Ok(Self {
            problem,
            q_rot: Mutex::new(None),
            host_scale,
        })
    }

    /// Appends `new` to `cache` in place (no-op when there is nothing to write); returns the
    /// rotated queries when the problem rotates.
    pub fn run(&self, cache: &Tensor, new: &Tensor) -> Result<Option<Tensor>> {
        let p = &self.problem;
        let q_rows = p.rotary.as_ref().map_or(0, |r| r.s_q * r.h);
        if p.b * p.d * (p.s_new * p.hk + q_rows) == 0 {
            return Ok(None);
        }
        cache.inplace_op2(new, self)?;
        Ok(self.q_rot.lock().ok().and_then(|mut g| g.take()))
    }
}

impl InplaceOp2 for AppendOp {
    fn name(&self) -> &'static str {
        "flash-attn-kvcache-append"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        let p = &self.problem;
        if p.rotary.is_some() {
            bail!("kv-cache append: the CPU rotates before appending, not inside the op")
        }
        match (s1, s2, &self.host_scale) {
            (CpuStorage::F32(c), CpuStorage::F32(n), None) => append(p, c, l1, n, l2, same),
            (CpuStorage::F16(c), CpuStorage::F16(n), None) => append(p, c, l1, n, l2, same),
            (CpuStorage::BF16(c), CpuStorage::BF16(n), None) => append(p, c, l1, n, l2, same),
            (CpuStorage::F8E4M3(c), CpuStorage::F32(n), Some(s)) => {
                append(p, c, l1, n, l2, |h, x| quantize(x, s[h]))
            }
            (CpuStorage::F8E4M3(c), CpuStorage::F16(n), Some(s)) => {
                append(p, c, l1, n, l2, |h, x: f16| quantize(x.to_f32(), s[h]))
            }
            (CpuStorage::F8E4M3(c), CpuStorage::BF16(n), Some(s)) => {
                append(p, c, l1, n, l2, |h, x: bf16| quantize(x.to_f32(), s[h]))
            }
            (c, n, s) => bail!(
                "kv-cache append: expected a cache and new rows of one dtype among F32, F16, \
                 BF16, or an F8E4M3 cache with scales, got {:?} and {:?} ({} scales)",
                c.dtype(),
                n.dtype(),
                if s.is_some() { "with" } else { "without" }
            ),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle::CudaStorage,
        l1: &Layout,
        s2: &candle::CudaStorage,
        l2: &Layout,
    ) -> Result<()> {
        if let Some(q) = crate::cuda::append(&self.problem, s1, l1, s2, l2)? {
            let p = &self.problem;
            let h = p.rotary.as_ref().map_or(0, |r| r.h);
            let s_q = p.rotary.as_ref().map_or(0, |r| r.s_q);
            let none = candle::op::BackpropOp::none();
            let q = Tensor::from_storage(candle::Storage::Cuda(q), (p.b, s_q, h, p.d), none, false);
            if let Ok(mut guard) = self.q_rot.lock() {
                *guard = Some(q);
            }
        }
        Ok(())
    }
}

/// One new element into a cache of its own dtype.
fn same<T>(_head: usize, x: T) -> T {
    x
}

/// One new element into an e4m3 cache: `x / scale` by a true f32 division, then rounded to
/// nearest even, saturating at ±448 (NaN stays NaN), the bytes the CUDA append writes.
fn quantize(x: f32, scale: f32) -> F8E4M3 {
    F8E4M3::from_f32(x / scale)
}

/// A scale tensor's values on the host when it lives on the CPU (CUDA kernels read it there).
fn host_scale(t: Option<&Tensor>) -> Result<Option<Vec<f32>>> {
    match t {
        Some(t) if t.device().is_cpu() => Ok(Some(t.to_vec1::<f32>()?)),
        _ => Ok(None),
    }
}

/// The CPU append: `new` may have any strides; `cache` must be contiguous. Element `x` of
/// head `h` is stored as `store(h, x)`.
fn append<S: Copy, T>(
    p: &AppendProblem,
    cache: &mut [T],
    cache_layout: &Layout,
    new: &[S],
    new_layout: &Layout,
    store: impl Fn(usize, S) -> T,
) -> Result<()> {
    let row_len = p.hk * p.d;
    let (c0, c1) = cache_range(
        cache_layout,
        cache_rows(&p.paging, p.b),
        row_len,
        cache.len(),
    )?;
    let cache = &mut cache[c0..c1];
    let &[sb, si, sh, sd] = new_layout.stride() else {
        bail!(
            "kv-cache append: expected rank 4 new rows, got shape {:?}",
            new_layout.dims()
        )
    };
    let n0 = new_layout.start_offset();
    let paging = HostPaging::of(&p.paging)?;
    let start = p.start.host("cache_seqlens")?;
    let new_lens = match &p.new_lens {
        Some(lens) => Some(lens.host("seqlens_q")?),
        None => None,
    };
    for (b, &first) in start.iter().enumerate().take(p.b) {
        let n = new_lens.map_or(p.s_new, |l| (l[b] as usize).min(p.s_new));
        for i in 0..n {
            let row = paging.row(b, first as usize + i);
            let dst = &mut cache[row * row_len..][..row_len];
            for (h, dst) in dst.chunks_exact_mut(p.d).enumerate() {
                let src = n0 + b * sb + i * si + h * sh;
                dst.iter_mut()
                    .enumerate()
                    .for_each(|(e, x)| *x = store(h, new[src + e * sd]));
            }
        }
    }
    Ok(())
}

/// Attention of `q` `(b, s_q, h, d)` over the first `seqlens[b]` tokens of each sequence of
/// the cache. Inference only: it has no backward, so a gradient through its output is
/// Candle's "no backward" error.
pub(crate) struct DecodeOp {
    problem: DecodeProblem,
    /// `(b, h, s_q)` f32 when `problem.want_lse`, written by `cpu_fwd` / `cuda_fwd`; shared
    /// with `run`, which hands the op itself to Candle.
    lse: Arc<Mutex<Option<Tensor>>>,
    /// An FP8 cache on the CPU: the K and V scales, read by `run` before the op locks q's
    /// storage (which the scales might share).
    host_scales: Option<[Vec<f32>; 2]>,
}

impl DecodeOp {
    pub fn new(problem: DecodeProblem) -> Self {
        Self {
            problem,
            lse: Arc::new(Mutex::new(None)),
            host_scales: None,
        }
    }

    /// `(b, s_q, h, d)`.
    fn out_shape(&self) -> Shape {
        let p = &self.problem;
        Shape::from((p.b, p.s_q, p.h, p.d))
    }

    /// Runs the op: `(b, s_q, h, d)` in q's dtype, and the LSE `(b, h, s_q)` when the problem
    /// asks for it.
    pub fn run(
        mut self,
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
    ) -> Result<(Tensor, Option<Tensor>)> {
        if let Some(s) = &self.problem.kv_scales {
            if let (Some(k), Some(v)) = (host_scale(Some(&s.k))?, host_scale(Some(&s.v))?) {
                self.host_scales = Some([k, v]);
            }
        }
        let p = &self.problem;
        if p.b * p.s_q * p.h == 0 {
            let out = Tensor::zeros(self.out_shape(), q.dtype(), q.device())?;
            let lse = Tensor::zeros((p.b, p.h, p.s_q), DType::F32, q.device())?;
            return Ok((out, p.want_lse.then_some(lse)));
        }
        let want_lse = p.want_lse;
        let slot = self.lse.clone();
        let out = q.apply_op3(k_cache, v_cache, self)?;
        if !want_lse {
            return Ok((out, None));
        }
        let lse = slot.lock().ok().and_then(|mut g| g.take());
        match lse {
            Some(lse) => Ok((out, Some(lse))),
            None => bail!("kv-cache: the attention kept no LSE"),
        }
    }

    /// The decode output's `(b, s_q, h, d)` and LSE's `(b, h, s_q)` for the sinks' fix-up.
    fn sink_layout(&self) -> crate::sinks::SinkLayout {
        let p = &self.problem;
        crate::sinks::SinkLayout {
            outer: p.b,
            rows: p.s_q,
            heads: p.h,
            d: p.d,
        }
    }

    fn keep_lse(&self, lse: Tensor) {
        if let Ok(mut guard) = self.lse.lock() {
            *guard = Some(lse);
        }
    }

    /// The real query rows per sequence (all `s_q` unless ragged).
    fn q_lens(&self) -> Result<Vec<usize>> {
        let p = &self.problem;
        Ok(match &p.q_lens {
            Some(lens) => lens
                .host("seqlens_q")?
                .iter()
                .map(|&l| l as usize)
                .collect(),
            None => vec![p.s_q; p.b],
        })
    }

    /// The same attention as a packed variable-length problem over the gathered prefixes:
    /// sequence `b` has `q_lens[b]` query rows and `seqlens[b]` key rows.
    fn varlen_problem(&self) -> Result<Problem> {
        let p = &self.problem;
        let lens_k: Vec<usize> = p
            .seqlens
            .host("cache_seqlens")?
            .iter()
            .map(|&l| l as usize)
            .collect();
        let cu_q = cumulative(&self.q_lens()?, "seqlen_q")?;
        let cu_k = cumulative(&lens_k, "cache_seqlens")?;
        Ok(Problem {
            shape: AttnShape {
                b: p.b,
                sq: p.s_q,
                sk: lens_k.iter().copied().max().unwrap_or(0),
                h: p.h,
                hk: p.hk,
                d: p.d,
                total_q: cu_q[p.b] as usize,
                total_k: cu_k[p.b] as usize,
            },
            scale: p.scale,
            causal: p.causal,
            dropout: None,
            mods: p.mods.clone(),
            varlen: Some(Arc::new(SeqOffsets { cu_q, cu_k })),
        })
    }
}

impl CustomOp3 for DecodeOp {
    fn name(&self) -> &'static str {
        "flash-attn-kvcache"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let p = &self.problem;
        let q = cpu::gather_f32(s1, l1)?;
        let [k_scale, v_scale] = match &self.host_scales {
            Some([k, v]) => [Some(k.as_slice()), Some(v.as_slice())],
            None => [None, None],
        };
        let k = gather_prefixes(p, s2, l2, k_scale)?;
        let v = gather_prefixes(p, s3, l3, v_scale)?;
        // The real query rows, packed; padding rows (ragged queries) come back as zeros.
        let q_lens = self.q_lens()?;
        let row = p.h * p.d;
        let rows = |b: usize| (b * p.s_q)..(b * p.s_q + q_lens[b]);
        let packed_q: Vec<f32> = (0..p.b)
            .flat_map(|b| rows(b).flat_map(|r| q[r * row..][..row].iter().copied()))
            .collect();
        let (packed, lse) = cpu::attn_fwd(&self.varlen_problem()?, &packed_q, &k, &v)?;
        let mut out = vec![0f32; p.b * p.s_q * row];
        let mut lse_out = vec![f32::NEG_INFINITY; p.b * p.h * p.s_q];
        let total_q: usize = q_lens.iter().sum();
        let mut t = 0;
        for b in 0..p.b {
            for r in rows(b) {
                out[r * row..][..row].copy_from_slice(&packed[t * row..][..row]);
                for h in 0..p.h {
                    // Packed LSE is (h, total_q).
                    lse_out[(b * p.h + h) * p.s_q + r - b * p.s_q] = lse[h * total_q + t];
                }
                t += 1;
            }
        }
        if let Some(sinks) = &p.sinks {
            let sinks = sinks.to_vec1::<f32>()?;
            crate::sinks::fix_up_host(&mut out, &mut lse_out, &sinks, self.sink_layout());
        }
        if p.want_lse {
            let shape = (p.b, p.h, p.s_q);
            self.keep_lse(Tensor::from_vec(lse_out, shape, &candle::Device::Cpu)?);
        }
        Ok((cpu::to_storage(out, s1.dtype())?, self.out_shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle::CudaStorage,
        l1: &Layout,
        s2: &candle::CudaStorage,
        l2: &Layout,
        s3: &candle::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle::CudaStorage, Shape)> {
        let p = &self.problem;
        let (mut out, mut lse) = crate::cuda::decode(p, (s1, l1), (s2, l2), (s3, l3))?;
        if let (Some(sinks), Some(lse)) = (&p.sinks, lse.as_mut()) {
            crate::sinks::fix_up_cuda(&mut out, lse, sinks, self.sink_layout())?;
        }
        if let Some(lse) = lse.filter(|_| p.want_lse) {
            let shape = (self.problem.b, self.problem.h, self.problem.s_q);
            let storage = candle::Storage::Cuda(lse);
            let none = candle::op::BackpropOp::none();
            self.keep_lse(Tensor::from_storage(storage, shape, none, false));
        }
        Ok((out, self.out_shape()))
    }
}

/// The first `seqlens[b]` tokens of every sequence of a cache, packed in f32:
/// `(sum of seqlens, hk, d)`. An F8E4M3 cache comes with its per-head `scale`: each element,
/// as f32, is multiplied by its head's (the real value, as the CUDA kernels see it).
fn gather_prefixes(
    p: &DecodeProblem,
    storage: &CpuStorage,
    layout: &Layout,
    scale: Option<&[f32]>,
) -> Result<Vec<f32>> {
    Ok(match (storage, scale) {
        (CpuStorage::F32(x), None) => prefixes(p, x, layout, |x| x)?,
        (CpuStorage::F16(x), None) => prefixes(p, x, layout, f16::to_f32)?,
        (CpuStorage::BF16(x), None) => prefixes(p, x, layout, bf16::to_f32)?,
        (CpuStorage::F8E4M3(x), Some(scale)) => {
            let mut out = prefixes(p, x, layout, |x| x.to_f32())?;
            // Rows of hk heads of d elements: chunk i belongs to head i % hk.
            for (i, head) in out.chunks_exact_mut(p.d.max(1)).enumerate() {
                let s = scale[i % p.hk.max(1)];
                head.iter_mut().for_each(|x| *x *= s);
            }
            out
        }
        (s, scale) => bail!(
            "kv-cache: dtype {:?} is not supported on the CPU {} scales, expected F32, F16 or \
             BF16 without, or F8E4M3 with",
            s.dtype(),
            if scale.is_some() { "with" } else { "without" }
        ),
    })
}

fn prefixes<T: Copy>(
    p: &DecodeProblem,
    cache: &[T],
    layout: &Layout,
    f: impl Fn(T) -> f32,
) -> Result<Vec<f32>> {
    let row_len = p.hk * p.d;
    let (c0, c1) = cache_range(layout, cache_rows(&p.paging, p.b), row_len, cache.len())?;
    let cache = &cache[c0..c1];
    let seqlens = p.seqlens.host("cache_seqlens")?;
    let paging = HostPaging::of(&p.paging)?;
    let total: usize = seqlens.iter().map(|&l| l as usize).sum();
    let mut out = Vec::with_capacity(total * row_len);
    for (b, &len) in seqlens.iter().enumerate() {
        for j in 0..len as usize {
            let row = paging.row(b, j);
            out.extend(cache[row * row_len..][..row_len].iter().map(|&x| f(x)));
        }
    }
    Ok(out)
}
