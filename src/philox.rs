//! Philox4x32-7 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11), the
//! counter-based generator behind attention dropout. `cuda/common/philox.cuh` is the same function;
//! the two must agree bit for bit so that CPU and GPU drop the same entries and the backward
//! pass regenerates the forward's mask from (seed, offset) with O(1) extra memory.

use crate::params::Dropout;

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = a as u64 * b as u64;
    ((p >> 32) as u32, p as u32)
}

/// Rounds per dropout draw. The paper finds 7 rounds of Philox4x32 pass BigCrush (10 is
/// Random123's default, with a safety margin); FlashAttention-2's dropout runs 7 too. The
/// draws are integer work beside the tensor cores, and the dropout kernels are bound by them.
pub(crate) const ROUNDS: usize = 7;

/// `R` rounds of Philox4x32 on `counter` with `key`.
pub(crate) fn philox4x32<const R: usize>(mut c: [u32; 4], mut k: [u32; 2]) -> [u32; 4] {
    for round in 0..R {
        if round > 0 {
            k[0] = k[0].wrapping_add(W0);
            k[1] = k[1].wrapping_add(W1);
        }
        let (hi0, lo0) = mulhilo(M0, c[0]);
        let (hi1, lo1) = mulhilo(M1, c[2]);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
    }
    c
}

/// Entries with a random half word (16 bits) below this are dropped: `p * 2^16` rounded, so
/// the drop probability is `p` to the nearest multiple of 2^-16 (0 below 2^-17: nothing is
/// dropped, and [`keep_scale`] is 1).
pub(crate) fn drop_threshold(p: f32) -> u32 {
    (p as f64 * 65_536.0).round().min(65_535.0) as u32
}

/// The factor of kept probabilities, `1 / (1 - p)`; 1 where nothing is dropped.
pub(crate) fn keep_scale(p: f32) -> f32 {
    if drop_threshold(p) == 0 {
        1.0
    } else {
        1.0 / (1.0 - p)
    }
}

/// Whether entry (query `i`, key `j`) of sequence `b`, head `h` (of `num_heads`) is kept.
///
/// One Philox call gives 8 entries, the half words of its 4 words: queries `i0` and `i0 + 8`
/// by keys `j0`, `j0 + 1`, `j0 + 8` and `j0 + 9`, with `i0 = 16 (i / 16) + i % 8` and
/// `j0 = 16 (j / 16) + 2 ((j % 8) / 2)`. Those are the 8 entries a lane of an MMA
/// accumulator fragment (rows g and g + 8, column pairs 2t in two neighbouring n8 tiles) holds,
/// so that a kernel draws each call once (`Dropout::keep_fragment` in cuda/common/philox.cuh):
/// counter = (4 (j / 16) + (j % 8) / 2, 8 (i / 16) + i % 8, b * num_heads + h, offset_lo),
/// key = (seed_lo, seed_hi ^ offset_hi), word = 2 ((i % 16) / 8) + (j % 16) / 8, its low half
/// for even j, its high half for odd j. The library draws through [`RowKeep`] (each call once
/// per row); this is the entry-by-entry definition its test checks it against.
#[cfg(test)]
pub(crate) fn keep(d: &Dropout, num_heads: usize, b: usize, h: usize, i: usize, j: usize) -> bool {
    let counter = [
        (4 * (j / 16) + (j % 8) / 2) as u32,
        (8 * (i / 16) + i % 8) as u32,
        (b * num_heads + h) as u32,
        d.offset as u32,
    ];
    let key = [
        d.seed as u32,
        (d.seed >> 32) as u32 ^ (d.offset >> 32) as u32,
    ];
    let word = philox4x32::<ROUNDS>(counter, key)[2 * ((i % 16) / 8) + (j % 16) / 8];
    let half = if j.is_multiple_of(2) {
        word & 0xffff
    } else {
        word >> 16
    };
    half >= drop_threshold(d.p)
}

/// The keep decisions of one row (query `i` of sequence `b`, head `h`), asked key by key: the
/// 4 of the row's entries that a Philox call covers ([`keep`]: keys `j0`, `j0 + 1`, `j0 + 8`,
/// `j0 + 9`) come from one draw, kept in one of 4 slots (one per key pair of an 8-key half)
/// until the row moves to the next 16 keys.
pub(crate) struct RowKeep {
    key: [u32; 2],
    counter: [u32; 4],
    threshold: u32,
    /// The row's pair of words (row `i % 16 / 8` of the call's two) from 2 * that row.
    word_row: usize,
    /// Per slot `(j % 8) / 2`: the 16-key group `j / 16` it holds, and the call's words.
    slots: [Option<(usize, [u32; 4])>; 4],
}

impl RowKeep {
    pub(crate) fn new(d: &Dropout, num_heads: usize, b: usize, h: usize, i: usize) -> Self {
        RowKeep {
            key: [
                d.seed as u32,
                (d.seed >> 32) as u32 ^ (d.offset >> 32) as u32,
            ],
            counter: [
                0,
                (8 * (i / 16) + i % 8) as u32,
                (b * num_heads + h) as u32,
                d.offset as u32,
            ],
            threshold: drop_threshold(d.p),
            word_row: 2 * ((i % 16) / 8),
            slots: [None; 4],
        }
    }

    /// Whether key `j` of the row is kept.
    pub(crate) fn kept(&mut self, j: usize) -> bool {
        let (group, slot) = (j / 16, (j % 8) / 2);
        let words = match self.slots[slot] {
            Some((g, words)) if g == group => words,
            _ => {
                let mut counter = self.counter;
                counter[0] = (4 * group + slot) as u32;
                let words = philox4x32::<ROUNDS>(counter, self.key);
                self.slots[slot] = Some((group, words));
                words
            }
        };
        let word = words[self.word_row + (j % 16) / 8];
        let half = if j.is_multiple_of(2) {
            word & 0xffff
        } else {
            word >> 16
        };
        half >= self.threshold
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Known-answer tests from Random123's kat_vectors, for the rounds dropout runs and for
    /// the library's default 10 (the round function, the key schedule).
    #[test]
    fn philox_known_answers() {
        assert_eq!(ROUNDS, 7);
        // (counter, key, 7 rounds, 10 rounds)
        for (c, k, r7, r10) in [
            (
                [0; 4],
                [0; 2],
                [0x5f6fb709, 0x0d893f64, 0x4f121f81, 0x4f730a48],
                [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8],
            ),
            (
                [u32::MAX; 4],
                [u32::MAX; 2],
                [0x5207ddc2, 0x45165e59, 0x4d8ee751, 0x8c52f662],
                [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd],
            ),
            (
                [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
                [0xa4093822, 0x299f31d0],
                [0x4dfccaba, 0x190a87f0, 0xc47362ba, 0xb6b5242a],
                [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1],
            ),
        ] {
            assert_eq!(philox4x32::<7>(c, k), r7, "7 rounds of {c:x?}");
            assert_eq!(philox4x32::<10>(c, k), r10, "10 rounds of {c:x?}");
        }
    }

    #[test]
    fn threshold_edges() {
        assert_eq!(drop_threshold(0.0), 0);
        assert_eq!(drop_threshold(0.5), 1 << 15);
        assert_eq!(drop_threshold(1e-6), 0);
        assert_eq!(keep_scale(1e-6), 1.0);
        assert_eq!(drop_threshold(0.999_999), 65_535);
    }

    /// A row drawn key by key through `RowKeep` (in order, and jumping back and across
    /// 16-key groups, as the CPU passes' windows and tiles do) equals `keep` entry by entry.
    #[test]
    fn row_keep_is_keep() {
        let d = Dropout {
            p: 0.3,
            seed: 0x1234_5678_9abc_def0,
            offset: (7 << 32) | 5,
        };
        let keys: Vec<usize> = (0..70).chain([3, 64, 17, 1, 200, 16, 0]).collect();
        for (b, h, i) in [(0, 0, 0), (1, 3, 9), (2, 1, 17), (0, 2, 1000)] {
            let mut row = RowKeep::new(&d, 4, b, h, i);
            for &j in &keys {
                assert_eq!(
                    row.kept(j),
                    keep(&d, 4, b, h, i, j),
                    "b {b} h {h} i {i} j {j}"
                );
            }
        }
        // And `dropout_mask`, which draws a row at a time.
        let (b, h, sq, sk) = (2, 3, 40, 70);
        let mask = crate::dropout_mask(d.p, d.seed, d.offset, b, h, sq, sk)
            .and_then(|m| m.flatten_all()?.to_vec1::<u8>())
            .unwrap();
        for (n, &m) in mask.iter().enumerate() {
            let (bi, hi, i, j) = (n / (h * sq * sk), n / (sq * sk) % h, n / sk % sq, n % sk);
            assert_eq!(
                m == 1,
                keep(&d, h, bi, hi, i, j),
                "b {bi} h {hi} i {i} j {j}"
            );
        }
    }

    /// Every (i, j) of a 32 x 32 block maps to its own (counter, word, half): the 8-entry
    /// blocks tile the plane.
    #[test]
    fn entries_have_distinct_draws() {
        let mut seen = std::collections::HashSet::new();
        for i in 0..32usize {
            for j in 0..32usize {
                let draw = (
                    4 * (j / 16) + (j % 8) / 2,
                    8 * (i / 16) + i % 8,
                    2 * ((i % 16) / 8) + (j % 16) / 8,
                    j % 2,
                );
                assert!(seen.insert(draw), "({i}, {j}) shares {draw:?}");
            }
        }
    }
}
