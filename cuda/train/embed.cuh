// Embedding lookup with a scatter-add backward. An id past the table gives a NaN row (and
// no gradient): the kernels never read or write outside the table, and the error shows in
// the loss instead of passing silently.
#pragma once
#include "train/common.cuh"

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

// dtable (vocab, cols) f32, zeroed by the caller. Rows that share an id add in no fixed
// order; embed_bwd_sorted is the repeatable form.
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

// The same sums in row order: `order` lists the rows with an id in the table by id, then row
// (sorted on the host), `seg[s]..seg[s + 1]` the rows of one id. Block s x chunks + j (chunks
// = blocks of columns per row) writes columns j x blockDim.x + threadIdx.x of that id's row
// of dtable (zeroed by the caller for the other ids), each the sum of the rows' gradients in
// row order.
template <typename T>
__device__ void embed_bwd_sorted(const T* __restrict__ dy, const uint32_t* __restrict__ ids,
                                 const uint32_t* __restrict__ order,
                                 const uint32_t* __restrict__ seg, float* __restrict__ dtable,
                                 int cols) {
  const int chunks = (cols + blockDim.x - 1) / blockDim.x;
  const int id_at = blockIdx.x / chunks, c = blockIdx.x % chunks * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const uint32_t begin = seg[id_at], end = seg[id_at + 1];
  float sum = 0.f;
  for (uint32_t k = begin; k < end; ++k) sum += to_f(dy[(int64_t)order[k] * cols + c]);
  dtable[(int64_t)ids[order[begin]] * cols + c] = sum;
}

}  // namespace train
