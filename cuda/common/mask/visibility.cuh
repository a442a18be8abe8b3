// Which (query, key) pairs are visible: the key-length bound, the bottom-right aligned causal
// mask and, in general, a window around the diagonal. One place for fwd, bwd and decode.
//
// Mask, built per (sequence, query head), is what the kernels hold. Its `apply` also runs the
// score modifiers (softcap, ALiBi) and the block mask in the same pass over S, so the struct
// carries their fields and declares their members; they are defined by concept in
// score_mods.cuh and block_walk.cuh, included at the end of this file.
#pragma once
#include <climits>
#include <cmath>
#include <cstdint>

#include "common/mask/levels.cuh"
#include "common/params.cuh"
#include "common/seq_info.cuh"

// What a masked entry's t becomes where S^T comes from K pre-multiplied by the softcap's scale
// (Mask::apply's PRESCALED, the backward's `_cap` kernels): finite, so that P (1 - t^2) needs
// no clamp (0 x 1e36 = 0, where 0 x inf was NaN), and far enough below -1 that P = 0: the
// exponent (t c log2(e) - LSE, with LSE >= -c log2(e) when every score is at least -c) is
// below -126 for any cap above 1e-16.
constexpr float CAP_MASKED_T = -1e18f;

struct Mask {
    int seqlen_k;
    int offset;  // seqlen_k - seqlen_q: query i's diagonal is key i + offset
    int left, right;  // window half-widths, -1 = unbounded
    float softcap_pre;    // 0, or S = tanh(S * softcap_pre) first
    const float* slopes;  // ALiBi slopes of this sequence's heads, or null
    float alibi_scale;
    int head;     // the query head (the first of GQA-packed decode rows)
    float slope;  // its slope times alibi_scale
    bool sparse;  // a block mask (p.block_mask) applies
    // The block mask and its geometry are read from the parameters through `prm` when used:
    // copied into fields, they cost the mma.sync kernels (run-time `sparse`) registers even
    // without a block mask (sm_80 forward d = 128: 0 -> 124 bytes of spill).
    const AttnParams* prm;

    Mask() = default;
    // Sequence b, query head h. Kernels compiled without a flag of `mods` (levels.cuh, a
    // compile-time constant: the host sends them no other problems) drop its code entirely.
    __device__ __forceinline__ Mask(const AttnParams& p, const SeqInfo& seq, int b, int h,
                                    int mods = MODS_ANY)
        : seqlen_k(seq.seqlen_k), offset(seq.seqlen_k - seq.seqlen_q),
          // FlashAttention 2's rule, per sequence: a side at or past the keys is unbounded.
          left(p.window_left < seq.seqlen_k ? p.window_left : -1),
          right(p.window_right < seq.seqlen_k ? p.window_right : -1),
          softcap_pre(mods & MODS_SCORES ? p.softcap_pre : 0.f),
          slopes(!(mods & MODS_SCORES) || p.alibi_slopes == nullptr
                     ? nullptr
                     : p.alibi_slopes + int64_t(b) * p.alibi_batch_stride),
          alibi_scale(p.alibi_scale), head(h), slope(slopes == nullptr ? 0.f : slope_of(h)),
          sparse((mods & MODS_BLOCKS) &&
                 (!(mods & MODS_BLOCKS_RUNTIME) || p.block_mask != nullptr)),
          prm(&p) {}

    // The same mask for query head h: the dK/dV kernels walk the heads of a GQA group.
    __device__ __forceinline__ Mask with_head(int h) const {
        Mask m = *this;
        m.head = h;
        if (slopes != nullptr) m.slope = slope_of(h);
        return m;
    }

    // Key blocks of width BN that queries [q_first, q_last] can see: [*begin, *end), maybe
    // empty.
    template <int BN>
    __device__ __forceinline__ void key_blocks(int q_first, int q_last, int* begin,
                                               int* end) const {
        int stop = seqlen_k;
        if (right >= 0) stop = min(stop, q_last + offset + right + 1);
        *end = stop <= 0 ? 0 : (stop + BN - 1) / BN;
        *begin = left >= 0 ? max(0, (q_first + offset - left) / BN) : 0;
    }

    // Query blocks of height BM that can see keys [n0, n0 + BN): [*begin, *end), maybe empty.
    template <int BM, int BN>
    __device__ __forceinline__ void query_blocks(int n0, int seqlen_q, int* begin, int* end) const {
        *end = (seqlen_q + BM - 1) / BM;
        // Row i sees key j only if i >= j - offset - right, and only if i <= j - offset + left.
        *begin = right >= 0 ? max(0, n0 - offset - right) / BM : 0;
        if (left >= 0) {
            const int last = n0 + BN - 1 - offset + left;
            *end = last < 0 ? 0 : min(*end, last / BM + 1);
        }
    }

    // Whether any pair of queries [q_first, q_last] x keys [n0, n0 + BN) is masked; the
    // others run the loop body compiled without mask code.
    // `state`: the tile's sparse_state if the caller has it (from next_key_block), else -1.
    template <int BN>
    __device__ __forceinline__ bool block_needs_mask(int q_first, int q_last, int n0,
                                                     int state = -1) const {
        return n0 + BN > seqlen_k || (right >= 0 && n0 + BN - 1 > q_first + offset + right) ||
               (left >= 0 && n0 < q_last + offset - left) ||
               (sparse &&
                (state >= 0 ? state : sparse_state(q_first, q_last, n0, n0 + BN)) == 2);
    }

    // Applies the softcap and the ALiBi bias (if any) to a warp's S accumulators, then, if
    // the block has a masked entry (`masked`: block_needs_mask), sets the masked scores to
    // -inf; the other blocks skip the mask's compares. S holds MT m16 tiles x NT n8
    // tiles in the mma C layout; the warp's first row is row0, the tile's first column col0.
    // Rows are queries and columns keys, or, with TRANSPOSED (S^T in the dK/dV kernel), rows
    // are keys and columns queries. Query rows may be packed: tile row r is query
    // r / rows_per_query (GQA-packed decode tiles hold several heads of one token).
    // Each thread's rows get their visible column range [lo, hi) once; an entry then costs two
    // compares (the per-entry `visible` was 6-8 integer instructions, on every masked block).
    // PRESCALED (a softcap without ALiBi, S computed from keys already multiplied by
    // softcap_pre): the tanh takes S as it is, and masked entries become CAP_MASKED_T.
    template <int MT, int NT, bool TRANSPOSED = false, bool PRESCALED = false>
    // `bits`: the block mask's part precomputed by sparse_bits, or null to compute it here.
    __device__ __forceinline__ void apply(float (&s)[MT][NT][4], int row0, int col0, int lane,
                                          bool masked, int rows_per_query = 1,
                                          const uint64_t (*bits)[2] = nullptr) const {
        const int g = lane / 4, t = lane % 4;
        constexpr float MASKED = PRESCALED ? CAP_MASKED_T : -INFINITY;
        if (PRESCALED || softcap_pre != 0.f) cap<MT, NT, PRESCALED>(s);
        if (slopes != nullptr) bias<MT, NT, TRANSPOSED>(s, row0, col0, lane, rows_per_query);
        if (!masked) return;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = row0 + mt * 16 + g + r * 8;
                int lo, hi;
                if constexpr (TRANSPOSED) {
                    // Key `row` is seen by queries i with row - offset - right <= i and
                    // i <= row - offset + left; by none past the key length.
                    lo = right >= 0 ? row - offset - right : INT_MIN;
                    hi = left >= 0 ? row - offset + left + 1 : INT_MAX;
                    if (row >= seqlen_k) hi = INT_MIN;
                } else {
                    const int q = row / rows_per_query;
                    lo = left >= 0 ? q + offset - left : INT_MIN;
                    hi = row_end(q);
                }
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 2 * r; e < 2 * r + 2; ++e) {
                        const int col = col0 + nt * 8 + 2 * t + (e % 2);
                        if (col < lo || col >= hi) s[mt][nt][e] = MASKED;
                    }
                if (sparse) {
                    const uint64_t seen =
                        bits != nullptr
                            ? bits[mt][r]
                            : sparse_row_lean<NT, TRANSPOSED>(row / rows_per_query, col0, t);
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                        for (int c = 0; c < 2; ++c)
                            if (!((seen >> (2 * nt + c)) & 1)) s[mt][nt][2 * r + c] = MASKED;
                }
            }
    }

    // One past the last key query q sees: the key length, or the window's right side.
    __device__ __forceinline__ int row_end(int q) const {
        return right >= 0 ? min(seqlen_k, q + offset + right + 1) : seqlen_k;
    }

    // `apply` for kernels whose host sends no left side and no score modifier or block mask
    // (the FP8 forward: causal or not, and the key length): per row its first hidden column,
    // the entries compared with it as constants of the tile. `apply`'s column per entry and
    // two bounds per row held the FP8 forward's consumers at 212 registers without spilling,
    // this at 184 (ptxas -v, d = 128, 128-key tiles), which leaves room for 192-key tiles.
    template <int NT>
    __device__ __forceinline__ void apply_right(float (&s)[NT][4], int row0, int col0,
                                                int lane) const {
        const int g = lane / 4, t = lane % 4;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int q = row0 + g + 8 * r;
            const int first_hidden = row_end(q) - col0 - 2 * t;  // in this thread's columns
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int c = 0; c < 2; ++c)
                    if (nt * 8 + c >= first_hidden) s[nt][2 * r + c] = -INFINITY;
        }
    }

    // The score modifiers (score_mods.cuh).
    __device__ __forceinline__ float slope_of(int h) const;
    template <int MT, int NT, bool PRESCALED = false>
    __device__ __forceinline__ void cap(float (&s)[MT][NT][4]) const;
    template <int MT, int NT, bool TRANSPOSED>
    __device__ __forceinline__ void bias(float (&s)[MT][NT][4], int row0, int col0, int lane,
                                         int rows_per_query) const;
    template <bool TRANSPOSED>
    __device__ __forceinline__ float capped(float s, int row, int col) const;
    template <int MT, int NT, bool TRANSPOSED, class Lse2>
    __device__ __forceinline__ void times_cap_grad(float (&x)[MT][NT][4],
                                                   const float (&pr)[MT][NT][4], int row0,
                                                   int col0, int lane, float scale_log2,
                                                   const Lse2& lse2) const;

    // The block mask (block_walk.cuh).
    __device__ __forceinline__ int sparse_state(int q_first, int q_last, int n0, int n1) const;
    __device__ __forceinline__ int block_state(int r, int c) const;
    template <int BN>
    __device__ __forceinline__ int next_key_block(int q_first, int q_last, int nb, int nb_begin,
                                                  int* state = nullptr) const;
    template <int BN>
    __device__ __forceinline__ int last_present_tile(int q_first, int q_last, int nb) const;
    template <int BM>
    __device__ __forceinline__ int next_present_tile(int h, int n0, int n1, int m0,
                                                     int m_end) const;
    __device__ __forceinline__ bool dense_visible(int q, int k) const;
    template <int MT, int NT, bool TRANSPOSED>
    __device__ __forceinline__ void sparse_bits(uint64_t (&bits)[MT][2], int row0, int col0,
                                                int lane) const;
    template <int NT, bool TRANSPOSED>
    __device__ __forceinline__ uint64_t sparse_row(int row, int col0, int t) const;
    template <int NT, bool TRANSPOSED>
    __device__ __forceinline__ uint64_t sparse_row_lean(int row, int col0, int t) const;
    template <int NT> __device__ __forceinline__ static uint64_t column_bits(int x);
};

#include "common/mask/block_walk.cuh"
#include "common/mask/score_mods.cuh"
