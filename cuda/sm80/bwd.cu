// The backward kernels (FlashAttention-2 Algorithm 2), launched in this order:
//   flash_bwd_dsum_<dtype>       D = rowsum(dO * O)                  grid (ceil(sq/8), h, b)
//   flash_bwd_dkdv_<dtype>_d<D>  dK, dV per key block                 grid (ceil(sk/BN), h_k * splits, b)
//   flash_bwd_dq_<dtype>_d<D>    dQ per query block                   grid (ceil(sq/BM), h, b)
// or, when the caller allows a non-deterministic dQ and d <= 128 (dq_accum zeroed first):
//   flash_bwd_dsum_<dtype>
//   flash_bwd_dkdvq_<dtype>_d<D>[_dropout]  dK, dV, atomic dQ        grid (ceil(sk/BN), h_k, b)
//   flash_bwd_dq_convert_<dtype>_d<D>  dq = dq_accum * scale           grid (ceil(sq/BM), h, b)
// flash_bwd_dkdvq_<dtype>_d{64,128}_bn128[t] are 128-key shapes of the second (no dropout),
// converted by flash_bwd_dq_convert_<dtype>_d<D>_bn128[t] (the tiled dq_accum follows the
// kernel's warps). flash_bwd_dq_convert_<dtype> converts the wgmma kernel's dq_accum.
#include "sm80/bwd_dkdv.cuh"
#include "sm80/bwd_dq.cuh"

// One warp per row: each lane reads one 16-byte chunk of dO and O (d <= 256 = 32 lanes x 8).
template <typename T> __device__ __forceinline__ void flash_bwd_dsum(const BwdParams& bp) {
    const AttnParams& p = bp.a;
    const int lane = threadIdx.x % 32;
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    const int bidh = blockIdx.y, bidb = blockIdx.z;
    const SeqInfo seq(p, bidb);
    if (row >= seq.seqlen_q) return;
    const int64_t off =
        seq.q_offset(p.o_batch_stride, p.o_row_stride, p.o_head_stride, bidb, bidh) +
        int64_t(row) * p.o_row_stride + lane * CHUNK;
    float sum = 0.f;
    if (lane * CHUNK < p.d) {
        const uint4 o4 = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.o) + off);
        const uint4 d4 = *reinterpret_cast<const uint4*>(static_cast<const T*>(bp.dout) + off);
        const T* o8 = reinterpret_cast<const T*>(&o4);
        const T* d8 = reinterpret_cast<const T*>(&d4);
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) sum += float(o8[i]) * float(d8[i]);
    }
#pragma unroll
    for (int s = 16; s > 0; s /= 2) sum += __shfl_xor_sync(0xffffffff, sum, s);
    if (lane == 0) bp.dsum[seq.lse_offset(p, bidb, bidh) + row] = sum;
}

#define FLASH_BWD_DSUM(NAME, T)                                                               \
    extern "C" __global__ void flash_bwd_dsum_##NAME(const __grid_constant__ BwdParams bp) {  \
        flash_bwd_dsum<T>(bp);                                                                \
    }

// `_sparse`: the dK/dV kernel that runs under a block mask (on Ampere and Ada, and Hopper's
// mma.sync paths, the block mask takes this separate path).
#define FLASH_BWD(NAME, T, D)                                                                 \
    extern "C" __global__ void __launch_bounds__(BwdConfig<T, D>::Kv::THREADS, 1)             \
        flash_bwd_dkdv_##NAME##_d##D(const __grid_constant__ BwdParams bp) {                  \
        flash_bwd_dkdv<BwdConfig<T, D>::Kv>(bp);                                              \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(BwdConfig<T, D>::Kv::THREADS, 1)             \
        flash_bwd_dkdv_##NAME##_d##D##_sparse(const __grid_constant__ BwdParams bp) {         \
        flash_bwd_dkdv<BwdConfig<T, D>::Kv, true, MODS_SPARSE>(bp);                           \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(BwdConfig<T, D>::Q::THREADS, 1)              \
        flash_bwd_dq_##NAME##_d##D(const __grid_constant__ BwdParams bp) {                    \
        flash_bwd_dq<BwdConfig<T, D>::Q>(bp);                                                 \
    }

// Without dropout the fused kernel compiles its dropout code out (_dropout: with it).
#define FLASH_BWD_FUSED(NAME, T, D)                                                           \
    extern "C" __global__ void __launch_bounds__(BwdFusedConfig<T, D>::Kv::THREADS, 1)        \
        flash_bwd_dkdvq_##NAME##_d##D(const __grid_constant__ BwdParams bp) {                 \
        flash_bwd_dkdv<BwdFusedConfig<T, D>::Kv, false>(bp);                                  \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(BwdFusedConfig<T, D>::Kv::THREADS, 1)        \
        flash_bwd_dkdvq_##NAME##_d##D##_dropout(const __grid_constant__ BwdParams bp) {       \
        flash_bwd_dkdv<BwdFusedConfig<T, D>::Kv, true>(bp);                                   \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(BwdFusedConfig<T, D>::Kv::THREADS)           \
        flash_bwd_dq_convert_##NAME##_d##D(const __grid_constant__ BwdParams bp) {            \
        flash_bwd_dq_convert_tiled<BwdFusedConfig<T, D>::Kv>(bp);                             \
    }

#define FLASH_BWD_WIDE(NAME, T, D)                                                            \
    extern "C" __global__ void __launch_bounds__(BwdFusedConfig<T, D, true>::Kv::THREADS, 1)  \
        flash_bwd_dkdvq_##NAME##_d##D##_bn128(const __grid_constant__ BwdParams bp) {         \
        flash_bwd_dkdv<BwdFusedConfig<T, D, true>::Kv, false>(bp);                            \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(                                             \
        BwdFusedConfig<T, D, true, true>::Kv::THREADS, 1)                                     \
        flash_bwd_dkdvq_##NAME##_d##D##_bn128t(const __grid_constant__ BwdParams bp) {        \
        flash_bwd_dkdv<BwdFusedConfig<T, D, true, true>::Kv, false>(bp);                      \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(BwdFusedConfig<T, D, true>::Kv::THREADS)     \
        flash_bwd_dq_convert_##NAME##_d##D##_bn128(const __grid_constant__ BwdParams bp) {    \
        flash_bwd_dq_convert_tiled<BwdFusedConfig<T, D, true>::Kv>(bp);                       \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(                                             \
        BwdFusedConfig<T, D, true, true>::Kv::THREADS)                                        \
        flash_bwd_dq_convert_##NAME##_d##D##_bn128t(const __grid_constant__ BwdParams bp) {   \
        flash_bwd_dq_convert_tiled<BwdFusedConfig<T, D, true, true>::Kv>(bp);                 \
    }

#define FLASH_BWD_ALL(NAME, T)                                                                \
    FLASH_BWD_DSUM(NAME, T)                                                                   \
    extern "C" __global__ void flash_bwd_dq_convert_##NAME(                                   \
        const __grid_constant__ BwdParams bp) {                                               \
        flash_bwd_dq_convert<T>(bp);                                                          \
    }                                                                                         \
    FLASH_BWD(NAME, T, 32)                                                                    \
    FLASH_BWD(NAME, T, 64)                                                                    \
    FLASH_BWD(NAME, T, 96)                                                                    \
    FLASH_BWD(NAME, T, 128)                                                                   \
    FLASH_BWD_FUSED(NAME, T, 32)                                                              \
    FLASH_BWD_FUSED(NAME, T, 64)                                                              \
    FLASH_BWD_FUSED(NAME, T, 96)                                                              \
    FLASH_BWD_FUSED(NAME, T, 128)                                                             \
    FLASH_BWD_WIDE(NAME, T, 64)                                                               \
    FLASH_BWD_WIDE(NAME, T, 128)                                                              \
    FLASH_BWD(NAME, T, 160)                                                                   \
    FLASH_BWD(NAME, T, 192)                                                                   \
    FLASH_BWD(NAME, T, 224)                                                                   \
    FLASH_BWD(NAME, T, 256)

// build.rs compiles this file once per dtype (CANDLE_FLASH_ONLY_F16 / _BF16): two nvcc jobs of
// half the size, which two cores finish sooner than one.
#ifndef CANDLE_FLASH_ONLY_BF16
FLASH_BWD_ALL(f16, __half)
#endif
#ifndef CANDLE_FLASH_ONLY_F16
FLASH_BWD_ALL(bf16, __nv_bfloat16)
#endif

// `flash_bwd_dkdv_<dtype>_d256_s16`: d = 256's dK/dV kernel for 99 KB devices.
#define FLASH_BWD_SMALL256(NAME, T)                                                           \
    extern "C" __global__ void __launch_bounds__(BwdKvSmall256<T>::Kv::THREADS, 1)            \
        flash_bwd_dkdv_##NAME##_d256_s16(const __grid_constant__ BwdParams bp) {              \
        flash_bwd_dkdv<BwdKvSmall256<T>::Kv>(bp);                                             \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(BwdKvSmall256<T>::Kv::THREADS, 1)            \
        flash_bwd_dkdv_##NAME##_d256_s16_sparse(const __grid_constant__ BwdParams bp) {       \
        flash_bwd_dkdv<BwdKvSmall256<T>::Kv, true, MODS_SPARSE>(bp);                          \
    }
#ifndef CANDLE_FLASH_ONLY_BF16
FLASH_BWD_SMALL256(f16, __half)
#endif
#ifndef CANDLE_FLASH_ONLY_F16
FLASH_BWD_SMALL256(bf16, __nv_bfloat16)
#endif
