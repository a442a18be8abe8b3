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

    // The warp-specialized kernels' draw (the mma.sync kernels above draw per row pair):
    // keep bits of every entry a lane holds in an MMA accumulator fragment of a warp's 16 rows
    // from row0 and NT <= 16 n8 tiles from col0 (mma.sync m16n8 or wgmma m64nN: rows row0 + g
    // and row0 + g + 8, g = lane / 4, column pairs col0 + 8 nt + 2 (lane % 4)): bit 2 nt + e of
    // keep[r] for the entry of row r (0: g, 1: g + 8) and column e of the pair. Rows are
    // queries and columns keys, or with KEYS_AS_ROWS (the backward's S^T) the reverse; row0
    // and col0 are even.
    // One Philox call covers a 2 x 2 block, of which a lane holds one row; lanes g and g ^ 1
    // (lane ^ 4) hold the block's two rows, both in their row g and in their row g + 8. So the
    // even lane draws the blocks of rows (g, g + 1), the odd one those of (g + 7, g + 8), and
    // each passes its partner the partner's half: NT calls per lane instead of 2 NT, the
    // Philox rounds being nearly all of dropout's cost. One call at a time (unroll 1): the
    // wgmma kernels draw while their accumulators are in flight, and unrolled, the calls'
    // interleaved temporaries spilled the d = 128 backward (12 -> 60 bytes).
    template <int NT, bool KEYS_AS_ROWS, int UNROLL = 1>
    __device__ __forceinline__ void keep_fragment(uint32_t (&keep)[2], int row0, int col0,
                                                  int lane) const {
        static_assert(NT <= 16, "two bits per n8 tile in one word per row");
        const int g = lane / 4, odd = g & 1;
        // The even row of the block pair this lane draws: its own row g, or its row g + 8.
        const unsigned int row = unsigned(row0 + (g & ~1) + 8 * odd);
        uint32_t own = 0u, other = 0u;
#pragma unroll UNROLL
        for (int nt = 0; nt < NT; ++nt) {
            const unsigned int col = unsigned(col0 + nt * 8 + 2 * (lane % 4));
            const uint4 c = KEYS_AS_ROWS ? make_uint4(row / 2, col / 2, bh, c3)
                                         : make_uint4(col / 2, row / 2, bh, c3);
            const uint4 x = philox4x32_10(c, k0, k1);
            // Word (query % 2) * 2 + key % 2. Block row 0 (even): queries x, y / keys x, z.
            const uint32_t r0c0 = x.x, r0c1 = KEYS_AS_ROWS ? x.z : x.y;
            const uint32_t r1c0 = KEYS_AS_ROWS ? x.y : x.z, r1c1 = x.w;
            const uint32_t bits0 = uint32_t(r0c0 >= threshold) | uint32_t(r0c1 >= threshold) << 1;
            const uint32_t bits1 = uint32_t(r1c0 >= threshold) | uint32_t(r1c1 >= threshold) << 1;
            own |= (odd ? bits1 : bits0) << (2 * nt);
            other |= (odd ? bits0 : bits1) << (2 * nt);
        }
        // The partner drew the block of this lane's other row (g + 8 for the even lane, g for
        // the odd one).
        const uint32_t got = __shfl_xor_sync(0xffffffff, other, 4);
        keep[0] = odd ? got : own;
        keep[1] = odd ? own : got;
    }

    // Whether entry (r, nt, e) of keep_fragment's bits is kept.
    static __device__ __forceinline__ bool kept(const uint32_t (&keep)[2], int r, int nt, int e) {
        return (keep[r] >> (2 * nt + e)) & 1u;
    }
};
