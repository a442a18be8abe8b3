// The tile source of the decode kernel: GQA-packed query rows and (possibly paged) cache rows.
//
// The query heads that share a K/V head are folded into the rows of one tile: row r holds
// token r / group of head h_k * group + r % group, so every K/V element is read from memory
// once per group, not once per query head (and one m16 tile serves up to 16 of those rows).
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

template <class K> struct CacheSource {
    using T = typename K::T;
    const DecodeParams& dp;
    CacheRows rows;
    int group;      // query heads per K/V head
    int seqlen_q;   // query tokens
    int seqlen_k;   // cached tokens to attend to

    __device__ __forceinline__ int rows_per_query() const { return group; }

    __device__ __forceinline__ void load_q(T* sQ, int m0, int tid) const {
        const AttnParams& p = dp.a;
        const auto q_row = [&](int r) -> const T* {
            const int row = m0 + r, token = row / group;
            if (token >= seqlen_q) return nullptr;
            const int head = rows.h_k * group + row % group;
            return static_cast<const T*>(p.q) + rows.b * p.q_batch_stride +
                   int64_t(token) * p.q_row_stride + head * p.q_head_stride;
        };
        load_rows<T, K::BM, K::D, K::THREADS>(sQ, q_row, p.d, tid);
    }

    __device__ __forceinline__ void load_kv(T* s, const void* cache, int64_t page_stride,
                                            int64_t row_stride, int64_t head_stride, int n0,
                                            int tid) const {
        const auto kv_row = [&](int r) -> const T* {
            const int j = n0 + r;
            return j < seqlen_k ? rows.row(static_cast<const T*>(cache), page_stride, row_stride,
                                           head_stride, j)
                                : nullptr;
        };
        load_rows<T, K::BN, K::D, K::THREADS>(s, kv_row, dp.a.d, tid);
    }
    __device__ __forceinline__ void load_k(T* sK, int n0, int tid) const {
        const AttnParams& p = dp.a;
        load_kv(sK, p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride, n0, tid);
    }
    __device__ __forceinline__ void load_v(T* sV, int n0, int tid) const {
        const AttnParams& p = dp.a;
        load_kv(sV, p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride, n0, tid);
    }
};
