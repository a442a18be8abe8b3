// One query row block of the mma.sync forward pass (sm80/fwd.cu) over its visible key blocks:
// FlashAttention-2 Algorithm 1, lines 6-13, for one thread block.
#pragma once
#include "common/copy.cuh"
#include "common/gemm.cuh"
#include "common/mask/visibility.cuh"
#include "common/mma.cuh"
#include "common/params.cuh"
#include "common/philox.cuh"
#include "common/seq_info.cuh"
#include "common/softmax.cuh"

// Where a block's tiles come from: one (sequence, head) of q and one (sequence, K/V head) of k
// and v, with even row strides. load_q(sQ, m0, tid), load_k(sK, n0, tid) and
// load_v(sV, n0, tid) copy a tile with cp.async, zero-filling rows past the end.
// rows_per_query(), the tile rows of one query token (Mask::apply's), is 1: the block's rows
// are its query rows.
template <class K> struct FwdRows {
    using T = typename K::T;
    const T* q;  // row 0 of this (sequence, head)
    const T* k;  // row 0 of this (sequence, K/V head)
    const T* v;
    int64_t q_row_stride, k_row_stride, v_row_stride;
    int seqlen_q, seqlen_k, d;
    __device__ __forceinline__ int rows_per_query() const { return 1; }

    __device__ __forceinline__ void load_q(T* sQ, int m0, int tid) const {
        load<K::BM>(sQ, q, q_row_stride, m0, seqlen_q, tid);
    }
    __device__ __forceinline__ void load_k(T* sK, int n0, int tid) const {
        load<K::BN>(sK, k, k_row_stride, n0, seqlen_k, tid);
    }
    __device__ __forceinline__ void load_v(T* sV, int n0, int tid) const {
        load<K::BN>(sV, v, v_row_stride, n0, seqlen_k, tid);
    }

  private:
    // ROWS rows from row r0 of a tensor of `rows` rows at `base`.
    template <int ROWS>
    __device__ __forceinline__ void load(T* dst, const T* base, int64_t row_stride, int r0,
                                         int rows, int tid) const {
        load_tile<T, ROWS, K::D, K::THREADS, typename K::Rows>(dst, base + r0 * row_stride,
                                                               row_stride, rows - r0, d, tid);
    }
};

// DROPOUT = false compiles the dropout code out: the Philox rounds cost registers in the loop
// body even when never run, and those registers are what wider key tiles need.
template <class K, bool DROPOUT> struct FwdBlock {
    using T = typename K::T;
    using Mma = MmaOp<T>;
    using Rows = typename K::Rows;
    static constexpr int D = K::D, BM = K::BM, BN = K::BN, MT = K::MT, NT = K::NT, DT = K::DT;
    static constexpr int STRIDE = K::STRIDE;

    const AttnParams& p;
    const FwdRows<K> src;
    const Mask mask;
    const Dropout dropout;
    T* sQ;  // (BM, STRIDE)
    T* sK;  // (BN, STRIDE)
    T* sV;  // (BN, STRIDE)
    const int m0;  // first tile row of the block
    const int q_first, q_last;  // the query tokens of the block's rows (for block skipping)
    const int tid, warp, lane;

    float o[MT][DT][4];  // (MT, DT, mma C) unnormalised output rows of this warp
    OnlineSoftmax<MT> softmax;

    // rows: the sequence's query rows; bidb is the sequence index and bidh the query head (for
    // dropout's counter).
    __device__ __forceinline__ FwdBlock(const AttnParams& p_, const FwdRows<K>& src_,
                                        const Mask& mask_, int bidb, int bidh, int m0_, int rows,
                                        T* smem)
        : p(p_), src(src_), mask(mask_), dropout(p_, bidb, bidh), sQ(smem), sK(smem + BM * STRIDE),
          sV(smem + (BM + BN) * STRIDE), m0(m0_), q_first(m0_ / src_.rows_per_query()),
          q_last((min(m0_ + BM, rows) - 1) / src_.rows_per_query()),
          tid(threadIdx.x), warp(threadIdx.x / 32), lane(threadIdx.x % 32) {
        zero(o);
        src.load_q(sQ, m0, tid);
    }

    __device__ __forceinline__ int warp_row0() const { return warp * MT * 16; }
    __device__ __forceinline__ bool dropout_on() const { return DROPOUT && dropout.active(); }

    __device__ __forceinline__ void load_k(int nb) { src.load_k(sK, nb * BN, tid); }
    __device__ __forceinline__ void load_v(int nb) { src.load_v(sV, nb * BN, tid); }

    // Key blocks this block's queries can see: [*begin, *end).
    __device__ __forceinline__ void key_blocks(int* begin, int* end) const {
        mask.template key_blocks<BN>(q_first, q_last, begin, end);
    }

    // Zeroes the dropped entries of P (FA2 Algorithm 1 with dropout); the 1/(1 - p) scale is
    // applied once, with 1/l, when O is stored.
    __device__ __forceinline__ void apply_dropout(float (&s)[MT][NT][4], int nb) const {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            uint32_t keep[2];
            dropout.template keep_fragment<NT, false, NT>(keep, m0 + warp_row0() + mt * 16,
                                                          nb * BN, lane);
            Dropout::zero_dropped<NT>(s[mt], keep);
        }
    }

    // One key block. K[nb] is in shared memory; V[nb] is requested here and K[next] (the next
    // block, -1 if none) once S is computed, so each copy overlaps at least one of the two
    // matmuls.
    template <bool MASK> __device__ __forceinline__ void step(int nb, int next) {
        load_v(nb);
        cp_async_commit();
        float s[MT][NT][4];  // S = Q K^T (line 8), its k-loop fully unrolled at every d
                             // (+1-4% at d 160-256; ptxas: at most 8 B of stack)
        zero(s);
        gemm_ss<T, MT, NT, D / 16, Rows>(s, sQ + warp_row0() * STRIDE, sK, lane);
        mask.apply<MT, NT>(s, m0 + warp_row0(), nb * BN, lane, MASK, src.rows_per_query());
        // K[nb - 1] is requested before the softmax, so that its copy overlaps the softmax
        // as well as P V (FlashAttention-2's order: +2-3% at d = 128 on the H100 than
        // requesting it after the softmax; docs/archive/PERF.md, "the sm_80 set next to
        // FlashAttention-2, counter by counter").
        cp_async_wait<0>();
        __syncthreads();  // V[nb] landed; every warp is done reading K[nb]
        if (next >= 0) {
            load_k(next);
            cp_async_commit();
        }
        softmax.update(s, o, p.scale_log2);  // l and the LSE count every entry, dropped or not
        if (dropout_on()) apply_dropout(s, nb);
        uint32_t pa[MT][NT / 2][4];  // P as the A operand of P V, straight from registers
        pack_a<T, MT, NT>(s, pa);
        gemm_rs<T, MT, NT / 2, DT, Rows>(o, pa, sV, lane);  // O += P V (line 10)
    }

    // Key blocks [nb_begin, nb_end), last first: with a causal mask the only blocks that need
    // the mask come first, and the rest run the mask-free body. A block mask skips blocks.
    __device__ __forceinline__ void run(int nb_begin, int nb_end) {
        int nb = mask.template next_key_block<BN>(q_first, q_last, nb_end, nb_begin);
        if (nb >= 0) load_k(nb);
        cp_async_commit();  // Q (from the constructor) and the first K
        while (nb >= 0) {
            const int next = mask.template next_key_block<BN>(q_first, q_last, nb, nb_begin);
            cp_async_wait<0>();
            __syncthreads();  // K[nb] landed; every warp is done reading the last V
            if (mask.template block_needs_mask<BN>(q_first, q_last, nb * BN))
                step<true>(nb, next);
            else
                step<false>(nb, next);
            nb = next;
        }
        // Q rows are copied by every thread, not by the warp that owns them: before a warp
        // reuses its rows of sQ to stage O, all copies must have landed. Inside the loop the
        // first barrier does this; a block that sees no key block never reaches it.
        cp_async_wait<0>();
        __syncthreads();
    }

    // Normalises O by 1/l (line 12), writes it through this warp's rows of sQ (only this warp
    // ever read them) as 16-byte coalesced stores, and writes the LSE (line 13); seqlen_q rows
    // exist.
    __device__ __forceinline__ void store(T* out, int64_t out_row_stride, float* lse,
                                          int seqlen_q) {
        const int g = lane / 4, t = lane % 4;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float inv_sum, row_lse;
                softmax.finalize(mt, r, p.scale, &inv_sum, &row_lse);
                if (dropout_on()) inv_sum *= p.rp_keep;
                const int row = warp_row0() + mt * 16 + g + 8 * r;
                if (t == 0 && m0 + row < seqlen_q) lse[m0 + row] = row_lse;
#pragma unroll
                for (int dt = 0; dt < DT; ++dt)
                    *reinterpret_cast<uint32_t*>(sQ + Rows::offset(row, dt * 8) + 2 * t) =
                        Mma::pack(o[mt][dt][2 * r] * inv_sum, o[mt][dt][2 * r + 1] * inv_sum);
            }
        __syncwarp();
        constexpr int ROWS = MT * 16, CHUNKS_PER_ROW = D / CHUNK;
#pragma unroll
        for (int c = lane; c < ROWS * CHUNKS_PER_ROW; c += 32) {
            const int row = warp_row0() + c / CHUNKS_PER_ROW;
            const int col = (c % CHUNKS_PER_ROW) * CHUNK;
            if (m0 + row < seqlen_q && col < p.d)
                *reinterpret_cast<uint4*>(out + int64_t(m0 + row) * out_row_stride + col) =
                    *reinterpret_cast<const uint4*>(sQ + Rows::offset(row, col));
        }
    }
};
