// Dropout's random numbers: Philox4x32-7 (src/philox.rs's ROUNDS says why 7 rounds), the same
// function as src/philox.rs, so CPU and GPU keep the same entries and the backward regenerates
// the forward's mask from (seed, offset).
// One call gives 8 entries, the 16-bit halves of its 4 words, compared with a 16-bit
// threshold: queries (i0, i0 + 8) by keys (j0, j0 + 1, j0 + 8, j0 + 9), i0 = 16 (i / 16) + i % 8,
// j0 = 16 (j / 16) + 2 ((j % 8) / 2), the entries one lane of an MMA accumulator fragment holds
// in two neighbouring n8 tiles: counter (4 (j / 16) + (j % 8) / 2, 8 (i / 16) + i % 8,
// b*h + head, offset_lo), key (seed_lo, seed_hi ^ offset_hi), word 2 ((i % 16) / 8) +
// (j % 16) / 8, low half for even j.
#pragma once
#include "common/params.cuh"

__device__ __forceinline__ uint4 philox4x32_7(uint4 c, unsigned int k0, unsigned int k1) {
    constexpr unsigned int M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;
    constexpr unsigned int W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#pragma unroll
    for (int round = 0; round < 7; ++round) {
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

    // Keep bits of every entry a lane holds in an MMA accumulator fragment of a warp's 16 rows
    // from row0 and NT n8 tiles from col0 (mma.sync m16n8 or wgmma m64nN: rows row0 + g and
    // row0 + g + 8, g = lane / 4, column pairs col0 + 8 nt + 2 (lane % 4)): bit 2 nt + e of
    // keep[r] for the entry of row r (0: g, 1: g + 8) and column e of the pair. Rows are
    // queries and columns keys, or with KEYS_AS_ROWS (the backward's S^T) the reverse; row0
    // and col0 are multiples of 16, NT is even.
    // Rows as queries, the 8 entries of each call are this lane's in n8 tiles 2m and 2m + 1:
    // NT / 2 calls, no exchange. Keys as rows, a call's 8 entries are those of one query column
    // (e) of lanes g and g ^ 1 (lane ^ 4), which hold the even and the odd keys: the even lane
    // draws column 0, the odd one column 1, and each passes the other its half. UNROLL calls
    // in flight together (the wgmma kernels draw while their accumulators are in flight).
    template <int NT, bool KEYS_AS_ROWS, int UNROLL = 1>
    __device__ __forceinline__ void keep_fragment(uint32_t (&keep)[2], int row0, int col0,
                                                  int lane) const {
        static_assert(NT % 2 == 0 && NT <= 16, "n8 tile pairs, two bits each in one word per row");
        const int g = lane / 4, t = lane % 4, odd = g & 1;
        uint32_t own[2] = {0u, 0u}, other[2] = {0u, 0u};
        const auto kept_half = [&](uint32_t half) { return uint32_t(half >= threshold); };
#pragma unroll UNROLL
        for (int m = 0; m < NT / 2; ++m) {
            const unsigned int col16 = unsigned(col0 / 16 + m), row16 = unsigned(row0 / 16);
            if constexpr (!KEYS_AS_ROWS) {
                const uint4 x =
                    philox4x32_7(make_uint4(4 * col16 + t, 8 * row16 + g, bh, c3), k0, k1);
                const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
                for (int r = 0; r < 2; ++r)
#pragma unroll
                    for (int n = 0; n < 2; ++n)
                        own[r] |= (kept_half(w[2 * r + n] & 0xffff) |
                                   kept_half(w[2 * r + n] >> 16) << 1)
                                  << (2 * (2 * m + n));
            } else {
                // Keys row0 + (g & ~1) + {0, 1, 8, 9}, queries col0 + 16 m + 2 t + odd + {0, 8}.
                const uint4 x = philox4x32_7(
                    make_uint4(4 * row16 + g / 2, 8 * col16 + 2 * t + odd, bh, c3), k0, k1);
                const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
                for (int nq = 0; nq < 2; ++nq)
#pragma unroll
                    for (int nk = 0; nk < 2; ++nk) {
                        const uint32_t word = w[2 * nq + nk], lo = word & 0xffff, hi = word >> 16;
                        const int bit = 2 * (2 * m + nq) + odd;
                        own[nk] |= kept_half(odd ? hi : lo) << bit;
                        other[nk] |= kept_half(odd ? lo : hi) << bit;
                    }
            }
        }
        if constexpr (KEYS_AS_ROWS) {
#pragma unroll
            for (int r = 0; r < 2; ++r) own[r] |= __shfl_xor_sync(0xffffffff, other[r], 4);
        }
        keep[0] = own[0];
        keep[1] = own[1];
    }

    // Whether entry (r, nt, e) of keep_fragment's bits is kept.
    static __device__ __forceinline__ bool kept(const uint32_t (&keep)[2], int r, int nt, int e) {
        return (keep[r] >> (2 * nt + e)) & 1u;
    }

    // x for entry (r, nt, e) as the dropped matrix has it: x / (1 - p) (rp_keep) if kept, else
    // 0 (the backward's P for dV and its dP for dS).
    static __device__ __forceinline__ float scaled(const uint32_t (&keep)[2], int r, int nt, int e,
                                                   float x, float rp_keep) {
        return kept(keep, r, nt, e) ? x * rp_keep : 0.f;
    }

    // Zeroes the dropped entries of one fragment row block (the forward's P; its 1 / (1 - p)
    // goes in with 1 / l).
    template <int NT>
    static __device__ __forceinline__ void zero_dropped(float (&s)[NT][4],
                                                        const uint32_t (&keep)[2]) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (!kept(keep, e / 2, nt, e % 2)) s[nt][e] = 0.f;
    }
};
