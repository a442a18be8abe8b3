// KV-cache decoding, launched in this order:
//   flash_append_<dtype>          new K or V rows -> cache rows start[b]..        grid (s_new, h_k, b)
//   flash_decode_<dtype>_d<D>     one split of the key range for 16 packed rows   grid (splits, h_k * tiles, b)
//   flash_decode_combine_<dtype>  merge the splits by their LSE (flash-decoding)  grid (ceil(rows/8), 1, 1)
// The decode kernel is the forward's row block (fwd_block.cuh) with one warp: a decode step
// has a handful of query rows, so it is bound by reading K and V, and small blocks over a
// split key range are what fill the GPU when batch x heads cannot.
#include "decode_block.cuh"
#include "fwd_block.cuh"
#include "seq_info.cuh"
#include "traits.cuh"

// One block per (new token, K/V head, sequence); one 16-byte chunk per thread.
template <typename T> __device__ __forceinline__ void flash_append(const AppendParams& ap) {
    const int i = blockIdx.x, h_k = blockIdx.y, b = blockIdx.z;
    const CacheRows rows{ap.block_table, ap.max_pages, ap.page_size, b, h_k};
    const int j = ap.start[b] + i;  // checked on the host to fit the cache
    T* dst = rows.row(static_cast<T*>(ap.cache), ap.cache_page_stride, ap.cache_row_stride,
                      ap.cache_head_stride, j);
    const T* src = static_cast<const T*>(ap.src) + b * ap.src_batch_stride +
                   int64_t(i) * ap.src_row_stride + h_k * ap.src_head_stride;
    for (int c = threadIdx.x * CHUNK; c < ap.d; c += blockDim.x * CHUNK)
        *reinterpret_cast<uint4*>(dst + c) = *reinterpret_cast<const uint4*>(src + c);
}

template <class K> __device__ __forceinline__ void flash_decode(const DecodeParams& dp) {
    using T = typename K::T;
    const AttnParams& p = dp.a;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const int group = p.h_h_k_ratio;
    const int rows = p.seqlen_q * group;  // packed (token, head) rows of one K/V head
    const int tiles = (rows + K::BM - 1) / K::BM;
    const int split = blockIdx.x, h_k = blockIdx.y / tiles, b = blockIdx.z;
    const int m0 = (blockIdx.y % tiles) * K::BM;
    const int seqlen_k = dp.seqlens[b];

    SeqInfo seq(p, b);
    seq.seqlen_q = p.seqlen_q;
    seq.seqlen_k = seqlen_k;
    const CacheSource<K> src{dp, CacheRows{dp.block_table, dp.max_pages, dp.page_size, b, h_k},
                             group, p.seqlen_q, seqlen_k};
    FwdBlock<K, CacheSource<K>> block(p, src, Mask(p, seq), b, 0, m0, rows,
                                      reinterpret_cast<T*>(smem_raw));
    // This split's share of the visible key blocks (contiguous, in order).
    int nb_begin, nb_end;
    block.key_blocks(&nb_begin, &nb_end);
    const int per_split = (nb_end - nb_begin + dp.num_splits - 1) / dp.num_splits;
    const int my_begin = min(nb_end, nb_begin + split * per_split);
    const int my_end = min(nb_end, my_begin + per_split);
    block.run(my_begin, my_end);

    // Epilogue: normalised partial O and LSE of each row, or the output itself when unsplit.
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float inv_sum, lse;
        block.softmax.finalize(0, r, p.scale, &inv_sum, &lse);
        const int row = m0 + g + 8 * r, token = row / group;
        if (token >= p.seqlen_q) continue;
        const int head = h_k * group + row % group;
        const int64_t partial_row =
            ((int64_t(split) * p.b + b) * p.h + head) * p.seqlen_q + token;
        if (dp.num_splits > 1 && t == 0) dp.lse_partial[partial_row] = lse;
#pragma unroll
        for (int dt = 0; dt < K::DT; ++dt) {
            const int col = dt * 8 + 2 * t;
            if (col >= p.d) continue;
            const float x0 = block.o[0][dt][2 * r] * inv_sum, x1 = block.o[0][dt][2 * r + 1] * inv_sum;
            if (dp.num_splits > 1) {
                *reinterpret_cast<float2*>(dp.o_partial + partial_row * p.d + col) = make_float2(x0, x1);
            } else {
                T* out = static_cast<T*>(p.o) + b * p.o_batch_stride + int64_t(token) * p.o_row_stride +
                         head * p.o_head_stride + col;
                *reinterpret_cast<uint32_t*>(out) = MmaOp<T>::pack(x0, x1);
            }
        }
    }
}

// Merges the splits of one (b, head, token) row per warp: O = sum_s exp(lse_s - lse) O_s with
// lse = log sum_s exp(lse_s). Splits that saw no key have lse_s = -inf and weigh nothing.
template <typename T> __device__ __forceinline__ void flash_decode_combine(const DecodeParams& dp) {
    const AttnParams& p = dp.a;
    const int lane = threadIdx.x % 32;
    const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
    const int64_t rows = int64_t(p.b) * p.h * p.seqlen_q;
    if (row >= rows) return;
    float lse_max = -INFINITY;
    for (int s = 0; s < dp.num_splits; ++s) lse_max = fmaxf(lse_max, dp.lse_partial[s * rows + row]);
    float sum = 0.f;
    for (int s = 0; s < dp.num_splits; ++s) {
        const float l = dp.lse_partial[s * rows + row];
        sum += l == -INFINITY ? 0.f : expf(l - lse_max);
    }
    const int token = row % p.seqlen_q, head = (row / p.seqlen_q) % p.h, b = row / (int64_t(p.seqlen_q) * p.h);
    T* out = static_cast<T*>(p.o) + b * p.o_batch_stride + int64_t(token) * p.o_row_stride + head * p.o_head_stride;
    for (int col = lane; col < p.d; col += 32) {
        float acc = 0.f;
        for (int s = 0; s < dp.num_splits; ++s) {
            const float l = dp.lse_partial[s * rows + row];
            if (l != -INFINITY) acc += expf(l - lse_max) * dp.o_partial[(s * rows + row) * p.d + col];
        }
        out[col] = T(sum > 0.f ? acc / sum : 0.f);
    }
}

// One warp of 16 packed rows; 32-key tiles above d = 128, where 64 spilled 64-544 B (ptxas -v).
template <typename T, int D> struct DecodeConfig {
    using Traits = FwdTraits<T, D, 16, (D <= 128 ? 64 : 32), 1>;
};

#define FLASH_DECODE_DTYPE(NAME, T)                                                           \
    extern "C" __global__ void flash_append_##NAME(const __grid_constant__ AppendParams ap) { \
        flash_append<T>(ap);                                                                  \
    }                                                                                         \
    extern "C" __global__ void flash_decode_combine_##NAME(                                   \
        const __grid_constant__ DecodeParams dp) {                                            \
        flash_decode_combine<T>(dp);                                                          \
    }
#define FLASH_DECODE(NAME, T, D)                                                              \
    extern "C" __global__ void __launch_bounds__(32)                                          \
        flash_decode_##NAME##_d##D(const __grid_constant__ DecodeParams dp) {                 \
        flash_decode<DecodeConfig<T, D>::Traits>(dp);                                         \
    }
#define FLASH_DECODE_ALL(NAME, T)                                                             \
    FLASH_DECODE_DTYPE(NAME, T)                                                               \
    FLASH_DECODE(NAME, T, 32)                                                                 \
    FLASH_DECODE(NAME, T, 64)                                                                 \
    FLASH_DECODE(NAME, T, 96)                                                                 \
    FLASH_DECODE(NAME, T, 128)                                                                \
    FLASH_DECODE(NAME, T, 160)                                                                \
    FLASH_DECODE(NAME, T, 192)                                                                \
    FLASH_DECODE(NAME, T, 224)                                                                \
    FLASH_DECODE(NAME, T, 256)

FLASH_DECODE_ALL(f16, __half)
FLASH_DECODE_ALL(bf16, __nv_bfloat16)
