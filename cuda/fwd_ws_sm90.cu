// The warp-specialized forward kernel on Hopper (sm_90a), FlashAttention-3's structure:
// - a producer warpgroup, one thread of which issues TMA copies of the Q tile and of each key
//   tile of K and V into a ring of STAGES slots, each slot with a "full" mbarrier (bytes
//   landed) and an "empty" one (both consumers done with it); it keeps 24 registers per
//   thread and hands the rest to the consumers (setmaxnreg);
// - two consumer warpgroups, 64 query rows each, sharing the key tiles. Within a warpgroup
//   the softmax of tile j runs while the tensor cores multiply P(j-1) V(j-1) (issued together
//   with S(j) = Q K(j)^T, then waited for one at a time); between them, named barriers hand
//   the tensor cores from one warpgroup to the other ("pingpong"), so one's softmax runs under
//   the other's matmuls.
// Key tiles are visited last first, as in fwd_sm90.cu (under a causal mask only the first
// need the mask). Fixed-length batches without dropout; src/cuda/mod.rs sends the rest to
// fwd_sm90.cu and fwd.cu. Entry points flash_fwd_ws_<dtype>_d<D>.
#include "gemm.cuh"
#include "mask.cuh"
#include "params.cuh"
#include "seq_info.cuh"
#include "softmax.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

// The kernel's parameter: tensor maps of q, k and v over (d, rows, heads, batch) with boxes
// of 64 columns x BM (q) or BN (k, v) rows, then the usual parameters (the same struct as in
// src/cuda/tma.rs).
struct FwdTmaParams {
    TmaDesc q, k, v;
    AttnParams a;
};

template <typename T_, int D_, int BN_, int STAGES_, bool PINGPONG_> struct WsTraits {
    using T = T_;
    static constexpr int D = D_, BN = BN_, STAGES = STAGES_;
    static constexpr bool PINGPONG = PINGPONG_;
    static constexpr int CONSUMERS = 2, BM = 64 * CONSUMERS, THREADS = 128 * (CONSUMERS + 1);
    static constexpr int NT = BN / 8, DT = D / 8;
    static constexpr int Q_BYTES = BM * D * 2, KV_BYTES = BN * D * 2;
    // Q, STAGES K tiles, STAGES V tiles, then the barriers: Q's, and full/empty per K and V
    // slot; plus 1 KB to align the tiles to a swizzle atom (src/cuda/tma.rs: smem_bytes).
    static constexpr int BAR_OFFSET = Q_BYTES + 2 * STAGES * KV_BYTES;
    static constexpr int SMEM_BYTES = BAR_OFFSET + (1 + 4 * STAGES) * 8 + 1024;
    // Registers per thread after the hand-over: 128 x 24 + 256 x 240 <= 64 K.
    static constexpr int PRODUCER_REGS = 24, CONSUMER_REGS = 240;
    static_assert(D % 64 == 0, "panels are 64 columns wide");
    static_assert(BN * 128 % 1024 == 0, "panels must stay 1 KB aligned");
};

// Shared-memory addresses of the tiles and barriers.
template <class K> struct WsSmem {
    uint32_t base;
    __device__ __forceinline__ uint32_t q() const { return base; }
    __device__ __forceinline__ uint32_t k(int st) const { return base + K::Q_BYTES + st * K::KV_BYTES; }
    __device__ __forceinline__ uint32_t v(int st) const {
        return base + K::Q_BYTES + (K::STAGES + st) * K::KV_BYTES;
    }
    __device__ __forceinline__ uint32_t bar_q() const { return base + K::BAR_OFFSET; }
    __device__ __forceinline__ uint32_t full_k(int st) const { return bar_q() + 8 * (1 + st); }
    __device__ __forceinline__ uint32_t full_v(int st) const {
        return bar_q() + 8 * (1 + K::STAGES + st);
    }
    __device__ __forceinline__ uint32_t empty_k(int st) const {
        return bar_q() + 8 * (1 + 2 * K::STAGES + st);
    }
    __device__ __forceinline__ uint32_t empty_v(int st) const {
        return bar_q() + 8 * (1 + 3 * K::STAGES + st);
    }
};

// The producer: one thread copies Q, then K and V of the key tiles [nb_begin, nb_end), last
// first, each into the next slot once the consumers have released it.
template <class K>
__device__ __forceinline__ void ws_produce(const FwdTmaParams& P, const WsSmem<K>& sm, int m0,
                                           int bidh, int bidh_k, int bidb, int nb_begin,
                                           int nb_end) {
    tma::arrive_expect_tx(sm.bar_q(), K::Q_BYTES);
#pragma unroll
    for (int panel = 0; panel < K::D / 64; ++panel)
        tma::load_4d(sm.q() + panel * K::BM * 128, P.q, sm.bar_q(), panel * 64, m0, bidh, bidb);
    for (int nb = nb_end - 1, i = 0; nb >= nb_begin; --nb, ++i) {
        const int st = i % K::STAGES, phase = (i / K::STAGES) & 1;
        tma::wait(sm.empty_k(st), phase ^ 1);
        tma::arrive_expect_tx(sm.full_k(st), K::KV_BYTES);
#pragma unroll
        for (int panel = 0; panel < K::D / 64; ++panel)
            tma::load_4d(sm.k(st) + panel * K::BN * 128, P.k, sm.full_k(st), panel * 64,
                         nb * K::BN, bidh_k, bidb);
        tma::wait(sm.empty_v(st), phase ^ 1);
        tma::arrive_expect_tx(sm.full_v(st), K::KV_BYTES);
#pragma unroll
        for (int panel = 0; panel < K::D / 64; ++panel)
            tma::load_4d(sm.v(st) + panel * K::BN * 128, P.v, sm.full_v(st), panel * 64,
                         nb * K::BN, bidh_k, bidb);
    }
}

// One consumer warpgroup: 64 query rows, its O and softmax state in registers.
template <class K> struct WsConsumer {
    using T = typename K::T;
    static constexpr int D = K::D, BM = K::BM, BN = K::BN, NT = K::NT, DT = K::DT;

    const AttnParams& p;
    const WsSmem<K> sm;
    const Mask mask;
    const int m0, q_last, group, warp_row0, lane;
    float o[1][DT][4];
    uint32_t pa[1][NT / 2][4];  // P of the previous tile, the A operand of P V
    OnlineSoftmax<1> softmax;

    // Pingpong: warpgroup g issues its matmuls after barrier 1 + g completes, then lets the
    // other one go.
    __device__ __forceinline__ void take_turn() const {
        if (K::PINGPONG) tma::named_sync(1 + group, 256);
    }
    __device__ __forceinline__ void pass_turn() const {
        if (K::PINGPONG) tma::named_arrive(1 + (group ^ 1), 256);
    }

    // S = Q K^T of the tile in slot st, issued (one commit group).
    __device__ __forceinline__ void issue_s(float (&s)[1][NT][4], int st) const {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
            sm90::Wgmma<T, BN>::ss(s[0], sm90::kmajor_desc(sm.q() + group * 64 * 128, BM, kk),
                                    sm90::kmajor_desc(sm.k(st), BN, kk), kk > 0);
        sm90::commit();
    }

    // O += P V of the tile in slot st, issued (one commit group). Head dims past 128 take
    // two n128 halves (panels 0-1 and 2-3).
    __device__ __forceinline__ void issue_pv(int st) {
        constexpr int N = D > 128 ? 128 : D;
#pragma unroll
        for (int half = 0; half < D / N; ++half) {
            float(&oh)[N / 8][4] = *reinterpret_cast<float(*)[N / 8][4]>(&o[0][half * N / 8]);
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)
                sm90::Wgmma<T, N>::rs(oh, pa[0][kk],
                                      sm90::mnmajor_desc(sm.v(st) + half * 2 * BN * 128, BN, kk),
                                      1);
        }
        sm90::commit();
    }

    __device__ __forceinline__ void release(uint32_t bar) const {
        if (lane == 0) tma::arrive(bar);
    }

    template <bool MASK> __device__ __forceinline__ void mask_scores(float (&s)[1][NT][4], int nb) const {
        if (MASK) mask.apply<1, NT>(s, m0 + warp_row0, nb * BN, lane);
    }

    // Key tiles [nb_begin, nb_end), last first: the first tile alone, then per tile S(j) and
    // P(j-1) V(j-1) in flight together, the softmax of S(j) under the second, and at the end
    // the last P V.
    __device__ __forceinline__ void run(int nb_begin, int nb_end) {
        zero(o);
        tma::wait(sm.bar_q(), 0);
        {
            const int nb = nb_end - 1;
            float s[1][NT][4];
            tma::wait(sm.full_k(0), 0);
            take_turn();
            sm90::fence();
            issue_s(s, 0);
            pass_turn();
            sm90::wait<0>();
            sm90::fence_operand(s[0]);
            release(sm.empty_k(0));
            if (mask.template block_needs_mask<BN>(m0, q_last, nb * BN))
                mask_scores<true>(s, nb);
            softmax.update(s, o, p.scale_log2);
            pack_a<T, 1, NT>(s, pa);
        }
        for (int nb = nb_end - 2, i = 1; nb >= nb_begin; --nb, ++i) {
            const int st = i % K::STAGES, phase = (i / K::STAGES) & 1;
            const int prev = (i - 1) % K::STAGES, prev_phase = ((i - 1) / K::STAGES) & 1;
            float s[1][NT][4];
            tma::wait(sm.full_k(st), phase);
            // V(j-1) came before K(j); waiting for it here keeps the two issues back to back
            // (ptxas fences between them if a wait loop separates them).
            tma::wait(sm.full_v(prev), prev_phase);
            take_turn();
            sm90::fence_operand(o[0]);
            sm90::fence();
            issue_s(s, st);
            issue_pv(prev);
            pass_turn();
            sm90::wait<1>();
            sm90::fence_operand(s[0]);
            release(sm.empty_k(st));
            if (mask.template block_needs_mask<BN>(m0, q_last, nb * BN))
                mask_scores<true>(s, nb);
            float alpha[1][2];
            const bool rescale = softmax.exp_and_factors(s, alpha, p.scale_log2);
            sm90::wait<0>();
            sm90::fence_operand(o[0]);
            release(sm.empty_v(prev));
            if (rescale) softmax.rescale(o, alpha);
            pack_a<T, 1, NT>(s, pa);
        }
        const int last = nb_end - 1 - nb_begin;
        const int st = last % K::STAGES, phase = (last / K::STAGES) & 1;
        tma::wait(sm.full_v(st), phase);
        take_turn();
        sm90::fence_operand(o[0]);
        sm90::fence();
        issue_pv(st);
        // Every take_turn of one warpgroup needs a pass_turn of the other; warpgroup 1 gave
        // one up front (so that 0 goes first), so it gives none after its last.
        if (group == 0) pass_turn();
        sm90::wait<0>();
        sm90::fence_operand(o[0]);
        release(sm.empty_v(st));
    }
};

template <class K> __device__ __forceinline__ void flash_fwd_ws(const FwdTmaParams& P) {
    using T = typename K::T;
    constexpr int BM = K::BM, BN = K::BN, DT = K::DT;
    const AttnParams& p = P.a;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const WsSmem<K> sm{(smem_addr(smem_raw) + 1023) & ~1023u};  // swizzle atoms: 1 KB aligned

    const int m_block = gridDim.x - 1 - blockIdx.x;  // heaviest (causal) blocks first
    const int bidh = blockIdx.y, bidb = blockIdx.z, bidh_k = bidh / p.h_h_k_ratio;
    const SeqInfo seq(p, bidb);
    const int m0 = m_block * BM;
    const int tid = threadIdx.x, lane = tid % 32, warpgroup = tid / 128;
    const Mask mask(p, seq);
    const int q_last = min(m0 + BM, seq.seqlen_q) - 1;
    int nb_begin, nb_end;
    mask.template key_blocks<BN>(m0, q_last, &nb_begin, &nb_end);
    const bool any_keys = nb_end > nb_begin;

    if (tid == 0) {
        tma::mbar_init(sm.bar_q(), 1);
        for (int st = 0; st < K::STAGES; ++st) {
            tma::mbar_init(sm.full_k(st), 1);
            tma::mbar_init(sm.full_v(st), 1);
            // One arrival per consumer warp, after its reads of the slot completed.
            tma::mbar_init(sm.empty_k(st), 4 * K::CONSUMERS);
            tma::mbar_init(sm.empty_v(st), 4 * K::CONSUMERS);
        }
        tma::fence_barrier_init();
    }
    __syncthreads();

    if (warpgroup == 0) {
        tma::regs_dealloc<K::PRODUCER_REGS>();
        if (tid == 0 && any_keys) ws_produce<K>(P, sm, m0, bidh, bidh_k, bidb, nb_begin, nb_end);
        return;
    }
    tma::regs_alloc<K::CONSUMER_REGS>();
    const int group = warpgroup - 1;
    WsConsumer<K> c{p, sm, mask, m0, q_last, group, group * 64 + (tid % 128) / 32 * 16, lane,
                    {}, {}, {}};
    if (any_keys) {
        if (K::PINGPONG && group == 1) tma::named_arrive(1, 256);  // warpgroup 0 goes first
        c.run(nb_begin, nb_end);
    } else {
        zero(c.o);
    }

    // Epilogue: O / l and the LSE, straight from registers (4-byte stores; once per block).
    T* out = static_cast<T*>(p.o) +
             seq.q_offset(p.o_batch_stride, p.o_row_stride, p.o_head_stride, bidb, bidh);
    float* lse = p.lse + seq.lse_offset(p, bidb, bidh);
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float inv_sum, row_lse;
        c.softmax.finalize(0, r, p.scale, &inv_sum, &row_lse);
        const int row = m0 + c.warp_row0 + g + 8 * r;
        if (row >= seq.seqlen_q) continue;
        if (t == 0) lse[row] = row_lse;
#pragma unroll
        for (int dt = 0; dt < DT; ++dt) {
            const int col = dt * 8 + 2 * t;
            if (col < p.d)
                *reinterpret_cast<uint32_t*>(out + int64_t(row) * p.o_row_stride + col) =
                    MmaOp<T>::pack(c.o[0][dt][2 * r] * inv_sum, c.o[0][dt][2 * r + 1] * inv_sum);
        }
    }
}

// Tiles per head dim (src/cuda/tma.rs: WsShape): 128 query rows; 128 keys per tile at d = 64
// and 128, 64 at d = 256 (two slots of K and V fill shared memory there).
#define FLASH_FWD_WS(NAME, T, D, BN, STAGES, PINGPONG)                                        \
    extern "C" __global__ void __launch_bounds__(384, 1)                                       \
        flash_fwd_ws_##NAME##_d##D(const __grid_constant__ FwdTmaParams p) {                   \
        flash_fwd_ws<WsTraits<T, D, BN, STAGES, PINGPONG>>(p);                                \
    }

FLASH_FWD_WS(f16, __half, 64, 128, 3, true)
FLASH_FWD_WS(bf16, __nv_bfloat16, 64, 128, 3, true)
FLASH_FWD_WS(f16, __half, 128, 128, 2, true)
FLASH_FWD_WS(bf16, __nv_bfloat16, 128, 128, 2, true)
FLASH_FWD_WS(f16, __half, 256, 64, 2, true)
FLASH_FWD_WS(bf16, __nv_bfloat16, 256, 64, 2, true)
