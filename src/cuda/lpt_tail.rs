//! How many (sequence, head) pairs end a Hopper grid in longest-first order
//! (`cuda/lpt_tail.cuh`): the forward's masked walk over query blocks, the backward's grid of
//! key blocks.

use std::sync::OnceLock;

/// Which kernel's tail: each reads its own environment variable, for A/B runs in one binary.
#[derive(Clone, Copy, Debug)]
pub(super) enum Tail {
    /// `CANDLE_FLASH_WS_LPT`.
    Forward,
    /// `CANDLE_FLASH_BWD_LPT`.
    Backward,
}

impl Tail {
    /// Waves of tiles in the tail: two unless the variable says otherwise, 0 none (read once).
    fn waves(self) -> usize {
        static FWD: OnceLock<usize> = OnceLock::new();
        static BWD: OnceLock<usize> = OnceLock::new();
        let (cell, var) = match self {
            Tail::Forward => (&FWD, "CANDLE_FLASH_WS_LPT"),
            Tail::Backward => (&BWD, "CANDLE_FLASH_BWD_LPT"),
        };
        *cell.get_or_init(|| {
            std::env::var(var)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(2)
        })
    }

    /// The tail's pair count for `pairs` pairs of `per_pair` tiles each, `slots` tiles running
    /// at once: enough pairs for about `waves` waves of tiles, 0 where a pair has one tile.
    pub fn pairs(self, pairs: usize, per_pair: usize, slots: usize) -> i32 {
        let waves = self.waves();
        if waves == 0 || per_pair < 2 {
            return 0;
        }
        (waves * slots).div_ceil(per_pair).min(pairs) as i32
    }
}
