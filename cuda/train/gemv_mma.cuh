// A decoding step's five to sixteen rows times a weight, on tensor cores: y = x w^T (+ add),
// or with SWIGLU h = silu(x wg^T) * (x wu^T). Each weight element now serves several rows, so
// a dot product per lane (gemv.cuh) would be bound by its FMAs; a GEMM's 64-row tiles waste
// three quarters of their work on rows that are not there. Here the weight is the mma's A
// operand (16 output columns), the rows its B operand (8 or 16 of them), and every lane
// streams its 32 contiguous bytes of two weight rows per 64-element chunk of k.
//
// The k order inside a chunk is permuted: the PTX fragment of m16n8k16 gives lane (g, t) the
// logical k 2t, 2t+1, 2t+8, 2t+9 of each step; here step j maps them to the physical
// 16t + 4j + {0, 1, 2, 3}, the same bijection for A and B, so the sums are those of the
// product while each lane's loads stay two 16-byte vectors per row.
#pragma once
#include "common/mma.cuh"
#include "common/pdl.cuh"
#include "train/common.cuh"

namespace train {

constexpr int GEMV_MMA_MAX_M = 16;
constexpr int GEMV_MMA_WARPS = 16;  // blockDim.x <= 512

// 16 elements of row `r` at [k0, k0 + 16), zero past `k` (k % 8 == 0: a vector is whole or
// absent) or for a row that is not there.
template <bool STREAM, typename T>
__device__ __forceinline__ void load16(uint32_t (&v)[8], const T* base, bool row_ok,
                                       int64_t row, int k, int k0) {
  const uint4* p = reinterpret_cast<const uint4*>(base + row * k + k0);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint4 q = make_uint4(0, 0, 0, 0);
    if (row_ok && k0 + 8 * h < k) q = STREAM ? __ldcs(p + h) : __ldg(p + h);
    v[4 * h] = q.x;
    v[4 * h + 1] = q.y;
    v[4 * h + 2] = q.z;
    v[4 * h + 3] = q.w;
  }
}

// Output columns in tiles of 16 (grid-stride over groups of blockDim / 32 / split tiles),
// `split` warps per tile each summing one slice of k's 64-element chunks, the slices summed
// in warp order through shared memory (the same bits every run). NG token groups of 8: rows
// m <= 8 * NG. x (m, k), w (n, k), add (m, n) dense, k % 8 == 0, rows 16-byte aligned.
// `part` holds GEMV_MMA_WARPS x ACC x 32 floats (one buffer for both NG: static shared
// memory of each instantiation would add up past 48 KB).
template <typename T, int NG, bool SWIGLU>
__device__ void gemv_mma_rows(const T* __restrict__ x, const T* __restrict__ w,
                              const T* __restrict__ add, T* __restrict__ y, int m, int n,
                              int k, int split, float* part_flat) {
  constexpr int HALVES = SWIGLU ? 2 : 1;
  constexpr int ACC = 4 * NG * HALVES;
  // Chunks whose loads are in flight together: 4 KB of weight a warp either way.
  constexpr int U = SWIGLU ? 2 : 4;
  auto part = reinterpret_cast<float(*)[ACC][32]>(part_flat);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int per_block = (blockDim.x >> 5) / split;
  const int slot = warp / split, sub = warp % split;
  const int chunks = (k + 63) / 64;
  const int c_begin = sub * chunks / split, c_end = (sub + 1) * chunks / split;
  const int outs = SWIGLU ? n / 2 : n;
  const int tiles = (outs + 15) / 16;
  const int groups = (tiles + per_block - 1) / per_block;
  pdl_wait();
  for (int gi = blockIdx.x; gi < groups; gi += gridDim.x) {
    const int j0 = (gi * per_block + slot) * 16;
    float acc[HALVES][NG][4];
#pragma unroll
    for (int s = 0; s < HALVES; ++s)
#pragma unroll
      for (int q = 0; q < NG; ++q)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[s][q][e] = 0.f;
    if (j0 < outs) {
      const bool r0 = j0 + g < outs, r1 = j0 + g + 8 < outs;
      // U chunks' loads issued before any of their mma: the loads and the mma are both
      // inline asm the compiler keeps in order, so a plain unrolled loop would wait for
      // each chunk before asking for the next.
      for (int c0 = c_begin; c0 < c_end; c0 += U) {
        uint32_t wa[U][HALVES][2][8];
        uint32_t xb[U][NG][8];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const bool in = c0 + u < c_end;
          const int k0 = (c0 + u) * 64 + 16 * t;
          // A: weight rows j0 + g and j0 + g + 8 (and the up half's, outs further on).
#pragma unroll
          for (int s = 0; s < HALVES; ++s) {
            load16<true>(wa[u][s][0], w, in && r0, int64_t(j0 + g + s * outs), k, k0);
            load16<true>(wa[u][s][1], w, in && r1, int64_t(j0 + g + 8 + s * outs), k, k0);
          }
          // B: the rows of x, token g of each group of 8.
#pragma unroll
          for (int q = 0; q < NG; ++q)
            load16<false>(xb[u][q], x, in && g + 8 * q < m, int64_t(g + 8 * q), k, k0);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
          for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int s = 0; s < HALVES; ++s) {
              const uint32_t a[4] = {wa[u][s][0][2 * j], wa[u][s][1][2 * j],
                                     wa[u][s][0][2 * j + 1], wa[u][s][1][2 * j + 1]};
#pragma unroll
              for (int q = 0; q < NG; ++q)
                MmaOp<T>::run(acc[s][q], a, xb[u][q][2 * j], xb[u][q][2 * j + 1]);
            }
          }
        }
      }
    }
    if (split > 1) {
#pragma unroll
      for (int s = 0; s < HALVES; ++s)
#pragma unroll
        for (int q = 0; q < NG; ++q)
#pragma unroll
          for (int e = 0; e < 4; ++e) part[warp][(s * NG + q) * 4 + e][lane] = acc[s][q][e];
      __syncthreads();
      if (sub == 0) {
        for (int o = 1; o < split; ++o) {
#pragma unroll
          for (int s = 0; s < HALVES; ++s)
#pragma unroll
            for (int q = 0; q < NG; ++q)
#pragma unroll
              for (int e = 0; e < 4; ++e) acc[s][q][e] += part[warp + o][(s * NG + q) * 4 + e][lane];
        }
      }
      __syncthreads();
    }
    if (sub != 0 || j0 >= outs) continue;
    // Accumulator e of group q: column j0 + g (+ 8 for e >= 2), token 8q + 2t + (e & 1).
#pragma unroll
    for (int q = 0; q < NG; ++q) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = j0 + g + (e >> 1) * 8, tok = 8 * q + 2 * t + (e & 1);
        if (col >= outs || tok >= m) continue;
        if (SWIGLU) {
          // The products rounded as the GEMM's output is before the SwiGLU.
          const float gr = to_f(from_f<T>(acc[0][q][e])), ur = to_f(from_f<T>(acc[HALVES - 1][q][e]));
          y[(int64_t)tok * outs + col] = from_f<T>(gr / (1.f + __expf(-gr)) * ur);
        } else {
          float v = acc[0][q][e];
          if (add != nullptr) v = to_f(from_f<T>(v)) + to_f(add[(int64_t)tok * n + col]);
          y[(int64_t)tok * outs + col] = from_f<T>(v);
        }
      }
    }
  }
}

template <typename T, bool SWIGLU>
__device__ void gemv_mma(const T* x, const T* w, const T* add, T* y, int m, int n, int k,
                         int split) {
  __shared__ float part[GEMV_MMA_WARPS * 4 * 2 * (SWIGLU ? 2 : 1) * 32];
  if (m <= 8) {
    gemv_mma_rows<T, 1, SWIGLU>(x, w, add, y, m, n, k, split, part);
  } else {
    gemv_mma_rows<T, 2, SWIGLU>(x, w, add, y, m, n, k, split, part);
  }
}

}  // namespace train
