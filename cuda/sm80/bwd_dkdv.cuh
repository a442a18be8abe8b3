// dK and dV for one block of keys: FlashAttention-2 Algorithm 2, lines 5-21. Without K::DQ
// dQ is left to the dQ kernel, so nothing is accumulated across blocks and the result is
// deterministic; with it, each tile's dQ share is added atomically (bwd_dq_accum.cuh).
// Scores are computed transposed, S^T = K Q^T, so that P^T and dS^T land in registers
// already as the A operands of dV += P^T dO and dK += dS^T Q.
#pragma once
#include "common/bwd_dq_accum.cuh"
#include "common/bwd_tiles.cuh"
#include "sm80/bwd_key_block.cuh"
#include "sm80/bwd_traits.cuh"
#include "common/copy.cuh"
#include "common/gemm.cuh"
#include "common/mask/levels.cuh"
#include "common/mask/visibility.cuh"
#include "common/params.cuh"
#include "common/philox.cuh"
#include "common/seq_info.cuh"
#include "common/softmax.cuh"

// MAYBE_DROPOUT = false compiles the dropout code out (it costs registers in the loop) for
// launches without dropout. MODS: MODS_SCORES, or MODS_SPARSE for the `_sparse` kernels, the
// only ones a block mask runs (its walk cost the others up to 48 bytes of spill, sm_80).
template <class K, bool MAYBE_DROPOUT = true, int MODS = MODS_SCORES>
__device__ __forceinline__ void flash_bwd_dkdv(const BwdParams& bp) {
    using T = typename K::T;
    using Rows = typename K::Rows;
    constexpr int D = K::D, DO = K::DO, BN = K::BN, BM = K::BM, MT = K::MT, NQ = K::NQ;
    constexpr int DOT = K::DOT, STRIDE = K::STRIDE, STAGES = K::STAGES;
    static_assert(STAGES == 1 || STAGES == 2, "Q/dO tiles are single- or double-buffered");
    // Fully unrolled k-loops where measured faster (the 128-key shapes above d = 64); the
    // others keep the registers (ptxas -v, sm_80: full unrolling doubled or tripled their spills).
    constexpr bool FULL_UNROLL = D > 64 && K::NWARPS == 8;
    const AttnParams& p = bp.a;
    extern __shared__ __align__(128) unsigned char smem_raw[];  // SwizzledRows tiles
    T* sK = reinterpret_cast<T*>(smem_raw);
    T* sV = sK + BN * STRIDE;
    T* sQ_all = sV + BN * STRIDE;             // STAGES Q tiles
    T* sdO_all = sQ_all + STAGES * BM * STRIDE;  // STAGES dO tiles
    T* sdS_t = sdO_all + STAGES * BM * STRIDE;   // dS^T (BN x BM), K::DQ only
    // Per stage: the LSE of the tile's rows (single-buffered: in log2 units, +inf = no row;
    // double-buffered: as stored) and their rowsum(dO O).
    float* sLse_all = reinterpret_cast<float*>(sdS_t + (K::DQ ? BN * K::DS_STRIDE : 0));
    float* sDsum_all = sLse_all + STAGES * BM;

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, warp_row0 = warp * MT * 16;
    const int n0 = blockIdx.x * BN;
    const int split = blockIdx.y % K::SPLITS, bidh_k = blockIdx.y / K::SPLITS, bidb = blockIdx.z;
    const int col0 = split * DO;  // first dK/dV column of this block
    const SeqInfo seq(p, bidb);
    if (n0 >= seq.seqlen_k) return;  // packed batches: this sequence is shorter than the grid

    load_key_block<T, BN, D, K::THREADS, Rows>(sK, sV, p, seq, bidb, bidh_k, n0, tid);
    cp_async_commit();

    float dk[MT][DOT][4], dv[MT][DOT][4];
    zero(dk);
    zero(dv);
    const Mask mask(p, seq, bidb, bidh_k * p.h_h_k_ratio, MODS);
    const QueryTiles<BM, BN> tiles(mask, p, n0, seq.seqlen_q);  // (bidh, m0) follows it
    const auto load_q_do = [&](int bidh, int m0, int stage) {
        const T* q = static_cast<const T*>(p.q) +
                     seq.q_offset(p.q_batch_stride, p.q_row_stride, p.q_head_stride, bidb, bidh);
        const T* dout = static_cast<const T*>(bp.dout) +
                        seq.q_offset(p.o_batch_stride, p.o_row_stride, p.o_head_stride, bidb, bidh);
        load_tile<T, BM, D, K::THREADS, Rows>(sQ_all + stage * BM * STRIDE,
                                              q + int64_t(m0) * p.q_row_stride, p.q_row_stride,
                                              seq.seqlen_q - m0, p.d, tid);
        load_tile<T, BM, D, K::THREADS, Rows>(sdO_all + stage * BM * STRIDE,
                                              dout + int64_t(m0) * p.o_row_stride,
                                              p.o_row_stride, seq.seqlen_q - m0, p.d, tid);
    };
    // Single-buffered: row `tid` of tile `it` (tid < BM), LSE in log2 units and rowsum(dO O).
    const auto row_stats = [&](int bidh, int m0, float& lse2, float& dsum) {
        const int row = m0 + tid;
        const int64_t off = seq.lse_offset(p, bidb, bidh);
        const float l = row < seq.seqlen_q ? p.lse[off + row] : -INFINITY;
        lse2 = lse_log2(l);  // rows past the end read -inf, so P = 0 there too
        dsum = row < seq.seqlen_q ? bp.dsum[off + row] : 0.f;
    };

    // Double-buffered: the row statistics travel raw with the tile's cp.async group.
    const auto stats_of_stage = [&](int bidh, int m0, int stage) {
        load_row_stats<BM>(sLse_all, sDsum_all, stage, bp, seq, bidb, bidh, m0, tid);
    };
    int bidh = bidh_k * p.h_h_k_ratio, m0 = tiles.m0_begin;  // tile it
    if (tiles.count > 0) tiles.first(mask, bidh, m0);
    if constexpr (STAGES == 2) {
        if (tiles.count > 0) {
            load_q_do(bidh, m0, 0);
            stats_of_stage(bidh, m0, 0);
        }
        cp_async_commit();
    }
    for (int it = 0; it < tiles.count; ++it, tiles.next(mask, bidh, m0)) {
        const int stage = STAGES == 2 ? it % 2 : 0;
        const T* sQ = sQ_all + stage * BM * STRIDE;
        const T* sdO = sdO_all + stage * BM * STRIDE;
        const float* sLse = sLse_all + stage * BM;
        const float* sDsum = sDsum_all + stage * BM;
        if constexpr (STAGES == 1) {
            __syncthreads();  // every warp is done with the previous Q, dO tiles
            load_q_do(bidh, m0, 0);
            cp_async_commit();
            if (tid < BM) row_stats(bidh, m0, sLse_all[tid], sDsum_all[tid]);
            cp_async_wait<0>();
            __syncthreads();
        } else {
            cp_async_wait<0>();
            // Tile it is visible to every warp, and every warp is done with tile it - 1, whose
            // stage the next tile's copy now overwrites while this one is computed.
            __syncthreads();
            if (it + 1 < tiles.count) {
                int next_bidh = bidh, next_m0 = m0;
                tiles.next(mask, next_bidh, next_m0);
                load_q_do(next_bidh, next_m0, stage ^ 1);
                stats_of_stage(next_bidh, next_m0, stage ^ 1);
            }
            cp_async_commit();
        }
        const Dropout dropout(p, bidb, bidh);
        const bool use_dropout = MAYBE_DROPOUT && dropout.active();
        // LSE of column `col` in log2 units (single-buffered tiles stored it converted).
        const auto lse2 = [&](int col) {
            if constexpr (STAGES == 1) return sLse[col];
            return lse_log2(sLse[col]);
        };

        float st[MT][NQ][4];  // S^T = K Q^T (line 11), then P^T (line 13)
        zero(st);
        gemm_ss<T, MT, NQ, D / 16, Rows, FULL_UNROLL>(st, sK + warp_row0 * STRIDE, sQ, lane);
        // Two calls with constant `masked`, not one with the test as argument: that one
        // spilled 36 bytes at d = 224 (ptxas -v, sm_80).
        // The block mask is per query head; the rest of block_needs_mask is not.
        if ((MODS & MODS_BLOCKS ? mask.with_head(bidh) : mask)
                .template block_needs_mask<BN>(m0, m0 + BM - 1, n0))
            mask.with_head(bidh).template apply<MT, NQ, true>(st, n0 + warp_row0, m0, lane, true);
        else
            mask.with_head(bidh).template apply<MT, NQ, true>(st, n0 + warp_row0, m0, lane, false);
        const int t = lane % 4;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int col = nt * 8 + 2 * t + (e % 2);
                    st[mt][nt][e] = exp2f(fmaf(st[mt][nt][e], p.scale_log2, -lse2(col)));
                }
        // Dropout keep bits of this thread's entries: bit (2 nt + e % 2) of keep[mt][r].
        // Both uses (P for dV, dP for dS) scale kept entries by 1 / (1 - p) and zero the rest.
        uint32_t keep[MT][2] = {};  // read only under use_dropout
        const auto dropped = [&](float x, int mt, int nt, int e) {
            return Dropout::scaled(keep[mt], e / 2, nt, e % 2, x, p.rp_keep);
        };
        if (use_dropout) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                dropout.template keep_fragment<NQ, true, NQ>(keep[mt], n0 + warp_row0 + mt * 16,
                                                             m0, lane);
        }
        uint32_t a[MT][NQ / 2][4];
        if (use_dropout) {
            // dV += (P o Z / (1 - p))^T dO: the dropped probabilities the forward used.
            float pd[MT][NQ][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) pd[mt][nt][e] = dropped(st[mt][nt][e], mt, nt, e);
            pack_a<T, MT, NQ>(pd, a);
        } else {
            pack_a<T, MT, NQ>(st, a);
        }
        gemm_rs<T, MT, NQ / 2, DOT, Rows>(dv, a, sdO + col0, lane);  // dV += P^T dO (line 16)

        float dpt[MT][NQ][4];  // dP^T = V dO^T (line 17), then dS^T (line 19)
        zero(dpt);
        gemm_ss<T, MT, NQ, D / 16, Rows, FULL_UNROLL>(dpt, sV + warp_row0 * STRIDE, sdO, lane);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int col = nt * 8 + 2 * t + (e % 2);
                    float dp = dpt[mt][nt][e];  // with dropout: d(P o Z / (1 - p))
                    if (use_dropout) dp = dropped(dp, mt, nt, e);
                    dpt[mt][nt][e] = st[mt][nt][e] * (dp - sDsum[col]);
                }
        if (mask.softcap_pre != 0.f)  // dS's factor 1 - t^2 from the tanh
            mask.with_head(bidh).template times_cap_grad<MT, NQ, true>(
                dpt, st, n0 + warp_row0, m0, lane, p.scale_log2,
                [&](int, int nt, int e) { return lse2(nt * 8 + 2 * t + (e % 2)); });
        pack_a<T, MT, NQ>(dpt, a);
        if constexpr (K::DQ)
            store_ds_t<MT, NQ / 2, K::DS_STRIDE>(sdS_t + warp_row0 * K::DS_STRIDE, a, lane);
        gemm_rs<T, MT, NQ / 2, DOT, Rows>(dk, a, sQ + col0, lane);  // dK += dS^T Q (line 21)
        if constexpr (K::DQ) {
            __syncthreads();  // dS^T of every warp is in shared memory
            dq_accumulate<K>(sdS_t, sK, bp.dq_accum + dq_tile_offset<K>(bp, seq, bidb, bidh, m0),
                             warp, lane);  // dQ += dS K (line 20)
        }
    }

    cp_async_wait<0>();  // K and V were requested even if no query block sees them

    store_dk_dv<T, MT, DOT>(dk, dv, bp, seq, bidb, bidh_k, n0 + warp_row0, col0, lane);
}
