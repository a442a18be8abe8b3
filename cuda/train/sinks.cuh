// Attention sinks (gpt-oss): a logit per head that joins every query row's softmax
// denominator and has no value. The attention kernels run without it; `sinks_fwd` turns their
// (O, lse) into the result with the sink, `sinks_grad` gives the sink's gradient.
//
// Layouts: O (outer, rows, heads, d) contiguous, lse (outer, heads, rows) f32. The
// fixed-length forward's (b, sq, h, d) and (b, h, sq) have outer = b, rows = sq; the packed
// (total_q, h, d) and (h, total_q) have outer = 1, rows = total_q. A row `r` below is
// outer * rows + row, so that O's row of head h starts at (r * heads + h) * d.
#pragma once
#include "train/common.cuh"

namespace train {

// log(exp(a) + exp(b)): the other where one is -inf, NaN where either is.
__device__ __forceinline__ float log_add_exp(float a, float b) {
  if (a == -INFINITY) return b;
  if (b == -INFINITY) return a;
  if (a == b) return a + 0.693147180559945309f;  // also +inf + +inf, where a - b is NaN
  return fmaxf(a, b) + log1pf(expf(-fabsf(a - b)));
}

__device__ __forceinline__ int64_t sinks_lse_index(int64_t r, int h, int rows, int heads) {
  return (r / rows * heads + h) * rows + r % rows;
}

// One warp per (row, head): lse becomes L = log(exp(lse) + exp(sink)), and O's row is scaled by
// exp(lse - L), the share of the keys in the new denominator (0 where lse = -inf: the row saw
// no key, its O stays zero and L = sink; NaN where a NaN sink made L NaN). Consecutive warps
// take consecutive heads of a row, which lie next to each other in O.
template <typename T>
__device__ void sinks_fwd(T* __restrict__ o, float* __restrict__ lse,
                          const float* __restrict__ sinks, int64_t n, int rows, int heads,
                          int d) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = (int64_t)gridDim.x * (blockDim.x >> 5);
  for (int64_t w = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); w < n * heads;
       w += warps) {
    const int64_t r = w / heads;
    const int h = (int)(w % heads);
    const int64_t li = sinks_lse_index(r, h, rows, heads);
    const float m = lse[li];
    const float l = log_add_exp(m, sinks[h]);
    const float share = m == -INFINITY && !isnan(l) ? 0.f : expf(m - l);
    T* row = o + (r * heads + h) * d;
    for (int c = lane; c < d; c += 32) row[c] = from_f<T>(to_f(row[c]) * share);
    // Every lane has read lse[li] before lane 0 overwrites it.
    __syncwarp();
    if (lane == 0) lse[li] = l;
  }
}

constexpr int SINKS_GRAD_ROWS = 64;

// The sink's share of row r is P = exp(sink - L), and its gradient -P * rowsum(dO * O): the
// softmax's dS = P (dP - D) with dP = 0 (no value) and D = rowsum(dO * O) over the keys.
// Block (chunk, h) = blockIdx.x as chunk * heads + h sums the rows chunk * SINKS_GRAD_ROWS ..
// + SINKS_GRAD_ROWS of head h, each warp its rows in order, then the warps in a fixed tree,
// into part[blockIdx.x]: (chunks, heads) partials that train_rms_dw sums in chunk order. No
// atomics: the same bits on every run.
template <typename T>
__device__ void sinks_grad(const T* __restrict__ o, const T* __restrict__ dout,
                           const float* __restrict__ lse, const float* __restrict__ sinks,
                           float* __restrict__ part, int64_t n, int rows, int heads, int d) {
  __shared__ float scratch[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int h = (int)(blockIdx.x % heads);
  const int64_t r0 = (int64_t)(blockIdx.x / heads) * SINKS_GRAD_ROWS;
  const int64_t r1 = min(r0 + SINKS_GRAD_ROWS, n);
  const float sink = sinks[h];
  float acc = 0.f;
  for (int64_t r = r0 + warp; r < r1; r += nwarps) {
    const T* orow = o + (r * heads + h) * d;
    const T* grow = dout + (r * heads + h) * d;
    float dot = 0.f;
    for (int c = lane; c < d; c += 32) dot += to_f(orow[c]) * to_f(grow[c]);
    dot = warp_sum(dot);
    // A sink of -inf is no sink: P = 0 even on rows without keys, where L = -inf too.
    const float p =
        sink == -INFINITY ? 0.f : expf(sink - lse[sinks_lse_index(r, h, rows, heads)]);
    acc -= p * dot;
  }
  // warp_sum gave every lane the same dot: one lane per warp enters the block's sum.
  const float total = block_sum(lane == 0 ? acc : 0.f, scratch);
  if (threadIdx.x == 0) part[blockIdx.x] = total;
}

}  // namespace train
