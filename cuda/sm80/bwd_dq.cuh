// dQ for one block of query rows: the forward's loop over key blocks (same order, same mask
// handling), recomputing P from the saved LSE instead of an online softmax, then
// dP = dO V^T, dS = P (dP - rowsum(dO O)) and dQ += dS K (Algorithm 2, lines 11-20).
// A separate pass costs two more matmuls than FA2's atomic dQ updates but needs no f32
// accumulator in device memory and is deterministic.
#pragma once
#include "sm80/bwd_traits.cuh"
#include "common/copy.cuh"
#include "common/softmax.cuh"
#include "common/gemm.cuh"
#include "common/mask/score_mods.cuh"
#include "common/mask/visibility.cuh"
#include "common/params.cuh"
#include "common/philox.cuh"
#include "common/seq_info.cuh"

template <class K> __device__ __forceinline__ void flash_bwd_dq(const BwdParams& bp) {
    using T = typename K::T;
    constexpr int D = K::D, BN = K::BN, BM = K::BM, MT = K::MT, NT = K::NT, DT = K::DT;
    using Rows = typename K::Rows;
    constexpr int STRIDE = K::STRIDE;
    const AttnParams& p = bp.a;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);
    T* sdO = sQ + BM * STRIDE;
    T* sK = sdO + BM * STRIDE;
    T* sV = sK + BN * STRIDE;

    const int tid = threadIdx.x, lane = tid % 32, warp_row0 = (tid / 32) * MT * 16;
    const int g = lane / 4, t = lane % 4;
    const int m_block = gridDim.x - 1 - blockIdx.x;  // heaviest (causal) blocks first
    const int bidh = blockIdx.y, bidb = blockIdx.z, bidh_k = bidh / p.h_h_k_ratio;
    const int m0 = m_block * BM;
    const SeqInfo seq(p, bidb);
    if (m0 >= seq.seqlen_q) return;  // packed batches: this sequence is shorter than the grid

    const T* q = static_cast<const T*>(p.q) +
                 seq.q_offset(p.q_batch_stride, p.q_row_stride, p.q_head_stride, bidb, bidh);
    const T* k = static_cast<const T*>(p.k) +
                 seq.k_offset(p.k_batch_stride, p.k_row_stride, p.k_head_stride, bidb, bidh_k);
    const T* v = static_cast<const T*>(p.v) +
                 seq.k_offset(p.v_batch_stride, p.v_row_stride, p.v_head_stride, bidb, bidh_k);
    const T* dout = static_cast<const T*>(bp.dout) +
                    seq.q_offset(p.o_batch_stride, p.o_row_stride, p.o_head_stride, bidb, bidh);
    load_tile<T, BM, D, K::THREADS, Rows>(sQ, q + int64_t(m0) * p.q_row_stride, p.q_row_stride,
                                          seq.seqlen_q - m0, p.d, tid);
    load_tile<T, BM, D, K::THREADS, Rows>(sdO, dout + int64_t(m0) * p.o_row_stride,
                                          p.o_row_stride, seq.seqlen_q - m0, p.d, tid);
    cp_async_commit();

    // This thread's rows: LSE in log2 units (+inf where P must be 0) and rowsum(dO O).
    float lse2[MT][2], dsum[MT][2];
    const int64_t row_base = seq.lse_offset(p, bidb, bidh);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = m0 + warp_row0 + mt * 16 + g + 8 * r;
            const float l = row < seq.seqlen_q ? p.lse[row_base + row] : -INFINITY;
            lse2[mt][r] = lse_log2(l);
            dsum[mt][r] = row < seq.seqlen_q ? bp.dsum[row_base + row] : 0.f;
        }

    float dq[MT][DT][4];
    zero(dq);
    const Mask mask(p, seq, bidb, bidh);
    const Dropout dropout(p, bidb, bidh);
    int nb_begin, nb_end;
    mask.template key_blocks<BN>(m0, m0 + BM - 1, &nb_begin, &nb_end);
    for (int nb = mask.template next_key_block<BN>(m0, m0 + BM - 1, nb_end, nb_begin); nb >= 0;
         nb = mask.template next_key_block<BN>(m0, m0 + BM - 1, nb, nb_begin)) {
        const int n0 = nb * BN;
        __syncthreads();  // every warp is done with the previous K, V tiles
        load_tile<T, BN, D, K::THREADS, Rows>(sK, k + int64_t(n0) * p.k_row_stride,
                                              p.k_row_stride, seq.seqlen_k - n0, p.d, tid);
        load_tile<T, BN, D, K::THREADS, Rows>(sV, v + int64_t(n0) * p.v_row_stride,
                                              p.v_row_stride, seq.seqlen_k - n0, p.d, tid);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();

        float s[MT][NT][4];  // S = Q K^T, then P = exp(scale S - LSE)
        zero(s);
        gemm_ss<T, MT, NT, D / 16, Rows, false>(s, sQ + warp_row0 * STRIDE, sK, lane);
        mask.apply<MT, NT>(s, m0 + warp_row0, n0, lane,
                           mask.template block_needs_mask<BN>(m0, m0 + BM - 1, n0));
        float dp[MT][NT][4];  // dP = dO V^T, then dS = P (dP - rowsum(dO O))
        zero(dp);
        gemm_ss<T, MT, NT, D / 16, Rows, false>(dp, sdO + warp_row0 * STRIDE, sV, lane);
        // With dropout, dO V^T is the gradient of P o Z / (1 - p).
        uint32_t keep[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            if (dropout.active())
                dropout.template keep_fragment<NT, false, 1>(keep[mt], m0 + warp_row0 + mt * 16,
                                                              n0, lane);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const int e = 2 * r + c;
                        const float prob = exp2f(fmaf(s[mt][nt][e], p.scale_log2, -lse2[mt][r]));
                        float dpe = dp[mt][nt][e];
                        if (dropout.active())
                            dpe = Dropout::scaled(keep[mt], r, nt, c, dpe, p.rp_keep);
                        float ds = prob * (dpe - dsum[mt][r]);
                        if (mask.softcap_pre != 0.f)  // the tanh's factor 1 - t^2
                            ds = cap_grad_times(ds, mask.template capped<false>(
                                s[mt][nt][e], m0 + warp_row0 + mt * 16 + g + 8 * r,
                                n0 + nt * 8 + 2 * t + c));
                        dp[mt][nt][e] = ds;
                    }
                }
        uint32_t a[MT][NT / 2][4];
        pack_a<T, MT, NT>(dp, a);
        gemm_rs<T, MT, NT / 2, DT, Rows>(dq, a, sK, lane);  // dQ += dS K
    }
    cp_async_wait<0>();  // Q and dO were requested even if no key block is visible

    T* dq_out = static_cast<T*>(bp.dq) +
                seq.q_offset(p.o_batch_stride, p.o_row_stride, p.o_head_stride, bidb, bidh);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = m0 + warp_row0 + mt * 16 + g + 8 * r;
            if (row >= seq.seqlen_q) continue;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                const int col = dt * 8 + 2 * t;
                if (col >= p.d) continue;
                *reinterpret_cast<uint32_t*>(dq_out + int64_t(row) * p.o_row_stride + col) =
                    MmaOp<T>::pack(dq[mt][dt][2 * r] * p.grad_scale, dq[mt][dt][2 * r + 1] * p.grad_scale);
            }
        }
}
