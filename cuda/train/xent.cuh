// Cross-entropy per row of logits (n, vocab) against target ids, without a softmax in
// device memory: the forward keeps a running (max, sum of exp) per thread, merges them over
// the block and writes the row's lse and loss = lse - logit[target]; the backward reads that
// lse back and writes dlogits = dloss * (softmax - onehot(target)). The lse is kept, not
// rebuilt as loss + logit[target]: that sum carries the f32 loss's rounding (2.6% off in the
// softmax for a target logit of -1e6) and is inf - inf = NaN for a target logit of -inf,
// whose loss is inf and whose gradient is finite (as in PyTorch).
// Target IGNORE (u32::MAX) gives loss 0 and no gradient; any other target past the vocabulary
// gives NaN (never an out-of-bounds read); so does a NaN or +inf logit, through a NaN lse.
#pragma once
#include "train/common.cuh"

namespace train {

constexpr uint32_t IGNORE = 0xffffffffu;

__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
  const float mx = fmaxf(m, m2);
  if (mx == -INFINITY) return;
  s = s * __expf(m - mx) + s2 * __expf(m2 - mx);
  m = mx;
}

// One block per row; lse (n,) f32 is kept for the backward.
template <typename T>
__device__ void xent_fwd(const T* __restrict__ logits, const uint32_t* __restrict__ targets,
                         float* __restrict__ loss, float* __restrict__ lse, int64_t vocab) {
  __shared__ float ms[32], ss[32];
  const int64_t row = blockIdx.x;
  const T* x = logits + row * vocab;
  float m = -INFINITY, s = 0.f;
  // A NaN or +inf logit makes the row's lse NaN, as in PyTorch (a running max of +inf
  // alone would give lse = inf and a softmax of 0 everywhere but NaN at that column).
  bool nan = false;
  for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) {
    const float v = to_f(x[c]);
    nan |= !(v < INFINITY);
    if (v > m) {
      s = s * __expf(m - v) + 1.f;
      m = v;
    } else if (v > -INFINITY) {
      s += __expf(v - m);
    }
  }
  // Merge across the warp, then across warps.
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    lse_merge(m, s, m2, s2);
  }
  nan = __syncthreads_or(nan);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  if (lane == 0) {
    ms[warp] = m;
    ss[warp] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float M = -INFINITY, S = 0.f;
    for (int i = 0; i < warps; ++i) lse_merge(M, S, ms[i], ss[i]);
    const uint32_t t = targets[row];
    const float row_lse = nan ? __int_as_float(0x7fc00000) : M + __logf(S);
    float out;
    if (t == IGNORE) out = 0.f;
    else if (t >= vocab) out = __int_as_float(0x7fc00000);
    else out = row_lse - to_f(x[t]);
    loss[row] = out;
    lse[row] = row_lse;
  }
}

// One block per row; lse (n,) f32 from the forward, dloss (n,) f32 the gradient of each
// row's loss.
template <typename T>
__device__ void xent_bwd(const T* __restrict__ logits, const uint32_t* __restrict__ targets,
                         const float* __restrict__ lse, const float* __restrict__ dloss,
                         T* __restrict__ dlogits, int64_t vocab) {
  const int64_t row = blockIdx.x;
  const T* x = logits + row * vocab;
  T* dx = dlogits + row * vocab;
  const uint32_t t = targets[row];
  if (t == IGNORE) {
    for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) dx[c] = from_f<T>(0.f);
    return;
  }
  const float nanf = __int_as_float(0x7fc00000);
  const float row_lse = t < vocab ? lse[row] : nanf;
  const float g = dloss[row];
  for (int64_t c = threadIdx.x; c < vocab; c += blockDim.x) {
    const float p = __expf(to_f(x[c]) - row_lse);
    dx[c] = from_f<T>(g * (p - (c == (int64_t)t ? 1.f : 0.f)));
  }
}

}  // namespace train
