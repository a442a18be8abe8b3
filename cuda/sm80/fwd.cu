// The forward kernel: one thread block per (query block, head, batch), FlashAttention-2
// Algorithm 1. Extern "C" entry points `flash_fwd_<dtype>_d<D>` are generated below.
#include "sm80/fwd_block.cuh"
#include "sm80/traits.cuh"

template <class K, bool DROPOUT> __device__ __forceinline__ void flash_fwd(const AttnParams& p) {
    using T = typename K::T;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    // Heaviest query blocks first: under a causal mask the last rows see the most keys, and
    // starting them early shortens the tail of the last wave.
    const int m_block = gridDim.x - 1 - blockIdx.x;
    const int bidh = blockIdx.y, bidb = blockIdx.z;
    const int bidh_k = bidh / p.h_h_k_ratio;  // GQA: K/V head shared by this query head
    const SeqInfo seq(p, bidb);
    const int m0 = m_block * K::BM;
    if (m0 >= seq.seqlen_q) return;  // packed batches: this sequence is shorter than the grid
    const DenseSource<K> src{
        static_cast<const T*>(p.q) +
            seq.q_offset(p.q_batch_stride, p.q_row_stride, p.q_head_stride, bidb, bidh),
        static_cast<const T*>(p.k) +
            seq.k_offset(p.k_batch_stride, p.k_row_stride, p.k_head_stride, bidb, bidh_k),
        static_cast<const T*>(p.v) +
            seq.k_offset(p.v_batch_stride, p.v_row_stride, p.v_head_stride, bidb, bidh_k),
        p.q_row_stride, p.k_row_stride, p.v_row_stride, seq.seqlen_q, seq.seqlen_k, p.d};
    T* o = static_cast<T*>(p.o) +
           seq.q_offset(p.o_batch_stride, p.o_row_stride, p.o_head_stride, bidb, bidh);
    float* lse = p.lse + seq.lse_offset(p, bidb, bidh);

    FwdBlock<K, DenseSource<K>, DROPOUT> block(p, src, Mask(p, seq, bidb, bidh), bidb, bidh, m0, seq.seqlen_q,
                                      reinterpret_cast<T*>(smem_raw));
    int nb_begin, nb_end;
    block.key_blocks(&nb_begin, &nb_end);
    block.run(nb_begin, nb_end);
    block.store(o, p.o_row_stride, lse, seq.seqlen_q);
}

// Two kernels per head dim: without dropout (`flash_fwd_<dtype>_d<D>`) and with it
// (`flash_fwd_<dtype>_d<D>_dropout`), chosen by the launcher from dropout_p.
#define FLASH_FWD(NAME, T, D)                                                                 \
    extern "C" __global__ void __launch_bounds__(FwdConfig<T, D>::Traits::THREADS, 1)         \
        flash_fwd_##NAME##_d##D(const __grid_constant__ AttnParams p) {                       \
        flash_fwd<FwdConfig<T, D>::Traits, false>(p);                                         \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(FwdConfig<T, D>::Traits::THREADS, 1)         \
        flash_fwd_##NAME##_d##D##_dropout(const __grid_constant__ AttnParams p) {             \
        flash_fwd<FwdConfig<T, D>::Traits, true>(p);                                          \
    }
#define FLASH_FWD_ALL_D(NAME, T)                                                              \
    FLASH_FWD(NAME, T, 32)                                                                    \
    FLASH_FWD(NAME, T, 64)                                                                    \
    FLASH_FWD(NAME, T, 96)                                                                    \
    FLASH_FWD(NAME, T, 128)                                                                   \
    FLASH_FWD(NAME, T, 160)                                                                   \
    FLASH_FWD(NAME, T, 192)                                                                   \
    FLASH_FWD(NAME, T, 224)                                                                   \
    FLASH_FWD(NAME, T, 256)

// build.rs compiles this file once per dtype (CANDLE_FLASH_ONLY_F16 / _BF16): two nvcc jobs of
// half the size, which two cores finish sooner than one.
#ifndef CANDLE_FLASH_ONLY_BF16
FLASH_FWD_ALL_D(f16, __half)
#endif
#ifndef CANDLE_FLASH_ONLY_F16
FLASH_FWD_ALL_D(bf16, __nv_bfloat16)
#endif

// The small-tile shape of d >= 192 for 99 KB devices: `flash_fwd_<dtype>_d<D>_s64[_dropout]`.
#define FLASH_FWD_SMALL(NAME, T, D)                                                           \
    extern "C" __global__ void __launch_bounds__(FwdSmallConfig<T, D>::Traits::THREADS, 1)    \
        flash_fwd_##NAME##_d##D##_s64(const __grid_constant__ AttnParams p) {                 \
        flash_fwd<FwdSmallConfig<T, D>::Traits, false>(p);                                    \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(FwdSmallConfig<T, D>::Traits::THREADS, 1)    \
        flash_fwd_##NAME##_d##D##_s64_dropout(const __grid_constant__ AttnParams p) {         \
        flash_fwd<FwdSmallConfig<T, D>::Traits, true>(p);                                     \
    }
#define FLASH_FWD_SMALL_ALL(NAME, T)                                                          \
    FLASH_FWD_SMALL(NAME, T, 192)                                                             \
    FLASH_FWD_SMALL(NAME, T, 224)                                                             \
    FLASH_FWD_SMALL(NAME, T, 256)
#ifndef CANDLE_FLASH_ONLY_BF16
FLASH_FWD_SMALL_ALL(f16, __half)
#endif
#ifndef CANDLE_FLASH_ONLY_F16
FLASH_FWD_SMALL_ALL(bf16, __nv_bfloat16)
#endif
