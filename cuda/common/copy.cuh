// Global -> shared tile copies with cp.async (16-byte chunks, zero-filled out of bounds), and
// the padded shared-memory tile layout.
//
// Tiles are row-major with rows of D + PAD elements: a row pitch of 2D + 16 bytes puts the
// eight 16-byte rows an ldmatrix reads into eight different bank groups, for every head dim
// (a XOR swizzle needs D / 8 to be a multiple of 8, which 40, 96, 160, 224 are not).
#pragma once
#include <climits>
#include <cstdint>

#include "common/mma.cuh"

constexpr int SMEM_PAD = 8;         // elements added to each shared-memory row
constexpr int CHUNK = 8;            // 16-bit elements per 16-byte copy

// 16 bytes global -> shared; when !valid the destination is zero-filled and nothing is read.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
                 "l"(src), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// 16 bytes global -> shared, in bounds.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src));
}

// Copies rows [0, ROWS) x columns [0, D) of a global tile into a padded shared tile. Rows at or
// past `rows_valid` and columns at or past `cols_valid` (a multiple of 8) read as zero, so the
// tensor-core math on a partial tile adds nothing and never sees garbage.
//
// A whole tile (every row and column valid; the common case) takes a path without bounds: each
// thread copies the same column of rows tid / CHUNKS_PER_ROW + i * ROWS_PER_PASS, one base
// address plus a constant step per chunk. Per-chunk index math, bounds checks and selects
// were a large part of the forward's integer instructions (Nsight Compute, SASS, H100,
// d = 128: 44 M against FlashAttention-2's 5 M), which FA2's precomputed copy partitions do
// not pay. Measured: +1-7% forward (causal, d = 64), +1-5% backward (docs/archive/PERF.md,
// "the sm_80 set next to FlashAttention-2, counter by counter").
template <typename T, int ROWS, int D, int NTHREADS>
__device__ __forceinline__ void load_tile(T* smem, const T* gmem, int64_t row_stride,
                                          int rows_valid, int cols_valid, int tid) {
    constexpr int CHUNKS_PER_ROW = D / CHUNK;
    constexpr int CHUNKS = ROWS * CHUNKS_PER_ROW;
    static_assert(CHUNKS % NTHREADS == 0, "tile chunks must split evenly over the threads");
    if constexpr (NTHREADS % CHUNKS_PER_ROW == 0) {
        // 32-bit offsets within the tile (the usual case by far) hold fewer registers.
        if (rows_valid >= ROWS && cols_valid >= D && row_stride <= INT_MAX / ROWS) {
            constexpr int ROWS_PER_PASS = NTHREADS / CHUNKS_PER_ROW;
            const int stride = int(row_stride);
            const int row = tid / CHUNKS_PER_ROW, col = (tid % CHUNKS_PER_ROW) * CHUNK;
            const T* src = gmem + (row * stride + col);
            T* dst = smem + row * (D + SMEM_PAD) + col;
#pragma unroll
            for (int i = 0; i < CHUNKS / NTHREADS; ++i)
                cp_async_16(dst + i * ROWS_PER_PASS * (D + SMEM_PAD),
                            src + i * ROWS_PER_PASS * stride);
            return;
        }
    }
#pragma unroll
    for (int i = 0; i < CHUNKS / NTHREADS; ++i) {
        const int c = tid + i * NTHREADS;
        const int row = c / CHUNKS_PER_ROW;
        const int col = (c % CHUNKS_PER_ROW) * CHUNK;
        const bool valid = row < rows_valid && col < cols_valid;
        const T* src = valid ? gmem + row * row_stride + col : gmem;
        cp_async_16(smem + row * (D + SMEM_PAD) + col, src, valid);
    }
}

// Like load_tile, for tiles whose rows are not evenly spaced (GQA-packed query rows, paged
// K/V rows): `row_ptr(row)` returns the global address of a row, or nullptr past the end.
// Zero-filled chunks still name `fallback`, a valid address: nothing is read from it, but
// tools that instrument cp.async (compute-sanitizer racecheck) may look at it.
template <typename T, int ROWS, int D, int NTHREADS, class RowPtr>
__device__ __forceinline__ void load_rows(T* smem, const RowPtr& row_ptr, const T* fallback,
                                          int cols_valid, int tid) {
    constexpr int CHUNKS_PER_ROW = D / CHUNK;
    constexpr int CHUNKS = ROWS * CHUNKS_PER_ROW;
#pragma unroll
    for (int i = 0; i < (CHUNKS + NTHREADS - 1) / NTHREADS; ++i) {
        const int c = tid + i * NTHREADS;
        if (CHUNKS % NTHREADS != 0 && c >= CHUNKS) break;  // small tiles: not every thread copies
        const int row = c / CHUNKS_PER_ROW;
        const int col = (c % CHUNKS_PER_ROW) * CHUNK;
        const T* src = row_ptr(row);
        const bool valid = src != nullptr && col < cols_valid;
        cp_async_16(smem + row * (D + SMEM_PAD) + col, valid ? src + col : fallback, valid);
    }
}
