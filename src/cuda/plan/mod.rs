//! The planners: a problem and the device's facts in, the kernels to launch out, chosen from
//! the catalogue by their fields. One per pass: [`plan_fwd`], [`plan_bwd`], [`plan_decode`].
//! The A/B switches they honour are read once (`super::overrides`).

mod bwd;
#[cfg(test)]
mod coverage;
mod decode;
mod fwd;

pub(crate) use bwd::{plan_bwd, BwdPlan, BwdQuery};
pub(crate) use decode::{plan_decode, DecodeQuery};
pub(crate) use fwd::{plan_fwd, FwdQuery};

use std::sync::OnceLock;

use super::catalogue::{Family, Kernel, Mods};
use super::overrides::overrides;

/// The smallest compiled head dim class of the mma.sync forward at or above `d` (every
/// kernel family compiles the same classes; d <= 256 was validated). A table built once: the
/// decode path asks per layer and step.
pub(crate) fn head_dim_class(d: usize) -> usize {
    static CLASSES: OnceLock<Vec<u16>> = OnceLock::new();
    let classes = CLASSES.get_or_init(|| {
        let mut ds: Vec<u16> = Kernel::ALL
            .iter()
            .map(|k| k.variant())
            .filter(|v| v.family == Family::Fwd)
            .map(|v| v.d)
            .collect();
        ds.sort_unstable();
        ds.dedup();
        ds
    });
    classes
        .iter()
        .map(|&c| usize::from(c))
        .find(|&c| c >= d)
        .unwrap_or(256)
}

/// The widest tiles of the warp-specialized kernels (forward and backward) that run head dim
/// `d`, if any do: the classes between the compiled ones (32: up to 32; 96: 65-96; 160, 192
/// and 224: 129-224) run the next one up, their columns past the head dim zero (TMA's fill),
/// as 33-63, 97-127 and 225-255 do in theirs (before that, the cut kernels of
/// [`ws_cut_dims`], and for the forward's plain problems at 129-192 its 192-column tiles:
/// plan/fwd.rs). At 129-192 the d = 256 kernels, a quarter to half of their matmul work on
/// zero columns, still ran 1.56-2.23x the older kernels forward and 1.43-2.65x backward (H100;
/// docs/archive/PERF.md, "Head dims 129-192 on the d 256 kernels"); `CANDLE_FLASH_WS_WIDE=0`
/// sends those head dims back to the older kernels, 192-column tiles included (A/B runs).
pub(crate) fn ws_head_dim(d: usize) -> Option<usize> {
    match head_dim_class(d) {
        32 | 64 => Some(64),
        96 | 128 => Some(128),
        224 | 256 => Some(256),
        160 | 192 if !overrides().ws_wide_off => Some(256),
        _ => None,
    }
}

/// The head dims of `family`'s cut warp-specialized kernels that may run head dim `d` on
/// tiles `tiles` wide, narrowest first: the catalogue's cut rows (`Variant::tiles_d` above
/// their head dim: up to 48 on d 64's tiles, 65-96 on d 128's, the forward's 129-160 on d
/// 192's, the backward's 129-192 on d 256's) at least `d` wide. Whether one is compiled for
/// the problem's features is the planner's lookup (none has score modifiers or the block
/// mask; above 128 plain problems alone). For A/B runs `CANDLE_FLASH_WS_SHAPE=d<N>` keeps
/// those narrower than N out ([`ws_floor`]; `d64`, `d128`, `d256`: the tiles' own kernels).
pub(crate) fn ws_cut_dims(family: Family, d: usize, tiles: usize) -> impl Iterator<Item = usize> {
    static CUTS: OnceLock<Vec<(Family, usize, usize)>> = OnceLock::new();
    let cuts = CUTS.get_or_init(|| {
        let mut cuts: Vec<(Family, usize, usize)> = Kernel::ALL
            .iter()
            .map(|k| k.variant())
            .filter(|v| matches!(v.family, Family::FwdWs | Family::BwdWs) && v.tiles_d() != v.d)
            .map(|v| (v.family, usize::from(v.d), usize::from(v.tiles_d())))
            .collect();
        cuts.sort_unstable_by_key(|&(f, cut, t)| (f as u8, cut, t));
        cuts.dedup();
        cuts
    });
    let floor = ws_floor();
    cuts.iter()
        .filter(move |&&(f, cut, t)| f == family && t == tiles && cut >= d.max(floor))
        .map(|&(_, cut, _)| cut)
}

/// `CANDLE_FLASH_WS_SHAPE=d<N>` (A/B runs): no warp-specialized kernel narrower than N, cut
/// or tiles (0: no floor).
pub(crate) fn ws_floor() -> usize {
    overrides()
        .ws_shape
        .strip_prefix('d')
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

/// Whether packed batches and dropout may take the warp-specialized kernels (forward and
/// backward): `CANDLE_FLASH_WS_PACKED=0` and `CANDLE_FLASH_WS_DROPOUT=0` send them to the
/// older kernels (A/B runs; docs/archive/PERF.md, "Packed batches on the warp-specialized
/// kernels", "Against the older kernels and PyTorch"). Whether a kernel is compiled for the
/// combination is the catalogue's to say (none has packed batches or dropout with mods).
pub(crate) fn ws_variant_allowed(mods: Mods, packed: bool, dropout: bool) -> bool {
    let o = overrides();
    let off = (packed && o.ws_packed_off) || (dropout && o.ws_dropout_off);
    !off && !((packed || dropout) && mods != Mods::None)
}

/// The devices the planners' unit tests plan for (the default switches: no CANDLE_FLASH_*
/// variable set).
#[cfg(test)]
mod test_facts {
    use super::super::runtime::DeviceFacts;

    /// H100 and H200 alike: 132 SMs, 227 KB of shared memory per block.
    pub const HOPPER: DeviceFacts = DeviceFacts {
        major: 9,
        sms: 132,
        smem: 227 * 1024,
    };
    pub const A100: DeviceFacts = DeviceFacts {
        major: 8,
        sms: 108,
        smem: 163 * 1024,
    };
    /// sm_86 and sm_89 (RTX 3090, 4090, L40S): 99 KB of shared memory per block.
    pub const ADA: DeviceFacts = DeviceFacts {
        major: 8,
        sms: 128,
        smem: 99 * 1024,
    };
}
