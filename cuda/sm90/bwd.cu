// The backward kernel on Hopper tensor cores (wgmma, sm_90a): FlashAttention-2 Algorithm 2
// for one block of 128 keys, the five matmuls issued per warpgroup. Two warpgroups own 64
// keys each and stream 64-row tiles of Q and dO (two cp.async stages). As in the mma.sync
// kernel (bwd_dkdv.cuh), scores are computed transposed, S^T = K Q^T and dP^T = V dO^T, so
// P^T and dS^T are register A operands of dV += P^T dO and dK += dS^T Q (dO and Q MN-major).
// dS^T then goes to shared memory for dQ = dS K (both operands MN-major), which the
// warpgroups split by columns and add to an f32 buffer with atomics; the launcher zeroes it
// before and converts it after (flash_bwd_dq_convert_<dtype> in bwd.cu).
// Entry points flash_bwd_sm90_<dtype>_d<D> for D = 64 and 128, non-deterministic, without
// dropout; src/cuda/plan/bwd.rs runs the mma.sync kernels for everything else.
#include "common/bwd_dq_accum.cuh"
#include "common/bwd_tiles.cuh"
#include "common/mask/levels.cuh"
#include "common/mask/visibility.cuh"
#include "common/params.cuh"
#include "common/seq_info.cuh"
#include "common/softmax.cuh"
#include "sm90/wgmma.cuh"

// MODS (common/mask/levels.cuh): with the softcap and ALiBi code (`_mods`), also with the
// block mask's (`_sparse`), as in sm90/fwd.cu.
template <typename T_, int D_, int MODS_ = MODS_NONE> struct BwdSm90Traits {
    using T = T_;
    static constexpr int D = D_;
    static constexpr int MODS = MODS_;
    static constexpr int BN = 128;  // keys per block, 64 per warpgroup
    static constexpr int BM = 64;   // query rows per streamed tile
    static constexpr int THREADS = 256;
    static constexpr int NQ = BM / 8;        // n8 tiles of S^T per warpgroup row
    static constexpr int DT = D / 8;         // n8 tiles of dK, dV
    static constexpr int DQ_N = D / 2;       // dQ columns per warpgroup
    static constexpr int KV_BYTES = BN * D * 2, Q_BYTES = BM * D * 2, DS_BYTES = BN * BM * 2;
    // K, V, two stages of (Q, dO), dS^T, two stages of (LSE, dsum); 1 KB for the alignment.
    static constexpr int SMEM_BYTES = 2 * KV_BYTES + 4 * Q_BYTES + DS_BYTES + 4 * BM * 4 + 1024;
    static_assert(D % 64 == 0 && BM == 64, "panel tiles; dS^T is one 64-column panel");
};

template <class K> __device__ __forceinline__ void flash_bwd_sm90(const BwdParams& bp) {
    using T = typename K::T;
    constexpr int D = K::D, BN = K::BN, BM = K::BM, NQ = K::NQ, DT = K::DT, DQ_N = K::DQ_N;
    const AttnParams& p = bp.a;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const uint32_t sK = (smem_addr(smem_raw) + 1023) & ~1023u;  // swizzle atoms: 1 KB aligned
    const uint32_t sV = sK + K::KV_BYTES;
    const uint32_t sQ0 = sV + K::KV_BYTES;  // stage s: Q at sQ0 + 2 s Q_BYTES, dO after it
    const uint32_t sdS = sQ0 + 4 * K::Q_BYTES;
    float* sStats = reinterpret_cast<float*>(smem_raw + (sdS + K::DS_BYTES - smem_addr(smem_raw)));
    // stage s: LSE at sStats + 2 s BM, dsum after it

    const int n0 = blockIdx.x * BN, bidh_k = blockIdx.y, bidb = blockIdx.z;
    const SeqInfo seq(p, bidb);
    if (n0 >= seq.seqlen_k) return;  // packed batches: this sequence is shorter than the grid
    const int tid = threadIdx.x, lane = tid % 32, group = tid / 128;
    const int wrow = (tid % 128) / 32 * 16;  // first row of this warp within its 64
    const int g = lane / 4, t = lane % 4;

    const T* k = static_cast<const T*>(p.k) +
                 seq.k_offset(p.k_batch_stride, p.k_row_stride, p.k_head_stride, bidb, bidh_k);
    const T* v = static_cast<const T*>(p.v) +
                 seq.k_offset(p.v_batch_stride, p.v_row_stride, p.v_head_stride, bidb, bidh_k);
    sm90::load_panels<T, BN, D, K::THREADS>(sK, k + int64_t(n0) * p.k_row_stride, p.k_row_stride,
                                            seq.seqlen_k - n0, p.d, tid);
    sm90::load_panels<T, BN, D, K::THREADS>(sV, v + int64_t(n0) * p.v_row_stride, p.v_row_stride,
                                            seq.seqlen_k - n0, p.d, tid);

    const Mask mask(p, seq, bidb, bidh_k * p.h_h_k_ratio, K::MODS);
    const QueryTiles<BM, BN> tiles(mask, p, n0, seq.seqlen_q);  // (bidh, m0) follows it
    // Q, dO and the row statistics of tile (bidh, m0) into `stage`, one cp.async group with
    // whatever was requested before. Rows past the end get LSE -inf (P = 0) and dsum 0: their
    // Q and dO rows are zero, but under an ALiBi bias (a negative slope raises far scores)
    // their scores are not, and exp2 of one can overflow into inf x (dO = 0) = NaN in dV.
    // Their dQ is never stored.
    const auto load_tile_into = [&](int bidh, int m0, int stage) {
        const int64_t qo =
            seq.q_offset(p.q_batch_stride, p.q_row_stride, p.q_head_stride, bidb, bidh);
        const int64_t oo =
            seq.q_offset(p.o_batch_stride, p.o_row_stride, p.o_head_stride, bidb, bidh);
        const uint32_t sQ = sQ0 + 2 * stage * K::Q_BYTES;
        sm90::load_panels<T, BM, D, K::THREADS>(
            sQ, static_cast<const T*>(p.q) + qo + int64_t(m0) * p.q_row_stride, p.q_row_stride,
            seq.seqlen_q - m0, p.d, tid);
        sm90::load_panels<T, BM, D, K::THREADS>(
            sQ + K::Q_BYTES, static_cast<const T*>(bp.dout) + oo + int64_t(m0) * p.o_row_stride,
            p.o_row_stride, seq.seqlen_q - m0, p.d, tid);
        if (tid < BM) {
            const int row = m0 + tid;
            const int64_t off = seq.lse_offset(p, bidb, bidh) + min(row, seq.seqlen_q - 1);
            const bool valid = row < seq.seqlen_q;
            if (valid)
                cp_async_4(sStats + 2 * stage * BM + tid, p.lse + off, true);
            else
                sStats[2 * stage * BM + tid] = -INFINITY;
            cp_async_4(sStats + 2 * stage * BM + BM + tid, bp.dsum + off, valid);
        }
    };
    int bidh = bidh_k * p.h_h_k_ratio, m0 = tiles.m0_begin;
    if (tiles.count > 0) tiles.first(mask, bidh, m0);
    if (tiles.count > 0) load_tile_into(bidh, m0, 0);
    cp_async_commit();  // K, V and the first tile

    float dk[DT][4], dv[DT][4];
#pragma unroll
    for (int i = 0; i < DT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.f;
    const uint32_t sK_mine = sK + group * 64 * 128, sV_mine = sV + group * 64 * 128;
    // This warpgroup's dQ columns [group * DQ_N, +DQ_N): whole panels at D = 128, half a
    // panel (64 bytes into each swizzled row) at D = 64.
    const uint32_t sK_dq =
        sK + (DQ_N % 64 == 0 ? group * (DQ_N / 64) * BN * 128 : group * DQ_N * 2);

    for (int it = 0; it < tiles.count; ++it, tiles.next(mask, bidh, m0)) {
        const int stage = it % 2;
        const uint32_t sQ = sQ0 + 2 * stage * K::Q_BYTES, sdO = sQ + K::Q_BYTES;
        const float* sLse = sStats + 2 * stage * BM;
        const float* sDsum = sLse + BM;
        cp_async_wait<0>();
        sm90::fence_proxy_async();
        __syncthreads();  // tile it landed for everyone; everyone is done with tile it - 1
        if (it + 1 < tiles.count) {
            int next_bidh = bidh, next_m0 = m0;
            tiles.next(mask, next_bidh, next_m0);
            load_tile_into(next_bidh, next_m0, stage ^ 1);
        }
        cp_async_commit();

        // S^T = K Q^T (line 11) and dP^T = V dO^T (line 17), issued together.
        float st[1][NQ][4], dpt[1][NQ][4];
        sm90::fence_operand(st[0]);
        sm90::fence_operand(dpt[0]);
        sm90::fence();
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
            sm90::Wgmma<T, BM>::ss(st[0], sm90::kmajor_desc(sK_mine, BN, kk),
                                   sm90::kmajor_desc(sQ, BM, kk), kk > 0);
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk)
            sm90::Wgmma<T, BM>::ss(dpt[0], sm90::kmajor_desc(sV_mine, BN, kk),
                                   sm90::kmajor_desc(sdO, BM, kk), kk > 0);
        sm90::commit();
        sm90::wait<0>();
        sm90::fence_operand(st[0]);
        sm90::fence_operand(dpt[0]);

        const Mask head_mask = mask.with_head(bidh);
        head_mask.template apply<1, NQ, true>(
            st, n0 + group * 64 + wrow, m0, lane,
            head_mask.template block_needs_mask<BN>(m0, m0 + BM - 1, n0));
        // P^T (line 13) and dS^T = P^T o (dP^T - rowsum(dO O)) (line 19). A row that saw no
        // key has LSE -inf and P = 0: exp2(s - inf).
#pragma unroll
        for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = nt * 8 + 2 * t + (e % 2);
                st[0][nt][e] = exp2f(fmaf(st[0][nt][e], p.scale_log2, -lse_log2(sLse[col])));
                dpt[0][nt][e] = st[0][nt][e] * (dpt[0][nt][e] - sDsum[col]);
            }
        // dS's factor 1 - t^2 from the tanh, t recovered from P (32 bytes of spill here
        // against 96 with t kept beside P in the loop above).
        if (mask.softcap_pre != 0.f)
            head_mask.template times_cap_grad<1, NQ, true>(
                dpt, st, n0 + group * 64 + wrow, m0, lane, p.scale_log2,
                [&](int, int nt, int e) { return lse_log2(sLse[nt * 8 + 2 * t + (e % 2)]); });
        uint32_t a_p[1][NQ / 2][4], a_ds[1][NQ / 2][4];
        pack_a<T, 1, NQ>(st, a_p);
        pack_a<T, 1, NQ>(dpt, a_ds);

        // dV += P^T dO (line 16), dK += dS^T Q (line 21).
        sm90::fence_operand(dv);
        sm90::fence_operand(dk);
        sm90::fence();
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk)
            sm90::Wgmma<T, D>::rs(dv, a_p[0][kk], sm90::mnmajor_desc(sdO, BM, kk), 1);
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk)
            sm90::Wgmma<T, D>::rs(dk, a_ds[0][kk], sm90::mnmajor_desc(sQ, BM, kk), 1);
        sm90::commit();

        // dS^T into the key-major panel tile (row = key, 64 query columns) while those run.
        sm90::store_key_major<BN, NQ>(sdS, a_ds, group * 64, 0, tid % 128, lane);
        sm90::fence_proxy_async();
        __syncthreads();  // both warpgroups' dS^T are in shared memory

        // dQ[:, group half] = dS K (line 20), added to dq_accum.
        float dq[DQ_N / 8][4];
        sm90::fence_operand(dq);
        sm90::fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            sm90::Wgmma<T, DQ_N>::ss_mn(dq, sm90::mnmajor_desc(sdS, BN, kk),
                                       sm90::mnmajor_desc(sK_dq, BN, kk), kk > 0);
        sm90::commit();
        sm90::wait<0>();
        sm90::fence_operand(dq);
        sm90::fence_operand(dv);
        sm90::fence_operand(dk);
        float* dq_accum =
            bp.dq_accum +
            seq.q_offset(p.o_batch_stride, p.o_row_stride, p.o_head_stride, bidb, bidh);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = m0 + wrow + g + 8 * r;
            if (row >= seq.seqlen_q) continue;
#pragma unroll
            for (int i = 0; i < DQ_N / 8; ++i) {
                const int col = group * DQ_N + i * 8 + 2 * t;
                if (col < p.d)
                    red_add_v2(dq_accum + int64_t(row) * p.o_row_stride + col, dq[i][2 * r],
                               dq[i][2 * r + 1]);
            }
        }
    }
    cp_async_wait<0>();  // K and V were requested even if no query tile sees them

    // dK carries the softmax scale of S = scale Q K^T (applied once here, not per tile).
    const int64_t dk_offset =
        seq.k_offset(bp.dk_batch_stride, bp.dk_row_stride, bp.dk_head_stride, bidb, bidh_k);
    T* dk_out = static_cast<T*>(bp.dk) + dk_offset;
    T* dv_out = static_cast<T*>(bp.dv) + dk_offset;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = n0 + group * 64 + wrow + g + 8 * r;
        if (row >= seq.seqlen_k) continue;
#pragma unroll
        for (int i = 0; i < DT; ++i) {
            const int col = i * 8 + 2 * t;
            if (col >= p.d) continue;
            const int64_t off = int64_t(row) * bp.dk_row_stride + col;
            *reinterpret_cast<uint32_t*>(dk_out + off) =
                MmaOp<T>::pack(dk[i][2 * r] * p.grad_scale, dk[i][2 * r + 1] * p.grad_scale);
            *reinterpret_cast<uint32_t*>(dv_out + off) =
                MmaOp<T>::pack(dv[i][2 * r], dv[i][2 * r + 1]);
        }
    }
}

// The kernels of this file: one per row of cuda/catalogue.rs (generated by build.rs).
#include "instances/sm90_bwd.inc"
