// SwiGLU: y = silu(g) * u, and its backward
//   dg = dy * u * s * (1 + g * (1 - s)),  du = dy * g * s,  s = sigmoid(g).
#pragma once
#include "train/common.cuh"

namespace train {

template <typename T>
__device__ void swiglu_fwd(const T* __restrict__ g, const T* __restrict__ u, T* __restrict__ y,
                           int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const float gv = to_f(g[i]);
    y[i] = from_f<T>(gv / (1.f + __expf(-gv)) * to_f(u[i]));
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
