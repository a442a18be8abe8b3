// Tile shapes of the forward kernel, per head dim. Each warp owns MT m16 tiles of query rows;
// two (MT = 2) halve the shared-memory reads of K and V per tensor-core op, which is what
// keeps ldmatrix bandwidth below the mma rate (256 B of B operand per 2048 FMAs per tile).
#pragma once
#include <type_traits>

#include "common/copy.cuh"

template <typename T_, int D_, int BM_, int BN_, int NWARPS_, bool SWIZZLE = true>
struct FwdTraits {
    using T = T_;
    static constexpr int D = D_;            // head dim the kernel is compiled for (>= actual d)
    static constexpr int BM = BM_;          // query rows per thread block
    static constexpr int BN = BN_;          // keys per K/V tile
    static constexpr int NWARPS = NWARPS_;
    static constexpr int THREADS = NWARPS * 32;
    static constexpr int MT = BM / (16 * NWARPS);  // m16 tiles per warp
    static constexpr int NT = BN / 8;              // n8 tiles of S = Q K^T per warp
    static constexpr int DT = D / 8;               // n8 tiles of O per warp
    // Tiles in swizzled rows, whose copies move each sector once (common/copy.cuh); head
    // dims that are not whole 128-byte rows round their rows up to one (d 96: 128). On the
    // H100's sm_80 path swizzled rows measured +1-3% at d 128, +3% at d 64 (64-key tiles) and
    // +11% at d 256 (docs/archive/PERF.md, "the sm_80 kernels' tiles in swizzled rows").
    using Rows = std::conditional_t<SWIZZLE, SwizzledRows<D>, PaddedRows<D>>;
    static constexpr int STRIDE = Rows::PITCH;     // shared-memory row pitch in elements
    static constexpr int SMEM_BYTES = (BM + 2 * BN) * STRIDE * int(sizeof(T));
    static_assert(BM == MT * 16 * NWARPS, "BM must be a multiple of 16 rows per warp");
    static_assert(D % 16 == 0 && BN % 16 == 0, "mma k-steps are 16 wide");
};

// Block sizes per head dim: 4 warps x 32 rows up to d = 128; 8 warps x 16 rows above, where 32
// rows of O no longer fit in registers. Key tiles are as wide as the registers allow without
// spills in the unmasked loop body (ptxas -v, sm_90): at d = 64 a 128-key tile spilled 80 B,
// at d = 128 a 64-key tile spilled 112 B, so those use 64 and 32.
// At d = 128 without dropout, 32-key tiles measured +4-7% causal and -2% to +2% non-causal
// against 64-key ones on the H100's sm_80 path, with fewer registers, so both variants take 32
// (docs/archive/PERF.md, "d = 128 without dropout back to 32-key tiles"). Those were padded
// rows and kernels with every score modifier; plain problems now take 64 keys at d = 96 and
// 128 (FwdWideConfig below).
template <typename T, int D> struct FwdConfig;
template <typename T> struct FwdConfig<T, 32> { using Traits = FwdTraits<T, 32, 128, 64, 4>; };
template <typename T> struct FwdConfig<T, 64> { using Traits = FwdTraits<T, 64, 128, 64, 4>; };
template <typename T> struct FwdConfig<T, 96> { using Traits = FwdTraits<T, 96, 128, 32, 4>; };
template <typename T> struct FwdConfig<T, 128> { using Traits = FwdTraits<T, 128, 128, 32, 4>; };
template <typename T> struct FwdConfig<T, 160> { using Traits = FwdTraits<T, 160, 128, 64, 8>; };
template <typename T> struct FwdConfig<T, 192> { using Traits = FwdTraits<T, 192, 128, 64, 8>; };
template <typename T> struct FwdConfig<T, 224> { using Traits = FwdTraits<T, 224, 128, 64, 8>; };
template <typename T> struct FwdConfig<T, 256> { using Traits = FwdTraits<T, 256, 128, 64, 8>; };
// Wider key tiles for plain problems (the kernels without score modifiers), which the
// planner (src/cuda/plan/fwd.rs) prefers where compiled. d = 64, non-causal only: 96 keys,
// which ptxas fits with 8 bytes of spill where 128 keys spilled 140; on the H100's sm_80
// path +3-6% at 1k-16k against 64-key tiles, but 0.7-3.5% slower causal, whose diagonal
// tiles mask more keys (docs/archive/PERF.md, "the d 64 forward's 96-key tile"). Its rows
// stay padded: swizzled, ptxas spilled 56 bytes and it ran 6-7% slower. d = 96 and 128: 64
// keys, FlashAttention-2's tile, which spills 40-48 bytes of stack yet measured +2-25% over
// 32 keys with and without a causal mask once the rows were swizzled (padded, it had lost:
// docs/archive/PERF.md, "64-key tiles at d 96 and 128 on swizzled rows").
template <typename T, int D> struct FwdWideConfig;
template <typename T> struct FwdWideConfig<T, 64> {
    using Traits = FwdTraits<T, 64, 128, 96, 4, false>;
};
template <typename T> struct FwdWideConfig<T, 96> { using Traits = FwdTraits<T, 96, 128, 64, 4>; };
template <typename T> struct FwdWideConfig<T, 128> { using Traits = FwdTraits<T, 128, 128, 64, 4>; };
// Where a device allows 99 KB of shared memory per block (sm_86/89), d >= 192 takes 64 query
// rows and 32-key tiles (52-68 KB instead of 102-135 KB). The planner
// (src/cuda/plan/fwd.rs) takes it where the other does not fit.
template <typename T, int D> struct FwdSmallConfig { using Traits = FwdTraits<T, D, 64, 32, 4>; };
