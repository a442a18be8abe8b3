//! Every `CANDLE_FLASH_*` variable the CUDA path reads at run time, read once (at the first
//! launch) into one typed struct. None is needed in normal use: they force a kernel family
//! (to test the Ampere/Ada kernels on a Hopper GPU), switch a choice off so that one binary can
//! time both sides of it (A/B runs), or poison outputs for the tests. An unknown value is the
//! same as an unset variable.
//!
//! | variable | values | effect |
//! |---|---|---|
//! | `CANDLE_FLASH_ARCH` | `sm80` | the sm_80 kernels on any GPU (no wgmma, no programmatic launch) |
//! | `CANDLE_FLASH_SMEM_KB` | KB | caps the shared memory per block the kernels may use (99: Ada, 163: A100) |
//! | `CANDLE_FLASH_FWD` | `mma`, `sm90` | the mma.sync forward, or the first (not warp-specialized) wgmma forward |
//! | `CANDLE_FLASH_MMA` | `any`, `base`, `wide` | `any`: the mma.sync kernels compiled with every score modifier for plain problems too (forward and fused backward); `base`: the plain forward's own key tile where a wider one is compiled; `wide`: the wider one for causal problems at d 64 too |
//! | `CANDLE_FLASH_SM90_SHAPE` | `g1`, `g1n64`, `g2`, `g3` | the first wgmma forward's consumer groups and key tile |
//! | `CANDLE_FLASH_WS_SHAPE` | `base`, `g3`, `n<keys>` (e.g. `n176`) | the warp-specialized forward's tile shape, where compiled (plan/fwd.rs); `d<N>`: no kernel narrower than N, cut or tiles, forward and backward (`d64`, `d128`: head dims up to 48 / 65-96 on d 64's / d 128's kernels instead of `_d32`/`_d48` / `_d80`/`_d96`; `d256`: 129-192 on d 256's instead of the forward's 192-column tiles and the backward's `_d160`/`_d192`; `d48`, `d96`: not `_d32` / `_d80`; `d192`: not the forward's `_d160` nor the backward's `_d160`; plan::ws_cut_dims, plan::ws_floor); FP8: `base` the narrowest key tiles, `n<keys>` that width instead of the widest (fwd_fp8.rs) |
//! | `CANDLE_FLASH_WS_PERSISTENT` | `0` | one block per tile instead of persistent blocks |
//! | `CANDLE_FLASH_WS_WIDE` | `0` | head dims 129-192 off the warp-specialized kernels (d 256's and the forward's 192-column tiles) |
//! | `CANDLE_FLASH_WS_PACKED` | `0` | packed batches off the `_packed` warp-specialized kernels |
//! | `CANDLE_FLASH_WS_DROPOUT` | `0` | dropout off the `_dropout` warp-specialized kernels |
//! | `CANDLE_FLASH_WS_LPT` | waves | the forward's longest-first tail (default 2, 0 none) |
//! | `CANDLE_FLASH_BWD_LPT` | waves | the backward's longest-first tail (default 2, 0 none) |
//! | `CANDLE_FLASH_BWD` | `separate`, `sm90`, `bn64`, `bn128`, `bn128t`, `grid` | the older backward kernels: deterministic pair, first wgmma, mma.sync fused shape (`bn128t`: the 128-key shapes without FlashAttention-2's warp layout, `grid`: only that layout, at d 256 within 163 KB too) |
//! | `CANDLE_FLASH_BWD_CAP` | `0` | a softcap's backward on the `_mods` kernels instead of `_cap` |
//! | `CANDLE_FLASH_DET_GROUP` | `0` | the deterministic backward's pairs in order instead of interleaved by wave |
//! | `CANDLE_FLASH_DECODE_SPLITS` | n > 0 | the decode split count (capped) |
//! | `CANDLE_FLASH_DECODE_WARPS` | `4` | every decode launch on 4-warp blocks (one-wave grids take 8-warp blocks where compiled) |
//! | `CANDLE_FLASH_DECODE_CLUSTER` | `0` | split decode launches merge through global memory, not inside thread-block clusters |
//! | `CANDLE_FLASH_DECODE_TRIGGER` | `0` | decode grids of one partial wave wait for their exit to let the next kernel in, as larger ones do |
//! | `CANDLE_FLASH_FUSED_APPEND` | `0` | a decoding call's K/V appends as launches of their own, not inside the decode launch |
//! | `CANDLE_FLASH_GEMV_MMA` | `0` | `infer::linear` and its fused forms at 5-16 rows on Candle's matmul instead of the tensor-core kernel (`infer::fused_max_rows` then 4: a comparison aid) |
//! | `CANDLE_FLASH_GEMV_SPLIT` | 1, 2, 4, 8, 16 | warps per 16-column tile of `infer::linear` at 5-16 rows |
//! | `CANDLE_FLASH_PDL` | `0` | no programmatic dependent launch |
//! | `CANDLE_FLASH_GRAPH` | `captured` | `graph::CapturedGraph::capture` instantiates the graph as captured (memory nodes left in the kernels' chain) |
//! | `CANDLE_FLASH_POISON` | `1` | outputs filled with NaN before each launch (unwritten elements show) |

use std::sync::OnceLock;

/// The overrides, as the environment gave them when first asked.
#[derive(Debug, Default)]
pub(crate) struct Overrides {
    pub arch_sm80: bool,
    pub smem_kb: Option<usize>,
    /// `CANDLE_FLASH_FWD`, empty when unset.
    pub fwd: String,
    /// `CANDLE_FLASH_MMA`, empty when unset.
    pub mma: String,
    /// `CANDLE_FLASH_SM90_SHAPE`, empty when unset.
    pub sm90_shape: String,
    /// `CANDLE_FLASH_WS_SHAPE`, empty when unset.
    pub ws_shape: String,
    pub ws_persistent_off: bool,
    pub ws_wide_off: bool,
    pub ws_packed_off: bool,
    pub ws_dropout_off: bool,
    pub fwd_tail_waves: usize,
    pub bwd_tail_waves: usize,
    /// `CANDLE_FLASH_BWD`, if set.
    pub bwd: Option<String>,
    pub bwd_cap_off: bool,
    pub det_group_off: bool,
    pub decode_splits: Option<usize>,
    pub decode_four_warps: bool,
    pub decode_cluster_off: bool,
    pub decode_trigger_off: bool,
    pub fused_append_off: bool,
    pub gemv_mma_off: bool,
    pub gemv_split: Option<usize>,
    pub pdl_off: bool,
    pub graph_as_captured: bool,
    pub poison: bool,
}

/// The overrides of this process (read at the first call).
pub(crate) fn overrides() -> &'static Overrides {
    static READ: OnceLock<Overrides> = OnceLock::new();
    READ.get_or_init(|| Overrides::from(|name| std::env::var(name).ok()))
}

impl Overrides {
    /// From a lookup of variable names (the environment, or a table in tests).
    fn from(var: impl Fn(&str) -> Option<String>) -> Self {
        let get = |name: &str| var(&format!("CANDLE_FLASH_{name}"));
        let is = |name: &str, value: &str| get(name).is_some_and(|v| v == value);
        let number = |name: &str| get(name).and_then(|v| v.parse::<usize>().ok());
        Self {
            arch_sm80: is("ARCH", "sm80"),
            smem_kb: number("SMEM_KB"),
            fwd: get("FWD").unwrap_or_default(),
            mma: get("MMA").unwrap_or_default(),
            sm90_shape: get("SM90_SHAPE").unwrap_or_default(),
            ws_shape: get("WS_SHAPE").unwrap_or_default(),
            ws_persistent_off: is("WS_PERSISTENT", "0"),
            ws_wide_off: is("WS_WIDE", "0"),
            ws_packed_off: is("WS_PACKED", "0"),
            ws_dropout_off: is("WS_DROPOUT", "0"),
            fwd_tail_waves: number("WS_LPT").unwrap_or(2),
            bwd_tail_waves: number("BWD_LPT").unwrap_or(2),
            bwd: get("BWD"),
            bwd_cap_off: is("BWD_CAP", "0"),
            det_group_off: is("DET_GROUP", "0"),
            decode_splits: number("DECODE_SPLITS").filter(|&n| n > 0),
            decode_four_warps: is("DECODE_WARPS", "4"),
            decode_cluster_off: is("DECODE_CLUSTER", "0"),
            decode_trigger_off: is("DECODE_TRIGGER", "0"),
            fused_append_off: is("FUSED_APPEND", "0"),
            gemv_mma_off: is("GEMV_MMA", "0"),
            gemv_split: number("GEMV_SPLIT").filter(|n| [1, 2, 4, 8, 16].contains(n)),
            pdl_off: is("PDL", "0"),
            graph_as_captured: is("GRAPH", "captured"),
            poison: is("POISON", "1"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unset_is_the_default_choice() {
        let o = Overrides::from(|_| None);
        assert!(!o.arch_sm80 && !o.poison && !o.pdl_off && o.bwd.is_none());
        assert!(!o.fused_append_off && !o.decode_trigger_off);
        assert_eq!((o.fwd_tail_waves, o.bwd_tail_waves), (2, 2));
        assert_eq!((o.smem_kb, o.decode_splits), (None, None));
    }

    #[test]
    fn values_are_read_by_their_names() {
        let env = [
            ("CANDLE_FLASH_ARCH", "sm80"),
            ("CANDLE_FLASH_SMEM_KB", "99"),
            ("CANDLE_FLASH_WS_PACKED", "0"),
            ("CANDLE_FLASH_WS_LPT", "0"),
            ("CANDLE_FLASH_DECODE_SPLITS", "0"),
            ("CANDLE_FLASH_DECODE_WARPS", "8"),
            ("CANDLE_FLASH_BWD", "bn64"),
            ("CANDLE_FLASH_FUSED_APPEND", "0"),
        ];
        let o = Overrides::from(|name| {
            env.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
        });
        assert!(o.arch_sm80 && o.ws_packed_off && !o.ws_dropout_off && o.fused_append_off);
        assert_eq!(
            (o.smem_kb, o.fwd_tail_waves, o.bwd_tail_waves),
            (Some(99), 0, 2)
        );
        // 0 splits and 8 warps are not overrides: the heuristics decide.
        assert_eq!((o.decode_splits, o.decode_four_warps), (None, false));
        assert_eq!(o.bwd.as_deref(), Some("bn64"));
    }
}
