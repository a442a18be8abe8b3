//! Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11), the
//! counter-based generator behind attention dropout. `cuda/philox.cuh` is the same function;
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

/// Ten rounds of Philox4x32 on `counter` with `key`.
pub(crate) fn philox4x32_10(mut c: [u32; 4], mut k: [u32; 2]) -> [u32; 4] {
    for round in 0..10 {
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

/// Entries with a random word below this are dropped: `floor(p * 2^32)`.
pub(crate) fn drop_threshold(p: f32) -> u32 {
    (p as f64 * 4_294_967_296.0).min(u32::MAX as f64) as u32
}

/// Whether entry (query `i`, key `j`) of sequence `b`, head `h` (of `num_heads`) is kept.
///
/// One Philox call covers a 2x2 block of (query, key) pairs, so both the forward (which holds
/// one query and two neighbouring keys per thread) and the transposed dK/dV pass (two
/// neighbouring queries, one key) use half of each call:
/// counter = (j / 2, i / 2, b * num_heads + h, offset_lo), key = (seed_lo, seed_hi ^ offset_hi),
/// word = (i % 2) * 2 + j % 2.
pub(crate) fn keep(d: &Dropout, num_heads: usize, b: usize, h: usize, i: usize, j: usize) -> bool {
    let counter = [
        (j / 2) as u32,
        (i / 2) as u32,
        (b * num_heads + h) as u32,
        d.offset as u32,
    ];
    let key = [
        d.seed as u32,
        (d.seed >> 32) as u32 ^ (d.offset >> 32) as u32,
    ];
    let words = philox4x32_10(counter, key);
    words[(i % 2) * 2 + j % 2] >= drop_threshold(d.p)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Known-answer tests from Random123's kat_vectors for philox4x32_10.
    #[test]
    fn philox_known_answers() {
        assert_eq!(
            philox4x32_10([0; 4], [0; 2]),
            [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]
        );
        assert_eq!(
            philox4x32_10([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]
        );
        assert_eq!(
            philox4x32_10(
                [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
                [0xa4093822, 0x299f31d0]
            ),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }

    #[test]
    fn threshold_edges() {
        assert_eq!(drop_threshold(0.0), 0);
        assert_eq!(drop_threshold(0.5), 1 << 31);
    }
}
