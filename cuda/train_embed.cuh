// Embedding lookup with a scatter-add backward. An id past the table gives a NaN row (and
// no gradient): the kernels never read or write outside the table, and the error shows in
// the loss instead of passing silently.
#pragma once
#include "train_common.cuh"

namespace train {

template <typename W, typename T>
__device__ void embed_fwd(const W* __restrict__ table, const uint32_t* __restrict__ ids,
                          T* __restrict__ y, int64_t n, int64_t vocab, int cols) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n * cols;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t row = i / cols, c = i % cols;
    const uint32_t id = ids[row];
    y[i] = id < vocab ? from_f<T>(to_f(table[(int64_t)id * cols + c])) : from_f<T>(__int_as_float(0x7fc00000));
  }
}

// dtable (vocab, cols) f32, zeroed by the caller.
template <typename T>
__device__ void embed_bwd(const T* __restrict__ dy, const uint32_t* __restrict__ ids,
                          float* __restrict__ dtable, int64_t n, int64_t vocab, int cols) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n * cols;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t row = i / cols, c = i % cols;
    const uint32_t id = ids[row];
    if (id < vocab) atomicAdd(dtable + (int64_t)id * cols + c, to_f(dy[i]));
  }
}

}  // namespace train
