// The parameter blocks of KV-cache decoding and the cache append, shared with Rust
// (src/cuda/decode.rs, src/cuda/append.rs: `#[repr(C)]` twins, checked by build/abi_layout.rs).
// Apart from common/params.cuh so that a change here rebuilds only decode.cu.
#pragma once
#include <cstdint>
#include "common/params.cuh"

// KV-cache decoding. `a.q`/`a.o` are (b, seqlen_q, h, d) with a.seqlen_q the query tokens;
// `a.k`/`a.v` are the caches: (b, capacity, h_k, d) with a.k_batch_stride the per-sequence
// stride, or paged (num_pages, page_size, h_k, d) with a.k_batch_stride the per-page stride
// and block_table mapping (sequence, page index) -> page.
constexpr int DECODE_INLINE_SEQLENS = 128;
// The append a decode launch does itself: new rows (b, s_new, h_k, d) of K and V written at
// cache rows seqlen_k - n.. (n = s_new, or q_lens[b] when ragged), K rotated on the way, and
// the query rows rotated as they are loaded. Field names as in AppendParams (append_row).
struct DecodeAppend {
    const void* k_new;  // null: no append in this launch
    const void* v_new;
    int64_t k_batch_stride, k_row_stride, k_head_stride;
    int64_t v_batch_stride, v_row_stride, v_head_stride;
    int d, s_new;
    const float* rot_cos;  // null: no rotary embedding
    const float* rot_sin;
    int rot_rows, rot_half, rot_interleaved, q_causal;
};

struct DecodeParams {
    AttnParams a;
    const int* seqlens;      // (b) cached tokens to attend to (the append ran before), or
                             // null: they are in seqlens_inline (b <= DECODE_INLINE_SEQLENS)
    const int* block_table;  // (b, max_pages) or null (one contiguous cache per sequence)
    int max_pages, page_size;  // page_size = capacity when not paged
    int num_pages;             // pages in the pool (paged): larger table entries are clamped
    // Added to each length read from `seqlens` (device lengths are those before the append);
    // the sum is clamped to the capacity.
    int seqlens_add;
    // Ragged queries: q_lens[b] <= seqlen_q query rows of sequence b are real, the rest
    // padding (output 0, LSE -inf); null: all seqlen_q. add_q_lens: device lengths grow by
    // q_lens[b] (its new tokens) instead of seqlens_add.
    const int* q_lens;
    int add_q_lens;
    int num_splits;            // key-range splits per (sequence, K/V head, row tile)
    // Nonzero: the blocks let the kernel after them in (programmatic launch) as they start
    // (a grid of one partial wave: that kernel's blocks take the idle SMs).
    int trigger_dependents;
    // Nonzero: the num_splits blocks of a row tile are one thread-block cluster and merge
    // through its shared memory (decode/merge.cuh); o_partial, lse_partial and counters unused.
    int cluster;
    float* o_partial;          // (num_splits, b, h, seqlen_q, d) when num_splits > 1
    float* lse_partial;        // (num_splits, b, h, seqlen_q)
    float* lse;                // (b, h, seqlen_q) row log-sum-exp out, or null
    // Split merge: one arrival counter per (b, h_k, row tile), zero at launch and left zero
    // (the last split of a tile resets its counter). Set whenever num_splits > 1.
    unsigned int* counters;
    // An e4m3 cache (the `_fp8` kernels): per-K/V-head dequantization scales (h_k), f32.
    const float* k_scale;
    const float* v_scale;
    // The call's new K/V rows appended (and q rotated) by the decode launch itself, or
    // k_new null: the appends ran before it (decode/decode.cu, "fused append").
    DecodeAppend append;
    // Small batches pass their lengths with the launch instead of a host-to-device copy.
    int seqlens_inline[DECODE_INLINE_SEQLENS];
};

// In-place append of new K (or V) rows (b, s_new, h_k, d) at cache rows start[b]..
struct AppendParams {
    void* cache;
    const void* src;
    int64_t cache_page_stride, cache_row_stride, cache_head_stride;
    int64_t src_batch_stride, src_row_stride, src_head_stride;
    const int* start;        // (b) tokens in the cache before the append
    const int* block_table;  // as in DecodeParams
    int max_pages, page_size;
    int num_pages;  // as in DecodeParams
    int d;
    int s_new, h_k;  // rows and heads of src (the grid may be larger: query rows)
    const int* new_lens;  // ragged: rows i >= new_lens[b] of sequence b are padding; or null
    // Rotary embedding (null: none): tables (rot_rows, rot_half) in f32, rotating the first
    // 2 * rot_half elements of each row at its position.
    const float* rot_cos;
    const float* rot_sin;
    int rot_rows, rot_half, rot_interleaved;
    // Query rows (b, s_q, h, d) rotated into q_out (contiguous) by the K launch, at positions
    // start[b] + i (q_causal) or start[b]; q null otherwise.
    int s_q, h, q_causal;
    const void* q;
    void* q_out;
    int64_t q_batch_stride, q_row_stride, q_head_stride;
    // An e4m3 cache (`flash_append_fp8_*`): per-head scales (h_k), f32; rows are divided by
    // theirs. Null otherwise.
    const float* scale;
};
