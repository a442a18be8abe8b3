//! The sizes of one attention call, shared by validation (params) and the score modifiers.

/// Sizes of one attention call. Fixed length: q is `(b, sq, h, d)`, k and v are
/// `(b, sk, hk, d)`. Variable length (packed): q is `(total_q, h, d)`, k and v are
/// `(total_k, hk, d)`, `b` is the number of sequences and `sq`, `sk` their maximum lengths.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct AttnShape {
    pub b: usize,
    pub sq: usize,
    pub sk: usize,
    pub h: usize,
    pub hk: usize,
    pub d: usize,
    /// Query rows over all sequences: `b * sq` for fixed length.
    pub total_q: usize,
    /// Key rows over all sequences: `b * sk` for fixed length.
    pub total_k: usize,
}

impl AttnShape {
    /// A fixed-length problem.
    pub fn fixed(b: usize, sq: usize, sk: usize, h: usize, hk: usize, d: usize) -> Self {
        Self {
            b,
            sq,
            sk,
            h,
            hk,
            d,
            total_q: b * sq,
            total_k: b * sk,
        }
    }
    pub fn q_elems(&self) -> usize {
        self.total_q * self.h * self.d
    }
    pub fn kv_elems(&self) -> usize {
        self.total_k * self.hk * self.d
    }
    /// Query heads that share one K/V head.
    pub fn group(&self) -> usize {
        self.h / self.hk
    }
}
