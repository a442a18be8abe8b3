//! The kernel catalogue: every attention kernel the crate compiles, one row each. It is the
//! single source of truth for what exists. From it build.rs generates
//! - the kernels' instantiations (`OUT_DIR/instances/<file>.inc`, included at the end of each
//!   `.cu` file): entry point name, launch bounds and template arguments;
//! - the host's table (`src/cuda/catalogue.rs` includes it): one [`Kernel`]-indexed entry per
//!   row with its names per dtype and its geometry (threads, shared memory, tile rows and
//!   keys, ring slots) read back from the device code's own constants by a PTX probe, so the
//!   host never restates them.
//!
//! The planners (`src/cuda/plan/`) choose a kernel by its fields (`Kernel::find`); adding a
//! variant is one row here (plus, for a new field value, the rule that picks it).
//!
//! This file is plain data included by build.rs and by the crate: no dependencies.

/// The source file a kernel is compiled from (under `cuda/`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum File {
    /// `sm80/fwd.cu`: the mma.sync forward (every architecture).
    Sm80Fwd,
    /// `sm80/bwd.cu`: the mma.sync backward and its helper kernels.
    Sm80Bwd,
    /// `sm90/fwd.cu`: the wgmma forward (Hopper).
    Sm90Fwd,
    /// `sm90/bwd.cu`: the wgmma backward (Hopper).
    Sm90Bwd,
    /// `sm90/fwd_ws.cu`: the warp-specialized forward (Hopper, TMA).
    Sm90FwdWs,
    /// `sm90/bwd_ws.cu`: the warp-specialized backward (Hopper, TMA).
    Sm90BwdWs,
    /// `decode/decode.cu`: KV-cache decoding and appending.
    Decode,
}

impl File {
    pub const ALL: [File; 7] = [
        File::Sm80Fwd,
        File::Sm80Bwd,
        File::Sm90Fwd,
        File::Sm90Bwd,
        File::Sm90FwdWs,
        File::Sm90BwdWs,
        File::Decode,
    ];

    /// The path under `cuda/`.
    pub const fn path(self) -> &'static str {
        match self {
            File::Sm80Fwd => "sm80/fwd.cu",
            File::Sm80Bwd => "sm80/bwd.cu",
            File::Sm90Fwd => "sm90/fwd.cu",
            File::Sm90Bwd => "sm90/bwd.cu",
            File::Sm90FwdWs => "sm90/fwd_ws.cu",
            File::Sm90BwdWs => "sm90/bwd_ws.cu",
            File::Decode => "decode/decode.cu",
        }
    }
}

/// What a kernel computes: its entry template, its parameter block and its file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// Forward, mma.sync (`flash_fwd_<dtype>_d<D>[_s64][_sparse][_dropout]`).
    Fwd,
    /// Forward, wgmma (`flash_fwd_sm90_<dtype>_d<D>[_g1_n<BN>|_g3][_mods|_sparse]`).
    FwdSm90,
    /// Forward, warp-specialized (`flash_fwd_ws_<dtype>_d<D>[_g3|_n<BN>][features]`).
    FwdWs,
    /// Backward: D = rowsum(dO * O) (`flash_bwd_dsum_<dtype>`).
    BwdDsum,
    /// Backward: dK, dV per key block, deterministic (`flash_bwd_dkdv_<dtype>_d<D>[_s16][_sparse]`).
    BwdDkdv,
    /// Backward: dQ per query block, deterministic (`flash_bwd_dq_<dtype>_d<D>`).
    BwdDq,
    /// Backward: dK, dV and atomic dQ in one kernel, mma.sync
    /// (`flash_bwd_dkdvq_<dtype>_d<D>[_bn128|_bn128t][_dropout]`).
    BwdFused,
    /// Backward: the fused kernel's tiled dq_accum to dQ (`flash_bwd_dq_convert_<dtype>_d<D>[...]`).
    BwdFusedConvert,
    /// Backward: dK, dV and atomic dQ, wgmma (`flash_bwd_sm90_<dtype>_d<D>[_mods|_sparse]`).
    BwdSm90,
    /// Backward: the wgmma kernel's flat dq_accum to dQ (`flash_bwd_dq_convert_<dtype>`).
    BwdSm90Convert,
    /// Backward, warp-specialized (`flash_bwd_ws_<dtype>_d<D>[features]`).
    BwdWs,
    /// Its row statistics and dq_accum tile states (`flash_bwd_ws_prep_<dtype>_d<D>`).
    BwdWsPrep,
    /// Its dq_accum to dQ (`flash_bwd_ws_convert_<dtype>_d<D>`).
    BwdWsConvert,
    /// Appending rows to a KV cache (`flash_append_<dtype>[_fp8]`).
    Append,
    /// Decoding against a KV cache (`flash_decode_<dtype>_d<D>[_w<W>][_fp8]`).
    Decode,
}

impl Family {
    pub const fn file(self) -> File {
        match self {
            Family::Fwd => File::Sm80Fwd,
            Family::FwdSm90 => File::Sm90Fwd,
            Family::FwdWs => File::Sm90FwdWs,
            Family::BwdDsum
            | Family::BwdDkdv
            | Family::BwdDq
            | Family::BwdFused
            | Family::BwdFusedConvert
            | Family::BwdSm90Convert => File::Sm80Bwd,
            Family::BwdSm90 => File::Sm90Bwd,
            Family::BwdWs | Family::BwdWsPrep | Family::BwdWsConvert => File::Sm90BwdWs,
            Family::Append | Family::Decode => File::Decode,
        }
    }
}

/// The score modifiers a kernel is compiled with (`MODS_*` in cuda/common/mask/levels.cuh): each
/// level costs the kernels without it registers, so it is a variant of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mods {
    /// None: no softcap, ALiBi or block mask.
    None,
    /// The softcap alone (`_cap`).
    Cap,
    /// Softcap and ALiBi (`_mods`).
    Scores,
    /// Softcap, ALiBi and the block mask (`_sparse`).
    Sparse,
    /// Every modifier, the block mask tested at run time so that plain problems run too
    /// (`MODS_ANY`; the mma.sync forward and dQ kernels, named `_sparse`).
    Any,
}

/// A named tile shape of a family whose shapes live in the device code's config structs
/// (`FwdConfig`, `BwdConfig`, `BwdFusedConfig`): the geometry comes back from the probe.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tile {
    /// The family's shape for the head dim.
    Base,
    /// The small-shared-memory shape for 99 KB devices (forward `_s64`, dK/dV `_s16`).
    Small,
    /// Wider key tiles: the fused backward with 128 keys over 8 warps (`_bn128`); the plain
    /// forward (`_wide`, `FwdWideConfig`) at d = 64 with 96 for non-causal problems, at d = 96
    /// and 128 with 64.
    Wide,
    /// `Wide` with twice the streamed query rows (`_bn128t`).
    Tall,
    /// The fused backward on FlashAttention-2's warp layout over 8 warps (`_grid`,
    /// sm80/bwd_grid.cuh; d = 128: 128 keys, d = 256: 64).
    Grid,
    /// `Grid` with Q single-buffered, for 163 KB devices (`_grid_q1`; d = 256).
    GridQ1,
}

/// A kernel's `__launch_bounds__`: what ptxas may assume of its launches, which decides its
/// register budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Bounds {
    /// The traits' `THREADS`, and at least this many blocks per SM (0: not given).
    Traits(u8),
    /// The traits' `THREADS` and `MIN_BLOCKS`.
    TraitsMin,
    /// A block size the launcher chooses, fixed for ptxas.
    Threads(u16),
    /// None: the launcher chooses the block size.
    Free,
}

/// One compiled kernel (both dtypes: f16 and bf16).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Variant {
    pub family: Family,
    /// Head dim compiled for (0: any, the kernel reads it from its parameters).
    pub d: u16,
    pub tile: Tile,
    /// Keys per tile where the row chooses it (forward wgmma and warp-specialized); else 0, the traits' own (the geometry's `bn` has it
    /// either way).
    pub bn: u16,
    /// Ring slots where the row chooses them: K/V (warp-specialized forward), Q/dO
    /// (warp-specialized backward); else 0.
    pub stages: u8,
    /// Consumer warpgroups (forward wgmma and warp-specialized), warps (decode); else 0.
    pub groups: u8,
    pub bounds: Bounds,
    pub mods: Mods,
    /// Packed (variable-length) batches addressed as one tensor (`_packed`).
    pub packed: bool,
    pub dropout: bool,
    /// Adds dQ in a fixed order (`_det`).
    pub deterministic: bool,
    /// E4M3 operands (`_fp8`): the KV cache (appending quantizes, decoding dequantizes), or
    /// the warp-specialized forward's q, k and v (its output in the dtype of the name).
    pub fp8: bool,
    /// The FP8 forward with V given transposed (`_vt`: `FlashAttn::fp8_v_transposed`, a
    /// `(batch, heads_k, head_dim, keys)` tensor): its tiles are copied as they are, where the
    /// others transpose V in shared memory.
    pub vt: bool,
}

const fn row(family: Family, d: u16) -> Variant {
    Variant {
        family,
        d,
        tile: Tile::Base,
        bn: 0,
        stages: 0,
        groups: 0,
        bounds: Bounds::Traits(1),
        mods: Mods::None,
        packed: false,
        dropout: false,
        deterministic: false,
        fp8: false,
        vt: false,
    }
}

impl Variant {
    /// The head dim of the kernel's tiles and buffers: the warp-specialized kernels' tiles
    /// are 64, 128 or 256 columns wide (the forward's also 192), and a row between them (a
    /// cut row: 32 and 48 on d 64's, 80 and 96 on d 128's, the forward's 160 on d 192's, the
    /// backward's 160 and 192 on d 256's) runs the next width up with its products cut to its
    /// own head dim (`DA` in the traits). The backward's d 256 tiles split their columns
    /// between two warpgroups, 128 each; 192 would split them unevenly.
    pub const fn tiles_d(&self) -> u16 {
        Self::ws_tiles(self.family, self.d)
    }
    /// `tiles_d` of a `family` row of head dim `d`.
    pub const fn ws_tiles(family: Family, d: u16) -> u16 {
        match (family, d) {
            (Family::FwdWs | Family::BwdWs, 0..=64) => 64,
            (Family::FwdWs | Family::BwdWs, 65..=128) => 128,
            (Family::FwdWs, 129..=192) => 192,
            (Family::FwdWs | Family::BwdWs, _) => 256,
            _ => d,
        }
    }
    const fn tile(mut self, tile: Tile) -> Self {
        self.tile = tile;
        self
    }
    const fn mods(mut self, mods: Mods) -> Self {
        self.mods = mods;
        self
    }
    const fn packed(mut self) -> Self {
        self.packed = true;
        self
    }
    const fn dropout(mut self) -> Self {
        self.dropout = true;
        self
    }
    const fn deterministic(mut self) -> Self {
        self.deterministic = true;
        self
    }
    const fn fp8(mut self) -> Self {
        self.fp8 = true;
        self
    }
    const fn vt(mut self) -> Self {
        self.vt = true;
        self
    }
    const fn bounds(mut self, bounds: Bounds) -> Self {
        self.bounds = bounds;
        self
    }
}

/// Forward, mma.sync: every head dim class, with and without dropout, compiled with every
/// score modifier and a run-time block mask.
const fn fwd(d: u16) -> Variant {
    row(Family::Fwd, d).mods(Any)
}
/// The mma.sync forward without score modifiers or block mask.
const fn fwd_plain(d: u16) -> Variant {
    row(Family::Fwd, d)
}
/// Forward, wgmma: `groups` warpgroups of 64 rows, `bn` keys per tile, `min_blocks` per SM.
const fn fwd_sm90(d: u16, groups: u8, bn: u16, min_blocks: u8) -> Variant {
    let mut v = row(Family::FwdSm90, d).bounds(Bounds::Traits(min_blocks));
    v.groups = groups;
    v.bn = bn;
    v
}
/// Forward, warp-specialized: `bn` keys per tile, `stages` K/V slots, `groups` consumer
/// warpgroups of 64 rows.
const fn fwd_ws(d: u16, bn: u16, stages: u8, groups: u8) -> Variant {
    let mut v = row(Family::FwdWs, d);
    v.bn = bn;
    v.stages = stages;
    v.groups = groups;
    v
}
/// The sm80 backward's kernels for head dim `d`: dK/dV (mods Scores: the softcap and ALiBi
/// are always compiled in; `Sparse` adds the block mask), dQ (every modifier, the block mask
/// tested at run time: `Any`, the `Mask` default).
const fn bwd_dkdv(d: u16) -> Variant {
    row(Family::BwdDkdv, d).mods(Mods::Scores)
}
const fn bwd_dq(d: u16) -> Variant {
    row(Family::BwdDq, d).mods(Any)
}
const fn bwd_fused(d: u16) -> Variant {
    row(Family::BwdFused, d).mods(Mods::Scores)
}
/// The fused backward without the softcap and ALiBi (their run-time branches cost the plain
/// kernels instructions and registers).
const fn bwd_fused_plain(d: u16) -> Variant {
    row(Family::BwdFused, d)
}
const fn bwd_fused_convert(d: u16) -> Variant {
    row(Family::BwdFusedConvert, d).bounds(Bounds::Traits(0))
}
const fn bwd_sm90(d: u16) -> Variant {
    row(Family::BwdSm90, d)
}
const fn bwd_ws(d: u16, stages: u8) -> Variant {
    let mut v = row(Family::BwdWs, d);
    v.stages = stages;
    v
}
const fn bwd_ws_helper(family: Family, d: u16, stages: u8) -> Variant {
    let mut v = row(family, d).bounds(Bounds::Threads(256));
    v.stages = stages;
    v
}
const fn decode(d: u16, warps: u8) -> Variant {
    let mut v = row(Family::Decode, d).bounds(Bounds::TraitsMin);
    v.groups = warps;
    v
}

use Mods::{Any, Cap, Scores, Sparse};
use Tile::{Grid, GridQ1, Small, Tall, Wide};

/// Every compiled kernel. Order is free; the generated `Kernel` enum follows it.
pub const CATALOGUE: &[Variant] = &[
    // sm80/fwd.cu: the mma.sync forward, every head dim class, with and without dropout;
    // d >= 192 also with the small tile for 99 KB devices.
    fwd(32),
    fwd(32).dropout(),
    fwd(64),
    fwd(64).dropout(),
    fwd(96),
    fwd(96).dropout(),
    fwd(128),
    fwd(128).dropout(),
    fwd(160),
    fwd(160).dropout(),
    fwd(192),
    fwd(192).dropout(),
    fwd(224),
    fwd(224).dropout(),
    fwd(256),
    fwd(256).dropout(),
    fwd(192).tile(Small),
    fwd(192).tile(Small).dropout(),
    fwd(224).tile(Small),
    fwd(224).tile(Small).dropout(),
    fwd(256).tile(Small),
    fwd(256).tile(Small).dropout(),
    // Without score modifiers (the common problem), at the head dims the Ampere/Ada path is
    // measured at against FlashAttention-2, and d 96 (Phi-3's). d 96 and 128 take their
    // 64-key tile causal or not, so only that one is compiled; d 64 keeps 64 keys causal.
    fwd_plain(64),
    fwd_plain(64).tile(Wide),
    fwd_plain(96).tile(Wide),
    fwd_plain(128).tile(Wide),
    fwd_plain(256),
    // sm90/fwd.cu: the wgmma forward. Two warpgroups of 64 rows and 128-key tiles; three at
    // d = 64 (192 rows sharing each K/V tile); one warpgroup per block where three (d = 64,
    // 128 keys; d = 128, 48 keys) or four (d = 64, 64 keys) blocks share an SM, so that one
    // block's loads and softmax overlap another's matmuls; the two-warpgroup shape with the
    // softcap and ALiBi (`_mods`) and the block mask too (`_sparse`).
    fwd_sm90(64, 2, 128, 1),
    fwd_sm90(128, 2, 128, 1),
    fwd_sm90(64, 3, 128, 1),
    fwd_sm90(64, 2, 128, 1).mods(Scores),
    fwd_sm90(64, 2, 128, 1).mods(Sparse),
    fwd_sm90(128, 2, 128, 1).mods(Scores),
    fwd_sm90(128, 2, 128, 1).mods(Sparse),
    fwd_sm90(64, 1, 128, 3),
    fwd_sm90(64, 1, 64, 4),
    fwd_sm90(128, 1, 48, 3),
    // sm90/fwd_ws.cu: the warp-specialized forward, 64 query rows per consumer warpgroup.
    // d = 64 128 x 128 has four K/V slots where its registers allow (not with the block
    // mask); its three-warpgroup shape has 160 registers per thread, so dropout and the
    // block mask run on two.
    fwd_ws(64, 128, 4, 2),
    fwd_ws(64, 128, 3, 3),
    fwd_ws(64, 192, 2, 2),
    fwd_ws(96, 128, 2, 2),
    fwd_ws(128, 128, 2, 2),
    fwd_ws(128, 176, 2, 2),
    fwd_ws(256, 64, 2, 2),
    fwd_ws(256, 80, 2, 2),
    // One shape per head dim with the softcap and ALiBi, and one with the block mask too.
    // d = 256 under a block mask on 64-key tiles, which blocks (multiples of 64) never
    // straddle.
    fwd_ws(64, 128, 3, 3).mods(Scores),
    fwd_ws(128, 128, 2, 2).mods(Scores),
    fwd_ws(256, 80, 2, 2).mods(Scores),
    fwd_ws(64, 128, 3, 2).mods(Sparse),
    fwd_ws(128, 128, 2, 2).mods(Sparse),
    fwd_ws(256, 64, 2, 2).mods(Sparse),
    // Packed batches and dropout: the shapes the planner takes for them, without mods.
    fwd_ws(64, 128, 4, 2).packed(),
    fwd_ws(64, 128, 3, 3).packed(),
    fwd_ws(128, 128, 2, 2).packed(),
    fwd_ws(256, 64, 2, 2).packed(),
    fwd_ws(256, 80, 2, 2).packed(),
    fwd_ws(64, 128, 4, 2).dropout(),
    fwd_ws(128, 128, 2, 2).dropout(),
    fwd_ws(256, 80, 2, 2).dropout(),
    fwd_ws(64, 128, 4, 2).packed().dropout(),
    fwd_ws(128, 128, 2, 2).packed().dropout(),
    fwd_ws(256, 80, 2, 2).packed().dropout(),
    // Head dims 65-96 on d 128's tiles, the products cut to 80 columns up to d 80 (Phi-2,
    // ViT-H), else to 96; with a score modifier or the block mask d 128's kernels run.
    fwd_ws(96, 128, 2, 2).packed(),
    fwd_ws(96, 128, 2, 2).dropout(),
    fwd_ws(96, 128, 2, 2).packed().dropout(),
    fwd_ws(80, 128, 2, 2),
    fwd_ws(80, 128, 2, 2).packed(),
    fwd_ws(80, 128, 2, 2).dropout(),
    fwd_ws(80, 128, 2, 2).packed().dropout(),
    // Head dims up to 48 (Stable Diffusion's 40; 32: MiniLM, BGE-small) on d 64's tiles, the
    // products cut to 32 or 48 columns, in d 64's two shapes; with a score modifier or the
    // block mask d 64's kernels run.
    fwd_ws(48, 128, 4, 2),
    fwd_ws(48, 128, 3, 3),
    fwd_ws(48, 128, 4, 2).packed(),
    fwd_ws(48, 128, 3, 3).packed(),
    fwd_ws(48, 128, 4, 2).dropout(),
    fwd_ws(48, 128, 4, 2).packed().dropout(),
    fwd_ws(32, 128, 4, 2),
    fwd_ws(32, 128, 3, 3),
    fwd_ws(32, 128, 4, 2).packed(),
    fwd_ws(32, 128, 3, 3).packed(),
    fwd_ws(32, 128, 4, 2).dropout(),
    fwd_ws(32, 128, 4, 2).packed().dropout(),
    // Head dims 129-192 (Stable Diffusion 1.x's 160) on tiles 192 columns wide, which leave
    // room for 112-key tiles; 129-160 with the products cut to 160 columns; plain problems
    // only (the others run d 256's kernels).
    fwd_ws(192, 64, 2, 2),
    fwd_ws(192, 80, 2, 2),
    fwd_ws(192, 112, 2, 2),
    fwd_ws(160, 64, 2, 2),
    fwd_ws(160, 80, 2, 2),
    fwd_ws(160, 112, 2, 2),
    // E4M3 q, k, v (FP8 wgmma, V transposed in shared memory by the producer warpgroup).
    fwd_ws(128, 128, 2, 2).fp8(),
    fwd_ws(128, 192, 2, 2).fp8(),
    fwd_ws(128, 128, 2, 2).packed().fp8(),
    fwd_ws(128, 192, 2, 2).packed().fp8(),
    fwd_ws(256, 64, 2, 2).fp8(),
    fwd_ws(256, 64, 2, 2).packed().fp8(),
    // d = 256 with 96-key tiles: O staged through the Q slot in two halves
    // (WsTraits::O_ROUNDS), V^T's last 96 keys in a panel of each slot's own (VT_OWN).
    fwd_ws(256, 96, 2, 2).fp8(),
    fwd_ws(256, 96, 2, 2).packed().fp8(),
    // E4M3 q, k, v with V given transposed (FlashAttn::fp8_v_transposed, fixed-length
    // batches): V^T's tiles copied as they are, in 64-key panels, no transposing warps. With
    // no transposer d = 256 has room for 128-key tiles that keep S and P V in flight
    // together (the transposing kernels stop at 96).
    fwd_ws(128, 128, 2, 2).fp8().vt(),
    fwd_ws(128, 192, 2, 2).fp8().vt(),
    fwd_ws(256, 64, 2, 2).fp8().vt(),
    fwd_ws(256, 128, 2, 2).fp8().vt(),
    // sm80/bwd.cu: dsum and the wgmma backward's dQ conversion (any head dim; their block
    // size is the launcher's), then per head dim the deterministic dK/dV (also under a block
    // mask) and dQ kernels, up to 128 the fused dK/dV/dQ kernel (64 keys over 4 warps) and
    // its conversion, at 64 and 128 its 128-key shapes, at 128 and 256 on FlashAttention-2's
    // warp layout (d = 256 with Q single-buffered too, for 163 KB devices); d = 256's dK/dV
    // with 16-row tiles for 99 KB devices.
    row(Family::BwdDsum, 0).bounds(Bounds::Free),
    row(Family::BwdSm90Convert, 0).bounds(Bounds::Free),
    bwd_dkdv(32),
    bwd_dkdv(32).mods(Sparse),
    bwd_dq(32),
    bwd_dkdv(64),
    bwd_dkdv(64).mods(Sparse),
    bwd_dq(64),
    bwd_dkdv(96),
    bwd_dkdv(96).mods(Sparse),
    bwd_dq(96),
    bwd_dkdv(128),
    bwd_dkdv(128).mods(Sparse),
    bwd_dq(128),
    bwd_fused(32),
    bwd_fused(32).dropout(),
    bwd_fused_convert(32),
    bwd_fused(64),
    bwd_fused(64).dropout(),
    bwd_fused_convert(64),
    bwd_fused(96),
    bwd_fused(96).dropout(),
    bwd_fused_convert(96),
    bwd_fused(128),
    bwd_fused(128).dropout(),
    bwd_fused_convert(128),
    bwd_fused(64).tile(Wide),
    bwd_fused(64).tile(Tall),
    bwd_fused_convert(64).tile(Wide),
    bwd_fused_convert(64).tile(Tall),
    bwd_fused(128).tile(Wide),
    bwd_fused(128).tile(Tall),
    bwd_fused_convert(128).tile(Wide),
    bwd_fused_convert(128).tile(Tall),
    bwd_fused_plain(64),
    bwd_fused_plain(96),
    bwd_fused_plain(96).tile(Wide),
    bwd_fused_convert(96).tile(Wide),
    bwd_fused_plain(128),
    bwd_fused_plain(64).tile(Wide),
    bwd_fused_plain(64).tile(Tall),
    bwd_fused_plain(128).tile(Wide),
    bwd_fused_plain(128).tile(Tall),
    bwd_fused(128).tile(Grid),
    bwd_fused_plain(128).tile(Grid),
    bwd_fused_convert(128).tile(Grid),
    bwd_fused(256).tile(Grid),
    bwd_fused_plain(256).tile(Grid),
    bwd_fused_convert(256).tile(Grid),
    bwd_fused(256).tile(GridQ1),
    bwd_fused_plain(256).tile(GridQ1),
    bwd_fused_convert(256).tile(GridQ1),
    bwd_dkdv(160),
    bwd_dkdv(160).mods(Sparse),
    bwd_dq(160),
    bwd_dkdv(192),
    bwd_dkdv(192).mods(Sparse),
    bwd_dq(192),
    bwd_dkdv(224),
    bwd_dkdv(224).mods(Sparse),
    bwd_dq(224),
    bwd_dkdv(256),
    bwd_dkdv(256).mods(Sparse),
    bwd_dq(256),
    bwd_dkdv(256).tile(Small),
    bwd_dkdv(256).tile(Small).mods(Sparse),
    // sm90/bwd.cu: the wgmma backward, d 64 and 128, plain, with mods, with the block mask.
    bwd_sm90(64),
    bwd_sm90(64).mods(Scores),
    bwd_sm90(64).mods(Sparse),
    bwd_sm90(128),
    bwd_sm90(128).mods(Scores),
    bwd_sm90(128).mods(Sparse),
    // sm90/bwd_ws.cu: the warp-specialized backward, four Q/dO slots at d = 64, two above;
    // every variant at each head dim (the block mask also deterministic), the softcap alone
    // at 64 and 128, the cut rows (d 32 and 48 on d 64's tiles, 80 and 96 on d 128's, 160 and
    // 192 on d 256's; without score modifiers or the block mask); its prep and convert kernels.
    bwd_ws(64, 4),
    bwd_ws(64, 4).mods(Scores),
    bwd_ws(64, 4).mods(Sparse),
    bwd_ws(64, 4).mods(Sparse).deterministic(),
    bwd_ws(64, 4).packed(),
    bwd_ws(64, 4).dropout(),
    bwd_ws(64, 4).packed().dropout(),
    bwd_ws(64, 4).mods(Cap),
    bwd_ws_helper(Family::BwdWsPrep, 64, 4),
    bwd_ws_helper(Family::BwdWsConvert, 64, 4),
    bwd_ws(96, 2),
    bwd_ws(96, 2).packed(),
    bwd_ws(96, 2).dropout(),
    bwd_ws(96, 2).packed().dropout(),
    bwd_ws(80, 2),
    bwd_ws(80, 2).packed(),
    bwd_ws(80, 2).dropout(),
    bwd_ws(80, 2).packed().dropout(),
    bwd_ws(48, 4),
    bwd_ws(48, 4).packed(),
    bwd_ws(48, 4).dropout(),
    bwd_ws(48, 4).packed().dropout(),
    bwd_ws(32, 4),
    bwd_ws(32, 4).packed(),
    bwd_ws(32, 4).dropout(),
    bwd_ws(32, 4).packed().dropout(),
    // Head dims 129-192 on d 256's: S^T's and dP^T's k loops cut (plain problems).
    bwd_ws(192, 2),
    bwd_ws(160, 2),
    bwd_ws(128, 2),
    bwd_ws(128, 2).mods(Scores),
    bwd_ws(128, 2).mods(Sparse),
    bwd_ws(128, 2).mods(Sparse).deterministic(),
    bwd_ws(128, 2).packed(),
    bwd_ws(128, 2).dropout(),
    bwd_ws(128, 2).packed().dropout(),
    bwd_ws(128, 2).mods(Cap),
    bwd_ws_helper(Family::BwdWsPrep, 128, 2),
    bwd_ws_helper(Family::BwdWsConvert, 128, 2),
    bwd_ws(256, 2),
    bwd_ws(256, 2).mods(Scores),
    bwd_ws(256, 2).mods(Sparse),
    bwd_ws(256, 2).mods(Sparse).deterministic(),
    bwd_ws(256, 2).packed(),
    bwd_ws(256, 2).dropout(),
    bwd_ws(256, 2).packed().dropout(),
    bwd_ws_helper(Family::BwdWsPrep, 256, 2),
    bwd_ws_helper(Family::BwdWsConvert, 256, 2),
    // decode/decode.cu: appending (block size the launcher's), decoding with 4-warp blocks
    // at every head dim class, and the split launches' blocks: 8 warps up to 128, 2 above.
    // An e4m3 cache: the append, and decoding at the head dims models use (64, 96 for 80,
    // 128, 256), 8-warp split blocks up to 128 (at 256 its half-size rings fit 4 warps on
    // 99 KB devices).
    row(Family::Append, 0).bounds(Bounds::Free),
    row(Family::Append, 0).bounds(Bounds::Free).fp8(),
    decode(64, 4).fp8(),
    decode(96, 4).fp8(),
    decode(128, 4).fp8(),
    decode(256, 4).fp8(),
    decode(64, 8).fp8(),
    decode(96, 8).fp8(),
    decode(128, 8).fp8(),
    decode(32, 4),
    decode(64, 4),
    decode(96, 4),
    decode(128, 4),
    decode(160, 4),
    decode(192, 4),
    decode(224, 4),
    decode(256, 4),
    decode(32, 8),
    decode(64, 8),
    decode(96, 8),
    decode(128, 8),
    decode(160, 2),
    decode(192, 2),
    decode(224, 2),
    decode(256, 2),
];
