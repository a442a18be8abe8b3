// The few rows of a decoding step times a weight matrix: y = x w^T (+ add), or with SWIGLU
// h = silu(x wg^T) * (x wu^T) for w = [wg; wu] stacked by rows. At one to four rows the product
// is a read of the weight and nothing else, and a GEMM's tiles (cuBLAS picks 64 x 8) leave
// most of a small matrix's bandwidth unused; here every warp streams whole weight rows with
// 16-byte loads, so every multiprocessor has many rows in flight.
#pragma once
#include "common/pdl.cuh"
#include "train/common.cuh"
#include "train/norm.cuh"

namespace train {

constexpr int GEMV_MAX_M = 4;
constexpr int GEMV_MAX_WARPS = 8;  // blockDim.x <= 256

// acc + the dot product of eight elements of w and x.
template <typename T> __device__ __forceinline__ float dot8(float acc, uint4 w, uint4 x) {
  const uint32_t ws[4] = {w.x, w.y, w.z, w.w}, xs[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 a = pair_f(ws[i], T()), b = pair_f(xs[i], T());
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
  }
  return acc;
}

// x's M rows normalised (RMSNorm with weight g, as rms_norm_fwd rounds them) into shared
// memory, for the product that follows: every block recomputes the norm of the few rows (a
// few KB read from L2) rather than a kernel of its own writing them for the next to read.
template <typename T, int M>
__device__ const uint4* gemv_norm_rows(const T* __restrict__ x, const T* __restrict__ g, int k,
                                       float eps) {
  extern __shared__ uint4 xs[];
  __shared__ float scratch[32];
  const int chunks = k / 8;
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  const uint4* gv = reinterpret_cast<const uint4*>(g);
#pragma unroll
  for (int m = 0; m < M; ++m) {
    float ss = 0.f;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x)
      ss = sum_sq8<T>(ss, __ldg(xv + (int64_t)m * chunks + c));
    const float rstd = exact_rstd(block_sum(ss, scratch), k, eps);
    for (int c = threadIdx.x; c < chunks; c += blockDim.x)
      xs[m * chunks + c] = norm8<T>(__ldg(xv + (int64_t)m * chunks + c), __ldg(gv + c), rstd);
  }
  __syncthreads();
  return xs;
}

// Output columns in groups of blockDim / 32 / split (grid-stride over the groups), `split`
// warps per column, each summing one slice of k: the dot products of x's M rows with weight
// row j (and, with SWIGLU, row j + outs). Long rows are split so that a block keeps as many
// 16-byte loads in flight as with short ones; the slices are summed in warp order through
// shared memory (the same bits every run). x (M, k), w (n, k) and add (M, n) dense,
// k % 8 == 0, every row 16-byte aligned; y (M, outs) with outs = n, or n / 2 with SWIGLU.
// With NORM, x is first normalised by gemv_norm_rows (weight g, eps) and read from shared
// memory.
template <typename T, int M, bool SWIGLU, bool NORM>
__device__ void gemv_rows(const T* __restrict__ x, const T* __restrict__ w,
                          const T* __restrict__ add, T* __restrict__ y, int n, int k,
                          int split, const T* __restrict__ g, float eps) {
  __shared__ float part[GEMV_MAX_WARPS][2 * GEMV_MAX_M];
  // The grid is one wave of resident blocks (src/infer/linear.rs), so once every block has
  // started, the kernel launched programmatically after this one may take what the wave
  // leaves free: its blocks ask L2 for their first loads while this one streams, and wait
  // in pdl_wait for its completion (the 1B model's batch-1 step: 7% faster).
  pdl_launch_dependents();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int per_block = (blockDim.x >> 5) / split;
  const int slot = warp / split, sub = warp % split;
  const int chunks = k / 8;
  const int c_begin = sub * chunks / split, c_end = (sub + 1) * chunks / split;
  const int outs = SWIGLU ? n / 2 : n;
  const int groups = (outs + per_block - 1) / per_block;
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  // Launched programmatically, the block may start while the kernel ahead (which wrote x, or
  // reads memory y may reuse) finishes: until pdl_wait it only asks L2 for the first 2 KB of
  // its first weight slices, which no kernel writes.
  if (blockIdx.x < groups && blockIdx.x * per_block + slot < outs) {
    const int j = blockIdx.x * per_block + slot;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int c = c_begin + lane + 32 * i;
      if (c >= c_end) break;
      asm volatile("prefetch.global.L2 [%0];" ::"l"(w + (int64_t)j * k + c * 8));
      if (SWIGLU) asm volatile("prefetch.global.L2 [%0];" ::"l"(w + (int64_t)(j + outs) * k + c * 8));
    }
  }
  pdl_wait();
  if (NORM) xv = gemv_norm_rows<T, M>(x, g, k, eps);
  for (int gi = blockIdx.x; gi < groups; gi += gridDim.x) {
    const int j = gi * per_block + slot;
    float acc[M], acc2[M];
#pragma unroll
    for (int m = 0; m < M; ++m) acc[m] = acc2[m] = 0.f;
    if (j < outs) {
      const uint4* wr = reinterpret_cast<const uint4*>(w + (int64_t)j * k);
      const uint4* wr2 = reinterpret_cast<const uint4*>(w + (int64_t)(j + outs) * k);
#pragma unroll 4
      for (int c = c_begin + lane; c < c_end; c += 32) {
        // The weight is read once per step: streamed past L1. x is reread by every warp.
        const uint4 wv = __ldcs(wr + c);
        uint4 wv2;
        if (SWIGLU) wv2 = __ldcs(wr2 + c);
#pragma unroll
        for (int m = 0; m < M; ++m) {
          // Shared memory with NORM: a generic load there, the read-only path otherwise.
          const uint4 xm = NORM ? xv[m * chunks + c] : __ldg(xv + (int64_t)m * chunks + c);
          acc[m] = dot8<T>(acc[m], wv, xm);
          if (SWIGLU) acc2[m] = dot8<T>(acc2[m], wv2, xm);
        }
      }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
      acc[m] = warp_sum(acc[m]);
      if (SWIGLU) acc2[m] = warp_sum(acc2[m]);
    }
    if (split > 1) {
      if (lane == 0) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
          part[warp][m] = acc[m];
          part[warp][GEMV_MAX_M + m] = acc2[m];
        }
      }
      __syncthreads();
      if (sub == 0) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
          for (int s = 1; s < split; ++s) {
            acc[m] += part[warp + s][m];
            acc2[m] += part[warp + s][GEMV_MAX_M + m];
          }
        }
      }
      __syncthreads();
    }
    if (sub != 0 || lane != 0 || j >= outs) continue;
#pragma unroll
    for (int m = 0; m < M; ++m) {
      if (SWIGLU) {
        // The products rounded as the GEMM's output is before the SwiGLU.
        const float gr = to_f(from_f<T>(acc[m])), ur = to_f(from_f<T>(acc2[m]));
        y[(int64_t)m * outs + j] = from_f<T>(gr / (1.f + __expf(-gr)) * ur);
      } else {
        float v = acc[m];
        if (add != nullptr) v = to_f(from_f<T>(v)) + to_f(add[(int64_t)m * n + j]);
        y[(int64_t)m * outs + j] = from_f<T>(v);
      }
    }
  }
}

template <typename T, bool SWIGLU, bool NORM>
__device__ void gemv_m(const T* x, const T* w, const T* add, T* y, int m, int n, int k, int split,
                       const T* g, float eps) {
  switch (m) {
    case 1: gemv_rows<T, 1, SWIGLU, NORM>(x, w, add, y, n, k, split, g, eps); break;
    case 2: gemv_rows<T, 2, SWIGLU, NORM>(x, w, add, y, n, k, split, g, eps); break;
    case 3: gemv_rows<T, 3, SWIGLU, NORM>(x, w, add, y, n, k, split, g, eps); break;
    case 4: gemv_rows<T, 4, SWIGLU, NORM>(x, w, add, y, n, k, split, g, eps); break;
    default: break;  // more rows: the tensor-core kernel (gemv_mma.cuh) or the GEMM
  }
}

// g non-null: x normalised first (RMSNorm with weight g and eps; one to four rows, whose
// normalised copy the launch gives as dynamic shared memory).
template <typename T, bool SWIGLU>
__device__ void gemv(const T* x, const T* w, const T* add, T* y, int m, int n, int k, int split,
                     const T* g, float eps) {
  if (g != nullptr) {
    gemv_m<T, SWIGLU, true>(x, w, add, y, m, n, k, split, g, eps);
  } else {
    gemv_m<T, SWIGLU, false>(x, w, add, y, m, n, k, split, g, eps);
  }
}

}  // namespace train
