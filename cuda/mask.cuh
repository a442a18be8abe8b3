// Which (query, key) pairs are visible: the key-length bound, the bottom-right aligned causal
// mask and, in general, a window around the diagonal. One place for fwd, bwd and decode.
#pragma once
#include <climits>
#include <cmath>

#include "params.cuh"
#include "seq_info.cuh"

struct Mask {
    int seqlen_k;
    int offset;  // seqlen_k - seqlen_q: query i's diagonal is key i + offset
    int left, right;  // window half-widths, -1 = unbounded

    __device__ __forceinline__ Mask(const AttnParams& p, const SeqInfo& seq)
        : seqlen_k(seq.seqlen_k), offset(seq.seqlen_k - seq.seqlen_q), left(p.window_left),
          right(p.window_right) {}

    // Key blocks of width BN that queries [q_first, q_last] can see: [*begin, *end), maybe
    // empty.
    template <int BN>
    __device__ __forceinline__ void key_blocks(int q_first, int q_last, int* begin,
                                               int* end) const {
        int stop = seqlen_k;
        if (right >= 0) stop = min(stop, q_last + offset + right + 1);
        *end = stop <= 0 ? 0 : (stop + BN - 1) / BN;
        *begin = left >= 0 ? max(0, (q_first + offset - left) / BN) : 0;
    }

    // Query blocks of height BM that can see keys [n0, n0 + BN): [*begin, *end), maybe empty.
    template <int BM, int BN>
    __device__ __forceinline__ void query_blocks(int n0, int seqlen_q, int* begin, int* end) const {
        *end = (seqlen_q + BM - 1) / BM;
        // Row i sees key j only if i >= j - offset - right, and only if i <= j - offset + left.
        *begin = right >= 0 ? max(0, n0 - offset - right) / BM : 0;
        if (left >= 0) {
            const int last = n0 + BN - 1 - offset + left;
            *end = last < 0 ? 0 : min(*end, last / BM + 1);
        }
    }

    // Whether any pair of queries [q_first, q_last] x keys [n0, n0 + BN) is masked; the
    // others run the loop body compiled without mask code.
    template <int BN>
    __device__ __forceinline__ bool block_needs_mask(int q_first, int q_last, int n0) const {
        return n0 + BN > seqlen_k || (right >= 0 && n0 + BN - 1 > q_first + offset + right) ||
               (left >= 0 && n0 < q_last + offset - left);
    }

    // Sets masked scores of a warp's S accumulators to -inf. S holds MT m16 tiles x NT n8
    // tiles in the mma C layout; the warp's first row is row0, the tile's first column col0.
    // Rows are queries and columns keys, or, with TRANSPOSED (S^T in the dK/dV kernel), rows
    // are keys and columns queries. Query rows may be packed: tile row r is query
    // r / rows_per_query (GQA-packed decode tiles hold several heads of one token).
    // Each thread's rows get their visible column range [lo, hi) once; an entry then costs two
    // compares (the per-entry `visible` was 6-8 integer instructions, on every masked block).
    template <int MT, int NT, bool TRANSPOSED = false>
    __device__ __forceinline__ void apply(float (&s)[MT][NT][4], int row0, int col0, int lane,
                                          int rows_per_query = 1) const {
        const int g = lane / 4, t = lane % 4;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = row0 + mt * 16 + g + r * 8;
                int lo, hi;
                if constexpr (TRANSPOSED) {
                    // Key `row` is seen by queries i with row - offset - right <= i and
                    // i <= row - offset + left; by none past the key length.
                    lo = right >= 0 ? row - offset - right : INT_MIN;
                    hi = left >= 0 ? row - offset + left + 1 : INT_MAX;
                    if (row >= seqlen_k) hi = INT_MIN;
                } else {
                    const int q = row / rows_per_query;
                    lo = left >= 0 ? q + offset - left : INT_MIN;
                    hi = right >= 0 ? min(seqlen_k, q + offset + right + 1) : seqlen_k;
                }
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 2 * r; e < 2 * r + 2; ++e) {
                        const int col = col0 + nt * 8 + 2 * t + (e % 2);
                        if (col < lo || col >= hi) s[mt][nt][e] = -INFINITY;
                    }
            }
    }
};
