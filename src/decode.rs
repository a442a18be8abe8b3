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

use std::sync::Arc;

use candle::backend::BackendStorage;
use candle::{bail, CpuStorage, CustomOp3, InplaceOp2, Layout, Result, Shape, Tensor};
use half::{bf16, f16};

use crate::cpu;
use crate::params::cumulative;
use crate::params::{AppendProblem, AttnShape, DecodeProblem, Paging, Problem, SeqOffsets};

/// Row of the cache (in units of `hk · d` elements from the cache's first element) that holds
/// token `j` of sequence `b`.
fn cache_row(paging: &Paging, b: usize, j: usize) -> usize {
    match paging {
        Paging::Contiguous { capacity } => b * capacity + j,
        Paging::Paged {
            page_size,
            max_pages,
            block_table,
            ..
        } => block_table[b * max_pages + j / page_size] as usize * page_size + j % page_size,
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
/// each sequence, in place. The caller has checked that the rows fit.
pub(crate) struct AppendOp(pub AppendProblem);

impl AppendOp {
    /// Appends `new` to `cache` in place (no-op when there is nothing to write).
    pub fn run(&self, cache: &Tensor, new: &Tensor) -> Result<()> {
        let p = &self.0;
        if p.b * p.s_new * p.hk * p.d == 0 {
            return Ok(());
        }
        cache.inplace_op2(new, self)
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
        match (s1, s2) {
            (CpuStorage::F32(c), CpuStorage::F32(n)) => append(&self.0, c, l1, n, l2),
            (CpuStorage::F16(c), CpuStorage::F16(n)) => append(&self.0, c, l1, n, l2),
            (CpuStorage::BF16(c), CpuStorage::BF16(n)) => append(&self.0, c, l1, n, l2),
            (c, n) => bail!(
                "kv-cache append: expected a cache and new rows of one dtype among F32, F16, \
                 BF16, got {:?} and {:?}",
                c.dtype(),
                n.dtype()
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
        crate::cuda::append(&self.0, s1, l1, s2, l2)
    }
}

/// The CPU append: `new` may have any strides; `cache` must be contiguous.
fn append<T: Copy>(
    p: &AppendProblem,
    cache: &mut [T],
    cache_layout: &Layout,
    new: &[T],
    new_layout: &Layout,
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
    for b in 0..p.b {
        for i in 0..p.s_new {
            let row = cache_row(&p.paging, b, p.start[b] as usize + i);
            let dst = &mut cache[row * row_len..][..row_len];
            for (h, dst) in dst.chunks_exact_mut(p.d).enumerate() {
                let src = n0 + b * sb + i * si + h * sh;
                if sd == 1 {
                    dst.copy_from_slice(&new[src..][..p.d]);
                } else {
                    dst.iter_mut()
                        .enumerate()
                        .for_each(|(e, x)| *x = new[src + e * sd]);
                }
            }
        }
    }
    Ok(())
}

/// Attention of `q` `(b, s_q, h, d)` over the first `seqlens[b]` tokens of each sequence of
/// the cache. Inference only: it has no backward, so a gradient through its output is
/// Candle's "no backward" error.
pub(crate) struct DecodeOp(pub DecodeProblem);

impl DecodeOp {
    /// `(b, s_q, h, d)`.
    fn out_shape(&self) -> Shape {
        let p = &self.0;
        Shape::from((p.b, p.s_q, p.h, p.d))
    }

    /// Runs the op: `(b, s_q, h, d)` in q's dtype.
    pub fn run(self, q: &Tensor, k_cache: &Tensor, v_cache: &Tensor) -> Result<Tensor> {
        let p = &self.0;
        if p.b * p.s_q * p.h == 0 {
            return Tensor::zeros(self.out_shape(), q.dtype(), q.device());
        }
        q.apply_op3(k_cache, v_cache, self)
    }

    /// The same attention as a packed variable-length problem over the gathered prefixes:
    /// sequence `b` has `s_q` query rows and `seqlens[b]` key rows.
    fn varlen_problem(&self) -> Result<Problem> {
        let p = &self.0;
        let lens_k: Vec<usize> = p.seqlens.iter().map(|&l| l as usize).collect();
        let cu_q = cumulative(&vec![p.s_q; p.b], "seqlen_q")?;
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
        let q = cpu::gather_f32(s1, l1)?;
        let k = gather_prefixes(&self.0, s2, l2)?;
        let v = gather_prefixes(&self.0, s3, l3)?;
        let (out, _lse) = cpu::attn_fwd(&self.varlen_problem()?, &q, &k, &v)?;
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
        let out = crate::cuda::decode(&self.0, (s1, l1), (s2, l2), (s3, l3))?;
        Ok((out, self.out_shape()))
    }
}

/// The first `seqlens[b]` tokens of every sequence of a cache, packed in f32:
/// `(sum of seqlens, hk, d)`.
fn gather_prefixes(p: &DecodeProblem, storage: &CpuStorage, layout: &Layout) -> Result<Vec<f32>> {
    Ok(match storage {
        CpuStorage::F32(x) => prefixes(p, x, layout, |x| x)?,
        CpuStorage::F16(x) => prefixes(p, x, layout, f16::to_f32)?,
        CpuStorage::BF16(x) => prefixes(p, x, layout, bf16::to_f32)?,
        s => bail!(
            "kv-cache: dtype {:?} is not supported on the CPU, expected F32, F16 or BF16",
            s.dtype()
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
    let total: usize = p.seqlens.iter().map(|&l| l as usize).sum();
    let mut out = Vec::with_capacity(total * row_len);
    for (b, &len) in p.seqlens.iter().enumerate() {
        for j in 0..len as usize {
            let row = cache_row(&p.paging, b, j);
            out.extend(cache[row * row_len..][..row_len].iter().map(|&x| f(x)));
        }
    }
    Ok(out)
}
