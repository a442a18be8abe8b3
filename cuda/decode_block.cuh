// Row addressing of the KV cache for the append and decode kernels (contiguous or paged).
#pragma once
#include "copy.cuh"
#include "params.cuh"

// Row addressing of a (possibly paged) cache for one sequence and K/V head.
struct CacheRows {
    const int* block_table;  // null: the sequence's rows are contiguous in slice `b`
    int max_pages, page_size, b, h_k;

    // Address of row j (a token position).
    template <typename T>
    __device__ __forceinline__ T* row(T* cache, int64_t page_stride, int64_t row_stride,
                                      int64_t head_stride, int j) const {
        int64_t page = b;
        int r = j;
        if (block_table != nullptr) {
            page = block_table[int64_t(b) * max_pages + j / page_size];
            r = j % page_size;
        }
        return cache + page * page_stride + int64_t(r) * row_stride + h_k * head_stride;
    }
};
