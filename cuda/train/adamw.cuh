// AdamW in two passes over a variable: the moments (m and v stacked in one f32 buffer
// (2, numel), updated in place from the gradient times `gscale`, which carries gradient
// clipping), then the decoupled-decay update of the f32 master weight in place. And the sum
// of squares of a gradient, added into one f32 for the global norm in a fixed order.
#pragma once
#include "train/common.cuh"

namespace train {

template <typename G>
__device__ void adamw_moments(float* __restrict__ mv, const G* __restrict__ grad, int64_t n,
                              float gscale, float beta1, float beta2) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const float g = to_f(grad[i]) * gscale;
    mv[i] = beta1 * mv[i] + (1.f - beta1) * g;
    mv[n + i] = beta2 * mv[n + i] + (1.f - beta2) * g * g;
  }
}

// w = w * (1 - lr * wd) - lr * (m / c1) / (sqrt(v / c2) + eps), c1/c2 the bias corrections.
__device__ void adamw_apply(float* __restrict__ w, const float* __restrict__ mv, int64_t n,
                            float lr, float decay, float c1, float c2, float eps) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const float m_hat = mv[i] / c1, v_hat = mv[n + i] / c2;
    w[i] = w[i] * decay - lr * m_hat / (sqrtf(v_hat) + eps);
  }
}

// acc: [0] the running sum, [1] a counter (u32 bits, 0 between launches), then one partial
// per block. Each block stores its partial; the last to finish (the counter) adds them up in
// block order and adds that to acc[0], so the sum is bitwise repeatable for a given grid.
template <typename G>
__device__ void sum_squares(const G* __restrict__ x, float* __restrict__ acc, int64_t n) {
  __shared__ float scratch[32];
  __shared__ bool last;
  float s = 0.f;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const float v = to_f(x[i]);
    s += v * v;
  }
  s = block_sum(s, scratch);
  unsigned* count = reinterpret_cast<unsigned*>(acc + 1);
  float* partial = acc + 2;
  if (threadIdx.x == 0) {
    partial[blockIdx.x] = s;
    __threadfence();
    last = atomicAdd(count, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  float t = 0.f;
  for (int b = threadIdx.x; b < gridDim.x; b += blockDim.x) t += __ldcg(partial + b);
  t = block_sum(t, scratch);
  if (threadIdx.x == 0) {
    acc[0] += t;
    *count = 0;
  }
}

}  // namespace train
