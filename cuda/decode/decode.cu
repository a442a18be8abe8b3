// KV-cache decoding, launched in this order:
//   flash_append_<dtype>          new K or V rows -> cache rows start[b]..        grid (s_new, h_k + h, b)
//                                 (rotary embedding and the rotated queries: append.cuh)
//   flash_decode_<dtype>_d<D>     one split of the key range for 16 packed rows   grid (h_k * tiles, splits, b)
//   flash_decode_<dtype>_d<D>_w8  the same with 8 warps (split launches, D <= 128)
//   flash_decode_<dtype>_d<D>_w2  with 2 warps, D > 128 on 99 KB devices (sm_86/89)
//   ..._fp8, flash_append_<dtype>_fp8   the same over an e4m3 cache (decode/fp8.cuh)
// When split, a row tile's splits are merged by their LSE (flash-decoding, decode/merge.cuh):
// inside the thread-block cluster they form (sm_90, DecodeParams::cluster), or by the last
// split to finish (through DecodeParams::counters).
// The decode kernel reuses the forward's softmax, mask and fragment packing (softmax.cuh,
// mask/visibility.cuh, gemm.cuh's pack_a) but not its block layout: a decode step has a
// handful of query rows, so the block's warps split the keys instead of the rows (see
// DecodeTraits), and its K/V tiles are swizzled rows (SwizzledRows), read by gemm_qk / gemm_pv
// below. The query heads that share a K/V head are folded into the rows of one tile (GQA
// packing): row r holds token r / group of head h_k * group + r % group, so each K/V element
// is read once per group, not per head.
#include <type_traits>
#include "decode/append.cuh"
#include "decode/decode_block.cuh"
#include "decode/fp8.cuh"
#include "decode/merge.cuh"
#include "common/arrival.cuh"
#include "common/gemm.cuh"
#include "common/mask/visibility.cuh"
#include "common/pdl.cuh"
#include "common/seq_info.cuh"
#include "common/softmax.cuh"

// Decode tile: ROWS packed query rows shared by NWARPS warps. Each warp streams its own
// 16-key K/V tiles (tiles w, w + NWARPS, ... of the block's key range) through a private
// two-stage cp.async ring, synchronising only within the warp, and keeps its own online
// softmax; the warps' (max, sum, O) are merged through shared memory at the end. Decoding
// reads every K/V byte once and does little math per byte, so what matters is many copies
// in flight, no block-wide barrier inside the loop, and few instructions per byte: at 12
// warps per SM the loop must stay near 300 instructions per 8 KB tile to keep up with HBM.
//
// FP8 = true: the cache is e4m3 (decode/fp8.cuh): its rows are D bytes, handled as D / 2
// 16-bit units by the copies, and the matmuls run in f16 whatever T is.
template <typename T_, int D_, int NWARPS_ = 4, bool FP8_ = false> struct DecodeTraits {
    using T = T_;
    static constexpr bool FP8 = FP8_;
    // The tiles' storage unit: 16-bit elements, or pairs of e4m3 bytes.
    using U = std::conditional_t<FP8, uint16_t, T>;
    // The mma's element type.
    using M = std::conditional_t<FP8, __half, T>;
    static constexpr int D = D_, NWARPS = NWARPS_, THREADS = 32 * NWARPS;
    static constexpr int ROWS = 16;  // one m16 tile of packed (token, head) rows
    static constexpr int BN = 16;    // keys per warp tile
    static constexpr int UNITS = FP8 ? D / 2 : D;  // 16-bit units per K/V row
    static constexpr int STRIDE = D + SMEM_PAD;        // Q tile pitch (padded rows)
    static constexpr int PITCH = SwizzledRows<UNITS>::PITCH;  // K/V tile pitch (units)
    static constexpr int ROW_BYTES = PITCH * 2;
    static constexpr int DT = D / 8;
    // Q's A fragments stay in registers across tiles up to D = 128 (32 registers); larger
    // head dims need those registers for O and re-read Q from shared memory.
    static constexpr bool Q_IN_REGS = D <= 128;
    // Blocks per SM that fit in shared memory (3 up to D = 128); hold registers to that too.
    // 8-warp blocks run one per SM (split launches, see src/cuda/plan/decode.rs).
    static constexpr int MIN_BLOCKS = NWARPS == 8 ? 1 : D <= 128 ? 3 : D <= 192 ? 2 : 1;
    // Partial-O loads in flight per thread in the merge (merge_splits): 4 registers
    // each, which small head dims would pay for in occupancy.
    static constexpr int MERGE_UNROLL = D <= 32 ? 8 : 16;
    // Two stages for e4m3 tiles too: four (as many bytes in flight as the 16-bit ring) were
    // slower at every shape (H200, (8, 8k) 0.0410 ms against 0.0403; docs/archive/PERF.md).
    static constexpr int RING = 2 * 2 * BN * PITCH;  // per warp: 2 stages x (K, V), units
    // The merge reuses the rings as f32: NWARPS x ROWS x D partial O, then row max and sum,
    // then (cluster merge) the block's merged rows and their LSE.
    static constexpr int MERGE_BYTES = (NWARPS * ROWS * (D + 2) + ROWS * (D + 1)) * 4;
    static_assert(ROWS * STRIDE * int(sizeof(T)) % 128 == 0, "K/V rings start 128-byte aligned");
    static_assert(!FP8 || D % 32 == 0, "e4m3 tiles are read 32 columns at a time");
    // Q tile, rings (or the merge's buffers), then the merge's arrival count.
    static constexpr int ARRIVED_OFFSET = ROWS * STRIDE * int(sizeof(T)) +
        (NWARPS * RING * 2 > MERGE_BYTES ? NWARPS * RING * 2 : MERGE_BYTES);
    static constexpr int SMEM_BYTES = ARRIVED_OFFSET + 16;
};

// S += Q K^T for one m16 row tile and 16 keys of a SwizzledRows K tile. Q's A fragments come
// from registers (Q_IN_REGS) or from the padded Q tile `q`. The K rows a lane addresses have
// row % 8 == lane % 8, so logical chunk 2 kk + (lane / 8) % 2 sits at chunk 2 kk ^ y.
template <typename T, int KSTEPS, int STRIDE, int PITCH, bool Q_IN_REGS, int QF>
__device__ __forceinline__ void gemm_qk(float (&s)[1][2][4], const uint32_t (&qf)[QF][4],
                                        const T* q, const T* k, int lane) {
    const int mi = lane / 8;
    const uint32_t k_row = opaque(smem_addr(k) + ((mi / 2) * 8 + lane % 8) * PITCH * int(sizeof(T)));
    const int y = (mi % 2) ^ (lane % 8);
    const uint32_t q_base = Q_IN_REGS ? 0 : opaque(smem_addr(q + (lane % 16) * STRIDE + (lane / 16) * 8));
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) {
        uint32_t a[4];
        if constexpr (Q_IN_REGS) {
#pragma unroll
            for (int j = 0; j < 4; ++j) a[j] = qf[kk][j];
        } else {
            ldmatrix_x4(a, q_base + kk * 16 * int(sizeof(T)));
        }
        uint32_t bf[4];
        ldmatrix_x4(bf, k_row + (((2 * kk) ^ y) << 4));
        MmaOp<T>::run(s[0][0], a, bf[0], bf[1]);
        MmaOp<T>::run(s[0][1], a, bf[2], bf[3]);
    }
}

// O += P V for 16 keys of a SwizzledRows V tile, P's A fragments in registers; V is read
// k-major through ldmatrix.trans, logical chunk 2 np + lane / 16 at chunk 2 np ^ y.
template <typename T, int DT, int PITCH>
__device__ __forceinline__ void gemm_pv(float (&o)[1][DT][4], const uint32_t (&pa)[1][1][4],
                                        const T* v, int lane) {
    static_assert(DT % 2 == 0, "V is loaded two n8 tiles at a time");
    const int mi = lane / 8;
    const uint32_t v_row = opaque(smem_addr(v) + ((mi % 2) * 8 + lane % 8) * PITCH * int(sizeof(T)));
    const int y = (mi / 2) ^ (lane % 8);
#pragma unroll
    for (int np = 0; np < DT / 2; ++np) {
        uint32_t bf[4];
        ldmatrix_x4_trans(bf, v_row + (((2 * np) ^ y) << 4));
        MmaOp<T>::run(o[0][2 * np], pa[0][0], bf[0], bf[1]);
        MmaOp<T>::run(o[0][2 * np + 1], pa[0][0], bf[2], bf[3]);
    }
}

// Writes the rows of a tile that holds only ragged padding: output 0 and, when asked, LSE
// -inf, for rows m0.. of sequence b's K/V head h_k.
template <typename T, int ROWS>
__device__ __forceinline__ void pad_rows(const DecodeParams& dp, int b, int h_k, int m0, int tid,
                                         int threads) {
    const AttnParams& p = dp.a;
    const int group = p.h_h_k_ratio;
    const int n_rows = min(ROWS, p.seqlen_q * group - m0);
    for (int e = tid; e < n_rows * p.d; e += threads) {
        const int r = e / p.d, col = e % p.d;
        const int token = (m0 + r) / group, head = h_k * group + (m0 + r) % group;
        static_cast<T*>(p.o)[b * p.o_batch_stride + int64_t(token) * p.o_row_stride +
                             head * p.o_head_stride + col] = T(0.f);
        if (col == 0 && dp.lse != nullptr)
            dp.lse[(int64_t(b) * p.h + head) * p.seqlen_q + token] = -INFINITY;
    }
}

template <class K> __device__ __forceinline__ void flash_decode(const DecodeParams& dp) {
    using T = typename K::T;
    using U = typename K::U;
    using M = typename K::M;
    constexpr int D = K::D, BN = K::BN, STRIDE = K::STRIDE, PITCH = K::PITCH, DT = K::DT;
    // Cache strides arrive in elements; the tiles move 16-bit units (two e4m3 bytes).
    constexpr int PER_UNIT = K::FP8 ? 2 : 1;
    constexpr int NW = K::NWARPS;
    constexpr int ROWS = K::ROWS, KSTEPS = D / 16;
    const AttnParams& p = dp.a;
    // Launched programmatically (src/cuda/decode.rs): the grid is set up while the kernel
    // ahead of it finishes, and touches no global memory before that kernel (the append, the
    // projection that wrote q, the previous decode step) has completed. A grid of one partial
    // wave lets its dependents in as it starts (trigger_dependents: the next kernel's blocks
    // take the idle SMs); a larger one waits for its exit: blocks of a next decode made
    // resident beside this grid's took its SMs' free slots and upset the block placement
    // (H200: (32, 4k) 0.17 ms against 0.125 with the implicit trigger at exit;
    // docs/archive/PERF.md).
    if (dp.trigger_dependents) pdl_launch_dependents();
    pdl_wait();
    // No static shared memory in this kernel: it would come first and push this base off
    // the 128-byte alignment the swizzled K/V rows rely on (every row 16 bytes off a sector
    // boundary moved each sector twice: 16.8 M sectors for 8.4 M at (8, 8k)).
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* sQ = reinterpret_cast<T*>(smem_raw);
    U* rings = reinterpret_cast<U*>(sQ + ROWS * STRIDE);  // 128-byte aligned (DecodeTraits)
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int group = p.h_h_k_ratio;
    const int rows = p.seqlen_q * group;  // packed (token, head) rows of one K/V head
    const int tiles = (rows + ROWS - 1) / ROWS;
    // Heads vary fastest across the grid: blocks resident together read the same token range
    // of every K/V head, which in a (b, L, h_k, d) cache is one contiguous run of memory.
    const int split = blockIdx.y, h_k = blockIdx.x / tiles, b = blockIdx.z;
    const int m0 = (blockIdx.x % tiles) * ROWS;
    // Device lengths are those before the append (plus seqlens_add), read unchecked: clamped
    // to the capacity so that no key past the cache is read.
    // Ragged queries: this sequence's real query rows (the causal alignment is theirs).
    const int q_len = dp.q_lens != nullptr
                          ? int(min(unsigned(dp.q_lens[b]), unsigned(p.seqlen_q)))
                          : p.seqlen_q;
    const int64_t total_len =
        int64_t(unsigned(dp.seqlens != nullptr ? dp.seqlens[b] : dp.seqlens_inline[b])) +
        (dp.add_q_lens ? q_len : dp.seqlens_add);
    const int64_t capacity = cache_capacity(dp.block_table, dp.max_pages, dp.page_size);
    const int seqlen_k = int(min(total_len, capacity));
    SeqInfo seq(p, b);
    seq.seqlen_q = q_len;
    seq.seqlen_k = seqlen_k;
    const Mask mask(p, seq, b, h_k * group);
    if (m0 / group >= q_len) {
        // A tile of padding rows only: zeros and -inf from the first split, no keys read,
        // and no split counts itself in (so no merge runs and the counter stays 0).
        if (split == 0) pad_rows<T, ROWS>(dp, b, h_k, m0, tid, K::THREADS);
        return;
    }

    const auto q_row = [&](int r) -> const T* {
        const int row = m0 + r, token = row / group;
        if (token >= q_len) return nullptr;
        const int head = h_k * group + row % group;
        return static_cast<const T*>(p.q) + b * p.q_batch_stride + int64_t(token) * p.q_row_stride +
               head * p.q_head_stride;
    };
    load_rows<T, ROWS, D, K::THREADS>(sQ, q_row, static_cast<const T*>(p.q), p.d, tid);
    cp_async_commit();

    // This split's share of the key tiles the block's queries can see.
    const int q_first = m0 / group, q_last = (min(m0 + ROWS, rows) - 1) / group;
    int kb_begin, kb_end;
    mask.template key_blocks<BN>(q_first, q_last, &kb_begin, &kb_end);
    const int per_split = (kb_end - kb_begin + dp.num_splits - 1) / dp.num_splits;
    const int my_begin = min(kb_end, kb_begin + split * per_split);
    const int my_end = min(kb_end, my_begin + per_split);

    // The fused append (DecodeAppend; src/cuda/decode.rs fuses it only where a K/V head has
    // one row tile, so one block per split reads each key): each new row goes to the cache
    // from the block whose key range holds it (split 0 for a row no query of this call
    // sees), before that block's copies read it, one warp a row. No other block reads those
    // keys, so no grid-wide ordering is needed. Rows past the capacity are dropped, as the
    // append launch drops them.
    const DecodeAppend& fa = dp.append;
    const bool fused = fa.k_new != nullptr;
    const int64_t new_start = fused ? total_len - (dp.q_lens != nullptr ? q_len : fa.s_new) : 0;
    if (fused) {
        using C = std::conditional_t<K::FP8, uint8_t, T>;
        const CacheRows dst{dp.block_table, dp.max_pages, dp.page_size, b, h_k, dp.num_pages};
        const int n = int(total_len - new_start);
        for (int item = warp; item < 2 * n; item += NW) {
            const int i = item / 2;
            const bool is_v = item % 2 != 0;
            const int64_t j = new_start + i;
            const int t = int(j / BN);
            const bool mine = (t >= my_begin && t < my_end) ||
                              (split == 0 && (t < kb_begin || t >= kb_end));
            if (j >= capacity || !mine) continue;
            const T* src = static_cast<const T*>(is_v ? fa.v_new : fa.k_new) +
                           b * (is_v ? fa.v_batch_stride : fa.k_batch_stride) +
                           int64_t(i) * (is_v ? fa.v_row_stride : fa.k_row_stride) +
                           h_k * (is_v ? fa.v_head_stride : fa.k_head_stride);
            C* row = dst.row(static_cast<C*>(const_cast<void*>(is_v ? p.v : p.k)),
                             is_v ? p.v_batch_stride : p.k_batch_stride,
                             is_v ? p.v_row_stride : p.k_row_stride,
                             is_v ? p.v_head_stride : p.k_head_stride, int(j));
            const float scale = K::FP8 ? (is_v ? dp.v_scale : dp.k_scale)[h_k] : 1.f;
            if (is_v)
                append_row<T, C>(Rotation{}, fa.d, row, src, j, scale, lane, 32);
            else
                append_row<T, C>(Rotation::of(fa), fa.d, row, src, j, scale, lane, 32);
        }
        __syncthreads();  // the rows are in the cache before any warp's copies read them
    }

    // A tile is 16 consecutive rows of one page (a contiguous cache is one page per
    // sequence), found with one block-table read per tile, done a step ahead so that its
    // latency hides behind the current tile. Pages of other sizes (not a multiple of 16)
    // look every row up.
    const int64_t k_batch = p.k_batch_stride / PER_UNIT, k_row = p.k_row_stride / PER_UNIT;
    const int64_t v_batch = p.v_batch_stride / PER_UNIT, v_row = p.v_row_stride / PER_UNIT;
    const U* k_base = static_cast<const U*>(p.k);
    const U* v_base = static_cast<const U*>(p.v);
    const U* k_head = k_base + h_k * (p.k_head_stride / PER_UNIT);
    const U* v_head = v_base + h_k * (p.v_head_stride / PER_UNIT);
    const int units_valid = p.d / PER_UNIT;
    const int* table = dp.block_table;
    const bool row_lookup = table != nullptr && dp.page_size % BN != 0;
    const CacheRows cache{table, dp.max_pages, dp.page_size, b, h_k, dp.num_pages};
    const int* my_pages = table + int64_t(b) * dp.max_pages;
    const auto page_of = [&](int tile) -> int {
        if (table == nullptr) return b;
        return tile < my_end && !row_lookup
                   ? clamp_page(my_pages[tile * BN / dp.page_size], dp.num_pages)
                   : 0;
    };
    const WarpTileCopy<U, BN, K::UNITS> copy(lane);
    const bool full_cols = p.d == D;

    U* ring = rings + warp * K::RING;  // stage s: K at ring + s * 2 * BN * PITCH, V after it
    const auto prefetch = [&](int tile, int stage, int page) {
        const int n0 = tile * BN;
        U* sK = ring + stage * 2 * BN * PITCH;
        U* sV = sK + BN * PITCH;
        if (row_lookup) {
            const int j = n0 + lane % BN;
            const bool is_v = lane >= BN;
            const U* my_row = j >= seqlen_k ? nullptr
                : is_v ? cache.row(v_base, v_batch, v_row, p.v_head_stride / PER_UNIT, j)
                       : cache.row(k_base, k_batch, k_row, p.k_head_stride / PER_UNIT, j);
            copy.gathered(sK, sV, my_row, k_base, units_valid);
            return;
        }
        const int r0 = table == nullptr ? n0 : n0 % dp.page_size;
        const U* kt = k_head + page * k_batch + int64_t(r0) * k_row;
        const U* vt = v_head + page * v_batch + int64_t(r0) * v_row;
        if (full_cols && n0 + BN <= seqlen_k) {
            copy.full(sK, kt, k_row);
            copy.full(sV, vt, v_row);
        } else {
            copy.partial(sK, kt, k_row, seqlen_k - n0, units_valid);
            copy.partial(sV, vt, v_row, seqlen_k - n0, units_valid);
        }
    };

    float o[1][DT][4];
    zero(o);
    OnlineSoftmax<1> softmax;
    int tile = my_begin + warp;
    if (tile < my_end) prefetch(tile, 0, page_of(tile));
    int next_page = page_of(tile + NW);
    cp_async_commit();  // one group per step, empty or not, so wait<1> always means "this tile"
    cp_async_wait<1>();  // Q landed (this thread's part) ...
    __syncthreads();     // ... and everyone's
    if (fused && fa.rot_cos != nullptr) {  // the queries rotated in place, one warp a row
        for (int r = warp; r < ROWS; r += NW) {
            const int token = (m0 + r) / group;
            if (token >= q_len) continue;
            T* row = sQ + r * STRIDE;
            append_row<T, T>(Rotation::of(fa), fa.d, row, row,
                             new_start + (fa.q_causal ? token : 0), 1.f, lane, 32);
        }
        __syncthreads();
    }
    if constexpr (K::FP8) {  // f16, carrying the K scale, in the K fragments' k order
        q_to_f16_permuted<T, ROWS, D, STRIDE, K::THREADS>(sQ, dp.k_scale[h_k], tid);
        __syncthreads();
    }
    const M* sQm = reinterpret_cast<const M*>(sQ);
    uint32_t qf[K::Q_IN_REGS ? KSTEPS : 1][4];
    if constexpr (K::Q_IN_REGS) {
        const uint32_t q_base = smem_addr(sQm + (lane % 16) * STRIDE + (lane / 16) * 8);
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) ldmatrix_x4(qf[kk], q_base + kk * 16 * int(sizeof(T)));
    }
    for (int stage = 0; tile < my_end; tile += NW, stage ^= 1) {
        if (tile + NW < my_end) prefetch(tile + NW, stage ^ 1, next_page);
        next_page = page_of(tile + 2 * NW);
        cp_async_commit();
        cp_async_wait<1>();
        __syncwarp();  // this tile landed for the whole warp
        const U* sK = ring + stage * 2 * BN * PITCH;
        float s[1][2][4];
        zero(s);
        if constexpr (K::FP8)
            gemm_qk_fp8<KSTEPS, STRIDE, K::ROW_BYTES, K::Q_IN_REGS>(s, qf, sQm, sK, lane);
        else
            gemm_qk<T, KSTEPS, STRIDE, PITCH, K::Q_IN_REGS>(s, qf, sQ, sK, lane);
        mask.apply<1, 2>(s, m0, tile * BN, lane,
                         mask.template block_needs_mask<BN>(q_first, q_last, tile * BN), group);
        softmax.update(s, o, p.scale_log2);
        uint32_t pa[1][1][4];
        pack_a<M, 1, 2>(s, pa);
        if constexpr (K::FP8)
            gemm_pv_fp8<DT, K::ROW_BYTES>(o, pa, sK + BN * PITCH, lane);
        else
            gemm_pv<T, DT, PITCH>(o, pa, sK + BN * PITCH, lane);
        __syncwarp();  // every lane is done with this stage before it is refilled
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with its ring: reuse the rings for the merge

    static_assert((ROWS * MAX_SPLITS + 4 * K::THREADS) * 4 <=
                      K::SMEM_BYTES - ROWS * STRIDE * int(sizeof(T)),
                  "merge_splits' weights and partial sums fit in the rings");
    float* sO = reinterpret_cast<float*>(rings);  // (NW, ROWS, D), unnormalised
    float* sM = sO + NW * ROWS * D;               // (NW, ROWS) row max of raw scores
    float* sL = sM + NW * ROWS;                   // (NW, ROWS) row sum
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = g + 8 * r;
        float l = softmax.row_sum[0][r];
        l += __shfl_xor_sync(0xffffffff, l, 1);
        l += __shfl_xor_sync(0xffffffff, l, 2);
        if (t == 0) {
            sM[warp * ROWS + row] = softmax.row_max[0][r];
            sL[warp * ROWS + row] = l;
        }
        if constexpr (K::FP8) {
            store_o_fp8(sO + (warp * ROWS + row) * D, o, r, t);
        } else {
#pragma unroll
            for (int dt = 0; dt < DT; ++dt)
                *reinterpret_cast<float2*>(sO + (warp * ROWS + row) * D + dt * 8 + 2 * t) =
                    make_float2(o[0][dt][2 * r], o[0][dt][2 * r + 1]);
        }
    }
    __syncthreads();
    // One thread per row turns the warps' (max, sum) into merge weights, written over sM:
    // O = sum_w weight_w O_w with weight_w = exp(m_w - m) / l, l = sum_w exp(m_w - m) l_w.
    // Split launches merge through global memory (split_out: partial rows, then the last
    // split to arrive), or through their cluster's shared memory (clustered: each block's
    // merged rows at sP, their LSE at sPl; decode/merge.cuh).
    const bool clustered = dp.cluster != 0;
    const bool split_out = dp.num_splits > 1 && !clustered;
    float* sP = sL + NW * ROWS;  // (ROWS, D)
    float* sPl = sP + ROWS * D;  // (ROWS)
    if (tid < ROWS) {
        float m = -INFINITY;
#pragma unroll
        for (int w = 0; w < NW; ++w) m = fmaxf(m, sM[w * ROWS + tid]);
        const float m_scaled = m == -INFINITY ? 0.f : m * p.scale_log2;
        float weight[NW], l = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) {
            weight[w] = exp2f(sM[w * ROWS + tid] * p.scale_log2 - m_scaled);
            l += weight[w] * sL[w * ROWS + tid];
        }
        const float inv = l == 0.f ? 0.f : 1.f / l;  // NaN stays NaN
#pragma unroll
        for (int w = 0; w < NW; ++w) sM[w * ROWS + tid] = weight[w] * inv;
        const int token = (m0 + tid) / group;
        const bool pad = token >= q_len;  // ragged padding: output 0, LSE -inf
        if (pad) {
#pragma unroll
            for (int w = 0; w < NW; ++w) sM[w * ROWS + tid] = 0.f;
        }
        const float lse = l == 0.f || pad ? -INFINITY : m * p.scale + logf(l);
        if (clustered) {
            sPl[tid] = lse;
        } else if (token < p.seqlen_q && (split_out || dp.lse != nullptr)) {
            const int head = h_k * group + (m0 + tid) % group;
            const int64_t row = (int64_t(b) * p.h + head) * p.seqlen_q + token;
            if (split_out)
                dp.lse_partial[int64_t(split) * p.b * p.h * p.seqlen_q + row] = lse;
            else
                dp.lse[row] = lse;
        }
    }
    __syncthreads();
    // An e4m3 cache's V scale, applied once to the output (partials included: the merge is
    // linear in them).
    const float v_scale = K::FP8 ? dp.v_scale[h_k] : 1.f;
    for (int e = tid; e < ROWS * D; e += K::THREADS) {
        const int row = e / D, col = e % D;
        const int token = (m0 + row) / group;
        if (token >= p.seqlen_q || col >= p.d) continue;
        float x = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) x += sM[w * ROWS + row] * sO[(w * ROWS + row) * D + col];
        x *= v_scale;
        const int head = h_k * group + (m0 + row) % group;
        if (clustered) {
            sP[row * D + col] = x;
        } else if (split_out) {
            const int64_t prow = ((int64_t(split) * p.b + b) * p.h + head) * p.seqlen_q + token;
            dp.o_partial[prow * p.d + col] = x;
        } else {
            static_cast<T*>(p.o)[b * p.o_batch_stride + int64_t(token) * p.o_row_stride +
                                 head * p.o_head_stride + col] = T(x);
        }
    }
    if (clustered) {  // sO's rows are read: its space holds the cluster merge's weights
        cluster_merge<T, ROWS, D, K::THREADS>(dp, sP, sPl, sO, b, h_k, m0, tid);
        return;
    }
    if (!split_out) return;  // unclustered split launches pass counters (src/cuda/decode.rs)

    // The split of this row tile that finishes last merges all of them (common/arrival.cuh),
    // which saves a separate combine kernel's launch gap and ramp.
    unsigned int& arrived = *reinterpret_cast<unsigned int*>(smem_raw + K::ARRIVED_OFFSET);
    __syncthreads();  // the block's partial rows are stored
    if (tid == 0)
        arrived = arrive_acq_rel(dp.counters + blockIdx.z * gridDim.x + blockIdx.x,
                                 dp.num_splits - 1);
    __syncthreads();
    if (arrived != unsigned(dp.num_splits - 1)) return;
    merge_splits<T, ROWS, K::THREADS, K::MERGE_UNROLL>(dp, reinterpret_cast<float*>(rings), b,
                                                       h_k, m0, tid);
}

// build.rs compiles this file once per dtype (CANDLE_FLASH_ONLY_F16 / CANDLE_FLASH_ONLY_BF16,
// which the instances test): two nvcc jobs of half the size, which two cores finish sooner.
// The kernels of this file: one per row of cuda/catalogue.rs (generated by build.rs).
#include "instances/decode.inc"
