// The query tiles a key block's backward streams (dK/dV kernels, mma.sync and wgmma): every
// query head of the GQA group, since each adds to this K/V head's dK and dV (Algorithm 2,
// line 21's sum), and within a head every query block that can see the keys. Tiles are
// numbered 0, 1, ... head-major; `next` steps a (query head, first row) cursor along them.
#pragma once
#include "mask.cuh"
#include "params.cuh"

template <int BM, int BN> struct QueryTiles {
    int count;             // tiles in all
    int m0_begin, m0_end;  // first row of the first visible query block, one past the last

    __device__ __forceinline__ QueryTiles(const Mask& mask, const AttnParams& p, int n0,
                                          int seqlen_q) {
        int mb_begin, mb_end;
        mask.template query_blocks<BM, BN>(n0, seqlen_q, &mb_begin, &mb_end);
        count = max(mb_end - mb_begin, 0) * p.h_h_k_ratio;
        m0_begin = mb_begin * BM;
        m0_end = mb_end * BM;
    }

    __device__ __forceinline__ void next(int& bidh, int& m0) const {
        m0 += BM;
        if (m0 == m0_end) {
            m0 = m0_begin;
            ++bidh;
        }
    }
};
