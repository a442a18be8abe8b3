// dQ by atomics (FlashAttention-2 Algorithm 2, line 20 as written): each dK/dV block adds
// its tile's dS K to an f32 buffer shaped like dq, and a last kernel scales and converts it.
// Saves the separate dQ kernel's recomputation of S and dP (2 of its 3 matmuls) at the price
// of a non-deterministic summation order.
#pragma once
#include "gemm.cuh"
#include "params.cuh"

// 4 bytes global -> shared, zero-filled when !valid (`src` must still be a valid address).
__device__ __forceinline__ void cp_async_4(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 4 : 0));
}

// Two adjacent f32 in one L2 atomic (sm_90; two scalar atomics before it); `addr` is 8-byte
// aligned.
__device__ __forceinline__ void red_add_v2(float* addr, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(addr), "f"(a), "f"(b)
                 : "memory");
#else
    atomicAdd(addr, a);
    atomicAdd(addr + 1, b);
#endif
}

// acc += dS K for this warp's MT x NT tiles: dS (queries x keys) is read from the key-major
// dS^T tile with ldmatrix.trans (A operand), K (keys x d, row-major) also with .trans (B).
// `ds_t` points at query column row0 of dS^T, `b` at column col0 of K.
template <typename T, int MT, int NT, int KSTEPS, int DS_STRIDE, int STRIDE>
__device__ __forceinline__ void gemm_dq(float (&acc)[MT][NT][4], const T* ds_t, const T* b,
                                        int lane) {
    static_assert(NT % 2 == 0, "B is loaded two n8 tiles at a time");
    const int mi = lane / 8;
    // Matrix mi of an A fragment covers queries (mi % 2) * 8.. and keys (mi / 2) * 8..
    const uint32_t a_base =
        opaque(smem_addr(ds_t + ((mi / 2) * 8 + lane % 8) * DS_STRIDE + (mi % 2) * 8));
    const uint32_t b_base = opaque(smem_addr(b + ((mi % 2) * 8 + lane % 8) * STRIDE + (mi / 2) * 8));
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
        uint32_t af[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            ldmatrix_x4_trans(af[mt], a_base + (kk * 16 * DS_STRIDE + mt * 16) * sizeof(T));
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
            uint32_t bf[4];
            ldmatrix_x4_trans(bf, b_base + (kk * 16 * STRIDE + np * 16) * sizeof(T));
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                MmaOp<T>::run(acc[mt][2 * np], af[mt], bf[0], bf[1]);
                MmaOp<T>::run(acc[mt][2 * np + 1], af[mt], bf[2], bf[3]);
            }
        }
    }
}

// Stores a warp's dS^T A fragments (MT key tiles x KT query k16 tiles, the layout pack_a
// produces) into the key-major shared tile, one 32-bit word per (row, column pair). The row
// pitch of BM + 8 elements puts the eight rows g of a store into distinct banks.
template <int MT, int KT, int DS_STRIDE, typename T>
__device__ __forceinline__ void store_ds_t(T* ds_t, const uint32_t (&a)[MT][KT][4], int lane) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int kk = 0; kk < KT; ++kk)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int row = mt * 16 + g + (j % 2) * 8, col = kk * 16 + (j / 2) * 8 + 2 * t;
                *reinterpret_cast<uint32_t*>(ds_t + row * DS_STRIDE + col) = a[mt][kk][j];
            }
}

// This tile's dQ contribution: dS (BM x BN) K (BN x D), split over the warps, added to
// dq_accum rows [m0, m0 + BM) that exist. dq_accum has dq's layout (o's strides) in f32.
template <class K>
__device__ __forceinline__ void dq_accumulate(const typename K::T* ds_t, const typename K::T* sK,
                                              float* dq_accum, int64_t row_stride, int m0,
                                              int seqlen_q, int d, int warp, int lane) {
    constexpr int MT = K::DQ_MT, NT = K::DQ_NT;
    const int row0 = (warp / K::DQ_WN) * MT * 16, col0 = (warp % K::DQ_WN) * NT * 8;
    float acc[MT][NT][4];
    zero(acc);
    gemm_dq<typename K::T, MT, NT, K::BN / 16, K::DS_STRIDE, K::STRIDE>(acc, ds_t + row0,
                                                                         sK + col0, lane);
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = m0 + row0 + mt * 16 + g + 8 * r;
            if (row >= seqlen_q) continue;  // would be the next sequence's row (or past the end)
            float* dst = dq_accum + int64_t(row) * row_stride;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int col = col0 + nt * 8 + 2 * t;
                if (col < d) red_add_v2(dst + col, acc[mt][nt][2 * r], acc[mt][nt][2 * r + 1]);
            }
        }
}

// dq = dq_accum * scale in q's dtype. dq and dq_accum share one contiguous layout whose
// every element belongs to some sequence (packed batches: cu_seqlens_q spans all total_q
// rows, checked on the host), so this is a flat pass; rows that no key reached convert the
// memset's zeros, which is their gradient.
template <typename T> __device__ __forceinline__ void flash_bwd_dq_convert(const BwdParams& bp) {
    const int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
    if (i >= bp.dq_accum_len) return;  // dq_accum_len is a multiple of 8 (d is)
    const float4 lo = *reinterpret_cast<const float4*>(bp.dq_accum + i);
    const float4 hi = *reinterpret_cast<const float4*>(bp.dq_accum + i + 4);
    const float s = bp.a.scale;
    uint4 out;
    out.x = MmaOp<T>::pack(lo.x * s, lo.y * s);
    out.y = MmaOp<T>::pack(lo.z * s, lo.w * s);
    out.z = MmaOp<T>::pack(hi.x * s, hi.y * s);
    out.w = MmaOp<T>::pack(hi.z * s, hi.w * s);
    *reinterpret_cast<uint4*>(static_cast<T*>(bp.dq) + i) = out;
}
