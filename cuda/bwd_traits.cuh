// Tile shapes of the backward kernels. Both keep one m16 tile per warp (MT = 1): each thread
// then holds two accumulators (dK and dV, or dQ) plus two score tiles in registers.
#pragma once
#include "copy.cuh"

// dK/dV kernel: a block owns BN keys and DO of the output columns, and streams BM-row tiles
// of Q and dO. Above d = 128, dK and dV for all columns no longer fit in registers, so each
// block takes half of them (and recomputes S and dP for its half: 1.5x the matmuls there).
template <typename T_, int D_, int DO_, int BN_, int BM_, int NWARPS_> struct BwdKvTraits {
    using T = T_;
    static constexpr int D = D_, DO = DO_, BN = BN_, BM = BM_, NWARPS = NWARPS_;
    static constexpr int THREADS = NWARPS * 32;
    static constexpr int MT = BN / (16 * NWARPS);  // m16 key tiles per warp
    static constexpr int NQ = BM / 8;              // n8 query tiles of S^T per warp
    static constexpr int DOT = DO / 8;             // n8 tiles of dK, dV per warp
    static constexpr int SPLITS = D / DO;          // column splits of dK, dV
    static constexpr int STRIDE = D + SMEM_PAD;
    static constexpr int SMEM_BYTES = (2 * BN + 2 * BM) * STRIDE * int(sizeof(T)) + 2 * BM * 4;
    static_assert(BN == MT * 16 * NWARPS && D % DO == 0 && DO % 16 == 0, "tile shape");
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
    static constexpr int STRIDE = D + SMEM_PAD;
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
