// Tile shapes of the backward kernels. Both keep one m16 tile per warp (MT = 1): each thread
// then holds two accumulators (dK and dV, or dQ) plus two score tiles in registers.
#pragma once
#include <type_traits>

#include "common/copy.cuh"

// dK/dV kernel: a block owns BN keys and DO of the output columns, and streams BM-row tiles
// of Q and dO. Above d = 128, dK and dV for all columns no longer fit in registers, so each
// block takes half of them (and recomputes S and dP for its half: 1.5x the matmuls there).
//
// With DQ (only when DO == D), the same kernel also adds each tile's dQ = dS K into an f32
// buffer with atomics: dS goes through shared memory (key-major, as the warps hold dS^T) and
// the warps split the BM x D product DQ_WM x DQ_WN ways. STAGES = 2 double-buffers the
// streamed Q/dO tiles (and their LSE and rowsum(dO O)).
template <typename T_, int D_, int DO_, int BN_, int BM_, int NWARPS_, bool DQ_ = false,
          int STAGES_ = 1, int DQ_WN_ = 1>
struct BwdKvTraits {
    using T = T_;
    static constexpr int D = D_, DO = DO_, BN = BN_, BM = BM_, NWARPS = NWARPS_;
    static constexpr bool DQ = DQ_;
    static constexpr int STAGES = STAGES_;
    static constexpr int THREADS = NWARPS * 32;
    static constexpr int MT = BN / (16 * NWARPS);  // m16 key tiles per warp
    static constexpr int NQ = BM / 8;              // n8 query tiles of S^T per warp
    static constexpr int DOT = DO / 8;             // n8 tiles of dK, dV per warp
    static constexpr int SPLITS = D / DO;          // column splits of dK, dV
    static constexpr int DQ_WN = DQ_WN_, DQ_WM = NWARPS / DQ_WN;
    static constexpr int DQ_MT = BM / (16 * DQ_WM);  // m16 query tiles of dQ per warp
    static constexpr int DQ_NT = D / (8 * DQ_WN);    // n8 column tiles of dQ per warp
    // Q, dO, K and V in swizzled rows (copies move each sector once, common/copy.cuh) where
    // rows, column splits and dQ's warp columns are whole powers of two of chunks; dS^T,
    // written by the warps, padded.
    static constexpr bool SWIZZLE =
        D % 64 == 0 && DO % 64 == 0 && (!DQ || (DQ_NT & (DQ_NT - 1)) == 0);
    using Rows = std::conditional_t<SWIZZLE, SwizzledRows<D>, PaddedRows<D>>;
    static constexpr int STRIDE = Rows::PITCH;
    static constexpr int DQ_FRAG = DQ_MT * DQ_NT * 4;  // dQ accumulators per thread
    static constexpr int DQ_PASSES = 1;                 // dq_accumulate: all columns at once
    // First row and column of `warp`'s dQ tile within the BM x D tile.
    static __device__ __forceinline__ int dq_row0(int warp) { return (warp / DQ_WN) * DQ_MT * 16; }
    static __device__ __forceinline__ int dq_col0(int warp) { return (warp % DQ_WN) * DQ_NT * 8; }
    static constexpr int DS_STRIDE = BM + SMEM_PAD;  // dS^T tile: BN rows of BM queries
    static constexpr int SMEM_BYTES = (2 * BN + 2 * STAGES * BM) * STRIDE * int(sizeof(T)) +
                                      (DQ ? BN * DS_STRIDE * int(sizeof(T)) : 0) +
                                      2 * STAGES * BM * 4;
    static_assert(BN == MT * 16 * NWARPS && D % DO == 0 && DO % 16 == 0, "tile shape");
    static_assert(BM <= THREADS, "one thread per row loads the LSE and rowsum(dO O)");
    static_assert(!DQ || (DO == D && NWARPS % DQ_WN == 0 && BM == DQ_MT * 16 * DQ_WM &&
                          D == DQ_NT * 8 * DQ_WN && DQ_NT % 2 == 0),
                  "dQ tile shape");
};

// dQ kernel: a block owns BM query rows and streams BN-key tiles of K and V (the forward's
// loop, with dP = dO V^T and dQ += dS K in place of the online softmax and O += P V).
template <typename T_, int D_, int BM_, int BN_, int NWARPS_> struct BwdQTraits {
    using T = T_;
    static constexpr int D = D_, BM = BM_, BN = BN_, NWARPS = NWARPS_;
    static constexpr int THREADS = NWARPS * 32;
    static constexpr int MT = BM / (16 * NWARPS);
    static constexpr int NT = BN / 8;
    static constexpr int DT = D / 8;
    using Rows = PaddedRows<D>;
    static constexpr int STRIDE = Rows::PITCH;
    static constexpr int SMEM_BYTES = (2 * BM + 2 * BN) * STRIDE * int(sizeof(T));
    static_assert(BM == MT * 16 * NWARPS && D % 16 == 0, "tile shape");
};

// The streamed tile shrinks as d grows so that the two score tiles (S and dP, 2 x BM/2 or
// 2 x BN/2 registers) fit beside the accumulators; with 64-wide tiles ptxas -v (sm_90)
// reported spills of 104 B (dK/dV, d = 128) up to 528 B (dQ, d = 256).
template <typename T, int D> struct BwdConfig {
    static constexpr int DO = D <= 128 ? D : D / 2;
    using Kv = BwdKvTraits<T, D, DO, 64, (D <= 96 ? 64 : 32), 4>;
    using Q = BwdQTraits<T, D, 64, (D <= 128 ? 64 : 32), 4>;
};

// d = 256's dK/dV kernel with 16-row Q/dO tiles (84 KB): its 32-row shape needs 99.3 KB, just
// past what sm_86/89 allow per block. The planner (src/cuda/plan/bwd.rs)
// takes it where the other does not fit.
template <typename T> struct BwdKvSmall256 { using Kv = BwdKvTraits<T, 256, 128, 64, 16, 4>; };

// The non-deterministic path for d <= 128: dK, dV and (atomically) dQ in one kernel. dQ's
// warp split keeps its accumulator at 32-48 registers per thread, live only after dS^T is
// consumed. WIDE: 128 keys per block over 8 warps (FA2's d = 128 shape), which halves the
// dQ atomics and the Q/dO reads per key but leaves one block per SM. Chosen in
// src/cuda/plan/bwd.rs.
// TALL (WIDE only): twice the streamed rows (d = 64: 128, d = 128: 64), which halves the
// barriers and the K/V fragment reloads per query at the price of a few spilled registers
// (ptxas -v, sm_80: 40-44 B) and 158 KB of shared memory at d = 128 (A100 and Hopper only).
// WIDE at d = 96 (FA2's d 96 shape: 64 x 128 over 8 warps): 123 KB on padded rows.
// Warp columns of a BM x D dQ tile over NWARPS warps: 32-row warp tiles, halved in columns
// while a warp's n8 tiles would be odd.
constexpr int dq_warp_columns(int nwarps, int bm, int d) {
    int wn = nwarps * 32 / bm;
    while (wn > 1 && (d / (8 * wn)) % 2 != 0) wn /= 2;
    return wn;
}

template <typename T, int D, bool WIDE = false, bool TALL = false> struct BwdFusedConfig {
    static_assert(WIDE || !TALL, "the tall shape is a wide one");
    static constexpr int BM = (D <= 96 ? 64 : 32) * (TALL ? 2 : 1);
    static constexpr int NWARPS = WIDE ? 8 : 4;
    // dQ warp tiles of 32 rows, or taller where that would leave a warp an odd number of n8
    // tiles (the B loads take them in pairs; d = 96 on 8 warps)
    static constexpr int DQ_WN = dq_warp_columns(NWARPS, BM, D);
    using Kv = BwdKvTraits<T, D, D, 16 * NWARPS, BM, NWARPS, true, 2, DQ_WN>;
};

// The fused backward on FlashAttention-2's warp layout (sm80/bwd_grid.cuh): BN keys over 8
// warps, and each product split over the warps in two dimensions so that every warp reads
// less of its shared operands per mma. S^T and dP^T on a WK x WQ grid (keys x queries), P^T
// and dS^T staged key-major in shared memory, then dV and dK on a WKV x WD grid (keys x
// columns) and dQ on the fused kernel's DQ_WM x DQ_WN. dO is single-buffered (the next dO is
// requested once every warp has read this one), Q double-buffered where Q_STAGES = 2, else
// requested once dK has read it.
template <typename T_, int D_, int BN_, int BM_, int WQ_, int WD_, int Q_STAGES_>
struct BwdGridTraits {
    using T = T_;
    static constexpr int D = D_, BN = BN_, BM = BM_, NWARPS = 8, STAGES = Q_STAGES_;
    static constexpr int THREADS = NWARPS * 32;
    static constexpr int WQ = WQ_, WK = NWARPS / WQ;  // S^T, dP^T warp grid
    static constexpr int MT = BN / (16 * WK);         // m16 key tiles of S^T per warp
    static constexpr int NQ = BM / (8 * WQ);          // n8 query tiles of S^T per warp
    static constexpr int WD = WD_, WKV = NWARPS / WD;  // dK, dV warp grid
    static constexpr int KMT = BN / (16 * WKV);       // m16 key tiles of dK, dV per warp
    static constexpr int DOT = D / (8 * WD);          // n8 column tiles of dK, dV per warp
    // Q, dO, K and V in swizzled rows, whose copies move each sector once (common/copy.cuh);
    // P^T and dS^T, written by the warps, in padded ones.
    using Rows = SwizzledRows<D>;
    static constexpr int STRIDE = Rows::PITCH;
    static constexpr int DS_STRIDE = BM + SMEM_PAD;   // P^T, dS^T tiles: BN rows of BM queries
    static constexpr int DQ_WN = NWARPS * 32 / BM, DQ_WM = NWARPS / DQ_WN;
    static constexpr int DQ_MT = BM / (16 * DQ_WM);
    static constexpr int DQ_NT = D / (8 * DQ_WN);
    static constexpr int DQ_FRAG = DQ_MT * DQ_NT * 4;
    // dQ's columns in passes of at most 4 n8 tiles: 32 accumulators beside dK's and dV's.
    static constexpr int DQ_PASSES = DQ_NT > 4 ? DQ_NT / 4 : 1;
    static __device__ __forceinline__ int dq_row0(int warp) { return (warp / DQ_WN) * DQ_MT * 16; }
    static __device__ __forceinline__ int dq_col0(int warp) { return (warp % DQ_WN) * DQ_NT * 8; }
    static constexpr int SMEM_BYTES = (2 * BN + (STAGES + 1) * BM) * STRIDE * int(sizeof(T)) +
                                      2 * BN * DS_STRIDE * int(sizeof(T)) + 2 * STAGES * BM * 4;
    static_assert(STAGES == 1 || STAGES == 2, "Q is single- or double-buffered");
    static_assert(BN == MT * 16 * WK && BM == NQ * 8 * WQ && NQ % 2 == 0, "S^T warp tiles");
    static_assert(BN == KMT * 16 * WKV && D == DOT * 8 * WD && DOT % 2 == 0, "dK, dV warp tiles");
    static_assert(D % 64 == 0 && (DOT * 8) % 64 == 0, "whole swizzled rows and column groups");
    static_assert(BM <= THREADS, "one thread per row loads the LSE and rowsum(dO O)");
    static_assert(BM == DQ_MT * 16 * DQ_WM && D == DQ_NT * 8 * DQ_WN && DQ_NT % 2 == 0,
                  "dQ tile shape");
};

// d = 128: 128 keys, 64 rows per tile, S^T warp tiles of 32 keys x 32 queries, dK/dV of 32
// keys x 64 columns, Q double-buffered (156 KB). d = 256: 64 keys and 64 rows, S^T warp tiles
// of 16 keys x 32 queries, dK/dV of 32 keys x 64 columns, Q double-buffered where 184 KB is
// allowed (Hopper's sm_80 path), else single (151 KB, A100).
template <typename T, int D, int Q_STAGES = 2> struct BwdGridConfig {
    static_assert(D == 128 || D == 256, "the grid layout is compiled at d = 128 and 256");
    using Kv = BwdGridTraits<T, D, (D == 128 ? 128 : 64), 64, 2, (D == 128 ? 2 : 4), Q_STAGES>;
};
