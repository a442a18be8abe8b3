//! The forward's kernel choice: the warp-specialized kernel where one is compiled for the
//! problem (and TMA can address its tensors, which the launcher learns when it encodes the
//! tensor maps), else the first wgmma kernel on Hopper, else the mma.sync kernel.

use candle::{bail, Result};

use super::super::catalogue::{Family, Kernel, Mods, Tile, Variant};
use super::super::overrides::overrides;
use super::super::runtime::DeviceFacts;
use super::{head_dim_class, ws_cut_dims, ws_floor, ws_head_dim, ws_variant_allowed};

/// What the forward's choice depends on.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FwdQuery {
    /// The problem's head dim.
    pub d: usize,
    /// Query and key rows (packed batches: the longest sequence's).
    pub sq: usize,
    pub sk: usize,
    pub causal: bool,
    pub mods: Mods,
    pub packed: bool,
    pub dropout: bool,
    /// Work tiles' (sequence, head) pairs: batch x heads.
    pub pairs: usize,
}

/// The kernels a forward may run, in order of preference.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FwdPlan {
    /// The warp-specialized kernel, where TMA can address the tensors.
    pub ws: Option<Kernel>,
    /// Otherwise.
    pub fallback: Kernel,
}

/// The forward's kernels for `q` on a device with `facts`.
pub(crate) fn plan_fwd(q: &FwdQuery, facts: &DeviceFacts) -> Result<FwdPlan> {
    let forced = overrides().fwd.as_str();
    let hopper = facts.hopper();
    let ws = if hopper && !matches!(forced, "mma" | "sm90") {
        // Its tile index is a 32-bit int.
        ws_kernel(q)
            .filter(|k| q.sq.div_ceil(k.geometry().bm as usize) * q.pairs <= i32::MAX as usize)
    } else {
        None
    };
    let d = head_dim_class(q.d);
    let sm90 = if !q.dropout && hopper && forced != "mma" {
        sm90_kernel(d, q)
    } else {
        None
    };
    let fallback = match sm90 {
        Some(k) => k,
        None => mma_kernel(d, q, facts.smem)?,
    };
    Ok(FwdPlan { ws, fallback })
}

/// The mma.sync kernel of head dim class `d`: its own tile, or where that needs more than
/// `smem` bytes of shared memory (d >= 192 on a 99 KB device) the small one. Problems without
/// a score modifier or block mask take a plain kernel where one is compiled, and its wider
/// key tile where one is (`FwdWideConfig`): at d = 96 and 128 64 keys, +2-25% with and
/// without a causal mask; at d = 64 96 keys, +4-6% non-causal but slower causal, where tiles
/// that do not divide the query tile mask more keys, so causal problems keep 64 there. For
/// A/B runs `CANDLE_FLASH_MMA=any` sends them to the kernel with every modifier, `base` keeps
/// them off the wider tile, `wide` puts causal problems at d = 64 on it too.
fn mma_kernel(d: usize, q: &FwdQuery, smem: usize) -> Result<Kernel> {
    mma_kernel_with(d, q, smem, overrides().mma.as_str())
}

/// [`mma_kernel`] under the switch's value `forced`.
fn mma_kernel_with(d: usize, q: &FwdQuery, smem: usize, forced: &str) -> Result<Kernel> {
    if q.mods == Mods::None && !q.dropout && forced != "any" {
        let plain = |tile| {
            Kernel::of(Family::Fwd, d, |v| {
                v.mods == Mods::None && v.tile == tile && !v.dropout
            })
            .filter(|k| k.geometry().smem as usize <= smem)
        };
        // Under a causal mask a key tile that does not divide the query tile (d = 64's 96
        // keys against 128 rows) spreads the diagonal over more tiles that need the mask.
        let diagonal_whole = |k: &Kernel| {
            let g = k.geometry();
            !q.causal || g.bm.is_multiple_of(g.bn) || forced == "wide"
        };
        let wide = (forced != "base")
            .then(|| plain(Tile::Wide))
            .flatten()
            .filter(diagonal_whole);
        if let Some(k) = wide.or_else(|| plain(Tile::Base)) {
            return Ok(k);
        }
    }
    let of = |tile| {
        Kernel::of(Family::Fwd, d, |v| {
            v.tile == tile && v.dropout == q.dropout && v.mods == Mods::Any
        })
    };
    let Some(base) = of(Tile::Base) else {
        bail!("flash-attn: no forward kernel for head dim {d}")
    };
    Ok(match of(Tile::Small) {
        Some(small) if base.geometry().smem as usize > smem => small,
        _ => base,
    })
}

/// The wgmma kernel's block shape (`sm90/fwd.cu`) for head dims 64 and 128. Measured on the
/// H200 (bf16, docs/archive/PERF.md, same-run A/B):
/// - one warpgroup (`_g1_n<keys per tile>`; three blocks per SM at d = 64, four with
///   64-key tiles, three at d = 128 with 48-key tiles) wherever blocks have few key tiles
///   or unequal work, since co-resident blocks hide each other's first loads, softmax and
///   epilogue: at d = 64 every causal length (211 against 141 TFLOP/s at 1k, 333 against
///   307 at 8k; with 64-key tiles up to 2k: 241-244 at 1k, 282-285 against 266-269 at 2k)
///   and non-causal below 4k (323 against 272 at 1k), at d = 128 causal up to 2k (243-246
///   against 213-216 at 1k with two warpgroups, 235 with one and 64-key tiles at two
///   blocks per SM);
/// - three warpgroups (`_g3`, 192 rows sharing each K/V tile) at d = 64 non-causal from 4k
///   (364 against 339 at 8k);
/// - two otherwise (d = 128: 325 against 303 at 1k non-causal, 320 against 308 at 4k
///   causal).
///
/// With a softcap, ALiBi or a block mask: the two-warpgroup shape, the one compiled with them.
/// `CANDLE_FLASH_SM90_SHAPE=g1|g1n64|g2|g3` forces one (A/B runs; g1 is the 48-key kernel at
/// d = 128, g1n64 and g3 exist only at d = 64).
fn sm90_kernel(d: usize, q: &FwdQuery) -> Option<Kernel> {
    let (groups, bn) = if q.mods != Mods::None {
        (2, 128)
    } else {
        match (overrides().sm90_shape.as_str(), d) {
            ("g1n64", 64) => (1, 64),
            ("g1", 128) => (1, 48),
            ("g1", _) => (1, 128),
            ("g2", _) => (2, 128),
            ("g3", 64) => (3, 128),
            (_, 64) if q.causal && q.sq <= 2048 => (1, 64),
            (_, 64) if q.causal || q.sq < 4096 => (1, 128),
            (_, 64) => (3, 128),
            _ if q.causal && q.sq <= 2048 => (1, 48),
            _ => (2, 128),
        }
    };
    Kernel::of(Family::FwdSm90, d, |v| {
        v.groups == groups && usize::from(v.bn) == bn && v.mods == q.mods
    })
}

/// The warp-specialized kernel for the problem, if one is compiled. Measured on the H100
/// (bf16, same-run A/B of every compiled shape; docs/archive/PERF.md, "the warp-specialized
/// Hopper forward"): d = 64 on three consumer warpgroups (192 x 128: +10-25% over 128 x 128
/// from seqlen 512 to 16k without a mask, +0-15% causal from 2k; causal up to 512 128 x 128,
/// with its work tiles in one stream, is 2% faster: "The three-warpgroup forward's partial
/// tile, first and light under a causal mask"), d = 128 with 176-key tiles without a mask
/// from 8k keys (+8% at 16k; 128 x 128 was as fast or faster up to 4k) and 128 with one,
/// d = 256 with 80-key tiles (+0-5%; causal up to 1k 64-key tiles, 2-8% faster on the H200,
/// where its warpgroups pass over the tiles masked for them: "d 256 causal up to 1k on 64-key
/// tiles", "Key tiles masked for a whole warpgroup").
/// `CANDLE_FLASH_WS_SHAPE=base|g3|n192|n176|n112|n80` forces one of the compiled shapes where it
/// exists (A/B runs). Before the tiles' own kernels, the cut ones of `ws_cut_dims` (in the
/// shape chosen for the tiles' head dim; `CANDLE_FLASH_WS_SHAPE=d64|d128|d192` keeps them off,
/// `d256` also the 192-column tiles of head dims 129-192).
///
/// With a softcap or ALiBi, or a block mask, and with dropout: the one kernel per head dim
/// compiled with it (the catalogue's row). Packed batches: the same choice among the
/// `_packed` kernels, base where the chosen shape has none.
fn ws_kernel(q: &FwdQuery) -> Option<Kernel> {
    let wide = ws_head_dim(q.d)?;
    if !ws_variant_allowed(q.mods, q.packed, q.dropout) {
        return None;
    }
    let forced = overrides().ws_shape.as_str();
    // d = 64 causal below 512 rows: the one-warpgroup kernel of sm90/fwd.cu, four blocks
    // per SM (at 512 it ran 190 against 165 TFLOP/s until the 128 x 128 shape ran its work
    // tiles as one stream: 0.158 against 0.171 ms since; docs/archive/PERF.md, "the
    // forward's work tiles as one stream of key tiles"; shorter not measured).
    let plain = !q.dropout && q.mods == Mods::None;
    if plain && forced.is_empty() && wide == 64 && q.causal && q.sq < 512 {
        return None;
    }
    // Head dims 129-192 on the forward's 192-column tiles where a kernel is compiled for the
    // problem (plain ones), else on d 256's. On each width the cut kernels first (in the
    // tiles' shape), then the tiles' own.
    let narrow = usize::from(Variant::ws_tiles(Family::FwdWs, head_dim_class(q.d) as u16));
    let narrow = Some(narrow).filter(|&t| t != wide && t >= ws_floor());
    narrow.into_iter().chain([wide]).find_map(|t| {
        ws_cut_dims(Family::FwdWs, q.d, t)
            .find_map(|kd| ws_shape_kernel(kd, t, q))
            .or_else(|| ws_shape_kernel(t, t, q))
    })
}

/// The kernel of head dim `kd` on the tiles of head dim `d` in the shape chosen for `q`.
fn ws_shape_kernel(kd: usize, d: usize, q: &FwdQuery) -> Option<Kernel> {
    let features = |v: &crate::cuda::catalogue::Variant| {
        v.mods == q.mods && v.packed == q.packed && v.dropout == q.dropout && !v.fp8
    };
    if q.dropout || q.mods != Mods::None {
        return Kernel::of(Family::FwdWs, kd, features);
    }
    let forced = overrides().ws_shape.as_str();
    // A shape by its name in the kernels' names: `base` (two warpgroups, the head dim's fewest
    // keys per tile), `g3` (three warpgroups), `n<keys>` (two warpgroups, that many keys);
    // (warpgroups, keys per tile or any).
    let shape = |name: &str| -> Option<(u8, Option<usize>)> {
        match name {
            "base" => Kernel::ALL
                .iter()
                .map(|k| k.variant())
                .filter(|v| {
                    v.family == Family::FwdWs && usize::from(v.d) == kd && v.groups == 2 && !v.fp8
                })
                .map(|v| (2, Some(usize::from(v.bn))))
                .min(),
            "g3" => Some((3, None)),
            _ => name.strip_prefix('n')?.parse().ok().map(|bn| (2, Some(bn))),
        }
    };
    let chosen = match d {
        // Causal up to 512: 128 x 128, whose kernel runs its work tiles as one stream of key
        // tiles (fwd_ws.cu: CARRY; 512 0.1425 against 0.1450 ms for 192 x 128, H100); above,
        // the three warpgroups, whose partial tile (1024 rows: 64) is the first and lightest
        // under the mask (END_ALIGNED): 1k 0.217 against 0.2285 ms, 6 of 6 rounds
        // (docs/archive/PERF.md, "The three-warpgroup forward's partial tile, first and light
        // under a causal mask").
        64 if q.causal && q.sq <= 512 => "base",
        64 => "g3",
        128 if !q.causal && q.sk >= 8192 => "n176",
        // Causal up to 1k: 64-key tiles, which never straddle a 64-row diagonal, so that the
        // upper warpgroup passes over the tile its rows cannot see (fwd_ws.cu: SKIP, which the
        // 80-key kernel spilled with). 1k 0.164 against 0.170 ms, 2k 0.296 against 0.286
        // (H100; docs/archive/PERF.md, "Key tiles masked for a whole warpgroup").
        // 192 columns: the same rule as 256's (not measured apart); 112 keys where 256's take 80.
        192 | 256 if q.causal && q.sq <= 1024 => "base",
        192 => "n112",
        256 => "n80",
        _ => "base",
    };
    let find = |(groups, bn): (u8, Option<usize>)| {
        Kernel::of(Family::FwdWs, kd, |v| {
            features(v) && v.groups == groups && bn.is_none_or(|bn| usize::from(v.bn) == bn)
        })
    };
    let forced_kernel = if q.packed {
        None
    } else {
        shape(forced).and_then(find)
    };
    forced_kernel
        .or_else(|| shape(chosen).and_then(find))
        .or_else(|| shape("base").and_then(find))
}

#[cfg(test)]
mod tests {
    use super::super::test_facts::{A100, ADA, HOPPER};
    use super::*;

    fn query(d: usize, sq: usize, causal: bool) -> FwdQuery {
        FwdQuery {
            d,
            sq,
            sk: sq,
            causal,
            mods: Mods::None,
            packed: false,
            dropout: false,
            pairs: 16,
        }
    }

    /// The warp-specialized kernel's (head dim, consumer warpgroups, keys per tile, mods,
    /// packed, dropout), if one is chosen.
    fn ws(q: &FwdQuery) -> Option<(u16, u8, u16, Mods, bool, bool)> {
        let v = plan_fwd(q, &HOPPER).unwrap().ws?.variant();
        Some((v.d, v.groups, v.bn, v.mods, v.packed, v.dropout))
    }

    #[test]
    fn hopper_shapes_follow_the_measured_rules() {
        // (head dim, rows = keys, causal) -> (kernel head dim, warpgroups, keys per tile):
        // - d 64: three warpgroups, but causal up to 512 rows 128 x 128, and below 512 the
        //   one-warpgroup wgmma kernel instead (no warp-specialized kernel);
        // - d 128: 176-key tiles without a mask from 8k keys;
        // - d 256: 80-key tiles, but 64 causal up to 1k;
        // - the classes between: up to 48 on d 64's tiles and shapes, products cut to 32
        //   columns up to d 32, else 48 (causal below 512 rows the one-warpgroup kernel too);
        //   65-96 on d 128's, cut to 80 columns up to d 80, else 96; 129-192 on 192-column
        //   tiles (112 keys; causal up to 1k 64), cut to 160 columns up to d 160; 193-224 on
        //   d 256's.
        for (d, sq, causal, want) in [
            (64, 4096, false, Some((64, 3, 128))),
            (64, 512, true, Some((64, 2, 128))),
            (64, 1024, true, Some((64, 3, 128))),
            (64, 256, true, None),
            (128, 4096, false, Some((128, 2, 128))),
            (128, 8192, false, Some((128, 2, 176))),
            (128, 8192, true, Some((128, 2, 128))),
            (256, 1024, true, Some((256, 2, 64))),
            (256, 2048, true, Some((256, 2, 80))),
            (256, 512, false, Some((256, 2, 80))),
            (96, 4096, false, Some((96, 2, 128))),
            (88, 512, true, Some((96, 2, 128))),
            (80, 512, true, Some((80, 2, 128))),
            (72, 4096, false, Some((80, 2, 128))),
            (40, 4096, false, Some((48, 3, 128))),
            (48, 512, true, Some((48, 2, 128))),
            (40, 256, true, None),
            (32, 1024, true, Some((32, 3, 128))),
            (16, 512, true, Some((32, 2, 128))),
            (56, 4096, false, Some((64, 3, 128))),
            (160, 4096, false, Some((160, 2, 112))),
            (136, 1024, true, Some((160, 2, 64))),
            (176, 4096, true, Some((192, 2, 112))),
            (208, 4096, false, Some((256, 2, 80))),
        ] {
            let want = want.map(|(kd, groups, bn)| (kd, groups, bn, Mods::None, false, false));
            assert_eq!(
                ws(&query(d, sq, causal)),
                want,
                "d {d}, {sq} rows, causal {causal}"
            );
        }
    }

    #[test]
    fn head_dim_96_keeps_the_d_128_kernels_only_with_modifiers() {
        // (mods, packed, dropout) -> the kernel's head dim
        for (mods, packed, dropout, want) in [
            (Mods::Scores, false, false, 128),
            (Mods::Sparse, false, false, 128),
            (Mods::None, true, false, 96),
            (Mods::None, false, true, 96),
            (Mods::None, true, true, 96),
        ] {
            let q = FwdQuery {
                mods,
                packed,
                dropout,
                ..query(96, 4096, false)
            };
            assert_eq!(
                ws(&q).map(|w| w.0),
                Some(want),
                "{mods:?} {packed} {dropout}"
            );
        }
    }

    #[test]
    fn head_dims_129_to_192_take_the_192_column_tiles_when_plain() {
        // (head dim, mods, packed, dropout) at 8k keys -> (kernel head dim, keys per tile):
        // plain problems on the 192-column tiles (cut to 160 up to d 160), the others on d
        // 256's kernels with their feature.
        for (d, mods, packed, dropout, want) in [
            (136, Mods::None, false, false, (160, 112)),
            (192, Mods::None, false, false, (192, 112)),
            (160, Mods::None, true, false, (256, 80)),
            (176, Mods::None, false, true, (256, 80)),
            (160, Mods::Scores, false, false, (256, 80)),
            (192, Mods::Sparse, false, false, (256, 64)),
        ] {
            let q = FwdQuery {
                mods,
                packed,
                dropout,
                ..query(d, 8192, false)
            };
            let (kd, bn) = want;
            assert_eq!(
                ws(&q),
                Some((kd, 2, bn, mods, packed, dropout)),
                "d {d}, {mods:?}, packed {packed}, dropout {dropout}"
            );
        }
    }

    #[test]
    fn hopper_features_take_their_own_kernels() {
        // (head dim, mods, packed, dropout) at 8k keys -> (keys per tile), two warpgroups:
        // modifiers take the one kernel per head dim compiled with them; packed batches the
        // chosen shape's `_packed` kernel, else the base one; none is compiled with modifiers
        // and packed batches or dropout together.
        for (d, mods, packed, dropout, want) in [
            (128, Mods::Scores, false, false, Some(128)),
            (256, Mods::Sparse, false, false, Some(64)),
            (256, Mods::None, true, false, Some(80)),
            (128, Mods::None, true, false, Some(128)),
            (128, Mods::None, false, true, Some(128)),
            (128, Mods::Scores, true, false, None),
            (128, Mods::Scores, false, true, None),
        ] {
            let q = FwdQuery {
                mods,
                packed,
                dropout,
                ..query(d, 8192, false)
            };
            let want = want.map(|bn| (d as u16, 2, bn, mods, packed, dropout));
            assert_eq!(
                ws(&q),
                want,
                "d {d}, {mods:?}, packed {packed}, dropout {dropout}"
            );
        }
    }

    #[test]
    fn hopper_falls_back_to_the_wgmma_kernel_without_dropout() {
        let fallback = |q: &FwdQuery| plan_fwd(q, &HOPPER).unwrap().fallback.variant();
        let v = fallback(&query(128, 1024, true));
        assert_eq!((v.family, v.groups, v.bn), (Family::FwdSm90, 1, 48));
        let v = fallback(&FwdQuery {
            mods: Mods::Scores,
            ..query(64, 4096, false)
        });
        assert_eq!(
            (v.family, v.groups, v.mods),
            (Family::FwdSm90, 2, Mods::Scores)
        );
        // Dropout: the mma.sync kernel.
        let v = fallback(&FwdQuery {
            dropout: true,
            ..query(128, 4096, false)
        });
        assert_eq!((v.family, v.dropout), (Family::Fwd, true));
    }

    fn mma(d: usize, mods: Mods, dropout: bool, facts: &DeviceFacts) -> Kernel {
        let q = FwdQuery {
            d,
            sq: 4096,
            sk: 4096,
            causal: false,
            mods,
            packed: false,
            dropout,
            pairs: 16,
        };
        let plan = plan_fwd(&q, facts).unwrap();
        assert!(plan.ws.is_none(), "no warp-specialized kernel off Hopper");
        plan.fallback
    }

    #[test]
    fn plain_problems_take_the_plain_mma_kernels_where_compiled() {
        for d in [64, 96, 128, 256] {
            let v = mma(d, Mods::None, false, &A100).variant();
            assert_eq!((v.d as usize, v.mods, v.dropout), (d, Mods::None, false));
        }
        // Head dims without one, and problems with a modifier or dropout: the kernel with
        // every modifier.
        let any = |d, mods, dropout| {
            let v = mma(d, mods, dropout, &A100).variant();
            (v.d, v.mods, v.dropout)
        };
        assert_eq!(any(160, Mods::None, false), (160, Mods::Any, false));
        assert_eq!(any(128, Mods::Scores, false), (128, Mods::Any, false));
        assert_eq!(any(128, Mods::Sparse, false), (128, Mods::Any, false));
        assert_eq!(any(128, Mods::None, true), (128, Mods::Any, true));
    }

    #[test]
    fn plain_problems_take_the_wider_key_tile_where_compiled() {
        let pick = |d, causal, forced| {
            let k = mma_kernel_with(d, &query(d, 4096, causal), A100.smem, forced).unwrap();
            (k.variant().tile, k.variant().mods, k.geometry().bn)
        };
        assert_eq!(pick(64, false, ""), (Tile::Wide, Mods::None, 96));
        assert_eq!(pick(64, true, ""), (Tile::Base, Mods::None, 64));
        assert_eq!(pick(64, false, "base"), (Tile::Base, Mods::None, 64));
        assert_eq!(pick(64, false, "any"), (Tile::Base, Mods::Any, 64));
        assert_eq!(pick(128, false, ""), (Tile::Wide, Mods::None, 64));
        assert_eq!(pick(128, true, ""), (Tile::Wide, Mods::None, 64));
        // `base` at d = 128: no plain kernel on 32 keys is compiled, the one with every modifier.
        assert_eq!(pick(128, true, "base"), (Tile::Base, Mods::Any, 32));
        assert_eq!(pick(96, false, ""), (Tile::Wide, Mods::None, 64));
        assert_eq!(pick(96, true, ""), (Tile::Wide, Mods::None, 64));
        assert_eq!(pick(64, true, "wide"), (Tile::Wide, Mods::None, 96));
        // None at d = 256.
        assert_eq!(pick(256, false, ""), (Tile::Base, Mods::None, 64));
        // A modifier or dropout: the kernel with every modifier.
        let q = FwdQuery {
            mods: Mods::Scores,
            ..query(64, 4096, false)
        };
        let k = mma_kernel_with(64, &q, A100.smem, "").unwrap();
        assert_eq!(
            (k.variant().tile, k.variant().mods),
            (Tile::Base, Mods::Any)
        );
    }

    #[test]
    fn small_devices_take_the_small_tile_above_their_shared_memory() {
        let v = mma(256, Mods::None, false, &ADA).variant();
        assert_eq!((v.tile, v.mods), (Tile::Small, Mods::Any));
        let v = mma(256, Mods::None, false, &A100).variant();
        assert_eq!((v.tile, v.mods), (Tile::Base, Mods::None));
        assert_eq!(
            mma(256, Mods::Scores, false, &A100).variant().tile,
            Tile::Base
        );
        // The plain kernels fit both.
        assert_eq!(mma(128, Mods::None, false, &ADA).variant().mods, Mods::None);
    }

    #[test]
    fn the_switch_picks_the_kernel_with_every_modifier() {
        let q = |d| FwdQuery {
            d,
            sq: 4096,
            sk: 4096,
            causal: true,
            mods: Mods::None,
            packed: false,
            dropout: false,
            pairs: 16,
        };
        let pick = |d, forced| {
            let k = mma_kernel_with(d, &q(d), A100.smem, forced).unwrap();
            (k.variant().mods, k.geometry().bn)
        };
        assert_eq!(pick(64, ""), (Mods::None, 64));
        assert_eq!(pick(64, "any"), (Mods::Any, 64));
        assert_eq!(pick(64, "base"), (Mods::None, 64));
        assert_eq!(pick(128, ""), (Mods::None, 64));
        assert_eq!(pick(128, "any"), (Mods::Any, 32));
        assert_eq!(pick(96, ""), (Mods::None, 64));
        // No plain kernel at d = 160: the one with every modifier.
        assert_eq!(pick(160, ""), (Mods::Any, 64));
    }
}
