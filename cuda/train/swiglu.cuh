// SwiGLU: y = silu(g) * u, and its backward
//   dg = dy * u * s * (1 + g * (1 - s)),  du = dy * g * s,  s = sigmoid(g).
#pragma once
#include "train/common.cuh"

namespace train {

// g and u are rows of `cols` elements `g_row` / `u_row` apart, so that the two halves of one
// fused gate-and-up projection `(rows, 2 * cols)` are read in place; y is dense.
template <typename T>
__device__ void swiglu_fwd(const T* __restrict__ g, int64_t g_row, const T* __restrict__ u,
                           int64_t u_row, T* __restrict__ y, int64_t rows, int cols) {
  const int64_t n = rows * cols;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / cols;
    const int64_t c = i - r * cols;
    const float gv = to_f(g[r * g_row + c]);
    y[i] = from_f<T>(gv / (1.f + __expf(-gv)) * to_f(u[r * u_row + c]));
  }
}

template <typename T>
__device__ void swiglu_bwd(const T* __restrict__ g, const T* __restrict__ u,
                           const T* __restrict__ dy, T* __restrict__ dg, T* __restrict__ du,
                           int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const float gv = to_f(g[i]), uv = to_f(u[i]), d = to_f(dy[i]);
    const float s = 1.f / (1.f + __expf(-gv));
    dg[i] = from_f<T>(d * uv * s * (1.f + gv * (1.f - s)));
    du[i] = from_f<T>(d * gv * s);
  }
}

}  // namespace train
