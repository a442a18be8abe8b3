// The FP8 (e4m3) KV cache: quantizing rows as the append writes them, and the decode
// kernel's tensor-core fragments read straight from e4m3 tiles.
//
// A cached byte times its head's scale is the real key or value. The decode kernel converts
// e4m3 to f16 in registers (exact: every e4m3 value is an f16) and runs the f16 mma; the
// query, in f16 too, carries the K scale, and the V scale multiplies the output, so the
// softmax sees the true scores. Tiles are the SwizzledRows of the 16-bit path with a row of
// D bytes seen as D / 2 16-bit units, so the copies and the swizzle are shared. ldmatrix moves
// 16-bit units, so a lane receives four consecutive bytes where the 16-bit path gets two
// elements; the k order of each mma is permuted to match (a dot product does not care in
// which order it sums, as long as q and k agree):
//   K (non-transposed ldmatrix): lane (g, t) holds K[key g][d 4t .. 4t + 3] of a 16-column
//     chunk; its low pair is b0 (logical k 2t, 2t + 1), its high pair b1 (k 2t + 8, 2t + 9).
//     The query tile is stored permuted to agree (q_to_f16_permuted).
//   V (transposed ldmatrix): lane (g, t) holds V[key 2t, 2t + 1][d 2g, 2g + 1]; one byte
//     permute gives the pairs (key 2t, key 2t + 1) of column 2g and of column 2g + 1, so a
//     16-column chunk feeds two n8 tiles, one of even and one of odd columns
//     (store_o_fp8 puts the columns back in order).
#pragma once
#include <cuda_fp8.h>
#include "common/mma.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
// Two e4m3 bytes (the low 16 bits of `x`) as an f16 pair, the low byte in the low half.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t x) {
    uint32_t r;
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n}\n"
        : "=r"(r)
        : "r"(x));
    return r;
}

// The high two bytes of `x` as an f16 pair.
__device__ __forceinline__ uint32_t e4m3x2_hi_to_f16x2(uint32_t x) {
    uint32_t r;
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, hi;\n}\n"
        : "=r"(r)
        : "r"(x));
    return r;
}
#else
// Without the conversion instruction (before sm_89): each byte's sign, exponent and
// mantissa moved into f16's fields (exponent bias 15 for 7) and the result scaled by 2^8,
// which is exact for normal and subnormal e4m3 alike (e4m3's NaN becomes 480).
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t x) {
    const uint32_t pair = __byte_perm(x, 0, 0x1404);  // byte 0 -> bits 8-15, byte 1 -> 24-31
    const uint32_t bits = (pair & 0x80008000u) | ((pair & 0x7f007f00u) >> 1);
    const __half2 h = __hmul2(*reinterpret_cast<const __half2*>(&bits), __float2half2_rn(256.f));
    return *reinterpret_cast<const uint32_t*>(&h);
}

__device__ __forceinline__ uint32_t e4m3x2_hi_to_f16x2(uint32_t x) {
    return e4m3x2_to_f16x2(x >> 16);
}
#endif

// Eight floats as e4m3 (x / scale, round to nearest even, saturating at ±448; NaN stays NaN),
// the first in the lowest byte. A true division, so that the CPU's quantization (f32
// division, then the same rounding) writes the same bytes.
__device__ __forceinline__ uint2 quantize_e4m3x8(const float (&x)[8], float scale) {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float2 f = make_float2(__fdiv_rn(x[2 * k], scale), __fdiv_rn(x[2 * k + 1], scale));
        w[k] = __nv_cvt_float2_to_fp8x2(f, __NV_SATFINITE, __NV_E4M3);
    }
    return make_uint2(w[0] | (w[1] << 16), w[2] | (w[3] << 16));
}

// The query tile (ROWS x D, row pitch STRIDE, in T) in place as f16 times `scale`, each
// 16-column block permuted so that the A fragments ldmatrix hands out match the K fragments
// above: position p < 8 holds column 4 (p / 2) + p % 2, position 8 + p holds 4 (p / 2) + 2 +
// p % 2. Each thread owns whole blocks (reads and writes its own 32 bytes), so no barrier is
// needed between reading and writing; the caller synchronises before the tile is read.
// f16 saturates at ±65504 (a query that large times a K scale is out of any model's range).
template <typename T, int ROWS, int D, int STRIDE, int THREADS>
__device__ __forceinline__ void q_to_f16_permuted(T* sq, float scale, int tid) {
    constexpr int BLOCKS_PER_ROW = D / 16;
    for (int i = tid; i < ROWS * BLOCKS_PER_ROW; i += THREADS) {
        uint4* blk = reinterpret_cast<uint4*>(sq + (i / BLOCKS_PER_ROW) * STRIDE +
                                              (i % BLOCKS_PER_ROW) * 16);
        const uint4 u[2] = {blk[0], blk[1]};
        const uint32_t w[8] = {u[0].x, u[0].y, u[0].z, u[0].w, u[1].x, u[1].y, u[1].z, u[1].w};
        float x[16];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const float2 f = MmaOp<T>::unpack(w[k]);
            x[2 * k] = fminf(fmaxf(f.x * scale, -65504.f), 65504.f);
            x[2 * k + 1] = fminf(fmaxf(f.y * scale, -65504.f), 65504.f);
        }
        uint32_t out[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {  // positions 2k, 2k + 1
            const int p = 2 * k, col = p < 8 ? 2 * p : 2 * (p - 8) + 2;
            out[k] = MmaOp<__half>::pack(x[col], x[col + 1]);
        }
        blk[0] = make_uint4(out[0], out[1], out[2], out[3]);
        blk[1] = make_uint4(out[4], out[5], out[6], out[7]);
    }
}

// S += Q K^T for one m16 row tile and 16 keys of an e4m3 SwizzledRows K tile (rows of
// ROW_BYTES), Q the permuted f16 tile or its fragments. One ldmatrix.x4 covers two 16-column
// chunks of both 8-key halves: four mma.
template <int KSTEPS, int STRIDE, int ROW_BYTES, bool Q_IN_REGS, int QF>
__device__ __forceinline__ void gemm_qk_fp8(float (&s)[1][2][4], const uint32_t (&qf)[QF][4],
                                            const __half* q, const void* k, int lane) {
    static_assert(KSTEPS % 2 == 0, "two 16-column chunks per load");
    const int mi = lane / 8;
    const uint32_t k_row = opaque(smem_addr(k) + ((mi / 2) * 8 + lane % 8) * ROW_BYTES);
    const int y = (mi % 2) ^ (lane % 8);
    const uint32_t q_base =
        Q_IN_REGS ? 0 : opaque(smem_addr(q + (lane % 16) * STRIDE + (lane / 16) * 8));
#pragma unroll
    for (int kk = 0; kk < KSTEPS / 2; ++kk) {
        uint32_t bf[4];  // keys 0-7 chunks 2kk, 2kk + 1; keys 8-15 the same
        ldmatrix_x4(bf, k_row + (((2 * kk) ^ y) << 4));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int ks = 2 * kk + h;
            uint32_t a[4];
            if constexpr (Q_IN_REGS) {
#pragma unroll
                for (int j = 0; j < 4; ++j) a[j] = qf[ks][j];
            } else {
                ldmatrix_x4(a, q_base + ks * 16 * 2);
            }
            MmaOp<__half>::run(s[0][0], a, e4m3x2_to_f16x2(bf[h]), e4m3x2_hi_to_f16x2(bf[h]));
            MmaOp<__half>::run(s[0][1], a, e4m3x2_to_f16x2(bf[2 + h]),
                               e4m3x2_hi_to_f16x2(bf[2 + h]));
        }
    }
}

// O += P V for 16 keys of an e4m3 SwizzledRows V tile, P's f16 A fragments in registers.
// Chunk c's even columns accumulate in n8 tile 2c, its odd ones in 2c + 1.
template <int DT, int ROW_BYTES>
__device__ __forceinline__ void gemm_pv_fp8(float (&o)[1][DT][4], const uint32_t (&pa)[1][1][4],
                                            const void* v, int lane) {
    static_assert(DT % 4 == 0, "two 16-column chunks per load");
    const int mi = lane / 8;
    const uint32_t v_row = opaque(smem_addr(v) + ((mi % 2) * 8 + lane % 8) * ROW_BYTES);
    const int y = (mi / 2) ^ (lane % 8);
#pragma unroll
    for (int np = 0; np < DT / 4; ++np) {
        uint32_t bf[4];  // chunk 2np keys 0-7, keys 8-15; chunk 2np + 1 the same
        ldmatrix_x4_trans(bf, v_row + (((2 * np) ^ y) << 4));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            // Bytes (key 2t: col 2g, 2g + 1; key 2t + 1: the same) -> low half the even
            // column's key pair, high half the odd column's.
            const uint32_t lo = __byte_perm(bf[2 * h], 0, 0x3120);
            const uint32_t hi = __byte_perm(bf[2 * h + 1], 0, 0x3120);
            MmaOp<__half>::run(o[0][4 * np + 2 * h], pa[0][0], e4m3x2_to_f16x2(lo),
                               e4m3x2_to_f16x2(hi));
            MmaOp<__half>::run(o[0][4 * np + 2 * h + 1], pa[0][0], e4m3x2_hi_to_f16x2(lo),
                               e4m3x2_hi_to_f16x2(hi));
        }
    }
}

// Row `r` (0: g, 1: g + 8) of this lane's O accumulators in column order into `dst` (a row of
// D floats): chunk c's tiles 2c (even columns) and 2c + 1 (odd) hold columns 16c + 4t + {0,
// 2} and 16c + 4t + {1, 3}.
template <int DT>
__device__ __forceinline__ void store_o_fp8(float* dst, const float (&o)[1][DT][4], int r, int t) {
#pragma unroll
    for (int c = 0; c < DT / 2; ++c) {
        const float* ev = o[0][2 * c];
        const float* od = o[0][2 * c + 1];
        *reinterpret_cast<float4*>(dst + 16 * c + 4 * t) =
            make_float4(ev[2 * r], od[2 * r], ev[2 * r + 1], od[2 * r + 1]);
    }
}
