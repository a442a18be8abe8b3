// Global -> shared tile copies with cp.async (16-byte chunks, zero-filled out of bounds), and
// the two shared-memory tile layouts the ldmatrix readers know.
#pragma once
#include <climits>
#include <cstdint>

#include "common/mma.cuh"

constexpr int SMEM_PAD = 8;         // elements added to each shared-memory row
constexpr int CHUNK = 8;            // 16-bit elements per 16-byte copy

// Row-major tiles whose rows are PITCH elements apart, chunks in place: with PITCH = D + 8
// (PaddedRows) the eight 16-byte rows an ldmatrix reads fall into eight different bank
// groups for every head dim. The price is in the copies: a padded row starts 16 bytes off a
// 32-byte boundary every other row, and a cp.async whose 32-byte global sector lands across
// such a boundary moves that sector twice (SwizzledRows below).
//
// A layout gives an ldmatrix lane its base address (lane_base: the lane's row inside the
// tile and its chunk, 0 or 1) and the address of the fragment `row0` rows and `c0` chunks on
// (at; row0 a multiple of 8, c0 even, both compile-time in the unrolled loops), and a copy
// the element offset of (row, col), col a multiple of CHUNK.
template <int PITCH_> struct PitchRows {
    static constexpr int PITCH = PITCH_;
    static constexpr int ROW_PERIOD = 1;  // rows after which offset()'s column mapping repeats
    __device__ __forceinline__ static int offset(int row, int col) { return row * PITCH + col; }
    template <typename T>
    __device__ __forceinline__ static uint32_t lane_base(const T* tile, int row, int chunk) {
        return opaque(smem_addr(tile + row * PITCH + chunk * CHUNK));
    }
    template <typename T>
    __device__ __forceinline__ static uint32_t at(uint32_t base, int row0, int c0) {
        return base + (row0 * PITCH + c0 * CHUNK) * sizeof(T);
    }
};
template <int D> using PaddedRows = PitchRows<D + SMEM_PAD>;

// Rows of D rounded up to eight 16-byte chunks, so that every row starts on a 128-byte
// boundary, with chunk c of row r stored at chunk c ^ (r % 8): the eight rows an ldmatrix
// reads still hit eight different bank groups, and every copied sector lands whole.
// Measured with a probe streaming K as the decode kernel does (H200, ncu): padded rows
// 6.29 M sectors and 2.75 M L2 requests for 4.19 M sectors of data, 3.9 TB/s; swizzled rows
// 4.19 M sectors, 1.05 M requests, 4.0 TB/s. The sm_80 d 128 forward's copies: 1.5x the
// sectors padded (docs/archive/PERF.md, "the sm_80 kernels' tiles in swizzled rows").
// Tiles must start on a 128-byte boundary.
template <int D> struct SwizzledRows {
    static constexpr int CHUNKS = (D / CHUNK + 7) / 8 * 8;  // 16-byte chunks per row
    static constexpr int PITCH = CHUNKS * CHUNK;             // elements per row
    static constexpr int ROW_BYTES = PITCH * 2;              // 16-bit elements
    static constexpr int ROW_PERIOD = 8;
    __device__ __forceinline__ static int offset(int row, int col) {
        return row * PITCH + (col ^ ((row & 7) * CHUNK));
    }
    // Shared address of 16-byte chunk `chunk` of row `row + step` of the tile at `base`, for a
    // row below 8 and a step that is a multiple of a power of two above it: the sum's swizzle
    // is then row's XOR step's, so a copy that walks a lane down the rows pays one XOR with a
    // constant a row.
    __device__ __forceinline__ static uint32_t chunk_at(uint32_t base, int row, int step,
                                                        int chunk) {
        return base + (row + step) * ROW_BYTES + (((chunk ^ row) ^ (step & 7)) << 4);
    }
    // The swizzle sits in address bits 4-6, so a chunk is placed by an XOR of those bits:
    // `tile` may point a few chunks into its rows (a warp's columns) as long as those, the
    // lane's chunk (0 or 1) and at()'s c0 have no low bits in common, as every caller's
    // powers of two do; the rest of c0 is an add that folds into ldmatrix's immediate.
    template <typename T>
    __device__ __forceinline__ static uint32_t lane_base(const T* tile, int row, int chunk) {
        return opaque(smem_addr(tile + row * PITCH) ^ ((chunk ^ (row & 7)) << 4));
    }
    template <typename T>
    __device__ __forceinline__ static uint32_t at(uint32_t base, int row0, int c0) {
        return (base ^ ((c0 & 7) << 4)) + row0 * ROW_BYTES + ((c0 & ~7) << 4);
    }
};

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
template <typename T, int ROWS, int D, int NTHREADS, class L = PaddedRows<D>>
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
            // A pass that moves the rows by less than the layout's period changes its column
            // mapping: one destination per phase of the period, each stepping a period on.
            constexpr int PHASES =
                ROWS_PER_PASS % L::ROW_PERIOD == 0 ? 1 : L::ROW_PERIOD / ROWS_PER_PASS;
            static_assert(PHASES == 1 || L::ROW_PERIOD % ROWS_PER_PASS == 0, "whole phases");
            T* dst[PHASES];
#pragma unroll
            for (int j = 0; j < PHASES; ++j)
                dst[j] = smem + L::offset(row + j * ROWS_PER_PASS, col);
#pragma unroll
            for (int i = 0; i < CHUNKS / NTHREADS; ++i)
                cp_async_16(dst[i % PHASES] + i / PHASES * PHASES * ROWS_PER_PASS * L::PITCH,
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
        cp_async_16(smem + L::offset(row, col), src, valid);
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
