//! The backward's kernel choice. dsum, then either
//! - the dK/dV kernel and the dQ kernel (deterministic; any head dim), or
//! - for d <= 128 and d = 256 when the caller allows non-determinism (the default): one kernel
//!   for dK, dV and dQ, dQ summed with f32 atomics into a zeroed buffer, then a convert kernel.
//!
//! On Hopper at d 64 and 128, for batches whose tensors TMA can address, the fused kernel is
//! the warp-specialized one (packed batches in its `_packed` kernels, dropout in its
//! `_dropout` and `_packed_dropout` ones, a softcap without ALiBi at d 64 and 128 in its
//! `_cap` ones); packed batches with a softcap, ALiBi or block mask there take the first
//! wgmma kernel, dropout with one the mma.sync `_dropout` kernel. At head dims 65-96 its
//! d = 128 kernel and at 129-256 its d = 256 kernel also run (the columns past the head dim
//! zero), under the same conditions (65-96: without a block mask or a `CANDLE_FLASH_BWD`
//! override). It has a deterministic mode (the key blocks add dQ in order; under a block mask
//! in its `_sparse_det` kernels): `deterministic(true)` runs it there, and the dK/dV and dQ
//! kernels elsewhere. Elsewhere the mma.sync fused kernel takes 128 keys per block over 8
//! warps where that variant is compiled (d 64 and 128, no dropout) and fits: at d 128 on
//! FlashAttention-2's warp layout where 156 KB of shared memory is allowed (A100, Hopper:
//! +3-4% over the tall shape on the H100's sm_80 path; docs/archive/PERF.md, "the fused
//! backward on FlashAttention-2's warp layout"), and at d 256 (no dropout) on the same layout
//! with 64 keys where 184 KB is allowed: 1.4-1.75x the deterministic pair it replaces
//! (docs/archive/PERF.md, "the grid layout at d 256"; its Q single-buffered kernel for 163 KB
//! only under `CANDLE_FLASH_BWD=grid`, see below),
//! with twice the streamed query rows where 158 KB is (+3-5% at d 64; docs/archive/PERF.md,
//! "a taller 128-key backward"), else 64 keys over 4 warps: at hd 128,
//! seqlen 8k the 128-key shape measured 207 against 192 TFLOP/s (H200; docs/archive/PERF.md,
//! "backward: dQ by atomics in the dK/dV kernel, double-buffered Q/dO").
//!
//! `CANDLE_FLASH_BWD` overrides the choice for A/B comparisons of speed and accuracy:
//! `separate` forces the deterministic kernels everywhere; `sm90` the first wgmma kernel on
//! Hopper; `bn64`, `bn128`, `bn128t` (128 keys, twice the query rows per tile) and `grid`
//! (FlashAttention-2's warp layout) force the mma.sync fused kernel of that shape.

use candle::{bail, Result};

use super::super::catalogue::{Family, Kernel, Mods, Tile};
use super::super::overrides::overrides;
use super::super::runtime::DeviceFacts;
use super::{head_dim_class, ws_cut_dims, ws_head_dim, ws_variant_allowed};

/// What the backward's choice depends on.
#[derive(Clone, Copy, Debug)]
pub(crate) struct BwdQuery {
    pub d: usize,
    pub deterministic: bool,
    pub dropout: bool,
    pub mods: Mods,
    /// A softcap without ALiBi whose scale (softmax scale / cap) is at most 1 (the `_cap`
    /// kernels' condition, see [`ws_kernel`]).
    pub cap_alone: bool,
    pub packed: bool,
}

/// The kernels of one backward path (dsum runs before each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BwdPlan {
    /// dK/dV kernel + dQ kernel: deterministic, every head dim.
    Separate { dkdv: Kernel, dq: Kernel },
    /// dK/dV/dQ kernel with atomic dQ into its tiled dq_accum + convert kernel.
    Fused { dkdvq: Kernel, convert: Kernel },
    /// The wgmma dK/dV/dQ kernel + the flat dq_accum's convert kernel.
    Sm90 { dkdvq: Kernel, convert: Kernel },
    /// The warp-specialized kernels: prep, main, convert.
    Ws {
        prep: Kernel,
        main: Kernel,
        convert: Kernel,
    },
}

/// The backward's path for `q`: the warp-specialized one where a kernel is compiled for it
/// (the launcher then checks that TMA can address the tensors, else takes `fallback`).
pub(crate) fn plan_bwd(q: &BwdQuery, facts: &DeviceFacts) -> Result<(Option<BwdPlan>, BwdPlan)> {
    Ok((ws_plan(q, facts), without_ws(q, facts)?))
}

fn bwd_override() -> Option<&'static str> {
    overrides().bwd.as_deref()
}

/// The warp-specialized kernels of the head dim's class, on Hopper, deterministic or not.
/// `CANDLE_FLASH_BWD` (A/B runs) keeps them off: `separate` everywhere; `sm90`, `bn64`,
/// `bn128`, `bn128t`, `grid` where those kernels exist (64-128), but `bn*` under a block mask at
/// 64/128 still runs them (the fused mma.sync kernels have no `_sparse` variant). Head dims
/// 65-96 under a block mask keep the mma.sync kernels (measured only without one).
fn ws_plan(q: &BwdQuery, facts: &DeviceFacts) -> Option<BwdPlan> {
    let class = head_dim_class(q.d);
    let sparse = q.mods == Mods::Sparse;
    let d = ws_head_dim(class)?;
    let allowed = match bwd_override() {
        None => !(sparse && class == 96),
        Some("separate") => false,
        Some("sm90") => class > 192,
        Some(_) => class > 192 || (sparse && matches!(class, 64 | 128)),
    };
    if !facts.hopper() || !allowed || !ws_variant_allowed(q.mods, q.packed, q.dropout) {
        return None;
    }
    // The cut kernels' prep and convert kernels are those of the tiles' head dim (d).
    let main = ws_cut_dims(Family::BwdWs, q.d, d)
        .find_map(|c| ws_kernel(c, q))
        .or_else(|| ws_kernel(d, q))?;
    let helper = |family| Kernel::of(family, d, |_| true);
    Some(BwdPlan::Ws {
        prep: helper(Family::BwdWsPrep)?,
        main,
        convert: helper(Family::BwdWsConvert)?,
    })
}

/// The warp-specialized main kernel. At d = 64 and 128 a softcap without ALiBi takes the
/// `_cap` kernels, compiled with the capped probabilities' code alone. There dV is issued a
/// k16 step at a time under the tanh and exponentials, which the `_mods` kernel at d = 128
/// cannot do without ptxas serializing its wgmmas (docs/archive/PERF.md, "dV steps in the
/// `_mods` kernels, once more" and "`_cap` backward kernels: a softcap without ALiBi on its
/// own code"), and the K tile is multiplied by the softcap's scale once per block
/// (`prescale_k`), so only where that scale is at most 1: f16 keys cannot overflow.
/// `CANDLE_FLASH_BWD_CAP=0` keeps them on `_mods` (A/B runs, and the tests of the `_mods`
/// kernels' capped path). Deterministic under a block mask: the `_sparse_det` kernels (the
/// others have a run-time deterministic mode).
fn ws_kernel(d: usize, q: &BwdQuery) -> Option<Kernel> {
    let find = |mods: Mods| {
        Kernel::of(Family::BwdWs, d, |v| {
            v.mods == mods
                && v.packed == q.packed
                && v.dropout == q.dropout
                && v.deterministic == (q.deterministic && mods == Mods::Sparse)
        })
    };
    if q.mods == Mods::Scores && q.cap_alone && !overrides().bwd_cap_off {
        if let Some(k) = find(Mods::Cap) {
            return Some(k);
        }
    }
    find(q.mods)
}

/// The kernels before the warp-specialized ones; also where those were chosen but cannot run
/// (tensors TMA cannot address). The first wgmma kernel at 64/128 on Hopper, else the
/// mma.sync fused kernels up to 128, else the dK/dV and dQ kernels. The 128-key fused shapes
/// run only where they fit in the device's shared memory, the grid one first, then the tall
/// one. Under a block
/// mask the mma.sync kernels run the separate path, whose dK/dV kernel has the `_sparse`
/// variant (the fused ones have none: the walk cost them registers).
fn without_ws(q: &BwdQuery, facts: &DeviceFacts) -> Result<BwdPlan> {
    let d = head_dim_class(q.d);
    let sparse = q.mods == Mods::Sparse;
    let env = bwd_override();
    let sm90 = Kernel::of(Family::BwdSm90, d, |v| {
        v.mods == if sparse { Mods::Sparse } else { q.mods }
    });
    let wgmma = facts.hopper() && sm90.is_some() && !q.dropout;
    // Plain problems take the kernels compiled without the softcap and ALiBi where they exist
    // (`CANDLE_FLASH_MMA=any`: the others, for A/B runs).
    let plain = q.mods == Mods::None && overrides().mma != "any";
    let fused = |tile: Tile, dropout: bool| {
        let of = |mods: Mods| {
            Kernel::of(Family::BwdFused, d, |v| {
                v.tile == tile && v.dropout == dropout && v.mods == mods
            })
        };
        plain
            .then(|| of(Mods::None))
            .flatten()
            .or_else(|| of(Mods::Scores))
    };
    if q.deterministic || env == Some("separate") || (sparse && !wgmma) {
        return separate(d, sparse, facts.smem);
    }
    // The first that fits of the allowed wider shapes (none with dropout), else 64 keys over
    // 4 warps; head dims without a fused kernel that runs here (d = 256 with dropout or on a
    // 99 KB device, d 160-224) take the deterministic pair. `GridQ1` is the grid layout with
    // Q single-buffered, so that d = 256 fits 163 KB (A100).
    let wide: &[Tile] = match env {
        Some("bn64") => &[],
        Some("bn128") => &[Tile::Wide],
        Some("bn128t") => &[Tile::Tall, Tile::Wide],
        Some("grid") => &[Tile::Grid, Tile::GridQ1],
        _ => &[Tile::Grid, Tile::GridQ1, Tile::Tall, Tile::Wide],
    };
    let fits =
        |tile: Tile| fused(tile, q.dropout).filter(|k| k.geometry().smem as usize <= facts.smem);
    let chosen = wide
        .iter()
        .filter(|_| !q.dropout)
        .find_map(|&t| fits(t).map(|k| (t, k)))
        .or_else(|| fused(Tile::Base, q.dropout).map(|k| (Tile::Base, k)));
    let Some((tile, dkdvq)) = chosen else {
        return separate(d, sparse, facts.smem);
    };
    if wgmma && (env.is_none() || env == Some("sm90") || sparse) {
        if let (Some(dkdvq), Some(convert)) =
            (sm90, Kernel::of(Family::BwdSm90Convert, 0, |_| true))
        {
            return Ok(BwdPlan::Sm90 { dkdvq, convert });
        }
    }
    match Kernel::of(Family::BwdFusedConvert, d, |v| v.tile == tile) {
        Some(convert) => Ok(BwdPlan::Fused { dkdvq, convert }),
        None => bail!("flash-attn backward: no dQ conversion for head dim {d}'s fused kernel"),
    }
}

/// The deterministic pair; at d = 256 on a device where its dK/dV kernel does not fit (99
/// KB), the one with 16-row tiles.
fn separate(d: usize, sparse: bool, smem: usize) -> Result<BwdPlan> {
    let mods = if sparse { Mods::Sparse } else { Mods::Scores };
    let dkdv = |tile| Kernel::of(Family::BwdDkdv, d, |v| v.tile == tile && v.mods == mods);
    let dkdv = match (dkdv(Tile::Base), dkdv(Tile::Small)) {
        (Some(base), Some(small)) if base.geometry().smem as usize > smem => small,
        (Some(base), _) => base,
        _ => bail!("flash-attn backward: no dK/dV kernel for head dim {d}"),
    };
    match Kernel::of(Family::BwdDq, d, |_| true) {
        Some(dq) => Ok(BwdPlan::Separate { dkdv, dq }),
        None => bail!("flash-attn backward: no dQ kernel for head dim {d}"),
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_facts::{A100, ADA, HOPPER};
    use super::*;

    fn query(d: usize, mods: Mods) -> BwdQuery {
        BwdQuery {
            d,
            deterministic: false,
            dropout: false,
            mods,
            cap_alone: false,
            packed: false,
        }
    }

    /// The warp-specialized main kernel's (head dim, mods, deterministic), if chosen.
    fn ws(q: &BwdQuery) -> Option<(u16, Mods, bool)> {
        match plan_bwd(q, &HOPPER).unwrap().0? {
            BwdPlan::Ws { main, .. } => {
                let v = main.variant();
                Some((v.d, v.mods, v.deterministic))
            }
            other => panic!("expected the warp-specialized kernels, got {other:?}"),
        }
    }

    #[test]
    fn hopper_takes_the_warp_specialized_kernels_of_the_class() {
        for (d, class) in [
            (64, 64),
            (96, 96),
            (88, 96),
            (80, 80),
            (72, 80),
            (48, 48),
            (40, 48),
            (32, 32),
            (8, 32),
            (56, 64),
            (128, 128),
            (160, 160),
            (136, 160),
            (176, 192),
            (208, 256),
            (256, 256),
        ] {
            assert_eq!(ws(&query(d, Mods::None)), Some((class, Mods::None, false)));
        }
        // Head dims 65-96 (and up to 48) with score modifiers: d 128's (d 64's) kernels;
        // packed and with dropout the cut ones too.
        assert_eq!(
            ws(&query(96, Mods::Scores)),
            Some((128, Mods::Scores, false))
        );
        assert_eq!(
            ws(&query(32, Mods::Scores)),
            Some((64, Mods::Scores, false))
        );
        let packed = BwdQuery {
            packed: true,
            dropout: true,
            ..query(96, Mods::None)
        };
        assert_eq!(ws(&packed), Some((96, Mods::None, false)));
        // A softcap alone (its scale at most 1) on the `_cap` kernels where compiled.
        let cap = |d| {
            ws(&BwdQuery {
                cap_alone: true,
                ..query(d, Mods::Scores)
            })
        };
        assert_eq!(cap(128), Some((128, Mods::Cap, false)));
        assert_eq!(cap(256), Some((256, Mods::Scores, false)));
        // Deterministic under a block mask: the `_sparse_det` kernels; 65-96 under one keep
        // the mma.sync kernels.
        let det = BwdQuery {
            deterministic: true,
            ..query(128, Mods::Sparse)
        };
        assert_eq!(ws(&det), Some((128, Mods::Sparse, true)));
        assert_eq!(ws(&query(96, Mods::Sparse)), None);
    }

    #[test]
    fn off_hopper_the_mma_kernels_run() {
        let (ws, plan) = plan_bwd(&query(128, Mods::None), &A100).unwrap();
        assert!(ws.is_none());
        assert!(matches!(plan, BwdPlan::Fused { .. }), "{plan:?}");
        // Deterministic, or under a block mask: the separate pair.
        let det = BwdQuery {
            deterministic: true,
            ..query(128, Mods::None)
        };
        let (_, plan) = plan_bwd(&det, &A100).unwrap();
        assert!(matches!(plan, BwdPlan::Separate { .. }), "{plan:?}");
        let (_, plan) = plan_bwd(&query(64, Mods::Sparse), &A100).unwrap();
        assert!(matches!(plan, BwdPlan::Separate { .. }), "{plan:?}");
    }

    fn fused(d: usize, mods: Mods, dropout: bool) -> (Kernel, Kernel) {
        fused_on(d, mods, dropout, &A100)
    }

    fn fused_on(d: usize, mods: Mods, dropout: bool, facts: &DeviceFacts) -> (Kernel, Kernel) {
        let q = BwdQuery {
            d,
            deterministic: false,
            dropout,
            mods,
            cap_alone: false,
            packed: false,
        };
        let (ws, plan) = plan_bwd(&q, facts).unwrap();
        assert!(ws.is_none(), "no warp-specialized kernel off Hopper");
        match plan {
            BwdPlan::Fused { dkdvq, convert } => (dkdvq, convert),
            other => panic!("expected the fused kernels, got {other:?}"),
        }
    }

    #[test]
    fn plain_problems_take_the_plain_fused_kernels() {
        for d in [64, 128] {
            let (plain, convert) = fused(d, Mods::None, false);
            let (mods, convert_mods) = fused(d, Mods::Scores, false);
            // The same tile (and so the same dq_accum conversion), without the modifiers.
            assert_eq!(
                (plain.variant().mods, mods.variant().mods),
                (Mods::None, Mods::Scores)
            );
            assert_eq!(plain.variant().tile, mods.variant().tile);
            assert_eq!(convert, convert_mods);
            assert_eq!(plain.variant().tile, convert.variant().tile);
        }
        // d = 96: the plain kernel on 128 keys over 8 warps (its own dq_accum tiling and
        // conversion), on the padded base tile where that does not fit (99 KB), as the kernel
        // with the modifiers.
        let (plain, convert) = fused(96, Mods::None, false);
        assert_eq!(
            (plain.variant().mods, plain.variant().tile),
            (Mods::None, Tile::Wide)
        );
        assert_eq!(convert.variant().tile, Tile::Wide);
        let (plain, _) = fused_on(96, Mods::None, false, &ADA);
        assert_eq!(
            (plain.variant().mods, plain.variant().tile),
            (Mods::None, Tile::Base)
        );
        assert_eq!(fused(96, Mods::Scores, false).0.variant().tile, Tile::Base);
        // Dropout and head dims without a plain kernel keep the kernel with the modifiers.
        assert_eq!(fused(128, Mods::None, true).0.variant().mods, Mods::Scores);
        assert_eq!(fused(32, Mods::None, false).0.variant().mods, Mods::Scores);
    }

    #[test]
    fn the_fused_tile_follows_the_head_dim_and_the_shared_memory() {
        let tile = |d, dropout, facts| fused_on(d, Mods::None, dropout, facts).0.variant().tile;
        // 163 KB (A100): FlashAttention-2's warp layout at d = 128, the tall shape at d = 64.
        assert_eq!(tile(128, false, &A100), Tile::Grid);
        assert_eq!(tile(64, false, &A100), Tile::Tall);
        // 99 KB (sm_86/89): the 128-key shape with 64-row tiles at d = 64 (93 KB); at d = 128
        // its 32-row tiles need 102 KB, so 64 keys over 4 warps.
        assert_eq!(tile(64, false, &ADA), Tile::Wide);
        assert_eq!(tile(128, false, &ADA), Tile::Base);
        // Dropout: 64 keys over 4 warps.
        assert_eq!(tile(128, true, &A100), Tile::Base);
        // d = 96: 128 keys over 8 warps where 123 KB is allowed, padded 64-key tiles with
        // dropout or on 99 KB.
        assert_eq!(tile(96, false, &A100), Tile::Wide);
        assert_eq!(
            tile(96, false, &DeviceFacts { major: 8, ..HOPPER }),
            Tile::Wide
        );
        assert_eq!(tile(96, true, &A100), Tile::Base);
        assert_eq!(tile(96, false, &ADA), Tile::Base);
        // d = 256: the grid layout where 184 KB is allowed (Hopper's sm_80 path), Q
        // single-buffered within 163 KB; on 99 KB devices and with dropout the deterministic
        // pair.
        let hopper_sm80 = DeviceFacts { major: 8, ..HOPPER };
        assert_eq!(tile(256, false, &hopper_sm80), Tile::Grid);
        assert_eq!(tile(256, false, &A100), Tile::GridQ1);
        for (dropout, facts) in [(false, &ADA), (true, &A100)] {
            let q = BwdQuery {
                dropout,
                ..query(256, Mods::None)
            };
            let (_, plan) = plan_bwd(&q, facts).unwrap();
            assert!(matches!(plan, BwdPlan::Separate { .. }), "{plan:?}");
        }
    }
}
