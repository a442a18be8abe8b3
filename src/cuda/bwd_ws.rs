//! The warp-specialized Hopper backward (`cuda/sm90/bwd_ws.cu`): its parameter block, its
//! buffers and its three launches (row statistics + dq_accum's tile states, dK/dV/dQ, dq).

use candle::cuda_backend::cudarc::driver::sys::CUdeviceptr;
use candle::cuda_backend::cudarc::driver::{CudaSlice, DevicePtrMut, DeviceRepr};
use candle::{DType, Result};

use super::lpt_tail::Tail;
use super::tma::{self, TileSource, TmaDesc};
use super::{launch_programmatic, AttnParams, BwdParams};

/// Mirror of `struct BwdTmaParams` in `cuda/sm90/bwd_ws.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct BwdTmaParams {
    pub(super) q: TmaDesc,
    pub(super) k: TmaDesc,
    pub(super) v: TmaDesc,
    pub(super) dout: TmaDesc,
    /// dK and dV, stored by TMA from the K and V tiles' shared memory, 64 rows a box.
    pub(super) dk: TmaDesc,
    pub(super) dv: TmaDesc,
    /// dq, stored by the convert kernel, BM rows a box.
    pub(super) dq: TmaDesc,
    pub(super) b: BwdParams,
    pub(super) stats: CUdeviceptr,
    /// Per query tile, the state word of its dq_accum tile (`cuda/sm90/dq_tile_state.cuh`); 0
    /// (null) for the split kernel unless deterministic (its dq_accum the prep kernel zeroes).
    pub(super) dq_state: CUdeviceptr,
    pub(super) m_blocks: i32,
    /// Under a mask, how many (sequence, KV head) pairs end the grid in longest-first order
    /// (`cuda/common/lpt_tail.cuh`); 0 none.
    pub(super) tail_heads: i32,
    /// Nonzero: the key blocks add into each dq_accum tile in order (from the last), for a
    /// bitwise repeatable dQ (`cuda/sm90/dq_tile_state.cuh`); under a block mask in the
    /// `_sparse_det` kernels.
    pub(super) deterministic: i32,
    /// Deterministic mode: (sequence, KV head) pairs per group of the grid's interleaved
    /// order (`interleaved_pairs`); 0 or 1: pair by pair.
    pub(super) pair_group: i32,
    /// The block mask's `next_col` skip table (`BlockMask`'s `Skips`), in deterministic mode
    /// (`DqOrder::sparse_turn`); null elsewhere.
    pub(super) block_next_col: CUdeviceptr,
}

// SAFETY: plain-old-data with the C layout of `BwdTmaParams`, passed by value as a kernel
// argument (__grid_constant__).
unsafe impl DeviceRepr for BwdTmaParams {}

/// Query rows per streamed tile (`BwdWsTraits`).
const BM: usize = 64;

/// One compiled warp-specialized backward: head dim 64 (four Q/dO slots), 128 or 256 (two).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct BwdWsShape {
    d: usize,
    stages: usize,
}

impl BwdWsShape {
    /// The kernel for padded head dim `d`, if there is one.
    pub fn for_head_dim(d: usize) -> Option<Self> {
        match d {
            // d 64 with 4 Q/dO slots: +1-2% over 3 (H200); d 128 with 3 (226.6 of 227 KB) was
            // 0-2% slower than with 2 (docs/archive/PERF.md, "Q slots, and three ideas
            // measured and dropped").
            64 => Some(Self { d, stages: 4 }),
            128 | 256 => Some(Self { d, stages: 2 }),
            _ => None,
        }
    }

    /// d = 256 splits the head dim between the consumer warpgroups (`BwdWsTraits::SPLIT`).
    fn split(&self) -> bool {
        self.d > 128
    }

    /// Keys per block.
    fn bn(&self) -> usize {
        if self.split() {
            64
        } else {
            128
        }
    }

    /// `BwdWsTraits::SMEM_BYTES`: K, V, the Q/dO slots, two dS^T tiles, the f32 dQ tile (with
    /// `split`, two P^T tiles instead), the slots' row statistics, the barriers, the slots'
    /// `TileInfo`, 1 KB of alignment.
    fn smem_bytes(&self) -> u32 {
        let bn = self.bn();
        let (kv, q, ds) = (bn * self.d * 2, BM * self.d * 2, bn * BM * 2);
        let dq = if self.split() {
            2 * ds
        } else {
            BM * self.d * 4
        };
        let stats = 2 * BM * 4;
        let bytes = 2 * kv + 2 * self.stages * q + 2 * ds + dq + self.stages * stats;
        (bytes + (1 + 2 * 2 + 3 * self.stages) * 8 + self.stages * 8 + 1024) as u32
    }
}

/// The backward's buffers of this path: per (sequence, head, query tile) the row statistics
/// (2 x 64 f32), the f32 dQ tile (64 x d) and the dQ tile's state word (which the split
/// kernel uses only in deterministic mode).
pub(super) struct BwdWsBuffers {
    stats: CudaSlice<f32>,
    dq_accum: CudaSlice<f32>,
    dq_state: CudaSlice<i32>,
    m_blocks: usize,
}

impl BwdWsBuffers {
    pub fn new(
        dev: &candle::CudaDevice,
        shape: &BwdWsShape,
        b: usize,
        h: usize,
        sq: usize,
    ) -> Result<Self> {
        let m_blocks = sq.div_ceil(BM);
        let tiles = b * h * m_blocks;
        // SAFETY: flash_bwd_ws_prep writes every element of the statistics, of the state
        // words where the kernels use them and (with `split`) of dq_accum before any other
        // kernel reads them; without `split` a dq_accum tile is read only after the main
        // kernel stored all of it, which its state word records (cuda/sm90/dq_tile_state.cuh).
        let stats = unsafe { dev.alloc::<f32>(tiles * 2 * BM)? };
        let dq_accum = unsafe { dev.alloc::<f32>(tiles * BM * shape.d)? };
        let dq_state = unsafe { dev.alloc::<i32>(tiles)? };
        Ok(Self {
            stats,
            dq_accum,
            dq_state,
            m_blocks,
        })
    }
}

/// The parameter block for `b` (pointers set, `b.dq_accum` aside), or `None` where TMA
/// cannot address q, k, v, dO, dK or dV; `packed` as in `tma::extents`.
fn params(
    b: &BwdParams,
    shape: &BwdWsShape,
    dtype: DType,
    packed: Option<(usize, usize)>,
) -> Option<BwdTmaParams> {
    let a: &AttnParams = &b.a;
    let (batch, rows_q, rows_k) = tma::extents(a, packed);
    let source = |ptr, rows: usize, heads: i32, [batch_stride, row, head]: [i64; 3]| TileSource {
        ptr,
        dtype,
        b: batch,
        rows,
        heads: heads as usize,
        d: a.d as usize,
        strides: [row, head, batch_stride],
    };
    let q = [a.q_batch_stride, a.q_row_stride, a.q_head_stride];
    let k = [a.k_batch_stride, a.k_row_stride, a.k_head_stride];
    let v = [a.v_batch_stride, a.v_row_stride, a.v_head_stride];
    let o = [a.o_batch_stride, a.o_row_stride, a.o_head_stride];
    let dkv = [b.dk_batch_stride, b.dk_row_stride, b.dk_head_stride];
    // dq is contiguous (b, seqlen_q, h, d).
    let row = i64::from(a.h) * i64::from(a.d);
    let dq = [i64::from(a.seqlen_q) * row, row, i64::from(a.d)];
    Some(BwdTmaParams {
        q: source(a.q, rows_q, a.h, q).encode(BM)?,
        k: source(a.k, rows_k, a.h_k, k).encode(shape.bn())?,
        v: source(a.v, rows_k, a.h_k, v).encode(shape.bn())?,
        dout: source(b.dout, rows_q, a.h, o).encode(BM)?,
        dk: source(b.dk, rows_k, a.h_k, dkv).encode(64)?,
        dv: source(b.dv, rows_k, a.h_k, dkv).encode(64)?,
        dq: source(b.dq, rows_q, a.h, dq).encode(BM)?,
        b: *b,
        stats: 0,
        dq_state: 0,
        m_blocks: 0,
        tail_heads: 0,
        deterministic: 0,
        pair_group: 0,
        block_next_col: 0,
    })
}

/// The main kernel's grid: (key blocks, KV heads, sequences).
fn grid(b: &BwdParams, shape: &BwdWsShape) -> (usize, usize, usize) {
    let a = &b.a;
    let key_blocks = (a.seqlen_k as usize).div_ceil(shape.bn());
    (key_blocks, a.h_k as usize, a.b as usize)
}

/// Whether this path can run `b`: TMA can address its tensors, the kernel's linear block
/// index (`BwdWsBlock::launch_order`) fits an int, and a kernel of the problem's variant is
/// compiled and switched on (`tma::ws_variant`; `packed`: total query and key rows).
pub(super) fn supported(
    b: &BwdParams,
    shape: &BwdWsShape,
    dtype: DType,
    packed: Option<(usize, usize)>,
) -> bool {
    let (x, y, z) = grid(b, shape);
    variant(b, shape, packed).is_some()
        && x * y * z <= i32::MAX as usize
        && params(b, shape, dtype, packed).is_some()
}

/// `tma::ws_variant` for `b` and `packed`; at d = 64 and 128 a softcap without ALiBi takes the
/// `_cap` kernels, compiled with the capped probabilities' code alone. There dV is issued a
/// k16 step at a time under the tanh and exponentials, which the `_mods` kernel at d = 128
/// cannot do without ptxas serializing its wgmmas (docs/archive/PERF.md, "dV steps in the
/// `_mods` kernels, once more" and "`_cap` backward kernels: a softcap without ALiBi on its
/// own code"), and the K tile is multiplied by the softcap's scale once per block
/// (`prescale_k`), so only where that scale (softmax scale / cap) is at most 1: f16 keys
/// cannot overflow.
/// `CANDLE_FLASH_BWD_CAP=0` (read once) keeps them on `_mods` (A/B runs, and the tests of the
/// `_mods` kernels' capped path).
fn variant(
    b: &BwdParams,
    shape: &BwdWsShape,
    packed: Option<(usize, usize)>,
) -> Option<&'static str> {
    let variant = tma::ws_variant(b.a.mods_suffix(), packed.is_some(), b.a.drop_threshold != 0)?;
    let cap_alone = b.a.softcap_pre != 0.0 && b.a.softcap_pre <= 1.0 && b.a.alibi_slopes == 0;
    Some(
        if variant == "_mods"
            && cap_alone
            && !shape.split()
            && !super::overrides::overrides().bwd_cap_off
        {
            "_cap"
        } else {
            variant
        },
    )
}

/// Runs the three kernels on `b` (every pointer but dq_accum set), writing dq, dk and dv, on
/// a device of `sms` multiprocessors; `packed` as for [`supported`]; `deterministic`: dQ
/// added in key-block order (under a block mask the `_sparse_det` kernels, which have no
/// other mode, instead of `_sparse`; `next_col`: the block mask's `next_col` table, which
/// they read).
#[allow(clippy::too_many_arguments)]
pub(super) fn run(
    dev: &candle::CudaDevice,
    sms: usize,
    shape: &BwdWsShape,
    dtype: DType,
    dtype_name: &str,
    b: &BwdParams,
    packed: Option<(usize, usize)>,
    deterministic: bool,
    next_col: CUdeviceptr,
    buffers: &mut BwdWsBuffers,
) -> Result<()> {
    let Some(mut p) = params(b, shape, dtype, packed) else {
        candle::bail!("flash-attn backward: TMA cannot address q, k, v or grad_out")
    };
    let Some(variant) = variant(b, shape, packed) else {
        candle::bail!("flash-attn backward: no warp-specialized kernel for this problem's options")
    };
    let variant = if deterministic && variant == "_sparse" {
        p.block_next_col = next_col;
        "_sparse_det"
    } else {
        variant
    };
    let stream = dev.cuda_stream();
    let (stats_ptr, _stats_sync) = buffers.stats.device_ptr_mut(&stream);
    let (dq_accum_ptr, _dq_accum_sync) = buffers.dq_accum.device_ptr_mut(&stream);
    let (dq_state_ptr, _dq_state_sync) = buffers.dq_state.device_ptr_mut(&stream);
    p.stats = stats_ptr;
    p.b.dq_accum = dq_accum_ptr;
    // The split kernel's consumers add into the zeroed dq_accum; its state words order them
    // in deterministic mode only (null: the convert kernel reads every tile).
    p.dq_state = if shape.split() && !deterministic {
        0
    } else {
        dq_state_ptr
    };
    p.m_blocks = buffers.m_blocks as i32;
    p.deterministic = i32::from(deterministic);
    let grid = grid(b, shape);
    let a = &b.a;
    if deterministic {
        // Block n waits for block n + 1 (cuda/sm90/dq_tile_state.cuh), so each pair's key blocks
        // start from the last and the grid has no longest-first tail. The pairs go interleaved
        // in groups of about one wave of blocks, so that each wave's blocks end in the order
        // the next wave's chains need (1.05-1.13x at 1k-4k, measured with the key blocks in
        // ascending order; H100, docs/archive/PERF.md, "The grid's pairs interleaved by
        // wave"). `CANDLE_FLASH_DET_GROUP=0` (read once) keeps the pair-by-pair order (A/B
        // runs).
        let group = (sms / grid.0).clamp(1, grid.1 * grid.2);
        if group > 1 && !super::overrides::overrides().det_group_off {
            p.pair_group = group as i32;
        }
    } else if a.window_left >= 0 || a.window_right >= 0 || a.block_q != 0 {
        // Under a mask the key blocks differ in work (causal: key block 0 sees every query),
        // so the grid ends heaviest first across its last heads; one block per SM.
        p.tail_heads = Tail::Backward.pairs(grid.1 * grid.2, grid.0, sms);
    }
    let (bsz, h) = (b.a.b as usize, b.a.h as usize);
    let d = shape.d;
    // 256 threads: 8 warps of 256 / d rows (d / 8 lanes per row).
    let rows_per_block = 8 * (256 / d);
    launch_programmatic(
        dev,
        &format!("flash_bwd_ws_prep_{dtype_name}_d{d}"),
        ((buffers.m_blocks * BM).div_ceil(rows_per_block), h, bsz),
        256,
        0,
        &p,
    )?;
    // The main and convert kernels are launched programmatically too: each waits in
    // `pdl_wait` for the kernel before it, its launch overlapping that kernel's last blocks.
    launch_programmatic(
        dev,
        &format!("flash_bwd_ws_{dtype_name}_d{d}{variant}"),
        grid,
        384,
        shape.smem_bytes(),
        &p,
    )?;
    // 256 threads: the main kernel's two consumer warpgroups, thread for thread. The `_cap`
    // kernels' dQ came from K times the softcap's scale (`prescale_k`): divided out here.
    if variant == "_cap" {
        p.b.a.grad_scale /= p.b.a.softcap_pre;
    }
    launch_programmatic(
        dev,
        &format!("flash_bwd_ws_convert_{dtype_name}_d{d}"),
        (buffers.m_blocks, h, bsz),
        256,
        0,
        &p,
    )
}
