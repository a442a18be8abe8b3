// dQ by atomics (FlashAttention-2 Algorithm 2, line 20 as written): each dK/dV block adds
// its tile's dS K to an f32 buffer shaped like dq, and a last kernel scales and converts it.
// Saves the separate dQ kernel's recomputation of S and dP (2 of its 3 matmuls) at the price
// of a non-deterministic summation order.
#pragma once
#include "common/gemm.cuh"
#include "common/params.cuh"
#include "common/seq_info.cuh"

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

// Four adjacent f32 in one L2 atomic (sm_90); `addr` is 16-byte aligned.
__device__ __forceinline__ void red_add_v4(float* addr, const float (&x)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(addr), "f"(x[0]),
                 "f"(x[1]), "f"(x[2]), "f"(x[3])
                 : "memory");
#else
    for (int i = 0; i < 4; ++i) atomicAdd(addr + i, x[i]);
#endif
}

// acc += dS K for this warp's MT x NT tiles: dS (queries x keys) is read from the key-major
// dS^T tile with ldmatrix.trans (A operand), K (keys x d, row-major) also with .trans (B).
// `ds_t` points at query column row0 of dS^T, `b` at column col0 of K.
template <typename T, int MT, int NT, int KSTEPS, class LA, class LB>
__device__ __forceinline__ void gemm_dq(float (&acc)[MT][NT][4], const T* ds_t, const T* b,
                                        int lane) {
    static_assert(NT % 2 == 0, "B is loaded two n8 tiles at a time");
    const int mi = lane / 8;
    // Matrix mi of an A fragment covers queries (mi % 2) * 8.. and keys (mi / 2) * 8..
    const uint32_t a_base = LA::lane_base(ds_t, (mi / 2) * 8 + lane % 8, mi % 2);
    const uint32_t b_base = LB::lane_base(b, (mi % 2) * 8 + lane % 8, mi / 2);
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
        uint32_t af[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            ldmatrix_x4_trans(af[mt], LA::template at<T>(a_base, kk * 16, 2 * mt));
        mma_b_step<T, MT, NT, LB, true>(
            acc, [&](int mt) -> const uint32_t(&)[4] { return af[mt]; }, b_base, kk);
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

// The fused mma.sync kernels accumulate dQ in a tiled f32 buffer (FlashAttention-2's
// layout for its dQ atomics): per (query head, tile of BM rows) one contiguous BM x D block
// in which every thread's accumulator fragment owns whole runs of DQ_VEC * 32 floats, lane by
// lane. Each atomic instruction of a warp then covers full 32-byte sectors (in dq's own
// layout a warp instruction touched half of 8 sectors: 43% of the kernel's L2 sectors were
// excess, Nsight Compute on the H100), and it needs no row or column bounds: the tile is
// whole, and the convert pass writes back only rows < seqlen_q and columns < d.
// sm_90 adds two floats per lane in one `red.global.add.v2`; before it, one per atomic.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
constexpr int DQ_VEC = 2;
#else
constexpr int DQ_VEC = 1;
#endif

// Offset of fragment element i (of FRAG per thread) of `warp`'s lane in a tile.
template <int FRAG>
__device__ __forceinline__ int dq_slot(int warp, int i, int lane) {
    return (warp * FRAG + i - i % DQ_VEC) * 32 + lane * DQ_VEC + i % DQ_VEC;
}

// Offset of the tile of rows [m0, m0 + BM) of (sequence b, query head h). A sequence's tiles
// start at row floor((first row + BM b) / BM) BM of a (h, dq_tile_rows, D) buffer, with
// dq_tile_rows = total_q + BM batch: each sequence gets its whole tiles without overlap
// (the BM b term keeps at least one tile's room between neighbours).
template <class K>
__device__ __forceinline__ int64_t dq_tile_offset(const BwdParams& bp, const SeqInfo& seq, int b,
                                                  int h, int m0) {
    const int64_t first = bp.a.cu_seqlens_q != nullptr ? seq.q_start
                                                       : int64_t(b) * bp.a.seqlen_q;
    const int64_t row0 = (first + int64_t(K::BM) * b) / K::BM * K::BM;
    return (int64_t(h) * bp.dq_tile_rows + row0 + m0) * K::D;
}

// This tile's dQ contribution: dS (BM x BN) K (BN x D), split over the warps, added to the
// tile at `tile` (dq_tile_offset). K::DQ_PASSES > 1 computes each warp's columns in that many
// passes, each with a fraction of the accumulators (registers for kernels that hold dK and dV
// for many columns), reading dS once per pass.
template <class K>
__device__ __forceinline__ void dq_accumulate(const typename K::T* ds_t, const typename K::T* sK,
                                              float* tile, int warp, int lane) {
    constexpr int MT = K::DQ_MT, NT = K::DQ_NT, FRAG = K::DQ_FRAG, PASSES = K::DQ_PASSES;
    constexpr int PNT = NT / PASSES;
    static_assert(PNT * PASSES == NT && PNT % 2 == 0, "whole pairs of n8 tiles per pass");
    const int row0 = K::dq_row0(warp), col0 = K::dq_col0(warp);
    // One pointer per thread, then compile-time offsets from it, which fold into the atomics'
    // address field (offsets computed per atomic in 32 bits cost four integer instructions
    // each to widen and add: ptxas, sm_80).
    float* const base = tile + dq_slot<FRAG>(warp, 0, lane);
#pragma unroll
    for (int pass = 0; pass < PASSES; ++pass) {
        float acc[MT][PNT][4];
        zero(acc);
        // Each warp's and pass's K columns start a multiple of PNT chunks in, PNT a power of
        // two: no low bits in common with the lane's chunk or the loads' 2 np
        // (SwizzledRows::lane_base).
        static_assert(K::Rows::ROW_PERIOD == 1 || (PNT & (PNT - 1)) == 0,
                      "swizzled K: column offsets of whole power-of-two chunks");
        gemm_dq<typename K::T, MT, PNT, K::BN / 16, PitchRows<K::DS_STRIDE>, typename K::Rows>(
            acc, ds_t + row0, sK + col0 + pass * PNT * 8, lane);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < PNT; ++j)
#pragma unroll
                for (int e = 0; e < 4; e += DQ_VEC) {
                    const int nt = pass * PNT + j;
                    float* dst = base + ((mt * NT + nt) * 4 + e) * 32;  // = dq_slot(.., i, ..)
                    if constexpr (DQ_VEC == 2)
                        red_add_v2(dst, acc[mt][j][e], acc[mt][j][e + 1]);
                    else
                        atomicAdd(dst, acc[mt][j][e]);
                }
    }
}

// dq = tile * scale for one tile of a tiled buffer: the block has the fused kernel's warps,
// and each thread reads back the fragments it added (coalesced) and writes their rows < seqlen_q
// and columns < d. Tiles that no key reached convert the memset's zeros: their gradient.
template <class K> __device__ __forceinline__ void flash_bwd_dq_convert_tiled(const BwdParams& bp) {
    using T = typename K::T;
    constexpr int MT = K::DQ_MT, NT = K::DQ_NT, FRAG = K::DQ_FRAG;
    const AttnParams& p = bp.a;
    const int m0 = blockIdx.x * K::BM, bidh = blockIdx.y, bidb = blockIdx.z;
    const SeqInfo seq(p, bidb);
    if (m0 >= seq.seqlen_q) return;
    const float* tile = bp.dq_accum + dq_tile_offset<K>(bp, seq, bidb, bidh, m0);
    T* dq = static_cast<T*>(bp.dq) +
            seq.q_offset(p.o_batch_stride, p.o_row_stride, p.o_head_stride, bidb, bidh);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int row0 = K::dq_row0(warp), col0 = K::dq_col0(warp);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int i = (mt * NT + nt) * 4 + 2 * r;
                const int row = m0 + row0 + mt * 16 + g + 8 * r, col = col0 + nt * 8 + 2 * t;
                if (row >= seq.seqlen_q || col >= p.d) continue;
                const float a = tile[dq_slot<FRAG>(warp, i, lane)];
                const float b = tile[dq_slot<FRAG>(warp, i + 1, lane)];
                *reinterpret_cast<uint32_t*>(dq + int64_t(row) * p.o_row_stride + col) =
                    MmaOp<T>::pack(a * p.grad_scale, b * p.grad_scale);
            }
}

// The wgmma kernel's dQ (sm90/bwd.cu) is summed in dq's own layout:
// dq = dq_accum * scale in q's dtype. dq and dq_accum share one contiguous layout whose
// every element belongs to some sequence (packed batches: cu_seqlens_q spans all total_q
// rows, checked on the host), so this is a flat pass; rows that no key reached convert the
// memset's zeros, which is their gradient.
template <typename T> __device__ __forceinline__ void flash_bwd_dq_convert(const BwdParams& bp) {
    const int64_t i = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
    if (i >= bp.dq_accum_len) return;  // dq_accum_len is a multiple of 8 (d is)
    const float4 lo = *reinterpret_cast<const float4*>(bp.dq_accum + i);
    const float4 hi = *reinterpret_cast<const float4*>(bp.dq_accum + i + 4);
    const float s = bp.a.grad_scale;
    uint4 out;
    out.x = MmaOp<T>::pack(lo.x * s, lo.y * s);
    out.y = MmaOp<T>::pack(lo.z * s, lo.w * s);
    out.z = MmaOp<T>::pack(hi.x * s, hi.y * s);
    out.w = MmaOp<T>::pack(hi.z * s, hi.w * s);
    *reinterpret_cast<uint4*>(static_cast<T*>(bp.dq) + i) = out;
}
