// Shared pieces of the training kernels (cuda/train.cu): conversions between the storage
// dtypes and the f32 all arithmetic happens in, and warp/block sums.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace train {

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Two 16-bit elements of a 32-bit word as floats (the tag's type says which), and back.
__device__ __forceinline__ float2 pair_f(uint32_t v, __nv_bfloat16) {
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v));
}
__device__ __forceinline__ float2 pair_f(uint32_t v, __half) {
  return __half22float2(*reinterpret_cast<__half2*>(&v));
}
template <typename T> __device__ __forceinline__ uint32_t pack_pair(T lo, T hi) {
  static_assert(sizeof(T) == 2, "two 16-bit elements");
  return uint32_t(*reinterpret_cast<uint16_t*>(&lo)) |
         (uint32_t(*reinterpret_cast<uint16_t*>(&hi)) << 16);
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Sum over a block of up to 1024 threads; every thread gets the result. `scratch` holds 32
// floats; the call ends with a barrier so `scratch` can be reused right after.
__device__ __forceinline__ float block_sum(float x, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  x = warp_sum(x);
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  const int warps = (blockDim.x + 31) >> 5;
  float total = lane < warps ? scratch[lane] : 0.f;
  total = warp_sum(total);
  __syncthreads();
  return total;
}

}  // namespace train
