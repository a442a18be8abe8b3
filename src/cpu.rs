//! The CPU implementation: FlashAttention-2 Algorithms 1 (forward) and 2 (backward) in f32
//! math, whatever the storage dtype. Tensors arrive as contiguous row-major `Vec<f32>`s
//! ([`gather_f32`]); each task copies the rows of one head into a `(seqlen, head_dim)` matrix,
//! so the loops below read like the paper.
//!
//! Tasks are independent and their results are combined in a fixed order, so the output does
//! not depend on the number of threads: forward and backward are deterministic.

use candle::backend::BackendStorage;
use candle::{bail, CpuStorage, DType, Layout, Result};
use half::{bf16, f16};

use crate::params::Problem;

/// Keys per tile (Algorithm 1's `B_c`). A 64 × 256 f32 tile of K plus one of V is 128 KiB,
/// which stays in L2 while every row of a query tile reads it.
const KEY_BLOCK: usize = 64;
/// Query rows per tile (Algorithm 1's `B_r`): the rows that share one pass over a K/V tile.
const QUERY_BLOCK: usize = 32;
/// Below this many multiply-adds a call runs on the calling thread: spawning threads costs
/// more than it saves.
const MIN_PARALLEL_WORK: usize = 1 << 18;

/// Copies a (possibly strided, offset) tensor into a contiguous row-major `Vec<f32>`.
pub(crate) fn gather_f32(storage: &CpuStorage, layout: &Layout) -> Result<Vec<f32>> {
    Ok(match storage {
        CpuStorage::F32(x) => gather(x, layout, |x| x),
        CpuStorage::F16(x) => gather(x, layout, f16::to_f32),
        CpuStorage::BF16(x) => gather(x, layout, bf16::to_f32),
        s => bail!(
            "flash-attn: dtype {:?} is not supported on the CPU, expected F32, F16 or BF16",
            s.dtype()
        ),
    })
}

fn gather<T: Copy>(src: &[T], layout: &Layout, f: impl Fn(T) -> f32) -> Vec<f32> {
    if let Some((start, end)) = layout.contiguous_offsets() {
        return src[start..end].iter().map(|&x| f(x)).collect();
    }
    // Not contiguous, so rank >= 1. Walk the outer indices like an odometer and copy the
    // last dimension (stride 1 after validation, but any stride works) in one go.
    let (dims, stride) = (layout.dims(), layout.stride());
    let len = layout.shape().elem_count();
    let mut out = Vec::with_capacity(len);
    if len == 0 {
        return out;
    }
    let rank = dims.len();
    let (inner, inner_stride) = (dims[rank - 1], stride[rank - 1]);
    let mut index = vec![0usize; rank - 1];
    let mut offset = layout.start_offset();
    loop {
        out.extend((0..inner).map(|j| f(src[offset + j * inner_stride])));
        let mut dim = rank - 1;
        loop {
            if dim == 0 {
                return out;
            }
            dim -= 1;
            index[dim] += 1;
            offset += stride[dim];
            if index[dim] < dims[dim] {
                break;
            }
            offset -= stride[dim] * dims[dim];
            index[dim] = 0;
        }
    }
}

/// Converts f32 results to storage of `dtype` (F32, F16 or BF16), rounding to nearest.
pub(crate) fn to_storage(data: Vec<f32>, dtype: DType) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(data),
        DType::F16 => CpuStorage::F16(data.into_iter().map(f16::from_f32).collect()),
        DType::BF16 => CpuStorage::BF16(data.into_iter().map(bf16::from_f32).collect()),
        dt => {
            bail!("flash-attn: dtype {dt:?} is not supported on the CPU, expected F32, F16 or BF16")
        }
    })
}

/// Forward pass. `q` is `(b, sq, h, d)`, `k` and `v` are `(b, sk, hk, d)`, all contiguous.
/// Returns `out` `(b, sq, h, d)` and the natural-log `lse` `(b, h, sq)` of the scaled scores
/// (`-inf`, with a zero output row, where a query sees no key).
pub(crate) fn attn_fwd(p: &Problem, q: &[f32], k: &[f32], v: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let s = p.shape;
    let work = s.sq * s.sk * s.d;
    // One task per (batch, head); task t = b * h + head, the order of the LSE's rows.
    let heads = par_map(s.b * s.h, work, |t| {
        let (b, head) = (t / s.h, t % s.h);
        let kv_head = head / s.group();
        let q = head_rows(q, b, head, s.sq, s.h, s.d);
        let k = head_rows(k, b, kv_head, s.sk, s.hk, s.d);
        let v = head_rows(v, b, kv_head, s.sk, s.hk, s.d);
        fwd_head(p, &q, &k, &v)
    });
    let mut out = vec![0f32; s.q_elems()];
    let mut lse = Vec::with_capacity(s.b * s.h * s.sq);
    for (t, (o, l)) in heads.into_iter().enumerate() {
        put_head_rows(&mut out, &o, t / s.h, t % s.h, s.sq, s.h, s.d);
        lse.extend_from_slice(&l);
    }
    (out, lse)
}

/// Algorithm 1 for one head: `q` `(sq, d)`, `k`, `v` `(sk, d)`. Returns `(out (sq, d), lse (sq))`.
fn fwd_head(p: &Problem, q: &[f32], k: &[f32], v: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let (sq, d) = (p.shape.sq, p.shape.d);
    // `out` holds the unnormalised accumulator until the end of each query tile.
    let mut out = vec![0f32; sq * d];
    let mut lse = vec![f32::NEG_INFINITY; sq];
    let mut scores = [0f32; KEY_BLOCK];
    for r0 in (0..sq).step_by(QUERY_BLOCK) {
        let r1 = (r0 + QUERY_BLOCK).min(sq);
        // Online softmax state (line 5): running max m and running sum l per row.
        let mut m = [f32::NEG_INFINITY; QUERY_BLOCK];
        let mut l = [0f32; QUERY_BLOCK];
        // key_end grows with the row, so the tile's last row sees the most keys; tiles past
        // it are skipped entirely.
        for c0 in (0..p.key_end(r1 - 1)).step_by(KEY_BLOCK) {
            for i in r0..r1 {
                let c1 = (c0 + KEY_BLOCK).min(p.key_end(i));
                if c1 <= c0 {
                    continue; // this row's visible keys end before the tile
                }
                let r = i - r0;
                let q_i = &q[i * d..][..d];
                // Line 8: S_ij = scale · q_i K_jᵀ.
                let s = &mut scores[..c1 - c0];
                for (j, s_j) in s.iter_mut().enumerate() {
                    *s_j = p.scale * dot(q_i, &k[(c0 + j) * d..][..d]);
                }
                // Lines 9-10: new max, rescale the old sum and accumulator by exp(m_old - m_new)
                // (0 on the first tile, where m_old = -inf), add exp(S - m_new) and its V.
                let m_new = s.iter().fold(m[r], |a, &b| a.max(b));
                let alpha = (m[r] - m_new).exp();
                let acc = &mut out[i * d..][..d];
                acc.iter_mut().for_each(|a| *a *= alpha);
                let mut row_sum = 0.0;
                for (j, &s_j) in s.iter().enumerate() {
                    let p_j = (s_j - m_new).exp();
                    row_sum += p_j;
                    axpy(acc, p_j, &v[(c0 + j) * d..][..d]);
                }
                l[r] = alpha * l[r] + row_sum;
                m[r] = m_new;
            }
        }
        // Lines 12-13: normalise once, LSE = m + ln(l). Rows that saw no key keep l = 0,
        // a zero output and LSE = -inf.
        for i in r0..r1 {
            let r = i - r0;
            if l[r] > 0.0 {
                let inv = 1.0 / l[r];
                out[i * d..][..d].iter_mut().for_each(|o| *o *= inv);
                lse[i] = m[r] + l[r].ln();
            }
        }
    }
    (out, lse)
}

/// Backward pass. `q`, `o`, `d_o` are `(b, sq, h, d)`, `k`, `v` are `(b, sk, hk, d)`, `lse` is
/// `(b, h, sq)` from the forward. Returns `(dq, dk, dv)` shaped like `(q, k, v)`; dk and dv
/// are summed over the query heads that share each K/V head.
pub(crate) fn attn_bwd(
    p: &Problem,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    o: &[f32],
    d_o: &[f32],
    lse: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let s = p.shape;
    let group = s.group();
    let work = group * s.sq * s.sk * s.d;
    // One task per (batch, K/V head): it owns dK and dV of that head and dQ of its group of
    // query heads, so no two tasks write the same gradient and no atomics are needed.
    let tasks = par_map(s.b * s.hk, work, |t| {
        let (b, kv_head) = (t / s.hk, t % s.hk);
        let k = head_rows(k, b, kv_head, s.sk, s.hk, s.d);
        let v = head_rows(v, b, kv_head, s.sk, s.hk, s.d);
        let heads: Vec<BwdHead> = (kv_head * group..(kv_head + 1) * group)
            .map(|head| BwdHead {
                q: head_rows(q, b, head, s.sq, s.h, s.d),
                o: head_rows(o, b, head, s.sq, s.h, s.d),
                d_o: head_rows(d_o, b, head, s.sq, s.h, s.d),
                lse: &lse[(b * s.h + head) * s.sq..][..s.sq],
            })
            .collect();
        bwd_group(p, &k, &v, &heads)
    });
    let mut dq = vec![0f32; s.q_elems()];
    let mut dk = vec![0f32; s.kv_elems()];
    let mut dv = vec![0f32; s.kv_elems()];
    for (t, (dq_heads, dk_t, dv_t)) in tasks.into_iter().enumerate() {
        let (b, kv_head) = (t / s.hk, t % s.hk);
        for (g, dq_h) in dq_heads.iter().enumerate() {
            put_head_rows(&mut dq, dq_h, b, kv_head * group + g, s.sq, s.h, s.d);
        }
        put_head_rows(&mut dk, &dk_t, b, kv_head, s.sk, s.hk, s.d);
        put_head_rows(&mut dv, &dv_t, b, kv_head, s.sk, s.hk, s.d);
    }
    (dq, dk, dv)
}

/// One query head's inputs to the backward, each `(sq, d)` (`lse`: `(sq)`).
struct BwdHead<'a> {
    q: Vec<f32>,
    o: Vec<f32>,
    d_o: Vec<f32>,
    lse: &'a [f32],
}

/// Algorithm 2 for one K/V head `k`, `v` `(sk, d)` and the query heads that read it. Returns
/// `(dq per query head (sq, d), dk (sk, d), dv (sk, d))`.
fn bwd_group(
    p: &Problem,
    k: &[f32],
    v: &[f32],
    heads: &[BwdHead],
) -> (Vec<Vec<f32>>, Vec<f32>, Vec<f32>) {
    let (sq, sk, d) = (p.shape.sq, p.shape.sk, p.shape.d);
    // Line 4 (preprocessing): D_i = rowsum(dO_i ∘ O_i).
    let delta: Vec<Vec<f32>> = heads
        .iter()
        .map(|h| {
            (0..sq)
                .map(|i| dot(&h.d_o[i * d..][..d], &h.o[i * d..][..d]))
                .collect()
        })
        .collect();
    let mut dq = vec![vec![0f32; sq * d]; heads.len()];
    let mut dk = vec![0f32; sk * d];
    let mut dv = vec![0f32; sk * d];
    // Line 5: outer loop over K/V tiles; dK_j and dV_j stay hot while every query row visits.
    for c0 in (0..sk).step_by(KEY_BLOCK) {
        let c1 = (c0 + KEY_BLOCK).min(sk);
        for ((h, delta), dq) in heads.iter().zip(&delta).zip(&mut dq) {
            for i in 0..sq {
                let end = p.key_end(i).min(c1);
                // Rows that see no key of this tile, or no key at all (LSE = -inf), contribute
                // nothing.
                if end <= c0 || h.lse[i] == f32::NEG_INFINITY {
                    continue;
                }
                let (q_i, d_o_i) = (&h.q[i * d..][..d], &h.d_o[i * d..][..d]);
                let dq_i = &mut dq[i * d..][..d];
                for j in c0..end {
                    let (k_j, v_j) = (&k[j * d..][..d], &v[j * d..][..d]);
                    // Lines 10-14: recompute P_ij from the saved LSE, then
                    // dV_j += P_ij dO_i, dP_ij = dO_i · v_j, dS_ij = P_ij (dP_ij - D_i).
                    let p_ij = (p.scale * dot(q_i, k_j) - h.lse[i]).exp();
                    axpy(&mut dv[j * d..][..d], p_ij, d_o_i);
                    let ds_ij = p_ij * (dot(d_o_i, v_j) - delta[i]);
                    // Lines 15-16: dQ_i += scale dS_ij k_j, dK_j += scale dS_ij q_i.
                    axpy(dq_i, p.scale * ds_ij, k_j);
                    axpy(&mut dk[j * d..][..d], p.scale * ds_ij, q_i);
                }
            }
        }
    }
    (dq, dk, dv)
}

/// Copies head `head` of batch `b` out of a `(batch, seqlen, heads, d)` buffer into a
/// `(seqlen, d)` matrix.
fn head_rows(x: &[f32], b: usize, head: usize, seqlen: usize, heads: usize, d: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(seqlen * d);
    for s in 0..seqlen {
        out.extend_from_slice(&x[((b * seqlen + s) * heads + head) * d..][..d]);
    }
    out
}

/// The inverse of [`head_rows`]: writes a `(seqlen, d)` matrix into head `head` of batch `b`.
fn put_head_rows(
    x: &mut [f32],
    rows: &[f32],
    b: usize,
    head: usize,
    seqlen: usize,
    heads: usize,
    d: usize,
) {
    for s in 0..seqlen {
        x[((b * seqlen + s) * heads + head) * d..][..d].copy_from_slice(&rows[s * d..][..d]);
    }
}

/// `a · b` with eight partial sums, which the compiler maps onto SIMD lanes (it may not
/// reorder a single f32 sum by itself). The order is fixed, so the result is deterministic.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    const LANES: usize = 8;
    let mut acc = [0f32; LANES];
    let (a8, b8) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = a8
        .remainder()
        .iter()
        .zip(b8.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in a8.zip(b8) {
        acc.iter_mut()
            .zip(x)
            .zip(y)
            .for_each(|((acc, x), y)| *acc += x * y);
    }
    acc.iter().sum::<f32>() + tail
}

/// `y += alpha · x`.
fn axpy(y: &mut [f32], alpha: f32, x: &[f32]) {
    y.iter_mut().zip(x).for_each(|(y, x)| *y += alpha * x);
}

/// `(0..n).map(f)` on all cores, results in task order. `work` is the multiply-adds of one task.
fn par_map<T: Send>(n: usize, work: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |t| t.get())
        .min(n);
    if threads <= 1 || n * work < MIN_PARALLEL_WORK {
        return (0..n).map(f).collect();
    }
    // Contiguous ranges of tasks per thread; the tasks of one call have equal sizes.
    let chunk = n.div_ceil(threads);
    std::thread::scope(|scope| {
        let f = &f;
        let workers: Vec<_> = (0..n)
            .step_by(chunk)
            .map(|start| {
                scope.spawn(move || (start..(start + chunk).min(n)).map(f).collect::<Vec<T>>())
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| {
                w.join()
                    .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
            })
            .collect()
    })
}
