// dK, dV and atomic dQ for one block of keys on FlashAttention-2's warp layout (its
// Algorithm 2, lines 5-21; the traits in bwd_traits.cuh). The fused kernel of bwd_dkdv.cuh
// gives each warp 16 keys against all of a tile's queries and keeps P^T and dS^T in registers
// as the A operands of dV and dK, so every warp reads all of Q and dO for every product; here
// S^T and dP^T are split over keys and queries and P^T, dS^T go through shared memory, which
// reads fewer shared bytes per mma (sm_80's limit in this kernel) at the price of one more
// barrier per tile and the P^T stores: +3-4% at d = 128 on the H100's sm_80 path, but 1-3%
// slower at d = 64, which keeps the other layout (docs/archive/PERF.md, "the fused backward
// on FlashAttention-2's warp layout"). At d = 256, where no other fused kernel fits, it
// replaces the deterministic pair (dK/dV in two column halves that each recompute S and dP,
// then a dQ kernel that recomputes both again). No dropout: those problems keep the other
// kernels.
#pragma once
#include "common/bwd_dq_accum.cuh"
#include "common/bwd_tiles.cuh"
#include "common/copy.cuh"
#include "common/gemm.cuh"
#include "common/mask/levels.cuh"
#include "common/mask/visibility.cuh"
#include "common/params.cuh"
#include "common/seq_info.cuh"
#include "common/softmax.cuh"
#include "sm80/bwd_key_block.cuh"
#include "sm80/bwd_traits.cuh"

template <class K, int MODS>
__device__ __forceinline__ void flash_bwd_grid(const BwdParams& bp) {
    using T = typename K::T;
    using Rows = typename K::Rows;
    constexpr int D = K::D, BN = K::BN, BM = K::BM, MT = K::MT, NQ = K::NQ;
    constexpr int STRIDE = K::STRIDE, DS_STRIDE = K::DS_STRIDE;
    constexpr int KMT = K::KMT, DOT = K::DOT, STAGES = K::STAGES;
    const AttnParams& p = bp.a;
    extern __shared__ __align__(128) unsigned char smem_raw[];  // SwizzledRows tiles
    T* sK = reinterpret_cast<T*>(smem_raw);
    T* sV = sK + BN * STRIDE;
    T* sQ_all = sV + BN * STRIDE;                // STAGES Q tiles
    T* sdO = sQ_all + STAGES * BM * STRIDE;      // one dO tile
    T* sP_t = sdO + BM * STRIDE;                 // P^T (BN x BM)
    T* sdS_t = sP_t + BN * DS_STRIDE;            // dS^T (BN x BM)
    // Per Q stage: the LSE of the tile's rows (as stored) and their rowsum(dO O).
    float* sLse_all = reinterpret_cast<float*>(sdS_t + BN * DS_STRIDE);
    float* sDsum_all = sLse_all + STAGES * BM;

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    // S^T warp tile: keys key0.., queries q0.. of the tile; dK/dV warp tile: keys kv0..,
    // columns c0...
    const int key0 = (warp % K::WK) * MT * 16, q0 = (warp / K::WK) * NQ * 8;
    const int kv0 = (warp % K::WKV) * KMT * 16, c0 = (warp / K::WKV) * DOT * 8;
    const int n0 = blockIdx.x * BN, bidh_k = blockIdx.y, bidb = blockIdx.z;
    const SeqInfo seq(p, bidb);
    if (n0 >= seq.seqlen_k) return;  // packed batches: this sequence is shorter than the grid

    load_key_block<T, BN, D, K::THREADS, Rows>(sK, sV, p, seq, bidb, bidh_k, n0, tid);
    cp_async_commit();

    float dk[KMT][DOT][4], dv[KMT][DOT][4];
    zero(dk);
    zero(dv);
    const Mask mask(p, seq, bidb, bidh_k * p.h_h_k_ratio, MODS);
    const QueryTiles<BM, BN> tiles(mask, p, n0, seq.seqlen_q);
    const auto load_q = [&](int bidh, int m0, int stage) {
        load_query_rows<T, BM, D, K::THREADS, Rows>(sQ_all + stage * BM * STRIDE, QueryRows::Q,
                                                    bp, seq, bidb, bidh, m0, tid);
    };
    const auto load_do = [&](int bidh, int m0) {
        load_query_rows<T, BM, D, K::THREADS, Rows>(sdO, QueryRows::DO, bp, seq, bidb, bidh, m0,
                                                    tid);
    };
    // The row statistics into Q's stage (bwd_key_block.cuh).
    const auto stats_of_stage = [&](int bidh, int m0, int stage) {
        load_row_stats<BM>(sLse_all, sDsum_all, stage, bp, seq, bidb, bidh, m0, tid);
    };
    int bidh = bidh_k * p.h_h_k_ratio, m0 = tiles.m0_begin;
    if (tiles.count > 0) {
        tiles.first(mask, bidh, m0);
        load_q(bidh, m0, 0);
        load_do(bidh, m0);
        stats_of_stage(bidh, m0, 0);
    }
    cp_async_commit();
    const int t = lane % 4;
    for (int it = 0; it < tiles.count; ++it) {
        const int stage = STAGES == 2 ? it % 2 : 0;
        const T* sQ = sQ_all + stage * BM * STRIDE;
        const float* sLse = sLse_all + stage * BM;
        const float* sDsum = sDsum_all + stage * BM;
        int next_bidh = bidh, next_m0 = m0;
        const bool has_next = it + 1 < tiles.count;
        if (has_next) tiles.next(mask, next_bidh, next_m0);
        cp_async_wait<0>();
        // Tile it (Q, dO, row statistics) is visible to every warp, and every warp is done
        // with tile it - 1: its Q stage, P^T and dS^T.
        __syncthreads();
        if constexpr (STAGES == 2) {
            if (has_next) {
                load_q(next_bidh, next_m0, stage ^ 1);
                stats_of_stage(next_bidh, next_m0, stage ^ 1);
            }
            cp_async_commit();
        }

        float st[MT][NQ][4];  // S^T = K Q^T (line 11), then P^T (line 13)
        zero(st);
        gemm_ss<T, MT, NQ, D / 16, Rows>(st, sK + key0 * STRIDE, sQ + q0 * STRIDE, lane);
        if ((MODS & MODS_BLOCKS ? mask.with_head(bidh) : mask)
                .template block_needs_mask<BN>(m0, m0 + BM - 1, n0))
            mask.with_head(bidh).template apply<MT, NQ, true>(st, n0 + key0, m0 + q0, lane, true);
        else
            mask.with_head(bidh).template apply<MT, NQ, true>(st, n0 + key0, m0 + q0, lane, false);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int col = q0 + nt * 8 + 2 * t + (e % 2);
                    st[mt][nt][e] =
                        exp2f(fmaf(st[mt][nt][e], p.scale_log2, -lse_log2(sLse[col])));
                }
        uint32_t a[MT][NQ / 2][4];
        pack_a<T, MT, NQ>(st, a);
        store_ds_t<MT, NQ / 2, DS_STRIDE>(sP_t + key0 * DS_STRIDE + q0, a, lane);

        float dpt[MT][NQ][4];  // dP^T = V dO^T (line 17), then dS^T (line 19)
        zero(dpt);
        gemm_ss<T, MT, NQ, D / 16, Rows>(dpt, sV + key0 * STRIDE, sdO + q0 * STRIDE, lane);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int col = q0 + nt * 8 + 2 * t + (e % 2);
                    dpt[mt][nt][e] = st[mt][nt][e] * (dpt[mt][nt][e] - sDsum[col]);
                }
        if (mask.softcap_pre != 0.f)  // dS's factor 1 - t^2 from the tanh
            mask.with_head(bidh).template times_cap_grad<MT, NQ, true>(
                dpt, st, n0 + key0, m0 + q0, lane, p.scale_log2, [&](int, int nt, int e) {
                    return lse_log2(sLse[q0 + nt * 8 + 2 * t + (e % 2)]);
                });
        pack_a<T, MT, NQ>(dpt, a);
        store_ds_t<MT, NQ / 2, DS_STRIDE>(sdS_t + key0 * DS_STRIDE + q0, a, lane);
        __syncthreads();  // P^T and dS^T of every warp are in shared memory

        // dV += P^T dO (line 16), then dO's buffer is free for the next tile.
        gemm_st<T, KMT, BM / 16, DOT, PitchRows<DS_STRIDE>, Rows>(dv, sP_t + kv0 * DS_STRIDE,
                                                                  sdO + c0, lane);
        __syncthreads();
        if (has_next) load_do(next_bidh, next_m0);
        cp_async_commit();
        // dK += dS^T Q (line 21), dQ += dS K (line 20).
        gemm_st<T, KMT, BM / 16, DOT, PitchRows<DS_STRIDE>, Rows>(dk, sdS_t + kv0 * DS_STRIDE,
                                                                  sQ + c0, lane);
        if constexpr (STAGES == 1) {
            __syncthreads();  // every warp is done with Q and the row statistics
            if (has_next) {
                load_q(next_bidh, next_m0, 0);
                stats_of_stage(next_bidh, next_m0, 0);
            }
            cp_async_commit();
        }
        dq_accumulate<K>(sdS_t, sK, bp.dq_accum + dq_tile_offset<K>(bp, seq, bidb, bidh, m0),
                         warp, lane);
        bidh = next_bidh;
        m0 = next_m0;
    }

    cp_async_wait<0>();  // K and V were requested even if no query block sees them

    store_dk_dv<T, KMT, DOT>(dk, dv, bp, seq, bidb, bidh_k, n0 + kv0, c0, lane);
}
