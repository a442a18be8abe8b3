// The warp-specialized forward kernel on Hopper (sm_90a), FlashAttention-3's structure:
// - a producer warpgroup, one thread of which issues TMA copies of the Q tile and of each key
//   tile of K and V into a ring of STAGES slots, each slot with a "full" mbarrier (bytes
//   landed) and an "empty" one (every consumer warp done with it); it keeps 32-40 registers per
//   thread and hands the rest to the consumers (setmaxnreg);
// - two or three consumer warpgroups, 64 query rows each, sharing the key tiles. Within a
//   warpgroup the softmax of tile j runs while the tensor cores multiply P(j-1) V(j-1)
//   (issued together with S(j) = Q K(j)^T, then waited for one at a time); between them,
//   named barriers hand the tensor cores from one warpgroup to the next ("pingpong"), so one's
//   softmax runs under the others' matmuls.
// - persistent blocks: block i starts with work tile i (query blocks of one head after
//   another, the last, heaviest under a causal mask, first) and takes the next either with
//   the grid's stride (tiles of equal work) or from an atomic counter (masked tiles, whose
//   work differs); the producer loads the next tile's Q and keys while the consumers finish
//   the last one and write its output. A grid of one block per tile is the non-persistent
//   kernel.
// - O goes out through shared memory: each consumer warpgroup writes its rows there
//   (stmatrix) and one of its threads issues the TMA store, which runs while the warpgroup
//   goes on to its next tile; a tile of its own where shared memory has room (d = 64, d = 128
//   with 128-key tiles), at d = 256 the warpgroup's rows of the Q slot. At 512 keys a build
//   that skipped the stores from registers ran 1.2-1.35x faster (docs/archive/PERF.md, "O
//   through shared memory and TMA stores").
// Key tiles are visited last first, as in sm90/fwd.cu (under a causal mask only the first
// need the mask). Packed (variable-length) batches in the `_packed` kernels and dropout in the
// `_dropout` ones (both: `_packed_dropout`), none with a softcap, ALiBi or block mask:
// src/cuda/plan/fwd.rs sends the rest to sm90/fwd.cu and sm80/fwd.cu.
// Packed batches are one tensor of every sequence's rows to TMA; a tile's rows past its
// sequence's end read the next sequence's Q, K and V (its keys masked, its rows never stored:
// where a warpgroup's rows cross the end, its threads copy the rows before it from the staged
// panels instead of a TMA store). Entry points
// flash_fwd_ws_<dtype>_d<D>[_<shape>][_mods|_sparse|_packed|_dropout|_packed_dropout].
#include <type_traits>

#include "common/gemm.cuh"
#include "common/lpt_tail.cuh"
#include "common/mask/levels.cuh"
#include "common/mask/visibility.cuh"
#include "common/params.cuh"
#include "common/pdl.cuh"
#include "common/philox.cuh"
#include "common/seq_info.cuh"
#include "common/softmax.cuh"
#include "sm90/ring.cuh"
#include "sm90/tma.cuh"
#include "sm90/wgmma.cuh"
#include "sm90/softmax_fp8.cuh"
#include "sm90/wgmma_fp8.cuh"

// The kernel's parameter: tensor maps of q, k, v and o over (d, rows, heads, batch) with boxes
// of 64 columns x BM (q), BN (k, v) or 64 (o) rows, then the usual parameters (the same struct
// as in src/cuda/tma.rs).
struct FwdTmaParams {
    TmaDesc q, k, v, o;
    AttnParams a;
    // Dynamic schedule: blocks take their tiles after the first from tile_counter[0], zero at
    // launch and left zero (the last fetch resets it); the producer passes each tile's index to
    // the consumers through 16 bytes per Q slot, tile_counter[4 + 4 * (Q_STAGES * block +
    // slot)], and a bulk copy into shared memory beside Q. Null: the static walk, which every
    // warp follows by itself.
    unsigned int* tile_counter;
    // Under the dynamic schedule, how many (sequence, head) pairs at the end of the walk
    // hand out their query blocks heaviest first across all of them (longest_first_tail);
    // 0: none.
    int tail_heads;
    // The FP8 kernels' dequantization factors (a stored e4m3 value times its factor is the
    // real one) and their element strides over (sequence, head, block of FP8_BLOCK rows): per
    // tensor (all 0), per head (0, 1, 0; q's by query head, k's and v's by key/value head) or
    // per block. Unused by the others.
    const float *q_descale, *k_descale, *v_descale;
    int q_descale_strides[3], k_descale_strides[3], v_descale_strides[3];
};

// Rows per block of the FP8 descales (src/quant: FP8_BLOCK_ROWS): a work tile's query rows
// and one or two key tiles, so a block's factor is one number per tile.
constexpr int FP8_BLOCK = 128;

// Shared memory with q Q slots (read back for the host by the geometry probe, build/catalogue.rs): q Q tiles, STAGES K
// tiles, STAGES V tiles (with FP8, STAGES more of V transposed: kv_tiles 3), the O tile
// staged for its store (o_bytes, or none), then the barriers (full and empty per Q, K and V
// slot, and per transposed V slot); per Q slot its work tile's index, written by the producer
// before it fills Q; under a block mask per K slot its key tile (KeyInfo), with FP8 per V slot
// whether it holds a tile (VInfo), written by the producer; 1 KB to align the tiles to a
// swizzle atom.
struct WsLayout {
    int o, bar, tile, key, bytes;
    static constexpr WsLayout of(int q, int q_bytes, int kv_bytes, int stages, int o_bytes,
                                 int kv_tiles = 2, int vt_extra = 0) {
        const int o = q * q_bytes + kv_tiles * stages * kv_bytes + vt_extra, bar = o + o_bytes;
        const int tile = (bar + (2 * q + 2 * kv_tiles * stages) * 8 + 15) / 16 * 16;
        return {o, bar, tile, tile + 16 * q, tile + 16 * q + 16 + 1024};
    }
};

// MODS (common/mask/levels.cuh): with the softcap and ALiBi code (entry points `..._mods`),
// also with the block mask's (`..._sparse`); the others are never given such a problem
// (src/cuda/plan/fwd.rs) and keep their registers.
// FP8: q, k and v in e4m3 (uint8_t in shared memory), O in T; V is transposed in shared
// memory by the producer warpgroup's other warps for the e4m3 wgmma (sm90/wgmma_fp8.cuh).
// DA: the head dim the products cover within D's layout (d 32 or 48 on d 64's tiles, 80 or 96
// on d 128's, 160 or 192 on d 256's: the columns past it are TMA's zero fill, so S's k loop
// stops there and P V is nDA, or n128 and n(DA - 128); at d 96 one consumer wgmma in four
// fewer).
template <typename T_, int D_, int BN_, int STAGES_, int CONSUMERS_, bool PINGPONG_,
          int MODS_ = MODS_NONE, bool PACKED_ = false, bool DROPOUT_ = false, bool FP8_ = false,
          int DA_ = D_, bool VT_GLOBAL_ = false>
struct WsTraits {
    using T = T_;  // O's type (and q's, k's and v's but with FP8)
    static constexpr bool FP8 = FP8_;
    // FP8 with V given transposed (`_vt`: FlashAttn::fp8_v_transposed, V^T with the keys of
    // each 16 already in P's order, sm90/wgmma_fp8.cuh): the producer copies V^T tiles
    // straight into the V slots (tma.cuh: load_vt_tile) in panels of 64 keys (32 where BN is
    // not a multiple of 64), swizzled at that width, and no warp transposes. The host's
    // tensor map has the same panel width (src/cuda/tma.rs).
    static constexpr bool VT_GLOBAL = VT_GLOBAL_;
    static constexpr int VT_PANEL_KEYS = BN_ % 64 == 0 ? 64 : 32;
    static_assert(!VT_GLOBAL || (FP8_ && BN_ % 32 == 0), "key-major V: FP8, 32-key steps");
    // The transposer's V^T slots (with FP8 but for VT_GLOBAL).
    static constexpr bool TRANSPOSE = FP8 && !VT_GLOBAL;
    // Bytes per q, k, v element; a 128-byte panel row holds PANEL_COLS of them.
    static constexpr int ELEM = FP8 ? 1 : 2, PANEL_COLS = 128 / ELEM;
    // The transposed V tiles beside K's and V's (FP8).
    static constexpr int KV_TILES = TRANSPOSE ? 3 : 2;
    static constexpr int D = D_, BN = BN_, STAGES = STAGES_, CONSUMERS = CONSUMERS_;
    static constexpr int DA = DA_;
    static_assert(DA == D || (DA < D && DA % 16 == 0 && (D <= 128 || DA > 128) && !FP8_),
                  "a cut row: whole k16 steps, past the first n128 half at d 256, bf16/f16");
    static constexpr bool PINGPONG = PINGPONG_;
    static constexpr int MODS = MODS_;
    // Packed (variable-length) batches, in kernels of their own (`_packed`): the sequences'
    // offsets in the addressing cost the fixed-length kernels 16-216 bytes of spills.
    static constexpr bool PACKED = PACKED_;
    // Dropout, in kernels of their own (`_dropout`): its Philox rounds and keep bits cost
    // registers the others keep.
    static constexpr bool DROPOUT = DROPOUT_;
    static constexpr int BM = 64 * CONSUMERS, THREADS = 128 * (CONSUMERS + 1);
    // Under a mask whose rows see keys up to a diagonal (causal, a window's right side), the
    // work tiles end at the sequence's last row (WsTile), so that a partial tile is the
    // first, lightest one: 1024 rows in 192-row tiles then leave 64 rows that see one key
    // tile, where the last tile had 128 rows past the end that saw all eight (1.055x at d 64
    // causal 1k, H100; docs/archive/PERF.md, "The three-warpgroup forward's partial tile,
    // first and light under a causal mask"). Its rows before 0 load as zeros (TMA) and are
    // never stored (store_staged). Three warpgroups only, whose 192 rows divide no power of
    // two (the others spilled: d = 256 0 -> 44 bytes); not in packed batches (the rows before
    // a sequence are another's) nor under a block mask (its tables start at row 0).
    static constexpr bool END_ALIGNED = CONSUMERS == 3 && !PACKED && !(MODS & MODS_BLOCKS);
    // Whether a warpgroup's 64 rows may lack a TMA box for their store (WsConsumer::OutTile:
    // packed batches at a sequence's end, END_ALIGNED rows before 0); the others never copy.
    static constexpr bool O_MAY_COPY = PACKED || END_ALIGNED;
    static constexpr int NT = BN / 8, DT = D / 8;
    static constexpr int Q_BYTES = BM * D * ELEM, KV_BYTES = BN * D * ELEM, O_BYTES = BM * D * 2;
    // Two Q slots where shared memory has room (d = 64, d = 128 with 128-key tiles): the
    // producer then loads the next work tile's Q while the consumers still run the last one's
    // final key tiles, instead of after their last S (a short row, 4 key tiles at 512, waited
    // for it once per tile).
    // Three at d = 64 with two consumer warpgroups (the causal 512 kernel, whose work tiles
    // hold 1-4 key tiles): the producer may then run two work tiles ahead (1.011x at 512 and
    // 1.012x at 1k causal, which it then also ran, in 6 and 5 of 6 rounds, H100;
    // docs/archive/PERF.md, "Three Q slots in the d 64 two-warpgroup forward").
    // FP8: V^T in panels of 128 keys (D rows of 128 bytes each, 128-byte swizzled), what the
    // k steps of P V read. A tile's last 64 keys (BN = 64 at d = 256, BN = 192) go to a half
    // panel: the two slots' halves share one panel, slot st in its bytes 64 st..64 st + 63 (a
    // k step's 32 bytes stay inside a swizzled row either way), so that V^T takes what K and V
    // take, BN x D bytes a slot. A last 96 keys (BN = 96) take a panel of their own per slot,
    // VT_EXTRA bytes more than BN x D a slot.
    static constexpr int VT_FULL_PANELS = BN / 128;
    static constexpr bool VT_HALF = TRANSPOSE && BN % 128 == 64;
    static constexpr bool VT_OWN = TRANSPOSE && BN % 128 != 0 && !VT_HALF;
    static constexpr int VT_SLOT_BYTES = (VT_FULL_PANELS + (VT_OWN ? 1 : 0)) * D * 128;
    static constexpr int VT_EXTRA = VT_OWN ? STAGES * (128 - BN % 128) * D : 0;
    static constexpr bool THREE_Q =
        D == 64 && CONSUMERS == 2 &&
        WsLayout::of(3, Q_BYTES, KV_BYTES, STAGES, O_BYTES).bytes <= 232448;
    // FP8 kernels whose staged O does not fit beside two Q slots take one, which holds O
    // (O_IN_Q), rather than store O from registers.
    static constexpr bool FP8_O_IN_Q =
        FP8 &&
        WsLayout::of(2, Q_BYTES, KV_BYTES, STAGES, O_BYTES, KV_TILES, VT_EXTRA).bytes > 232448;
    static constexpr int Q_STAGES =
        THREE_Q ? 3
        : FP8_O_IN_Q ? 1
        : WsLayout::of(2, Q_BYTES, KV_BYTES, STAGES, 0, KV_TILES, VT_EXTRA).bytes <= 232448 ? 2
                                                                                            : 1;
    // O through shared memory and a TMA store (WsConsumer::store_staged) where the tile fits
    // beside the Q slots, else straight from registers.
    static constexpr bool O_STAGED =
        WsLayout::of(Q_STAGES, Q_BYTES, KV_BYTES, STAGES, O_BYTES, KV_TILES, VT_EXTRA).bytes <=
        232448;
    static constexpr WsLayout LAYOUT = WsLayout::of(Q_STAGES, Q_BYTES, KV_BYTES, STAGES,
                                                    O_STAGED ? O_BYTES : 0, KV_TILES, VT_EXTRA);
    // d = 256, one Q slot and no room for O: each warpgroup stages its O in its own 64 rows of
    // the Q tile, free after its last S, and hands the slot back once the store has read them
    // (1.05-1.17x up to 2k, level at 16k; the next Q then loads later, which cost the d = 128
    // 176-key kernel 1-2.5% at 8k-16k: it keeps its stores from registers). An e4m3 Q row
    // holds half an O row: O goes in two rounds of half the head dim (O_ROUNDS). The FP8
    // kernels past FP8_O_IN_Q need it: stored from registers, O itself went to local memory
    // (~2 KB in a d = 256 x 128-key build, ptxas -v).
    static constexpr bool O_IN_Q = !O_STAGED && Q_STAGES == 1 && (D > 128 || FP8_O_IN_Q);
    static constexpr int O_ROUNDS = O_IN_Q ? 2 / ELEM : 1;
    static constexpr int O_PANEL_ROWS = O_STAGED ? 64 : BM;  // rows per panel where O is staged
    static constexpr int O_OFFSET = LAYOUT.o, BAR_OFFSET = LAYOUT.bar, TILE_OFFSET = LAYOUT.tile;
    static constexpr int KEY_OFFSET = LAYOUT.key, SMEM_BYTES = LAYOUT.bytes;
    static_assert(SMEM_BYTES <= 232448, "shared memory per block");
    // The consumers take their key tiles from the producer (KEY_OFFSET) rather than walk
    // the block mask themselves: its reads and index arithmetic, in each of their threads,
    // cost the d = 64 forward a third of its time with every block kept.
    static constexpr bool KEYS_FROM_PRODUCER = (MODS & MODS_BLOCKS) != 0;
    static_assert(STAGES <= 4, "one 4-byte KeyInfo per K slot");
    // Registers per thread after the hand-over. The launch gives each thread 65536 / THREADS
    // rounded down to 8 (168 or 128); the consumers can take what the producer gives up:
    // 128 x (168 - 40) / 256 -> 232 with two (128 x (168 - 24) / 256 -> 240 with a 24-register
    // producer), 128 x (128 - 32) / 384 -> 160 with three.
    // d = 128 without mods: the producer keeps 24 and the consumers take 240 (FlashAttention
    // 3's split): 1.017-1.018x at 2k-4k non-causal (H100); at d = 64 it lost 2.6% at 512
    // causal (docs/archive/PERF.md, "240 consumer registers in the d 128 forward"). The mods
    // and block-mask producers spill at 24, d = 256's below 40.
    // FP8: the producer warpgroup's transposing warps (two ldmatrix units in flight) keep 40
    // like the two-warpgroup producers, the consumers 232. The `_vt` producers transpose
    // nothing and keep 24 at d = 256 too: 240 leave the 128-key consumers 32 bytes of spill
    // (the 96-key ones spilled 28 at 232, none at 240).
    static constexpr bool LEAN_PRODUCER =
        CONSUMERS == 2 && MODS == MODS_NONE && (D == 128 || VT_GLOBAL) && !TRANSPOSE;
    static constexpr int PRODUCER_REGS = LEAN_PRODUCER ? 24 : CONSUMERS == 2 ? 40 : 32;
    static constexpr int CONSUMER_REGS = LEAN_PRODUCER ? 240 : CONSUMERS == 2 ? 232 : 160;
    // Whether a key tile's softmax runs under the P V in flight (WsConsumer::step: P V's wait
    // in each arm of the rescale's branch). With the wait in the softmax's basic block, as
    // written, ptxas issues it ahead of the softmax (WARPGROUP.DEPBAR before the first FMNMX),
    // so the softmax starts only once P V is done. Under P V (H100, same-run A/B,
    // docs/archive/PERF.md "The softmax under P V"): d 128 1.00-1.07x, d 256 0.95-1.05x
    // (1.01 on average), FP8 d 256 x 128 with V transposed 0.98-1.10x (1.03); left as they
    // were: d 64 0.95-1.02x, FP8 d 128 0.98-1.02x, d 256 x 64 with V transposed 0.98x, the
    // transposing FP8 kernels 0.91-1.02x.
    static constexpr bool SOFTMAX_UNDER_PV =
        DA == D && (FP8 ? VT_GLOBAL && D == 256 && BN == 128 : D == 128 || D == 256);
    // The producer warpgroup's warps 1-3 transpose V (FP8); their arrivals on its barriers.
    static constexpr int TRANSPOSERS = 3;
    static_assert(D % PANEL_COLS == 0, "panels are 128 bytes wide");
    static_assert(!FP8 || ((BN % 128 == 0 || (VT_HALF && STAGES == 2) || VT_OWN || VT_GLOBAL) &&
                           BN % 32 == 0 && MODS == MODS_NONE && !DROPOUT && CONSUMERS == 2),
                  "FP8: V^T in 128-key panels (a last half panel shared by two slots, or a "
                  "partial one per slot), k32 steps, no score mods, no dropout, two consumers");
    static_assert(BN * 128 % 1024 == 0, "panels must stay 1 KB aligned");
    static_assert(CONSUMERS == 2 || CONSUMERS == 3, "two or three consumer warpgroups");
};

// Shared-memory addresses of the tiles and barriers.
template <class K> struct WsSmem {
    uint32_t base;
    static constexpr int QB = 2 * K::Q_STAGES;  // Q's barriers, before K's and V's
    __device__ __forceinline__ uint32_t q(int qs) const { return base + qs * K::Q_BYTES; }
    __device__ __forceinline__ uint32_t k(int st) const {
        return base + K::Q_STAGES * K::Q_BYTES + st * K::KV_BYTES;
    }
    __device__ __forceinline__ uint32_t v(int st) const {
        return base + K::Q_STAGES * K::Q_BYTES + (K::STAGES + st) * K::KV_BYTES;
    }
    // FP8: V transposed (WsTraits::VT_FULL_PANELS, VT_HALF, VT_OWN), what P V reads: slot
    // st's full panels, the panel of its last keys (the half panel the two slots share, or its
    // own), and the first byte of those keys in its rows.
    __device__ __forceinline__ uint32_t vt(int st) const {
        if constexpr (K::VT_GLOBAL) return v(st);
        return base + K::Q_STAGES * K::Q_BYTES + 2 * K::STAGES * K::KV_BYTES +
               st * K::VT_SLOT_BYTES;
    }
    __device__ __forceinline__ uint32_t vt_part(int st) const {
        return K::VT_HALF ? vt(K::STAGES) : vt(st) + K::VT_FULL_PANELS * K::D * 128;
    }
    __device__ __forceinline__ int vt_part_key0(int st) const { return K::VT_HALF ? 64 * st : 0; }
    __device__ __forceinline__ uint32_t full_q(int qs) const {
        return base + K::BAR_OFFSET + 8 * qs;
    }
    __device__ __forceinline__ uint32_t empty_q(int qs) const {
        return full_q(K::Q_STAGES + qs);
    }
    __device__ __forceinline__ uint32_t full_k(int st) const { return full_q(QB + st); }
    __device__ __forceinline__ uint32_t full_v(int st) const {
        return full_q(QB + K::STAGES + st);
    }
    __device__ __forceinline__ uint32_t empty_k(int st) const {
        return full_q(QB + 2 * K::STAGES + st);
    }
    __device__ __forceinline__ uint32_t empty_v(int st) const {
        return full_q(QB + 3 * K::STAGES + st);
    }
    __device__ __forceinline__ uint32_t full_vt(int st) const {
        if constexpr (K::VT_GLOBAL) return full_v(st);
        return full_q(QB + 4 * K::STAGES + st);
    }
    __device__ __forceinline__ uint32_t empty_vt(int st) const {
        if constexpr (K::VT_GLOBAL) return empty_v(st);
        return full_q(QB + 5 * K::STAGES + st);
    }
    // The barriers of the V operand of P V as the consumers see it: the one it lands on and
    // the one they release it through (with FP8 the transposed tile's).
    __device__ __forceinline__ uint32_t pv_full(int st) const {
        return K::FP8 ? full_vt(st) : full_v(st);
    }
    __device__ __forceinline__ uint32_t pv_empty(int st) const {
        return K::FP8 ? empty_vt(st) : empty_v(st);
    }
    __device__ __forceinline__ uint32_t tile(int qs) const {
        return base + K::TILE_OFFSET + 16 * qs;
    }
    __device__ __forceinline__ uint32_t key(int st) const { return base + K::KEY_OFFSET + 4 * st; }
    // Where consumer warpgroup g stages its 64 rows of O (store_staged): a tile of its own
    // (panels of 64 rows), or with K::O_IN_Q its own rows of Q slot qs (panels of BM rows).
    __device__ __forceinline__ uint32_t o(int g, int qs) const {
        return K::O_IN_Q ? q(qs) + g * 64 * 128 : base + K::O_OFFSET + g * 64 * K::D * 2;
    }
};

// A key tile as the producer hands it over (K::KEYS_FROM_PRODUCER): its index, its
// sparse_state and whether it is the work tile's last, in one word.
struct KeyInfo {
    int nb, state;
    bool last;
    __device__ __forceinline__ int pack() const { return nb << 3 | int(last) << 2 | state; }
    __device__ __forceinline__ static KeyInfo unpack(int x) { return {x >> 3, x & 3, (x & 4) != 0}; }
};

__device__ __forceinline__ void st_shared(uint32_t addr, int v) {
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ int ld_shared(uint32_t addr) {
    int v;
    asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
    return v;
}

// A tile's place in its ring (sm90/ring.cuh): every block counts the key tiles (N = STAGES)
// and the work tiles (N = Q_STAGES) it has passed through, the producer and each consumer
// alike.
template <class K> using Slot = Ring<K::STAGES>;
template <class K> using QSlot = Ring<K::Q_STAGES>;

// One work tile: query block m_block of head bidh of sequence bidb, and its key tiles.
template <class K> struct WsTile {
    int m_block, bidh, bidb, bidh_k, m0, q_last, nb_begin, nb_end;
    int last_state;  // the last key tile's sparse_state
    SeqInfo seq;
    Mask mask;

    WsTile() = default;

    // The work tile at index t of the grid's walk over its `tiles` tiles. The walk runs the
    // query blocks of one (sequence, head) after another, from the last (the heaviest under a
    // causal mask) down, so that the blocks in flight together read the K and V of few heads
    // (they stay in L2), but for its last tail_heads pairs (longest_first_tail).
    __device__ __forceinline__ WsTile(const AttnParams& p, int t, int tiles, int tail_heads)
        : WsTile(p, t, tiles, tail_heads, (p.seqlen_q + K::BM - 1) / K::BM) {}

    // Packed batches: whether the tile at walk index t has rows (its sequence reaches m0).
    static __device__ __forceinline__ bool has_rows(const AttnParams& p, int t, int tiles,
                                                    int tail_heads) {
        const int m_blocks = (p.seqlen_q + K::BM - 1) / K::BM;
        t = longest_first_tail(t, tiles, tail_heads, m_blocks);
        const int b = t / m_blocks / p.h, m0 = (m_blocks - 1 - t % m_blocks) * K::BM;
        return m0 < p.cu_seqlens_q[b + 1] - p.cu_seqlens_q[b];
    }

    __device__ __forceinline__ int key_tiles() const { return max(nb_end - nb_begin, 0); }
    // The key tile after nb (they go last first), -1 after the last, and its sparse_state:
    // under a block mask, the producer skips absent blocks with it (and hands its consumers
    // the tiles it kept: KeyInfo).
    __device__ __forceinline__ int next(int nb, int* state = nullptr) const {
        return mask.template next_key_block<K::BN>(m0, q_last, nb, nb_begin, state);
    }

  private:
    __device__ __forceinline__ WsTile(const AttnParams& p, int t, int tiles, int tail_heads,
                                      int m_blocks)
        : WsTile(p, longest_first_tail(t, tiles, tail_heads, m_blocks), m_blocks) {}

    // Tile t in pair-major order: rank t % m_blocks of pair t / m_blocks, rank 0 the last block.
    __device__ __forceinline__ WsTile(const AttnParams& p, int t, int m_blocks)
        : seq(p, t / m_blocks / p.h),
          mask(p, seq, t / m_blocks / p.h, t / m_blocks % p.h, K::MODS) {
        m_block = m_blocks - 1 - t % m_blocks;
        bidh = t / m_blocks % p.h;
        bidb = t / m_blocks / p.h;
        bidh_k = bidh / p.h_h_k_ratio;
        m0 = m_block * K::BM;
        if (K::END_ALIGNED && mask.right >= 0) m0 -= m_blocks * K::BM - seq.seqlen_q;
        q_last = min(m0 + K::BM, seq.seqlen_q) - 1;
        mask.template key_blocks<K::BN>(m0, q_last, &nb_begin, &nb_end);
        nb_end = mask.template next_key_block<K::BN>(m0, q_last, nb_end, nb_begin, &last_state) + 1;
        // Packed batches: the query blocks past a shorter sequence's end have no rows.
        if (K::PACKED && m0 >= seq.seqlen_q) nb_end = nb_begin;
    }
};

// The producer thread hands the consumers their work tiles one at a time through the Q slots:
// once they are done with the slot's last Q, it copies the next tile's Q, and under the
// dynamic schedule the tile's index (an index past the last tile tells them to stop) beside
// it, both completing on the slot's barrier; then K and V of the tile's key tiles, last
// first, each into the next slot once the consumers have released it. With FP8 a V slot is
// released by the warps that transpose it, and each carries a word saying that it holds a tile
// (VInfo: 1; the word 0 after the last tells the transposers to stop, end_v_stream). Returns
// the key tiles it loaded.
template <class K>
__device__ __forceinline__ int ws_produce(const FwdTmaParams& P, const WsSmem<K>& sm,
                                          int tiles) {
    // Each Q slot's index goes through a global slot of its own: with two or three Q slots the
    // producer may write the next index before the last one's bulk copy has landed.
    unsigned int* slots = P.tile_counter == nullptr
                              ? nullptr
                              : P.tile_counter + 4 + 4 * K::Q_STAGES * blockIdx.x;
    // The next tile's index under the grid's stride, or from the counter: every block fetches
    // until it fails once, `tiles` fetches in all (the grid is at most `tiles` blocks), so the
    // one that gets tiles - 1 is the last and resets.
    const auto fetch = [&](int t) {
        if (slots == nullptr) return t + int(gridDim.x);
        const unsigned int i = atomicAdd(P.tile_counter, 1u);
        if (i == unsigned(tiles) - 1) atomicExch(P.tile_counter, 0u);
        return int(gridDim.x) + int(i);
    };
    int it = 0;
    for (int t = blockIdx.x, q_uses = 0;; ++q_uses) {
        // Packed batches: the tiles past a shorter sequence's end (no rows, nothing to write)
        // are passed over here under the counter, so the consumers never wait for them.
        if constexpr (K::PACKED) {
            while (slots != nullptr && t < tiles &&
                   !WsTile<K>::has_rows(P.a, t, tiles, P.tail_heads))
                t = fetch(t);
        }
        const bool last = t >= tiles;
        if (last && slots == nullptr) return it;  // the consumers walk the same tiles and stop
        const QSlot<K> qs(q_uses);
        tma::wait(sm.empty_q(qs.st), qs.phase ^ 1);
        const WsTile<K> w(P.a, last ? 0 : t, tiles, P.tail_heads);
        // No keys: no Q either; the consumers write zeros and move on.
        const bool q = !last && w.key_tiles() > 0;
        unsigned int* slot = slots == nullptr ? nullptr : slots + 4 * qs.st;
        if (slot != nullptr) {
            *slot = unsigned(t);
            tma::fence_proxy_global();
        }
        const uint32_t bytes = (slot != nullptr ? 16 : 0) + (q ? K::Q_BYTES : 0);
        if (bytes == 0) {
            tma::arrive(sm.full_q(qs.st));
        } else {
            tma::arrive_expect_tx(sm.full_q(qs.st), bytes);
        }
        if (slot != nullptr) tma::load_bulk(sm.tile(qs.st), slot, 16, sm.full_q(qs.st));
        if (last) return it;
        const TmaSeq ts = tma_seq<K::PACKED>(w.seq, w.bidb);
        constexpr int PANELS = K::D / K::PANEL_COLS, COLS = K::PANEL_COLS;
        if (q)
            tma::load_tile<K::BM, PANELS, COLS>(sm.q(qs.st), P.q, sm.full_q(qs.st),
                                                ts.q0 + w.m0, w.bidh, ts.batch);
        int state = w.last_state;
        for (int nb = w.key_tiles() > 0 ? w.nb_end - 1 : -1, next, next_state; nb >= 0;
             nb = next, state = next_state, ++it) {
            const Slot<K> s(it);
            // The next tile before the wait for K's slot: under a block mask its skip-table
            // read then runs during the wait.
            next = w.next(nb, &next_state);
            // K, then V, each into its slot once the consumers released it.
            tma::wait(sm.empty_k(s.st), s.phase ^ 1);
            if constexpr (K::KEYS_FROM_PRODUCER)
                st_shared(sm.key(s.st), KeyInfo{nb, state, next < 0}.pack());
            tma::arrive_expect_tx(sm.full_k(s.st), K::KV_BYTES);
            tma::load_tile<K::BN, PANELS, COLS>(sm.k(s.st), P.k, sm.full_k(s.st),
                                                ts.k0 + nb * K::BN, w.bidh_k, ts.batch);
            tma::wait(sm.empty_v(s.st), s.phase ^ 1);
            if constexpr (K::TRANSPOSE) st_shared(sm.key(s.st), 1);
            tma::arrive_expect_tx(sm.full_v(s.st), K::KV_BYTES);
            if constexpr (K::VT_GLOBAL)
                tma::load_vt_tile<K::D, K::BN / K::VT_PANEL_KEYS, K::VT_PANEL_KEYS>(
                    sm.v(s.st), P.v, sm.full_v(s.st), ts.k0 + nb * K::BN, w.bidh_k, ts.batch);
            else
                tma::load_tile<K::BN, PANELS, COLS>(sm.v(s.st), P.v, sm.full_v(s.st),
                                                    ts.k0 + nb * K::BN, w.bidh_k, ts.batch);
        }
        t = fetch(t);
    }
}

// FP8: after the producer's last key tile (`tiles_loaded` of them), a V slot without a tile
// (VInfo 0), which stops the transposers.
template <class K>
__device__ __forceinline__ void end_v_stream(const WsSmem<K>& sm, int tiles_loaded) {
    const Slot<K> s(tiles_loaded);
    tma::wait(sm.empty_v(s.st), s.phase ^ 1);
    st_shared(sm.key(s.st), 0);
    tma::arrive(sm.full_v(s.st));
}

// FP8: the producer warpgroup's warps 1-3 transpose each V tile once it lands and its slot of
// transposed V is free (sm90/wgmma_fp8.cuh: transpose_v_fp8), then hand the transposed tile
// to the consumers and the V slot back to the producer. `thread` counts from 0 in warp 1.
template <class K>
__device__ __forceinline__ void ws_transpose(const WsSmem<K>& sm, int thread) {
    for (int it = 0;; ++it) {
        const Slot<K> s(it);
        tma::wait(sm.full_v(s.st), s.phase);
        if (ld_shared(sm.key(s.st)) == 0) return;
        tma::wait(sm.empty_vt(s.st), s.phase ^ 1);
#ifndef CANDLE_FLASH_FP8_NO_TRANSPOSE  // the A/B build that times the rest (wrong results)
        sm90::transpose_v_fp8<K::BN, K::D, K::TRANSPOSERS>(sm.vt(s.st), sm.vt_part(s.st),
                                                           sm.vt_part_key0(s.st), sm.v(s.st),
                                                           thread);
#endif
        // The stores (generic proxy) become visible to the wgmmas (async proxy) that read them.
        sm90::fence_proxy_async();
        __syncwarp();
        if (thread % 32 == 0) {
            tma::arrive(sm.full_vt(s.st));
            tma::arrive(sm.empty_v(s.st));
        }
    }
}

// S(j) is waited for alone, so that the softmax may run while P(j-1) V(j-1) is in flight
// (where it does: WsTraits::SOFTMAX_UNDER_PV); -DCANDLE_FLASH_WS_SERIAL waits for both.
#ifdef CANDLE_FLASH_WS_SERIAL
constexpr int WS_WAIT_S = 0;
#else
constexpr int WS_WAIT_S = 1;
#endif

// One consumer warpgroup: 64 query rows, its O and softmax state in registers.
template <class K> struct WsConsumer {
    using T = typename K::T;
    static constexpr int D = K::D, BM = K::BM, BN = K::BN, NT = K::NT, DT = K::DT;
    // Work tiles in one stream of key tiles (work()) where that compiles without spilling:
    // the plain d = 64 kernel with two consumers, whose second Q slot lets the next tile's Q
    // land early (d 128 spilled 12 bytes into the key-tile loop and ran 3-7% slower at every
    // length, the three-warpgroup d 64 one 136 bytes, 5-8%; docs/archive/PERF.md, "the
    // forward's work tiles as one stream of key tiles").
    static constexpr bool CARRY =
        K::Q_STAGES > 1 && D == 64 && K::CONSUMERS == 2 && K::MODS == MODS_NONE;
    static_assert(!(CARRY && K::FP8), "FP8 descales are set by flash_fwd_ws's work-tile loop");
    // k steps of P V: k16 (two n8 tiles of P) or with FP8 k32 (four).
    static constexpr int PV_STEPS = K::FP8 ? NT / 4 : NT / 2;

    // Named barriers 1 .. CONSUMERS pass the pingpong turns; EPILOGUE_BAR + g orders
    // warpgroup g's writes of the staged O tile around its TMA stores.
    static constexpr int EPILOGUE_BAR = 4;

    const FwdTmaParams& P;
    const AttnParams& p;  // P.a
    const WsSmem<K> sm;
    const int group, warp_row0, lane;
    int qs;  // the Q slot of the work tile being run
    float o[1][DT][4];
    uint32_t pa[1][PV_STEPS][4];  // P of the previous tile, the A operand of P V
    OnlineSoftmax<1> softmax;
    // FP8: the work tile's softmax scale (log2 units) times q's descale (set_descales), where
    // its sequence's and head's k and v factors start, and v's factor of the last key tile
    // whose P went into O: O is kept in units of it, so that a key tile of another V factor
    // (per block) rescales O by the ratio with the softmax's factors (exp_scores).
    float fp8_q_log2 = 0.f, fp8_v = 1.f;
    int fp8_k = 0, fp8_vs = 0;  // element offsets (the pointers stay in the parameter space)

    __device__ __forceinline__ void set_descales(const WsTile<K>& w) {
        if constexpr (K::FP8) {
            const int* qs = P.q_descale_strides;
            const int* ks = P.k_descale_strides;
            const int* vs = P.v_descale_strides;
            static_assert(K::BM == FP8_BLOCK, "a work tile's rows are one block");
            fp8_q_log2 = p.scale_log2 * P.q_descale[w.bidb * qs[0] + w.bidh * qs[1] +
                                                    w.m_block * qs[2]];
            fp8_k = w.bidb * ks[0] + w.bidh_k * ks[1];
            fp8_vs = w.bidb * vs[0] + w.bidh_k * vs[1];
            // What the host never sends these kernels (src/fp8_fwd.rs refuses windows;
            // src/cuda/fwd_fp8.rs picks key tiles inside one block for per-block descales):
            // a window's left side (scores() masks the right side only), and per-block k or v
            // descales to key tiles that straddle two blocks.
            if (w.mask.left >= 0 || (FP8_BLOCK % BN != 0 && kv_blocks())) __trap();
            if (!kv_blocks()) {  // one k and v factor for the work tile: no loads per key tile
                fp8_q_log2 *= P.k_descale[fp8_k];
                fp8_v = P.v_descale[fp8_vs];
            }
        }
    }
    // Whether k's or v's factors change from one block of keys to the next. Per tensor or per
    // head they are loaded once per work tile: with two loads per key tile the d = 128 kernel
    // ran 1-2% slower at 8k-16k (H200, separate runs of the two builds).
    __device__ __forceinline__ bool kv_blocks() const {
        return (P.k_descale_strides[2] | P.v_descale_strides[2]) != 0;
    }
    // FP8: k's and v's factors of key tile nb, loaded before its S is waited for.
    struct TileDescales {
        float k, v;
    };
    __device__ __forceinline__ TileDescales tile_descales(int nb) const {
        if constexpr (K::FP8) {
            if (FP8_BLOCK % BN != 0 || !kv_blocks()) return {1.f, fp8_v};
            const int block = nb / (FP8_BLOCK / BN);
            return {__ldg(P.k_descale + fp8_k + block * P.k_descale_strides[2]),
                    __ldg(P.v_descale + fp8_vs + block * P.v_descale_strides[2])};
        }
        return {1.f, 1.f};
    }
    // P's registers held until the P V that reads them is done (sm90/wgmma_fp8.cuh). The
    // 16-bit kernels, measured without it and never seen wrong, keep their schedules.
    __device__ __forceinline__ void fence_pa() {
        if constexpr (K::FP8) sm90::fence_operand(pa[0]);
    }
    // P (S after the softmax) as the A operand of P V.
    __device__ __forceinline__ void pack_p(const float (&s)[1][NT][4]) {
        if constexpr (K::FP8)
            sm90::pack_a_fp8<NT>(s[0], pa[0]);
        else
            pack_a<T, 1, NT>(s, pa);
    }

    // Pingpong: warpgroup g issues its matmuls once barrier 1 + g completes, then lets the
    // next one (round robin) go. The last warpgroup arrives once before its first turn so
    // that warpgroup 0 starts; warpgroup 0 takes that arrival back after its last turn.
    __device__ __forceinline__ void take_turn() const {
        if (K::PINGPONG) tma::named_sync(1 + group, 128 * 2);
    }
    __device__ __forceinline__ void pass_turn() const {
        if (K::PINGPONG) tma::named_arrive(1 + (group + 1) % K::CONSUMERS, 128 * 2);
    }

    // S = Q K^T of the tile in slot st, issued (one commit group).
    // A k step spans 32 bytes of a panel row either way (k16, or k32 of e4m3).
    __device__ __forceinline__ void issue_s(float (&s)[1][NT][4], int st) const {
#pragma unroll
        for (int kk = 0; kk < K::DA * K::ELEM / 32; ++kk) {
            const uint64_t a = sm90::kmajor_desc(sm.q(qs) + group * 64 * 128, BM, kk);
            const uint64_t b = sm90::kmajor_desc(sm.k(st), BN, kk);
            if constexpr (K::FP8)
                sm90::WgmmaFp8<BN>::ss(s[0], a, b, kk > 0);
            else
                sm90::Wgmma<T, BN>::ss(s[0], a, b, kk > 0);
        }
        sm90::commit();
    }

    // FP8: k step kk of V^T in slot st, `rows` bytes into its panels (a half of the head dim):
    // in a full panel, or in the panel of the slot's last keys (WsSmem::vt_part).
    __device__ __forceinline__ uint64_t vt_desc(int st, int rows, int kk) const {
        // Key-major V from memory: panels of D rows of VT_PANEL_KEYS bytes.
        if constexpr (K::VT_GLOBAL)
            return sm90::kmajor_narrow_desc<K::VT_PANEL_KEYS>(
                sm.v(st) + rows / 128 * K::VT_PANEL_KEYS, D, kk);
        constexpr int FULL_STEPS = 4 * K::VT_FULL_PANELS;
        if (kk < FULL_STEPS) return sm90::kmajor_desc(sm.vt(st) + rows, D, kk);
        return sm90::kmajor_desc(sm.vt_part(st) + rows, D,
                                 sm.vt_part_key0(st) / 32 + kk - FULL_STEPS);
    }

    // O += P V of the tile in slot st, issued (one commit group). Head dims past 128 take
    // two halves of up to 128 columns (panels 0-1 and 2-3). With FP8, V^T's rows are the head
    // dim (K-major, a half is 128 of its rows). DA < D: O's columns from DA on stay zero.
    __device__ __forceinline__ void issue_pv(int st) {
        if constexpr (D > 128) {
            issue_pv_half<128>(st, 0);
            issue_pv_half<K::DA - 128>(st, 1);
        } else {
            issue_pv_half<K::DA>(st, 0);
        }
        sm90::commit();
    }
    template <int N> __device__ __forceinline__ void issue_pv_half(int st, int half) {
        float(&oh)[N / 8][4] = sm90::acc_cols<N>(o[0], half * 16);
#pragma unroll
        for (int kk = 0; kk < PV_STEPS; ++kk) {
            if constexpr (K::FP8)
                sm90::WgmmaFp8<N>::rs(oh, pa[0][kk], vt_desc(st, half * 128 * 128, kk), 1);
            else
                sm90::Wgmma<T, N>::rs(
                    oh, pa[0][kk], sm90::mnmajor_desc(sm.v(st) + half * 2 * BN * 128, BN, kk), 1);
        }
    }

    // Dropout (K::DROPOUT): the keep bits of this warp's entries of key tile nb, drawn while
    // its S runs (Philox is integer work, the tensor cores are busy), and P's dropped entries
    // zeroed after the row sums have counted them (FlashAttention-2 Algorithm 1 with dropout;
    // the 1 / (1 - p) goes with 1 / l when O is stored).
    // Philox calls in flight together, 8 entries each: 4, the most that kept the d = 64 and
    // 128 kernels free of spills (all 8: 144 and 104 bytes). With 4 entries a call, drawing
    // them all at once had been 1.05-1.20x faster than one at a time (H100;
    // docs/archive/PERF.md, "Philox calls in flight together" and "8 entries per Philox call,
    // laid out on the fragment").
    static constexpr int DROP_UNROLL = 4;
    __device__ __forceinline__ void draw_keep(uint32_t (&keep)[2], const WsTile<K>& w,
                                              int nb) const {
        if constexpr (K::DROPOUT)
            Dropout(p, w.bidb, w.bidh)
                .template keep_fragment<NT, false, DROP_UNROLL>(keep, w.m0 + warp_row0, nb * BN,
                                                                lane);
    }
    __device__ __forceinline__ void drop(float (&s)[1][NT][4], const uint32_t (&keep)[2]) const {
        if constexpr (K::DROPOUT) Dropout::zero_dropped<NT>(s[0], keep);
    }
    // 1 / l, times 1 / (1 - p) with dropout.
    __device__ __forceinline__ void finalize(int r, float* inv_sum, float* row_lse) const {
        // FP8's running maximum is in log2 units of the scaled scores (sm90/softmax_fp8.cuh).
        constexpr float LN2 = 0.6931471805599453f;
        softmax.finalize(0, r, K::FP8 ? LN2 : p.scale, inv_sum, row_lse);
        if constexpr (K::DROPOUT) *inv_sum *= p.rp_keep;
        if constexpr (K::FP8) {
            *inv_sum *= fp8_v;
            // The row sum carries P's 2^8; -inf stays.
            *row_lse -= FP8_P_SHIFT * LN2;
        }
    }

    // Each consumer warp arrives once its reads of the slot (its wgmmas) completed.
    __device__ __forceinline__ void release(uint32_t bar) const {
        if (lane == 0) tma::arrive(bar);
    }
    // The Q slot also holds the tile index every lane read.
    __device__ __forceinline__ void release_q() const {
        __syncwarp();
        release(sm.empty_q(qs));
    }

    // What the mask does to key tile nb, found before its S is issued: whether it masks any
    // entry, and the block mask's part (used only if it does and there is a block mask).
    struct TileMask {
        bool masked;
        uint64_t bits[1][2];
    };
    __device__ __forceinline__ TileMask tile_mask(const WsTile<K>& w, int nb, int state) const {
        TileMask m;
        m.masked = w.mask.template block_needs_mask<BN>(w.m0, w.q_last, nb * BN, state);
        if (w.mask.sparse && m.masked)
            w.mask.template sparse_bits<1, NT, false>(m.bits, w.m0 + warp_row0, nb * BN, lane);
        return m;
    }

    __device__ __forceinline__ void scores(float (&s)[1][NT][4], const WsTile<K>& w, int nb,
                                           const TileMask& m) {
        if constexpr (K::FP8) {  // causal or not, no window's left side (set_descales)
            if (m.masked) w.mask.template apply_right<NT>(s[0], w.m0 + warp_row0, nb * BN, lane);
            return;
        }
        if (cap_in_softmax(m)) return;
        // Two calls with constant `masked` (as in bwd_dkdv.cuh): the d = 256 `_mods` kernel
        // spilled 32 more bytes of loads with the test as argument.
        if (m.masked)
            w.mask.template apply<1, NT>(s, w.m0 + warp_row0, nb * BN, lane, true, 1, m.bits);
        else
            w.mask.template apply<1, NT>(s, w.m0 + warp_row0, nb * BN, lane, false);
    }

    // A softcap's bound replaces the running max where P's type holds the range that leaves
    // (bf16; AttnParams::softcap_max_log2): no max, no rescale. Not in the three-warpgroup
    // d = 64 kernel, whose 160 registers it cost a spill (12 -> 16 bytes) and ALiBi there 2-4%
    // (H100; docs/archive/PERF.md, "The softcap without a row max"), with no gain for the cap.
    static constexpr bool FIXED =
        (K::MODS & MODS_SCORES) && std::is_same_v<T, __nv_bfloat16> && K::CONSUMERS == 2;
    // A key tile without masked entries under a softcap without ALiBi takes its tanh in the
    // exponentials' loop (scores() skips it), each n8 tile's tanh tied to an earlier one's
    // exponentials (OnlineSoftmax: CAP, INTERLEAVE), under FIXED's bound or else a running max
    // taken from the raw scores. Apart, ptxas issued a warp's 64 MUFU.TANH back to back and
    // only then its exponentials; together the two kinds alternate with the adds between them
    // (d = 128 softcap forward 1.08x, causal 1.11x; H100; docs/archive/PERF.md, "The softcap's
    // tanh in the exponentials' loop"). Not in the block-mask kernels, which the tie's code
    // made slower even without a cap, nor in the three-warpgroup d = 64 one, which it made
    // spill 124 bytes (12 before; "Kept: the forward's tanh in the exponentials' loop under a
    // running max too").
    __device__ __forceinline__ bool cap_in_softmax(const TileMask& m) const {
        return K::MODS == MODS_SCORES && K::CONSUMERS == 2 && p.softcap_pre != 0.f &&
               p.alibi_slopes == nullptr && !m.masked;
    }

    // S becomes P and the softmax state `st` moves on; true if O needs the factors alpha once
    // the last P V is done.
    // FP8: `f` holds the tile's k and v factors.
    __device__ __forceinline__ bool exp_scores(OnlineSoftmax<1>& st, float (&s)[1][NT][4],
                                               float (&alpha)[1][2], const TileMask& m,
                                               const TileDescales& f) {
        if constexpr (K::FP8) {
            bool rescale = exp_and_factors_fp8(st, s, alpha, fp8_q_log2 * f.k);
            if (f.v != fp8_v) {  // per block: O moves to this tile's V factor
                const float ratio = fp8_v / f.v;
                alpha[0][0] *= ratio;
                alpha[0][1] *= ratio;
                fp8_v = f.v;
                rescale = true;
            }
            return rescale;
        }
        // seqlen_q is never negative: the ties' zero is 0.
        const float zero = __int_as_float(min(p.seqlen_q, 0));
        if (cap_in_softmax(m))
            return st.template exp_and_factors<FIXED, true, true>(
                s, alpha, p.scale_log2, p.softcap_max_log2, zero, p.softcap_pre);
        // The kernels whose exponentials ptxas ran back to back (OnlineSoftmax): 1.4-2.3%
        // faster; not dropout's or the block mask's, which the tie made 1.6-2.8% and 6.4%
        // slower (H100; docs/archive/PERF.md, "Why ptxas ran the exponentials back to back,
        // and a tie that stops it" and "The softcap's tanh in the exponentials' loop").
        constexpr bool INTERLEAVE =
            D == 64 && K::CONSUMERS == 2 && !K::DROPOUT && K::MODS == MODS_NONE;
        return st.template exp_and_factors<FIXED, INTERLEAVE>(s, alpha, p.scale_log2,
                                                              p.softcap_max_log2, zero);
    }

    // Where a work tile's O goes: kept from its last S to its store, which comes after the
    // next work tile's first S.
    struct OutTile {
        T* out;      // the (sequence, head)'s row 0
        float* lse;  // likewise
        int row0;    // this warp's first row
        int seqlen_q;
        // O's head and third coordinate for the TMA store: the batch, or in packed batches
        // (batch 0) the sequence's first row; -1 where a TMA box of this warpgroup's 64 rows
        // may not be stored: in packed batches where they cross the sequence's end (it would
        // write the next sequence's rows), and where they start before row 0 (END_ALIGNED; a
        // TMA store at a negative row is an illegal instruction). store_staged copies the
        // rows in [0, seqlen_q) instead.
        int bidh, tma_c;
    };
    __device__ __forceinline__ OutTile out_tile(const WsTile<K>& w) const {
        const int first = w.m0 + group * 64;  // the warpgroup's first row
        const bool copy =
            (K::PACKED && first + 64 > w.seq.seqlen_q) || (K::END_ALIGNED && first < 0);
        return {static_cast<T*>(p.o) + w.seq.q_offset(p.o_batch_stride, p.o_row_stride,
                                                      p.o_head_stride, w.bidb, w.bidh),
                p.lse + w.seq.lse_offset(p, w.bidb, w.bidh),
                w.m0 + warp_row0,
                w.seq.seqlen_q,
                w.bidh,
                copy ? -1 : K::PACKED ? w.seq.q_start : w.bidb};
    }

    // The block's next work tile with keys into w and its index into t (the last one's
    // before), its Q slot waited for; those without keys are written on the way (zeros, LSE
    // -inf). False past the last.
    __device__ __forceinline__ bool next_tile(WsTile<K>& w, int& q_uses, int& t, int tiles,
                                              bool dynamic) {
        for (;;) {
            t += gridDim.x;
            if (!dynamic && t >= tiles) return false;
            const QSlot<K> q(q_uses++);
            qs = q.st;
            tma::wait(sm.full_q(q.st), q.phase);
            if (dynamic) t = ld_shared(sm.tile(q.st));
            if (t >= tiles) return false;
            w = WsTile<K>(p, t, tiles, P.tail_heads);
            if (w.key_tiles() > 0) return true;
            release_q();
            store(out_tile(w), true);
        }
    }

    // Key tile (nb, state) of w that comes in slot `cur`, and whether another follows in w;
    // `first`: w's first (they go last first).
    __device__ __forceinline__ void key_tile(const WsTile<K>& w, const Slot<K>& cur, bool first,
                                             int& nb, int& state, bool& more) const {
        if constexpr (K::KEYS_FROM_PRODUCER) {
            tma::wait(sm.full_k(cur.st), cur.phase);
            const KeyInfo key = KeyInfo::unpack(ld_shared(sm.key(cur.st)));
            nb = key.nb;
            state = key.state;
            more = !key.last;
        } else {
            if (first) {
                nb = w.nb_end - 1;
                state = w.last_state;
            } else {
                nb = w.next(nb, &state);
            }
            more = w.next(nb) >= 0;
        }
    }

    // Whether this warpgroup passes over the key tiles its rows cannot see at the start of a
    // work tile (skip_masked). Not in the one-stream kernel (CARRY), whose 128 x 128 tiles
    // never have them with seqlen_q = seqlen_k, nor where the producer picks the tiles; nor
    // where it spilled (ptxas -v): the 80-key d = 256 kernels (0 -> 140 bytes, 11-18% slower,
    // H100) and the three-warpgroup `_mods` one (12 -> 140 bytes).
    static constexpr bool SKIP = !CARRY && !K::KEYS_FROM_PRODUCER && BN != 80 &&
                                 !(K::CONSUMERS == 3 && K::MODS != MODS_NONE);

    // The last key tile any of this warpgroup's 64 rows can see (Mask::key_blocks over its
    // rows), at least w's lowest. A work tile's key tiles reach its last row's; above this
    // warpgroup's, they are masked for all of its rows (the causal mask or a window's right
    // side, with the d = 64 three-warpgroup kernel's 192 x 128 tiles, d = 256's 128 x 64).
    __device__ __forceinline__ int last_visible(const WsTile<K>& w) const {
        const int first = w.m0 + group * 64;
        int begin, end;
        w.mask.template key_blocks<BN>(first, min(first + 63, w.q_last), &begin, &end);
        return max(end - 1, w.nb_begin);
    }

    // The key tile of slot `it`, entirely masked for this warpgroup: no S, softmax or P V.
    // It still waits for both tiles (every consumer keeps every slot's phase) and takes its
    // pingpong turn empty (the turns alternate strictly).
    __device__ __forceinline__ void skip_masked(int it) const {
        const Slot<K> s(it);
        tma::wait(sm.full_k(s.st), s.phase);
        take_turn();
        pass_turn();
        release(sm.empty_k(s.st));
        tma::wait(sm.pv_full(s.st), s.phase);
        release(sm.pv_empty(s.st));
    }

    // The first key tile of w that this warpgroup sees, from slot `it` (the tiles before it
    // passed over, `it` past them): its S alone, then its softmax.
    __device__ __forceinline__ void first_s(const WsTile<K>& w, int& it, int& nb, int& state,
                                            bool& more) {
        key_tile(w, Slot<K>(it), true, nb, state, more);
        if constexpr (SKIP) {
            // Without a block mask the key tiles go one by one, each of state 1.
            // A warpgroup's last row is at most BM - 64 rows before the work tile's.
            constexpr int MAX_SKIPPED = (BM - 64 + BN - 1) / BN;
            const int last = last_visible(w);
#pragma unroll
            for (int i = 0; i < MAX_SKIPPED; ++i)
                if (nb > last) {
                    skip_masked(it++);
                    more = --nb > w.nb_begin;
                }
        }
        const Slot<K> s0(it);
        const TileMask m = tile_mask(w, nb, state);
        float s[1][NT][4];
        if constexpr (!K::KEYS_FROM_PRODUCER) tma::wait(sm.full_k(s0.st), s0.phase);
        take_turn();
        sm90::fence();
        issue_s(s, s0.st);
        pass_turn();
        uint32_t keep[2];
        draw_keep(keep, w, nb);
        sm90::wait<0>();
        sm90::fence_operand(s[0]);
        release(sm.empty_k(s0.st));
        scores(s, w, nb, m);
        float alpha[1][2];
        if (exp_scores(softmax, s, alpha, m, tile_descales(nb))) softmax.rescale(o, alpha);
        drop(s, keep);
        pack_p(s);
    }

    // The next key tile of w (with `boundary`, its first: the last one was another work
    // tile's, whose O goes to `done` once its P V lands): its S and the last P V in flight
    // together, the softmax of S under the second.
    __device__ __forceinline__ void step(const WsTile<K>& w, int& it, int& nb, int& state,
                                         bool& more, bool boundary, const OutTile& done) {
        const Slot<K> prev(it), cur(it + 1);
        ++it;
        key_tile(w, cur, boundary, nb, state, more);
        const TileMask m = tile_mask(w, nb, state);
        float s[1][NT][4];
        if constexpr (!K::KEYS_FROM_PRODUCER) tma::wait(sm.full_k(cur.st), cur.phase);
        // V(j-1) came before K(j); waiting for it here keeps the two issues back to back
        // (ptxas fences between them if a wait loop separates them).
        tma::wait(sm.pv_full(prev.st), prev.phase);
        take_turn();
        sm90::fence_operand(o[0]);
        sm90::fence();
        issue_s(s, cur.st);
        issue_pv(prev.st);
        pass_turn();
        uint32_t keep[2];
        draw_keep(keep, w, nb);
        sm90::wait<WS_WAIT_S>();
        sm90::fence_operand(s[0]);
        release(sm.empty_k(cur.st));
        scores(s, w, nb, m);
        if (boundary) {
            OnlineSoftmax<1> next;
            float alpha[1][2];  // O starts over
            exp_scores(next, s, alpha, m, tile_descales(nb));
            pv_done(prev.st);
            store(done);
            zero(o);
            softmax = next;
        } else {
            float alpha[1][2];
            const bool rescale = exp_scores(softmax, s, alpha, m, tile_descales(nb));
            if constexpr (K::SOFTMAX_UNDER_PV) {
                if (rescale) {
                    pv_done(prev.st);
                    softmax.rescale(o, alpha);
                } else {
                    pv_done(prev.st);
                }
            } else {
                pv_done(prev.st);
                if (rescale) softmax.rescale(o, alpha);
            }
        }
        drop(s, keep);
        pack_p(s);
    }

    // The last P V, alone, from slot `it`.
    __device__ __forceinline__ void last_pv(int it) {
        const Slot<K> last(it);
        tma::wait(sm.pv_full(last.st), last.phase);
        take_turn();
        sm90::fence_operand(o[0]);
        sm90::fence();
        issue_pv(last.st);
        pass_turn();
        pv_done(last.st);
    }

    // The P V from slot st waited for (with every wgmma before it): O and P's registers are
    // final, the slot goes back.
    __device__ __forceinline__ void pv_done(int st) {
        sm90::wait<0>();
        sm90::fence_operand(o[0]);
        fence_pa();
        release(sm.pv_empty(st));
    }

    // Every work tile of the block (CARRY), their key tiles last first, in one stream: a work
    // tile's last P V goes out with the next one's first S (one pingpong turn, not two half
    // ones) and its O is stored once that lands, before the new tile's P is packed.
    __device__ __forceinline__ void work(int tiles, bool dynamic) {
        int it = 0, q_uses = 0, t = int(blockIdx.x - gridDim.x);  // key tiles, Q slots, tile
        int nb, state;
        bool more;  // a key tile of w after nb
        WsTile<K> w;
        if (!next_tile(w, q_uses, t, tiles, dynamic)) return;
        if (K::PINGPONG && group == K::CONSUMERS - 1)
            tma::named_arrive(1, 128 * 2);  // warpgroup 0 goes first
        zero(o);
        first_s(w, it, nb, state, more);
        OutTile done;  // the work tile whose last P is in pa
        for (;;) {
            if (!more) {
                release_q();  // every S of this tile is done
                done = out_tile(w);
                if (!next_tile(w, q_uses, t, tiles, dynamic)) break;
                step(w, it, nb, state, more, true, done);
            } else {
                step(w, it, nb, state, more, false, done);
            }
        }
        last_pv(it);
        store(done);
        finish();
        if (K::PINGPONG && group == 0) tma::named_sync(1, 128 * 2);  // the last arrival back
    }

    // One work tile on its own: its first S alone, its last P V alone.
    __device__ __forceinline__ void run(const WsTile<K>& w, int& it) {
        int nb, state;
        bool more;
        first_s(w, it, nb, state, more);
        while (more) step(w, it, nb, state, more, false, {});
        if constexpr (!K::O_IN_Q) release_q();  // every S of this tile is done
        last_pv(it++);
    }

    // O / l and the LSE; `empty`: a work tile whose rows see no key (zeros and LSE -inf,
    // whatever O holds). Through shared memory where the kernel has room for it, else (and for
    // empty tiles, which are rare) straight from registers (4-byte stores).
    __device__ __forceinline__ void store(const OutTile& to, bool empty = false) const {
        if constexpr (K::O_STAGED || K::O_IN_Q) {
            if (!empty) {
                store_staged(to);
                return;
            }
        }
        const int g = lane / 4, t = lane % 4;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float inv_sum = 0.f, row_lse = -INFINITY;
            if (!empty) finalize(r, &inv_sum, &row_lse);
            const int row = to.row0 + g + 8 * r;
            if (row < 0 || row >= to.seqlen_q) continue;
            if (t == 0) to.lse[row] = row_lse;
#pragma unroll
            for (int dt = 0; dt < DT; ++dt) {
                const int col = dt * 8 + 2 * t;
                if (col < p.d)
                    *reinterpret_cast<uint32_t*>(to.out + int64_t(row) * p.o_row_stride + col) =
                        empty ? 0u
                              : MmaOp<T>::pack(o[0][dt][2 * r] * inv_sum,
                                               o[0][dt][2 * r + 1] * inv_sum);
            }
        }
    }

    // Columns [ROUND * COLS, (ROUND + 1) * COLS) of O / l (COLS = D / K::O_ROUNDS) into the
    // stage and out (store_staged).
    template <int ROUND>
    __device__ __forceinline__ void store_round(const OutTile& to, uint32_t stage,
                                                const float (&inv)[2], bool leader) const {
        constexpr int PANEL_ROWS = K::O_PANEL_ROWS, ROUNDS = K::O_ROUNDS, COLS = D / ROUNDS;
        constexpr int COL0 = ROUND * COLS;
        const auto& part =
            *reinterpret_cast<const float(*)[DT / ROUNDS][4]>(&o[0][ROUND * DT / ROUNDS]);
        sm90::stage_fragments<T, PANEL_ROWS, DT / ROUNDS>(stage, part, warp_row0 - group * 64, 0,
                                                          inv[0], inv[1], lane);
        sm90::fence_proxy_async();
        tma::named_sync(EPILOGUE_BAR + group, 128);
        const int row0 = to.row0 - (warp_row0 - group * 64);  // the warpgroup's first row
        if (K::O_MAY_COPY && to.tma_c < 0) {
            // No TMA box (OutTile::tma_c): the rows in [0, seqlen_q), copied (the head dim is
            // a multiple of 8 wherever O has a tensor map; in rounds, the FP8 kernels' exact D).
            const int first = max(row0, 0), end = min(row0 + 64, to.seqlen_q);
            if (end > first)
                sm90::copy_panel_rows<T, PANEL_ROWS, COLS / 8>(
                    stage, first - row0, 0, end - first, ROUNDS == 1 ? p.d / 8 : COLS / 8,
                    to.out + int64_t(first) * p.o_row_stride + COL0, p.o_row_stride,
                    threadIdx.x % 128, 128);
        } else if (leader) {
            if constexpr (K::PACKED)
                tma::store_tile<PANEL_ROWS, COLS / 64>(P.o, stage, COL0, to.tma_c + row0, to.bidh,
                                                       0);
            else
                tma::store_tile<PANEL_ROWS, COLS / 64>(P.o, stage, COL0, row0, to.bidh, to.tma_c);
            tma::bulk_commit();
        }
    }

    // O / l into this warpgroup's panels of the staged tile (stmatrix, 16 bytes per
    // instruction and lane, no bank conflict), then one TMA store per panel, issued by the
    // warpgroup's first thread. With a tile of its own the warpgroup does not wait for it: the
    // next store's first barrier does, after that tile's key tiles. In the Q slot (O_IN_Q) it
    // waits until the store has read the rows, then hands the slot back. TMA clips rows past
    // seqlen_q and columns past the head dim (O's tensor map has the true extents). The LSE
    // from registers.
    __device__ __forceinline__ void store_staged(const OutTile& to) const {
        const bool leader = threadIdx.x % 128 == 0;
        const uint32_t stage = sm.o(group, qs);
        if (leader) tma::bulk_wait_read<0>();  // the last store has read the tile
        tma::named_sync(EPILOGUE_BAR + group, 128);
        float inv[2], row_lse[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) finalize(r, &inv[r], &row_lse[r]);
        store_round<0>(to, stage, inv, leader);
        if constexpr (K::O_ROUNDS > 1) {
            static_assert(K::O_ROUNDS == 2, "O in two halves");
            if (leader) tma::bulk_wait_read<0>();
            tma::named_sync(EPILOGUE_BAR + group, 128);
            store_round<1>(to, stage, inv, leader);
        }
        if constexpr (K::O_IN_Q) {
            if (leader) tma::bulk_wait_read<0>();
            tma::named_sync(EPILOGUE_BAR + group, 128);
            release_q();
        }
        if (lane % 4 == 0) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int q_row = to.row0 + lane / 4 + 8 * r;
                if (q_row >= 0 && q_row < to.seqlen_q)
                    to.lse[q_row] = row_lse[r];
            }
        }
    }

    // Before the block exits: its last TMA store done.
    __device__ __forceinline__ void finish() const {
        if ((K::O_STAGED || K::O_IN_Q) && threadIdx.x % 128 == 0) tma::bulk_wait_all();
    }
};

template <class K> __device__ __forceinline__ void flash_fwd_ws(const FwdTmaParams& P) {
    const AttnParams& p = P.a;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const WsSmem<K> sm{(smem_addr(smem_raw) + 1023) & ~1023u};  // swizzle atoms: 1 KB aligned
    const int tiles = (p.seqlen_q + K::BM - 1) / K::BM * p.h * p.b;
    // Unlike the backward's (a shuffle from lane 0, so that its descriptors stay on the
    // uniform datapath), not warp-uniform to the compiler: the shuffle cost this kernel 3% at
    // d 128 16k causal and gained nothing elsewhere beside the descriptor change
    // (docs/archive/PERF.md, "The backward against cuDNN under Nsight Compute; half of its
    // instructions built descriptors").
    const int tid = threadIdx.x, warpgroup = tid / 128;

    if (tid == 0) {
        for (int qs = 0; qs < K::Q_STAGES; ++qs) {
            tma::mbar_init(sm.full_q(qs), 1);
            tma::mbar_init(sm.empty_q(qs), 4 * K::CONSUMERS);
        }
        for (int st = 0; st < K::STAGES; ++st) {
            tma::mbar_init(sm.full_k(st), 1);
            tma::mbar_init(sm.full_v(st), 1);
            tma::mbar_init(sm.empty_k(st), 4 * K::CONSUMERS);
            // With FP8 the transposing warps read V; the consumers read V^T.
            tma::mbar_init(sm.empty_v(st), K::TRANSPOSE ? K::TRANSPOSERS : 4 * K::CONSUMERS);
            if constexpr (K::TRANSPOSE) {
                tma::mbar_init(sm.full_vt(st), K::TRANSPOSERS);
                tma::mbar_init(sm.empty_vt(st), 4 * K::CONSUMERS);
            }
        }
        tma::fence_barrier_init();
    }
    // Launched programmatically (src/cuda/fwd.rs): the set-up above overlaps the end of the
    // kernel before, whose outputs may be Q, K or V (or whose inputs O's memory held).
    pdl_wait();
    __syncthreads();

    if (warpgroup == 0) {
        tma::regs_dealloc<K::PRODUCER_REGS>();
        if (tid == 0) {
            const int loaded = ws_produce<K>(P, sm, tiles);
            if constexpr (K::TRANSPOSE) end_v_stream<K>(sm, loaded);
            // No more loads: the next kernel's blocks may take the SMs this grid leaves.
            pdl_launch_dependents();
        } else if constexpr (K::TRANSPOSE) {
            if (tid >= 32) ws_transpose<K>(sm, tid - 32);
        }
        return;
    }
    tma::regs_alloc<K::CONSUMER_REGS>();
    const int group = warpgroup - 1;
    WsConsumer<K> c{P, p, sm, group, group * 64 + (tid % 128) / 32 * 16, tid % 32, 0, {}, {}, {}};
    const bool dynamic = P.tile_counter != nullptr;
    if constexpr (WsConsumer<K>::CARRY) {
        c.work(tiles, dynamic);
        return;
    }
    bool started = false;  // took a pingpong turn yet
    for (int it = 0, q_uses = 0, t = blockIdx.x;; ++q_uses, t += gridDim.x) {
        if (!dynamic && t >= tiles) break;
        const QSlot<K> qs(q_uses);
        c.qs = qs.st;
        tma::wait(sm.full_q(qs.st), qs.phase);
        if (dynamic) t = ld_shared(sm.tile(qs.st));
        if (t >= tiles) break;
        const WsTile<K> w(p, t, tiles, P.tail_heads);
        c.set_descales(w);
        zero(c.o);
        c.softmax = OnlineSoftmax<1>();
        // A tile without keys: zeros and LSE -inf from registers, its Q slot released here
        // (store_staged releases it with O_IN_Q).
        const bool empty = w.key_tiles() == 0;
        if (!empty) {
            if (K::PINGPONG && !started && group == K::CONSUMERS - 1)
                tma::named_arrive(1, 128 * 2);  // warpgroup 0 goes first
            started = true;
            c.run(w, it);
        } else {
            c.release_q();
        }
        c.store(c.out_tile(w), empty);
    }
    c.finish();
    if (K::PINGPONG && started && group == 0) tma::named_sync(1, 128 * 2);
}

#ifndef CANDLE_FLASH_WS_PINGPONG
#define CANDLE_FLASH_WS_PINGPONG true  // -DCANDLE_FLASH_WS_PINGPONG=false: the A/B build
#endif
// The kernels of this file: one per row of cuda/catalogue.rs (generated by build.rs).
#include "instances/sm90_fwd_ws.inc"
