// FP8 (e4m3) quantization helpers (src/quant/): a (batch, seq, heads, head_dim) tensor to
// e4m3 bytes divided by its group's scale, and back times it. Candle's own CUDA casts to and
// from F8E4M3 cannot be used: candle-core 0.11.1 looks them up under names its kernels do
// not have (`cast_f32_f8e4m3` for `cast_f32_f8_e4m3`).
#pragma once
#include <cuda_fp8.h>
#include "train/common.cuh"

namespace train {

// The scale of element i of a contiguous (b, s, h, d) tensor: mode 0 one scale, 1 one per
// head, 2 one per block of `block_rows` tokens of a (batch, head), `(b, h, ceil(s /
// block_rows))`.
__device__ __forceinline__ int64_t fp8_scale_index(int64_t i, int d, int h, int s,
                                                   int block_rows, int mode) {
  if (mode == 0) return 0;
  const int64_t row = i / d;
  const int head = int(row % h);
  if (mode == 1) return head;
  const int64_t token = (row / h) % s, batch = row / (int64_t(h) * s);
  const int blocks = (s + block_rows - 1) / block_rows;
  return (batch * h + head) * blocks + token / block_rows;
}

// q = e4m3(x / scale): a true division, round to nearest even, saturating at ±448, NaN kept.
template <typename T>
__device__ void fp8_quantize(const T* __restrict__ x, uint8_t* __restrict__ q,
                             const float* __restrict__ scales, int64_t n, int d, int h, int s,
                             int block_rows, int mode) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const float v = __fdiv_rn(to_f(x[i]), scales[fp8_scale_index(i, d, h, s, block_rows, mode)]);
    q[i] = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
  }
}

// y = e4m3 value times its scale, in T.
template <typename T>
__device__ void fp8_dequantize(const uint8_t* __restrict__ q, T* __restrict__ y,
                               const float* __restrict__ scales, int64_t n, int d, int h, int s,
                               int block_rows, int mode) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const __half_raw hr = __nv_cvt_fp8_to_halfraw(q[i], __NV_E4M3);
    const float v = __half2float(__half(hr));
    y[i] = from_f<T>(v * scales[fp8_scale_index(i, d, h, s, block_rows, mode)]);
  }
}

// dst[i] = the byte at the strided position of contiguous index i of a (d0, d1, d2, d3)
// tensor with element strides s0..s3. candle-core 0.11.1 cannot make this copy of an F8E4M3
// tensor on CUDA: it looks up `ucopy_f8e4m3`, a name its kernels do not have.
__device__ void fp8_copy(const uint8_t* __restrict__ src, uint8_t* __restrict__ dst, int64_t n,
                         int64_t d1, int64_t d2, int64_t d3, int64_t s0, int64_t s1, int64_t s2,
                         int64_t s3) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    int64_t r = i;
    const int64_t i3 = r % d3;
    r /= d3;
    const int64_t i2 = r % d2;
    r /= d2;
    const int64_t i1 = r % d1;
    dst[i] = src[(r / d1) * s0 + i1 * s1 + i2 * s2 + i3 * s3];
  }
}

}  // namespace train
