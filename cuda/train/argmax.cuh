// The index of each row's largest element (greedy decoding over a vocabulary). A row is cut
// into slices of `chunk` elements, a block each (one block streaming a 128k row alone is
// bound by its own issue rate), every lane reading 16-byte vectors and keeping the first of
// its largest values; the (value, index) pairs are then reduced as one 64-bit key, which
// orders values as floats do, NaN above everything (as torch.argmax), and among equal values
// the first index. The last slice of a row to finish (a counter per row, wrapped back to 0 by
// that block: no memset per call) reduces the slices' keys in slice order.
#pragma once
#include "train/common.cuh"
#include "common/arrival.cuh"

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

// Block-wide max of `key`; thread 0 gets it. `best` holds 32 keys.
__device__ __forceinline__ unsigned long long block_key_max(unsigned long long key,
                                                            unsigned long long* best) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) key = key_max(key, __shfl_xor_sync(0xffffffffu, key, o));
  if (lane == 0) best[warp] = key;
  __syncthreads();
  if (warp == 0) {
    key = lane < int(blockDim.x >> 5) ? best[lane] : 0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) key = key_max(key, __shfl_xor_sync(0xffffffffu, key, o));
  }
  __syncthreads();
  return key;
}

// Keeps (bv, bi) the first of the largest values seen in increasing index order: NaN
// replaces a number, a later NaN does not replace the first.
__device__ __forceinline__ void argmax_step(float v, uint32_t i, float& bv, uint32_t& bi) {
  if (!(v <= bv) && bv == bv) {
    bv = v;
    bi = i;
  }
}

// x (rows, n), rows `stride` elements apart; grid (slices, rows), slice s covering
// [s * chunk, (s + 1) * chunk). `vec`: x, stride, n and chunk are whole 16-byte vectors.
// `part` (rows, slices) and `counters` (rows, zero) are used when there is more than one
// slice.
template <typename T>
__device__ void argmax_rows(const T* __restrict__ x, unsigned long long* part,
                            unsigned* counters, uint32_t* __restrict__ out, int64_t rows,
                            int64_t n, int64_t stride, int64_t chunk, bool vec) {
  __shared__ unsigned long long best[32];
  __shared__ bool last;
  constexpr int PER = 16 / sizeof(T);
  const int slices = gridDim.x, s = blockIdx.x;
  const int64_t lo = s * chunk, hi = min(n, lo + chunk);
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const T* row = x + r * stride;
    float bv = -INFINITY;
    uint32_t bi = 0;
    bool any = false;
    if (vec) {
      const uint4* v = reinterpret_cast<const uint4*>(row);
      const int64_t first = lo / PER + threadIdx.x;
      any = first < hi / PER;
      bi = uint32_t(first * PER);
#pragma unroll 4
      for (int64_t c = first; c < hi / PER; c += blockDim.x) {
        const uint4 q = __ldcs(v + c);
        const T* e = reinterpret_cast<const T*>(&q);
#pragma unroll
        for (int i = 0; i < PER; ++i) argmax_step(to_f(e[i]), uint32_t(c * PER + i), bv, bi);
      }
    } else {
      const int64_t first = lo + threadIdx.x;
      any = first < hi;
      bi = uint32_t(first);
      for (int64_t c = first; c < hi; c += blockDim.x) argmax_step(to_f(row[c]), uint32_t(c), bv, bi);
    }
    unsigned long long key = block_key_max(any ? argmax_key(bv, bi) : 0ull, best);
    if (slices == 1) {
      if (threadIdx.x == 0) out[r] = 0xffffffffu - uint32_t(key & 0xffffffffu);
      continue;
    }
    if (threadIdx.x == 0) {  // the last slice to arrive merges them (common/arrival.cuh)
      part[r * slices + s] = key;
      last = arrive_acq_rel(counters + r, unsigned(slices - 1)) == unsigned(slices - 1);
    }
    __syncthreads();
    if (last) {
      key = 0;
      for (int i = threadIdx.x; i < slices; i += blockDim.x) key = key_max(key, __ldcg(part + r * slices + i));
      key = block_key_max(key, best);
      if (threadIdx.x == 0) out[r] = 0xffffffffu - uint32_t(key & 0xffffffffu);
    }
  }
}

}  // namespace train
