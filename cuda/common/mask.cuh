// Which (query, key) pairs are visible: the key-length bound, the bottom-right aligned causal
// mask and, in general, a window around the diagonal, and a block mask; and what else happens to a score before
// the softmax (softcap, ALiBi bias). One place for fwd, bwd and decode.
#pragma once
#include <climits>
#include <cmath>

#include "common/approx.cuh"
#include "common/params.cuh"
#include "common/seq_info.cuh"

// What a kernel is compiled with (its MODS), flags: MODS_SCORES the softcap and ALiBi (entry
// points `_mods`), MODS_BLOCKS a block mask, always there; MODS_SPARSE both (`_sparse`: a block
// mask may come with a cap or slopes); MODS_ANY everything, the block mask tested at run time
// (the mma.sync kernels but the `_sparse` dK/dV ones). The wgmma kernels have a variant per
// level, as each level's code cost the plain kernels registers (spills). MODS_CAP, the softcap
// without ALiBi (the backward's `_cap` kernels), so that no bias code takes registers: their
// scores come prescaled (Mask::apply's PRESCALED), so the mask keeps no softcap_pre.
constexpr int MODS_NONE = 0, MODS_SCORES = 1, MODS_BLOCKS = 2, MODS_SPARSE = 3, MODS_ANY = 7;
constexpr int MODS_CAP = 8;

// x (1 - t^2), the softcap's tanh derivative at a capped score t applied to x, with t^2
// clamped to 1: 0 rather than NaN at masked entries (t = -inf there, and x = 0), with no test
// of P and select; written x - x min(t^2, 1), one FFMA for the subtraction and the product.
__device__ __forceinline__ float cap_grad_times(float x, float t) {
    return fmaf(-x, fminf(t * t, 1.f), x);
}

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
    // Sequence b, query head h. Kernels compiled for a lower `mods` level (a compile-time
    // constant: the host sends them no other problems) drop the code above it entirely.
    __device__ __forceinline__ Mask(const AttnParams& p, const SeqInfo& seq, int b, int h,
                                    int mods = MODS_ANY)
        : seqlen_k(seq.seqlen_k), offset(seq.seqlen_k - seq.seqlen_q),
          // FlashAttention 2's rule, per sequence: a side at or past the keys is unbounded.
          left(p.window_left < seq.seqlen_k ? p.window_left : -1),
          right(p.window_right < seq.seqlen_k ? p.window_right : -1), softcap_pre(mods & MODS_SCORES ? p.softcap_pre : 0.f),
          slopes(!(mods & MODS_SCORES) || p.alibi_slopes == nullptr
                     ? nullptr
                     : p.alibi_slopes + int64_t(b) * p.alibi_batch_stride),
          alibi_scale(p.alibi_scale), head(h), slope(slopes == nullptr ? 0.f : slope_of(h)),
          sparse((mods & MODS_BLOCKS) && (mods != MODS_ANY || p.block_mask != nullptr)),
          prm(&p) {}

    // The same mask for query head h: the dK/dV kernels walk the heads of a GQA group.
    __device__ __forceinline__ Mask with_head(int h) const {
        Mask m = *this;
        m.head = h;
        if (slopes != nullptr) m.slope = slope_of(h);
        return m;
    }

    // The block mask's states under queries [q_first, q_last] x keys [n0, n1) of this head
    // (rows and keys past the sequence do not count): 0 no block present (the tile is
    // skipped), 1 every block present and entirely visible, 2 anything else (the tile is
    // masked entry by entry). A tile spans few blocks: block sizes are multiples of 64.
    __device__ __forceinline__ int sparse_state(int q_first, int q_last, int n0, int n1) const {
        return sparse_state_of(head, q_first, q_last, n0, n1);
    }
    // The same for query head h.
    __device__ __forceinline__ int sparse_state_of(int h, int q_first, int q_last, int n0,
                                                   int n1) const {
        q_last = min(q_last, seqlen_k - offset - 1);
        n1 = min(n1, seqlen_k);
        if (q_last < q_first || n1 <= n0) return 0;
        const AttnParams& p = *prm;
        const unsigned char* head_blocks = p.block_mask + h * p.block_head_stride;
        int any = 0, all = 1;
        const int c0 = p.block_k_div(n0), c1 = p.block_k_div(n1 - 1);
        for (int r = p.block_q_div(q_first); r <= p.block_q_div(q_last); ++r)
            for (int c = c0; c <= c1; ++c) {
                const int v = head_blocks[r * p.block_cols + c];
                any |= v;
                all &= v == 1;
            }
        return any == 0 ? 0 : all ? 1 : 2;
    }

    // The state of block (r, c) of this head.
    __device__ __forceinline__ int block_state(int r, int c) const {
        return prm->block_mask[head * prm->block_head_stride + r * prm->block_cols + c];
    }

    // The key block below nb (of width BN, down to nb_begin) that queries [q_first, q_last]
    // need: nb - 1, or under a block mask the first one with a block present; -1 if none.
    // The forward loops and the warp-specialized producer (which hands the tiles to its
    // consumers) walk the blocks through this. `state`, if given, gets the
    // block's sparse_state (1 without a block mask), for block_needs_mask.
    template <int BN>
    __device__ __forceinline__ int next_key_block(int q_first, int q_last, int nb, int nb_begin,
                                                  int* state = nullptr) const {
        --nb;
        if (sparse) nb = last_present_tile<BN>(q_first, q_last, nb);
        if (nb < nb_begin) return -1;
        if (state != nullptr)
            *state = sparse ? sparse_state(q_first, q_last, nb * BN, nb * BN + BN) : 1;
        return nb;
    }

    // The last key block of width BN at or before nb that meets a block present for queries
    // [q_first, q_last] (rows and keys past the sequence do not count); -1 if none. One
    // read per block row of the skip table, however many absent blocks lie between.
    template <int BN>
    __device__ __forceinline__ int last_present_tile(int q_first, int q_last, int nb) const {
        const AttnParams& p = *prm;
        q_last = min(q_last, seqlen_k - offset - 1);
        const int n1 = min(nb * BN + BN, seqlen_k);
        if (nb < 0 || q_last < q_first || n1 <= 0) return -1;
        const unsigned int* prev =
            p.block_prev_col + head * p.block_head_stride + p.block_k_div(n1 - 1);
        int c = 0;
        for (int r = p.block_q_div(q_first); r <= p.block_q_div(q_last); ++r)
            c = max(c, int(prev[r * p.block_cols]));
        if (c-- == 0) return -1;
        // Block c ends in or after the tiles of [.., n1): its last tile, or nb itself.
        return min(nb, (min(c * p.block_k + p.block_k, seqlen_k) - 1) / BN);
    }

    // The first query block of height BM (a multiple of BM at or after m0, below m_end) of
    // query head h that meets a block present for keys [n0, n1); m_end if none. The dK/dV
    // loops' counterpart of last_present_tile.
    template <int BM>
    __device__ __forceinline__ int next_present_tile(int h, int n0, int n1, int m0,
                                                     int m_end) const {
        const AttnParams& p = *prm;
        const int seqlen_q = seqlen_k - offset;
        n1 = min(n1, seqlen_k);
        if (n1 <= n0 || m0 >= min(m_end, seqlen_q)) return m_end;
        const unsigned int* next =
            p.block_next_row + h * p.block_head_stride + p.block_q_div(m0);
        int r = p.block_rows;
        for (int c = p.block_k_div(n0); c <= p.block_k_div(n1 - 1); ++c)
            r = min(r, int(next[c * p.block_rows]));
        const int q = r * p.block_q;  // the block's first query
        if (q >= seqlen_q) return m_end;
        return min(max(m0, q / BM * BM), m_end);
    }

    // Whether the element mask lets query q see key k (a block of state 2).
    __device__ __forceinline__ bool dense_visible(int q, int k) const {
        const AttnParams& p = *prm;
        return p.block_dense[int64_t(head) * p.dense_head_stride +
                             int64_t(q) * p.dense_row_stride + k] != 0;
    }

    // Head h's ALiBi slope in S's units.
    __device__ __forceinline__ float slope_of(int h) const { return slopes[h] * alibi_scale; }

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
                    hi = right >= 0 ? min(seqlen_k, q + offset + right + 1) : seqlen_k;
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

    // The block mask's part of `apply` for this thread's rows (bits[mt][r]: see sparse_row),
    // computed ahead: the warp-specialized kernels call it before the matmul whose scores it
    // masks, as with S live its registers spilled.
    template <int MT, int NT, bool TRANSPOSED>
    __device__ __forceinline__ void sparse_bits(uint64_t (&bits)[MT][2], int row0, int col0,
                                                int lane) const {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r)
                bits[mt][r] = sparse_row<NT, TRANSPOSED>(row0 + mt * 16 + lane / 4 + r * 8, col0,
                                                         lane % 4);
    }

    // Which of this thread's 2 NT columns (col0 + nt * 8 + 2 t + c: bit 2 nt + c) the block
    // mask lets row `row` see, block by block across the tile's columns (a thread's row lies in
    // one block row): a whole block of state 1 sets its columns' bits at once, and only
    // blocks of state 2 read the element mask, in a loop that is not unrolled (unrolled, its
    // loads were issued all at once and the forward's consumers spilled hundreds of bytes).
    template <int NT, bool TRANSPOSED>
    __device__ __forceinline__ uint64_t sparse_row(int row, int col0, int t) const {
        static_assert(2 * NT <= 64, "one bit per column");
        // Rows are queries (keys when TRANSPOSED); columns are keys (queries).
        const int seqlen_q = seqlen_k - offset;
        const int row_len = TRANSPOSED ? seqlen_k : seqlen_q;
        const int col_len = TRANSPOSED ? seqlen_q : seqlen_k;
        const int col_block = TRANSPOSED ? prm->block_q : prm->block_k;
        if (row >= row_len) return 0;
        const int rb = TRANSPOSED ? prm->block_k_div(row) : prm->block_q_div(row);
        const int col_end = min(col0 + NT * 8, col_len);
        uint64_t seen = 0;
#pragma unroll 1
        for (int cb = TRANSPOSED ? prm->block_q_div(col0) : prm->block_k_div(col0);
             cb * col_block < col_end; ++cb) {
            const int state = TRANSPOSED ? block_state(cb, rb) : block_state(rb, cb);
            if (state == 0) continue;
            const int lo = max(cb * col_block, col0), hi = min((cb + 1) * col_block, col_end);
            if (state == 1) {
                seen |= column_bits<NT>(hi - col0 - 2 * t) & ~column_bits<NT>(lo - col0 - 2 * t);
                continue;
            }
#pragma unroll 1
            for (int j = 0; j < 2 * NT; ++j) {
                const int col = col0 + (j / 2) * 8 + 2 * t + j % 2;
                if (col >= lo && col < hi &&
                    (state == 1 ||
                     (TRANSPOSED ? dense_visible(col, row) : dense_visible(row, col))))
                    seen |= uint64_t(1) << j;
            }
        }
        return seen;
    }

    // sparse_row entry by entry, for `apply` in the mma.sync kernels (their `sparse` is a
    // run-time test, and they call it with S live): sparse_row's block-by-block form made
    // the sm_80 forward at d = 128 spill 72 bytes where this one spills none.
    template <int NT, bool TRANSPOSED>
    __device__ __forceinline__ uint64_t sparse_row_lean(int row, int col0, int t) const {
        uint64_t seen = 0;
#pragma unroll 1
        for (int j = 0; j < 2 * NT; ++j) {
            const int col = col0 + (j / 2) * 8 + 2 * t + j % 2;
            const int q = TRANSPOSED ? col : row, k = TRANSPOSED ? row : col;
            if (q >= seqlen_k - offset || k >= seqlen_k) continue;
            const int state = block_state(prm->block_q_div(q), prm->block_k_div(k));
            if (state == 1 || (state == 2 && dense_visible(q, k))) seen |= uint64_t(1) << j;
        }
        return seen;
    }

    // The bits of sparse_row whose columns lie below col0 + 2 t + x: the columns
    // col0 + 2 t + 8 (j / 2) + j % 2 grow with j, so they are the first
    // 2 floor(x / 8) + min(x mod 8, 2) of the 2 NT.
    template <int NT> __device__ __forceinline__ static uint64_t column_bits(int x) {
        const int n = x <= 0 ? 0 : min(2 * (x / 8) + min(x % 8, 2), 2 * NT);
        return n >= 64 ? ~uint64_t(0) : (uint64_t(1) << n) - 1;
    }

    // c tanh(x / c) with the scale folded in (S keeps the tanh; `scale` is c): tanh.approx.f32
    // (sm_75+, ~2^-11 relative error, below the bf16 rounding of the scores it feeds; the
    // f16x2 form, half the MUFU issues, was no faster: 1.46-1.75x plain against 1.44-1.61x,
    // H200, its conversions cost what it saved).
    // PRESCALED: S already carries the scale (Mask::apply).
    template <int MT, int NT, bool PRESCALED = false>
    __device__ __forceinline__ void cap(float (&s)[MT][NT][4]) const {
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
    __device__ __forceinline__ void bias(float (&s)[MT][NT][4], int row0, int col0, int lane,
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
    __device__ __forceinline__ float capped(float s, int row, int col) const {
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
    __device__ __forceinline__ void times_cap_grad(float (&x)[MT][NT][4],
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
};

