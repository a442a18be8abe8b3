// Rotary position embedding on (n, heads, d) with non-interleaved halves (the LLaMA layout):
// (a, b) -> (a cos - b sin, b cos + a sin) for a = x[j], b = x[j + d/2]. The backward is the
// rotation by the opposite angle, so one kernel serves both (`sign` = -1 in the backward).
#pragma once
#include "train/common.cuh"

namespace train {

// One thread per (token, head, j < d/2); cos and sin are (n, d/2) f32.
template <typename T>
__device__ void rotary(const T* __restrict__ x, const float* __restrict__ cos_t,
                       const float* __restrict__ sin_t, T* __restrict__ y, int64_t n, int heads,
                       int half, float sign) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n * heads * half) return;
  const int j = (int)(i % half);
  const int64_t th = i / half;  // token * heads + head
  const int64_t tok = th / heads;
  const float c = cos_t[tok * half + j], s = sign * sin_t[tok * half + j];
  const int64_t base = th * 2 * half;
  const float a = to_f(x[base + j]), b = to_f(x[base + j + half]);
  y[base + j] = from_f<T>(a * c - b * s);
  y[base + j + half] = from_f<T>(b * c + a * s);
}

}  // namespace train
