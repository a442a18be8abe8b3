// The online softmax of the FP8 forward (sm90/fwd_ws.cu with FP8 traits). P goes to e4m3
// before P V, so where a row's reference maximum sits matters for accuracy:
// - the maximum moves whenever a tile's is higher (no slack, unlike OnlineSoftmax's
//   RESCALE_SLACK): a tile's largest probability is then exactly a power of two and rounds
//   without error. With the slack, a row whose maximum arrived in a later tile rounded its
//   dominant key's probability (2^x for a fraction x) by up to 6%, and its output erred 1.3-5.6x
//   more than P's rounding against the true maximum (H200, 300-key rows);
// - P is computed as exp2(scale s - scale m + 8), up to 256 (FlashAttention-3's offset), so
//   that probabilities down to 2^-17 of the maximum stay e4m3 numbers rather than flushing
//   below 2^-9. The row sum carries the same 2^8, which 1 / l cancels; the LSE subtracts it.
#pragma once

#include "common/softmax.cuh"

constexpr float FP8_P_SHIFT = 8.f;  // log2 of P at a row's running maximum

// OnlineSoftmax::exp_and_factors for FP8: S becomes P (in place), the running maximum and sum
// move on, and alpha holds the factors O must be multiplied by once the P V in flight is done
// (1 for rows whose maximum stayed). Returns whether any row of the warp moved.
// The running maximum is kept in log2 units of the scaled scores (S times scale_log2): the
// scale may change from one key tile to the next (k's descale per block of keys), and a
// positive factor commutes with the maximum, so a tile's maximum is its raw one times its
// scale.
template <int NT>
__device__ __forceinline__ bool exp_and_factors_fp8(OnlineSoftmax<1>& st, float (&s)[1][NT][4],
                                                    float (&alpha)[1][2], float scale_log2) {
    bool any = false;
    float neg_m[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float m_old = st.row_max[0][r];
        float raw = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            raw = fmaxf(raw, fmaxf(s[0][nt][2 * r], s[0][nt][2 * r + 1]));
        raw = fmaxf(raw, __shfl_xor_sync(0xffffffff, raw, 1));
        raw = fmaxf(raw, __shfl_xor_sync(0xffffffff, raw, 2));
        const float m = fmaxf(m_old, raw * scale_log2);
        // -inf to a finite maximum grows (alpha 0 on a zero sum); -inf to -inf does not.
        const bool grows = m > m_old;
        alpha[0][r] = grows ? exp2f(m_old - m) : 1.f;
        st.row_max[0][r] = m;
        st.row_sum[0][r] *= alpha[0][r];
        // A row with no visible key yet keeps -inf; subtracting 0 keeps its P exp2(-inf) = 0.
        neg_m[r] = FP8_P_SHIFT - (m == -INFINITY ? 0.f : m);
        any |= grows;
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float sum = st.row_sum[0][r];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; ++e) {
                s[0][nt][e] = exp2f(fmaf(s[0][nt][e], scale_log2, neg_m[r]));
                sum += s[0][nt][e];
            }
        st.row_sum[0][r] = sum;
    }
    return __any_sync(0xffffffff, any);
}
