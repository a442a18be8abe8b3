// The block mask (p.block_mask, block-sparse attention): which key or query tiles a loop
// visits, jumping past absent blocks with the skip tables, the state of a tile (absent, whole
// or partly visible) and, in the partly visible ones, which entries the mask keeps. Mask's
// members (its fields, `sparse` and `prm` among them: visibility.cuh).
#pragma once
#include <cstdint>

#include "common/mask/visibility.cuh"
#include "common/params.cuh"

// The block mask's states under queries [q_first, q_last] x keys [n0, n1) of this head
// (rows and keys past the sequence do not count): 0 no block present (the tile is
// skipped), 1 every block present and entirely visible, 2 anything else (the tile is
// masked entry by entry). A tile spans few blocks: block sizes are multiples of 64.
__device__ __forceinline__ int Mask::sparse_state(int q_first, int q_last, int n0, int n1) const {
    q_last = min(q_last, seqlen_k - offset - 1);
    n1 = min(n1, seqlen_k);
    if (q_last < q_first || n1 <= n0) return 0;
    const AttnParams& p = *prm;
    const unsigned char* head_blocks = p.block_mask + head * p.block_head_stride;
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
__device__ __forceinline__ int Mask::block_state(int r, int c) const {
    return prm->block_mask[head * prm->block_head_stride + r * prm->block_cols + c];
}

// The key block below nb (of width BN, down to nb_begin) that queries [q_first, q_last]
// need: nb - 1, or under a block mask the first one with a block present; -1 if none.
// The forward loops and the warp-specialized producer (which hands the tiles to its
// consumers) walk the blocks through this. `state`, if given, gets the
// block's sparse_state (1 without a block mask), for block_needs_mask.
template <int BN>
__device__ __forceinline__ int Mask::next_key_block(int q_first, int q_last, int nb, int nb_begin,
                                                    int* state) const {
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
__device__ __forceinline__ int Mask::last_present_tile(int q_first, int q_last, int nb) const {
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
__device__ __forceinline__ int Mask::next_present_tile(int h, int n0, int n1, int m0,
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
__device__ __forceinline__ bool Mask::dense_visible(int q, int k) const {
    const AttnParams& p = *prm;
    return p.block_dense[int64_t(head) * p.dense_head_stride +
                         int64_t(q) * p.dense_row_stride + k] != 0;
}

// The block mask's part of `apply` for this thread's rows (bits[mt][r]: see sparse_row),
// computed ahead: the warp-specialized kernels call it before the matmul whose scores it
// masks, as with S live its registers spilled.
template <int MT, int NT, bool TRANSPOSED>
__device__ __forceinline__ void Mask::sparse_bits(uint64_t (&bits)[MT][2], int row0, int col0,
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
__device__ __forceinline__ uint64_t Mask::sparse_row(int row, int col0, int t) const {
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
__device__ __forceinline__ uint64_t Mask::sparse_row_lean(int row, int col0, int t) const {
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
template <int NT> __device__ __forceinline__ uint64_t Mask::column_bits(int x) {
    const int n = x <= 0 ? 0 : min(2 * (x / 8) + min(x % 8, 2), 2 * NT);
    return n >= 64 ? ~uint64_t(0) : (uint64_t(1) << n) - 1;
}
