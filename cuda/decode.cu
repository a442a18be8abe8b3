// KV-cache decoding, launched in this order:
//   flash_append_<dtype>          new K or V rows -> cache rows start[b]..        grid (s_new, h_k, b)
//   flash_decode_<dtype>_d<D>     one split of the key range for 16 packed rows   grid (splits, h_k * tiles, b)
//   flash_decode_combine_<dtype>  merge the splits by their LSE (flash-decoding)  grid (ceil(rows/8), 1, 1)
// The decode kernel reuses the forward's pieces (gemm.cuh, softmax.cuh, mask.cuh, copy.cuh)
// but not its block layout: a decode step has a handful of query rows, so the block's warps
// split the keys instead of the rows (see DecodeTraits). The query heads that share a K/V
// head are folded into the rows of one tile (GQA packing): row r holds token r / group of
// head h_k * group + r % group, so each K/V element is read once per group, not per head.
#include "decode_block.cuh"
#include "gemm.cuh"
#include "mask.cuh"
#include "seq_info.cuh"
#include "softmax.cuh"

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

// Decode tile: ROWS packed query rows shared by NWARPS warps. Each warp streams its own
// 16-key K/V tiles (tiles w, w + NWARPS, ... of the block's key range) through a private
// two-stage cp.async ring, synchronising only within the warp, and keeps its own online
// softmax; the warps' (max, sum, O) are merged through shared memory at the end. Decoding
// reads every K/V byte once and does little math per byte, so what matters is many copies
// in flight and no block-wide barrier inside the loop.
template <typename T_, int D_> struct DecodeTraits {
    using T = T_;
    static constexpr int D = D_, NWARPS = 4, THREADS = 32 * NWARPS;
    static constexpr int ROWS = 16;  // one m16 tile of packed (token, head) rows
    static constexpr int BN = 16;    // keys per warp tile
    static constexpr int STRIDE = D + SMEM_PAD;
    static constexpr int DT = D / 8;
    static constexpr int RING = 2 * 2 * BN * STRIDE;  // per warp: 2 stages x (K, V), elements
    // The merge reuses the rings as f32: NWARPS x ROWS x D partial O, then row max and sum.
    static constexpr int MERGE_BYTES = NWARPS * ROWS * (D + 2) * 4;
    static constexpr int SMEM_BYTES = ROWS * STRIDE * int(sizeof(T)) +
        (NWARPS * RING * int(sizeof(T)) > MERGE_BYTES ? NWARPS * RING * int(sizeof(T)) : MERGE_BYTES);
};

template <class K> __device__ __forceinline__ void flash_decode(const DecodeParams& dp) {
    using T = typename K::T;
    constexpr int D = K::D, BN = K::BN, STRIDE = K::STRIDE, DT = K::DT, NW = K::NWARPS;
    constexpr int ROWS = K::ROWS;
    const AttnParams& p = dp.a;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* rings = sQ + ROWS * STRIDE;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int group = p.h_h_k_ratio;
    const int rows = p.seqlen_q * group;  // packed (token, head) rows of one K/V head
    const int tiles = (rows + ROWS - 1) / ROWS;
    const int split = blockIdx.x, h_k = blockIdx.y / tiles, b = blockIdx.z;
    const int m0 = (blockIdx.y % tiles) * ROWS;
    const int seqlen_k = dp.seqlens[b];
    SeqInfo seq(p, b);
    seq.seqlen_q = p.seqlen_q;
    seq.seqlen_k = seqlen_k;
    const Mask mask(p, seq);
    const CacheRows cache{dp.block_table, dp.max_pages, dp.page_size, b, h_k};

    const auto q_row = [&](int r) -> const T* {
        const int row = m0 + r, token = row / group;
        if (token >= p.seqlen_q) return nullptr;
        const int head = h_k * group + row % group;
        return static_cast<const T*>(p.q) + b * p.q_batch_stride + int64_t(token) * p.q_row_stride +
               head * p.q_head_stride;
    };
    load_rows<T, ROWS, D, K::THREADS>(sQ, q_row, static_cast<const T*>(p.q), p.d, tid);
    cp_async_commit();

    // This split's share of the key tiles the block's queries can see.
    const int q_first = m0 / group, q_last = (min(m0 + ROWS, rows) - 1) / group;
    int kb_begin, kb_end;
    mask.template key_blocks<BN>(q_first, q_last, &kb_begin, &kb_end);
    const int per_split = (kb_end - kb_begin + dp.num_splits - 1) / dp.num_splits;
    const int my_begin = min(kb_end, kb_begin + split * per_split);
    const int my_end = min(kb_end, my_begin + per_split);

    T* ring = rings + warp * K::RING;  // stage s: K at ring + s * 2 * BN * STRIDE, V after it
    const auto prefetch = [&](int tile, int stage) {
        const int n0 = tile * BN;
        T* sK = ring + stage * 2 * BN * STRIDE;
        const auto k_row = [&](int r) -> const T* {
            const int j = n0 + r;
            return j < seqlen_k ? cache.row(static_cast<const T*>(p.k), p.k_batch_stride,
                                            p.k_row_stride, p.k_head_stride, j)
                                : nullptr;
        };
        const auto v_row = [&](int r) -> const T* {
            const int j = n0 + r;
            return j < seqlen_k ? cache.row(static_cast<const T*>(p.v), p.v_batch_stride,
                                            p.v_row_stride, p.v_head_stride, j)
                                : nullptr;
        };
        load_rows<T, BN, D, 32>(sK, k_row, static_cast<const T*>(p.k), p.d, lane);
        load_rows<T, BN, D, 32>(sK + BN * STRIDE, v_row, static_cast<const T*>(p.v), p.d, lane);
    };

    float o[1][DT][4];
    zero(o);
    OnlineSoftmax<1> softmax;
    int tile = my_begin + warp;
    if (tile < my_end) prefetch(tile, 0);
    cp_async_commit();  // one group per step, empty or not, so wait<1> always means "this tile"
    cp_async_wait<1>();  // Q landed (this thread's part) ...
    __syncthreads();     // ... and everyone's
    for (int stage = 0; tile < my_end; tile += NW, stage ^= 1) {
        if (tile + NW < my_end) prefetch(tile + NW, stage ^ 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncwarp();  // this tile landed for the whole warp
        const T* sK = ring + stage * 2 * BN * STRIDE;
        float s[1][2][4];
        zero(s);
        gemm_ss<T, 1, 2, D / 16, STRIDE>(s, sQ, sK, lane);
        if (mask.template block_needs_mask<BN>(q_first, q_last, tile * BN))
            mask.apply<1, 2>(s, m0, tile * BN, lane, group);
        softmax.update(s, o, p.scale_log2);
        uint32_t pa[1][1][4];
        pack_a<T, 1, 2>(s, pa);
        gemm_rs<T, 1, 1, DT, STRIDE>(o, pa, sK + BN * STRIDE, lane);
        __syncwarp();  // every lane is done with this stage before it is refilled
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with its ring: reuse the rings for the merge

    float* sO = reinterpret_cast<float*>(rings);  // (NW, ROWS, D), unnormalised
    float* sM = sO + NW * ROWS * D;               // (NW, ROWS) row max of raw scores
    float* sL = sM + NW * ROWS;                   // (NW, ROWS) row sum
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = g + 8 * r;
        float l = softmax.row_sum[0][r];
        l += __shfl_xor_sync(0xffffffff, l, 1);
        l += __shfl_xor_sync(0xffffffff, l, 2);
        if (t == 0) {
            sM[warp * ROWS + row] = softmax.row_max[0][r];
            sL[warp * ROWS + row] = l;
        }
#pragma unroll
        for (int dt = 0; dt < DT; ++dt)
            *reinterpret_cast<float2*>(sO + (warp * ROWS + row) * D + dt * 8 + 2 * t) =
                make_float2(o[0][dt][2 * r], o[0][dt][2 * r + 1]);
    }
    __syncthreads();
    for (int e = tid; e < ROWS * D; e += K::THREADS) {
        const int row = e / D, col = e % D;
        const int token = (m0 + row) / group;
        if (token >= p.seqlen_q || col >= p.d) continue;
        float m = -INFINITY;
#pragma unroll
        for (int w = 0; w < NW; ++w) m = fmaxf(m, sM[w * ROWS + row]);
        const float m_scaled = m == -INFINITY ? 0.f : m * p.scale_log2;
        float l = 0.f, acc = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) {
            const float weight = exp2f(sM[w * ROWS + row] * p.scale_log2 - m_scaled);
            l += weight * sL[w * ROWS + row];
            acc += weight * sO[(w * ROWS + row) * D + col];
        }
        const float x = l > 0.f ? acc / l : 0.f;
        const int head = h_k * group + (m0 + row) % group;
        if (dp.num_splits > 1) {
            const int64_t prow = ((int64_t(split) * p.b + b) * p.h + head) * p.seqlen_q + token;
            dp.o_partial[prow * p.d + col] = x;
            if (col == 0) dp.lse_partial[prow] = l > 0.f ? m * p.scale + logf(l) : -INFINITY;
        } else {
            static_cast<T*>(p.o)[b * p.o_batch_stride + int64_t(token) * p.o_row_stride +
                                 head * p.o_head_stride + col] = T(x);
        }
    }
}

constexpr int MAX_SPLITS = 128;  // src/cuda/decode.rs caps num_splits to this

// Merges the splits of one (b, head, token) row per warp: O = sum_s w_s O_s with
// w_s = exp(lse_s - lse) and lse = log sum_s exp(lse_s). Splits that saw no key have
// lse_s = -inf and weigh nothing. The weights are computed once per row, across the lanes.
template <typename T> __device__ __forceinline__ void flash_decode_combine(const DecodeParams& dp) {
    const AttnParams& p = dp.a;
    __shared__ float weights[8][MAX_SPLITS];  // 8 warps per block
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + warp;
    const int64_t rows = int64_t(p.b) * p.h * p.seqlen_q;
    if (row >= rows) return;
    const int splits = dp.num_splits;
    float mx = -INFINITY;
    for (int s = lane; s < splits; s += 32) mx = fmaxf(mx, dp.lse_partial[s * rows + row]);
#pragma unroll
    for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, off));
    float sum = 0.f;
    for (int s = lane; s < splits; s += 32) {
        const float l = dp.lse_partial[s * rows + row];
        const float w = l == -INFINITY ? 0.f : expf(l - mx);
        weights[warp][s] = w;
        sum += w;
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffff, sum, off);
    __syncwarp();
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    const int token = row % p.seqlen_q, head = (row / p.seqlen_q) % p.h;
    const int b = row / (int64_t(p.seqlen_q) * p.h);
    T* out = static_cast<T*>(p.o) + b * p.o_batch_stride + int64_t(token) * p.o_row_stride +
             head * p.o_head_stride;
    for (int col = lane; col < p.d; col += 32) {
        float acc = 0.f;
#pragma unroll 4
        for (int s = 0; s < splits; ++s) acc += weights[warp][s] * dp.o_partial[(s * rows + row) * p.d + col];
        out[col] = T(acc * inv);
    }
}

#define FLASH_DECODE_DTYPE(NAME, T)                                                           \
    extern "C" __global__ void flash_append_##NAME(const __grid_constant__ AppendParams ap) { \
        flash_append<T>(ap);                                                                  \
    }                                                                                         \
    extern "C" __global__ void flash_decode_combine_##NAME(                                   \
        const __grid_constant__ DecodeParams dp) {                                            \
        flash_decode_combine<T>(dp);                                                          \
    }
#define FLASH_DECODE(NAME, T, D)                                                              \
    extern "C" __global__ void __launch_bounds__(DecodeTraits<T, D>::THREADS)                 \
        flash_decode_##NAME##_d##D(const __grid_constant__ DecodeParams dp) {                 \
        flash_decode<DecodeTraits<T, D>>(dp);                                                 \
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
