// The forward kernel on Hopper tensor cores (wgmma, sm_90a): FlashAttention-2 Algorithm 1
// with the matmuls issued per warpgroup instead of per warp. One, two or three warpgroups
// share a block of query rows, 64 each, and stream key tiles of K and V (128 keys; 64 or 48
// in the one-warpgroup kernels) through two cp.async stages, so the next tile's copy overlaps
// the whole of the current tile's work. S = Q K^T reads both operands from shared memory;
// O += P V takes P from registers (the S accumulators, packed) and V from shared memory,
// MN-major. Mask, online softmax and the epilogue are the mma.sync kernel's (the accumulator
// layout is the same). Which shape runs where: sm90_kernel in src/cuda/plan/fwd.rs. Entry
// points flash_fwd_sm90_<dtype>_d<D>[_g1_n<BN>|_g3] for D = 64 and 128, without dropout;
// src/cuda/plan/fwd.rs falls back to fwd.cu for the rest.
#include "common/gemm.cuh"
#include "common/mask/levels.cuh"
#include "common/mask/visibility.cuh"
#include "common/params.cuh"
#include "common/seq_info.cuh"
#include "common/softmax.cuh"
#include "sm90/wgmma.cuh"

// MODS (common/mask/levels.cuh): compiled with the softcap and ALiBi code (kernels named
// `_mods`), also with the block mask's (`_sparse`); the others get no such problem (the host's
// choice) and carry none of its registers.
template <typename T_, int D_, int GROUPS_ = 2, int BN_ = 128, int MODS_ = MODS_NONE>
struct Sm90Traits {
    using T = T_;
    static constexpr int D = D_;
    static constexpr int MODS = MODS_;
    static constexpr int GROUPS = GROUPS_;      // warpgroups, 64 rows each
    static constexpr int BM = 64 * GROUPS, BN = BN_;  // query rows, keys per tile
    static constexpr int THREADS = GROUPS * 128;
    static constexpr int NT = BN / 8, DT = D / 8;
    static constexpr int Q_BYTES = BM * D * 2, KV_BYTES = BN * D * 2;
    // Q, then two stages of (K, V); plus 1 KB to align the tiles to a swizzle atom.
    static constexpr int SMEM_BYTES = Q_BYTES + 2 * 2 * KV_BYTES + 1024;
    static_assert(D % 64 == 0, "panels are 64 columns wide");
};

template <class K> struct Sm90Fwd {
    using T = typename K::T;
    static constexpr int D = K::D, BM = K::BM, BN = K::BN, NT = K::NT, DT = K::DT;

    const AttnParams& p;
    const Mask mask;
    const int m0, group, warp_row0, lane, tid;
    const uint32_t sQ, sKV;  // shared addresses: Q tile, stage 0 of (K, V)
    const T *k, *v;
    const int seqlen_k;
    float o[1][DT][4];
    OnlineSoftmax<1> softmax;

    __device__ __forceinline__ uint32_t sK(int stage) const {
        return sKV + stage * 2 * K::KV_BYTES;
    }
    __device__ __forceinline__ uint32_t sV(int stage) const { return sK(stage) + K::KV_BYTES; }

    __device__ __forceinline__ void load_kv(int nb, int stage) const {
        const int n0 = nb * BN;
        sm90::load_panels<T, BN, D, K::THREADS>(sK(stage), k + int64_t(n0) * p.k_row_stride,
                                                p.k_row_stride, seqlen_k - n0, p.d, tid);
        sm90::load_panels<T, BN, D, K::THREADS>(sV(stage), v + int64_t(n0) * p.v_row_stride,
                                                p.v_row_stride, seqlen_k - n0, p.d, tid);
        cp_async_commit();
    }

    // One key tile, already in shared memory at `stage`.
    template <bool MASK> __device__ __forceinline__ void step(int nb, int stage) {
        float s[1][NT][4];
        sm90::fence_operand(s[0]);
        sm90::fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
            sm90::Wgmma<T, BN>::ss(s[0], sm90::kmajor_desc(sQ + group * 64 * 128, BM, kk),
                                    sm90::kmajor_desc(sK(stage), BN, kk), kk > 0);
        sm90::commit();
        sm90::wait<0>();
        sm90::fence_operand(s[0]);
        mask.apply<1, NT>(s, m0 + warp_row0, nb * BN, lane, MASK);
        softmax.update(s, o, p.scale_log2);
        uint32_t pa[1][NT / 2][4];
        pack_a<T, 1, NT>(s, pa);
        sm90::fence_operand(o[0]);
        sm90::fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            sm90::Wgmma<T, D>::rs(o[0], pa[0][kk], sm90::mnmajor_desc(sV(stage), BN, kk), 1);
        sm90::commit();
        sm90::wait<0>();
        sm90::fence_operand(o[0]);
    }
};

template <class K> __device__ __forceinline__ void flash_fwd_sm90(const AttnParams& p) {
    using T = typename K::T;
    constexpr int BM = K::BM, BN = K::BN, D = K::D, DT = K::DT;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const uint32_t base = (smem_addr(smem_raw) + 1023) & ~1023u;  // swizzle atoms: 1 KB aligned

    const int m_block = gridDim.x - 1 - blockIdx.x;  // heaviest (causal) blocks first
    const int bidh = blockIdx.y, bidb = blockIdx.z, bidh_k = bidh / p.h_h_k_ratio;
    const SeqInfo seq(p, bidb);
    const int m0 = m_block * BM;
    if (m0 >= seq.seqlen_q) return;  // packed batches: this sequence is shorter than the grid
    const int tid = threadIdx.x, lane = tid % 32, group = tid / 128;
    const T* q = static_cast<const T*>(p.q) +
                 seq.q_offset(p.q_batch_stride, p.q_row_stride, p.q_head_stride, bidb, bidh);
    Sm90Fwd<K> f{p,
                 Mask(p, seq, bidb, bidh, K::MODS),
                 m0,
                 group,
                 group * 64 + (tid % 128) / 32 * 16,
                 lane,
                 tid,
                 base,
                 base + K::Q_BYTES,
                 static_cast<const T*>(p.k) +
                     seq.k_offset(p.k_batch_stride, p.k_row_stride, p.k_head_stride, bidb, bidh_k),
                 static_cast<const T*>(p.v) +
                     seq.k_offset(p.v_batch_stride, p.v_row_stride, p.v_head_stride, bidb, bidh_k),
                 seq.seqlen_k,
                 {},
                 {}};
    zero(f.o);

    sm90::load_panels<T, BM, D, K::THREADS>(base, q + int64_t(m0) * p.q_row_stride,
                                            p.q_row_stride, seq.seqlen_q - m0, p.d, tid);
    int nb_begin, nb_end;
    const int q_last = min(m0 + BM, seq.seqlen_q) - 1;
    f.mask.template key_blocks<BN>(m0, q_last, &nb_begin, &nb_end);
    int state, next_state;  // the tiles' sparse_state
    int nb = f.mask.template next_key_block<BN>(m0, q_last, nb_end, nb_begin, &state);
    if (nb >= 0) f.load_kv(nb, 0);  // commits Q with the first tile
    // Last key tile first: under a causal mask only the first tiles need the mask.
    for (int stage = 0, next; nb >= 0; nb = next, state = next_state, stage ^= 1) {
        next = f.mask.template next_key_block<BN>(m0, q_last, nb, nb_begin, &next_state);
        cp_async_wait<0>();
        sm90::fence_proxy_async();
        __syncthreads();  // tile nb landed for everyone; everyone is done with the other stage
        if (next >= 0) f.load_kv(next, stage ^ 1);
        if (f.mask.template block_needs_mask<BN>(m0, q_last, nb * BN, state))
            f.template step<true>(nb, stage);
        else
            f.template step<false>(nb, stage);
    }
    cp_async_wait<0>();  // Q was requested even if no key tile is visible

    // Epilogue: O / l and the LSE, straight from registers (4-byte stores; once per block).
    T* out = static_cast<T*>(p.o) +
             seq.q_offset(p.o_batch_stride, p.o_row_stride, p.o_head_stride, bidb, bidh);
    float* lse = p.lse + seq.lse_offset(p, bidb, bidh);
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float inv_sum, row_lse;
        f.softmax.finalize(0, r, p.scale, &inv_sum, &row_lse);
        const int row = m0 + f.warp_row0 + g + 8 * r;
        if (row >= seq.seqlen_q) continue;
        if (t == 0) lse[row] = row_lse;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            const int col = dt * 8 + 2 * t;
            if (col < p.d)
                *reinterpret_cast<uint32_t*>(out + int64_t(row) * p.o_row_stride + col) =
                    MmaOp<T>::pack(f.o[0][dt][2 * r] * inv_sum, f.o[0][dt][2 * r + 1] * inv_sum);
        }
    }
}

// The kernels of this file: one per row of cuda/catalogue.rs (generated by build.rs).
#include "instances/sm90_fwd.inc"
