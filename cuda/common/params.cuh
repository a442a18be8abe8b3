// The parameter block shared with Rust (`src/cuda/abi.rs`, `#[repr(C)] struct AttnParams`).
// It is the only contract between the host and the kernels: keep both in the same order.
#pragma once
#include <cstdint>

// n / d for 0 <= n < 2^31 with a multiply-high and a shift (Granlund and Montgomery 1994):
// shift = ceil(log2 d), mul = floor(2^32 (2^shift - d) / d) + 1, set by the host
// (src/block_sparse.rs: fast_div, tested there against the division).
struct FastDiv {
    unsigned int mul;
    int shift;
    __device__ __forceinline__ int operator()(int n) const {
        return int((__umulhi(unsigned(n), mul) + unsigned(n)) >> shift);
    }
};

struct AttnParams {
    const void* q;   // (b, seqlen_q, h, d), or packed (total_q, h, d)
    const void* k;   // (b, seqlen_k, h_k, d), or packed (total_k, h_k, d)
    const void* v;   // like k
    void* o;         // like q
    float* lse;      // natural log of the row sums of exp(scale * q.k); see lse_*_stride
    // Packed (variable-length) batches: sequence b owns rows cu_seqlens_q[b]..[b + 1] of q and
    // cu_seqlens_k[b]..[b + 1] of k and v (checked on the host). Null for fixed length.
    const int* cu_seqlens_q;
    const int* cu_seqlens_k;

    // Strides in elements; the head_dim stride is 1. Batch strides are 0 when packed.
    int64_t q_batch_stride, q_row_stride, q_head_stride;
    int64_t k_batch_stride, k_row_stride, k_head_stride;
    int64_t v_batch_stride, v_row_stride, v_head_stride;
    int64_t o_batch_stride, o_row_stride, o_head_stride;
    // LSE of row i of sequence b, head h: lse[b * lse_batch_stride + h * lse_head_stride +
    // (first row of b when packed) + i]: (b, h, seqlen_q) fixed, (h, total_q) packed.
    int64_t lse_batch_stride, lse_head_stride;

    int b, h, h_k;
    int seqlen_q, seqlen_k;  // fixed length; the maximum over the sequences when packed
    int d;
    int h_h_k_ratio;   // h / h_k: query heads per K/V head (GQA group)
    float scale;       // softmax scale
    float scale_log2;  // scale * log2(e): exp(scale * x) == exp2(scale_log2 * x)
    // Keys visible to query row i: [i + off - window_left, i + off + window_right] with
    // off = seqlen_k - seqlen_q of i's sequence (bottom-right alignment); -1 means unbounded
    // on that side, and so is a side >= that sequence's seqlen_k (Mask applies the rule).
    // Causal is (-1, 0); no mask is (-1, -1).
    int window_left, window_right;
    // Softcapping: S = tanh(scale' q.k) with scale' = softcap_pre (the softmax scale / cap),
    // and `scale` is then the cap; 0 turns it off. (FlashAttention 2 folds it the same way.)
    float softcap_pre;
    // Under a softcap every score is at most the cap, so the bf16 warp-specialized forward
    // (two consumer warpgroups) takes this fixed row max (log2 units, set by the host: P
    // stays within [2^-100, 2^64], which bf16 holds) and never computes one; 0 (no cap,
    // ALiBi, or a cap too large for that range): the running max.
    float softcap_max_log2;
    // What dS K and dS^T Q are multiplied by: the softmax scale (`scale` is the cap under a
    // softcap).
    float grad_scale;
    // ALiBi: S -= alibi_scale * slope * |i + off - j|, slope of sequence b, query head h at
    // alibi_slopes[b * alibi_batch_stride + h] (stride 0: one slope per head); alibi_scale =
    // 1 / scale puts the bias in S's units. Null: no bias.
    const float* alibi_slopes;
    int alibi_batch_stride;
    float alibi_scale;
    // Block-sparse attention (src/block_sparse.rs). Block (r, c) of a sequence, queries
    // [r block_q, (r + 1) block_q) x keys [c block_k, ..), has under query head h the state
    // block_mask[h * block_head_stride + r * block_cols + c]: 0 absent, 1 every entry visible,
    // 2 entry (i, j) visible iff block_dense[h * dense_head_stride + i * dense_row_stride + j]
    // is nonzero. Indices are within each sequence; head strides are 0 for one mask for all
    // heads. Null block_mask: no block mask.
    const unsigned char* block_mask;
    const unsigned char* block_dense;
    // Where loops jump past absent blocks (BlockMask's Skips), same head stride:
    // block_prev_col[h * block_head_stride + r * block_cols + c] = 1 + the last present
    // block at or before column c of row r (0: none); block_next_row[h * block_head_stride +
    // c * block_rows + r] = the first present block at or after row r of column c (block_rows:
    // none).
    const unsigned int* block_prev_col;
    const unsigned int* block_next_row;
    int64_t block_head_stride, dense_head_stride, dense_row_stride;
    int block_q, block_k, block_cols, block_rows;
    // Divisions by block_q and block_k: every consumer thread divides per key tile, and the
    // integer division (~20 instructions each) made the block-mask kernels issue 62% more
    // instructions than the plain ones.
    FastDiv block_q_div, block_k_div;

    // Dropout (src/philox.rs, cuda/philox.cuh): entry kept iff its 16-bit half of a Philox
    // word >= threshold (p 2^16, rounded); kept entries are scaled by rp_keep = 1 / (1 - p).
    // threshold = 0 disables dropout.
    unsigned int drop_threshold;
    float rp_keep;
    unsigned int seed_lo, seed_hi, offset_lo, offset_hi;
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
    // Non-deterministic path (d <= 128): dQ summed with atomics in f32, zeroed before the
    // dK/dV/dQ kernel, laid out like dq (wgmma kernel) or in tiles (bwd_dq_accum.cuh); null
    // when the dQ kernel computes dq directly.
    float* dq_accum;
    int64_t dq_accum_len;  // wgmma kernel: elements of dq (and of dq_accum)
    int64_t dq_tile_rows;  // mma.sync fused kernels: rows per head of the tiled dq_accum
};
