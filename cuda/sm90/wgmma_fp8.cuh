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
// follows the same permutation (transpose_v_fp8, or the caller's transposed V:
// src/quant/mod.rs, V_ORDER), so the product is unchanged.
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
SM90_WGMMA_FP8(96, 48, 49, 50, 51, 52, 53)
SM90_WGMMA_FP8(128, 64, 65, 66, 67, 68, 69)
SM90_WGMMA_FP8(192, 96, 97, 98, 99, 100, 101)
#undef SM90_WGMMA_FP8

// Keeps the A operand's registers of an in-flight wgmma as they are until this point (the
// instruction reads them asynchronously, until its wait, while the compiler sees them read at
// issue), as CUTLASS's warpgroup_fence_operand does.
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

// Transposes an e4m3 V tile (BN key rows x D bytes, TMA's panels) into V^T (D rows of 128-key
// panels from `vt`; the last BN % 128 keys go to the panel `half` from byte `half_key0` of its
// rows: a half panel two slots share at 64 keys, a slot's own at 96) in the permuted key
// order, by WARPS warps (`thread` 0..32 WARPS - 1).
// A unit is 16 keys x 32 head-dim bytes: ldmatrix.trans reads them as four 8 x 8 matrices of
// 16-bit pairs (keys 0-7 and 8-15 of two 16-byte chunks), giving lane 4c + t the bytes of
// head-dim pair c for keys 2t, 2t + 1 (and 8 + 2t, 9 + 2t); one byte permute per register
// pair makes the even or the odd head-dim row's 4 bytes at A positions 4t..4t + 3; stmatrix
// writes them as four 8 x 8 matrices of V^T rows. Lanes of rows c >= 4 hold the odd row in
// their first register and the even one in their second, so that each stored matrix has rows
// of all eight residues mod 8 (its 16-byte chunks in eight banks groups of the swizzle) where
// even rows alone took two wavefronts. Units go two at a time, both loads first.

// Units u = warp, warp + warps, ... as a runtime loop (u's key group and head-dim column by
// division: cheap for power-of-two GROUPS only).
template <int BN, int D>
__device__ __forceinline__ void transpose_loop(uint32_t vt, uint32_t half, int half_key0,
                                               uint32_t v, int thread, int threads) {
    constexpr int GROUPS = BN / 16, UNITS = GROUPS * (D / 32);
    const int lane = thread % 32, warps = threads / 32, m = lane / 8, r = lane % 8;
    const bool high = lane / 4 >= 4;  // this lane's rows c >= 4
    const uint32_t first = high ? 0x7531 : 0x6420, second = high ? 0x6420 : 0x7531;
    const auto src = [&](int u) {
        const int g = u % GROUPS, h = u / GROUPS;
        return v + panel_byte<BN>(16 * g + (m % 2) * 8 + r, 16 * (2 * h + m / 2));
    };
    constexpr int FULL_KEYS = BN / 128 * 128;
    const auto dst = [&](int u) {
        const int g = u % GROUPS, h = u / GROUPS;
        const int row = 32 * h + 16 * (m / 2) + 2 * r + ((m % 2) ^ int(r >= 4));
        return 16 * g < FULL_KEYS ? vt + panel_byte<D>(row, 16 * g)
                                  : half + panel_byte<D>(row, half_key0 + 16 * g - FULL_KEYS);
    };
    const auto store = [&](int u, const uint32_t (&x)[4]) {
        stmatrix_x4(dst(u), __byte_perm(x[0], x[1], first), __byte_perm(x[0], x[1], second),
                    __byte_perm(x[2], x[3], first), __byte_perm(x[2], x[3], second));
    };
    for (int u = thread / 32; u < UNITS; u += 2 * warps) {
        uint32_t a[4], b[4];
        const bool two = u + warps < UNITS;
        ldmatrix_x4_trans(a, src(u));
        if (two) ldmatrix_x4_trans(b, src(u + warps));
        store(u, a);
        if (two) store(u + warps, b);
    }
}

// Warp W's share: units W, W + WARPS, ..., each (g, h) a compile-time constant, so that a unit
// costs its ldmatrix, four byte permutes, its stmatrix and an XOR and add (the loop over
// runtime units divided by GROUPS per unit, by 12 at 192 keys: the transposers then held
// the consumers up; docs/archive/PERF.md, "the FP8 128 x 192 tile on the GPU").
template <int BN, int D, int WARPS, int W>
__device__ __forceinline__ void transpose_units(uint32_t vt, uint32_t half, int half_key0,
                                                uint32_t v, int lane) {
    constexpr int GROUPS = BN / 16, UNITS = GROUPS * (D / 32);
    constexpr int FULL_KEYS = BN / 128 * 128;
    const int m = lane / 8, r = lane % 8;
    const bool high = lane / 4 >= 4;  // this lane's rows c >= 4
    const uint32_t first = high ? 0x7531 : 0x6420, second = high ? 0x6420 : 0x7531;
    // A unit's source: key row 16 g + (m % 2) 8 + r (residue r), bytes 16 (2 h + m / 2); its
    // destination: V^T row 32 h + 16 (m / 2) + 2 r + ((m % 2) ^ (r >= 4)), keys 16 g.. .
    // panel_byte's swizzle XORs a row's 16-byte chunk with its residue: at the source chunk
    // 2 h % 8 + m / 2 = (2 h % 8) ^ (m / 2) against r, at the destination chunk c against the
    // row's residue dst_res, so each offset is the lane's part XOR a constant.
    const int dst_row = 16 * (m / 2) + 2 * r + ((m % 2) ^ int(r >= 4));
    const uint32_t src_x = uint32_t((m / 2) ^ r) * 16, dst_x = uint32_t(dst_row % 8) * 16;
    const uint32_t src0 = v + ((m % 2) * 8 + r) * 128;
    const uint32_t vt0 = vt + dst_row * 128, half0 = half + dst_row * 128;
    const auto store = [&](uint32_t addr, const uint32_t (&x)[4]) {
        stmatrix_x4(addr, __byte_perm(x[0], x[1], first), __byte_perm(x[0], x[1], second),
                    __byte_perm(x[2], x[3], first), __byte_perm(x[2], x[3], second));
    };
    const auto pair = [&](int u) {  // units u and u + WARPS, both loads first
        const auto src = [&](int g, int h) {
            return src0 + (2 * h / 8) * BN * 128 + 16 * g * 128 + (src_x ^ ((2 * h) % 8 * 16));
        };
        const auto dst = [&](int g, int h) {  // rows 32 h.. keep the residue
            if (16 * g < FULL_KEYS)
                return vt0 + 32 * h * 128 + (16 * g / 128) * D * 128 + (dst_x ^ (16 * g % 128));
            const int k = half_key0 + 16 * g - FULL_KEYS;  // half_key0 is 0 or 64
            return half0 + 32 * h * 128 + (dst_x ^ uint32_t(k));
        };
        uint32_t a[4], b[4];
        const int u2 = u + WARPS;
        ldmatrix_x4_trans(a, src(u % GROUPS, u / GROUPS));
        if (u2 < UNITS) ldmatrix_x4_trans(b, src(u2 % GROUPS, u2 / GROUPS));
        store(dst(u % GROUPS, u / GROUPS), a);
        if (u2 < UNITS) store(dst(u2 % GROUPS, u2 / GROUPS), b);
    };
#pragma unroll
    for (int u = W; u < UNITS; u += 2 * WARPS) pair(u);
}

template <int BN, int D, int WARPS>
__device__ __forceinline__ void transpose_v_fp8(uint32_t vt, uint32_t half, int half_key0,
                                                uint32_t v, int thread) {
    static_assert(WARPS >= 1 && WARPS <= 4, "one to four transposing warps");
    const int warp = thread / 32, lane = thread % 32;
    if constexpr (BN < 96) {
        // d = 256's 64-key tiles give a warp ~11 units of 16 x 32 bytes: unrolled, their
        // offsets outgrew the producer's 40 registers (20 bytes of spill, opaque copies or
        // not), and the same offsets in a runtime loop came to ~25 instructions a unit against
        // this loop's ~22. Its 96-key tiles (16 units a warp, a panel of their own per slot)
        // unroll without spill at ~7 instructions a unit (ptxas -v, SASS).
        transpose_loop<BN, D>(vt, half, half_key0, v, thread, 32 * WARPS);
        return;
    }
    if (warp == 0) transpose_units<BN, D, WARPS, 0>(vt, half, half_key0, v, lane);
    if constexpr (WARPS > 1)
        if (warp == 1) transpose_units<BN, D, WARPS, 1>(vt, half, half_key0, v, lane);
    if constexpr (WARPS > 2)
        if (warp == 2) transpose_units<BN, D, WARPS, 2>(vt, half, half_key0, v, lane);
    if constexpr (WARPS > 3)
        if (warp == 3) transpose_units<BN, D, WARPS, 3>(vt, half, half_key0, v, lane);
}

}  // namespace sm90
