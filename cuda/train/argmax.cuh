// The index of each row's largest element (greedy decoding over a vocabulary): a block per
// row, every lane streaming 16-byte vectors, the (value, index) pairs reduced as one 64-bit
// key. The key orders values as floats do, NaN above everything (as torch.argmax), and among
// equal values the first index.
#pragma once
#include "train/common.cuh"

namespace train {

// An order-preserving 32-bit image of a float (its sign flips the rest), any NaN on top,
// above the row's inverted index so that max() picks the first of equal values.
__device__ __forceinline__ unsigned long long argmax_key(float v, uint32_t i) {
  uint32_t b = __float_as_uint(v);
  b = (b & 0x80000000u) ? ~b : (b | 0x80000000u);
  if (v != v) b = 0xffffffffu;
  return (static_cast<unsigned long long>(b) << 32) | (0xffffffffu - i);
}

__device__ __forceinline__ unsigned long long key_max(unsigned long long a,
                                                      unsigned long long b) {
  return a > b ? a : b;
}

// x (rows, n) with rows `stride` elements apart; `vec`: n, stride and x 16-byte aligned, so
// each lane reads 16 / sizeof(T) elements a load.
template <typename T>
__device__ void argmax_rows(const T* __restrict__ x, uint32_t* __restrict__ out, int64_t rows,
                            int64_t n, int64_t stride, bool vec) {
  __shared__ unsigned long long best[32];
  constexpr int PER = 16 / sizeof(T);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* row = x + r * stride;
    unsigned long long key = 0;
    if (vec) {
      const uint4* v = reinterpret_cast<const uint4*>(row);
      const int64_t vecs = n / PER;
#pragma unroll 4
      for (int64_t c = threadIdx.x; c < vecs; c += blockDim.x) {
        const uint4 q = __ldcs(v + c);
        const T* e = reinterpret_cast<const T*>(&q);
#pragma unroll
        for (int i = 0; i < PER; ++i)
          key = key_max(key, argmax_key(to_f(e[i]), uint32_t(c * PER + i)));
      }
    } else {
      for (int64_t c = threadIdx.x; c < n; c += blockDim.x)
        key = key_max(key, argmax_key(to_f(row[c]), uint32_t(c)));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) key = key_max(key, __shfl_xor_sync(0xffffffffu, key, o));
    if (lane == 0) best[warp] = key;
    __syncthreads();
    if (warp == 0) {
      key = lane < int(blockDim.x >> 5) ? best[lane] : 0;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) key = key_max(key, __shfl_xor_sync(0xffffffffu, key, o));
      if (lane == 0) out[r] = 0xffffffffu - uint32_t(key & 0xffffffffu);
    }
    __syncthreads();
  }
}

}  // namespace train
