//! A varlen call's layout on the host and its run: each sequence cut into row segments, the
//! segments of one mask packed into one call of our op, the rows put back in order.

use candle::{bail, Result, Tensor};

use super::scores::Scores;
use super::segments::{prefix_segments, window_segments, Segment};
use super::seqlens::{check_packed, offsets};
use super::window::{Mask, Window};
use crate::VarLen;

/// Where key `j` of sequence `b` lives in the (flattened) key tensor of a varlen call.
pub(super) enum KeyRows {
    /// Packed `(total_k, ..)`: row `cu_k[b] + j`.
    Packed,
    /// Paged, flattened to `(num_blocks · page, ..)`: row `table[b][j / page] · page + j % page`
    /// with `width` entries per table row.
    Paged {
        table: Vec<u32>,
        width: usize,
        page: usize,
    },
}

/// The layout of a varlen call, checked, on the host.
pub(super) struct Batch {
    pub(super) cu_q: Vec<u32>,
    /// Cumulative key offsets as given (upstream does not need them to start at 0).
    pub(super) cu_k: Vec<u32>,
    pub(super) keys: KeyRows,
}

impl Batch {
    /// Packed q, k, v and their offsets.
    pub(super) fn packed(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        seqlens_q: &Tensor,
        seqlens_k: &Tensor,
        max_seqlen_q: usize,
    ) -> Result<Self> {
        let (total_q, total_k) = check_packed(q, k, v, 3, "(total_k, num_heads_k, head_dim)")?;
        let (cu_q, cu_k) = offsets(seqlens_q, seqlens_k, total_q, max_seqlen_q)?;
        let last = cu_k[cu_k.len() - 1] as usize;
        if last > total_k {
            bail!("seqlens_k: last offset {last} exceeds k's total rows {total_k}")
        }
        Ok(Self {
            cu_q,
            cu_k,
            keys: KeyRows::Packed,
        })
    }

    pub(super) fn num_seqs(&self) -> usize {
        self.cu_q.len() - 1
    }

    fn len_q(&self, b: usize) -> usize {
        (self.cu_q[b + 1] - self.cu_q[b]) as usize
    }

    fn len_k(&self, b: usize) -> usize {
        (self.cu_k[b + 1] - self.cu_k[b]) as usize
    }

    /// The row of key `j` of sequence `b` in the (flattened) key tensor.
    fn key_row(&self, b: usize, j: usize) -> u32 {
        match &self.keys {
            KeyRows::Packed => self.cu_k[b] + j as u32,
            KeyRows::Paged { table, width, page } => {
                table[b * width + j / page] * *page as u32 + (j % page) as u32
            }
        }
    }

    /// Runs the call: `k`, `v` are `(rows, num_heads_k, head_dim)` (paged ones flattened),
    /// `ranges` the valid prefix ranges of each sequence (paged calls, no ALiBi).
    ///
    /// Every sequence is cut into row segments that one call of our op computes exactly
    /// (usually one per sequence: the whole of it under upstream's mask); segments with the
    /// same mask run as one packed call, and the rows are put back in order.
    pub(super) fn attend(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        scores: &Scores,
        window: Window,
        ranges: Option<&[Vec<(i64, i64)>]>,
    ) -> Result<Tensor> {
        scores.check_slopes(q.dim(1)?)?;
        if ranges.is_some() && scores.alibi.is_some() {
            bail!("alibi_slopes: not supported together with mm_prefix_ranges")
        }
        let (q, scale) = scores.query(q)?;
        let mut groups: Vec<Group> = Vec::new();
        for b in 0..self.num_seqs() {
            let (sq, sk) = (self.len_q(b), self.len_k(b));
            let segments = match (window, ranges.map(|r| r[b].as_slice())) {
                (Window::Local { left, right }, Some(r)) if !r.is_empty() => {
                    prefix_segments(sq, sk, left, right, r)?
                }
                _ => window_segments(window, sq, sk),
            };
            for seg in segments {
                let key = (seg.mask, seg.flip_alibi);
                let at = match groups.iter().position(|g| g.key == key) {
                    Some(at) => at,
                    None => {
                        groups.push(Group::new(key));
                        groups.len() - 1
                    }
                };
                groups[at].add(self, b, &seg);
            }
        }
        let mut outs = Vec::with_capacity(groups.len());
        let mut order: Vec<u32> = Vec::with_capacity(q.dim(0)?);
        for g in &groups {
            let varlen = VarLen::from_seqlens(&g.lens_q, &g.lens_k)?;
            let opts = scores.options(scale, g.key.0, g.key.1)?;
            let (qg, kg, vg) = (
                rows(&q, &g.q_rows)?,
                rows(k, &g.k_rows)?,
                rows(v, &g.k_rows)?,
            );
            outs.push(opts.forward_varlen(&qg, &kg, &vg, &varlen)?);
            order.extend_from_slice(&g.q_rows);
        }
        if outs.len() == 1 {
            // One group holds every row in order.
            return Ok(outs.remove(0));
        }
        let out = Tensor::cat(&outs, 0)?;
        let mut inverse = vec![0u32; order.len()];
        for (at, &row) in order.iter().enumerate() {
            inverse[row as usize] = at as u32;
        }
        let len = inverse.len();
        out.index_select(&Tensor::from_vec(inverse, len, q.device())?, 0)
    }
}

/// Rows `rows` of `t` along dimension 0: a view when they are consecutive (the usual case: a
/// single segment per sequence over packed keys), a gathered copy otherwise.
fn rows(t: &Tensor, rows: &[u32]) -> Result<Tensor> {
    let first = rows.first().copied().unwrap_or(0);
    if rows.iter().enumerate().all(|(i, &r)| r == first + i as u32) {
        return t.narrow(0, first as usize, rows.len());
    }
    t.index_select(&Tensor::from_vec(rows.to_vec(), rows.len(), t.device())?, 0)
}

/// The segments of one mask, gathered into one packed call.
struct Group {
    key: (Mask, bool),
    q_rows: Vec<u32>,
    k_rows: Vec<u32>,
    lens_q: Vec<usize>,
    lens_k: Vec<usize>,
}

impl Group {
    fn new(key: (Mask, bool)) -> Self {
        Self {
            key,
            q_rows: Vec::new(),
            k_rows: Vec::new(),
            lens_q: Vec::new(),
            lens_k: Vec::new(),
        }
    }

    fn add(&mut self, batch: &Batch, b: usize, seg: &Segment) {
        let start = batch.cu_q[b];
        self.q_rows
            .extend(seg.rows.clone().map(|i| start + i as u32));
        self.k_rows
            .extend(seg.keys.clone().map(|j| batch.key_row(b, j)));
        self.lens_q.push(seg.rows.len());
        self.lens_k.push(seg.keys.len());
    }
}
