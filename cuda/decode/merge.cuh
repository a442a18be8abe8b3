// The merge of a row tile's key splits (flash-decoding): each split leaves its rows' partial
// output and LSE, and the merged row is sum_s exp(lse_s - lse) O_s with lse = log sum_s
// exp(lse_s) (-inf splits weigh nothing, rows without keys give 0, a NaN split makes the row
// NaN). Two ways to bring the partials together:
//   merge_splits   through global memory: the last split to finish (common/arrival.cuh)
//                  reads them all from L2
//   cluster_merge  through distributed shared memory (sm_90): the splits of a row tile are
//                  one thread-block cluster, every block keeps its partial rows in its own
//                  shared memory, and the blocks merge a share of the columns each
#pragma once
#include "common/mma.cuh"
#include "decode/params.cuh"

// Float4 column e of the merged rows of the tile at m0 (row e / (d / 4)) to the output.
template <typename T>
__device__ __forceinline__ void store_merged(const AttnParams& p, int b, int h_k, int m0, int e,
                                             const float4& acc) {
    const int group = p.h_h_k_ratio, c4 = p.d / 4;
    const int r = e / c4, token = (m0 + r) / group, head = h_k * group + (m0 + r) % group;
    T* out = static_cast<T*>(p.o) + b * p.o_batch_stride + int64_t(token) * p.o_row_stride +
             head * p.o_head_stride + 4 * (e % c4);
    *reinterpret_cast<uint2*>(out) =
        make_uint2(MmaOp<T>::pack(acc.x, acc.y), MmaOp<T>::pack(acc.z, acc.w));
}

constexpr int MAX_SPLITS = 128;  // src/cuda/plan/decode.rs caps num_splits to this

// The merge of the splits, run by the last split of a row tile to finish (weights
// exp(lse_s - lse) with lse = log sum_s exp(lse_s), -inf splits weigh nothing, rows without
// keys give 0, a NaN split makes the row NaN) over the tile's rows with a query. One block merges them all, from partials
// that sit in L2, so its time is L2 round trips:
// each thread keeps UNROLL 16-byte loads in flight, the first batch issued before the weights
// are known, and when the tile has fewer float4 columns than threads (few rows, small d) the
// threads also split the splits. Loads are ld.global.cg: L1 is not coherent across SMs, and
// the other splits' rows were written by other SMs during this launch.
template <typename T, int ROWS, int THREADS, int UNROLL>
__device__ __forceinline__ void merge_splits(const DecodeParams& dp, float* smem, int b, int h_k,
                                             int m0, int tid) {
    const AttnParams& p = dp.a;
    const int group = p.h_h_k_ratio, splits = dp.num_splits;
    const int n_rows = min(ROWS, p.seqlen_q * group - m0);
    const int c4 = p.d / 4, n = n_rows * c4;  // float4 outputs of the tile
    const int groups = max(1, THREADS / n);   // threads per output, each a share of the splits
    const int grp = tid / n;
    const bool active = grp < groups;
    const int64_t split_stride = int64_t(p.b) * p.h * p.seqlen_q * c4;  // float4s
    float* weights = smem;                                               // (ROWS, MAX_SPLITS)
    float4* part = reinterpret_cast<float4*>(weights + ROWS * MAX_SPLITS);  // (THREADS)
    const auto part_row = [&](int r) {  // row r's index within one split's partials
        const int token = (m0 + r) / group, head = h_k * group + (m0 + r) % group;
        return (int64_t(b) * p.h + head) * p.seqlen_q + token;
    };
    const auto part_o = [&](int e) {
        return reinterpret_cast<const float4*>(dp.o_partial) + part_row(e / c4) * c4 + e % c4;
    };
    float4 x[UNROLL];
    const auto load = [&](const float4* src, int k0) {  // this thread's splits k0.. of output e
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int s = grp + (k0 + u) * groups;
            x[u] = active && s < splits ? __ldcg(src + s * split_stride)
                                        : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    };
    load(part_o(tid % n), 0);

    const int warp = tid / 32, lane = tid % 32;
    constexpr int PER_LANE = MAX_SPLITS / 32;
    for (int r = warp; r < n_rows; r += THREADS / 32) {
        const float* lse = dp.lse_partial + part_row(r);
        const int64_t lse_stride = split_stride / c4;
        float l[PER_LANE];
        float mx = -INFINITY;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            const int s = lane + 32 * i;
            l[i] = s < splits ? __ldcg(lse + s * lse_stride) : -INFINITY;
            mx = fmaxf(mx, l[i]);
        }
#pragma unroll
        for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, off));
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            l[i] = l[i] == -INFINITY ? 0.f : __expf(l[i] - mx);
            sum += l[i];
        }
#pragma unroll
        for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffff, sum, off);
        const float inv = sum == 0.f ? 0.f : 1.f / sum;  // NaN stays NaN
        if (dp.lse != nullptr && lane == 0)
            dp.lse[part_row(r)] = sum == 0.f ? -INFINITY : mx + logf(sum);
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) weights[r * MAX_SPLITS + lane + 32 * i] = l[i] * inv;
    }
    __syncthreads();

    const auto sum_splits = [&](int e) {  // x holds the first batch of output e
        const float* w = weights + (e / c4) * MAX_SPLITS;
        const float4* src = part_o(e);
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int k0 = 0;;) {
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int s = grp + (k0 + u) * groups;
                const float wu = s < splits ? w[s] : 0.f;
                acc.x += wu * x[u].x;
                acc.y += wu * x[u].y;
                acc.z += wu * x[u].z;
                acc.w += wu * x[u].w;
            }
            k0 += UNROLL;
            if (grp + k0 * groups >= splits) return acc;
            load(src, k0);
        }
    };
    const auto store = [&](int e, const float4& acc) { store_merged<T>(p, b, h_k, m0, e, acc); };
    if (groups == 1) {
        for (int e = tid; e < n; e += THREADS) {
            const float4 acc = sum_splits(e);
            if (e + THREADS < n) load(part_o(e + THREADS), 0);
            store(e, acc);
        }
        return;
    }
    part[tid] = active ? sum_splits(tid % n) : make_float4(0.f, 0.f, 0.f, 0.f);
    __syncthreads();
    if (tid < n) {
        float4 acc = part[tid];
        for (int g = 1; g < groups; ++g) {
            const float4 y = part[g * n + tid];
            acc.x += y.x;
            acc.y += y.y;
            acc.z += y.z;
            acc.w += y.w;
        }
        store(tid, acc);
    }
}

constexpr int MAX_CLUSTER_SPLITS = 16;  // src/cuda/plan/decode.rs: MAX_CLUSTER

// The block's rank in its cluster, a peer's shared-memory address, loads from it, and the
// cluster-wide barrier (release/acquire: what a block stored to its shared memory before it
// arrives is seen by every peer after the wait). sm_90 only: the host clusters no launch
// elsewhere.
__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
#endif
    return r;
}
__device__ __forceinline__ uint32_t peer_smem(uint32_t local, uint32_t rank) {
    uint32_t a = local;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(a) : "r"(local), "r"(rank));
#endif
    return a;
}
__device__ __forceinline__ float ld_peer(uint32_t a) {
    float v = 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(a));
#endif
    return v;
}
__device__ __forceinline__ float4 ld_peer4(uint32_t a) {
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(a));
#endif
    return v;
}
__device__ __forceinline__ void cluster_sync() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n"
                 "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

// The merge of the row tile at m0 by the dp.num_splits blocks of its cluster, each holding its
// split's rows (ROWS x D f32, normalised, at `rows`) and their LSE (`lse`, natural log) in its
// shared memory; `weights` (ROWS x MAX_CLUSTER_SPLITS f32) is this block's scratch. Every
// block weighs all the splits of every row (a few LSE reads across the cluster) and merges a
// share of the tile's float4 columns, reading the peers' rows directly: no partials in global
// memory, no arrival count. Called by every thread of every block of the cluster.
template <typename T, int ROWS, int D, int THREADS>
__device__ __forceinline__ void cluster_merge(const DecodeParams& dp, const float* rows,
                                              const float* lse, float* weights, int b, int h_k,
                                              int m0, int tid) {
    static_assert(ROWS <= THREADS, "one thread a row weighs the splits");
    const AttnParams& p = dp.a;
    const int group = p.h_h_k_ratio, n = dp.num_splits;
    const int n_rows = min(ROWS, p.seqlen_q * group - m0);
    const uint32_t rank = cluster_rank();
    cluster_sync();  // every split's rows and LSE are in its shared memory
    if (tid < n_rows) {
        float l[MAX_CLUSTER_SPLITS];
        float mx = -INFINITY;
        const uint32_t mine = smem_addr(lse + tid);
#pragma unroll
        for (int s = 0; s < MAX_CLUSTER_SPLITS; ++s) {
            l[s] = s < n ? ld_peer(peer_smem(mine, s)) : -INFINITY;
            mx = fmaxf(mx, l[s]);
        }
        float sum = 0.f;
#pragma unroll
        for (int s = 0; s < MAX_CLUSTER_SPLITS; ++s) {
            l[s] = l[s] == -INFINITY ? 0.f : __expf(l[s] - mx);
            sum += l[s];
        }
        const float inv = sum == 0.f ? 0.f : 1.f / sum;  // NaN stays NaN
#pragma unroll
        for (int s = 0; s < MAX_CLUSTER_SPLITS; ++s) weights[tid * MAX_CLUSTER_SPLITS + s] = l[s] * inv;
        if (rank == 0 && dp.lse != nullptr) {
            const int token = (m0 + tid) / group, head = h_k * group + (m0 + tid) % group;
            dp.lse[(int64_t(b) * p.h + head) * p.seqlen_q + token] =
                sum == 0.f ? -INFINITY : mx + logf(sum);
        }
    }
    __syncthreads();
    const int c4 = p.d / 4;
    for (int e = int(rank) * THREADS + tid; e < n_rows * c4; e += n * THREADS) {
        const int r = e / c4;
        const uint32_t mine = smem_addr(rows + r * D + 4 * (e % c4));
        const float* w = weights + r * MAX_CLUSTER_SPLITS;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int s = 0; s < n; ++s) {
            const float4 y = ld_peer4(peer_smem(mine, s));
            acc.x += w[s] * y.x;
            acc.y += w[s] * y.y;
            acc.z += w[s] * y.z;
            acc.w += w[s] * y.w;
        }
        store_merged<T>(p, b, h_k, m0, e, acc);
    }
    cluster_sync();  // no block leaves while a peer may still read its shared memory
}
