// Row addressing of the KV cache for the append and decode kernels (contiguous or paged), and
// the decode kernel's per-warp tile copies.
#pragma once
#include "common/copy.cuh"
#include "decode/params.cuh"

// Row addressing of a (possibly paged) cache for one sequence and K/V head.
// A block-table entry as a page of the pool: entries are u32 on the host side, and a device
// table is read unchecked, so anything past the pool reads (or writes) its last page rather
// than memory outside it.
__device__ __forceinline__ int clamp_page(int entry, int num_pages) {
    return unsigned(entry) < unsigned(num_pages) ? entry : num_pages - 1;
}

// A sequence's capacity in tokens: a contiguous cache passes it as page_size.
__device__ __forceinline__ int cache_capacity(const int* block_table, int max_pages,
                                              int page_size) {
    return block_table != nullptr ? max_pages * page_size : page_size;
}

struct CacheRows {
    const int* block_table;  // null: the sequence's rows are contiguous in slice `b`
    int max_pages, page_size, b, h_k;
    int num_pages;  // paged: entries past the pool (a device table is not checked) are clamped

    // Address of row j (a token position).
    template <typename T>
    __device__ __forceinline__ T* row(T* cache, int64_t page_stride, int64_t row_stride,
                                      int64_t head_stride, int j) const {
        int64_t page = b;
        int r = j;
        if (block_table != nullptr) {
            page = clamp_page(block_table[int64_t(b) * max_pages + j / page_size], num_pages);
            r = j % page_size;
        }
        return cache + page * page_stride + int64_t(r) * row_stride + h_k * head_stride;
    }
};

// 16 bytes global -> shared at a shared-window address; `bytes` < 16 zero-fills the rest.
__device__ __forceinline__ void cp_async_16_to(uint32_t dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_16_to(uint32_t dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(bytes));
}

// A copy of `x` the compiler cannot see through (see `opaque` in mma.cuh): the per-copy row
// offsets are loop invariant, and hoisting all of them out of the key loop costs two
// registers each.
__device__ __forceinline__ int64_t opaque64(int64_t x) {
    asm volatile("mov.b64 %0, %0;\n" : "+l"(x));
    return x;
}

// The decode kernel's K/V tiles in shared memory are SwizzledRows (common/copy.cuh): padded
// rows would move every other row's copied sectors twice.

// One warp copies a BN x D tile whose rows are `row_stride` apart in global memory into a
// SwizzledRows tile. Each lane keeps one 16-byte column of the tile and walks down the rows,
// so a copy is one 64-bit pointer step and one cp.async: no per-chunk row arithmetic. Rows of
// D / 8 chunks are spread over LPR lanes (a power of two, so each lane's column is fixed);
// lanes past the last chunk of a row (head dims 96, 160, 192, 224) copy nothing. A lane's
// rows are row + i * RSTEP with row < RSTEP <= 8 and RSTEP a power of two: the steps
// SwizzledRows::chunk_at places with one XOR with a constant per unrolled copy.
template <typename T, int BN, int D> struct WarpTileCopy {
    using Rows = SwizzledRows<D>;
    static constexpr int CPR = D / CHUNK;
    static constexpr int LPR = CPR <= 4 ? 4 : CPR <= 8 ? 8 : CPR <= 16 ? 16 : 32;
    static constexpr int RSTEP = 32 / LPR;  // rows between a lane's copies
    static constexpr int PASSES = BN / RSTEP;
    static_assert(CPR <= 32 && BN % RSTEP == 0 && RSTEP <= 8, "one warp-wide pass covers whole rows");

    int row, chunk;  // this lane's first row and its (logical) 16-byte column

    __device__ __forceinline__ explicit WarpTileCopy(int lane) : row(lane / LPR), chunk(lane % LPR) {}

    __device__ __forceinline__ bool active() const { return CPR == LPR || chunk < CPR; }

    // Shared address of this lane's i-th copy in the tile at `smem`.
    __device__ __forceinline__ uint32_t dst(uint32_t smem, int i) const {
        return Rows::chunk_at(smem, row, i * RSTEP, chunk);
    }

    // All BN rows and D columns exist.
    __device__ __forceinline__ void full(T* smem, const T* tile, int64_t row_stride) const {
        if (!active()) return;
        const T* src = tile + row * row_stride + chunk * CHUNK;
        const uint32_t base = smem_addr(smem);
        const int64_t step = opaque64(RSTEP * row_stride);
#pragma unroll
        for (int i = 0; i < PASSES; ++i, src += step) cp_async_16_to(dst(base, i), src);
    }

    // Rows found one by one (pages shorter than a tile): lane r < BN holds the address of K
    // row r and lane BN + r that of V row r, or null past the end, and shuffles hand them to
    // the copying lanes. Missing rows and columns at or past `cols_valid` are zero-filled.
    __device__ __forceinline__ void gathered(T* sk, T* sv, const T* my_row, const T* fallback,
                                             int cols_valid) const {
        static_assert(2 * BN == 32, "one lane per K row and one per V row");
        const uint32_t dk = smem_addr(sk), dv = smem_addr(sv);
        const int col = chunk * CHUNK;
        const bool col_ok = active() && col < cols_valid;
        const uint64_t mine = reinterpret_cast<uint64_t>(my_row);
#pragma unroll
        for (int i = 0; i < PASSES; ++i) {
            const int r = row + i * RSTEP;
            const T* k = reinterpret_cast<const T*>(__shfl_sync(0xffffffff, mine, r));
            const T* v = reinterpret_cast<const T*>(__shfl_sync(0xffffffff, mine, BN + r));
            if (!active()) continue;
            const bool k_ok = col_ok && k != nullptr, v_ok = col_ok && v != nullptr;
            cp_async_16_to(dst(dk, i), k_ok ? k + col : fallback, k_ok ? 16 : 0);
            cp_async_16_to(dst(dv, i), v_ok ? v + col : fallback, v_ok ? 16 : 0);
        }
    }

    // Rows at or past `rows_valid` and columns at or past `cols_valid` are zero-filled (they
    // name row 0, a valid address, and read nothing).
    __device__ __forceinline__ void partial(T* smem, const T* tile, int64_t row_stride,
                                            int rows_valid, int cols_valid) const {
        if (!active()) return;
        const T* src = tile + row * row_stride + chunk * CHUNK;
        const uint32_t base = smem_addr(smem);
        const int64_t step = opaque64(RSTEP * row_stride);
        const bool col_ok = chunk * CHUNK < cols_valid;
#pragma unroll
        for (int i = 0; i < PASSES; ++i, src += step) {
            const bool ok = col_ok && row + i * RSTEP < rows_valid;
            cp_async_16_to(dst(base, i), ok ? src : tile, ok ? 16 : 0);
        }
    }
};
