//! The warp-specialized Hopper backward (`cuda/sm90/bwd_ws.cu`): its parameter block, its
//! buffers and its three launches (row statistics + dq_accum's tile states, dK/dV/dQ, dq),
//! the kernels `plan_bwd` chose.

use candle::cuda_backend::cudarc::driver::sys::CUdeviceptr;
use candle::cuda_backend::cudarc::driver::{CudaSlice, DevicePtrMut, DeviceRepr};
use candle::{DType, Result};

use super::abi::{AttnParams, BwdParams};
use super::catalogue::{Kernel, Mods};
use super::lpt_tail::Tail;
use super::runtime::Launch;
use super::tma::{self, TileSource, TmaDesc};

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

/// d = 256 splits the head dim between the consumer warpgroups (`BwdWsTraits::SPLIT`): its
/// consumers add dQ into dq_accum themselves.
fn split(main: Kernel) -> bool {
    main.variant().d > 128
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
        main: Kernel,
        b: usize,
        h: usize,
        sq: usize,
    ) -> Result<Self> {
        let bm = main.geometry().bm as usize;
        let d = usize::from(main.variant().tiles_d());
        let m_blocks = sq.div_ceil(bm);
        let tiles = b * h * m_blocks;
        // SAFETY: flash_bwd_ws_prep writes every element of the statistics, of the state
        // words where the kernels use them and (with `split`) of dq_accum before any other
        // kernel reads them; without `split` a dq_accum tile is read only after the main
        // kernel stored all of it, which its state word records (cuda/sm90/dq_tile_state.cuh).
        let stats = unsafe { dev.alloc::<f32>(tiles * 2 * bm)? };
        let dq_accum = unsafe { dev.alloc::<f32>(tiles * bm * d)? };
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
    main: Kernel,
    dtype: DType,
    packed: Option<(usize, usize)>,
) -> Option<BwdTmaParams> {
    let a: &AttnParams = &b.a;
    let g = main.geometry();
    let (bm, bn) = (g.bm as usize, g.bn as usize);
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
        q: source(a.q, rows_q, a.h, q).encode(bm)?,
        k: source(a.k, rows_k, a.h_k, k).encode(bn)?,
        v: source(a.v, rows_k, a.h_k, v).encode(bn)?,
        dout: source(b.dout, rows_q, a.h, o).encode(bm)?,
        dk: source(b.dk, rows_k, a.h_k, dkv).encode(64)?,
        dv: source(b.dv, rows_k, a.h_k, dkv).encode(64)?,
        dq: source(b.dq, rows_q, a.h, dq).encode(bm)?,
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
fn grid(b: &BwdParams, main: Kernel) -> (usize, usize, usize) {
    let a = &b.a;
    let key_blocks = (a.seqlen_k as usize).div_ceil(main.geometry().bn as usize);
    (key_blocks, a.h_k as usize, a.b as usize)
}

/// Whether `main` can run `b`: TMA can address its tensors and the kernel's linear block
/// index (`BwdWsBlock::launch_order`) fits an int (`packed`: total query and key rows).
pub(super) fn supported(
    b: &BwdParams,
    main: Kernel,
    dtype: DType,
    packed: Option<(usize, usize)>,
) -> bool {
    let (x, y, z) = grid(b, main);
    x * y * z <= i32::MAX as usize && params(b, main, dtype, packed).is_some()
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
    (prep, main, convert): (Kernel, Kernel, Kernel),
    dtype: DType,
    b: &BwdParams,
    packed: Option<(usize, usize)>,
    deterministic: bool,
    next_col: CUdeviceptr,
    buffers: &mut BwdWsBuffers,
) -> Result<()> {
    let Some(mut p) = params(b, main, dtype, packed) else {
        candle::bail!("flash-attn backward: TMA cannot address q, k, v or grad_out")
    };
    let v = main.variant();
    if v.deterministic {
        // Under a block mask the deterministic kernels read the `next_col` skip table.
        p.block_next_col = next_col;
    }
    let stream = dev.cuda_stream();
    let (stats_ptr, _stats_sync) = buffers.stats.device_ptr_mut(&stream);
    let (dq_accum_ptr, _dq_accum_sync) = buffers.dq_accum.device_ptr_mut(&stream);
    let (dq_state_ptr, _dq_state_sync) = buffers.dq_state.device_ptr_mut(&stream);
    p.stats = stats_ptr;
    p.b.dq_accum = dq_accum_ptr;
    // The split kernel's consumers add into the zeroed dq_accum; its state words order them
    // in deterministic mode only (null: the convert kernel reads every tile).
    p.dq_state = if split(main) && !deterministic {
        0
    } else {
        dq_state_ptr
    };
    p.m_blocks = buffers.m_blocks as i32;
    p.deterministic = i32::from(deterministic);
    let grid = grid(b, main);
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
    let d = usize::from(v.tiles_d());
    let bm = main.geometry().bm as usize;
    // The prep kernel's 256 threads: 8 warps of 256 / d rows (d / 8 lanes per row).
    let rows_per_block = 8 * (prep.geometry().threads as usize / d);
    Launch::new(
        prep,
        dtype,
        ((buffers.m_blocks * bm).div_ceil(rows_per_block), h, bsz),
    )
    .run_programmatic(dev, &p)?;
    // The main and convert kernels are launched programmatically too: each waits in
    // `pdl_wait` for the kernel before it, its launch overlapping that kernel's last blocks.
    Launch::new(main, dtype, grid).run_programmatic(dev, &p)?;
    // The convert kernel's 256 threads: the main kernel's two consumer warpgroups, thread for
    // thread. The `_cap` kernels' dQ came from K times the softcap's scale (`prescale_k`):
    // divided out here.
    if v.mods == Mods::Cap {
        p.b.a.grad_scale /= p.b.a.softcap_pre;
    }
    Launch::new(convert, dtype, (buffers.m_blocks, h, bsz)).run_programmatic(dev, &p)
}
