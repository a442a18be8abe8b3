// Where one sequence's rows live and how long it is: fixed-length batches index by the batch
// stride, packed (variable-length) batches by cumulative offsets. Every kernel starts here
// and reads lengths only from it.
#pragma once
#include "common/params.cuh"

struct SeqInfo {
    int q_start, k_start;    // first row of the sequence in the packed tensors (0 if fixed)
    int seqlen_q, seqlen_k;

    SeqInfo() = default;
    __device__ __forceinline__ SeqInfo(const AttnParams& p, int b) {
        if (p.cu_seqlens_q != nullptr) {
            q_start = p.cu_seqlens_q[b];
            k_start = p.cu_seqlens_k[b];
            seqlen_q = p.cu_seqlens_q[b + 1] - q_start;
            seqlen_k = p.cu_seqlens_k[b + 1] - k_start;
        } else {
            q_start = k_start = 0;
            seqlen_q = p.seqlen_q;
            seqlen_k = p.seqlen_k;
        }
    }

    // Element offsets of row 0 of (sequence b, head h) in q/o-like and k/v-like tensors.
    __device__ __forceinline__ int64_t q_offset(int64_t batch_stride, int64_t row_stride,
                                                int64_t head_stride, int b, int h) const {
        return b * batch_stride + int64_t(q_start) * row_stride + h * head_stride;
    }
    __device__ __forceinline__ int64_t k_offset(int64_t batch_stride, int64_t row_stride,
                                                int64_t head_stride, int b, int h) const {
        return b * batch_stride + int64_t(k_start) * row_stride + h * head_stride;
    }
    // Offset of row 0 of (b, h) in the LSE (and in the backward's rowsum(dO O), same layout).
    __device__ __forceinline__ int64_t lse_offset(const AttnParams& p, int b, int h) const {
        return b * p.lse_batch_stride + h * p.lse_head_stride + q_start;
    }
};

// Where the Hopper kernels' tensor maps (tma.cuh, over (d, rows, heads, batch)) find sequence b:
// fixed-length batches at batch b from row 0; packed ones in one tensor of every sequence's
// rows, batch 0, from the sequence's first rows q0 and k0. PACKED is the kernel's, known at
// compile time, so that the fixed-length kernels carry no offsets (registers).
struct TmaSeq {
    int q0, k0, batch;
};
template <bool PACKED> __device__ __forceinline__ TmaSeq tma_seq(const SeqInfo& seq, int b) {
    return PACKED ? TmaSeq{seq.q_start, seq.k_start, 0} : TmaSeq{0, 0, b};
}
