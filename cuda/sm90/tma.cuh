// Hopper's asynchronous data movement for the warp-specialized kernels (sm_90a): tensor
// memory access (TMA) copies of whole tiles, the mbarriers that count their bytes, named
// barriers between warpgroups and register reallocation between them.
//
// A TMA copy of a 64-column box with the 128-byte swizzle lands in shared memory in exactly
// the panel layout of wgmma.cuh (chunk ^ row % 8 within 1 KB atoms), so the same matrix
// descriptors read it.
#pragma once
#include <cstdint>

// A CUtensorMap, encoded on the host (src/cuda/tma.rs) and passed inside a __grid_constant__
// kernel parameter: the TMA unit reads it from parameter space, no copy to global memory.
struct alignas(64) TmaDesc {
    uint64_t opaque[16];
};

namespace tma {

__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}

// Barrier initialisation must be visible to the async proxy before a copy signals one.
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival that also announces `bytes` of copies that will complete on the barrier.
__device__ __forceinline__ void arrive_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Waits for the completion of the barrier's phase of parity `phase`. A fresh barrier is in
// phase 0, so waiting for parity 1 returns at once: producers start there on empty slots.
__device__ __forceinline__ void wait(uint32_t bar, int phase) {
    asm volatile(
        "{\n.reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" ::"r"(bar),
        "r"(phase)
        : "memory");
}

// Copies the box at element coordinates (c0 = column, c1 = row, c2 = head, c3 = batch) of
// `desc`'s tensor to `dst`; completion counts the box's bytes on `bar`. Coordinates past the
// tensor's extent read as zero.
__device__ __forceinline__ void load_4d(uint32_t dst, const TmaDesc& desc, uint32_t bar, int c0,
                                        int c1, int c2, int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%3, %4, %5, %6}], [%2];\n" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(&desc)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}

// Copies the box at `src` (shared memory, the layout load_4d writes) to element coordinates
// (c0, c1, c2, c3) of `desc`'s tensor; coordinates past the tensor's extent are not written.
// Part of this thread's current bulk group (bulk_commit, then bulk_wait_read before `src` is
// written again). Shared-memory writes of other threads need fence_proxy_async (wgmma.cuh)
// and a barrier first.
__device__ __forceinline__ void store_4d(const TmaDesc& desc, uint32_t src, int c0, int c1, int c2,
                                         int c3) {
    asm volatile(
        "cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
            reinterpret_cast<uint64_t>(&desc)),
        "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
        : "memory");
}

// Copies `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared
// memory like a tensor copy, completing on `bar`. A value the issuing thread wrote to `src`
// needs fence_proxy_global() first.
__device__ __forceinline__ void load_bulk(uint32_t dst, const void* src, uint32_t bytes,
                                          uint32_t bar) {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
            dst),
        "l"(src), "r"(bytes), "r"(bar)
        : "memory");
}

// Orders this thread's generic-proxy global writes before its later async-proxy reads.
__device__ __forceinline__ void fence_proxy_global() {
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
}

// Adds `bytes` of f32 values (a multiple of 16, both addresses 16-byte aligned) from shared
// memory into global memory, element by element, in L2: no thread issues an atomic. Part of
// this thread's current bulk group (bulk_commit, then bulk_wait_read before the source is
// written again). Shared-memory writes of other threads need fence_proxy_async (wgmma.cuh)
// and a barrier first.
__device__ __forceinline__ void reduce_add_bulk(float* dst, uint32_t src, uint32_t bytes) {
    asm volatile(
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
        "r"(src), "r"(bytes)
        : "memory");
}
// Copies `bytes` (a multiple of 16, both addresses 16-byte aligned) from shared to global
// memory; a bulk group like reduce_add_bulk.
__device__ __forceinline__ void store_bulk(void* dst, uint32_t src, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst),
                 "r"(src), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() {
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
// Waits until at most N of this thread's bulk groups still read their shared-memory source.
template <int N> __device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// Waits until this thread's bulk groups are complete (their global writes done).
__device__ __forceinline__ void bulk_wait_all() {
    asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

// A ROWS x (COLS PANELS) tile of one head at (row, head, batch), one box per panel of COLS
// columns (128 bytes: 64 16-bit or 128 8-bit elements), into consecutive panels at `dst` (the
// layout of wgmma.cuh).
template <int ROWS, int PANELS, int COLS = 64>
__device__ __forceinline__ void load_tile(uint32_t dst, const TmaDesc& desc, uint32_t bar, int row,
                                          int head, int batch) {
#pragma unroll
    for (int panel = 0; panel < PANELS; ++panel)
        load_4d(dst + panel * ROWS * 128, desc, bar, panel * COLS, row, head, batch);
}

// A key tile of V given transposed (V^T: rows are the head dim, keys contiguous) as PANELS
// boxes of PANEL_KEYS keys x ROWS head-dim rows, each swizzled at its width (the tensor
// map's), one after another from `dst`: keys key0 + PANEL_KEYS p .. of (head, batch). What
// the e4m3 P V reads as its K-major B operand (wgmma.cuh: kmajor_narrow_desc) without a
// transpose in shared memory.
template <int ROWS, int PANELS, int PANEL_KEYS>
__device__ __forceinline__ void load_vt_tile(uint32_t dst, const TmaDesc& desc, uint32_t bar,
                                             int key0, int head, int batch) {
#pragma unroll
    for (int panel = 0; panel < PANELS; ++panel)
        load_4d(dst + panel * ROWS * PANEL_KEYS, desc, bar, key0 + panel * PANEL_KEYS, 0, head,
                batch);
}

// The inverse of load_tile: PANELS boxes of 64 columns, the panels PANEL_ROWS rows apart from
// `src`, to columns from col0 (a multiple of 64) of (row, head, batch) (the box's rows are
// the tensor map's).
template <int PANEL_ROWS, int PANELS>
__device__ __forceinline__ void store_tile(const TmaDesc& desc, uint32_t src, int col0, int row,
                                           int head, int batch) {
#pragma unroll
    for (int panel = 0; panel < PANELS; ++panel)
        store_4d(desc, src + panel * PANEL_ROWS * 128, col0 + panel * 64, row, head, batch);
}

// Named barriers 1..15 (0 is __syncthreads): `threads` arrivals complete one; `sync` waits
// for that, `arrive` does not.
__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Moves registers between warpgroups: every warp of a warpgroup runs the same one. The
// producer gives up what its copies do not need, the consumers take it for their
// accumulators.
template <int N> __device__ __forceinline__ void regs_dealloc() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N> __device__ __forceinline__ void regs_alloc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

}  // namespace tma
