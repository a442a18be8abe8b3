// The parameter block shared with Rust (`src/cuda.rs`, `#[repr(C)] struct AttnParams`).
// It is the only contract between the host and the kernels: keep both in the same order.
#pragma once
#include <cstdint>

struct AttnParams {
    const void* q;   // (b, seqlen_q, h, d)
    const void* k;   // (b, seqlen_k, h_k, d)
    const void* v;   // (b, seqlen_k, h_k, d)
    void* o;         // (b, seqlen_q, h, d)
    float* lse;      // (b, h, seqlen_q), natural log of the row sums of exp(scale * q.k)

    // Strides in elements; the head_dim stride is 1.
    int64_t q_batch_stride, q_row_stride, q_head_stride;
    int64_t k_batch_stride, k_row_stride, k_head_stride;
    int64_t v_batch_stride, v_row_stride, v_head_stride;
    int64_t o_batch_stride, o_row_stride, o_head_stride;

    int b, h, h_k, seqlen_q, seqlen_k, d;
    int h_h_k_ratio;   // h / h_k: query heads per K/V head (GQA group)
    float scale;       // softmax scale
    float scale_log2;  // scale * log2(e): exp(scale * x) == exp2(scale_log2 * x)
    // Keys visible to query row i: [i + off - window_left, i + off + window_right] with
    // off = seqlen_k - seqlen_q (bottom-right alignment); -1 means unbounded on that side.
    // Causal is (-1, 0); no mask is (-1, -1).
    int window_left, window_right;
};

// The backward pass reads the forward's inputs, output and LSE through `a`, plus these.
// dO and dQ share o's strides; dK and dV are contiguous (b, seqlen_k, h_k, d).
struct BwdParams {
    AttnParams a;
    const void* dout;  // (b, seqlen_q, h, d)
    float* dsum;       // (b, h, seqlen_q): rowsum(dO * O), written by the preprocess kernel
    void* dq;          // (b, seqlen_q, h, d)
    void* dk;          // (b, seqlen_k, h_k, d)
    void* dv;          // (b, seqlen_k, h_k, d)
    int64_t dk_batch_stride, dk_row_stride, dk_head_stride;
};
