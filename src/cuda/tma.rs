//! The warp-specialized Hopper forward (`cuda/sm90/fwd_ws.cu`): tensor maps for its TMA
//! copies, its parameter block and its tile shapes.

use candle::cuda_backend::cudarc::driver::sys;
use candle::cuda_backend::cudarc::driver::DeviceRepr;
use candle::DType;

use super::overrides::overrides;
use super::AttnParams;

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
    /// O, stored by TMA from shared memory where the kernel stages it (`WsShape::o_staged`).
    pub o: TmaDesc,
    pub a: AttnParams,
    /// Dynamic schedule: the tile counter (zero, kept zero by the kernel) followed by 16 bytes
    /// per block that carry the next tile's index to shared memory; null for the static walk.
    pub tile_counter: sys::CUdeviceptr,
    /// Under the dynamic schedule, the (sequence, head) pairs at the end of the walk whose
    /// query blocks go heaviest first across all of them (`longest_first_tail`); 0: none.
    pub tail_heads: i32,
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
    /// A tensor map copying boxes of 64 columns x `box_rows` rows of one head into 128-byte
    /// swizzled panels, zero past the tensor's extent. `None` where TMA cannot address the
    /// tensor (a base or stride not a multiple of 16 bytes, broadcast strides): the caller
    /// then runs a kernel that copies with per-thread loads.
    pub fn encode(&self, box_rows: usize) -> Option<TmaDesc> {
        use sys::{
            CUtensorMapDataType as Ty, CUtensorMapFloatOOBfill as Fill,
            CUtensorMapInterleave as Interleave, CUtensorMapL2promotion as L2,
            CUtensorMapSwizzle as Swizzle,
        };
        let ty = match self.dtype {
            DType::F16 => Ty::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
            DType::BF16 => Ty::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            _ => return None,
        };
        let dims = [self.d, self.rows, self.heads, self.b].map(|x| x as u64);
        // A dimension of extent 1 is never stepped over; give it a stride TMA accepts.
        let mut strides = [0u64; 3];
        for (i, &s) in self.strides.iter().enumerate() {
            let bytes = (s.max(0) as u64) * 2;
            strides[i] = if dims[i + 1] == 1 { 16 } else { bytes };
        }
        if !self.ptr.is_multiple_of(16)
            || strides
                .iter()
                .any(|&s| s == 0 || !s.is_multiple_of(16) || s >= 1 << 40)
        {
            return None;
        }
        let boxes = [64u32, box_rows as u32, 1, 1];
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
                self.ptr as *mut std::ffi::c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                unit.as_ptr(),
                Interleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                Swizzle::CU_TENSOR_MAP_SWIZZLE_128B,
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
}

/// The head dim of the warp-specialized kernels (forward and backward) that run padded head
/// dim `d`, if one does: the classes between the compiled ones (96: 65-96; 160, 192 and 224:
/// 129-224) run the next one up, their columns past the head dim zero (TMA's fill), as 97-127
/// and 225-255 do in theirs. At 129-192 the d = 256 kernels, a quarter to half of their
/// matmul work on zero columns, still ran 1.56-2.23x the older kernels forward and
/// 1.43-2.65x backward (H100; docs/archive/PERF.md, "Head dims 129-192 on the d 256
/// kernels"); `CANDLE_FLASH_WS_WIDE=0` (read once) sends those head dims back to the older
/// kernels (A/B runs).
pub(super) fn ws_head_dim(d: usize) -> Option<usize> {
    match d {
        64 | 128 | 256 => Some(d),
        96 => Some(128),
        224 => Some(256),
        160 | 192 if !overrides().ws_wide_off => Some(256),
        _ => None,
    }
}

/// Whether packed batches may take the `_packed` warp-specialized kernels (forward and
/// backward): `CANDLE_FLASH_WS_PACKED=0` sends them to the older kernels (A/B runs; the two
/// measured in docs/archive/PERF.md, "Packed batches on the warp-specialized kernels").
fn packed_kernels() -> bool {
    !overrides().ws_packed_off
}

/// Whether dropout may take the `_dropout` warp-specialized kernels (forward and backward):
/// `CANDLE_FLASH_WS_DROPOUT=0` sends it to the older kernels (A/B runs; the two measured in
/// docs/archive/PERF.md, "Against the older kernels and PyTorch").
fn dropout_kernels() -> bool {
    !overrides().ws_dropout_off
}

/// The part of a warp-specialized entry point's name (forward and backward) that names its
/// features: `mods` (`AttnParams::mods_suffix`: `_mods`, `_sparse` or empty) for fixed-length
/// batches without dropout, else `_packed`, `_dropout` or `_packed_dropout`. `None` where no
/// such kernel is compiled (packed batches or dropout with a softcap, ALiBi or block mask) or
/// an A/B switch sends the problem to the older kernels.
pub(super) fn ws_variant(mods: &'static str, packed: bool, dropout: bool) -> Option<&'static str> {
    let off = (packed && !packed_kernels()) || (dropout && !dropout_kernels());
    if off || ((packed || dropout) && !mods.is_empty()) {
        return None;
    }
    Some(match (packed, dropout) {
        (true, true) => "_packed_dropout",
        (true, false) => "_packed",
        (false, true) => "_dropout",
        (false, false) => mods,
    })
}

/// One warp-specialized forward kernel (mirror of `WsTraits`): 64 query rows per consumer
/// warpgroup, `bn` keys per tile, `stages` slots of K and V.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct WsShape {
    pub d: usize,
    pub consumers: usize,
    pub bn: usize,
    pub stages: usize,
    /// The variant's part of the entry point's name after the head dim.
    pub suffix: &'static str,
    /// `_mods` or `_sparse` where the kernel is compiled with the softcap and ALiBi code or
    /// the block mask too (`AttnParams::mods_suffix`), `_packed` for packed batches,
    /// `_dropout` or `_packed_dropout` with dropout, else empty.
    pub mods: &'static str,
}

impl WsShape {
    /// The compiled variants (cuda/sm90/fwd_ws.cu's entry points; `CANDLE_FLASH_WS_SHAPE`
    /// names them): `base` 128 x 128 (d = 256: 128 x 64), `g3` 192 x 128 (three consumer
    /// warpgroups), `n192` 128 x 192, `n176` 128 x 176, `n80` 128 x 80; `mods` selects the
    /// variant's `_mods` / `_sparse` entry point, compiled for one variant per head dim.
    fn compiled(d: usize, variant: &str, mods: &'static str) -> Option<Self> {
        // d = 64 128 x 128 (causal up to 512) has 4 K/V slots (1.015-1.028x over 3 at causal
        // 512 and 1k, H100; docs/archive/PERF.md, "A fourth K/V slot for the d 64 128 x 128
        // kernel"); its `_sparse` kernel keeps 3 (FLASH_FWD_WS_MODS_BOTH).
        let base64_stages = if matches!(mods, "" | "_packed" | "_dropout" | "_packed_dropout") {
            4
        } else {
            3
        };
        let (consumers, bn, stages, suffix) = match (variant, d) {
            ("base", 64) => (2, 128, base64_stages, ""),
            ("base", 128) => (2, 128, 2, ""),
            ("base", 256) => (2, 64, 2, ""),
            ("g3", 64) => (3, 128, 3, "_g3"),
            ("n192", 64) => (2, 192, 2, "_n192"),
            ("n176", 128) => (2, 176, 2, "_n176"),
            ("n80", 256) => (2, 80, 2, "_n80"),
            _ => return None,
        };
        Some(Self {
            d,
            consumers,
            bn,
            stages,
            suffix,
            mods,
        })
    }

    /// The kernel for padded head dim `d`, if there is one (`None`: the older kernels run).
    /// Measured on the H100 (bf16, same-run A/B of every compiled shape; docs/archive/PERF.md,
    /// "the warp-specialized Hopper forward"): d = 64 on three consumer warpgroups (192 x 128:
    /// +10-25% over 128 x 128 from seqlen 512 to 16k without a mask, +0-15% causal from 2k;
    /// causal up to 512 128 x 128, with its work tiles in one stream, is 2% faster: "The
    /// three-warpgroup forward's partial tile, first and light under a causal mask"), d = 128
    /// with 176-key tiles without a mask from 8k keys (+8% at 16k; 128 x 128 was as fast or
    /// faster up to 4k) and 128 with one, d = 256 with 80-key tiles (+0-5%; causal up to 1k
    /// 64-key tiles, 2-8% faster on the H200, where its warpgroups pass over the tiles masked
    /// for them: "d 256 causal up to 1k on 64-key tiles", "Key tiles masked for a whole
    /// warpgroup").
    /// `CANDLE_FLASH_WS_SHAPE=base|g3|n192|n176|n80` forces one of the compiled variants
    /// where it exists (read once; A/B runs).
    ///
    /// With a softcap or ALiBi slopes (`mods` = `_mods`), or a block mask (`_sparse`), the one
    /// variant per head dim compiled with that code: `_mods` d = 64 `g3`, d = 256 `n80`,
    /// the rest `base`. Packed batches (`packed`; `seqlen_q`, `seqlen_k` the longest): the
    /// same choice among the `_packed` kernels (base, d = 64 g3, d = 256 n80), none with mods.
    /// With dropout (`dropout`), fixed-length or packed, without mods: the one variant per head
    /// dim compiled with it (`_dropout`, `_packed_dropout`): base, d = 256 n80, two consumer
    /// warpgroups (the third's 160 registers per thread have no room for the Philox rounds).
    pub fn choose(
        d: usize,
        seqlen_q: usize,
        seqlen_k: usize,
        causal: bool,
        mods: &'static str,
        packed: bool,
        dropout: bool,
    ) -> Option<Self> {
        let forced = &overrides().ws_shape;
        let d = ws_head_dim(d)?;
        let variant_suffix = ws_variant(mods, packed, dropout)?;
        if dropout {
            let variant = if d == 256 { "n80" } else { "base" };
            return Self::compiled(d, variant, variant_suffix);
        }
        // d = 64 causal below 512 rows: the one-warpgroup kernel of sm90/fwd.cu, four blocks
        // per SM (at 512 it ran 190 against 165 TFLOP/s until the 128 x 128 shape ran its work
        // tiles as one stream: 0.158 against 0.171 ms since; docs/archive/PERF.md, "the
        // forward's work tiles as one stream of key tiles"; shorter not measured).
        if forced.is_empty() && d == 64 && causal && seqlen_q < 512 {
            return None;
        }
        if !mods.is_empty() {
            let variant = match (d, mods) {
                (64, "_mods") => "g3",
                (256, "_mods") => "n80",
                _ => "base",
            };
            return Self::compiled(d, variant, mods);
        }
        let variant = match d {
            // Causal up to 512: 128 x 128, whose kernel runs its work tiles as one stream of
            // key tiles (sm90/fwd_ws.cu: CARRY; 512 0.1425 against 0.1450 ms for 192 x 128,
            // H100); above, the three warpgroups, whose partial tile (1024 rows: 64) is the
            // first and lightest under the mask (END_ALIGNED): 1k 0.217 against 0.2285 ms, 6
            // of 6 rounds (with the partial tile last: 0.280 against 0.244;
            // docs/archive/PERF.md, "The three-warpgroup forward's partial tile, first and
            // light under a causal mask").
            64 if causal && seqlen_q <= 512 => "base",
            64 => "g3",
            128 if !causal && seqlen_k >= 8192 => "n176",
            // Causal up to 1k: 64-key tiles, which never straddle a 64-row diagonal, so that
            // the upper warpgroup passes over the tile its rows cannot see (sm90/fwd_ws.cu:
            // SKIP, which the 80-key kernel spilled with). 1k 0.164 against 0.170 ms, 2k 0.296
            // against 0.286 (H100; docs/archive/PERF.md, "Key tiles masked for a whole
            // warpgroup").
            256 if causal && seqlen_q <= 1024 => "base",
            256 => "n80",
            _ => "base",
        };
        if packed {
            // Compiled for packed batches: base, d = 64 g3, d = 256 n80.
            let variant = if matches!(variant, "g3" | "n80") {
                variant
            } else {
                "base"
            };
            return Self::compiled(d, variant, variant_suffix);
        }
        Self::compiled(d, forced, "").or_else(|| Self::compiled(d, variant, ""))
    }

    pub fn bm(&self) -> usize {
        64 * self.consumers
    }

    pub fn threads(&self) -> u32 {
        128 * (self.consumers as u32 + 1)
    }

    /// `flash_fwd_ws_<dtype>_d<D><suffix><mods>` (the entry points of cuda/sm90/fwd_ws.cu).
    pub fn kernel(&self, dtype: &str) -> String {
        format!(
            "flash_fwd_ws_{dtype}_d{}{}{}",
            self.d, self.suffix, self.mods
        )
    }

    /// `WsTraits::SMEM_BYTES`.
    pub fn smem_bytes(&self) -> u32 {
        self.smem_for(self.q_stages(), self.o_staged())
    }

    /// `WsLayout::of`: with `q` Q slots, the Q tiles, the K and V slots, the O tile where it
    /// is staged (`o`), the mbarriers, 16 bytes per Q slot for its tile's index, 16 for the key
    /// tiles' `KeyInfo`, 1 KB of alignment.
    fn smem_for(&self, q: usize, o: bool) -> u32 {
        let tiles =
            (q * self.bm() + 2 * self.stages * self.bn + usize::from(o) * self.bm()) * self.d * 2;
        ((tiles + (2 * q + 4 * self.stages) * 8).next_multiple_of(16) + 16 * q + 16 + 1024) as u32
    }

    /// `WsTraits::Q_STAGES`: two Q slots where they fit in the 227 KB a block may have, so
    /// that the next work tile's Q loads under the last one's key tiles; three at d = 64 with
    /// two consumer warpgroups, whose short work tiles (causal 512) the producer may then run
    /// two ahead of.
    pub fn q_stages(&self) -> usize {
        if self.d == 64 && self.consumers == 2 && self.smem_for(3, true) <= 232_448 {
            3
        } else if self.smem_for(2, false) <= 232_448 {
            2
        } else {
            1
        }
    }

    /// Length in u32 of the dynamic schedule's buffer (`FwdTmaParams::tile_counter`): the
    /// counter and padding to 16 bytes, then 16 bytes per block and Q slot (the tile index
    /// the producer hands its consumers).
    pub fn tile_slots(&self, blocks: usize) -> usize {
        4 + 4 * self.q_stages() * blocks
    }

    /// `WsTraits::O_STAGED`: O leaves through shared memory and a TMA store where its tile
    /// fits beside the Q slots.
    pub fn o_staged(&self) -> bool {
        self.smem_for(self.q_stages(), true) <= 232_448
    }

    /// Blocks to launch for `tiles` work tiles (query blocks x heads x batch): one per SM,
    /// each taking tile after tile, so that a tile's loads overlap the last one's epilogue;
    /// `dynamic` when tiles differ in work (a mask), which a static walk would leave unequal
    /// across SMs (causal: up to the whole key range against one tile), so blocks take their
    /// next tile from a counter. `CANDLE_FLASH_WS_PERSISTENT=0` launches one block per tile
    /// instead (read once; A/B runs). Returns (blocks, dynamic).
    pub fn grid(tiles: usize, sms: usize, masked: bool) -> (usize, bool) {
        if overrides().ws_persistent_off || tiles <= sms {
            (tiles, false)
        } else {
            (sms, masked)
        }
    }
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

/// The parameter block of the warp-specialized forward for `a` (pointers and strides set),
/// or `None` where TMA cannot address q, k or v; `packed` as in [`extents`].
pub(super) fn fwd_params(
    a: &AttnParams,
    dtype: DType,
    shape: &WsShape,
    packed: Option<(usize, usize)>,
) -> Option<FwdTmaParams> {
    let (b, rows_q, rows_k) = extents(a, packed);
    let source = |ptr, rows: usize, heads: i32, [batch, row, head]: [i64; 3]| TileSource {
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
        q: source(a.q, rows_q, a.h, q).encode(shape.bm())?,
        k: source(a.k, rows_k, a.h_k, k).encode(shape.bn)?,
        v: source(a.v, rows_k, a.h_k, v).encode(shape.bn)?,
        // Each consumer warpgroup stores its own 64 rows.
        o: source(a.o, rows_q, a.h, o).encode(64)?,
        a: *a,
        tile_counter: 0,
        tail_heads: 0,
    })
}
