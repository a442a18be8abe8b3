// Who writes a dq_accum tile first (the warp-specialized backward, cuda/sm90/bwd_ws.cu).
// Every key block adds its dQ into the query tiles it sees, in no fixed order. Rather than
// zero the whole f32 buffer beforehand (a pass over 2x the size of dq), the first block to
// reach a tile stores into it and the others add once that store is complete. Each tile has
// one state word, zeroed by the prep kernel: the number of blocks that have claimed the tile,
// with bit 31 set once the first one's store is complete. A tile whose word is still 0 after
// the kernel was never written (no key reached it) and reads as zero in the convert kernel.
//
// The first block waits only for its own store, never for another block, so no block waits
// in a cycle; the others wait for one store (~1-2 us), and with the staggered walk of
// bwd_ws_walk they seldom arrive while it runs.
//
// Deterministic mode (`BwdTmaParams::deterministic`) orders the blocks instead: the key blocks
// that see a query tile add into it one at a time from the last, so each element of dq_accum
// sums the same values in the same order on every run. The state word then holds one past the
// index of the key block that added last (0: none yet); block n waits until it reads m + 1,
// m the next key block above n that sees the tile. Without a block mask those blocks are
// consecutive (Mask::query_blocks: both ends grow with the key block), so m = n + 1
// (bwd_ws_walk's order in this mode keeps each wait to about one add's latency); under one,
// the block mask's next present column (DqOrder::sparse_turn). A block
// waits only for higher-numbered blocks of its own (sequence, KV head), which start before
// it (BwdWsBlock::launch_order starts each pair's key blocks from the last; the hardware
// starts blocks in launch-index order, which CUDA does not promise but FlashAttention-3's
// deterministic backward relies on too), so the chain always ends at a running or finished
// block.
#pragma once

constexpr unsigned DQ_TILE_WRITTEN = 0x80000000u;

// Claims the tile: true for the first block to arrive, which must store, then publish.
__device__ __forceinline__ bool dq_tile_claim(int* state) { return atomicAdd(state, 1) == 0; }

// After the first block's bulk store has completed (bulk_wait_all): its writes, made by the
// async proxy, become visible to the blocks that acquire the state word.
__device__ __forceinline__ void dq_tile_publish(int* state) {
    asm volatile(
        "fence.proxy.async.global;\n"
        "red.release.gpu.global.or.b32 [%0], %1;\n" ::"l"(state),
        "r"(DQ_TILE_WRITTEN)
        : "memory");
}

// Before a later block's bulk reduce-add into the tile: waits until the first one published.
__device__ __forceinline__ void dq_tile_wait_written(const int* state) {
    unsigned s;
#pragma unroll 1
    while (true) {
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(s) : "l"(state) : "memory");
        if (s & DQ_TILE_WRITTEN) break;
        __nanosleep(64);
    }
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// Deterministic mode: waits until the state word reads `turn`, one past the key block that
// adds before this one (its add complete and published by dq_tile_pass_turn). A wait past
// 2^24 polls (seconds; a turn comes within one block's run) traps rather than hangs.
__device__ __forceinline__ void dq_tile_wait_turn(const int* state, int turn) {
    int s;
#pragma unroll 1
    for (unsigned polls = 0;; ++polls) {
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(s) : "l"(state) : "memory");
        if (s == turn) break;
        if (polls == (1u << 24)) __trap();
        __nanosleep(64);
    }
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// Deterministic mode: after this block's bulk store or reduce-add into the tile has
// completed (bulk_wait_all), hands the tile to the next key block.
__device__ __forceinline__ void dq_tile_pass_turn(int* state, int key_block) {
    asm volatile(
        "fence.proxy.async.global;\n"
        "st.release.gpu.global.b32 [%0], %1;\n" ::"l"(state),
        "r"(key_block + 1)
        : "memory");
}
