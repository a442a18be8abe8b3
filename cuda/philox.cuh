// Dropout's random numbers: Philox4x32-10, the same function as src/philox.rs, so CPU and GPU
// keep the same entries and the backward regenerates the forward's mask from (seed, offset).
// One call covers a 2x2 block of (query, key) pairs: counter (j/2, i/2, b*h + head, offset_lo),
// key (seed_lo, seed_hi ^ offset_hi), word (i % 2) * 2 + j % 2.
#pragma once
#include "params.cuh"

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, unsigned int k0, unsigned int k1) {
    constexpr unsigned int M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;
    constexpr unsigned int W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += W0;
            k1 += W1;
        }
        const unsigned int hi0 = __umulhi(M0, c.x), lo0 = M0 * c.x;
        const unsigned int hi1 = __umulhi(M1, c.z), lo1 = M1 * c.z;
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    }
    return c;
}

struct Dropout {
    unsigned int threshold, k0, k1, c3, bh;

    // bh = sequence index * h + query head.
    __device__ __forceinline__ Dropout(const AttnParams& p, int b, int h)
        : threshold(p.drop_threshold), k0(p.seed_lo), k1(p.seed_hi ^ p.offset_hi),
          c3(p.offset_lo), bh(unsigned(b) * unsigned(p.h) + unsigned(h)) {}

    __device__ __forceinline__ bool active() const { return threshold != 0; }

    // Keep bits of (query i, keys j0 and j0 + 1), j0 even: bit 0 for j0, bit 1 for j0 + 1.
    __device__ __forceinline__ unsigned int keep_row_pair(int i, int j0) const {
        const uint4 w = philox4x32_10(make_uint4(unsigned(j0) / 2, unsigned(i) / 2, bh, c3), k0, k1);
        const unsigned int a = (i & 1) ? w.z : w.x, b = (i & 1) ? w.w : w.y;
        return unsigned(a >= threshold) | (unsigned(b >= threshold) << 1);
    }

    // Keep bits of (queries i0 and i0 + 1, key j), i0 even: bit 0 for i0, bit 1 for i0 + 1.
    __device__ __forceinline__ unsigned int keep_col_pair(int i0, int j) const {
        const uint4 w = philox4x32_10(make_uint4(unsigned(j) / 2, unsigned(i0) / 2, bh, c3), k0, k1);
        const unsigned int a = (j & 1) ? w.y : w.x, b = (j & 1) ? w.w : w.z;
        return unsigned(a >= threshold) | (unsigned(b >= threshold) << 1);
    }
};
