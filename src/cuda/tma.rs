//! The warp-specialized Hopper kernels' tensor maps (TMA copies), the forward's parameter
//! block and its grid (`cuda/sm90/fwd_ws.cu`).

use candle::cuda_backend::cudarc::driver::sys;
use candle::cuda_backend::cudarc::driver::DeviceRepr;
use candle::DType;

use super::abi::AttnParams;
use super::catalogue::Kernel;
use super::overrides::overrides;

/// Mirror of `struct TmaDesc` in `cuda/sm90/tma.cuh`: an encoded `CUtensorMap`, 64-byte aligned as
/// the TMA unit requires (cudarc's own type is 128-byte aligned under CUDA 13; the bytes are
/// the same).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct TmaDesc {
    pub(super) opaque: [u64; 16],
}

/// Mirror of `struct FwdTmaParams` in `cuda/sm90/fwd_ws.cu`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(super) struct FwdTmaParams {
    pub q: TmaDesc,
    pub k: TmaDesc,
    pub v: TmaDesc,
    /// O, stored by TMA from shared memory where the kernel stages it (`WsTraits::O_STAGED`).
    pub o: TmaDesc,
    pub a: AttnParams,
    /// Dynamic schedule: the tile counter (zero, kept zero by the kernel) followed by 16 bytes
    /// per block that carry the next tile's index to shared memory; null for the static walk.
    pub tile_counter: sys::CUdeviceptr,
    /// Under the dynamic schedule, the (sequence, head) pairs at the end of the walk whose
    /// query blocks go heaviest first across all of them (`longest_first_tail`); 0: none.
    pub tail_heads: i32,
    /// The FP8 kernels' dequantization factors (f32; null for the others) and their element
    /// strides over (sequence, head, block of 128 rows): `Fp8Descales::strides`.
    pub q_descale: sys::CUdeviceptr,
    pub k_descale: sys::CUdeviceptr,
    pub v_descale: sys::CUdeviceptr,
    pub q_descale_strides: [i32; 3],
    pub k_descale_strides: [i32; 3],
    pub v_descale_strides: [i32; 3],
}

// SAFETY: plain-old-data with the C layout of `FwdTmaParams`, passed by value as a kernel
// argument (__grid_constant__).
unsafe impl DeviceRepr for FwdTmaParams {}

/// A (batch, rows, heads, head_dim) tensor as TMA sees it: element strides of a row, a head
/// and a batch (the head dim is contiguous).
pub(super) struct TileSource {
    pub ptr: sys::CUdeviceptr,
    pub dtype: DType,
    pub b: usize,
    pub rows: usize,
    pub heads: usize,
    pub d: usize,
    pub strides: [i64; 3],
}

impl TileSource {
    /// A tensor map copying boxes of 128 bytes (64 16-bit or 128 8-bit columns) x `box_rows`
    /// rows of one head into 128-byte swizzled panels, zero past the tensor's extent. `None` where TMA cannot address the
    /// tensor (a base or stride not a multiple of 16 bytes, broadcast strides): the caller
    /// then runs a kernel that copies with per-thread loads.
    pub fn encode(&self, box_rows: usize) -> Option<TmaDesc> {
        let elem = elem_bytes(self.dtype)?;
        let dims = [self.d, self.rows, self.heads, self.b];
        encode_4d(
            self.ptr,
            self.dtype,
            dims,
            self.strides,
            [128 / elem as u32, box_rows as u32],
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
        )
    }
}

/// V given transposed (`FlashAttn::fp8_v_transposed`): `(batch, heads_k, head_dim, keys)`,
/// e4m3, keys contiguous, at the parameter block's `v`.
pub(super) struct TransposedV {
    /// Stored keys: seqlen_k rounded up to 16.
    pub keys: usize,
    /// Element strides of a head-dim row, a head and a batch.
    pub strides: [i64; 3],
}

impl TransposedV {
    /// A tensor map over `a`'s V (`b` batches) copying boxes of `panel_keys` keys (64 or 32)
    /// x d rows, swizzled at that width (the layout `load_vt_tile` in cuda/sm90/tma.cuh
    /// reads); `None` where TMA cannot address the tensor. Every stored key is in the map,
    /// padding included: the keys of each 16 are permuted, so the last 16 mix keys before
    /// and past seqlen_k (the padding is zeros).
    fn encode(&self, a: &AttnParams, b: usize, panel_keys: u32) -> Option<TmaDesc> {
        use sys::CUtensorMapSwizzle as Swizzle;
        let swizzle = match panel_keys {
            64 => Swizzle::CU_TENSOR_MAP_SWIZZLE_64B,
            32 => Swizzle::CU_TENSOR_MAP_SWIZZLE_32B,
            _ => return None,
        };
        encode_4d(
            a.v,
            DType::F8E4M3,
            [self.keys, a.d as usize, a.h_k as usize, b],
            self.strides,
            [panel_keys, a.d as u32],
            swizzle,
        )
    }
}

fn elem_bytes(dtype: DType) -> Option<u64> {
    match dtype {
        DType::F16 | DType::BF16 => Some(2),
        DType::F8E4M3 => Some(1),
        _ => None,
    }
}

/// A rank-4 tensor map of `dtype` at `ptr`: extents `dims` (innermost first, contiguous),
/// element strides of dims 1-3, a box of `boxes` over dims 0-1 (one element of dims 2-3),
/// zero fill past the extents. `None` where TMA cannot address it (a base or stride not a
/// multiple of 16 bytes, broadcast strides, a box past the limits).
fn encode_4d(
    ptr: sys::CUdeviceptr,
    dtype: DType,
    dims: [usize; 4],
    strides: [i64; 3],
    boxes: [u32; 2],
    swizzle: sys::CUtensorMapSwizzle,
) -> Option<TmaDesc> {
    use sys::{
        CUtensorMapDataType as Ty, CUtensorMapFloatOOBfill as Fill,
        CUtensorMapInterleave as Interleave, CUtensorMapL2promotion as L2,
    };
    let ty = match dtype {
        DType::F16 => Ty::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        DType::BF16 => Ty::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        DType::F8E4M3 => Ty::CU_TENSOR_MAP_DATA_TYPE_UINT8,
        _ => return None,
    };
    let elem = elem_bytes(dtype)?;
    let dims = dims.map(|x| x as u64);
    // A dimension of extent 1 is never stepped over; give it a stride TMA accepts.
    let mut byte_strides = [0u64; 3];
    for (i, &s) in strides.iter().enumerate() {
        let bytes = (s.max(0) as u64) * elem;
        byte_strides[i] = if dims[i + 1] == 1 { 16 } else { bytes };
    }
    if !ptr.is_multiple_of(16)
        || byte_strides
            .iter()
            .any(|&s| s == 0 || !s.is_multiple_of(16) || s >= 1 << 40)
        || boxes.iter().any(|&b| b == 0 || b > 256)
    {
        return None;
    }
    let boxes = [boxes[0], boxes[1], 1, 1];
    let unit = [1u32; 4];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::uninit();
    // SAFETY: the arrays have the rank's lengths (4 dims, 3 strides past the first, 4 box
    // extents and element strides); the map is written by the call and read only on
    // success. Encoding touches no device memory: `ptr` is stored, not dereferenced.
    let result = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            ty,
            4,
            ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            byte_strides.as_ptr(),
            boxes.as_ptr(),
            unit.as_ptr(),
            Interleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            swizzle,
            L2::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            Fill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if result != sys::CUresult::CUDA_SUCCESS {
        return None;
    }
    // SAFETY: initialised by the successful call above.
    let map = unsafe { map.assume_init() };
    Some(TmaDesc { opaque: map.opaque })
}

/// Blocks to launch for `tiles` work tiles (query blocks x heads x batch) of the
/// warp-specialized forward: one per SM, each taking tile after tile, so that a tile's loads
/// overlap the last one's epilogue; `dynamic` when tiles differ in work (a mask), which a
/// static walk would leave unequal across SMs (causal: up to the whole key range against one
/// tile), so blocks take their next tile from a counter. `CANDLE_FLASH_WS_PERSISTENT=0`
/// launches one block per tile instead (A/B runs). Returns (blocks, dynamic).
pub(super) fn ws_grid(tiles: usize, sms: usize, masked: bool) -> (usize, bool) {
    if overrides().ws_persistent_off || tiles <= sms {
        (tiles, false)
    } else {
        (sms, masked)
    }
}

/// Length in u32 of the dynamic schedule's buffer (`FwdTmaParams::tile_counter`) for
/// `blocks` blocks of `kernel`: the counter and padding to 16 bytes, then 16 bytes per block
/// and Q slot (the tile index the producer hands its consumers).
pub(super) fn tile_slots(kernel: Kernel, blocks: usize) -> usize {
    4 + 4 * kernel.geometry().q_stages as usize * blocks
}

/// The batches and rows the Hopper kernels' tensor maps span, `(batch, rows of q, rows of k)`:
/// fixed length `(b, seqlen_q, seqlen_k)`; packed batches (`packed`: total query and key rows)
/// one tensor of every sequence's rows, batch 1 (the kernels add each sequence's first row:
/// `tma_seq` in cuda/common/seq_info.cuh).
pub(super) fn extents(a: &AttnParams, packed: Option<(usize, usize)>) -> (usize, usize, usize) {
    match packed {
        Some((total_q, total_k)) => (1, total_q, total_k),
        None => (a.b as usize, a.seqlen_q as usize, a.seqlen_k as usize),
    }
}

/// The parameter block of the warp-specialized forward `kernel` for `a` (pointers and
/// strides set), or `None` where TMA cannot address q, k or v; `packed` as in [`extents`].
/// q, k and v are `dtype`, O `out_dtype` (the same but for the FP8 kernels).
/// `v_transposed`: V given transposed (the FP8 `_vt` kernels).
pub(super) fn fwd_params(
    a: &AttnParams,
    dtype: DType,
    out_dtype: DType,
    kernel: Kernel,
    packed: Option<(usize, usize)>,
    v_transposed: Option<TransposedV>,
) -> Option<FwdTmaParams> {
    let g = kernel.geometry();
    let (bm, bn) = (g.bm as usize, g.bn as usize);
    let (b, rows_q, rows_k) = extents(a, packed);
    let source = |ptr, dtype, rows: usize, heads: i32, [batch, row, head]: [i64; 3]| TileSource {
        ptr,
        dtype,
        b,
        rows,
        heads: heads as usize,
        d: a.d as usize,
        strides: [row, head, batch],
    };
    let q = [a.q_batch_stride, a.q_row_stride, a.q_head_stride];
    let k = [a.k_batch_stride, a.k_row_stride, a.k_head_stride];
    let v = [a.v_batch_stride, a.v_row_stride, a.v_head_stride];
    let o = [a.o_batch_stride, a.o_row_stride, a.o_head_stride];
    Some(FwdTmaParams {
        q: source(a.q, dtype, rows_q, a.h, q).encode(bm)?,
        k: source(a.k, dtype, rows_k, a.h_k, k).encode(bn)?,
        v: match v_transposed {
            None => source(a.v, dtype, rows_k, a.h_k, v).encode(bn)?,
            Some(t) => t.encode(a, b, g.vt_panel_keys)?,
        },
        // Each consumer warpgroup stores its own 64 rows.
        o: source(a.o, out_dtype, rows_q, a.h, o).encode(64)?,
        a: *a,
        tile_counter: 0,
        tail_heads: 0,
        q_descale: 0,
        k_descale: 0,
        v_descale: 0,
        q_descale_strides: [0; 3],
        k_descale_strides: [0; 3],
        v_descale_strides: [0; 3],
    })
}
