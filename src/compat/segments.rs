//! The row segments of one varlen sequence: runs of query rows that one call of our op
//! computes exactly under upstream's window, alone or joined with prefix ranges.

use std::ops::Range;

use candle::{bail, Result};

use super::window::{Mask, Window, CAUSAL};

/// Query rows of one sequence that one call of our op computes exactly: over keys `keys` of
/// the sequence, with `mask` (aligned bottom-right within the segment) and the ALiBi slopes
/// negated if `flip_alibi`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Segment {
    pub(super) rows: Range<usize>,
    pub(super) keys: Range<usize>,
    pub(super) mask: Mask,
    pub(super) flip_alibi: bool,
}

/// A sequence under `window` alone: our op's mask for the whole sequence, but for the
/// [`Window::clipped_rows`].
pub(super) fn window_segments(window: Window, sq: usize, sk: usize) -> Vec<Segment> {
    let top = window.clipped_rows(sq, sk);
    let mut segments = Vec::with_capacity(2);
    if top > 0 {
        segments.push(Segment {
            rows: 0..top,
            keys: 0..sk - 1,
            mask: CAUSAL,
            flip_alibi: true,
        });
    }
    segments.push(Segment {
        rows: top..sq,
        keys: 0..sk,
        mask: window.mask(),
        flip_alibi: false,
    });
    segments
}

/// One end of the keys a row sees: a fixed key index, or the row's position `p` plus an
/// offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Edge {
    At(i64),
    Diag(i64),
}

/// A sequence of `sq` queries and `sk` keys under a local window `(left, right)` joined with
/// prefix ranges (half-open, `start < end`): upstream's query at position `p` sees the keys
/// of the window, and those of each range that contains `p`, within `0..sk`. Each row's keys
/// form one interval (all the pieces contain `p`) whose ends are fixed or follow `p`; rows
/// whose ends have the same form make one segment.
///
/// A segment's call aligns its diagonal with the upper end: a fixed end `e` is the end of its
/// key slice (no right side), an end `p + c` makes it causal over keys up to the last row's
/// `p + c`; a lower end `p + c` is its left side, measured from that diagonal. The diagonal
/// moves by a per-segment amount, which would shift ALiBi distances: these calls take none.
pub(super) fn prefix_segments(
    sq: usize,
    sk: usize,
    left: usize,
    right: usize,
    ranges: &[(i64, i64)],
) -> Result<Vec<Segment>> {
    let (sq_i, sk_i) = (sq as i64, sk as i64);
    // Sides past sq + sk act like sq + sk for every row; the arithmetic then stays in i64.
    let reach = sq_i + sk_i;
    let side = |w: usize| i64::try_from(w).unwrap_or(i64::MAX).min(reach);
    let (l, r) = (side(left), side(right));
    let edges = |i: usize| -> Option<(Edge, Edge)> {
        let p = i as i64 + sk_i - sq_i;
        let covering = ranges.iter().filter(|&&(s, e)| s <= p && p < e);
        let start = covering.clone().map(|&(s, _)| s).min().unwrap_or(i64::MAX);
        let end = covering.map(|&(_, e)| e).max().unwrap_or(i64::MIN);
        let (lo, lo_edge) = match start < p - l {
            true => (start, Edge::At(start)),
            false => (p - l, Edge::Diag(-l)),
        };
        let (lo, lo_edge) = if lo <= 0 {
            (0, Edge::At(0))
        } else {
            (lo, lo_edge)
        };
        let (hi, hi_edge) = match end > p + r + 1 {
            true => (end, Edge::At(end)),
            false => (p + r + 1, Edge::Diag(r + 1)),
        };
        let (hi, hi_edge) = if hi >= sk_i {
            (sk_i, Edge::At(sk_i))
        } else {
            (hi, hi_edge)
        };
        (lo < hi).then_some((lo_edge, hi_edge))
    };
    let mut segments = Vec::new();
    let mut i0 = 0;
    while i0 < sq {
        let form = edges(i0);
        let mut i1 = i0 + 1;
        while i1 < sq && edges(i1) == form {
            i1 += 1;
        }
        segments.push(match form {
            // Rows that see no key: a call over no key outputs zeros.
            None => Segment {
                rows: i0..i1,
                keys: 0..0,
                mask: Mask::default(),
                flip_alibi: false,
            },
            Some((lo, hi)) => edge_segment(i0..i1, sq_i, sk_i, lo, hi)?,
        });
        i0 = i1;
    }
    Ok(segments)
}

/// The call for rows `rows` whose visible keys run from `lo` to `hi` (see [`prefix_segments`]).
fn edge_segment(rows: Range<usize>, sq: i64, sk: i64, lo: Edge, hi: Edge) -> Result<Segment> {
    let (p0, p1) = (rows.start as i64 + sk - sq, rows.end as i64 + sk - sq);
    // The segment's diagonal is `p + shift` for the row at position `p`.
    let (end, causal, shift) = match hi {
        Edge::At(e) => (e, false, e - p1),
        Edge::Diag(c) => (p1 - 1 + c, true, c - 1),
    };
    let (start, left) = match lo {
        Edge::At(s) => (s, None),
        Edge::Diag(c) => (p0 + c, Some(shift - c)),
    };
    let index = |x: i64| usize::try_from(x).ok();
    match (index(start), index(end), left.map(index)) {
        (Some(start), Some(end), None) if start <= end => Ok(Segment {
            rows,
            keys: start..end,
            mask: Mask {
                causal,
                left: None,
                right: None,
            },
            flip_alibi: false,
        }),
        (Some(start), Some(end), Some(Some(left))) if start <= end => Ok(Segment {
            rows,
            keys: start..end,
            mask: Mask {
                causal,
                left: Some(left),
                right: None,
            },
            flip_alibi: false,
        }),
        _ => bail!(
            "mm_prefix_ranges: internal error, rows {rows:?} got keys {start}..{end}, \
             left side {left:?}"
        ),
    }
}
