// The query tiles a key block's backward streams (dK/dV kernels, mma.sync and wgmma): every
// query head of the GQA group, since each adds to this K/V head's dK and dV (Algorithm 2,
// line 21's sum), and within a head every query block that can see the keys. Tiles are
// numbered 0, 1, ... head-major; `next` steps a (query head, first row) cursor along them,
// past the tiles a block mask leaves out (jumping with its skip table).
#pragma once
#include "common/mask/visibility.cuh"
#include "common/params.cuh"

template <int BM, int BN> struct QueryTiles {
    int n0;                // the key block's first key
    int head0, head_end;   // the group's query heads
    int total;             // tiles of the window's query blocks in all heads
    int count;             // those to visit (all of them without a block mask; see below)
    int m0_begin, m0_end;  // first row of the first visible query block, one past the last

    // `mask`: the group's first query head's. Under a block mask, `count` costs a walk of
    // the tiles (`counted`); the warp-specialized kernel, which walks with seek, skips it.
    __device__ __forceinline__ QueryTiles(const Mask& mask, const AttnParams& p, int n0_,
                                          int seqlen_q, bool counted = true)
        : n0(n0_), head0(mask.head), head_end(mask.head + p.h_h_k_ratio) {
        int mb_begin, mb_end;
        mask.template query_blocks<BM, BN>(n0, seqlen_q, &mb_begin, &mb_end);
        total = max(mb_end - mb_begin, 0) * p.h_h_k_ratio;
        m0_begin = mb_begin * BM;
        m0_end = mb_end * BM;
        count = total;
        if (mask.sparse && counted && total > 0) {
            count = 0;
            for (int h = head0; h < head_end; ++h)
                for (int m0 = skip(mask, h, m0_begin); m0 < m0_end; m0 = skip(mask, h, m0 + BM))
                    ++count;
        }
    }

    // The first tile at or after (bidh, m0) that the block mask keeps (m0_end if none in this
    // head). The methods take the mask as an argument: a reference member put the kernels'
    // Mask in local memory.
    __device__ __forceinline__ int skip(const Mask& mask, int bidh, int m0) const {
        return mask.sparse ? mask.template next_present_tile<BM>(bidh, n0, n0 + BN, m0, m0_end)
                           : m0;
    }

    // The first tile to visit (count > 0).
    __device__ __forceinline__ void first(const Mask& mask, int& bidh, int& m0) const {
        bidh = head0;
        m0 = m0_begin;
        if (mask.sparse) {
            m0 = skip(mask, bidh, m0);
            settle(mask, bidh, m0);
        }
    }

    // The tile to visit after (bidh, m0); past the last, a head outside the group.
    __device__ __forceinline__ void next(const Mask& mask, int& bidh, int& m0) const {
        if (!mask.sparse) {
            m0 += BM;
            if (m0 == m0_end) {
                m0 = m0_begin;
                ++bidh;
            }
            return;
        }
        m0 = skip(mask, bidh, m0 + BM);
        settle(mask, bidh, m0);
    }

    // Past a head's last tile: the next head's first kept tile.
    __device__ __forceinline__ void settle(const Mask& mask, int& bidh, int& m0) const {
        while (m0 >= m0_end) {
            m0 = m0_begin;
            if (++bidh == head_end) return;
            m0 = skip(mask, bidh, m0);
        }
    }

    // Moves (head, m0), head counted from the group's first, to the first kept tile at or
    // after it; false if none is left in the group.
    __device__ __forceinline__ bool seek(const Mask& mask, int& head, int& m0) const {
        m0 = skip(mask, head0 + head, m0);
        while (m0 >= m0_end) {
            if (++head == head_end - head0) return false;
            m0 = skip(mask, head0 + head, m0_begin);
        }
        return true;
    }
};
