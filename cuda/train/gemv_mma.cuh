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
#include "train/norm.cuh"

namespace train {

constexpr int GEMV_MMA_MAX_M = 16;
constexpr int GEMV_MMA_WARPS = 16;  // blockDim.x <= 512

// Where load16 reads: the weight, streamed past L1; x through the read-only path; x's
// normalised copy in shared memory.
enum class From { Stream, ReadOnly, Shared };

// 16 elements of row `row` (rows `ld` elements apart) at [k0, k0 + 16), zero past `k`
// (k % 8 == 0: a vector is whole or absent) or for a row that is not there.
template <From FROM, typename T>
__device__ __forceinline__ void load16(uint32_t (&v)[8], const T* base, bool row_ok,
                                       int64_t row, int ld, int k, int k0) {
  const uint4* p = reinterpret_cast<const uint4*>(base + row * ld + k0);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint4 q = make_uint4(0, 0, 0, 0);
    if (row_ok && k0 + 8 * h < k) {
      if constexpr (FROM == From::Stream) q = __ldcs(p + h);
      else if constexpr (FROM == From::ReadOnly) q = __ldg(p + h);
      else q = p[h];
    }
    v[4 * h] = q.x;
    v[4 * h + 1] = q.y;
    v[4 * h + 2] = q.z;
    v[4 * h + 3] = q.w;
  }
}

// Row stride (elements) of the normalised rows in shared memory: 16 bytes of padding put the
// B fragments' loads of rows g and g + 1 (same column) in different banks.
__host__ __device__ constexpr int gemv_mma_norm_ld(int k) { return k + 8; }

// x's m rows normalised (RMSNorm with weight g, rounded as rms_norm_fwd rounds them) into
// dynamic shared memory, a warp per row (two rows at once where the block has fewer warps
// than rows): the rows' sums in parallel and one barrier, where a block-wide sum per row
// would cost sixteen barriers in turn. A lane asks for all its vectors of a 2048-element row
// (then of g) at once: one L2 round trip each, where a loop of dependent loads took eight.
template <typename T>
__device__ const T* gemv_mma_norm_rows(const T* __restrict__ x, const T* __restrict__ g, int m,
                                       int k, float eps) {
  constexpr int B = 8;  // vectors a lane has in flight per row
  extern __shared__ uint4 xs_norm[];
  const int chunks = k / 8, ld = gemv_mma_norm_ld(k) / 8;
  const int lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const uint4* gv = reinterpret_cast<const uint4*>(g);
  for (int r0 = threadIdx.x >> 5; r0 < m; r0 += 2 * warps) {
    const int rows[2] = {r0, r0 + warps};
    const bool two = rows[1] < m;
    float ss[2] = {0.f, 0.f};
    for (int c0 = lane; c0 < chunks; c0 += 32 * B) {
      uint4 v[2][B];
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int i = 0; i < B; ++i)
          v[h][i] = (h == 0 || two) && c0 + 32 * i < chunks
                        ? __ldg(reinterpret_cast<const uint4*>(x) + (int64_t)rows[h] * chunks +
                                c0 + 32 * i)
                        : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int i = 0; i < B; ++i) {
          ss[h] = sum_sq8<T>(ss[h], v[h][i]);
          if ((h == 0 || two) && c0 + 32 * i < chunks)
            xs_norm[rows[h] * ld + c0 + 32 * i] = v[h][i];
        }
    }
    float rstd[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) rstd[h] = exact_rstd(warp_sum(ss[h]), k, eps);
    // Each lane rewrites the vectors it stored itself: no barrier between the passes.
    for (int c0 = lane; c0 < chunks; c0 += 32 * B) {
      uint4 gw[B];
#pragma unroll
      for (int i = 0; i < B; ++i)
        gw[i] = c0 + 32 * i < chunks ? __ldg(gv + c0 + 32 * i) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (h == 1 && !two) break;
#pragma unroll
        for (int i = 0; i < B; ++i) {
          const int c = c0 + 32 * i;
          if (c >= chunks) break;
          uint4& slot = xs_norm[rows[h] * ld + c];
          slot = norm8<T>(slot, gw[i], rstd[h]);
        }
      }
    }
  }
  __syncthreads();
  return reinterpret_cast<const T*>(xs_norm);
}

// Output columns in tiles of 16 (grid-stride over groups of blockDim / 32 / split tiles),
// `split` warps per tile each summing one slice of k's 64-element chunks, the slices summed
// in warp order through shared memory (the same bits every run). NG token groups of 8: rows
// m <= 8 * NG. x (m, k), w (n, k), add (m, n) dense, k % 8 == 0, rows 16-byte aligned.
// `part` holds GEMV_MMA_WARPS x ACC x 32 floats (one buffer for both NG: static shared
// memory of each instantiation would add up past 48 KB). With NORM, x is first normalised
// (gemv_mma_norm_rows: weight gamma, eps) and the B operand read from shared memory.
template <typename T, int NG, bool SWIGLU, bool NORM>
__device__ void gemv_mma_rows(const T* __restrict__ x, const T* __restrict__ w,
                              const T* __restrict__ add, T* __restrict__ y, int m, int n,
                              int k, int split, float* part_flat,
                              const T* __restrict__ gamma, float eps) {
  constexpr int HALVES = SWIGLU ? 2 : 1;
  constexpr int ACC = 4 * NG * HALVES;
  // Chunks whose loads are in flight together: 8 KB of weight a warp either way.
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
  const T* xb_src = x;
  int x_ld = k;
  if (NORM) {
    xb_src = gemv_mma_norm_rows<T>(x, gamma, m, k, eps);
    x_ld = gemv_mma_norm_ld(k);
  }
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
            load16<From::Stream>(wa[u][s][0], w, in && r0, int64_t(j0 + g + s * outs), k, k,
                                 k0);
            load16<From::Stream>(wa[u][s][1], w, in && r1, int64_t(j0 + g + 8 + s * outs), k,
                                 k, k0);
          }
          // B: the rows of x (L2, or shared memory with NORM), token g of each group of 8.
#pragma unroll
          for (int q = 0; q < NG; ++q)
            load16<NORM ? From::Shared : From::ReadOnly>(xb[u][q], xb_src, in && g + 8 * q < m,
                                                         int64_t(g + 8 * q), x_ld, k, k0);
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

// g non-null: x normalised first (RMSNorm with weight g and eps), its rows padded to
// gemv_mma_norm_ld(k) in the launch's dynamic shared memory.
template <typename T, bool SWIGLU>
__device__ void gemv_mma(const T* x, const T* w, const T* add, T* y, int m, int n, int k,
                         int split, const T* g, float eps) {
  __shared__ float part[GEMV_MMA_WARPS * 4 * 2 * (SWIGLU ? 2 : 1) * 32];
  if (g != nullptr) {
    if (m <= 8) {
      gemv_mma_rows<T, 1, SWIGLU, true>(x, w, add, y, m, n, k, split, part, g, eps);
    } else {
      gemv_mma_rows<T, 2, SWIGLU, true>(x, w, add, y, m, n, k, split, part, g, eps);
    }
  } else if (m <= 8) {
    gemv_mma_rows<T, 1, SWIGLU, false>(x, w, add, y, m, n, k, split, part, g, eps);
  } else {
    gemv_mma_rows<T, 2, SWIGLU, false>(x, w, add, y, m, n, k, split, part, g, eps);
  }
}

}  // namespace train
