//! Upstream's window conventions: its `Option<usize>` sides converted into the mask its
//! kernels apply, and into our op's mask with the rows where the two differ.

/// A mask of our op: causal and [`Options::window`](crate::FlashAttn::window) sides (a side at or past a sequence's key
/// count is unbounded there).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Mask {
    pub(super) causal: bool,
    pub(super) left: Option<usize>,
    pub(super) right: Option<usize>,
}

pub(super) const CAUSAL: Mask = Mask {
    causal: true,
    left: None,
    right: None,
};

/// The mask upstream's kernels apply, after its conversions of the `Option<usize>` sides
/// (module docs, "Windows"), with `limit` = seqlen_k (fixed length) or max_seqlen_k (varlen).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Window {
    Full,
    Causal,
    /// Query at position `p` sees keys `p - left ..= p + right`, both sides finite.
    Local {
        left: usize,
        right: usize,
    },
}

impl Window {
    pub(super) fn new(
        left: Option<usize>,
        right: Option<usize>,
        limit: usize,
        prefix_ranges: bool,
    ) -> Self {
        let within = |w: Option<usize>| w.filter(|&w| w <= limit);
        let (mut left, right) = (within(left), within(right));
        // Upstream turns causal into a local window when prefix ranges are given, so that
        // its kernels mask every key block (the ranges reach right of the diagonal).
        if prefix_ranges && left.is_none() && right == Some(0) {
            left = Some(limit);
        }
        match (left, right) {
            (None, None) => Self::Full,
            (None, Some(0)) => Self::Causal,
            (None, Some(right)) => Self::Local { left: limit, right },
            (Some(left), None) => Self::Local { left, right: limit },
            (Some(left), Some(right)) => Self::Local { left, right },
        }
    }

    /// Our op's mask for this window: exact for every row but [`Window::clipped_rows`].
    pub(super) fn mask(self) -> Mask {
        match self {
            Self::Full => Mask::default(),
            Self::Causal => CAUSAL,
            Self::Local { left, right } => Mask {
                causal: false,
                left: Some(left),
                right: Some(right),
            },
        }
    }

    /// The first rows of a sequence of `sq` queries and `sk` keys on which our op's window
    /// differs from upstream's: with a right side `r >= sk` our op leaves that side unbounded,
    /// upstream does not, which matters for rows `i < sq - 1 - r` (position `p < sk - 1 - r`,
    /// hence `p < 0`).
    ///
    /// Those rows see keys `0 ..= p + r` (their left side lies before key 0), all below
    /// `sk - 1`: a causal call of these rows over keys `0..sk - 1` has its diagonal exactly at
    /// `p + r`. Its ALiBi distances `p + r - j` are upstream's `j - p` reflected around a
    /// per-row constant, so negated slopes give the same scores up to a per-row constant,
    /// which the softmax cancels.
    pub(super) fn clipped_rows(self, sq: usize, sk: usize) -> usize {
        match self {
            Self::Local { right, .. } if sk > 0 && right >= sk && sq > 0 && right < sq - 1 => {
                sq - 1 - right
            }
            _ => 0,
        }
    }
}
