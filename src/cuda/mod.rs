//! CUDA launchers: the `#[repr(C)]` twin of `cuda/common/params.cuh`, kernel selection per dtype and
//! head dim, and the launches themselves. Attention forward/backward here; KV-cache append
//! and decoding in [`decode`].

mod bwd;
mod bwd_ws;
mod decode;
mod lpt_tail;
mod overrides;
mod tma;
pub(crate) use bwd::bwd;
pub(crate) use decode::{append, decode};

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle::backend::BackendStorage;
use candle::cuda_backend::cudarc::driver::result::memset_d8_async;
use candle::cuda_backend::cudarc::driver::sys::{
    CUdevice_attribute, CUdeviceptr, CUfunction_attribute,
};
use candle::cuda_backend::cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
    LaunchConfig, PushKernelArg, SyncOnDrop,
};
use candle::cuda_backend::cudarc::nvrtc::Ptx;
use candle::cuda_backend::{CudaDType, WrapErr};
use candle::{bail, CudaStorage, DType, Layout, Result, Tensor};
use half::{bf16, f16};
use lpt_tail::Tail;

use crate::params::Problem;
use crate::score_mod::ScoreMods;
use crate::{philox, ptx};

/// Mirror of `struct AttnParams` in `cuda/common/params.cuh`; same field order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct AttnParams {
    q: CUdeviceptr,
    k: CUdeviceptr,
    v: CUdeviceptr,
    o: CUdeviceptr,
    lse: CUdeviceptr,
    cu_seqlens_q: CUdeviceptr,
    cu_seqlens_k: CUdeviceptr,
    q_batch_stride: i64,
    q_row_stride: i64,
    q_head_stride: i64,
    k_batch_stride: i64,
    k_row_stride: i64,
    k_head_stride: i64,
    v_batch_stride: i64,
    v_row_stride: i64,
    v_head_stride: i64,
    o_batch_stride: i64,
    o_row_stride: i64,
    o_head_stride: i64,
    lse_batch_stride: i64,
    lse_head_stride: i64,
    b: i32,
    h: i32,
    h_k: i32,
    seqlen_q: i32,
    seqlen_k: i32,
    d: i32,
    h_h_k_ratio: i32,
    scale: f32,
    scale_log2: f32,
    window_left: i32,
    window_right: i32,
    softcap_pre: f32,
    softcap_max_log2: f32,
    grad_scale: f32,
    alibi_slopes: CUdeviceptr,
    alibi_batch_stride: i32,
    alibi_scale: f32,
    block_mask: CUdeviceptr,
    block_dense: CUdeviceptr,
    block_prev_col: CUdeviceptr,
    block_next_row: CUdeviceptr,
    block_head_stride: i64,
    dense_head_stride: i64,
    dense_row_stride: i64,
    block_q: i32,
    block_k: i32,
    block_cols: i32,
    block_rows: i32,
    block_q_div: FastDiv,
    block_k_div: FastDiv,
    drop_threshold: u32,
    rp_keep: f32,
    seed_lo: u32,
    seed_hi: u32,
    offset_lo: u32,
    offset_hi: u32,
}

// SAFETY: plain-old-data with the C layout of `AttnParams`, passed by value as a kernel argument.
unsafe impl DeviceRepr for AttnParams {}

/// Mirror of `struct FastDiv` in `cuda/common/params.cuh`: division by a constant the kernels take
/// as a multiply-high and a shift ([`crate::block_sparse::fast_div`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct FastDiv {
    mul: u32,
    shift: i32,
}

impl FastDiv {
    fn new(d: usize) -> Self {
        let (mul, shift) = crate::block_sparse::fast_div(d as u32);
        Self { mul, shift }
    }
}

/// Mirror of `struct BwdParams` in `cuda/common/params.cuh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct BwdParams {
    a: AttnParams,
    dout: CUdeviceptr,
    dsum: CUdeviceptr,
    dq: CUdeviceptr,
    dk: CUdeviceptr,
    dv: CUdeviceptr,
    dk_batch_stride: i64,
    dk_row_stride: i64,
    dk_head_stride: i64,
    dq_accum: CUdeviceptr,
    dq_accum_len: i64,
    dq_tile_rows: i64,
}

// SAFETY: as for `AttnParams`.
unsafe impl DeviceRepr for BwdParams {}

/// The host-device contract, checked when the crate compiles: every `#[repr(C)]` struct under
/// `src/cuda` (here and in `decode`, `tma`, `bwd_ws`) is the twin of the C struct of the same
/// name under `cuda/`, the source of truth, and where the two differ the build fails naming
/// the struct and the field.
/// - build.rs (`abi_layout`) reads each C struct's fields from its definition (so C's field
///   list is parsed, not restated) and has nvcc compile a probe to PTX that records the
///   struct's `sizeof` and `alignof` and each field's `offsetof` and `sizeof` as the device
///   compiler lays them out (build machine only: no GPU, nothing run).
/// - The generated `OUT_DIR/abi_layout.rs` asserts in `const` items the Rust struct's size
///   and alignment and, per C field, its offset, size and type (the C type mapped to Rust:
///   any pointer is a `CUdeviceptr`), then destructures the struct with exactly C's fields
///   and no `..`: a field on one side only fails to compile, even one in tail padding.
///
/// Twins in submodules have `pub(super)` fields so that this module sees them.
mod abi_layout {
    include!(concat!(env!("OUT_DIR"), "/abi_layout.rs"));
}

impl AttnParams {
    /// Sizes, strides, scale, mask and dropout of a problem; pointers are filled in by the
    /// launchers. The output (and dO, dQ) are contiguous, like q without its strides.
    fn new(problem: &Problem, ql: &Layout, kl: &Layout, vl: &Layout) -> Result<Self> {
        let s = problem.shape;
        let packed = problem.varlen.is_some();
        let [q_batch_stride, q_row_stride, q_head_stride] = strides3(ql);
        let [k_batch_stride, k_row_stride, k_head_stride] = strides3(kl);
        let [v_batch_stride, v_row_stride, v_head_stride] = strides3(vl);
        let (o_row_stride, o_head_stride) = ((s.h * s.d) as i64, s.d as i64);
        let o_batch_stride = if packed {
            0
        } else {
            s.sq as i64 * o_row_stride
        };
        let (lse_batch_stride, lse_head_stride) = if packed {
            (0, s.total_q as i64)
        } else {
            ((s.h * s.sq) as i64, s.sq as i64)
        };
        let mut params = Self {
            q_batch_stride,
            q_row_stride,
            q_head_stride,
            k_batch_stride,
            k_row_stride,
            k_head_stride,
            v_batch_stride,
            v_row_stride,
            v_head_stride,
            o_batch_stride,
            o_row_stride,
            o_head_stride,
            lse_batch_stride,
            lse_head_stride,
            b: to_i32(s.b, "batch")?,
            h: to_i32(s.h, "num_heads")?,
            h_k: to_i32(s.hk, "num_heads_k")?,
            seqlen_q: rows_i32(s.sq, "seqlen_q")?,
            seqlen_k: rows_i32(s.sk, "seqlen_k")?,
            d: s.d as i32,
            h_h_k_ratio: s.group() as i32,
            ..Self::default()
        };
        params.set_mods(&problem.mods, problem.scale, s.sq, s.sk);
        rows_i32(s.total_q.max(s.total_k), "total rows")?;
        if let Some(d) = &problem.dropout {
            params.drop_threshold = philox::drop_threshold(d.p);
            params.rp_keep = philox::keep_scale(d.p);
            (params.seed_lo, params.seed_hi) = (d.seed as u32, (d.seed >> 32) as u32);
            (params.offset_lo, params.offset_hi) = (d.offset as u32, (d.offset >> 32) as u32);
        }
        Ok(params)
    }
}

impl AttnParams {
    /// Whether the scores are capped or biased, or a block mask applies (the pointers are set
    /// at launch, the block sizes with the rest of the problem).
    fn has_mods(&self) -> bool {
        self.softcap_pre != 0.0 || self.alibi_slopes != 0 || self.block_q != 0
    }

    /// `_mods` for a problem with a softcap, ALiBi slopes or a block mask: the wgmma kernels
    /// have variants compiled with that code and variants without it (which spilled with it).
    fn mods_suffix(&self) -> &'static str {
        if self.block_q != 0 {
            "_sparse"
        } else if self.has_mods() {
            "_mods"
        } else {
            ""
        }
    }

    /// The scale, window, softcap and ALiBi fields (the slopes' pointer is set at launch, see
    /// [`alibi_view`]) for sequences of at most `sq` queries and `sk` keys.
    fn set_mods(&mut self, mods: &ScoreMods, scale: f32, sq: usize, sk: usize) {
        // The kernels compare the window against row + (sk - sq) + window in i32: a side that
        // reaches past every row's keys is unbounded (-1), so no sum overflows. A side at or
        // past a sequence's key count is unbounded by FlashAttention 2's rule (the kernels'
        // Mask applies it per sequence), one at or past its query count by the formula.
        let side = |w: Option<usize>, bound: usize| match w {
            Some(w) if w < bound => w as i32,
            _ => -1,
        };
        self.window_left = side(mods.left, sk);
        self.window_right = side(mods.right, sq.min(sk));
        // Under a softcap the kernels keep S = tanh(scale q.k / c) and exponentiate c S: the
        // softmax's scale becomes the cap, the gradient's stays the softmax scale.
        self.grad_scale = scale;
        self.scale = match mods.softcap {
            Some(c) => {
                self.softcap_pre = scale / c;
                c
            }
            None => scale,
        };
        self.scale_log2 = self.scale * std::f32::consts::LOG2_E;
        if mods.softcap.is_some() && mods.alibi.is_none() {
            self.softcap_max_log2 = softcap_max_log2(self.scale_log2);
        }
        if let Some(a) = &mods.alibi {
            self.alibi_scale = 1.0 / self.scale;
            self.alibi_batch_stride = if a.per_batch { self.h } else { 0 };
        }
        if let Some(m) = &mods.sparse {
            // Checked against the call (BlockMask::check): (1 or h, rows, cols) blocks cover
            // (sq, sk) in blocks of at least 64, so every value fits in i32 but the head
            // strides of the element mask.
            let (heads, rows, cols) = m.states().dims3().unwrap_or((1, 0, 0));
            let (bq, bk) = m.block_size();
            (self.block_q, self.block_k) = (bq as i32, bk as i32);
            (self.block_cols, self.block_rows) = (cols as i32, rows as i32);
            (self.block_q_div, self.block_k_div) = (FastDiv::new(bq), FastDiv::new(bk));
            self.block_head_stride = if heads == 1 { 0 } else { (rows * cols) as i64 };
            if let Some(d) = m.dense() {
                let (_, dq, dk) = d.dims3().unwrap_or((1, 0, 0));
                self.dense_row_stride = dk as i64;
                self.dense_head_stride = if heads == 1 { 0 } else { (dq * dk) as i64 };
            }
        }
    }
}

/// The fixed row max (log2 units) for scores capped at `cap_log2` = cap x log2(e), or 0 where
/// there is none: P = exp2(x - m) for x in [-cap_log2, cap_log2] must stay within
/// [2^-100, 2^64], normal in bf16 and f32 with room below (products with V stay normal) and
/// above (sums over 2^20 keys of P V stay finite for |V| < 2^44). m = cap_log2 (P <= 1) for
/// caps up to 50 log2 units, else 100 - cap_log2, up to 82 (a cap of 56.8; Gemma 2's 50 is
/// 72.1). ALiBi's bias is not capped, so it has none.
fn softcap_max_log2(cap_log2: f32) -> f32 {
    const LOWEST: f32 = -100.0;
    const HIGHEST: f32 = 64.0;
    let m = cap_log2.min(-LOWEST - cap_log2);
    if cap_log2 - m <= HIGHEST {
        m
    } else {
        0.0
    }
}

/// Read-locks a tensor the kernels read besides the inputs, for [`locked_ptr`].
fn lock_tensor(
    t: Option<&Tensor>,
) -> Option<(impl std::ops::Deref<Target = candle::Storage> + '_, &Layout)> {
    t.map(|t| t.storage_and_layout())
}

/// The device address of a tensor locked by [`lock_tensor`] (0 for none) and the stream
/// ordering of that read, kept until the launches are queued. `name` is the option's.
fn locked_ptr<'a, T: CudaDType + 'static, G: std::ops::Deref<Target = candle::Storage>>(
    guard: &'a Option<(G, &Layout)>,
    stream: &'a CudaStream,
    name: &str,
) -> Result<(CUdeviceptr, Option<SyncOnDrop<'a>>)> {
    let Some((storage, layout)) = guard else {
        return Ok((0, None));
    };
    let candle::Storage::Cuda(cs) = &**storage else {
        bail!("{name}: expected a CUDA tensor (the inputs' device)")
    };
    let view = cs.as_cuda_slice::<T>()?.slice(layout.start_offset()..);
    let (ptr, sync) = view.view_ptr(stream);
    Ok((ptr, Some(sync)))
}

/// The block mask's states, element mask and skip tables, locked while the kernels that read
/// them are queued; see [`sparse_ptrs`].
type SparseLocks<'a, G> = [Option<(G, &'a Layout)>; 5];

fn lock_sparse(
    mods: &ScoreMods,
) -> SparseLocks<'_, impl std::ops::Deref<Target = candle::Storage> + '_> {
    let m = mods.sparse.as_ref();
    [
        lock_tensor(m.map(crate::BlockMask::states)),
        lock_tensor(m.and_then(crate::BlockMask::dense)),
        lock_tensor(m.and_then(|m| m.skips()).map(|s| s.0)),
        lock_tensor(m.and_then(|m| m.skips()).map(|s| s.1)),
        lock_tensor(m.and_then(|m| m.skips()).map(|s| s.2)),
    ]
}

/// Sets the block mask's pointers from [`lock_sparse`]'s locks; the syncs returned are kept
/// until the launches are queued. Also returns the `next_col` skip table, which only the
/// deterministic warp-specialized backward reads (`BwdTmaParams::block_next_col`, kept out
/// of `AttnParams`: a field there cost the d 128 `_sparse` backward 12 bytes of spill).
fn sparse_ptrs<'a, G: std::ops::Deref<Target = candle::Storage>>(
    params: &mut AttnParams,
    locks: &'a SparseLocks<'a, G>,
    stream: &'a CudaStream,
) -> Result<([Option<SyncOnDrop<'a>>; 5], CUdeviceptr)> {
    let (blocks, blocks_sync) = locked_ptr::<u8, G>(&locks[0], stream, "block_mask")?;
    let (dense, dense_sync) = locked_ptr::<u8, G>(&locks[1], stream, "block_mask")?;
    let (prev, prev_sync) = locked_ptr::<u32, G>(&locks[2], stream, "block_mask")?;
    let (next, next_sync) = locked_ptr::<u32, G>(&locks[3], stream, "block_mask")?;
    let (next_col, next_col_sync) = locked_ptr::<u32, G>(&locks[4], stream, "block_mask")?;
    (params.block_mask, params.block_dense) = (blocks, dense);
    if blocks != 0 && (prev == 0 || next == 0 || next_col == 0) {
        bail!("block_mask: has no skip tables (it was not made on a CUDA device)")
    }
    (params.block_prev_col, params.block_next_row) = (prev, next);
    let syncs = [blocks_sync, dense_sync, prev_sync, next_sync, next_col_sync];
    Ok((syncs, next_col))
}

/// Read-locks the ALiBi slopes of `mods`, if any, for [`locked_ptr`].
fn lock_slopes(
    mods: &ScoreMods,
) -> Option<(impl std::ops::Deref<Target = candle::Storage> + '_, &Layout)> {
    lock_tensor(mods.alibi.as_ref().map(|a| &a.slopes))
}

/// `xs` on the device as the i32 the kernels read (offsets, lengths, block tables).
fn to_device_i32(dev: &candle::CudaDevice, xs: &[u32]) -> Result<CudaSlice<i32>> {
    let xs: Vec<i32> = xs.iter().map(|&x| x as i32).collect();
    dev.clone_htod(&xs)
}

/// Where a stream's work is ordered: `(device ordinal, stream handle, host thread)`. Candle's
/// devices run on the per-thread default stream, whose one handle (0x2) names a different
/// stream in every host thread, and cudarc does no cross-stream tracking for it: work of two
/// threads runs concurrently, unordered. Device buffers that kernels write (counters), or
/// that a launch may read before an upload lands (shared uploads), are therefore kept per
/// key, and freed only by the thread whose stream they belong to.
pub(crate) type StreamKey = (usize, usize, Option<std::thread::ThreadId>);

/// The [`StreamKey`] of `stream` for the calling thread.
pub(crate) fn stream_key(stream: &CudaStream) -> StreamKey {
    // CU_STREAM_PER_THREAD (cuda.h); the legacy default stream (0x1, or null) is one stream
    // for every thread.
    const PER_THREAD: usize = 0x2;
    let handle = stream.cu_stream() as usize;
    let thread = (handle == PER_THREAD).then(|| std::thread::current().id());
    (stream.context().ordinal(), handle, thread)
}

/// Read-only host arrays uploaded recently (the append's start rows, block tables), per
/// stream. A decoding step sends the same arrays for every layer, and each upload (an
/// allocation and a copy from pageable memory) cost tens of microseconds of host time per
/// launch: at batch 1 on the H100, 0.5 ms per token of a 16-layer model with a contiguous
/// cache and 1.5 ms with a paged one (the table goes to the append and the decode).
static UPLOADS: Mutex<Vec<Upload>> = Mutex::new(Vec::new());
/// One kept upload: its stream, device, host values and device copy.
type Upload = (
    StreamKey,
    candle::cuda_backend::DeviceId,
    Vec<u32>,
    SharedI32,
);
/// A device array that several launches read.
type SharedI32 = Arc<CudaSlice<i32>>;
/// Distinct arrays kept per stream: a step of a batch uses two (start rows, block table); a
/// few more cover several caches or devices used in turn.
const KEPT_UPLOADS: usize = 8;

/// `xs` as i32 on `dev`, reusing an identical upload made on the same stream (so the copy is
/// ordered before every launch that reads it). The kernels only read these buffers; each is
/// freed in its stream's order when evicted (by its own thread) and no longer used.
fn to_device_i32_shared(dev: &candle::CudaDevice, xs: &[u32]) -> Result<SharedI32> {
    let mut kept = UPLOADS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let (key, id) = (stream_key(&dev.cuda_stream()), dev.id());
    let mine = |(k, d, _, _): &Upload| *k == key && *d == id;
    if let Some(i) = kept.iter().position(|e| mine(e) && e.2 == xs) {
        let hit = kept.remove(i);
        let buf = hit.3.clone();
        kept.push(hit);
        return Ok(buf);
    }
    let buf = Arc::new(to_device_i32(dev, xs)?);
    kept.push((key, id, xs.to_vec(), buf.clone()));
    if kept.iter().filter(|e| mine(e)).count() > KEPT_UPLOADS {
        let oldest = kept.iter().position(mine).expect("one was just pushed");
        kept.remove(oldest);
    }
    Ok(buf)
}

/// The device pointer of an optional buffer (0 when absent); the guard that orders the
/// stream's use of it goes to `syncs`, which must outlive the launch.
fn device_ptr_opt<'a>(
    x: Option<&'a CudaSlice<i32>>,
    stream: &'a Arc<CudaStream>,
    syncs: &mut Vec<SyncOnDrop<'a>>,
) -> CUdeviceptr {
    match x {
        Some(x) => {
            let (ptr, sync) = x.device_ptr(stream);
            syncs.push(sync);
            ptr
        }
        None => 0,
    }
}

/// Device copies of a packed batch's cumulative offsets `(cu_q, cu_k)`; `None` for fixed
/// length. Freed in stream order, after the launches that use them.
type SeqOffsets = (Option<CudaSlice<i32>>, Option<CudaSlice<i32>>);

fn seq_offsets(problem: &Problem, dev: &candle::CudaDevice) -> Result<SeqOffsets> {
    Ok(match &problem.varlen {
        Some(o) => (
            Some(to_device_i32(dev, &o.cu_q)?),
            Some(to_device_i32(dev, &o.cu_k)?),
        ),
        None => (None, None),
    })
}

/// Fills the pointers of the packed-batch offsets into `params`.
fn set_seq_offsets<'a>(
    params: &mut AttnParams,
    (cu_q, cu_k): &'a SeqOffsets,
    stream: &'a Arc<CudaStream>,
) -> Vec<SyncOnDrop<'a>> {
    let mut syncs = vec![];
    params.cu_seqlens_q = device_ptr_opt(cu_q.as_ref(), stream, &mut syncs);
    params.cu_seqlens_k = device_ptr_opt(cu_k.as_ref(), stream, &mut syncs);
    syncs
}

/// Forward tile shape for one compiled head dim; mirror of `FwdConfig` in `cuda/sm80/traits.cuh`.
#[derive(Clone, Copy, Debug)]
pub(super) struct FwdTile {
    d: usize,
    bm: usize,
    bn: usize,
    warps: usize,
    /// The 99 KB shape of d >= 192 (`fit`).
    small: bool,
}

impl FwdTile {
    /// This tile, or where it needs more shared memory than `smem` bytes (d >= 192 on a 99 KB
    /// device), the small one: 64 rows, 32-key tiles, 4 warps (`FwdSmallConfig`).
    fn fit(self, smem: usize) -> Self {
        if self.smem_bytes() as usize <= smem || self.d < 192 {
            return self;
        }
        Self {
            bm: 64,
            bn: 32,
            warps: 4,
            small: true,
            ..self
        }
    }

    /// `_s64` for the small tile (the kernel names' suffix), else empty.
    fn suffix(&self) -> &'static str {
        if self.small {
            "_s64"
        } else {
            ""
        }
    }

    /// The smallest compiled head dim >= d (d <= 256 was validated).
    fn for_head_dim(d: usize) -> Self {
        let (d, bm, bn, warps) = match d {
            0..=32 => (32, 128, 64, 4),
            33..=64 => (64, 128, 64, 4),
            65..=96 => (96, 128, 32, 4),
            97..=128 => (128, 128, 32, 4),
            129..=160 => (160, 128, 64, 8),
            161..=192 => (192, 128, 64, 8),
            193..=224 => (224, 128, 64, 8),
            _ => (256, 128, 64, 8),
        };
        Self {
            d,
            bm,
            bn,
            warps,
            small: false,
        }
    }

    fn threads(&self) -> u32 {
        32 * self.warps as u32
    }

    /// Q tile plus one K and one V tile, rows padded by 8 elements (`SMEM_PAD`), 2-byte elements.
    fn smem_bytes(&self) -> u32 {
        ((self.bm + 2 * self.bn) * (self.d + 8) * 2) as u32
    }
}

/// One wgmma forward kernel's block (`cuda/sm90/fwd.cu`, mirror of `Sm90Traits`):
/// warpgroups of 64 query rows and keys per tile, key tiles in two stages.
#[derive(Clone, Copy, Debug)]
struct Sm90Shape {
    groups: usize,
    bn: usize,
}

impl Sm90Shape {
    /// Head dims 64 and 128 (`CANDLE_FLASH_FWD=mma` keeps everything on the mma.sync kernel).
    fn supports(d: usize) -> bool {
        d == 64 || d == 128
    }

    /// The block shape for head dim `d`, `seqlen_q` query rows and the mask. Measured on the
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
    /// `CANDLE_FLASH_SM90_SHAPE=g1|g1n64|g2|g3` forces one (read once; A/B runs; g1 is the
    /// 48-key kernel at d = 128, g1n64 and g3 exist only at d = 64).
    fn choose(d: usize, seqlen_q: usize, causal: bool) -> Self {
        let forced = &overrides::overrides().sm90_shape;
        let (groups, bn) = match (forced.as_str(), d) {
            ("g1n64", 64) => (1, 64),
            ("g1", 128) => (1, 48),
            ("g1", _) => (1, 128),
            ("g2", _) => (2, 128),
            ("g3", 64) => (3, 128),
            (_, 64) if causal && seqlen_q <= 2048 => (1, 64),
            (_, 64) if causal || seqlen_q < 4096 => (1, 128),
            (_, 64) => (3, 128),
            _ if causal && seqlen_q <= 2048 => (1, 48),
            _ => (2, 128),
        };
        Self { groups, bn }
    }

    /// `flash_fwd_sm90_<dtype>_d<D><suffix>` (the entry points in cuda/sm90/fwd.cu).
    fn suffix(&self) -> String {
        match self.groups {
            1 => format!("_g1_n{}", self.bn),
            2 => String::new(),
            g => format!("_g{g}"),
        }
    }

    /// Q tile, two stages of K and V tiles, 1 KB for the swizzle alignment:
    /// `Sm90Traits::SMEM_BYTES`.
    fn smem_bytes(&self, d: usize) -> u32 {
        ((64 * self.groups + 4 * self.bn) * d * 2 + 1024) as u32
    }
}

/// What the launchers ask of a device once: compute capability, SM count and the shared
/// memory a block may opt into.
#[derive(Clone, Copy)]
pub(crate) struct DeviceFacts {
    pub major: i32,
    pub sms: usize,
    /// Bytes of dynamic shared memory one block may use (A100 163 KB, sm_86/89 99 KB, Hopper
    /// 227 KB); `CANDLE_FLASH_SMEM_KB` lowers it, to run another GPU's tile choices.
    pub smem: usize,
}

impl DeviceFacts {
    /// Compute capability 9.x: the wgmma kernels, and programmatic launch, are built for
    /// sm_90a only. False on Hopper too when `CANDLE_FLASH_ARCH=sm80` asks for the sm_80 set.
    pub fn hopper(&self) -> bool {
        self.major == 9
    }
}

/// [`DeviceFacts`] of `dev`, cached per device ordinal. Errors for GPUs older than Ampere,
/// which have no `cp.async` or bf16 tensor cores.
pub(crate) fn device_facts(dev: &candle::CudaDevice) -> Result<DeviceFacts> {
    static KNOWN: Mutex<Vec<(usize, DeviceFacts)>> = Mutex::new(Vec::new());
    let ordinal = dev.cuda_stream().context().ordinal();
    let mut known = KNOWN
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(&(_, facts)) = known.iter().find(|(o, _)| *o == ordinal) {
        return Ok(facts);
    }
    let context = dev.cuda_stream().context().clone();
    let attr = |a| context.attribute(a).w();
    let major = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    if major < 8 {
        bail!(
            "candle-flash: CUDA device {ordinal} has compute capability {major}.{minor}; the \
             CUDA kernels need 8.0 or newer (Ampere, Ada, Hopper). The CPU implementation runs \
             anywhere."
        )
    }
    let forced = overrides::overrides();
    let smem_cap = forced
        .smem_kb
        .map_or(usize::MAX, |kb| kb.saturating_mul(1024));
    let facts = DeviceFacts {
        major: if forced.arch_sm80 { 8 } else { major },
        sms: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as usize,
        smem: (attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?
            as usize)
            .min(smem_cap),
    };
    known.push((ordinal, facts));
    Ok(facts)
}

/// A kernel source file of cuda/, whose PTX exists per architecture set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PtxFile {
    Fwd,
    FwdSm90,
    FwdWs,
    Bwd,
    BwdSm90,
    BwdWs,
    Decode,
    Train,
}

impl PtxFile {
    /// `(sm90a, sm80)` images of the file.
    fn sets(self) -> (ptx::Parts, ptx::Parts) {
        match self {
            Self::Fwd => (ptx::sm90a::SM80_FWD, ptx::sm80::SM80_FWD),
            Self::FwdSm90 => (ptx::sm90a::SM90_FWD, ptx::sm80::SM90_FWD),
            Self::FwdWs => (ptx::sm90a::SM90_FWD_WS, ptx::sm80::SM90_FWD_WS),
            Self::Bwd => (ptx::sm90a::SM80_BWD, ptx::sm80::SM80_BWD),
            Self::BwdSm90 => (ptx::sm90a::SM90_BWD, ptx::sm80::SM90_BWD),
            Self::BwdWs => (ptx::sm90a::SM90_BWD_WS, ptx::sm80::SM90_BWD_WS),
            Self::Decode => (ptx::sm90a::DECODE, ptx::sm80::DECODE),
            Self::Train => (ptx::sm90a::TRAIN, ptx::sm80::TRAIN),
        }
    }
}

/// Loaded kernels per device ordinal, by name: a launch finds its function with one lookup
/// (no module search, no driver call). A kernel name is unique within the set a device runs.
type Functions = HashMap<usize, HashMap<String, CudaFunction>>;
/// Loaded modules, per (device ordinal, file, set, dtype part): loading one (and, for PTX,
/// the driver's JIT) happens once per process. A module holds its context, so its handles
/// stay valid.
type Modules = Vec<(
    (usize, PtxFile, &'static str, &'static str),
    Arc<CudaModule>,
)>;

/// `kernel` of `file`, from the set the device runs: sm_90a on Hopper (where the file has
/// Hopper code; the sm80 image otherwise), sm_80 on Ampere, Ada and newer (and on Hopper
/// under `CANDLE_FLASH_ARCH=sm80`).
pub(crate) fn load_func(
    dev: &candle::CudaDevice,
    kernel: &str,
    file: PtxFile,
) -> Result<CudaFunction> {
    static FUNCTIONS: Mutex<Option<Functions>> = Mutex::new(None);
    static MODULES: Mutex<Modules> = Mutex::new(Vec::new());
    let context = dev.cuda_stream().context().clone();
    let ordinal = context.ordinal();
    let mut functions = FUNCTIONS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let per_device = functions
        .get_or_insert_with(HashMap::new)
        .entry(ordinal)
        .or_default();
    if let Some(func) = per_device.get(kernel) {
        return Ok(func.clone());
    }
    let facts = device_facts(dev)?;
    let (hopper_parts, generic_parts) = file.sets();
    let (hopper_image, hopper_part) = hopper_parts.for_kernel(kernel);
    let (generic_image, generic_part) = generic_parts.for_kernel(kernel);
    let (set, part, image) = match (facts.hopper(), hopper_image, generic_image) {
        (true, Some(i), _) => ("sm90a", hopper_part, i),
        (_, _, Some(i)) => ("sm80", generic_part, i),
        _ => bail!(
            "{kernel}: this build of candle-flash has no {file:?} kernels for compute \
             capability {}.x (it was built for other GPUs: see CANDLE_FLASH_SASS / \
             CUDA_COMPUTE_CAP in the README)",
            facts.major
        ),
    };
    let key = (ordinal, file, set, part);
    let module = {
        let mut modules = MODULES
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        match modules.iter().find(|(k, _)| *k == key) {
            Some((_, m)) => m.clone(),
            None => {
                let source = match image {
                    ptx::Image::Ptx(text) => Ptx::from_src(text),
                    ptx::Image::Fatbin(bytes) => Ptx::from_binary(bytes.to_vec()),
                };
                let module = context.load_module(source).w()?;
                modules.push((key, module.clone()));
                module
            }
        }
    };
    let func = module.load_function(kernel).w()?;
    per_device.insert(kernel.to_string(), func.clone());
    Ok(func)
}

/// Counters that kernels keep zero between launches (they reset them themselves, so a call
/// needs no memset of its own), kept per stream ([`StreamKey`]: per host thread on Candle's
/// per-thread default stream) and grown on demand, so that launches that may overlap never
/// share counters. Four threads sharing one set raced in split-KV decoding (a merge ran
/// before its splits arrived; seen under compute-sanitizer's racecheck, which slows kernels).
/// Entries live until exit (a few bytes per thread that decoded). Hold the cache's lock until
/// the launch is queued: another call on the stream must not grow (and free) them between.
pub(crate) type StreamCounters = Vec<(StreamKey, CudaSlice<u32>)>;

/// The zeroed counters for `dev`'s stream, at least `n` of them.
pub(crate) fn stream_counters<'a>(
    cache: &'a mut StreamCounters,
    dev: &candle::CudaDevice,
    n: usize,
) -> Result<&'a mut CudaSlice<u32>> {
    let key = stream_key(&dev.cuda_stream());
    let i = match cache.iter().position(|(k, _)| *k == key) {
        Some(i) => i,
        None => {
            cache.push((key, dev.alloc_zeros::<u32>(n.next_power_of_two())?));
            cache.len() - 1
        }
    };
    if cache[i].1.len() < n {
        // The old slice is freed in stream order, after the launches that used it.
        cache[i].1 = dev.alloc_zeros::<u32>(n.next_power_of_two())?;
    }
    Ok(&mut cache[i].1)
}

/// Whether the forward runs the wgmma kernel: on compute capability 9.x, unless
/// `CANDLE_FLASH_FWD=mma` asks for the mma.sync kernel (read once; for A/B comparisons).
fn use_sm90(dev: &candle::CudaDevice) -> Result<bool> {
    Ok(forced_fwd() != "mma" && device_facts(dev)?.hopper())
}

/// The warp-specialized kernel (sm90/fwd_ws.cu) on Hopper, unless `CANDLE_FLASH_FWD=sm90`
/// (the wgmma kernel of sm90/fwd.cu) or `mma` asks for another.
fn use_ws(dev: &candle::CudaDevice) -> Result<bool> {
    Ok(!matches!(forced_fwd(), "mma" | "sm90") && device_facts(dev)?.hopper())
}

/// `CANDLE_FLASH_FWD=mma|sm90` forces the mma.sync or the first wgmma forward kernels.
fn forced_fwd() -> &'static str {
    &overrides::overrides().fwd
}

/// Whether outputs are filled with NaN before each launch, so that elements a kernel fails to
/// write show up in tests (`CANDLE_FLASH_POISON=1`).
fn poison_outputs() -> bool {
    overrides::overrides().poison
}

/// Fills a fresh allocation with 0xFF bytes: NaN in f16, bf16 and f32.
pub(crate) fn poison<T: DeviceRepr>(
    stream: &Arc<CudaStream>,
    buf: &mut CudaSlice<T>,
) -> Result<()> {
    if poison_outputs() {
        let bytes = buf.len() * std::mem::size_of::<T>();
        let (ptr, _sync) = buf.device_ptr_mut(stream);
        // SAFETY: ptr is a live allocation of `bytes` bytes, written in stream order.
        unsafe { memset_d8_async(ptr, 0xff, bytes, stream.cu_stream()) }.w()?;
    }
    Ok(())
}

/// Launches `name` from the PTX module of its kernel family (`flash_fwd_*` from fwd.cu,
/// `flash_bwd_*` from bwd.cu) with one parameter block.
fn launch<P: DeviceRepr>(
    dev: &candle::CudaDevice,
    name: &str,
    grid: (usize, usize, usize),
    threads: u32,
    smem: u32,
    params: &P,
) -> Result<()> {
    let Some((func, cfg)) = prepare_launch(dev, name, grid, threads, smem)? else {
        return Ok(());
    };
    let stream = dev.cuda_stream();
    let mut builder = stream.launch_builder(&func);
    builder.arg(params);
    // SAFETY: the parameter block describes live allocations of the sizes the kernel indexes
    // (shapes checked by `params::validate`, buffers allocated by the caller for them).
    unsafe { builder.launch(cfg) }.w()?;
    Ok(())
}

/// [`launch`] with programmatic stream serialization on Hopper: the kernel's blocks may be
/// dispatched while the kernel ahead of it in the stream finishes, so the launch overlaps
/// that tail. Only for kernels that call `pdl_wait` (cuda/common/pdl.cuh) before they touch global
/// memory. A plain [`launch`] elsewhere, or when `CANDLE_FLASH_PDL=0` (read once).
fn launch_programmatic<P: DeviceRepr>(
    dev: &candle::CudaDevice,
    name: &str,
    grid: (usize, usize, usize),
    threads: u32,
    smem: u32,
    params: &P,
) -> Result<()> {
    use candle::cuda_backend::cudarc::driver::sys;
    if overrides::overrides().pdl_off || !device_facts(dev)?.hopper() {
        return launch(dev, name, grid, threads, smem, params);
    }
    let Some((func, cfg)) = prepare_launch(dev, name, grid, threads, smem)? else {
        return Ok(());
    };
    let stream = dev.cuda_stream();
    stream.context().bind_to_thread().w()?;
    // SAFETY: zero is a valid bit pattern for this plain C struct; the id and value are set.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: 1,
    };
    let mut args = [params as *const P as *mut std::ffi::c_void];
    // SAFETY: as in `launch`; `params` outlives the call (the driver copies the parameter
    // block at launch) and the function belongs to the stream's context.
    unsafe {
        sys::cuLaunchKernelEx(
            &config,
            func.cu_function(),
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
    .w()?;
    Ok(())
}

/// The function `name` from the PTX module of its kernel family, its dynamic shared memory
/// allowed, and the launch shape; `None` for an empty grid (nothing to launch).
pub(crate) fn prepare_launch(
    dev: &candle::CudaDevice,
    name: &str,
    (x, y, z): (usize, usize, usize),
    threads: u32,
    smem: u32,
) -> Result<Option<(CudaFunction, LaunchConfig)>> {
    if x > i32::MAX as usize || y > 65535 || z > 65535 {
        bail!(
            "{name}: launch grid ({x}, {y}, {z}) exceeds CUDA's limits (too many heads or batches)"
        )
    }
    if x == 0 || y == 0 || z == 0 {
        return Ok(None);
    }
    let file = if name.starts_with("flash_fwd_sm90") {
        PtxFile::FwdSm90
    } else if name.starts_with("flash_fwd_ws") {
        PtxFile::FwdWs
    } else if name.starts_with("flash_bwd_sm90") {
        PtxFile::BwdSm90
    } else if name.starts_with("flash_bwd_ws") {
        PtxFile::BwdWs
    } else if name.starts_with("flash_fwd") {
        PtxFile::Fwd
    } else if name.starts_with("flash_bwd") {
        PtxFile::Bwd
    } else if name.starts_with("train_") {
        PtxFile::Train
    } else {
        PtxFile::Decode
    };
    let limit = device_facts(dev)?.smem;
    if smem as usize > limit {
        bail!("{name}: needs {smem} bytes of shared memory per block, the device allows {limit}")
    }
    let func = load_func(dev, name, file)?;
    func.set_attribute(
        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        smem as i32,
    )
    .w()?;
    let cfg = LaunchConfig {
        grid_dim: (x as u32, y as u32, z as u32),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem,
    };
    Ok(Some((func, cfg)))
}

fn dtype_name(dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F16 => Ok("f16"),
        DType::BF16 => Ok("bf16"),
        dt => bail!("q: dtype {dt:?} is not supported on CUDA, expected F16 or BF16"),
    }
}

/// `(batch, row, head)` strides of a `(b, s, h, d)` layout, or `(0, row, head)` of a packed
/// `(total, h, d)` one; the last dim is contiguous.
fn strides3(layout: &Layout) -> [i64; 3] {
    match layout.stride() {
        [b, r, h, _] => [*b as i64, *r as i64, *h as i64],
        [r, h, _] => [0, *r as i64, *h as i64],
        other => unreachable!("validated rank 3 or 4 layout, got strides {other:?}"),
    }
}

fn to_i32(x: usize, what: &str) -> Result<i32> {
    match i32::try_from(x) {
        Ok(v) => Ok(v),
        Err(_) => bail!("{what}: {x} is larger than the kernels' 32-bit index range"),
    }
}

/// The most rows (sequence lengths, packed totals, cache capacities) the kernels take: their
/// block arithmetic adds up to a tile past the last row (`stop + BN - 1`, `n0 + BN` in
/// mask.cuh) in 32-bit ints, so lengths stop 1024 short of `i32::MAX`.
const MAX_ROWS: usize = i32::MAX as usize - 1024;

/// A row count for the kernels, checked against [`MAX_ROWS`].
fn rows_i32(x: usize, what: &str) -> Result<i32> {
    if x > MAX_ROWS {
        bail!("{what}: {x} rows are past the kernels' 32-bit range (at most {MAX_ROWS})")
    }
    Ok(x as i32)
}

/// Forward pass: returns `(out, lse)` storages, out `(b, sq, h, d)` contiguous in q's dtype,
/// lse `(b, h, sq)` f32.
pub(crate) fn fwd(
    problem: &Problem,
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
) -> Result<(CudaStorage, CudaStorage)> {
    match q.0.dtype() {
        DType::F16 => fwd_typed::<f16>(problem, q, k, v),
        DType::BF16 => fwd_typed::<bf16>(problem, q, k, v),
        dt => bail!("q: dtype {dt:?} is not supported on CUDA, expected F16 or BF16"),
    }
}

fn fwd_typed<T: CudaDType + DeviceRepr>(
    problem: &Problem,
    (q, ql): (&CudaStorage, &Layout),
    (k, kl): (&CudaStorage, &Layout),
    (v, vl): (&CudaStorage, &Layout),
) -> Result<(CudaStorage, CudaStorage)> {
    let s = problem.shape;
    let dev = q.device.clone();
    let stream = dev.cuda_stream();
    let q_view = q.as_cuda_slice::<T>()?.slice(ql.start_offset()..);
    let k_view = k.as_cuda_slice::<T>()?.slice(kl.start_offset()..);
    let v_view = v.as_cuda_slice::<T>()?.slice(vl.start_offset()..);
    // SAFETY: every element of out and lse is written by the kernel (rows < sq, cols < d).
    let mut out = unsafe { dev.alloc::<T>(s.q_elems())? };
    let mut lse = unsafe { dev.alloc::<f32>(s.h * s.total_q)? };
    poison(&stream, &mut out)?;
    poison(&stream, &mut lse)?;

    let mut params = AttnParams::new(problem, ql, kl, vl)?;
    // Dropout has kernels of its own (its Philox code costs registers in the loop): `_dropout`
    // among the warp-specialized ones, the mma.sync ones otherwise.
    let dropout = params.drop_threshold != 0;
    let tile = FwdTile::for_head_dim(s.d).fit(device_facts(&dev)?.smem);
    let offsets = seq_offsets(problem, &dev)?;
    {
        let _offset_syncs = set_seq_offsets(&mut params, &offsets, &stream);
        let (q_ptr, _q_sync) = q_view.device_ptr(&stream);
        let (k_ptr, _k_sync) = k_view.device_ptr(&stream);
        let (v_ptr, _v_sync) = v_view.device_ptr(&stream);
        let (o_ptr, _o_sync) = out.device_ptr_mut(&stream);
        let (lse_ptr, _lse_sync) = lse.device_ptr_mut(&stream);
        (params.q, params.k, params.v, params.o, params.lse) =
            (q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr);
        let slopes = lock_slopes(&problem.mods);
        let (alibi, _slopes_sync) = locked_ptr::<f32, _>(&slopes, &stream, "alibi_slopes")?;
        params.alibi_slopes = alibi;
        let sparse = lock_sparse(&problem.mods);
        let (_sparse_syncs, _) = sparse_ptrs(&mut params, &sparse, &stream)?;
        let dtype = dtype_name(q.dtype())?;
        // Warp-specialized where TMA can address the tensors (tma::TileSource::encode).
        // Its tile index is a 32-bit int.
        let ws = match tma::WsShape::choose(
            tile.d,
            s.sq,
            s.sk,
            problem.causal,
            params.mods_suffix(),
            problem.varlen.is_some(),
            dropout,
        ) {
            Some(shape)
                if s.sq.div_ceil(shape.bm()) * s.h * s.b <= i32::MAX as usize && use_ws(&dev)? =>
            {
                let packed = problem.varlen.as_ref().map(|_| (s.total_q, s.total_k));
                tma::fwd_params(&params, q.dtype(), &shape, packed).map(|p| (shape, p))
            }
            _ => None,
        };
        if let Some((shape, mut ws_params)) = ws {
            let tiles = s.sq.div_ceil(shape.bm()) * s.h * s.b;
            // Tiles of unequal work (a mask, or packed sequences of different lengths) are
            // handed out from a counter.
            let masked = params.window_left >= 0
                || params.window_right >= 0
                || params.block_q != 0
                || problem.varlen.is_some();
            let (blocks, dynamic) = tma::WsShape::grid(tiles, device_facts(&dev)?.sms, masked);
            // Locked (only for the dynamic schedule) until the launch is queued: see
            // StreamCounters. Only the counter needs the zero it keeps.
            static COUNTERS: Mutex<StreamCounters> = Mutex::new(Vec::new());
            let mut cache = dynamic.then(|| {
                COUNTERS
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
            });
            let slots = shape.tile_slots(blocks);
            let counter = match cache.as_deref_mut() {
                Some(cache) => Some(stream_counters(cache, &dev, slots)?),
                None => None,
            };
            let _counter_sync = counter.map(|c| {
                let (ptr, sync) = c.device_ptr_mut(&stream);
                ws_params.tile_counter = ptr;
                sync
            });
            if dynamic {
                ws_params.tail_heads =
                    Tail::Forward.pairs(s.h * s.b, s.sq.div_ceil(shape.bm()), blocks);
            }
            // Programmatically: its barrier set-up overlaps the last blocks of the kernel
            // before (it waits in `pdl_wait` before touching memory).
            launch_programmatic(
                &dev,
                &shape.kernel(dtype),
                (blocks, 1, 1),
                shape.threads(),
                shape.smem_bytes(),
                &ws_params,
            )?;
        } else if !dropout && Sm90Shape::supports(tile.d) && use_sm90(&dev)? {
            // With a cap or slopes: the two-warpgroup shape, the one compiled with them.
            let (shape, suffix) = if params.has_mods() {
                (
                    Sm90Shape { groups: 2, bn: 128 },
                    params.mods_suffix().to_string(),
                )
            } else {
                let shape = Sm90Shape::choose(tile.d, s.sq, problem.causal);
                (shape, shape.suffix())
            };
            let name = format!("flash_fwd_sm90_{dtype}_d{}{suffix}", tile.d);
            launch(
                &dev,
                &name,
                (s.sq.div_ceil(64 * shape.groups), s.h, s.b),
                128 * shape.groups as u32,
                shape.smem_bytes(tile.d),
                &params,
            )?;
        } else {
            let suffix = if dropout { "_dropout" } else { "" };
            let name = format!("flash_fwd_{dtype}_d{}{}{suffix}", tile.d, tile.suffix());
            let grid = (s.sq.div_ceil(tile.bm), s.h, s.b);
            launch(
                &dev,
                &name,
                grid,
                tile.threads(),
                tile.smem_bytes(),
                &params,
            )?;
        }
    }
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev.clone()),
        CudaStorage::wrap_cuda_slice(lse, dev),
    ))
}
