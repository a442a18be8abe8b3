// Online softmax over a warp's rows (FlashAttention-2 Algorithm 1, lines 8-10 and 12).
// Each thread holds two rows (g and g+8) of each m16 tile; a row's 8 values per n8 tile are
// spread over the 4 threads of a quad, so row reductions need two shuffles (xor 1, 2).
#pragma once
#include <cmath>

#include "common/approx.cuh"

constexpr float LOG2E = 1.4426950408889634f;
// How far (log2 units) a row's max may rise above the one its P, l and O are kept relative
// to before they are rescaled (OnlineSoftmax::exp_and_factors).
constexpr float RESCALE_SLACK = 8.f;

// A row's LSE as the backward reads it: in log2 units, so P = exp2(scale_log2 s - lse2). A row
// that saw no key has LSE -inf; +inf makes its P = exp2(s - inf) = 0 instead of NaN.
__device__ __forceinline__ float lse_log2(float lse) {
    return lse == -INFINITY ? INFINITY : lse * LOG2E;
}

template <int MT> struct OnlineSoftmax {
    float row_max[MT][2];  // running max of the raw scores q.k (not yet scaled)
    float row_sum[MT][2];  // this thread's part of the running sum; reduced once at the end

    __device__ __forceinline__ OnlineSoftmax() {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                row_max[mt][r] = -INFINITY;
                row_sum[mt][r] = 0.f;
            }
    }

    // m_new = max(m, rowmax(S)); O *= exp(m - m_new); P = exp(S - m_new); l = l e^(m - m_new) + rowsum(P).
    // S becomes P in place. exp(scale x) is computed as exp2(scale_log2 x - scale_log2 m): one FFMA.
    // The running max need not be the true max, only one that P, l and O are all relative to
    // (the LSE and the normalisation by l are exact for any m). So a row keeps its max until a
    // tile's beats it by more than RESCALE_SLACK (log2 units), as FlashAttention-4 does: P then
    // stays below 2^RESCALE_SLACK = 256 (finite in f16 too), and while no row of the warp moves,
    // O goes untouched (MT x DT x 4 multiplies per thread skipped: a tenth of the d = 128 loop's
    // instructions, half of d = 256's). Past the first key tile a row seldom gains that much,
    // so almost every tile skips the rescale.
    template <int NT, int DT>
    __device__ __forceinline__ void update(float (&s)[MT][NT][4], float (&o)[MT][DT][4],
                                           float scale_log2) {
        float alpha[MT][2];
        if (exp_and_factors(s, alpha, scale_log2)) rescale(o, alpha);
    }

    // update() without touching O, for kernels whose O is still being accumulated by an
    // asynchronous matmul of the previous tile: S becomes P, the running max and sum move on,
    // and alpha holds the factors O must be multiplied by once that matmul is done (1 for a
    // row that kept its max). Returns whether O needs them (the same for every lane).
    // FIXED (a compile-time option) with fixed_log2 != 0: a row max (log2 units) known to bound
    // every score well enough (a softcap's, src/cuda/abi.rs: softcap_max_log2) is taken
    // instead: no max to find, O never rescaled.
    // INTERLEAVE (compile-time) with `zero` a run-time 0 (one the compiler cannot fold): every
    // second n8 tile's exponentials wait for the row sum of three tiles before (their max
    // term plus that sum times zero). In some kernels ptxas otherwise issues a warp's
    // exponentials back to back (the two-warpgroup d = 64 forward: 60 MUFU.EX2 in a row, 8
    // cycles each on the quarter's MUFU pipe, the warp issuing nothing else) and the sums'
    // FADDs after them; tied, the adds issue between them. One FFMA per two n8 tiles.
    // CAP: S holds raw scores, capped here (tanh(S cap_pre), Mask::cap's) just before their
    // exponentials, the running max (without FIXED's) taken from the raw scores' and capped
    // once per row; with INTERLEAVE the tie goes into the tanh's argument, so that tanh and
    // exponential operations alternate (sm90/fwd_ws.cu: cap_in_softmax).
    template <bool FIXED = false, bool INTERLEAVE = false, bool CAP = false, int NT>
    __device__ __forceinline__ bool exp_and_factors(float (&s)[MT][NT][4], float (&alpha)[MT][2],
                                                    float scale_log2, float fixed_log2 = 0.f,
                                                    float zero = 0.f, float cap_pre = 0.f) {
        float m_scaled[MT][2];
        bool any = false;
        if (FIXED && fixed_log2 != 0.f) {
            const float m = fixed_log2 / scale_log2;  // raw score units, for the LSE
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    row_max[mt][r] = m;
                    m_scaled[mt][r] = fixed_log2;
                    alpha[mt][r] = 1.f;
                }
        } else {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    // The new max; under CAP the tile's raw one, capped here: the capped
                    // scores' max is the cap of the raw scores' (tanh rises), so each score's
                    // tanh can wait for the loop below.
                    float x = CAP ? -INFINITY : row_max[mt][r];
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt)
                        x = fmaxf(x, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
                    x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
                    x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
                    const float m = CAP ? fmaxf(row_max[mt][r], tanh_approx(x * cap_pre)) : x;
                    // From -inf (no key seen yet) any finite max grows; -inf to -inf: NaN, no.
                    const float m_old = row_max[mt][r];
                    const bool grows = (m - m_old) * scale_log2 > RESCALE_SLACK;
                    const float m_new = grows ? m : m_old;
                    // A row with no visible key yet keeps m = -inf; subtracting 0 keeps
                    // exp2(-inf) = 0 instead of exp2(-inf + inf) = NaN.
                    m_scaled[mt][r] = m_new == -INFINITY ? 0.f : m_new * scale_log2;
                    alpha[mt][r] = grows ? exp2f(m_old * scale_log2 - m_scaled[mt][r]) : 1.f;
                    row_max[mt][r] = m_new;
                    row_sum[mt][r] *= alpha[mt][r];
                    any |= grows;
                }
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float sum = row_sum[mt][r], neg_m = -m_scaled[mt][r], tie = 0.f;
                float part[NT];  // the sum through each n8 tile (INTERLEAVE)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    if (INTERLEAVE && nt >= 4 && nt % 2 == 0) {
                        if (CAP)
                            tie = part[nt - 3] * zero;
                        else
                            neg_m = fmaf(part[nt - 3], zero, neg_m);
                    }
#pragma unroll
                    for (int e = 2 * r; e < 2 * r + 2; ++e) {
                        float x = s[mt][nt][e];
                        if constexpr (CAP) x = tanh_approx(fmaf(x, cap_pre, tie));
                        s[mt][nt][e] = exp2f(fmaf(x, scale_log2, neg_m));
                        sum += s[mt][nt][e];
                    }
                    part[nt] = sum;
                }
                row_sum[mt][r] = sum;
            }
        return __any_sync(0xffffffff, any);
    }

    template <int DT>
    __device__ __forceinline__ void rescale(float (&o)[MT][DT][4], const float (&alpha)[MT][2]) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int dt = 0; dt < DT; ++dt)
#pragma unroll
                for (int e = 0; e < 4; ++e) o[mt][dt][e] *= alpha[mt][e / 2];
    }

    // Reduces the row sums over the quad; returns 1/l (0 for rows that saw no key) and the
    // natural-log LSE (-inf for those rows) of row (mt, r). A NaN score (fmaxf skipped it in
    // the max, but not in the sum) makes l NaN, and the row's output and LSE NaN: NaN in,
    // NaN out, distinct from a row that saw no key.
    __device__ __forceinline__ void finalize(int mt, int r, float scale, float* inv_sum,
                                             float* lse) const {
        float l = row_sum[mt][r];
        l += __shfl_xor_sync(0xffffffff, l, 1);
        l += __shfl_xor_sync(0xffffffff, l, 2);
        const bool empty = l == 0.f;
        *inv_sum = empty ? 0.f : 1.f / l;
        *lse = empty ? -INFINITY : row_max[mt][r] * scale + logf(l);
    }
};
