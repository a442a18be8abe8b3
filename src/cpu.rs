//! The CPU implementation: FlashAttention-2 Algorithms 1 (forward) and 2 (backward) in f32
//! math, whatever the storage dtype. Tensors arrive as contiguous row-major `Vec<f32>`s
//! ([`gather_f32`]); each task copies the rows of one head of one sequence into a
//! `(seqlen, head_dim)` matrix, so the loops below read like the paper.
//!
//! One code path serves fixed-length and packed batches: a fixed-length `(b, s, h, d)` tensor
//! is a packed `(b · s, h, d)` one whose sequences all have length `s` ([`Problem::seq_q`],
//! [`Problem::seq_k`]). Dropout draws its mask from [`philox::RowKeep`], the function the CUDA
//! kernels use, so both paths drop the same entries. The window, softcap, ALiBi and the block
//! mask ([`crate::score_mod::ScoreMods`]) enter through [`Scores`]: each row reads only the
//! keys of its window, and the tiles outside every row's window are never visited, so a
//! windowed call costs in proportion to the window. A [`crate::BlockMask`] (block-sparse
//! attention) works per tile: a tile that lies in absent blocks only is skipped, one in fully
//! visible blocks runs as without a mask, and only the others ask the mask entry by entry.
//!
//! Tasks are independent and their results are combined in a fixed order, so the output does
//! not depend on the number of threads: forward and backward are deterministic.

use candle::backend::BackendStorage;
use candle::{bail, CpuStorage, DType, Layout, Result};
use half::{bf16, f16};

use crate::block_sparse::{HostBlockMask, ALL};
use crate::params::Problem;
use crate::philox;

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

/// Copies a (possibly strided, offset) F8E4M3 tensor into a contiguous row-major `Vec<f32>`
/// of its stored values (exact: every e4m3 value is an f32); the FP8 forward's inputs.
pub(crate) fn gather_e4m3(storage: &CpuStorage, layout: &Layout) -> Result<Vec<f32>> {
    match storage {
        CpuStorage::F8E4M3(x) => Ok(gather(x, layout, |x| x.to_f32())),
        s => bail!(
            "flash-attn fp8: expected an F8E4M3 storage, got {:?}",
            s.dtype()
        ),
    }
}

fn gather<T: Copy>(src: &[T], layout: &Layout, f: impl Fn(T) -> f32) -> Vec<f32> {
    let len = layout.shape().elem_count();
    if len == 0 {
        // Before the offsets: an empty view (a narrow of a tensor with no rows) may start
        // past the end of its storage.
        return Vec::new();
    }
    if let Some((start, end)) = layout.contiguous_offsets() {
        return src[start..end].iter().map(|&x| f(x)).collect();
    }
    // Not contiguous, so rank >= 1. Walk the outer indices like an odometer and copy the
    // last dimension (stride 1 after validation, but any stride works) in one go.
    let (dims, stride) = (layout.dims(), layout.stride());
    let mut out = Vec::with_capacity(len);
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

/// `v` rounded to `dtype` and back (F16, BF16; others unchanged): what storing it would keep.
pub(crate) fn round_to(v: f32, dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => bf16::from_f32(v).to_f32(),
        DType::F16 => f16::from_f32(v).to_f32(),
        _ => v,
    }
}

/// Lengths of one sequence of the batch (every sequence of a fixed-length batch has
/// `(sq, sk)`); `b` keys the dropout RNG.
#[derive(Clone, Copy)]
struct Seq {
    b: usize,
    sq: usize,
    sk: usize,
}

impl Seq {
    fn new(p: &Problem, b: usize) -> Self {
        Self {
            b,
            sq: p.seq_q(b).1,
            sk: p.seq_k(b).1,
        }
    }
}

/// How the block mask covers a tile of the attention matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Tile {
    /// Every block under the tile is absent: nothing to read.
    Hidden,
    /// Every block under the tile is fully visible (or there is no block mask): only the
    /// window decides.
    Shown,
    /// Blocks of different states, or some with an element mask: ask
    /// [`Scores::visible`] entry by entry.
    Mixed,
}

/// The scores of one query head of one sequence: `scale · q·k`, then the softcap and the
/// ALiBi bias of [`Problem::mods`], over the keys of each row's window that the block mask
/// keeps.
#[derive(Clone, Copy)]
struct Scores<'a> {
    p: &'a Problem,
    sq: usize,
    sk: usize,
    /// The query head, which picks its block mask.
    head: usize,
    /// The head's ALiBi slope, 0 without ALiBi.
    slope: f32,
    /// Neither a cap nor a bias: the score is the scaled dot product, and its derivative 1.
    plain: bool,
    /// The block mask on the host, if any.
    sparse: Option<&'a HostBlockMask>,
}

impl<'a> Scores<'a> {
    /// `slopes` is [`Alibi::host`](crate::score_mod::Alibi::host) (empty without ALiBi),
    /// `sparse` the host view of the block mask ([`host_block_mask`]).
    fn new(
        p: &'a Problem,
        seq: Seq,
        head: usize,
        slopes: &[f32],
        sparse: Option<&'a HostBlockMask>,
    ) -> Self {
        let slope = p
            .mods
            .alibi
            .as_ref()
            .map_or(0.0, |a| slopes[a.index(seq.b, head, p.shape.h)]);
        Self {
            p,
            sq: seq.sq,
            sk: seq.sk,
            head,
            slope,
            plain: p.mods.softcap.is_none() && slope == 0.0,
            sparse,
        }
    }

    /// How the block mask covers rows `rows` × keys `keys` (both non-empty; coordinates
    /// within the sequence, which uses the top-left part of the mask). The tile may straddle
    /// blocks (a window moves the key tiles off the 64-key grid), so every block under it is
    /// read: at most 2 × 2, as blocks are at least 64 rows and keys.
    fn tile(&self, rows: std::ops::Range<usize>, keys: std::ops::Range<usize>) -> Tile {
        let Some(mask) = self.sparse else {
            return Tile::Shown;
        };
        let (mut any_visible, mut all_visible) = (false, true);
        for r in rows.start / mask.block_q..=(rows.end - 1) / mask.block_q {
            for c in keys.start / mask.block_k..=(keys.end - 1) / mask.block_k {
                match mask.state(self.head, r, c) {
                    0 => all_visible = false,
                    ALL => any_visible = true,
                    _ => (any_visible, all_visible) = (true, false),
                }
            }
        }
        match (any_visible, all_visible) {
            (false, _) => Tile::Hidden,
            (true, true) => Tile::Shown,
            (true, false) => Tile::Mixed,
        }
    }

    /// Whether the block mask lets row `i` see key `j` (the window aside): what a
    /// [`Tile::Mixed`] tile asks entry by entry.
    fn visible(&self, i: usize, j: usize) -> bool {
        self.sparse.is_none_or(|m| m.visible(self.head, i, j))
    }

    /// Keys `[lo, hi)` that row `i` sees (`lo >= hi` when none). Both ends grow with `i`,
    /// which is what lets a tile of rows or keys bound its partners by its first and last.
    fn keys(&self, i: usize) -> (usize, usize) {
        self.p.key_range(i, self.sq, self.sk)
    }

    /// The score of (row `i`, key `j`) from `q_i · k_j`, and its derivative with respect to
    /// the scaled product (the backward's chain rule through the cap).
    fn score(&self, qk: f32, i: usize, j: usize) -> (f32, f32) {
        let s = self.p.scale * qk;
        if self.plain {
            return (s, 1.0);
        }
        self.p.mods.score(s, i, j, self.sq, self.sk, self.slope)
    }
}

/// The ALiBi slopes on the host, read once per call (empty without ALiBi).
fn host_slopes(p: &Problem) -> Result<Vec<f32>> {
    p.mods.alibi.as_ref().map_or(Ok(Vec::new()), |a| a.host())
}

/// The block mask on the host, read once per call.
fn host_block_mask(p: &Problem) -> Result<Option<HostBlockMask>> {
    p.mods.sparse.as_ref().map(|m| m.host()).transpose()
}

/// The first `i` in `0..n` for which `pred` is false, where `pred` is true on a prefix of
/// `0..n` and false after it.
fn partition_point(n: usize, pred: impl Fn(usize) -> bool) -> usize {
    let (mut lo, mut hi) = (0, n);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if pred(mid) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

/// Multiply-adds of `q kᵀ` over all sequences and query heads (ignoring masks and windows):
/// the size of a call, for [`par_map`].
fn total_work(p: &Problem) -> usize {
    let s = p.shape;
    let per_head: usize = (0..s.b).map(|b| p.seq_q(b).1 * p.seq_k(b).1).sum();
    per_head * s.h * s.d
}

/// `1 / (1 - p)`, the factor of kept probabilities; 1 without dropout.
fn keep_scale(p: &Problem) -> f32 {
    p.dropout.map_or(1.0, |d| philox::keep_scale(d.p))
}

/// Whether the probabilities of query `i` of sequence `b`, query head `head` survive dropout,
/// asked key by key (always, without dropout).
struct RowDropout(Option<philox::RowKeep>);

impl RowDropout {
    fn new(p: &Problem, b: usize, head: usize, i: usize) -> Self {
        Self(
            p.dropout
                .as_ref()
                .map(|d| philox::RowKeep::new(d, p.shape.h, b, head, i)),
        )
    }

    fn kept(&mut self, j: usize) -> bool {
        self.0.as_mut().is_none_or(|row| row.kept(j))
    }
}

/// Forward pass. `q` is `(total_q, h, d)`, `k` and `v` are `(total_k, hk, d)`, all
/// contiguous (a fixed-length `(b, sq, h, d)` is `(b · sq, h, d)`). Returns `out` shaped like
/// `q` and the natural-log `lse` of the final scores (scaled, capped, biased) in the layout of
/// [`Problem::lse_index`] (`-inf`, with a zero output row, where a query sees no key).
pub(crate) fn attn_fwd(
    p: &Problem,
    q: &[f32],
    k: &[f32],
    v: &[f32],
) -> Result<(Vec<f32>, Vec<f32>)> {
    let s = p.shape;
    let slopes = host_slopes(p)?;
    let sparse = host_block_mask(p)?;
    // One task per (sequence, head); task t = b * h + head.
    let heads = par_map(s.b * s.h, total_work(p), |t| {
        let (b, head) = (t / s.h, t % s.h);
        let ((q0, sq), (k0, sk)) = (p.seq_q(b), p.seq_k(b));
        let kv_head = head / s.group();
        let q = head_rows(q, q0, sq, head, s.h, s.d);
        let k = head_rows(k, k0, sk, kv_head, s.hk, s.d);
        let v = head_rows(v, k0, sk, kv_head, s.hk, s.d);
        let seq = Seq::new(p, b);
        let scores = Scores::new(p, seq, head, &slopes, sparse.as_ref());
        fwd_head(p, seq, head, scores, &q, &k, &v)
    });
    let mut out = vec![0f32; s.q_elems()];
    let mut lse = vec![f32::NEG_INFINITY; s.h * s.total_q];
    for (t, (o, l)) in heads.into_iter().enumerate() {
        let (b, head) = (t / s.h, t % s.h);
        let (q0, sq) = p.seq_q(b);
        put_head_rows(&mut out, &o, q0, sq, head, s.h, s.d);
        lse[p.lse_index(b, head, 0)..][..sq].copy_from_slice(&l);
    }
    Ok((out, lse))
}

/// Algorithm 1 for query head `head` of sequence `seq`: `q` `(sq, d)`, `k`, `v` `(sk, d)`.
/// Returns `(out (sq, d), lse (sq))`.
///
/// Dropout (FlashAttention-2's): the row sum `l` and the LSE are those of the undropped
/// probabilities; only the accumulator `P̃ V` skips the dropped ones, and the final
/// normalisation multiplies by `1 / (1 - p)`.
fn fwd_head(
    p: &Problem,
    seq: Seq,
    head: usize,
    scores: Scores,
    q: &[f32],
    k: &[f32],
    v: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let (sq, d) = (seq.sq, p.shape.d);
    // `out` holds the unnormalised accumulator until the end of each query tile.
    let mut out = vec![0f32; sq * d];
    let mut lse = vec![f32::NEG_INFINITY; sq];
    let mut s_buf = [0f32; KEY_BLOCK];
    for r0 in (0..sq).step_by(QUERY_BLOCK) {
        let r1 = (r0 + QUERY_BLOCK).min(sq);
        // Online softmax state (line 5): running max m and running sum l per row.
        let mut m = [f32::NEG_INFINITY; QUERY_BLOCK];
        let mut l = [0f32; QUERY_BLOCK];
        // Both ends of the window grow with the row: the tile's keys lie between its first
        // row's first key and its last row's end, and the key tiles outside are skipped.
        let (first, last) = (scores.keys(r0).0, scores.keys(r1 - 1).1);
        for c0 in (first..last).step_by(KEY_BLOCK) {
            // Algorithm 5: a tile in absent blocks is neither read nor computed.
            let tile = scores.tile(r0..r1, c0..(c0 + KEY_BLOCK).min(last));
            if tile == Tile::Hidden {
                continue;
            }
            // Entries the block mask hides within the tile: never read, neither their score
            // nor their V.
            let shown = |i, j| tile == Tile::Shown || scores.visible(i, j);
            for i in r0..r1 {
                let (lo, hi) = scores.keys(i);
                let (c_lo, c_hi) = (c0.max(lo), (c0 + KEY_BLOCK).min(hi));
                if c_hi <= c_lo {
                    continue; // this row's window misses the tile
                }
                let r = i - r0;
                let q_i = &q[i * d..][..d];
                // Line 8: S_ij = scale · q_i K_jᵀ, then the cap and the bias; -inf where the
                // block mask hides the entry.
                let s = &mut s_buf[..c_hi - c_lo];
                let mut any_shown = false;
                for (j, s_j) in (c_lo..).zip(s.iter_mut()) {
                    *s_j = if shown(i, j) {
                        any_shown = true;
                        scores.score(dot(q_i, &k[j * d..][..d]), i, j).0
                    } else {
                        f32::NEG_INFINITY
                    };
                }
                if !any_shown {
                    // The mask hides this row's part of the tile: leave m and l alone (with
                    // m = -inf, the update below would compute exp(-inf - -inf) = NaN).
                    continue;
                }
                // Lines 9-10: new max, rescale the old sum and accumulator by exp(m_old - m_new)
                // (0 on the first tile, where m_old = -inf), add exp(S - m_new) and, if the
                // entry survives dropout, its V.
                let m_new = s.iter().fold(m[r], |a, &b| a.max(b));
                let alpha = (m[r] - m_new).exp();
                let acc = &mut out[i * d..][..d];
                acc.iter_mut().for_each(|a| *a *= alpha);
                let mut row_sum = 0.0;
                let mut dropout = RowDropout::new(p, seq.b, head, i);
                for (j, &s_j) in (c_lo..).zip(s.iter()) {
                    if !shown(i, j) {
                        continue;
                    }
                    let p_j = (s_j - m_new).exp();
                    row_sum += p_j;
                    if dropout.kept(j) {
                        axpy(acc, p_j, &v[j * d..][..d]);
                    }
                }
                l[r] = alpha * l[r] + row_sum;
                m[r] = m_new;
            }
        }
        // Lines 12-13: normalise once (and undo the dropout's expected shrinkage),
        // LSE = m + ln(l). Rows that saw no key keep l = 0, a zero output and LSE = -inf; a
        // NaN score (which `max` skipped, but not the sum) makes l, the output and the LSE NaN.
        for i in r0..r1 {
            let r = i - r0;
            if l[r] != 0.0 {
                let inv = keep_scale(p) / l[r];
                out[i * d..][..d].iter_mut().for_each(|o| *o *= inv);
                lse[i] = m[r] + l[r].ln();
            }
        }
    }
    (out, lse)
}

/// Backward pass. `q`, `o`, `d_o` are `(total_q, h, d)`, `k`, `v` are `(total_k, hk, d)`
/// (fixed length: `(b · sq, h, d)` and `(b · sk, hk, d)`), `lse` is the forward's, in the
/// layout of [`Problem::lse_index`]. Returns `(dq, dk, dv)` shaped like `(q, k, v)`; dk and
/// dv are summed over the query heads that share each K/V head.
pub(crate) fn attn_bwd(
    p: &Problem,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    o: &[f32],
    d_o: &[f32],
    lse: &[f32],
) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
    let s = p.shape;
    let group = s.group();
    let slopes = host_slopes(p)?;
    let sparse = host_block_mask(p)?;
    // One task per (sequence, K/V head): it owns dK and dV of that head and dQ of its group
    // of query heads, so no two tasks write the same gradient and no atomics are needed.
    let tasks = par_map(s.b * s.hk, total_work(p), |t| {
        let (b, kv_head) = (t / s.hk, t % s.hk);
        let ((q0, sq), (k0, sk)) = (p.seq_q(b), p.seq_k(b));
        let seq = Seq::new(p, b);
        let k = head_rows(k, k0, sk, kv_head, s.hk, s.d);
        let v = head_rows(v, k0, sk, kv_head, s.hk, s.d);
        let heads: Vec<BwdHead> = (kv_head * group..(kv_head + 1) * group)
            .map(|head| BwdHead {
                head,
                scores: Scores::new(p, seq, head, &slopes, sparse.as_ref()),
                q: head_rows(q, q0, sq, head, s.h, s.d),
                o: head_rows(o, q0, sq, head, s.h, s.d),
                d_o: head_rows(d_o, q0, sq, head, s.h, s.d),
                lse: &lse[p.lse_index(b, head, 0)..][..sq],
            })
            .collect();
        bwd_group(p, seq, &k, &v, &heads)
    });
    let mut dq = vec![0f32; s.q_elems()];
    let mut dk = vec![0f32; s.kv_elems()];
    let mut dv = vec![0f32; s.kv_elems()];
    for (t, (dq_heads, dk_t, dv_t)) in tasks.into_iter().enumerate() {
        let (b, kv_head) = (t / s.hk, t % s.hk);
        let ((q0, sq), (k0, sk)) = (p.seq_q(b), p.seq_k(b));
        for (g, dq_h) in dq_heads.iter().enumerate() {
            put_head_rows(&mut dq, dq_h, q0, sq, kv_head * group + g, s.h, s.d);
        }
        put_head_rows(&mut dk, &dk_t, k0, sk, kv_head, s.hk, s.d);
        put_head_rows(&mut dv, &dv_t, k0, sk, kv_head, s.hk, s.d);
    }
    Ok((dq, dk, dv))
}

/// One query head's inputs to the backward, each `(sq, d)` (`lse`: `(sq)`).
struct BwdHead<'a> {
    /// The query head's index, which keys the dropout RNG.
    head: usize,
    scores: Scores<'a>,
    q: Vec<f32>,
    o: Vec<f32>,
    d_o: Vec<f32>,
    lse: &'a [f32],
}

/// Rows of `0..sq` whose window meets keys `c0..c1`: a contiguous run, as both ends of the
/// window grow with the row.
fn rows_seeing(scores: &Scores, sq: usize, c0: usize, c1: usize) -> std::ops::Range<usize> {
    let first = partition_point(sq, |i| scores.keys(i).1 <= c0);
    let end = partition_point(sq, |i| scores.keys(i).0 < c1);
    first..end.max(first)
}

/// Algorithm 2 for one K/V head `k`, `v` `(sk, d)` of sequence `seq` and the query heads
/// that read it. Returns `(dq per query head (sq, d), dk (sk, d), dv (sk, d))`.
///
/// With dropout (mask Z, kept entries scaled by `1 / (1 - p)`): `P` is recomputed from the
/// LSE (undropped), `dV += (P∘Z)ᵀ dO / (1 - p)`, `dP = (dO Vᵀ)∘Z / (1 - p)`,
/// `D = rowsum(dO∘O)` and `dS = P∘(dP − D)` as without. A softcap multiplies dS by its
/// derivative `1 - tanh²` before dQ and dK; the ALiBi bias is a constant. Entries the block
/// mask hides have `P = 0` and contribute nothing; they are skipped like those outside the
/// window.
fn bwd_group(
    p: &Problem,
    seq: Seq,
    k: &[f32],
    v: &[f32],
    heads: &[BwdHead],
) -> (Vec<Vec<f32>>, Vec<f32>, Vec<f32>) {
    let (sq, sk, d) = (seq.sq, seq.sk, p.shape.d);
    let keep_scale = keep_scale(p);
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
    if sq == 0 || heads.is_empty() {
        return (dq, dk, dv);
    }
    let window = heads[0].scores;
    // Line 5: outer loop over K/V tiles; dK_j and dV_j stay hot while every query row visits.
    // Only the keys some row sees (the first row's first to the last row's end) are visited,
    // and each tile only by the rows whose window meets it (the window does not depend on the
    // head).
    let (first, last) = (window.keys(0).0, window.keys(sq - 1).1);
    for c0 in (first..last).step_by(KEY_BLOCK) {
        let c1 = (c0 + KEY_BLOCK).min(last);
        let rows = rows_seeing(&window, sq, c0, c1);
        for ((h, delta), dq) in heads.iter().zip(&delta).zip(&mut dq) {
            for i in rows.clone() {
                let (lo, hi) = h.scores.keys(i);
                let (c_lo, c_hi) = (c0.max(lo), c1.min(hi));
                // Rows that see no key of this tile, or no key at all (LSE = -inf), contribute
                // nothing.
                if c_hi <= c_lo || h.lse[i] == f32::NEG_INFINITY {
                    continue;
                }
                // The row's part of the tile (1 x up to 64 keys) against the block mask: this
                // head's absent blocks are skipped, partly hidden ones asked entry by entry.
                let tile = h.scores.tile(i..i + 1, c_lo..c_hi);
                if tile == Tile::Hidden {
                    continue;
                }
                let (q_i, d_o_i) = (&h.q[i * d..][..d], &h.d_o[i * d..][..d]);
                let dq_i = &mut dq[i * d..][..d];
                let mut dropout = RowDropout::new(p, seq.b, h.head, i);
                for j in c_lo..c_hi {
                    if tile == Tile::Mixed && !h.scores.visible(i, j) {
                        continue;
                    }
                    let (k_j, v_j) = (&k[j * d..][..d], &v[j * d..][..d]);
                    // Lines 10-14: recompute P_ij from the saved LSE, then
                    // dV_j += P̃_ij dO_i, dP_ij = Z_ij dO_i · v_j / (1 - p),
                    // dS_ij = P_ij (dP_ij - D_i); a dropped entry has P̃_ij = dP_ij = 0.
                    let (s_ij, ds_dx) = h.scores.score(dot(q_i, k_j), i, j);
                    let p_ij = (s_ij - h.lse[i]).exp();
                    let ds_ij = if dropout.kept(j) {
                        axpy(&mut dv[j * d..][..d], p_ij * keep_scale, d_o_i);
                        p_ij * (keep_scale * dot(d_o_i, v_j) - delta[i])
                    } else {
                        -p_ij * delta[i]
                    };
                    // Lines 15-16 through the cap: dQ_i += scale dS_ij c'_ij k_j,
                    // dK_j += scale dS_ij c'_ij q_i.
                    let g = p.scale * ds_ij * ds_dx;
                    axpy(dq_i, g, k_j);
                    axpy(&mut dk[j * d..][..d], g, q_i);
                }
            }
        }
    }
    (dq, dk, dv)
}

/// Copies rows `row0..row0 + len` of head `head` out of a `(rows, heads, d)` buffer into a
/// `(len, d)` matrix.
pub(crate) fn head_rows(
    x: &[f32],
    row0: usize,
    len: usize,
    head: usize,
    heads: usize,
    d: usize,
) -> Vec<f32> {
    let mut out = Vec::with_capacity(len * d);
    for r in row0..row0 + len {
        out.extend_from_slice(&x[(r * heads + head) * d..][..d]);
    }
    out
}

/// The inverse of [`head_rows`]: writes a `(len, d)` matrix into rows `row0..row0 + len` of
/// head `head`.
pub(crate) fn put_head_rows(
    x: &mut [f32],
    rows: &[f32],
    row0: usize,
    len: usize,
    head: usize,
    heads: usize,
    d: usize,
) {
    for r in 0..len {
        x[((row0 + r) * heads + head) * d..][..d].copy_from_slice(&rows[r * d..][..d]);
    }
}

/// `a · b` with eight partial sums, which the compiler maps onto SIMD lanes (it may not
/// reorder a single f32 sum by itself). The order is fixed, so the result is deterministic.
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
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
pub(crate) fn axpy(y: &mut [f32], alpha: f32, x: &[f32]) {
    y.iter_mut().zip(x).for_each(|(y, x)| *y += alpha * x);
}

/// `(0..n).map(f)` on all cores, results in task order. `work` is the multiply-adds of all
/// tasks together.
pub(crate) fn par_map<T: Send>(n: usize, work: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |t| t.get())
        .min(n);
    if threads <= 1 || work < MIN_PARALLEL_WORK {
        return (0..n).map(f).collect();
    }
    // Thread w runs tasks w, w + threads, ...: neighbouring tasks (the heads of one sequence,
    // or sequences of similar length) land on different threads, which balances the load of
    // variable-length batches.
    let results: Vec<Option<T>> = std::thread::scope(|scope| {
        let f = &f;
        let workers: Vec<_> = (0..threads)
            .map(|w| scope.spawn(move || (w..n).step_by(threads).map(f).collect::<Vec<T>>()))
            .collect();
        let mut results: Vec<Option<T>> = (0..n).map(|_| None).collect();
        for (w, worker) in workers.into_iter().enumerate() {
            let done = worker
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            for (t, r) in (w..n).step_by(threads).zip(done) {
                results[t] = Some(r);
            }
        }
        results
    });
    results
        .into_iter()
        .map(|r| r.expect("every task ran"))
        .collect()
}
