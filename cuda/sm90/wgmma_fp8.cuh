// The e4m3 forms of wgmma (sm_90a) for the FP8 forward (sm90/fwd_ws.cu with FP8 traits):
// m64nNk32, f32 accumulators in the same layout as the 16-bit forms (wgmma.cuh), both operands
// K-major (the 8-bit forms have no transpose), so V is transposed in shared memory first
// (transpose_v_fp8). A k32 step spans 32 bytes of a 128-byte swizzled row, as a k16 step of
// the 16-bit forms does: wgmma.cuh's kmajor_desc serves both.
//
// P as the A operand: a thread's four A registers of a k32 step hold, per register, four
// consecutive k of one row (rows g and g + 8, k 4t..4t+3 and 16 + 4t..16 + 4t + 3 for lane
// 4g + t), while its S accumulators hold column pairs (2t, 2t + 1) of each n8 tile. Rather than
// move bytes between lanes, P's k order is permuted: A position 4t + j of each 16 carries key
// 2t + j (j < 2) or 8 + 2t + j - 2 (j >= 2) of those 16, and the transposed V's key order
// follows the same permutation (transpose_v_fp8), so the product is unchanged.
#pragma once
#include <cstdint>

#include "sm90/wgmma.cuh"

namespace sm90 {

template <int N> struct WgmmaFp8;

// One WgmmaFp8<N>; I0..I5 are the asm operand numbers after the N / 2 accumulators.
#define SM90_WGMMA_FP8(N, I0, I1, I2, I3, I4, I5)                                                \
    template <> struct WgmmaFp8<N> {                                                               \
        static __device__ __forceinline__ void ss(float (&d)[N / 8][4], uint64_t desc_a,           \
                                                  uint64_t desc_b, int scale_d) {                  \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #I2 ", 0;\n"                         \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 "               \
                         "{" SM90_REGS_##N "}, %" #I0 ", %" #I1 ", p, 1, 1;\n}\n"                  \
                         : SM90_ACC_##N                                                            \
                         : "l"(desc_a), "l"(desc_b), "r"(scale_d));                                \
        }                                                                                          \
        static __device__ __forceinline__ void rs(float (&d)[N / 8][4], const uint32_t (&a)[4],    \
                                                  uint64_t desc_b, int scale_d) {                  \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #I5 ", 0;\n"                         \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k32.f32.e4m3.e4m3 "               \
                         "{" SM90_REGS_##N "}, {%" #I0 ", %" #I1 ", %" #I2 ", %" #I3 "}, %" #I4    \
                         ", p, 1, 1;\n}\n"                                                         \
                         : SM90_ACC_##N                                                            \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b),                \
                           "r"(scale_d));                                                          \
        }                                                                                          \
    };

SM90_WGMMA_FP8(64, 32, 33, 34, 35, 36, 37)
SM90_WGMMA_FP8(128, 64, 65, 66, 67, 68, 69)
#undef SM90_WGMMA_FP8

// Keeps the A operand's registers of an in-flight wgmma as they are until this point (the
// instruction reads them asynchronously, until its wait): without it ptxas may reuse them for
// the softmax's temporaries while P V still runs.
template <int KT> __device__ __forceinline__ void fence_operand(uint32_t (&a)[KT][4]) {
#pragma unroll
    for (int i = 0; i < KT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[i][e])::"memory");
}

// Four floats as e4m3 bytes, x0 in the lowest (round to nearest even, saturating).
__device__ __forceinline__ uint32_t pack_e4m3x4(float x0, float x1, float x2, float x3) {
    uint16_t lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(x1), "f"(x0));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(x3), "f"(x2));
    return uint32_t(lo) | (uint32_t(hi) << 16);
}

// P (S accumulators, NT n8 tiles of a warp's 16 rows) as the A operand of P V in e4m3, one
// k32 step per four n8 tiles, in the permuted key order of the header comment.
template <int NT>
__device__ __forceinline__ void pack_a_fp8(const float (&c)[NT][4], uint32_t (&a)[NT / 4][4]) {
    static_assert(NT % 4 == 0, "k32 steps of four n8 tiles");
#pragma unroll
    for (int kk = 0; kk < NT / 4; ++kk) {
        const float(&c0)[4] = c[4 * kk];
        const float(&c1)[4] = c[4 * kk + 1];
        const float(&c2)[4] = c[4 * kk + 2];
        const float(&c3)[4] = c[4 * kk + 3];
        a[kk][0] = pack_e4m3x4(c0[0], c0[1], c1[0], c1[1]);
        a[kk][1] = pack_e4m3x4(c0[2], c0[3], c1[2], c1[3]);
        a[kk][2] = pack_e4m3x4(c2[0], c2[1], c3[0], c3[1]);
        a[kk][3] = pack_e4m3x4(c2[2], c2[3], c3[2], c3[3]);
    }
}

// Byte (row, byte b) of a 128-byte-swizzled panel tile of ROWS rows, 128 bytes a row per
// panel: panel b / 128, 16-byte chunk (b % 128) / 16 stored at chunk ^ (row % 8).
template <int ROWS>
__device__ __forceinline__ uint32_t panel_byte(int row, int b) {
    return (b / 128) * ROWS * 128 + row * 128 + ((((b % 128) / 16) ^ (row % 8)) * 16) + b % 16;
}

// Transposes an e4m3 V tile (BN key rows x D bytes, TMA's panels) into V^T (D rows x BN key
// bytes, panels of 128 keys) in the permuted key order, by `threads` threads from `thread`.
// A unit is four keys (2t, 2t + 1, 8 + 2t, 9 + 2t of a 16-key group: A positions 4t..4t + 3)
// by four head-dim bytes: four 4-byte loads, a 4 x 4 byte transpose (8 byte permutes), four
// 4-byte stores. Within a warp, lanes take t = lane % 4, the 16-key group's low bit from lane
// / 4 % 2 and four head-dim words from lane / 8, so that loads and stores each touch 16
// banks twice (two wavefronts).
template <int BN, int D>
__device__ __forceinline__ void transpose_v_fp8(uint32_t vt, uint32_t v, int thread, int threads) {
    static_assert(BN % 32 == 0 && D % 16 == 0, "whole warp steps");
    constexpr int STEPS = BN / 32 * (D / 16);  // warp steps: 32 keys x 16 head-dim bytes
    const int lane = thread % 32, t = lane % 4, g_lo = lane / 4 % 2, w_lo = lane / 8;
    for (int step = thread / 32; step < STEPS; step += threads / 32) {
        const int key_group = (step % (BN / 32)) * 2 + g_lo, w = (step / (BN / 32)) * 4 + w_lo;
        const int key0 = key_group * 16 + 2 * t, col = 4 * w;
        uint32_t r[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int key = key0 + (j % 2) + (j / 2) * 8;
            asm volatile("ld.shared.b32 %0, [%1];\n"
                         : "=r"(r[j])
                         : "r"(v + panel_byte<BN>(key, col)));
        }
        const uint32_t t0 = __byte_perm(r[0], r[1], 0x5140), t1 = __byte_perm(r[0], r[1], 0x7362);
        const uint32_t t2 = __byte_perm(r[2], r[3], 0x5140), t3 = __byte_perm(r[2], r[3], 0x7362);
        const uint32_t out[4] = {__byte_perm(t0, t2, 0x5410), __byte_perm(t0, t2, 0x7632),
                                 __byte_perm(t1, t3, 0x5410), __byte_perm(t1, t3, 0x7632)};
#pragma unroll
        for (int i = 0; i < 4; ++i)
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(vt + panel_byte<D>(col + i, key_group * 16 + 4 * t)),
                         "r"(out[i])
                         : "memory");
    }
}

}  // namespace sm90
