// What happens to a score before the softmax besides the mask: the softcap (S = c tanh(S / c))
// and the ALiBi bias (S -= slope |i + offset - j|), and the softcap's factor in the backward.
// Mask's members (its fields: visibility.cuh).
#pragma once
#include <cmath>

#include "common/approx.cuh"
#include "common/mask/visibility.cuh"

// x (1 - t^2), the softcap's tanh derivative at a capped score t applied to x, with t^2
// clamped to 1: 0 rather than NaN at masked entries (t = -inf there, and x = 0), with no test
// of P and select; written x - x min(t^2, 1), one FFMA for the subtraction and the product.
__device__ __forceinline__ float cap_grad_times(float x, float t) {
    return fmaf(-x, fminf(t * t, 1.f), x);
}

// Head h's ALiBi slope in S's units.
__device__ __forceinline__ float Mask::slope_of(int h) const { return slopes[h] * alibi_scale; }

// c tanh(x / c) with the scale folded in (S keeps the tanh; `scale` is c): tanh.approx.f32
// (sm_75+, ~2^-11 relative error, below the bf16 rounding of the scores it feeds; the
// f16x2 form, half the MUFU issues, was no faster: 1.46-1.75x plain against 1.44-1.61x,
// H200, its conversions cost what it saved).
// PRESCALED: S already carries the scale (Mask::apply).
template <int MT, int NT, bool PRESCALED>
__device__ __forceinline__ void Mask::cap(float (&s)[MT][NT][4]) const {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                s[mt][nt][e] =
                    tanh_approx(PRESCALED ? s[mt][nt][e] : s[mt][nt][e] * softcap_pre);
}

// S -= slope |i + offset - j| (in S's units). GQA-packed decode row r is head
// head + r % rows_per_query.
template <int MT, int NT, bool TRANSPOSED>
__device__ __forceinline__ void Mask::bias(float (&s)[MT][NT][4], int row0, int col0, int lane,
                                           int rows_per_query) const {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = row0 + mt * 16 + g + r * 8;
            float m = slope;
            // diag: the key on this row's diagonal (rows are queries), or minus the query
            // whose diagonal this key is (rows are keys); the distance is |diag - col|.
            int diag;
            if constexpr (TRANSPOSED) {
                diag = row - offset;
            } else {
                diag = row / rows_per_query + offset;
                if (rows_per_query > 1) m = slope_of(head + row % rows_per_query);
            }
            // The distance to column col0 + 2 t + k is |near - k|, k a constant of the
            // unrolled loop: per score a float subtract, its absolute value and an FFMA,
            // where an integer subtract, abs and I2FP conversion preceded the FFMA (d 64
            // ALiBi forward 1.11x faster). Exact while distances stay below 2^24.
            const float near = float(diag - col0 - 2 * t);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 2 * r; e < 2 * r + 2; ++e)
                    s[mt][nt][e] = fmaf(-m, fabsf(near - float(nt * 8 + e % 2)), s[mt][nt][e]);
        }
}

// The capped score tanh(.) behind S = t - slope |diag - col| at (row, col): the bias
// added back (d(c tanh(x / c))/dx needs t, and S is all the backward keeps).
template <bool TRANSPOSED>
__device__ __forceinline__ float Mask::capped(float s, int row, int col) const {
    if (slopes == nullptr) return s;
    const int diag = TRANSPOSED ? row - offset : row + offset;
    return s + slope * float(abs(diag - col));
}

// x *= 1 - t^2 under a softcap (the tanh's derivative; the scale is applied with dQ/dK),
// t the capped score behind the probability pr = exp2(scale_log2 S - lse2), recovered
// from it with one lg2 instead of keeping S in registers beside P. x = 0 where pr is
// (masked entries, rows that saw no key: t = -inf or NaN, its factor 0). lse2(mt, nt, e)
// is the entry's row LSE.
template <int MT, int NT, bool TRANSPOSED, class Lse2>
__device__ __forceinline__ void Mask::times_cap_grad(float (&x)[MT][NT][4],
                                                     const float (&pr)[MT][NT][4], int row0,
                                                     int col0, int lane, float scale_log2,
                                                     const Lse2& lse2) const {
    const int g = lane / 4, t = lane % 4;
    const float inv = 1.f / scale_log2;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = row0 + mt * 16 + g + (e / 2) * 8;
                const int col = col0 + nt * 8 + 2 * t + (e % 2);
                const float c = capped<TRANSPOSED>(
                    (__log2f(pr[mt][nt][e]) + lse2(mt, nt, e)) * inv, row, col);
                x[mt][nt][e] = cap_grad_times(x[mt][nt][e], c);
            }
}
