//! The decode kernel's choice: warps per block and how many slices of each sequence's keys
//! run in parallel (flash-decoding).

use std::sync::OnceLock;

use candle::{bail, Result};

use super::super::catalogue::{Family, Kernel};
use super::super::overrides::overrides;
use super::head_dim_class;

/// Warps of the unsplit decode blocks.
const BASE_WARPS: u8 = 4;
/// `MAX_SPLITS` in `cuda/decode/merge.cuh` (the merge's weight buffer).
const MAX_SPLITS: usize = 128;
/// Fewest key tiles per warp worth a split of their own. Each split also pays for loading Q,
/// filling its ring, merging its warps and writing a partial row, but where the grid is
/// small a warp's tiles are a chain of memory latencies: the LLaMA-1B step at batch 1 (8 K/V
/// heads, 768-key capacity: 48 tiles of 16) ran 1.104-1.107 ms/step with 4 to 12 split
/// blocks of 8 warps and 1.123-1.125 with 2 or 3 (H200, docs/archive/PERF.md). One tile a
/// warp: 6 splits there; long caches hit the SM count first and keep theirs.
const MIN_TILES_PER_WARP: usize = 1;

/// What the decode choice depends on.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DecodeQuery {
    pub d: usize,
    /// Query rows per K/V head: seqlen_q x (num_heads / num_heads_k).
    pub rows: usize,
    /// Batch x K/V heads.
    pub pairs: usize,
    /// Keys of the longest sequence.
    pub max_len: usize,
    /// The cache is e4m3 (the `_fp8` kernels).
    pub fp8_cache: bool,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct DecodePlan {
    pub kernel: Kernel,
    pub splits: usize,
    /// Packed query row tiles per K/V head.
    pub row_tiles: usize,
    /// The splits of each row tile run as one thread-block cluster and merge through its
    /// shared memory (sm_90) instead of through global memory and an arrival count.
    pub cluster: bool,
}

/// `MAX_CLUSTER_SPLITS` in `cuda/decode/merge.cuh`: the most splits a cluster merges (16 is
/// past the portable cluster size of 8; the driver is asked whether such clusters fit).
const MAX_CLUSTER: usize = 16;

/// The decode launch for `q` on a device with `sms` multiprocessors allowing `smem` bytes of
/// shared memory per block; `residency(kernel)` asks the driver how many blocks of a kernel
/// one multiprocessor holds, `clusters(kernel, size)` how many clusters of `size` blocks of
/// it the device runs at once (0 where there are none: before sm_90).
pub(crate) fn plan_decode(
    q: &DecodeQuery,
    sms: usize,
    smem: usize,
    residency: impl Fn(Kernel) -> Result<usize>,
    clusters: impl Fn(Kernel, usize) -> Result<usize>,
) -> Result<DecodePlan> {
    let plan = plan_blocks(q, sms, smem, residency)?;
    Ok(DecodePlan {
        cluster: cluster_merge(&plan, q.pairs, clusters)?,
        ..plan
    })
}

/// Whether `plan`'s splits merge inside clusters: a split launch whose clusters (one per row
/// tile, its splits) all fit on the device at once. A cluster's blocks leave partial rows in
/// their own shared memory and merge them after a cluster barrier, where the global merge
/// stores them, counts each block in with an atomic and has the last one read them back from
/// L2. `CANDLE_FLASH_DECODE_CLUSTER=0` keeps the global merge.
fn cluster_merge(
    plan: &DecodePlan,
    pairs: usize,
    clusters: impl Fn(Kernel, usize) -> Result<usize>,
) -> Result<bool> {
    if plan.splits < 2 || plan.splits > MAX_CLUSTER || overrides().decode_cluster_off {
        return Ok(false);
    }
    Ok(clusters(plan.kernel, plan.splits)? >= pairs * plan.row_tiles)
}

/// [`plan_decode`]'s kernel, splits and row tiles.
fn plan_blocks(
    q: &DecodeQuery,
    sms: usize,
    smem: usize,
    residency: impl Fn(Kernel) -> Result<usize>,
) -> Result<DecodePlan> {
    let d = head_dim_class(q.d);
    let Some(shapes) = shapes(d, q.fp8_cache) else {
        if q.fp8_cache {
            bail!(
                "k_cache: no F8E4M3-cache decode kernel for head_dim {} (compiled for head dims \
                 up to 64, 96 and 128, and 256); use a bf16/f16 cache",
                q.d
            )
        }
        bail!("flash-attn decode: no kernel for head dim {d}")
    };
    let fits = |k: &Kernel| k.geometry().smem as usize <= smem;
    // Four warps, or where their K/V rings do not fit (d > 128 on a 99 KB sm_86/89 device)
    // the narrower block compiled for the head dim.
    let base = match shapes.narrow {
        Some(narrow) if !fits(&shapes.base) => narrow,
        _ => shapes.base,
    };
    let geometry = base.geometry();
    let row_tiles = q.rows.div_ceil(geometry.bm as usize);
    let blocks = q.pairs * row_tiles;
    let key_tiles = q.max_len.div_ceil(geometry.bn as usize);
    let slots = sms * residency(base)?.max(1);
    let base_warps = geometry.threads as usize / 32;
    let splits = num_splits(blocks, key_tiles, sms, slots, base_warps);
    // A grid of one wave at most (a split launch, which fills the SMs once, or an unsplit
    // one of few blocks) runs one block an SM, so its blocks get the wider shape compiled for
    // the head dim (8 warps up to 128): twice the K/V tiles in flight per SM (H200, hd 128:
    // (8, 8k) 0.0670 ms against 0.0683 with 4 warps; the LLaMA-1B step at batch 16, 128
    // unsplit blocks of ~40 tiles: 1.308 ms/step against 1.356; docs/archive/PERF.md).
    // Larger unsplit grids fill the SMs with several 4-warp blocks (6 warps measured no faster
    // at (32, 4k)). Above 128 the rings of 8 warps do not fit (224, 256) or were not measured
    // (160, 192). `CANDLE_FLASH_DECODE_WARPS=4` keeps every launch on 4-warp blocks (a tuning
    // aid).
    let wide = shapes.wide.filter(fits);
    if let (Some(wide), false) = (wide, overrides().decode_four_warps) {
        let warps = wide.geometry().threads as usize / 32;
        let wide_splits = match splits {
            1 => 1,
            _ => num_splits(blocks, key_tiles, sms, slots, warps),
        };
        // One wave: unsplit and at most one block an SM, or split (wider blocks may want
        // fewer splits; none at all leaves the grid to the 4-warp blocks).
        if (splits == 1 && blocks <= sms) || wide_splits > 1 {
            return Ok(DecodePlan {
                kernel: wide,
                splits: wide_splits,
                row_tiles,
                cluster: false,
            });
        }
    }
    Ok(DecodePlan {
        kernel: base,
        splits,
        row_tiles,
        cluster: false,
    })
}

/// The decode kernels of one head dim class: 4-warp blocks, and the narrower and wider ones
/// where compiled.
#[derive(Clone, Copy, Debug)]
struct Shapes {
    base: Kernel,
    narrow: Option<Kernel>,
    wide: Option<Kernel>,
}

/// [`Shapes`] of head dim class `d` for a 16-bit or an e4m3 cache, found in the catalogue
/// once per class (a decode step asks per layer).
fn shapes(d: usize, fp8_cache: bool) -> Option<Shapes> {
    type Table = Vec<(usize, bool, Shapes)>;
    static BY_CLASS: OnceLock<Table> = OnceLock::new();
    let table = BY_CLASS.get_or_init(|| {
        let mut table = vec![];
        for k in Kernel::ALL {
            let v = k.variant();
            if v.family != Family::Decode || v.groups != BASE_WARPS {
                continue;
            }
            let other = |pred: fn(u8) -> bool| {
                Kernel::find(|w| {
                    w.family == Family::Decode && w.d == v.d && w.fp8 == v.fp8 && pred(w.groups)
                })
            };
            let shapes = Shapes {
                base: k,
                narrow: other(|g| g < BASE_WARPS),
                wide: other(|g| g > BASE_WARPS),
            };
            table.push((usize::from(v.d), v.fp8, shapes));
        }
        table
    });
    table
        .iter()
        .find(|(c, f, _)| *c == d && *f == fp8_cache)
        .map(|(.., s)| *s)
}

/// How many slices of each sequence's key range run in parallel, for `blocks` = batch x K/V
/// heads x row tiles, `key_tiles` tiles in the longest sequence, `sms` multiprocessors and
/// `slots` = SMs x resident blocks per SM.
///
/// Measured (H200, GQA 32/8, hd 128, docs/archive/PERF.md): one block per SM streams K and V
/// as fast as three, and any grid a little past the SM count pays a tail (at (1, 64k): 16
/// splits = 128 blocks 0.074 ms, 17 = 136 blocks 0.086 ms, 49 = 392 blocks, 0.080 ms). So the
/// splits fill the SMs once, never past them; a grid that fills half the slots on its own
/// runs unsplit ((32, 4k): 256 blocks, 0.134 ms against 0.147 ms with 3 splits). At least
/// `MIN_TILES_PER_WARP` key tiles per warp. `CANDLE_FLASH_DECODE_SPLITS=n` forces n (a tuning
/// aid).
fn num_splits(blocks: usize, key_tiles: usize, sms: usize, slots: usize, warps: usize) -> usize {
    if let Some(n) = overrides().decode_splits {
        return n.min(MAX_SPLITS);
    }
    if blocks * 2 >= slots {
        return 1;
    }
    let most = (key_tiles / (MIN_TILES_PER_WARP * warps)).clamp(1, MAX_SPLITS);
    (sms / blocks.max(1)).clamp(1, most)
}

#[cfg(test)]
mod tests {
    use super::super::test_facts::HOPPER;
    use super::*;

    /// The plan on an H200 for `pairs` batch x K/V heads, `rows` packed query rows a K/V
    /// head and `max_len` keys, with three blocks of any kernel resident per SM.
    fn plan(d: usize, rows: usize, pairs: usize, max_len: usize) -> DecodePlan {
        let q = DecodeQuery {
            d,
            rows,
            pairs,
            max_len,
            fp8_cache: false,
        };
        plan_decode(&q, HOPPER.sms, HOPPER.smem, |_| Ok(3), |_, _| Ok(0)).unwrap()
    }

    fn warps(p: &DecodePlan) -> u32 {
        p.kernel.geometry().threads / 32
    }

    #[test]
    fn one_wave_grids_take_eight_warps() {
        // The LLaMA-1B step at batch 16: 128 unsplit blocks, one an SM.
        let p = plan(64, 4, 16 * 8, 768);
        assert_eq!((p.splits, warps(&p)), (1, 8));
        // Batch 1 at 8k keys: split to fill the SMs, on 8-warp blocks.
        let p = plan(128, 4, 8, 8192);
        assert_eq!((p.splits, warps(&p)), (16, 8));
    }

    #[test]
    fn larger_grids_keep_four_warps() {
        // (32, 4k): 256 blocks, several an SM.
        let p = plan(128, 4, 32 * 8, 4096);
        assert_eq!((p.splits, warps(&p)), (1, 4));
    }

    #[test]
    fn split_launches_merge_in_clusters_that_fit() {
        let q = DecodeQuery {
            d: 128,
            rows: 4,
            pairs: 8,
            max_len: 8192,
            fp8_cache: false,
        };
        // Batch 1 at 8k keys: 8 clusters of 16 splits, if the device runs 8 at once.
        let p = plan_decode(&q, HOPPER.sms, HOPPER.smem, |_| Ok(3), |_, _| Ok(8)).unwrap();
        assert_eq!((p.splits, p.cluster), (16, true));
        let p = plan_decode(&q, HOPPER.sms, HOPPER.smem, |_| Ok(3), |_, _| Ok(7)).unwrap();
        assert_eq!((p.splits, p.cluster), (16, false));
        // Unsplit launches have nothing to merge.
        let q = DecodeQuery { pairs: 128, ..q };
        let p = plan_decode(&q, HOPPER.sms, HOPPER.smem, |_| Ok(3), |_, _| Ok(1000)).unwrap();
        assert_eq!((p.splits, p.cluster), (1, false));
    }

    #[test]
    fn head_dims_without_a_wide_kernel_stay_on_four_warps() {
        let p = plan(256, 4, 16 * 8, 768);
        assert_eq!((p.splits, warps(&p)), (1, 4));
    }
}
