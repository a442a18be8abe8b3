//! The host-device contract: the `#[repr(C)]` twins of `cuda/common/params.cuh`'s structs
//! and how a problem fills them. Their layout is checked against the C side when the crate
//! compiles (module `abi_layout` below).

use candle::cuda_backend::cudarc::driver::sys::CUdeviceptr;
use candle::cuda_backend::cudarc::driver::DeviceRepr;
use candle::{bail, Layout, Result};

use super::catalogue::Mods;
use crate::params::Problem;
use crate::philox;
use crate::score_mod::ScoreMods;

/// Mirror of `struct AttnParams` in `cuda/common/params.cuh`; same field order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct AttnParams {
    pub(crate) q: CUdeviceptr,
    pub(crate) k: CUdeviceptr,
    pub(crate) v: CUdeviceptr,
    pub(crate) o: CUdeviceptr,
    pub(crate) lse: CUdeviceptr,
    pub(crate) cu_seqlens_q: CUdeviceptr,
    pub(crate) cu_seqlens_k: CUdeviceptr,
    pub(crate) q_batch_stride: i64,
    pub(crate) q_row_stride: i64,
    pub(crate) q_head_stride: i64,
    pub(crate) k_batch_stride: i64,
    pub(crate) k_row_stride: i64,
    pub(crate) k_head_stride: i64,
    pub(crate) v_batch_stride: i64,
    pub(crate) v_row_stride: i64,
    pub(crate) v_head_stride: i64,
    pub(crate) o_batch_stride: i64,
    pub(crate) o_row_stride: i64,
    pub(crate) o_head_stride: i64,
    pub(crate) lse_batch_stride: i64,
    pub(crate) lse_head_stride: i64,
    pub(crate) b: i32,
    pub(crate) h: i32,
    pub(crate) h_k: i32,
    pub(crate) seqlen_q: i32,
    pub(crate) seqlen_k: i32,
    pub(crate) d: i32,
    pub(crate) h_h_k_ratio: i32,
    pub(crate) scale: f32,
    pub(crate) scale_log2: f32,
    pub(crate) window_left: i32,
    pub(crate) window_right: i32,
    pub(crate) softcap_pre: f32,
    pub(crate) softcap_max_log2: f32,
    pub(crate) grad_scale: f32,
    pub(crate) alibi_slopes: CUdeviceptr,
    pub(crate) alibi_batch_stride: i32,
    pub(crate) alibi_scale: f32,
    pub(crate) block_mask: CUdeviceptr,
    pub(crate) block_dense: CUdeviceptr,
    pub(crate) block_prev_col: CUdeviceptr,
    pub(crate) block_next_row: CUdeviceptr,
    pub(crate) block_head_stride: i64,
    pub(crate) dense_head_stride: i64,
    pub(crate) dense_row_stride: i64,
    pub(crate) block_q: i32,
    pub(crate) block_k: i32,
    pub(crate) block_cols: i32,
    pub(crate) block_rows: i32,
    pub(crate) block_q_div: FastDiv,
    pub(crate) block_k_div: FastDiv,
    pub(crate) drop_threshold: u32,
    pub(crate) rp_keep: f32,
    pub(crate) seed_lo: u32,
    pub(crate) seed_hi: u32,
    pub(crate) offset_lo: u32,
    pub(crate) offset_hi: u32,
}

// SAFETY: plain-old-data with the C layout of `AttnParams`, passed by value as a kernel argument.
unsafe impl DeviceRepr for AttnParams {}

/// Mirror of `struct FastDiv` in `cuda/common/params.cuh`: division by a constant the kernels take
/// as a multiply-high and a shift ([`crate::block_sparse::fast_div`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct FastDiv {
    pub(crate) mul: u32,
    pub(crate) shift: i32,
}

impl FastDiv {
    pub(crate) fn new(d: usize) -> Self {
        let (mul, shift) = crate::block_sparse::fast_div(d as u32);
        Self { mul, shift }
    }
}

/// Mirror of `struct BwdParams` in `cuda/common/params.cuh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct BwdParams {
    pub(crate) a: AttnParams,
    pub(crate) dout: CUdeviceptr,
    pub(crate) dsum: CUdeviceptr,
    pub(crate) dq: CUdeviceptr,
    pub(crate) dk: CUdeviceptr,
    pub(crate) dv: CUdeviceptr,
    pub(crate) dk_batch_stride: i64,
    pub(crate) dk_row_stride: i64,
    pub(crate) dk_head_stride: i64,
    pub(crate) dq_accum: CUdeviceptr,
    pub(crate) dq_accum_len: i64,
    pub(crate) dq_tile_rows: i64,
}

// SAFETY: as for `AttnParams`.
unsafe impl DeviceRepr for BwdParams {}

/// The host-device contract, checked when the crate compiles: every `#[repr(C)]` struct under
/// `src/cuda` (here and in `decode`, `tma`, `bwd_ws`) is the twin of the C struct of the same
/// name under `cuda/`, the source of truth, and where the two differ the build fails naming
/// the struct and the field.
/// - build/abi_layout.rs reads each C struct's fields from its definition (so C's field
///   list is parsed, not restated) and has nvcc compile a probe to PTX that records the
///   struct's `sizeof` and `alignof` and each field's `offsetof` and `sizeof` as the device
///   compiler lays them out (build machine only: no GPU, nothing run).
/// - The generated `OUT_DIR/abi_layout.rs` asserts in `const` items the Rust struct's size
///   and alignment and, per C field, its offset, size and type (the C type mapped to Rust:
///   any pointer is a `CUdeviceptr`), then destructures the struct with exactly C's fields
///   and no `..`: a field on one side only fails to compile, even one in tail padding.
///
/// The twins' fields are visible in `crate::cuda` and below (`pub(super)` or wider), where
/// this module is.
mod abi_layout {
    include!(concat!(env!("OUT_DIR"), "/abi_layout.rs"));
}

impl AttnParams {
    /// Sizes, strides, scale, mask and dropout of a problem; pointers are filled in by the
    /// launchers. The output (and dO, dQ) are contiguous, like q without its strides.
    pub(crate) fn new(problem: &Problem, ql: &Layout, kl: &Layout, vl: &Layout) -> Result<Self> {
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

/// The score modifiers a kernel must be compiled with for `mods`: the block mask (with the
/// softcap and ALiBi code), else the softcap and ALiBi; the kernels without them keep their
/// registers. From the problem, not the parameter block, whose ALiBi pointer is set only
/// when the launch locks the slopes.
pub(crate) fn mods_level(mods: &ScoreMods) -> Mods {
    if mods.sparse.is_some() {
        Mods::Sparse
    } else if mods.softcap.is_some() || mods.alibi.is_some() {
        Mods::Scores
    } else {
        Mods::None
    }
}

impl AttnParams {
    /// The scale, window, softcap and ALiBi fields (the slopes' pointer is set at launch, see
    /// `buffers::lock_slopes`) for sequences of at most `sq` queries and `sk` keys.
    pub(crate) fn set_mods(&mut self, mods: &ScoreMods, scale: f32, sq: usize, sk: usize) {
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

/// `(batch, row, head)` strides of a `(b, s, h, d)` layout, or `(0, row, head)` of a packed
/// `(total, h, d)` one; the last dim is contiguous.
pub(crate) fn strides3(layout: &Layout) -> [i64; 3] {
    match layout.stride() {
        [b, r, h, _] => [*b as i64, *r as i64, *h as i64],
        [r, h, _] => [0, *r as i64, *h as i64],
        other => unreachable!("validated rank 3 or 4 layout, got strides {other:?}"),
    }
}

pub(crate) fn to_i32(x: usize, what: &str) -> Result<i32> {
    match i32::try_from(x) {
        Ok(v) => Ok(v),
        Err(_) => bail!("{what}: {x} is larger than the kernels' 32-bit index range"),
    }
}

/// The most rows (sequence lengths, packed totals, cache capacities) the kernels take: their
/// block arithmetic adds up to a tile past the last row (`stop + BN - 1`, `n0 + BN` in
/// common/mask/visibility.cuh) in 32-bit ints, so lengths stop 1024 short of `i32::MAX`.
pub(crate) const MAX_ROWS: usize = i32::MAX as usize - 1024;

/// A row count for the kernels, checked against [`MAX_ROWS`].
pub(crate) fn rows_i32(x: usize, what: &str) -> Result<i32> {
    if x > MAX_ROWS {
        bail!("{what}: {x} rows are past the kernels' 32-bit range (at most {MAX_ROWS})")
    }
    Ok(x as i32)
}
