// The warp-specialized backward kernel on Hopper (sm_90a): FlashAttention-2 Algorithm 2 for
// one block of 128 keys, arranged as in FlashAttention-3's backward:
// - a producer warp issues TMA copies: K and V of the block once, then per query tile the Q
//   tile with its row statistics and the dO tile, into a ring of STAGES slots with full/empty
//   mbarriers (Q and dO have barriers of their own, so S^T starts before dO lands);
// - a dQ warp adds each tile's dQ (f32, in shared memory) to dq_accum with one bulk
//   reduce-add (`cp.reduce.async.bulk .add.f32`, summed in L2): no thread of the matmul
//   warpgroups waits on an atomic;
// - two consumer warpgroups own 64 keys each, their dK and dV in registers, and run the five
//   matmuls of each query tile on wgmma: S^T = K Q^T and dP^T = V dO^T (issued together),
//   P^T (line 13), dV += P^T dO (issued before dS^T is computed, so it runs under that),
//   dS^T (line 19), dK += dS^T Q, then dQ = dS K with dS^T shared through shared memory, the
//   warpgroups splitting dQ's columns; at d = 64 the next query tile's S^T and dP^T are
//   issued before this tile's dK is waited for. The producer warpgroup keeps 24 registers per thread
//   (setmaxnreg) and the consumers take 240. dK and dV leave at the end through the K and V
//   tiles' shared memory and TMA stores (store_dkdv).
// Scores are computed transposed (S^T, keys as rows) so that P^T and dS^T are register A
// operands (as in sm90/bwd.cu). The row statistics are precomputed per query tile
// (flash_bwd_ws_prep_<dtype>: the LSE in log2 units, +inf on rows past the sequence, and
// rowsum(dO O)), so that each tile's pair is one 512-byte bulk copy. dq_accum is laid out per
// (sequence, head, query tile) in the consumers' fragment order (each thread's float4s
// interleaved with its warpgroup's), written without bank conflicts and read back by
// flash_bwd_ws_convert_<dtype>_d<D>, which scales and stores dq. The first key block to reach
// a dq_accum tile stores into it, the others add (dq_tile_state.cuh): nothing zeroes dq_accum
// but for d = 256.
// d = 256 (head dims 129-256, columns past the head dim zero) splits the head dim between the
// consumers instead of the keys: see BwdWsSplitConsumer.
// Head dims 33-128 (65-96 on the d = 128 kernel) and 129-256 (on the d = 256 kernel),
// TMA-addressable tensors; dropout in the `_dropout` kernels and packed (variable-length)
// batches in the `_packed` ones (both: `_packed_dropout`), without a softcap, ALiBi or block
// mask. Packed batches are one tensor of every sequence's rows to TMA, the rows crossing a
// sequence's end written from shared memory by the threads (copy_dkdv, the convert kernel).
// src/cuda/plan/bwd.rs runs the older kernels for the rest.
// Entry points flash_bwd_ws_*.
#include "common/bwd_dq_accum.cuh"
#include "common/bwd_tiles.cuh"
#include "sm90/dq_tile_state.cuh"
#include "sm90/ring.cuh"
#include "common/gemm.cuh"
#include "common/lpt_tail.cuh"
#include "common/mask/levels.cuh"
#include "common/mask/score_mods.cuh"
#include "common/mask/visibility.cuh"
#include "common/params.cuh"
#include "common/pdl.cuh"
#include "common/philox.cuh"
#include "common/seq_info.cuh"
#include "common/softmax.cuh"
#include "sm90/tma.cuh"
#include "sm90/wgmma.cuh"

#include <type_traits>

// The kernels' parameter (mirror: `BwdTmaParams` in src/cuda/bwd_ws.rs): tensor maps of q,
// k, v, dout, dk, dv and dq over (d, rows, heads, batch), boxes of 64 columns x BM (q, dout,
// dq), BN (k, v) or 64 (dk, dv) rows; the backward's parameters (`b.dq_accum` is the tiled
// buffer described above).
struct BwdTmaParams {
    TmaDesc q, k, v, dout;
    TmaDesc dk, dv;  // boxes of 64 rows: each consumer warpgroup stores its own (store_dkdv)
    TmaDesc dq;      // stored by the convert kernel
    BwdParams b;
    // Per (sequence, head, query tile): BM LSEs in log2 units, then BM rowsum(dO O).
    float* stats;
    // Per (sequence, head, query tile): its dq_accum tile's state word (dq_tile_state.cuh), for
    // the kernels whose dQ warp adds dQ and for K::SPLIT in deterministic mode; otherwise null.
    // With K::SPLIT the prep zeroes dq_accum, into which the consumers add.
    int* dq_state;
    int m_blocks;  // query tiles of BM rows per (sequence, head)
    // Under a mask, how many (sequence, KV head) pairs at the end of the grid take their key
    // blocks heaviest first across all of them (longest_first_tail); 0: none.
    int tail_heads;
    // Nonzero: dQ bitwise repeatable, the key blocks adding into each dq_accum tile in order,
    // from the last (dq_tile_state.cuh), walking their query tiles from the first
    // (bwd_ws_walk) and starting from the last within each pair (launch_order). Read by the
    // kernels with K::HAS_ORDERED but the `_sparse_det` ones, which are always in this mode
    // (src/cuda/plan/bwd.rs takes them instead of `_sparse` when it is set).
    int deterministic;
    // Deterministic mode: the grid's (sequence, KV head) pairs go in groups of this many, key
    // block by key block across each group (interleaved_pairs); 0 or 1: pair by pair.
    int pair_group;
    // The `_sparse_det` kernels: block_next_col[h * block_head_stride + r * block_cols + c] =
    // the first block present at or after column c of row r of the block mask (block_cols:
    // none), for DqOrder::sparse_turn. Here rather than in AttnParams, where a field cost the
    // d 128 `_sparse` kernel 12 bytes of spill.
    const unsigned int* block_next_col;
};

// MODS (common/mask/levels.cuh): with the softcap and ALiBi code (`_mods`), also with the
// block mask's (`_sparse`), or the softcap's alone (`_cap`); without them, d = 128 kept no
// spill (112 bytes with the first).
// SPLIT (d = 256): 64 keys per block, and the consumer warpgroups split the head dim instead
// of the keys (BwdWsSplitConsumer): dK and dV of 128 keys x 256 columns would need 256
// registers per thread in each warpgroup, of 64 keys x 128 columns 128.
// DA: the head dim the products cover within D's layout (d 32 or 48 on d 64's tiles, 80 or 96
// on d 128's, as the forward's WsTraits::DA: the columns past it are TMA's zero fill, so S^T's
// and dP^T's k loops stop there, dV and dK are nDA). 160 or 192 on d 256's (SPLIT): only the
// k loops stop, each warpgroup keeps its 128 columns of dV, dK and dQ (a narrower second
// half would put a wgmma on one side of a branch on the warpgroup).
template <typename T_, int D_, int STAGES_, int MODS_ = MODS_NONE, bool PACKED_ = false,
          bool DROPOUT_ = false, bool DET_ = false, int DA_ = D_>
struct BwdWsTraits {
    using T = T_;
    static constexpr int D = D_, STAGES = STAGES_, DA = DA_;
    static constexpr int MODS = MODS_;
    // Packed (variable-length) batches, in kernels of their own (`_packed`), as in the
    // forward: one tensor of every sequence's rows to TMA, batch coordinate 0.
    static constexpr bool PACKED = PACKED_;
    // Dropout, in kernels of their own (`_dropout`, `_packed_dropout`), without mods.
    static constexpr bool DROPOUT = DROPOUT_;
    static_assert(!DROPOUT || MODS == MODS_NONE, "dropout kernels have no mods");
    // Dropout's Philox calls in flight together (Dropout::keep_fragment): all of a tile's at
    // d = 64 and 256, 2 at d = 128 (all spilled 32 bytes in its `_packed_dropout` kernel, 2
    // still 8; with 4 entries a call, all and 2 had run level there: H100;
    // docs/archive/PERF.md, "Philox calls in flight together" and "8 entries per Philox call,
    // laid out on the fragment").
    static constexpr int DROP_UNROLL = D == 128 ? 2 : 8;
    static constexpr bool SPLIT = D > 128;
    static_assert(DA == D || (DA < D && DA % 16 == 0 && (D <= 128 || DA > 128)),
                  "a cut row: whole k16 steps, past the first 128 columns at d 256");
    // Keys per block (64 per consumer, or all 64 in both with SPLIT), rows per query tile.
    static constexpr int BN = SPLIT ? 64 : 128, BM = 64;
    static constexpr int CONSUMERS = 2, THREADS = 128 * (CONSUMERS + 1);
    // n8 tiles of S^T per consumer warpgroup (SPLIT: its 32 of the tile's query rows).
    static constexpr int NQ = SPLIT ? BM / 16 : BM / 8;
    // n8 tiles of dK, dV per consumer warpgroup (SPLIT: its half of the columns).
    static constexpr int DT = SPLIT ? D / 16 : D / 8;
    static constexpr int DQ_N = D / 2;  // dQ columns per consumer warpgroup
    static constexpr int KV_BYTES = BN * D * 2, Q_BYTES = BM * D * 2, DS_BYTES = BN * BM * 2;
    // SPLIT adds dQ to dq_accum from the consumers' registers (red.global.add): the f32 tile
    // does not fit beside K, V and two slots of Q and dO (64 KB each at d = 256).
    static constexpr int DQ_BYTES = SPLIT ? 0 : BM * D * 4, STATS_BYTES = 2 * BM * 4;
    // K, V, STAGES x (Q, dO), two dS^T tiles (one per tile parity: a warpgroup may write the
    // next while the other still reads this one), with SPLIT two P^T tiles likewise, the dQ
    // tile, STAGES x statistics, barriers; plus 1 KB to align the panels to a swizzle atom
    // (read back for the host by the geometry probe, build/catalogue.rs).
    static constexpr int Q_OFFSET = 2 * KV_BYTES;
    static constexpr int DS_OFFSET = Q_OFFSET + 2 * STAGES * Q_BYTES;
    static constexpr int P_OFFSET = DS_OFFSET + 2 * DS_BYTES;
    static constexpr int DQ_OFFSET = P_OFFSET + (SPLIT ? 2 * DS_BYTES : 0);
    static constexpr int STATS_OFFSET = DQ_OFFSET + DQ_BYTES;
    static constexpr int BAR_OFFSET = STATS_OFFSET + STAGES * STATS_BYTES;
    static constexpr int BARRIERS = 1 + 2 * CONSUMERS + 3 * STAGES;
    // Under a block mask, per slot its query tile (TileInfo), written by the producer.
    static constexpr int INFO_OFFSET = BAR_OFFSET + BARRIERS * 8;
    static constexpr int SMEM_BYTES = INFO_OFFSET + STAGES * 8 + 1024;
    // The consumers take their query tiles from the producer (INFO_OFFSET) rather than walk
    // the block mask themselves, in each of their threads (the dQ warp still walks: it runs
    // behind them, after the slot's reuse); with SPLIT always (walking, the consumers of
    // d = 256 spilled 768 bytes).
    static constexpr bool TILES_FROM_PRODUCER = (MODS & MODS_BLOCKS) != 0 || SPLIT;
    // The kernels with a deterministic mode (BwdTmaParams::deterministic): all but the
    // `_sparse` ones, from which it is compiled out (reading the flag in their walks spilled:
    // d 64 8 -> 36 bytes, d 128 68 -> 96; with the one-division walk 4 -> 80 and 68 -> 96).
    // Under a block mask the `_sparse_det` kernels (DET) run it, and nothing else.
    static constexpr bool DET = DET_;
    static_assert(!DET || (MODS & MODS_BLOCKS) != 0, "_sparse_det: the block mask's kernels");
    static constexpr bool HAS_ORDERED = (MODS & MODS_BLOCKS) == 0 || DET;
    // Whether dQ is added in key-block order (dq_tile_state.cuh), given the parameter.
    static __device__ __forceinline__ bool ordered(int deterministic) {
        return DET || (HAS_ORDERED && deterministic != 0);
    }
    // 65536 / 384 -> 168 registers per thread at launch; the producer warpgroup gives up
    // 144 each, the consumers take 72 more: 128 x (168 - 24) / 256 = 72.
    static constexpr int PRODUCER_REGS = 24, CONSUMER_REGS = 240;
    // S^T and dP^T of query tile it + 1 issued before dK of tile it is waited for
    // (BwdWsConsumer::tile), so that the tensor cores go from one tile's dK to the next
    // tile's S^T without the warpgroups' turn around the loop in between: d = 64 1.2-4.2%
    // faster (plain), 1-4.5% with mods or a block mask; d = 128 level or up to 3.7% slower
    // (H100; docs/archive/PERF.md, "The d 64 backward: the next query tile's S^T and dP^T
    // issued before this tile's dK is waited for").
    static constexpr bool PIPE_SDP = !SPLIT && D == 64;
    static_assert(D % 64 == 0 && BM == 64, "panel tiles; dS^T is one 64-column panel");
    static_assert(DQ_N % 32 == 0, "dQ halves of whole wgmma n32 tiles");
    static_assert(CONSUMERS == 2, "the dQ warp's bulk groups are counted for two halves");
    static_assert(SMEM_BYTES <= 227 * 1024, "a Hopper block's shared memory");
};

// Named barrier ids (0 is __syncthreads), one table so that no two uses collide.
enum BwdWsBarrier : int {
    BAR_TILE_A = 1,   // both consumer warpgroups wrote their half of dS^T (K::SPLIT: of P^T)
    BAR_TILE_B = 2,   // K::SPLIT: both halves of dS^T written
    BAR_KV_FREE = 3,  // neither warpgroup reads K or V any more (store_dkdv)
    BAR_STORE = 4,    // + group: the warpgroup's dK/dV staging written (store_dkdv)
    BAR_K_SCALED = 6,  // the `_cap` kernels: K multiplied by the softcap's scale (prescale_k)
};

__device__ __forceinline__ float2 ld_shared_f2(uint32_t addr) {
    float2 v;
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(addr));
    return v;
}

template <class K> struct BwdWsSmem {
    uint32_t base;
    __device__ __forceinline__ uint32_t k() const { return base; }
    __device__ __forceinline__ uint32_t v() const { return base + K::KV_BYTES; }
    __device__ __forceinline__ uint32_t q(int st) const {
        return base + K::Q_OFFSET + 2 * st * K::Q_BYTES;
    }
    __device__ __forceinline__ uint32_t dout(int st) const { return q(st) + K::Q_BYTES; }
    __device__ __forceinline__ uint32_t ds(int parity) const {
        return base + K::DS_OFFSET + parity * K::DS_BYTES;
    }
    __device__ __forceinline__ uint32_t p(int parity) const {
        return base + K::P_OFFSET + parity * K::DS_BYTES;
    }
    __device__ __forceinline__ uint32_t dq() const { return base + K::DQ_OFFSET; }
    __device__ __forceinline__ uint32_t stats(int st) const {
        return base + K::STATS_OFFSET + st * K::STATS_BYTES;
    }
    // Barriers: K and V landed; per consumer warpgroup, its half of the dQ tile written (by
    // it) / read (by the dQ warp); per slot Q and its statistics landed, dO landed, slot
    // released by every consumer warp.
    __device__ __forceinline__ uint32_t full_kv() const { return base + K::BAR_OFFSET; }
    __device__ __forceinline__ uint32_t full_dq(int group) const {
        return full_kv() + 8 * (1 + group);
    }
    __device__ __forceinline__ uint32_t empty_dq(int group) const {
        return full_kv() + 8 * (1 + K::CONSUMERS + group);
    }
    // K::SPLIT has no dQ warp; in deterministic mode its order warp (bwd_ws_order_dq) uses
    // those barriers for the tile's turn: it came (arrived by the order warp), and every
    // consumer warp issued its adds.
    __device__ __forceinline__ uint32_t dq_turn() const { return full_dq(0); }
    __device__ __forceinline__ uint32_t dq_added() const { return empty_dq(0); }
    __device__ __forceinline__ uint32_t full_q(int st) const {
        return full_kv() + 8 * (1 + 2 * K::CONSUMERS + st);
    }
    __device__ __forceinline__ uint32_t full_do(int st) const { return full_q(K::STAGES + st); }
    __device__ __forceinline__ uint32_t empty(int st) const { return full_q(2 * K::STAGES + st); }
    __device__ __forceinline__ uint32_t info(int st) const {
        return base + K::INFO_OFFSET + 8 * st;
    }
};

// A query tile as the producer hands it over (K::TILES_FROM_PRODUCER): its query head,
// first row and whether it is the block's last.
struct TileInfo {
    int bidh, m0;
    bool last;
};
__device__ __forceinline__ void st_tile_info(uint32_t addr, TileInfo t) {
    asm volatile("st.shared.v2.b32 [%0], {%1, %2};\n" ::"r"(addr), "r"(t.m0),
                 "r"(t.bidh << 1 | int(t.last))
                 : "memory");
}
__device__ __forceinline__ TileInfo ld_tile_info(uint32_t addr) {
    int m0, x;
    asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(m0), "=r"(x) : "r"(addr) : "memory");
    return {x >> 1, m0, (x & 1) != 0};
}

// The block's key range and the query tiles that see it, walked the same way by the
// producer, the dQ warp and (without a block mask; with one the producer hands them the
// tiles: TileInfo) the consumers.
template <class K> struct BwdWsBlock {
    int n0, bidh_k, bidb;
    SeqInfo seq;
    Mask mask;
    QueryTiles<K::BM, K::BN> tiles;

    // The grid is (key blocks, KV heads, sequences), and the blocks start in the order of
    // their linear index: key block 0 (the heaviest under a causal mask, it sees every query)
    // first within each head, but for the last tail_heads pairs (longest_first_tail); in
    // deterministic mode the last key block first (launch_order).
    __device__ __forceinline__ explicit BwdWsBlock(const BwdTmaParams& P)
        : BwdWsBlock(P.b.a, launch_order(P.tail_heads, P.pair_group, P.deterministic)) {}

    __device__ __forceinline__ int key_block() const { return n0 / K::BN; }

    // Index of query tile (bidh, m0) in the tiled statistics and dq_accum.
    __device__ __forceinline__ int64_t tile_index(const BwdTmaParams& P, int bidh, int m0) const {
        return (int64_t(bidb) * P.b.a.h + bidh) * P.m_blocks + m0 / K::BM;
    }

  private:
    // Block i in (sequence, KV head, key block) order.
    __device__ __forceinline__ BwdWsBlock(const AttnParams& p, int i)
        : n0(i % gridDim.x * K::BN), bidh_k(i / gridDim.x % gridDim.y),
          bidb(i / gridDim.x / gridDim.y), seq(p, bidb),
          mask(p, seq, bidb, bidh_k * p.h_h_k_ratio, K::MODS),
          tiles(mask, p, n0, seq.seqlen_q, false) {}

    // The block's index in (sequence, KV head, key block) order after the longest-first tail;
    // in deterministic mode instead each pair's key blocks last to first, after
    // interleaved_pairs where pair_group > 1: block n waits for block n + 1 (dq_tile_state.cuh),
    // which must have started before it. (src/cuda/bwd_ws.rs runs this kernel only on grids
    // of fewer than 2^31 blocks.)
    static __device__ __forceinline__ int launch_order(int tail_heads, int pair_group,
                                                       int deterministic) {
        const int blocks = gridDim.x * gridDim.y * gridDim.z;
        const int i = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
        if (K::ordered(deterministic)) {
            const int j =
                pair_group > 1 ? interleaved_pairs(i, gridDim.x, gridDim.y * gridDim.z, pair_group)
                               : i;
            return j + gridDim.x - 1 - 2 * (j % gridDim.x);
        }
        return longest_first_tail(i, blocks, tail_heads, gridDim.x);
    }

    // Launch index i -> (pair, key block) index, pairs in groups of `group` taken key block by
    // key block across the group (the last group may be smaller). In deterministic mode the
    // blocks of a pair wait for each other at every tile (dq_tile_state.cuh); a wave of a few
    // pairs' blocks ends in chain order across its pairs, and the next pairs' blocks, started
    // in the same order, then start as far apart as their own chains need.
    static __device__ __forceinline__ int interleaved_pairs(int i, int per_pair, int pairs,
                                                            int group) {
        const int span = group * per_pair, g = i / span, r = i - g * span;
        const int size = min(group, pairs - g * group), n = r / size;
        return (g * group + r - n * size) * per_pair + n;
    }
};

// Every role walks the block's query tiles in the same order through this: `f(bidh, m0,
// tile)` per tile, with its query head, first row and index in the statistics and dq_accum.
// The walk starts at tile key_block() (mod the count) and wraps around: without a mask every
// key block of a head sees the same tiles, and walking them in step made all of them add
// their dQ to the same tile at once (d 64, seqlen 1k: 146 against 229 TFLOP/s for the
// atomics of sm90/bwd.cu). In deterministic mode block n adds into a tile after block n + 1
// (dq_tile_state.cuh), and each walks its rows from its first tile up, the group's heads
// within each row of tiles: block n + 1's range of tiles starts at or after block n's (both
// ends grow with the key block), so it reaches any tile they share at the same step of its
// walk as block n or earlier. Under a causal mask earlier (its range starts a row or two of
// tiles later), so block n finds its turn waiting. Ascending order walked from the last tile
// down made every causal block start at the same tile, and block k wait k turns there (d 256
// causal 0.77-0.89x of this order; H100, docs/archive/PERF.md, "Key blocks in descending
// order"). Staggered, block n would wait for the whole of block n + 1's walk. Under a block
// mask (`_sparse_det`) block n adds after the next key block above it that sees the tile, and
// both walk their kept tiles from the first, head by head.
template <class K, class F>
__device__ __forceinline__ void bwd_ws_walk(const BwdTmaParams& P, const BwdWsBlock<K>& blk,
                                            F&& f) {
    const int per_head = (blk.tiles.m0_end - blk.tiles.m0_begin) / K::BM;
    const int h0 = blk.bidh_k * P.b.a.h_h_k_ratio, total = blk.tiles.total;
    const bool ordered = K::ordered(P.deterministic);
    const int start = total > 0 && !ordered ? blk.key_block() % total : 0;
    if (!blk.mask.sparse) {
        // Tile j is (head, row) = (j / per_head, j % per_head), ordered (row, head) = (j /
        // ratio, j % ratio): one division either way.
        const int div = ordered ? P.b.a.h_h_k_ratio : per_head;
        int j = start;
#pragma unroll 1
        for (int i = 0; i < total; ++i) {
            const int q = j / div, r = j - q * div;
            const int head = ordered ? r : q;
            const int m0 = blk.tiles.m0_begin + (ordered ? q : r) * K::BM;
            f(h0 + head, m0, blk.tile_index(P, h0 + head, m0));
            if (++j == total) j = 0;
        }
        return;
    }
    // Under a block mask (the `_sparse` kernels: a compile-time branch) the kept tiles only,
    // jumping past the others (seek): from `start` to the end, then from 0 to `start`. A
    // (head, row) cursor, not the tile number, steps: per tile, a division by per_head
    // cost more than the tile's skip-table read. One call site of `f`, as the consumers' is
    // the whole tile's work.
    if (total == 0) return;
    bool wrapped = false;
    int head = start / per_head, m0 = blk.tiles.m0_begin + (start - head * per_head) * K::BM;
#pragma unroll 1
    while (true) {
        if (!blk.tiles.seek(blk.mask, head, m0)) {
            if (wrapped) break;
            wrapped = true;
            head = 0;
            m0 = blk.tiles.m0_begin;
            continue;
        }
        if (wrapped && head * per_head + (m0 - blk.tiles.m0_begin) / K::BM >= start) break;
        f(h0 + head, m0, blk.tile_index(P, h0 + head, m0));
        m0 += K::BM;
    }
}

template <class K>
__device__ __forceinline__ void bwd_ws_produce(const BwdTmaParams& P, const BwdWsSmem<K>& sm,
                                               const BwdWsBlock<K>& blk) {
    // Packed batches: a block's rows past its sequence's end read the next sequence's
    // (masked keys, query rows whose statistics the prep kernel set to +inf LSE: P = 0 there).
    const TmaSeq ts = tma_seq<K::PACKED>(blk.seq, blk.bidb);
    tma::arrive_expect_tx(sm.full_kv(), 2 * K::KV_BYTES);
    tma::load_tile<K::BN, K::D / 64>(sm.k(), P.k, sm.full_kv(), ts.k0 + blk.n0, blk.bidh_k,
                                     ts.batch);
    tma::load_tile<K::BN, K::D / 64>(sm.v(), P.v, sm.full_kv(), ts.k0 + blk.n0, blk.bidh_k,
                                     ts.batch);
    // Ring<K::STAGES>'s slot and phase, stepped fill by fill instead of divided out of a count
    // (the same values; as a Ring they compile to a different instruction order here).
    int slot = 0, phase = 0;
    const auto issue = [&](int bidh, int m0, int64_t tile, bool last) {
        tma::wait(sm.empty(slot), phase ^ 1);
        if constexpr (K::TILES_FROM_PRODUCER) st_tile_info(sm.info(slot), {bidh, m0, last});
        tma::arrive_expect_tx(sm.full_q(slot), K::Q_BYTES + K::STATS_BYTES);
        tma::load_tile<K::BM, K::D / 64>(sm.q(slot), P.q, sm.full_q(slot), ts.q0 + m0, bidh,
                                         ts.batch);
        tma::load_bulk(sm.stats(slot), P.stats + tile * 2 * K::BM, K::STATS_BYTES,
                       sm.full_q(slot));
        tma::arrive_expect_tx(sm.full_do(slot), K::Q_BYTES);
        tma::load_tile<K::BM, K::D / 64>(sm.dout(slot), P.dout, sm.full_do(slot), ts.q0 + m0,
                                         bidh, ts.batch);
        if (++slot == K::STAGES) {
            slot = 0;
            phase ^= 1;
        }
    };
    if constexpr (!K::TILES_FROM_PRODUCER) {
        bwd_ws_walk<K>(P, blk, [&](int bidh, int m0, int64_t tile) { issue(bidh, m0, tile, false); });
        return;
    }
    // One tile behind the walk, to tell the consumers which is the last (there is one: the
    // kernel calls this only if any query sees the keys).
    int pending_bidh = -1, pending_m0 = 0;
    int64_t pending_tile = 0;
    bwd_ws_walk<K>(P, blk, [&](int bidh, int m0, int64_t tile) {
        if (pending_bidh >= 0) issue(pending_bidh, pending_m0, pending_tile, false);
        pending_bidh = bidh;
        pending_m0 = m0;
        pending_tile = tile;
    });
    issue(pending_bidh, pending_m0, pending_tile, true);
}

// Deterministic mode: key block n adds into a query tile after the next key block above it
// that sees the tile, or first where none does. Without a block mask that is block n + 1
// where its range of tiles (QueryTiles') holds the tile (none past the sequence's last key
// block). The state word reads m + 1 once block m added; block n then writes n + 1.
template <class K> struct DqOrder {
    static constexpr bool SPARSE = (K::MODS & MODS_BLOCKS) != 0;
    int n, pred_begin = 0, pred_end = 0;
    __device__ __forceinline__ DqOrder(const BwdWsBlock<K>& blk, bool ordered)
        : n(blk.key_block()) {
        if (!SPARSE && ordered && blk.n0 + K::BN < blk.seq.seqlen_k)
            blk.mask.template query_blocks<K::BM, K::BN>(blk.n0 + K::BN, blk.seq.seqlen_q,
                                                         &pred_begin, &pred_end);
    }
    // The state word's value once the key block before this one on query tile (bidh, m0) has
    // added, or -1 where this block is the first.
    __device__ __forceinline__ int turn(const BwdTmaParams& P, const BwdWsBlock<K>& blk,
                                        int bidh, int m0) const {
        if constexpr (SPARSE) return sparse_turn(P, blk, bidh, m0);
        return m0 / K::BM < pred_begin || m0 / K::BM >= pred_end ? -1 : n + 2;
    }
    __device__ __forceinline__ void wait(const int* state, int turn) const {
        dq_tile_wait_turn(state, turn);
    }
    __device__ __forceinline__ void pass(int* state) const { dq_tile_pass_turn(state, n); }

  private:
    // Under a block mask the key blocks that see a tile need not be consecutive. The one
    // before block n is the first above it with a block present in the tile's rows (one
    // block_next_col read per block row), if the causal or window range lets it see the
    // tile: blocks further up see it only where that one does (both ends of the range grow
    // with the key block). The same tests as the walk's (next_present_tile, QueryTiles), so
    // that block m does visit the tile.
    __device__ __forceinline__ int sparse_turn(const BwdTmaParams& P, const BwdWsBlock<K>& blk,
                                               int bidh, int m0) const {
        const AttnParams& p = P.b.a;
        const int n1 = blk.n0 + K::BN, q_last = min(m0 + K::BM, blk.seq.seqlen_q) - 1;
        if (n1 >= blk.seq.seqlen_k) return -1;
        const unsigned int* next =
            P.block_next_col + bidh * p.block_head_stride + p.block_k_div(n1);
        int c = p.block_cols;
        for (int r = p.block_q_div(m0); r <= p.block_q_div(q_last); ++r)
            c = min(c, int(next[r * p.block_cols]));
        if (c >= p.block_cols) return -1;
        const int m = max(n + 1, c * p.block_k / K::BN);
        int begin, end;
        blk.mask.template query_blocks<K::BM, K::BN>(m * K::BN, blk.seq.seqlen_q, &begin, &end);
        return m0 / K::BM >= begin && m0 / K::BM < end ? m + 1 : -1;
    }
};

// Adds each query tile's dQ to its tile of dq_accum, each consumer warpgroup's half as soon
// as that warpgroup wrote it; the first block to reach a tile stores instead
// (dq_tile_state.cuh). In deterministic mode the first is the last key block that sees the
// tile, and the others add in descending key-block order.
template <class K>
__device__ __forceinline__ void bwd_ws_add_dq(const BwdTmaParams& P, const BwdWsSmem<K>& sm,
                                              const BwdWsBlock<K>& blk) {
    constexpr int HALF = K::DQ_BYTES / K::CONSUMERS;
    const bool ordered = K::ordered(P.deterministic);
    const DqOrder<K> order(blk, ordered);
    int phase = 0;
    bwd_ws_walk<K>(P, blk, [&](int bidh, int m0, int64_t tile) {
        float* dst = P.b.dq_accum + tile * K::BM * K::D;
        int* state = P.dq_state + tile;
        // Claimed (or, ordered, waited for) once this block has something to write, so that a
        // block that waits for another never waits for this one's matmuls.
        tma::wait(sm.full_dq(0), phase);
        bool first;
        if (ordered) {
            const int turn = order.turn(P, blk, bidh, m0);
            first = turn < 0;
            if (!first) order.wait(state, turn);
        } else {
            first = dq_tile_claim(state);
            if (!first) dq_tile_wait_written(state);
        }
#pragma unroll
        for (int group = 0; group < K::CONSUMERS; ++group) {
            if (group > 0) tma::wait(sm.full_dq(group), phase);  // half 0: waited for above
            if (first)
                tma::store_bulk(dst + group * HALF / 4, sm.dq() + group * HALF, HALF);
            else
                tma::reduce_add_bulk(dst + group * HALF / 4, sm.dq() + group * HALF, HALF);
            tma::bulk_commit();
        }
        phase ^= 1;
#pragma unroll
        for (int group = 0; group < K::CONSUMERS; ++group) {
            // Half `group` was committed CONSUMERS - 1 - group groups before the last.
            if (group == 0) tma::bulk_wait_read<K::CONSUMERS - 1>(); else tma::bulk_wait_read<0>();
            tma::arrive(sm.empty_dq(group));
        }
        if (ordered) {
            tma::bulk_wait_all();
            order.pass(state);
        } else if (first) {
            tma::bulk_wait_all();
            dq_tile_publish(state);
        }
    });
    tma::bulk_wait_all();
}

// K::SPLIT in deterministic mode, one warp: the consumers add their dQ halves from registers
// (BwdWsSplitConsumer), so this warp takes each tile's turn for them (dq_turn) before they
// need it, and passes it on once every consumer warp issued its adds (dq_added). The pass's
// release follows their adds through the mbarrier's arrive (release) and wait (acquire), so
// the next key block's adds come after them; fencing and polling stay off the consumers.
template <class K>
__device__ __forceinline__ void bwd_ws_order_dq(const BwdTmaParams& P, const BwdWsSmem<K>& sm,
                                                const BwdWsBlock<K>& blk) {
    static_assert(K::TILES_FROM_PRODUCER, "the tiles in the consumers' order");
    const DqOrder<K> order(blk, true);
#pragma unroll 1
    for (int it = 0, last = false; !last; ++it) {
        // The slot is not reused before this tile's turn: the consumers release it after.
        tma::wait(sm.full_q(it % K::STAGES), (it / K::STAGES) & 1);
        const TileInfo t = ld_tile_info(sm.info(it % K::STAGES));
        int* state = P.dq_state + blk.tile_index(P, t.bidh, t.m0);
        const int turn = order.turn(P, blk, t.bidh, t.m0);
        if (turn >= 0) order.wait(state, turn);
        tma::arrive(sm.dq_turn());
        tma::wait(sm.dq_added(), it & 1);
        order.pass(state);
        last = t.last;
    }
}

// How P^T comes from S^T: exp2 only (PROBS_PLAIN); under a softcap S^T holds the tanh t of
// each score and becomes P^T (1 - t^2) for dS^T (PROBS_CAPPED), with ALiBi's bias added back
// to t first (PROBS_CAPPED_ALIBI). A template argument, so that the bias's per-score column
// arithmetic (Mask::capped: 6-7 integer and float instructions, if-converted onto every
// score) is compiled only where there is a bias: with the run-time test inside the loop, the
// d 128 `_mods` kernel executed 2.1x the plain kernel's instructions (docs/archive/PERF.md,
// "The softcap backward's per-score instructions").
// PROBS_PRESCALED is the `_cap` kernels' PROBS_CAPPED: t is finite at masked entries
// (CAP_MASKED_T), so P^T (1 - t^2) needs no clamp.
enum ProbsMode { PROBS_PLAIN, PROBS_CAPPED, PROBS_CAPPED_ALIBI, PROBS_PRESCALED };

__device__ __forceinline__ ProbsMode probs_mode(const Mask& mask) {
    if (mask.softcap_pre == 0.f) return PROBS_PLAIN;
    return mask.slopes != nullptr ? PROBS_CAPPED_ALIBI : PROBS_CAPPED;
}

// Dropout's keep bits of a consumer's S^T fragment (Dropout::keep_fragment with keys as rows)
// and 1 / (1 - p). Both of P's uses in the backward see the forward's dropped and scaled
// entries: dV += (P o Z / (1 - p))^T dO, and dS = P o (dP o Z / (1 - p) - rowsum(dO O))
// (FlashAttention-2 Algorithm 2 with dropout). Where a kernel has no dropout (DROP = false),
// nothing of it is compiled.
struct DropBits {
    uint32_t keep[2];
    float rp_keep;
    __device__ __forceinline__ float apply(float x, int r, int nt, int e) const {
        return Dropout::scaled(keep, r, nt, e, x, rp_keep);
    }
    // The keep bits of the fragment of 16 keys from row0 and NQ n8 tiles of queries from col0,
    // for query head bidh of sequence bidb, UNROLL Philox calls in flight together.
    template <int NQ, int UNROLL>
    static __device__ __forceinline__ DropBits draw(const AttnParams& p, int bidb, int bidh,
                                                    int row0, int col0, int lane) {
        DropBits d;
        Dropout(p, bidb, bidh).template keep_fragment<NQ, true, UNROLL>(d.keep, row0, col0, lane);
        d.rp_keep = p.rp_keep;
        return d;
    }
};

// P^T for the k16 step kk of dV (S^T's n8 tiles 2 kk and 2 kk + 1, keys as rows from row0,
// queries as columns from col0) from this thread's query columns' LSE, into A fragment
// a_p[0][kk]; S^T becomes P^T, or under a softcap P^T (1 - t^2), one pair at a time, so
// that no second array of t is live. Rows that saw no key have LSE +inf: P = 0.
// With DROP, the A fragment holds the dropped and scaled P^T (DropBits), S^T the whole one.
template <ProbsMode MODE, typename T, int NQ, bool DROP = false>
__device__ __forceinline__ void probs_step(float (&s)[1][NQ][4], uint32_t (&a_p)[1][NQ / 2][4],
                                           int kk, const float2 (&lse)[NQ], const Mask& mask,
                                           int row0, int col0, int lane, float scale_log2,
                                           const DropBits& drop = {}) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int nt = 2 * kk; nt < 2 * kk + 2; ++nt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float prob[2];
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                float& x = s[0][nt][2 * half + c];
                const float tc = MODE == PROBS_CAPPED_ALIBI
                                     ? mask.template capped<true>(x, row0 + g + 8 * half,
                                                                  col0 + nt * 8 + 2 * t + c)
                                     : x;
                prob[c] = exp2f(fmaf(x, scale_log2, -(c ? lse[nt].y : lse[nt].x)));
                x = MODE == PROBS_PLAIN       ? prob[c]
                    : MODE == PROBS_PRESCALED ? prob[c] * fmaf(-tc, tc, 1.f)
                                              : cap_grad_times(prob[c], tc);
                if (DROP) prob[c] = drop.apply(prob[c], half, nt, c);
            }
            a_p[0][kk][(nt % 2) * 2 + half] = MmaOp<T>::pack(prob[0], prob[1]);
        }
}

// P^T (Algorithm 2, line 13) for every k16 step, into A fragments (probs_step).
template <typename T, int NQ, bool DROP = false>
__device__ __forceinline__ void probs_t(float (&s)[1][NQ][4], uint32_t (&a_p)[1][NQ / 2][4],
                                        const float2 (&lse)[NQ], const Mask& mask, int row0,
                                        int col0, int lane, float scale_log2,
                                        const DropBits& drop = {}) {
    const auto all = [&](auto mode) {
#pragma unroll
        for (int kk = 0; kk < NQ / 2; ++kk)
            probs_step<decltype(mode)::value, T, NQ, DROP>(s, a_p, kk, lse, mask, row0, col0,
                                                           lane, scale_log2, drop);
    };
    switch (probs_mode(mask)) {
    case PROBS_PLAIN: all(std::integral_constant<ProbsMode, PROBS_PLAIN>()); break;
    case PROBS_CAPPED: all(std::integral_constant<ProbsMode, PROBS_CAPPED>()); break;
    default: all(std::integral_constant<ProbsMode, PROBS_CAPPED_ALIBI>()); break;
    }
}

// dS^T = P^T o (dP^T - rowsum(dO O)) (line 19) in dpt, and as A fragments; with DROP, dP^T's
// entries dropped and scaled first (DropBits).
template <typename T, int NQ, bool DROP = false>
__device__ __forceinline__ void grads_t(float (&dpt)[1][NQ][4], const float (&s)[1][NQ][4],
                                        const float2 (&dsum)[NQ], uint32_t (&a_ds)[1][NQ / 2][4],
                                        const DropBits& drop = {}) {
#pragma unroll
    for (int nt = 0; nt < NQ; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float dp = DROP ? drop.apply(dpt[0][nt][e], e / 2, nt, e % 2) : dpt[0][nt][e];
            dpt[0][nt][e] = s[0][nt][e] * (dp - (e % 2 ? dsum[nt].y : dsum[nt].x));
        }
    pack_a<T, 1, NQ>(dpt, a_ds);
}

// Packed batches, a warpgroup's 64 keys from key0 crossing the sequence's end: its staged dK
// and dV rows before the end (chunks of 8 columns from col0, DT of them, within the head dim,
// a multiple of 8 wherever dK has a tensor map) to global memory, 16 bytes a thread.
template <class K, int DT>
__device__ __forceinline__ void copy_dkdv(const BwdTmaParams& P, const BwdWsSmem<K>& sm,
                                          const BwdWsBlock<K>& blk, int key0, int col0,
                                          int tid) {
    using T = typename K::T;
    const BwdParams& b = P.b;
    const int64_t base = blk.seq.k_offset(b.dk_batch_stride, b.dk_row_stride, b.dk_head_stride,
                                          blk.bidb, blk.bidh_k);
    const int rows = min(64, blk.seq.seqlen_k - blk.n0 - key0);
    const int valid = min(DT, b.a.d / 8 - col0 / 8);
    const int64_t at = base + int64_t(blk.n0 + key0) * b.dk_row_stride + col0;
    sm90::copy_panel_rows<T, K::BN, DT>(sm.k(), key0, col0 / 8, rows, valid,
                                        static_cast<T*>(b.dk) + at, b.dk_row_stride, tid, 128);
    sm90::copy_panel_rows<T, K::BN, DT>(sm.v(), key0, col0 / 8, rows, valid,
                                        static_cast<T*>(b.dv) + at, b.dk_row_stride, tid, 128);
}

// dK (with the softmax scale of S = scale Q K^T, applied once here) and dV of a warpgroup's
// fragments (keys from key0 of the block, head-dim columns from col0) out through the K and V
// tiles' shared memory, which no matmul reads once both consumer warpgroups are past their
// last query tile: stmatrix into the tiles' own panel layout, then one TMA store per 64-column
// panel of each, issued by the warpgroup's first thread (TMA clips rows past seqlen_k and
// columns past the head dim). From registers, 4-byte stores over 8 rows per warp instruction,
// the stores cost 11-16% of the backward at 512-1k (docs/archive/PERF.md, "The backward's dK
// and dV through shared memory").
template <class K, int DT>
__device__ __forceinline__ void store_dkdv(const BwdTmaParams& P, const BwdWsSmem<K>& sm,
                                           const BwdWsBlock<K>& blk, const float (&dk)[DT][4],
                                           const float (&dv)[DT][4], int key0, int col0,
                                           int group, int tid, int lane) {
    using T = typename K::T;
    const float scale = P.b.a.grad_scale;
    tma::named_sync(BAR_KV_FREE, 128 * K::CONSUMERS);
    const int row0 = key0 + tid / 32 * 16;
    sm90::stage_fragments<T, K::BN, DT>(sm.k(), dk, row0, col0 / 8, scale, scale, lane);
    sm90::stage_fragments<T, K::BN, DT>(sm.v(), dv, row0, col0 / 8, 1.f, 1.f, lane);
    sm90::fence_proxy_async();
    tma::named_sync(BAR_STORE + group, 128);
    // Packed batches: rows crossing the sequence's end would be written into the next
    // sequence's by TMA; copied from the panels instead.
    if (K::PACKED && blk.n0 + key0 + 64 > blk.seq.seqlen_k) {
        copy_dkdv<K, DT>(P, sm, blk, key0, col0, tid);
        return;
    }
    if (tid == 0) {
        // This warpgroup's DT / 8 panels: from panel col0 / 64, rows from key0.
        const uint32_t off = col0 / 64 * K::BN * 128 + key0 * 128;
        const TmaSeq ts = tma_seq<K::PACKED>(blk.seq, blk.bidb);
        const int row = ts.k0 + blk.n0 + key0;
        tma::store_tile<K::BN, DT / 8>(P.dk, sm.k() + off, col0, row, blk.bidh_k, ts.batch);
        tma::store_tile<K::BN, DT / 8>(P.dv, sm.v() + off, col0, row, blk.bidh_k, ts.batch);
        tma::bulk_commit();
        tma::bulk_wait_all();  // the block's shared memory outlives the copies
    }
}

// One consumer warpgroup: keys n0 + 64 group .. + 63, their dK and dV in registers.
template <class K> struct BwdWsConsumer {
    using T = typename K::T;
    static constexpr int D = K::D, BM = K::BM, BN = K::BN, NQ = K::NQ, DT = K::DT;
    static constexpr int DQ_N = K::DQ_N;

    const AttnParams& p;
    const BwdWsSmem<K> sm;
    const int group, tid, lane;  // tid: thread within the warpgroup
    float dk[DT][4], dv[DT][4];
    // dS^T as A fragments: the operand of dK += dS^T Q, which with K::PIPE_SDP is still in
    // flight after tile() returns (retire keeps it live until the wait).
    uint32_t a_ds[1][NQ / 2][4];

    // acc = A B^T over the head dim, A (BN keys) and B (BM queries) K-major in shared memory:
    // one commit group.
    __device__ __forceinline__ void issue_ss(float (&acc)[1][NQ][4], uint32_t a,
                                             uint32_t b) const {
#pragma unroll
        for (int kk = 0; kk < K::DA / 16; ++kk)
            sm90::Wgmma<T, BM>::ss(acc[0], sm90::kmajor_desc(a, BN, kk),
                                   sm90::kmajor_desc(b, BM, kk), kk > 0);
        sm90::commit();
    }

    // S^T = K Q^T (line 11) once Q has landed, then `between` (while S^T runs), then dP^T =
    // V dO^T (line 17) once dO has: two commit groups.
    template <typename F>
    __device__ __forceinline__ void issue_sdp(float (&s)[1][NQ][4], float (&dpt)[1][NQ][4], int it,
                                              F&& between) const {
        const Ring<K::STAGES> fill(it);
        const int slot = fill.st, phase = fill.phase;
        tma::wait(sm.full_q(slot), phase);
        sm90::fence();
        issue_ss(s, sm.k() + group * 64 * 128, sm.q(slot));
        between();
        tma::wait(sm.full_do(slot), phase);
        sm90::fence();
        issue_ss(dpt, sm.v() + group * 64 * 128, sm.dout(slot));
    }

    // This warp's reads of ring slot `slot` are done: every lane's, not just lane 0's
    // (without the __syncwarp racecheck saw the next tile's statistics copy race this one's
    // loads).
    __device__ __forceinline__ void release(int slot) const {
        __syncwarp();
        if (lane == 0) tma::arrive(sm.empty(slot));
    }

    // K::PIPE_SDP: dK of query tile `done` (-1: none yet) waited for and its slot released,
    // the GROUPS commit groups issued after it left in flight. The wait is unconditional
    // (before the first tile it returns at once): ptxas must see a wait on every path from a
    // dK wgmma to the next use of dk, or it serializes the wgmmas (C7514).
    template <int GROUPS> __device__ __forceinline__ void retire(int done) {
        static_assert(K::PIPE_SDP, "only the pipelined consumer leaves dK in flight");
        sm90::wait<GROUPS>();
        sm90::fence_operand(dk);
#pragma unroll
        for (int kk = 0; kk < NQ / 2; ++kk)
#pragma unroll
            for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a_ds[0][kk][e])::"memory");
        if (done >= 0) release(done % K::STAGES);
    }

    // Query tile `it` of the block (head bidh, rows m0..), from its ring slot. The matmuls are queued
    // so that the tensor cores have the next one while this warpgroup computes: dP^T under
    // the softmax, dV under dS^T, dK under dQ's trip through shared memory, and with
    // K::PIPE_SDP the next tile's S^T and dP^T behind dK.
    __device__ __forceinline__ void tile(const BwdWsBlock<K>& blk, int it, int bidh, int m0) {
        const int slot = it % K::STAGES;
        const int t = lane % 4, wrow = tid / 32 * 16;
        const uint32_t sQ = sm.q(slot), sdO = sm.dout(slot), sdS = sm.ds(it & 1);
        const uint32_t sLse = sm.stats(slot), sDsum = sLse + BM * 4;

        // Under a block mask, the mask of this tile is found before S^T is issued (with S^T
        // live, the block mask's part spilled more); the other kernels find it after (found
        // before, d = 128 spilled 12 bytes).
        const Mask head_mask = blk.mask.with_head(bidh);
        const int row0 = blk.n0 + group * 64 + wrow;
        constexpr bool EARLY = (K::MODS & MODS_BLOCKS) != 0;
        bool masked = false;
        uint64_t bits[1][2];
        if constexpr (EARLY) {
            masked = head_mask.template block_needs_mask<BN>(m0, m0 + BM - 1, blk.n0);
            if (head_mask.sparse && masked)
                head_mask.template sparse_bits<1, NQ, true>(bits, row0, m0, lane);
        }

        // S^T and dP^T; this thread's query columns' LSE while S^T runs, or with
        // K::PIPE_SDP once the last tile's dK (queued before this S^T) is done.
        float s[1][NQ][4], dpt[1][NQ][4];
        float2 lse[NQ];
        const auto load_lse = [&] {
#pragma unroll
            for (int nt = 0; nt < NQ; ++nt) lse[nt] = ld_shared_f2(sLse + (nt * 8 + 2 * t) * 4);
        };
        // Dropout's keep bits while S^T runs (and dP^T: with both in flight the d = 128
        // kernel spilled 12 bytes).
        DropBits drop;
        const auto draw = [&] {
            if constexpr (K::DROPOUT)
                drop = DropBits::draw<NQ, K::DROP_UNROLL>(p, blk.bidb, bidh, row0, m0, lane);
        };
        if constexpr (K::PIPE_SDP) {
            issue_sdp(s, dpt, it, [] {});
            retire<2>(it - 1);
            load_lse();
            draw();
        } else {
            issue_sdp(s, dpt, it, [&] {
                load_lse();
                draw();
            });
        }
        sm90::wait<1>();
        sm90::fence_operand(s[0]);

        // P^T (line 13). Rows that saw no key, and rows past the sequence, have LSE +inf
        // here: P = 0.
        if constexpr (EARLY)
            head_mask.template apply<1, NQ, true>(s, row0, m0, lane, masked, 1, bits);
        else
            head_mask.template apply<1, NQ, true, (K::MODS & MODS_CAP) != 0>(
                s, row0, m0, lane, head_mask.template block_needs_mask<BN>(m0, m0 + BM - 1, blk.n0));
        // P^T (line 13) and dV += P^T dO (line 16), which runs while dS^T is computed. The
        // plain kernels issue dV a k16 step at a time, as soon as that step's P^T is packed,
        // so that the tensor cores start it while the rest of P^T is computed (d 64 2.5-3.5%
        // faster, d 128 1-2.5%), and so do the `_cap` kernels (d 64 and 128, a softcap
        // alone), which compile those capped steps and nothing else: no serialized wgmma (at
        // d 128 8 bytes of spill, two words reloaded per tile, since prescale_k and the
        // unclamped P^T (1 - t^2)); 1.7-2% faster than `_mods` at d 128, 3-6% at d 64 (H100,
        // H200; docs/archive/PERF.md, "`_cap` backward kernels: a softcap without ALiBi on
        // its own code"), and another 3.4% at d 128 (1.5% at d 64) for the scale in K ("Kept:
        // two instructions fewer per score in the `_cap` backward"). In the d 128 `_mods`
        // kernel any such path, even one its case did not take, made ptxas serialize the
        // wgmmas (C7512: too few registers; 12-21% slower), and the d 64 `_sparse` kernel
        // spilled 80 bytes instead of 36 ("dV steps in the `_mods` kernels, once more"): the
        // `_mods` and `_sparse` kernels keep one probs_t pass and the wgmmas after it. The
        // tanh taken in the steps as well (raw scores masked to -inf, each step's tanh
        // arguments tied to the previous step's A fragment so that ptxas kept them after its
        // dV wgmma) ran level with the `_cap` kernels' (the same `_cap` section).
        uint32_t a_p[1][NQ / 2][4];
        sm90::fence_operand(dv);
        if constexpr (K::MODS == MODS_NONE) {
            probs_dv<PROBS_PLAIN>(s, a_p, lse, head_mask, row0, m0, sdO, drop);
        } else if constexpr ((K::MODS & MODS_CAP) != 0) {
            probs_dv<PROBS_PRESCALED>(s, a_p, lse, head_mask, row0, m0, sdO);
        } else {
            probs_t<T, NQ>(s, a_p, lse, head_mask, row0, m0, lane, p.scale_log2);
            sm90::fence();
#pragma unroll
            for (int kk = 0; kk < BM / 16; ++kk) issue_dv(a_p, kk, sdO);
        }
        sm90::commit();
        sm90::wait<1>();  // dP^T
        sm90::fence_operand(dpt[0]);
        // Loaded only now: with P^T and dP^T live, 16 more registers spilled at d = 128.
        float2 dsum[NQ];
#pragma unroll
        for (int nt = 0; nt < NQ; ++nt) dsum[nt] = ld_shared_f2(sDsum + (nt * 8 + 2 * t) * 4);

        // dS^T (line 19), into the key-major panel tile for dQ.
        grads_t<T, NQ, K::DROPOUT>(dpt, s, dsum, a_ds, drop);
        sm90::store_key_major<BN, NQ>(sdS, a_ds, group * 64, 0, tid, lane);
        sm90::fence_proxy_async();
        tma::named_sync(BAR_TILE_A, 128 * K::CONSUMERS);  // both halves of dS^T are written

        // dQ[:, group's columns] = dS K (line 20), then dK += dS^T Q (line 21). This
        // warpgroup's dQ columns [group DQ_N, +DQ_N): whole panels at D = 128, half a panel
        // (64 bytes into each swizzled row) at D = 64.
        const uint32_t sK_dq =
            sm.k() + (DQ_N % 64 == 0 ? group * (DQ_N / 64) * BN * 128 : group * DQ_N * 2);
        float dq[DQ_N / 8][4];
        sm90::fence_operand(dk);
        sm90::fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            sm90::Wgmma<T, DQ_N>::ss_mn(dq, sm90::mnmajor_desc(sdS, BN, kk),
                                       sm90::mnmajor_desc(sK_dq, BN, kk), kk > 0);
        sm90::commit();
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk)
            sm90::Wgmma<T, K::DA>::rs(sm90::acc_cols<K::DA>(dk), a_ds[0][kk],
                                      sm90::mnmajor_desc(sQ, BM, kk), 1);
        sm90::commit();
        sm90::wait<1>();  // dV and dQ
        sm90::fence_operand(dq);
        sm90::fence_operand(dv);

        // This warpgroup's half of the dQ tile for the dQ warp, once it has read the last
        // one: float4 i of thread tid at float4 (group DQ_N / 8 + i) x 128 + tid (a warp's
        // stores are 512 consecutive bytes).
        tma::wait(sm.empty_dq(group), (it & 1) ^ 1);
#pragma unroll
        for (int i = 0; i < DQ_N / 8; ++i) {
            const uint32_t addr = sm.dq() + ((group * (DQ_N / 8) + i) * 128 + tid) * 16;
            asm volatile("st.shared.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
                         "f"(dq[i][0]), "f"(dq[i][1]), "f"(dq[i][2]), "f"(dq[i][3]));
        }
        sm90::fence_proxy_async();
        tma::arrive(sm.full_dq(group));
        if constexpr (K::PIPE_SDP) return;  // dK stays in flight (retire)
        sm90::wait<0>();  // dK
        sm90::fence_operand(dk);
        release(slot);
    }

    // P^T one k16 step at a time, each step's dV wgmma issued as soon as its A fragment is
    // packed.
    template <ProbsMode MODE>
    __device__ __forceinline__ void probs_dv(float (&s)[1][NQ][4], uint32_t (&a_p)[1][NQ / 2][4],
                                             const float2 (&lse)[NQ], const Mask& mask, int row0,
                                             int col0, uint32_t sdO, const DropBits& drop = {}) {
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) {
            probs_step<MODE, T, NQ, K::DROPOUT>(s, a_p, kk, lse, mask, row0, col0, lane,
                                                p.scale_log2, drop);
            sm90::fence();
            issue_dv(a_p, kk, sdO);
        }
    }

    // dV += P^T dO for the k16 step kk (line 16).
    __device__ __forceinline__ void issue_dv(const uint32_t (&a_p)[1][NQ / 2][4], int kk,
                                             uint32_t sdO) {
        // DA < D: dV's columns from DA on stay zero (as dK's).
        sm90::Wgmma<T, K::DA>::rs(sm90::acc_cols<K::DA>(dv), a_p[0][kk],
                                  sm90::mnmajor_desc(sdO, BM, kk), 1);
    }

    // The `_cap` kernels: the block's K tile times the softcap's scale, in place (both
    // warpgroups, 16 bytes a thread at a time, each element rounded once from its f32
    // product), so that S^T arrives as the tanh's argument and no score needs the multiply.
    // dQ = dS K then carries the scale too, which the convert kernel divides out
    // (src/cuda/bwd_ws.rs); dK = dS^T Q does not read K.
    __device__ __forceinline__ void prescale_k() const {
        constexpr int CHUNKS = K::KV_BYTES / 16, PER = CHUNKS / (128 * K::CONSUMERS);
        const int i0 = group * 128 + tid;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            const uint32_t addr = sm.k() + (i0 + i * 128 * K::CONSUMERS) * 16;
            uint32_t w[4];
            asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                         : "r"(addr));
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float2 x = MmaOp<T>::unpack(w[j]);
                w[j] = MmaOp<T>::pack(x.x * p.softcap_pre, x.y * p.softcap_pre);
            }
            asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(w[0]),
                         "r"(w[1]), "r"(w[2]), "r"(w[3])
                         : "memory");
        }
        sm90::fence_proxy_async();  // read next by wgmma
        tma::named_sync(BAR_K_SCALED, 128 * K::CONSUMERS);
    }

    // dK and dV of this warpgroup's 64 keys.
    __device__ __forceinline__ void store(const BwdTmaParams& P, const BwdWsBlock<K>& blk) const {
        store_dkdv<K, DT>(P, sm, blk, dk, dv, group * 64, 0, group, tid, lane);
    }
};

// d = 256 (K::SPLIT): both consumer warpgroups see all 64 keys of the block; each owns half
// of the head dim's columns of dK, dV and dQ (128 registers for dK and dV) and half of the
// tile's 64 query rows (32) for S^T and dP^T, so that each computes P^T and dS^T in f32 for
// its rows as the other kernels do. The halves meet in shared memory (P^T and dS^T, key-major),
// from which both warpgroups' dV, dK and dQ matmuls read them. dQ goes from the registers to
// dq_accum by red.global.add (there is no room for the f32 tile), in the fragment order of
// the other kernels, so that the convert kernel is the same.
template <class K> struct BwdWsSplitConsumer {
    using T = typename K::T;
    static constexpr int D = K::D, BM = K::BM, BN = K::BN, NQ = K::NQ, DT = K::DT;
    static constexpr int DQ_N = K::DQ_N;

    const AttnParams& p;
    const BwdWsSmem<K> sm;
    const int group, tid, lane;
    float dk[DT][4], dv[DT][4];

    __device__ __forceinline__ void tile(const BwdTmaParams& P, const BwdWsBlock<K>& blk, int it,
                                         int bidh, int m0, int64_t tile_index) {
        const Ring<K::STAGES> fill(it);
        const int slot = fill.st, phase = fill.phase;
        const int t = lane % 4, wrow = tid / 32 * 16;
        const uint32_t sQ = sm.q(slot), sdO = sm.dout(slot);
        const uint32_t sdS = sm.ds(it & 1), sP = sm.p(it & 1);
        const int c0 = group * 32;  // this warpgroup's first query column of the tile
        const uint32_t sLse = sm.stats(slot) + c0 * 4, sDsum = sLse + BM * 4;
        // This warpgroup's columns: panels 2 group, 2 group + 1 of Q, dO and K.
        const uint32_t sQ_mine = sQ + 2 * group * BM * 128, sdO_mine = sdO + 2 * group * BM * 128;
        const uint32_t sK_mine = sm.k() + 2 * group * BN * 128;

        const Mask head_mask = blk.mask.with_head(bidh);
        const int row0 = blk.n0 + wrow;
        constexpr bool EARLY = (K::MODS & MODS_BLOCKS) != 0;
        const bool masked =
            head_mask.template block_needs_mask<BN>(m0 + c0, m0 + c0 + 31, blk.n0);
        uint64_t bits[1][2];
        if constexpr (EARLY)
            if (head_mask.sparse && masked)
                head_mask.template sparse_bits<1, NQ, true>(bits, row0, m0 + c0, lane);

        // S^T = K Q^T and dP^T = V dO^T for this warpgroup's 32 query rows.
        float s[1][NQ][4], dpt[1][NQ][4];
        tma::wait(sm.full_q(slot), phase);
        sm90::fence();
#pragma unroll
        for (int kk = 0; kk < K::DA / 16; ++kk)
            sm90::Wgmma<T, BM / 2>::ss(s[0], sm90::kmajor_desc(sm.k(), BN, kk),
                                       sm90::kmajor_desc(sQ + c0 * 128, BM, kk), kk > 0);
        sm90::commit();
        float2 lse[NQ];
#pragma unroll
        for (int nt = 0; nt < NQ; ++nt) lse[nt] = ld_shared_f2(sLse + (nt * 8 + 2 * t) * 4);
        tma::wait(sm.full_do(slot), phase);
        sm90::fence();
#pragma unroll
        for (int kk = 0; kk < K::DA / 16; ++kk)
            sm90::Wgmma<T, BM / 2>::ss(dpt[0], sm90::kmajor_desc(sm.v(), BN, kk),
                                       sm90::kmajor_desc(sdO + c0 * 128, BM, kk), kk > 0);
        sm90::commit();
        DropBits drop;  // dropout's keep bits while S^T and dP^T run
        if constexpr (K::DROPOUT)
            drop = DropBits::draw<NQ, K::DROP_UNROLL>(p, blk.bidb, bidh, row0, m0 + c0, lane);
        sm90::wait<1>();
        sm90::fence_operand(s[0]);

        // P^T; with a softcap, s becomes P (1 - t^2) for dS (see BwdWsConsumer).
        head_mask.template apply<1, NQ, true>(s, row0, m0 + c0, lane, masked, 1,
                                              EARLY ? bits : nullptr);
        uint32_t a_p[1][NQ / 2][4];
        probs_t<T, NQ, K::DROPOUT>(s, a_p, lse, head_mask, row0, m0 + c0, lane, p.scale_log2,
                                   drop);
        sm90::store_key_major<BN, NQ>(sP, a_p, 0, c0, tid, lane);
        sm90::fence_proxy_async();
        tma::named_sync(BAR_TILE_A, 128 * K::CONSUMERS);  // both halves of P^T are written

        // dV[:, mine] += P^T dO[:, mine], running while dS^T is computed.
        sm90::fence_operand(dv);
        sm90::fence();
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk)
            sm90::Wgmma<T, DQ_N>::template ss_t<0, 1>(dv, sm90::kmajor_desc(sP, BN, kk),
                                                      sm90::mnmajor_desc(sdO_mine, BM, kk), 1);
        sm90::commit();
        sm90::wait<1>();  // dP^T
        sm90::fence_operand(dpt[0]);
        float2 dsum[NQ];
#pragma unroll
        for (int nt = 0; nt < NQ; ++nt) dsum[nt] = ld_shared_f2(sDsum + (nt * 8 + 2 * t) * 4);
        uint32_t a_ds[1][NQ / 2][4];
        grads_t<T, NQ, K::DROPOUT>(dpt, s, dsum, a_ds, drop);
        sm90::store_key_major<BN, NQ>(sdS, a_ds, 0, c0, tid, lane);
        sm90::fence_proxy_async();
        tma::named_sync(BAR_TILE_B, 128 * K::CONSUMERS);  // both halves of dS^T are written

        // dQ[:, mine] = dS K[:, mine], then dK[:, mine] += dS^T Q[:, mine].
        float dq[DQ_N / 8][4];
        sm90::fence_operand(dk);
        sm90::fence();
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
            sm90::Wgmma<T, DQ_N>::ss_mn(dq, sm90::mnmajor_desc(sdS, BN, kk),
                                       sm90::mnmajor_desc(sK_mine, BN, kk), kk > 0);
        sm90::commit();
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk)
            sm90::Wgmma<T, DQ_N>::template ss_t<0, 1>(dk, sm90::kmajor_desc(sdS, BN, kk),
                                                      sm90::mnmajor_desc(sQ_mine, BM, kk), 1);
        sm90::commit();
        sm90::wait<1>();  // dV and dQ
        sm90::fence_operand(dq);
        sm90::fence_operand(dv);
        // float4 i of thread tid at float4 (group DQ_N / 8 + i) x 128 + tid of the tile.
        // Deterministic mode: after the key block before this one (bwd_ws_order_dq).
        const bool ordered = K::ordered(P.deterministic);
        if (ordered) tma::wait(sm.dq_turn(), it & 1);
        float* dst = P.b.dq_accum + tile_index * BM * D;
#pragma unroll
        for (int i = 0; i < DQ_N / 8; ++i) {
            red_add_v4(dst + ((group * (DQ_N / 8) + i) * 128 + tid) * 4, dq[i]);
        }
        if (ordered) {
            __syncwarp();
            if (lane == 0) tma::arrive(sm.dq_added());
        }
        sm90::wait<0>();  // dK
        sm90::fence_operand(dk);
        __syncwarp();
        if (lane == 0) tma::arrive(sm.empty(slot));
    }

    // dK and dV: all 64 keys, this warpgroup's columns.
    __device__ __forceinline__ void store(const BwdTmaParams& P, const BwdWsBlock<K>& blk) const {
        store_dkdv<K, DT>(P, sm, blk, dk, dv, 0, group * DQ_N, group, tid, lane);
    }
};

template <class K, bool SPLIT = K::SPLIT> struct ConsumerOf {
    using type = BwdWsConsumer<K>;
};
template <class K> struct ConsumerOf<K, true> {
    using type = BwdWsSplitConsumer<K>;
};

template <class K> __device__ __forceinline__ void flash_bwd_ws(const BwdTmaParams& P) {
    const AttnParams& p = P.b.a;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const BwdWsSmem<K> sm{(smem_addr(smem_raw) + 1023) & ~1023u};  // swizzle atoms: 1 KB
    const BwdWsBlock<K> blk(P);
    if (blk.n0 >= blk.seq.seqlen_k) return;
    // Warp-uniform as far as the compiler can tell (a shuffle from lane 0): the descriptors
    // built from a warpgroup's tile addresses then stay on the uniform datapath.
    const int tid = threadIdx.x, warpgroup = __shfl_sync(0xffffffff, tid / 128, 0);

    if (tid == 0) {
        tma::mbar_init(sm.full_kv(), 1);
        if constexpr (K::SPLIT) {
            tma::mbar_init(sm.dq_turn(), 1);
            tma::mbar_init(sm.dq_added(), 4 * K::CONSUMERS);
        } else {
            for (int group = 0; group < K::CONSUMERS; ++group) {
                tma::mbar_init(sm.full_dq(group), 128);
                tma::mbar_init(sm.empty_dq(group), 1);
            }
        }
        for (int st = 0; st < K::STAGES; ++st) {
            tma::mbar_init(sm.full_q(st), 1);
            tma::mbar_init(sm.full_do(st), 1);
            tma::mbar_init(sm.empty(st), 4 * K::CONSUMERS);
        }
        tma::fence_barrier_init();
    }
    // Launched programmatically after the prep kernel (src/cuda/bwd_ws.rs): the statistics,
    // the dq_accum state words and (with K::SPLIT) dq_accum's zeros are its output.
    pdl_wait();
    __syncthreads();
    // No query sees these keys: dK = dV = 0.
    int first_head = 0, first_m0 = blk.tiles.m0_begin;
    const bool any = blk.tiles.total > 0 && blk.tiles.seek(blk.mask, first_head, first_m0);

    if (warpgroup == 0) {
        tma::regs_dealloc<K::PRODUCER_REGS>();
        // else: the producer's registers (24) hold none of the other warp's values.
        if (any && tid == 0) {
            bwd_ws_produce<K>(P, sm, blk);
        } else if (any && tid == 32) {
            if constexpr (!K::SPLIT)
                bwd_ws_add_dq<K>(P, sm, blk);
            else if (K::ordered(P.deterministic))
                bwd_ws_order_dq<K>(P, sm, blk);
        }
        return;
    }
    tma::regs_alloc<K::CONSUMER_REGS>();
    typename ConsumerOf<K>::type c{p, sm, warpgroup - 1, tid % 128, tid % 32, {}, {}};
#pragma unroll
    for (int i = 0; i < K::DT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) c.dk[i][e] = c.dv[i][e] = 0.f;
    // The split consumer adds dQ itself, so it needs the tile's place in dq_accum.
    const auto run_tile = [&](int it, int bidh, int m0, int64_t tile) {
        if constexpr (K::SPLIT)
            c.tile(P, blk, it, bidh, m0, tile);
        else
            c.tile(blk, it, bidh, m0);
    };
    int tiles = 0;  // query tiles run
    if (any) {
        tma::wait(sm.full_kv(), 0);
        if constexpr ((K::MODS & MODS_CAP) != 0) c.prescale_k();
        if constexpr (K::TILES_FROM_PRODUCER) {
#pragma unroll 1
            for (bool last = false; !last; ++tiles) {
                const Ring<K::STAGES> fill(tiles);
                tma::wait(sm.full_q(fill.st), fill.phase);  // its TileInfo was written before
                const TileInfo t = ld_tile_info(sm.info(fill.st));
                run_tile(tiles, t.bidh, t.m0, blk.tile_index(P, t.bidh, t.m0));
                last = t.last;
            }
        } else {
            bwd_ws_walk<K>(P, blk, [&](int bidh, int m0, int64_t tile) {
                run_tile(tiles++, bidh, m0, tile);
            });
        }
    }
    if constexpr (K::PIPE_SDP) c.template retire<0>(tiles - 1);  // the last tile's dK
    c.store(P, blk);
}

// The row statistics per query tile (see the top of this file), the tile's dq_accum state
// word where there is one, and with K::SPLIT (D > 128: the consumers add into dq_accum
// directly) the dq_accum tile's zeros: D / 8 lanes per row (16 bytes of O and of dO each),
// 256 / D rows per warp (one warp per row left three quarters of the lanes idle at d = 64,
// and too few loads in flight to reach DRAM's bandwidth), rows up to m_blocks x BM. Grid
// (ceil(m_blocks x BM / (8 x 256 / D)), h, b).
template <class K> __device__ __forceinline__ void flash_bwd_ws_prep(const BwdTmaParams& P) {
    using T = typename K::T;
    constexpr int BM = K::BM, D = K::D;
    constexpr int LANES = D / CHUNK, ROWS_PER_WARP = 32 / LANES;
    static_assert(BM % ROWS_PER_WARP == 0, "a warp's rows are all in range or all past it");
    const BwdParams& bp = P.b;
    const AttnParams& p = bp.a;
    const int lane = threadIdx.x % 32, l = lane % LANES;
    const int row =
        (blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32) * ROWS_PER_WARP + lane / LANES;
    const int bidh = blockIdx.y, bidb = blockIdx.z;
    if (row >= P.m_blocks * BM) return;  // the whole warp
    // Launched programmatically (src/cuda/bwd_ws.rs): O and dO may be the last kernel's.
    pdl_wait();
    const SeqInfo seq(p, bidb);
    float sum = 0.f;
    if (row < seq.seqlen_q && l * CHUNK < p.d) {
        const int64_t off =
            seq.q_offset(p.o_batch_stride, p.o_row_stride, p.o_head_stride, bidb, bidh) +
            int64_t(row) * p.o_row_stride + l * CHUNK;
        const uint4 o4 = *reinterpret_cast<const uint4*>(static_cast<const T*>(p.o) + off);
        const uint4 d4 = *reinterpret_cast<const uint4*>(static_cast<const T*>(bp.dout) + off);
        const T* o8 = reinterpret_cast<const T*>(&o4);
        const T* d8 = reinterpret_cast<const T*>(&d4);
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) sum += float(o8[i]) * float(d8[i]);
    }
    // Within each row's LANES lanes (xor with less than LANES stays in the group).
#pragma unroll
    for (int s = LANES / 2; s > 0; s /= 2) sum += __shfl_xor_sync(0xffffffff, sum, s);
    const int64_t tile = (int64_t(bidb) * p.h + bidh) * P.m_blocks + row / BM;
    if (l == 0) {
        P.stats[tile * 2 * BM + row % BM] =
            row < seq.seqlen_q ? lse_log2(p.lse[seq.lse_offset(p, bidb, bidh) + row]) : INFINITY;
        P.stats[tile * 2 * BM + BM + row % BM] = sum;
    }
    if (P.dq_state != nullptr && row % BM == 0 && l == 0) P.dq_state[tile] = 0;
    if (!K::SPLIT) return;  // the dQ warp's first block stores (dq_tile_state.cuh)
    // D floats per row: the tile's BM x D floats in whatever order.
    float4* zero = reinterpret_cast<float4*>(bp.dq_accum + (tile * BM + row % BM) * D);
#pragma unroll
    for (int i = l; i < D / 4; i += LANES) zero[i] = make_float4(0.f, 0.f, 0.f, 0.f);
}

// dq = scale x dq_accum for one query tile, undoing the consumers' fragment order: the
// block's 256 threads stand for the main kernel's two consumer warpgroups, thread (group,
// tid) loading the float4s that consumer thread wrote (each warp load 512 consecutive bytes),
// then, as the forward stores O, stmatrix into a panel tile and one TMA store per 64 columns
// (TMA clips rows past seqlen_q and columns past the head dim). Launched programmatically
// after the main kernel. Grid (m_blocks, h, b), 256 threads.
template <class K> __device__ __forceinline__ void flash_bwd_ws_convert(const BwdTmaParams& P) {
    using T = typename K::T;
    constexpr int BM = K::BM, D = K::D, DQ_N = K::DQ_N, DT = DQ_N / 8;
    static_assert(K::CONSUMERS == 2 && DT % 2 == 0, "two warpgroups, stmatrix x4 pairs");
    __shared__ __align__(1024) unsigned char stage_raw[BM * D * sizeof(T)];
    const AttnParams& p = P.b.a;
    const int m_block = blockIdx.x, bidh = blockIdx.y, bidb = blockIdx.z;
    const int group = threadIdx.x / 128, tid = threadIdx.x % 128, lane = tid % 32;
    const int64_t tile = (int64_t(bidb) * p.h + bidh) * P.m_blocks + m_block;
    // Packed batches: tiles past a shorter sequence's end have no rows.
    const SeqInfo seq(p, bidb);
    const int m0 = m_block * BM;
    if (m0 >= seq.seqlen_q) return;
    pdl_wait();
    // A tile no key block reached holds no dQ (dq_tile_state.cuh).
    const bool written = P.dq_state == nullptr || P.dq_state[tile] != 0;
    const float4* src = reinterpret_cast<const float4*>(P.b.dq_accum + tile * BM * D);
    float x[DT][4];
#pragma unroll
    for (int i = 0; i < DT; ++i) {
        const float4 v =
            written ? src[(group * DT + i) * 128 + tid] : make_float4(0.f, 0.f, 0.f, 0.f);
        x[i][0] = v.x;
        x[i][1] = v.y;
        x[i][2] = v.z;
        x[i][3] = v.w;
    }
    const uint32_t stage = smem_addr(stage_raw);
    sm90::stage_fragments<T, BM, DT>(stage, x, tid / 32 * 16, group * DT, p.grad_scale,
                                     p.grad_scale, lane);
    sm90::fence_proxy_async();
    __syncthreads();
    const bool packed = p.cu_seqlens_q != nullptr;
    if (packed && m0 + BM > seq.seqlen_q) {
        // Rows crossing the sequence's end: a TMA store would write the next sequence's,
        // so the rows before the end from the panels, 16 bytes a thread. dq is contiguous.
        T* dq = static_cast<T*>(P.b.dq) + (int64_t(seq.q_start + m0) * p.h + bidh) * p.d;
        sm90::copy_panel_rows<T, BM, D / 8>(stage, 0, 0, seq.seqlen_q - m0, p.d / 8, dq,
                                            int64_t(p.h) * p.d, threadIdx.x, 256);
        return;
    }
    if (threadIdx.x == 0) {
        // Packed batches: one tensor of every sequence's rows, batch 0 (q_start is 0 for
        // fixed length).
        tma::store_tile<BM, D / 64>(P.dq, stage, 0, seq.q_start + m0, bidh, packed ? 0 : bidb);
        tma::bulk_commit();
        tma::bulk_wait_all();  // the block's shared memory outlives the copies
    }
}

// The kernels of this file: one per row of cuda/catalogue.rs (generated by build.rs).
#include "instances/sm90_bwd_ws.inc"
