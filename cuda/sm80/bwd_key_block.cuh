// The global-memory side of a dK/dV kernel's key block (bwd_dkdv.cuh, bwd_grid.cuh): its K
// and V tiles in, the row statistics of the query tiles it streams in, dK and dV out.
#pragma once
#include "common/bwd_dq_accum.cuh"
#include "common/copy.cuh"
#include "common/mma.cuh"
#include "common/params.cuh"
#include "common/seq_info.cuh"

// Keys [n0, n0 + BN) of K/V head bidh_k, rows past the sequence zero-filled.
template <typename T, int BN, int D, int THREADS, class L = PaddedRows<D>>
__device__ __forceinline__ void load_key_block(T* sK, T* sV, const AttnParams& p,
                                               const SeqInfo& seq, int bidb, int bidh_k, int n0,
                                               int tid) {
    const T* k = static_cast<const T*>(p.k) +
                 seq.k_offset(p.k_batch_stride, p.k_row_stride, p.k_head_stride, bidb, bidh_k);
    const T* v = static_cast<const T*>(p.v) +
                 seq.k_offset(p.v_batch_stride, p.v_row_stride, p.v_head_stride, bidb, bidh_k);
    load_tile<T, BN, D, THREADS, L>(sK, k + int64_t(n0) * p.k_row_stride, p.k_row_stride,
                                    seq.seqlen_k - n0, p.d, tid);
    load_tile<T, BN, D, THREADS, L>(sV, v + int64_t(n0) * p.v_row_stride, p.v_row_stride,
                                    seq.seqlen_k - n0, p.d, tid);
}

// Query rows [m0, m0 + BM) of head bidh from q (`which` = Q) or dO (`which` = DO), rows
// past the sequence zero-filled: the tiles a key block streams.
enum class QueryRows { Q, DO };
template <typename T, int BM, int D, int THREADS, class L = PaddedRows<D>>
__device__ __forceinline__ void load_query_rows(T* dst, QueryRows which, const BwdParams& bp,
                                                const SeqInfo& seq, int bidb, int bidh, int m0,
                                                int tid) {
    const AttnParams& p = bp.a;
    const bool q = which == QueryRows::Q;
    const int64_t row_stride = q ? p.q_row_stride : p.o_row_stride;
    const T* src = static_cast<const T*>(q ? p.q : bp.dout) +
                   (q ? seq.q_offset(p.q_batch_stride, p.q_row_stride, p.q_head_stride, bidb, bidh)
                      : seq.q_offset(p.o_batch_stride, p.o_row_stride, p.o_head_stride, bidb,
                                     bidh));
    load_tile<T, BM, D, THREADS, L>(dst, src + int64_t(m0) * row_stride, row_stride,
                                    seq.seqlen_q - m0, p.d, tid);
}

// The LSE (as stored) and rowsum(dO O) of rows [m0, m0 + BM) into the stage's slots of the
// per-stage arrays, one thread per row, by cp.async with the tile's group (no registers held
// across an iteration; the LSE is converted where it is read). Rows past the end get LSE
// -inf, so P = 0 there: their Q rows are zero, but a score is not, under an ALiBi bias (a
// negative slope raises far scores), and exp2 of it can overflow f16 into inf x (dO = 0) =
// NaN in dV. Their dsum is 0.
template <int BM>
__device__ __forceinline__ void load_row_stats(float* sLse_all, float* sDsum_all, int stage,
                                               const BwdParams& bp, const SeqInfo& seq, int bidb,
                                               int bidh, int m0, int tid) {
    if (tid >= BM) return;
    const AttnParams& p = bp.a;
    const int row = m0 + tid;
    const int64_t off = seq.lse_offset(p, bidb, bidh) + min(row, seq.seqlen_q - 1);
    const bool valid = row < seq.seqlen_q;
    if (valid)
        cp_async_4(sLse_all + stage * BM + tid, p.lse + off, true);
    else
        sLse_all[stage * BM + tid] = -INFINITY;
    cp_async_4(sDsum_all + stage * BM + tid, bp.dsum + off, valid);
}

// A warp's dK and dV accumulators (MT m16 key tiles from key row0, DOT n8 column tiles from
// col0, mma C layout) to dk and dv, rows past the sequence and columns past d left out. dK
// carries the softmax scale of S = scale Q K^T (applied once here, not per tile).
template <typename T, int MT, int DOT>
__device__ __forceinline__ void store_dk_dv(const float (&dk)[MT][DOT][4],
                                            const float (&dv)[MT][DOT][4], const BwdParams& bp,
                                            const SeqInfo& seq, int bidb, int bidh_k, int row0,
                                            int col0, int lane) {
    const AttnParams& p = bp.a;
    const int64_t dk_offset =
        seq.k_offset(bp.dk_batch_stride, bp.dk_row_stride, bp.dk_head_stride, bidb, bidh_k);
    T* dk_out = static_cast<T*>(bp.dk) + dk_offset;
    T* dv_out = static_cast<T*>(bp.dv) + dk_offset;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = row0 + mt * 16 + g + 8 * r;
            if (row >= seq.seqlen_k) continue;
#pragma unroll
            for (int dt = 0; dt < DOT; ++dt) {
                const int col = col0 + dt * 8 + 2 * t;
                if (col >= p.d) continue;
                const int64_t off = int64_t(row) * bp.dk_row_stride + col;
                *reinterpret_cast<uint32_t*>(dk_out + off) = MmaOp<T>::pack(
                    dk[mt][dt][2 * r] * p.grad_scale, dk[mt][dt][2 * r + 1] * p.grad_scale);
                *reinterpret_cast<uint32_t*>(dv_out + off) =
                    MmaOp<T>::pack(dv[mt][dt][2 * r], dv[mt][dt][2 * r + 1]);
            }
        }
}
