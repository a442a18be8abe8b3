//! How many (sequence, head) pairs end a Hopper grid in longest-first order
//! (`cuda/common/lpt_tail.cuh`): the forward's masked walk over query blocks, the backward's grid of
//! key blocks.

/// Which kernel's tail: each has its own override (overrides.rs), for A/B runs in one binary.
#[derive(Clone, Copy, Debug)]
pub(super) enum Tail {
    /// `CANDLE_FLASH_WS_LPT`.
    Forward,
    /// `CANDLE_FLASH_BWD_LPT`.
    Backward,
}

impl Tail {
    /// Waves of tiles in the tail: two unless the variable says otherwise, 0 none.
    fn waves(self) -> usize {
        let o = super::overrides::overrides();
        match self {
            Tail::Forward => o.fwd_tail_waves,
            Tail::Backward => o.bwd_tail_waves,
        }
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
