// Warp-level matmuls on tensor cores, the three shapes FlashAttention needs (forward and
// backward alike). Each warp computes MT m16 row tiles x NT n8 column tiles in the mma C
// layout (see mma.cuh). Shared tiles are row-major in a layout L of common/copy.cuh
// (PitchRows<STRIDE> or SwizzledRows<D>).
#pragma once
#include "common/copy.cuh"
#include "common/mma.cuh"

// A's MT m16 tiles of k16 step kk, row-major in shared memory from the lane's `a_base`.
template <typename T, int MT, class L>
__device__ __forceinline__ void load_a(uint32_t (&af)[MT][4], uint32_t a_base, int kk) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(af[mt], L::template at<T>(a_base, mt * 16, 2 * kk));
}

// One k16 step kk of acc += A B over B's NT n8 tiles, two per x4 load from the lane's
// `b_base`: B k-major in shared memory (TRANS: 16 x NT*8, read through ldmatrix.trans) or
// n-major (NT*8 x 16, as K for S = Q K^T); `a(mt)` is A's fragment of m16 tile mt.
template <typename T, int MT, int NT, class L, bool TRANS, class AFrag>
__device__ __forceinline__ void mma_b_step(float (&acc)[MT][NT][4], const AFrag& a,
                                           uint32_t b_base, int kk) {
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
        uint32_t bf[4];  // B of n8 tiles 2np (bf0, bf1) and 2np+1 (bf2, bf3)
        if constexpr (TRANS)
            ldmatrix_x4_trans(bf, L::template at<T>(b_base, kk * 16, 2 * np));
        else
            ldmatrix_x4(bf, L::template at<T>(b_base, np * 16, 2 * kk));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            MmaOp<T>::run(acc[mt][2 * np], a(mt), bf[0], bf[1]);
            MmaOp<T>::run(acc[mt][2 * np + 1], a(mt), bf[2], bf[3]);
        }
    }
}

// One k-step of gemm_ss: A (MT m16 tiles) and B (NT n8 tiles) of k16 step kk.
template <typename T, int MT, int NT, class L>
__device__ __forceinline__ void gemm_ss_step(float (&acc)[MT][NT][4], uint32_t a_base,
                                             uint32_t b_base, int kk) {
    uint32_t af[MT][4];
    load_a<T, MT, L>(af, a_base, kk);
    mma_b_step<T, MT, NT, L, false>(
        acc, [&](int mt) -> const uint32_t(&)[4] { return af[mt]; }, b_base, kk);
}

// acc += A B^T with A (MT*16 x 16*KSTEPS) and B (NT*8 x 16*KSTEPS) both row-major in shared
// memory: S = Q K^T, dP = dO V^T and their transposes. `a` and `b` point at the first row.
// The k-loop is unrolled fully (ptxas can then issue the next step's ldmatrix under this
// step's mma: +1-6% forward, +3-9% d = 128 backward on the H100; docs/archive/PERF.md, "the
// sm_80 set next to FlashAttention-2, counter by counter"); FULL = false unrolls it by two,
// for kernels that need the registers (the d = 64 backward was 2-5% slower fully unrolled;
// others spilled more).
template <typename T, int MT, int NT, int KSTEPS, class L, bool FULL = true>
__device__ __forceinline__ void gemm_ss(float (&acc)[MT][NT][4], const T* a, const T* b, int lane) {
    static_assert(NT % 2 == 0, "B is loaded two n8 tiles at a time");
    const int mi = lane / 8;  // which 8x8 matrix of an x4 load this lane addresses
    const uint32_t a_base = L::lane_base(a, lane % 16, lane / 16);
    const uint32_t b_base = L::lane_base(b, (mi / 2) * 8 + lane % 8, mi % 2);
    if constexpr (FULL) {
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) gemm_ss_step<T, MT, NT, L>(acc, a_base, b_base, kk);
    } else {
#pragma unroll 2
        for (int kk = 0; kk < KSTEPS; ++kk) gemm_ss_step<T, MT, NT, L>(acc, a_base, b_base, kk);
    }
}

// A C-layout accumulator (MT x NT n8 tiles, f32) as A fragments (MT x NT/2 k16 tiles, 16-bit):
// P for O += P V, dS for dQ += dS K, and the transposed ones for dV and dK.
template <typename T, int MT, int NT>
__device__ __forceinline__ void pack_a(const float (&c)[MT][NT][4], uint32_t (&a)[MT][NT / 2][4]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int kk = 0; kk < NT / 2; ++kk) {
            a[mt][kk][0] = MmaOp<T>::pack(c[mt][2 * kk][0], c[mt][2 * kk][1]);
            a[mt][kk][1] = MmaOp<T>::pack(c[mt][2 * kk][2], c[mt][2 * kk][3]);
            a[mt][kk][2] = MmaOp<T>::pack(c[mt][2 * kk + 1][0], c[mt][2 * kk + 1][1]);
            a[mt][kk][3] = MmaOp<T>::pack(c[mt][2 * kk + 1][2], c[mt][2 * kk + 1][3]);
        }
}

// acc += A B with A in registers (MT x KT k16 fragments) and B (KT*16 x NT*8) row-major in
// shared memory, read k-major through ldmatrix.trans: O += P V, dQ += dS K, dV += P^T dO,
// dK += dS^T Q. `b` points at B's first row and first column.
template <typename T, int MT, int KT, int NT, class L>
__device__ __forceinline__ void gemm_rs(float (&acc)[MT][NT][4], const uint32_t (&a)[MT][KT][4],
                                        const T* b, int lane) {
    static_assert(NT % 2 == 0, "B is loaded two n8 tiles at a time");
    const int mi = lane / 8;
    const uint32_t b_base = L::lane_base(b, (mi % 2) * 8 + lane % 8, mi / 2);
#pragma unroll
    for (int kk = 0; kk < KT; ++kk)
        mma_b_step<T, MT, NT, L, true>(
            acc, [&](int mt) -> const uint32_t(&)[4] { return a[mt][kk]; }, b_base, kk);
}

template <int MT, int NT> __device__ __forceinline__ void zero(float (&acc)[MT][NT][4]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;
}

// acc += A B with A (MT*16 x KT*16) and B (KT*16 x NT*8) both row-major in shared memory, A
// read as it is and B k-major through ldmatrix.trans: the backward's dV += P^T dO and
// dK += dS^T Q where P^T and dS^T were staged key-major by the warps that computed them.
// `a` points at A's first row, `b` at B's first row and column.
template <typename T, int MT, int KT, int NT, class LA, class LB>
__device__ __forceinline__ void gemm_st(float (&acc)[MT][NT][4], const T* a, const T* b, int lane) {
    static_assert(NT % 2 == 0, "B is loaded two n8 tiles at a time");
    const int mi = lane / 8;
    const uint32_t a_base = LA::lane_base(a, lane % 16, lane / 16);
    const uint32_t b_base = LB::lane_base(b, (mi % 2) * 8 + lane % 8, mi / 2);
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
        uint32_t af[MT][4];
        load_a<T, MT, LA>(af, a_base, kk);
        mma_b_step<T, MT, NT, LB, true>(
            acc, [&](int mt) -> const uint32_t(&)[4] { return af[mt]; }, b_base, kk);
    }
}
