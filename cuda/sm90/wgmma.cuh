// Hopper warpgroup matrix multiply (wgmma.mma_async, sm_90a) for sm90/fwd.cu and
// sm90/bwd.cu: shared-memory matrix descriptors over 128-byte-swizzled tiles, and the
// instruction shapes they need. A warpgroup is 4 warps (128 threads) computing a 64-row tile;
// warp w of the group holds rows 16w..16w+15 in the mma.sync C layout (mma.cuh), one n8 tile
// after another, so the mma.sync kernels' softmax, mask and pack_a code applies unchanged.
//
// Tile layout in shared memory ("panels"): a ROWS x D tile is D/64 panels of ROWS x 64
// elements; each 128-byte row of a panel holds its eight 16-byte chunks in the order
// chunk ^ (row % 8) (the 128B swizzle the hardware undoes). Panels start 1024-byte aligned.
// The same layout serves as the K-major A/B operand (Q, K: rows are m or n, contiguous k)
// and as the MN-major operand (V: rows are k = keys, contiguous n = head dim).
#pragma once
#include <cstdint>

#include "common/copy.cuh"
#include "common/mma.cuh"

namespace sm90 {

constexpr int ATOM_BYTES = 1024;  // 8 rows x 128 bytes: one swizzle atom

// The n8 tiles [t0, t0 + N / 8) of an accumulator array as the d operand of an m64nN wgmma:
// a product over part of the columns (a half of d 256's O; the head dim's columns of d 128's
// tiles at d 80 and 96).
template <int N, int NT>
__device__ __forceinline__ float (&acc_cols(float (&acc)[NT][4], int t0 = 0))[N / 8][4] {
    static_assert(N % 8 == 0 && N / 8 <= NT, "whole n8 tiles within the accumulators");
    return *reinterpret_cast<float(*)[N / 8][4]>(&acc[t0]);
}

// Byte offset of (row, 16-byte chunk c of the row's D / 8) in a ROWS-row panel tile.
template <int ROWS>
__device__ __forceinline__ uint32_t panel_offset(int row, int c) {
    const int panel = c / 8, chunk = c % 8;
    return panel * ROWS * 128 + row * 128 + ((chunk ^ (row % 8)) * 16);
}

// Copies rows [0, ROWS) x columns [0, D) of a global tile into a panel tile with cp.async.
// Rows at or past rows_valid, columns at or past cols_valid read as zero.
template <typename T, int ROWS, int D, int NTHREADS>
__device__ __forceinline__ void load_panels(uint32_t smem, const T* gmem, int64_t row_stride,
                                            int rows_valid, int cols_valid, int tid) {
    constexpr int CHUNKS_PER_ROW = D / CHUNK;
    constexpr int CHUNKS = ROWS * CHUNKS_PER_ROW;
#pragma unroll
    for (int i = 0; i < (CHUNKS + NTHREADS - 1) / NTHREADS; ++i) {
        const int c = tid + i * NTHREADS;
        if (CHUNKS % NTHREADS != 0 && c >= CHUNKS) break;
        const int row = c / CHUNKS_PER_ROW, chunk = c % CHUNKS_PER_ROW;
        const bool valid = row < rows_valid && chunk * CHUNK < cols_valid;
        const T* src = valid ? gmem + row * row_stride + chunk * CHUNK : gmem;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                         smem + panel_offset<ROWS>(row, chunk)),
                     "l"(src), "r"(valid ? 16 : 0));
    }
}

// Matrix descriptor (PTX ISA, "Matrix Descriptor Format"): start address, leading and stride
// byte offsets (all >> 4), 128B swizzle (mode 1 in bits 62-63).
// `offset` (a multiple of 16, usually a compile-time k-step) is added to the address field
// after the tile's own part is built: shared addresses are below 2^18, so the 14-bit field
// never carries into LBO. Written as (tile + offset) >> 4 inside a masked field, an HGMMA's
// two descriptors cost ~12 integer instructions, two of them moves to the uniform datapath
// (ncu, d 64 backward: half of all executed instructions were integer ones); this way the
// tile's part is shared by its k-steps and each step adds one constant.
__device__ __forceinline__ uint64_t descriptor(uint32_t tile, uint32_t offset, uint32_t lbo,
                                               uint32_t sbo) {
    const uint32_t lo = ((tile >> 4) | ((lbo >> 4) << 16)) + (offset >> 4);
    const uint32_t hi = (sbo >> 4) | (1u << 30);
    return (uint64_t(hi) << 32) | lo;
}

// K-major operand, k-step kk (16 elements): the step's 32 bytes inside panel kk / 4; rows
// (m or n) advance 128 bytes within an atom and one atom (SBO) per 8 rows. `tile` is the
// address of the operand's first row in panel 0; `rows` is the panel height.
__device__ __forceinline__ uint64_t kmajor_desc(uint32_t tile, int rows, int kk) {
    return descriptor(tile, (kk / 4) * rows * 128 + (kk % 4) * 32, 16, ATOM_BYTES);
}

// K-major operand in panels PANEL bytes wide (64 or 32 e4m3 keys a row: load_vt_tile),
// swizzled at that width, k-step kk (32 bytes): panel kk / (PANEL / 32), the step's part of a
// row; rows advance PANEL bytes within an atom of 8 rows and one atom (SBO) per 8 rows. The
// swizzle mode in bits 62-63: 2 for 64 bytes, 3 for 32.
template <int PANEL>
__device__ __forceinline__ uint64_t kmajor_narrow_desc(uint32_t tile, int rows, int kk) {
    static_assert(PANEL == 64 || PANEL == 32, "64- or 32-byte swizzled panels");
    constexpr int STEPS = PANEL / 32;
    const uint32_t offset = (kk / STEPS) * rows * PANEL + (kk % STEPS) * 32;
    const uint32_t lo = ((tile >> 4) | ((16u >> 4) << 16)) + (offset >> 4);
    const uint32_t hi = ((8u * PANEL) >> 4) | ((PANEL == 64 ? 2u : 3u) << 30);
    return (uint64_t(hi) << 32) | lo;
}

// MN-major B operand (V: k = keys are rows, n = head dim across panels), k-step kk: rows
// 16kk..16kk+15 of every panel; n advances one panel (LBO) per 64 elements, k one atom (SBO)
// per 8 rows.
__device__ __forceinline__ uint64_t mnmajor_desc(uint32_t tile, int rows, int kk) {
    return descriptor(tile, kk * 16 * 128, rows * 128, ATOM_BYTES);
}

__device__ __forceinline__ void fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Shared-memory writes of the generic proxy (cp.async) become visible to wgmma, which reads
// through the async proxy, only after this fence (executed by the writing threads).
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Keeps the compiler from moving accumulator reads or writes across an in-flight wgmma.
template <int NT> __device__ __forceinline__ void fence_operand(float (&d)[NT][4]) {
#pragma unroll
    for (int i = 0; i < NT; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}

// The instruction shapes: m64nNk16, f32 accumulators d[N / 8][4] (the mma.sync C layout per
// warp), f16 or bf16 inputs. `ss` reads A and B from shared memory, both K-major (S = Q K^T,
// S^T = K Q^T, dP^T = V dO^T); `ss_mn` both MN-major (dQ = dS K with dS^T stored key-major);
// `rs` takes A from registers and B MN-major (O += P V, dV += P^T dO, dK += dS^T Q).
// scale_d = 0 overwrites d, 1 accumulates.
template <typename T, int N> struct Wgmma;

// Operand lists of the accumulator ("+f", one per register) and their names in the asm text.
#define SM90_ACC4(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define SM90_ACC_32 SM90_ACC4(0), SM90_ACC4(1), SM90_ACC4(2), SM90_ACC4(3)
#define SM90_ACC_48 SM90_ACC4(0), SM90_ACC4(1), SM90_ACC4(2), SM90_ACC4(3), SM90_ACC4(4), SM90_ACC4(5)
#define SM90_ACC_64 SM90_ACC4(0), SM90_ACC4(1), SM90_ACC4(2), SM90_ACC4(3), SM90_ACC4(4), SM90_ACC4(5), SM90_ACC4(6), SM90_ACC4(7)
#define SM90_ACC_80 SM90_ACC4(0), SM90_ACC4(1), SM90_ACC4(2), SM90_ACC4(3), SM90_ACC4(4), SM90_ACC4(5), SM90_ACC4(6), SM90_ACC4(7), SM90_ACC4(8), SM90_ACC4(9)
#define SM90_ACC_96 SM90_ACC4(0), SM90_ACC4(1), SM90_ACC4(2), SM90_ACC4(3), SM90_ACC4(4), SM90_ACC4(5), SM90_ACC4(6), SM90_ACC4(7), SM90_ACC4(8), SM90_ACC4(9), SM90_ACC4(10), SM90_ACC4(11)
#define SM90_ACC_112 SM90_ACC4(0), SM90_ACC4(1), SM90_ACC4(2), SM90_ACC4(3), SM90_ACC4(4), SM90_ACC4(5), SM90_ACC4(6), SM90_ACC4(7), SM90_ACC4(8), SM90_ACC4(9), SM90_ACC4(10), SM90_ACC4(11), SM90_ACC4(12), SM90_ACC4(13)
#define SM90_ACC_128 SM90_ACC4(0), SM90_ACC4(1), SM90_ACC4(2), SM90_ACC4(3), SM90_ACC4(4), SM90_ACC4(5), SM90_ACC4(6), SM90_ACC4(7), SM90_ACC4(8), SM90_ACC4(9), SM90_ACC4(10), SM90_ACC4(11), SM90_ACC4(12), SM90_ACC4(13), SM90_ACC4(14), SM90_ACC4(15)
#define SM90_ACC_176 SM90_ACC4(0), SM90_ACC4(1), SM90_ACC4(2), SM90_ACC4(3), SM90_ACC4(4), SM90_ACC4(5), SM90_ACC4(6), SM90_ACC4(7), SM90_ACC4(8), SM90_ACC4(9), SM90_ACC4(10), SM90_ACC4(11), SM90_ACC4(12), SM90_ACC4(13), SM90_ACC4(14), SM90_ACC4(15), SM90_ACC4(16), SM90_ACC4(17), SM90_ACC4(18), SM90_ACC4(19), SM90_ACC4(20), SM90_ACC4(21)
#define SM90_ACC_192 SM90_ACC4(0), SM90_ACC4(1), SM90_ACC4(2), SM90_ACC4(3), SM90_ACC4(4), SM90_ACC4(5), SM90_ACC4(6), SM90_ACC4(7), SM90_ACC4(8), SM90_ACC4(9), SM90_ACC4(10), SM90_ACC4(11), SM90_ACC4(12), SM90_ACC4(13), SM90_ACC4(14), SM90_ACC4(15), SM90_ACC4(16), SM90_ACC4(17), SM90_ACC4(18), SM90_ACC4(19), SM90_ACC4(20), SM90_ACC4(21), SM90_ACC4(22), SM90_ACC4(23)
#define SM90_REGS_32 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define SM90_REGS_48 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23"
#define SM90_REGS_64 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define SM90_REGS_80 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39"
#define SM90_REGS_96 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
#define SM90_REGS_112 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55"
#define SM90_REGS_128 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define SM90_REGS_176 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87"
#define SM90_REGS_192 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"

// One Wgmma<T, N>; I0..I5 are the asm operand numbers after the N / 2 accumulators.
#define SM90_WGMMA(T, TY, N, I0, I1, I2, I3, I4, I5)                                          \
    template <> struct Wgmma<T, N> {                                                               \
        template <int TA, int TB>                                                                  \
        static __device__ __forceinline__ void ss_t(float (&d)[N / 8][4], uint64_t desc_a,         \
                                                    uint64_t desc_b, int scale_d) {                \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #I2 ", 0;\n"                         \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " "           \
                         "{" SM90_REGS_##N "}, %" #I0 ", %" #I1 ", p, 1, 1, %" #I3 ", %" #I4       \
                         ";\n}\n"                                                                  \
                         : SM90_ACC_##N                                                            \
                         : "l"(desc_a), "l"(desc_b), "r"(scale_d), "n"(TA), "n"(TB));              \
        }                                                                                          \
        static __device__ __forceinline__ void ss(float (&d)[N / 8][4], uint64_t desc_a,           \
                                                  uint64_t desc_b, int scale_d) {                  \
            ss_t<0, 0>(d, desc_a, desc_b, scale_d);                                                \
        }                                                                                          \
        static __device__ __forceinline__ void ss_mn(float (&d)[N / 8][4], uint64_t desc_a,        \
                                                     uint64_t desc_b, int scale_d) {               \
            ss_t<1, 1>(d, desc_a, desc_b, scale_d);                                                \
        }                                                                                          \
        static __device__ __forceinline__ void rs(float (&d)[N / 8][4], const uint32_t (&a)[4],    \
                                                  uint64_t desc_b, int scale_d) {                  \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #I5 ", 0;\n"                         \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TY "." TY " "           \
                         "{" SM90_REGS_##N "}, {%" #I0 ", %" #I1 ", %" #I2 ", %" #I3 "}, %" #I4    \
                         ", p, 1, 1, 1;\n}\n"                                                      \
                         : SM90_ACC_##N                                                            \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b),                \
                           "r"(scale_d));                                                          \
        }                                                                                          \
    };

SM90_WGMMA(__half, "f16", 32, 16, 17, 18, 19, 20, 21)
SM90_WGMMA(__half, "f16", 48, 24, 25, 26, 27, 28, 29)
SM90_WGMMA(__half, "f16", 64, 32, 33, 34, 35, 36, 37)
SM90_WGMMA(__half, "f16", 80, 40, 41, 42, 43, 44, 45)
SM90_WGMMA(__half, "f16", 96, 48, 49, 50, 51, 52, 53)
SM90_WGMMA(__half, "f16", 112, 56, 57, 58, 59, 60, 61)
SM90_WGMMA(__half, "f16", 128, 64, 65, 66, 67, 68, 69)
SM90_WGMMA(__half, "f16", 176, 88, 89, 90, 91, 92, 93)
SM90_WGMMA(__half, "f16", 192, 96, 97, 98, 99, 100, 101)
SM90_WGMMA(__nv_bfloat16, "bf16", 32, 16, 17, 18, 19, 20, 21)
SM90_WGMMA(__nv_bfloat16, "bf16", 48, 24, 25, 26, 27, 28, 29)
SM90_WGMMA(__nv_bfloat16, "bf16", 64, 32, 33, 34, 35, 36, 37)
SM90_WGMMA(__nv_bfloat16, "bf16", 80, 40, 41, 42, 43, 44, 45)
SM90_WGMMA(__nv_bfloat16, "bf16", 96, 48, 49, 50, 51, 52, 53)
SM90_WGMMA(__nv_bfloat16, "bf16", 112, 56, 57, 58, 59, 60, 61)
SM90_WGMMA(__nv_bfloat16, "bf16", 128, 64, 65, 66, 67, 68, 69)
SM90_WGMMA(__nv_bfloat16, "bf16", 176, 88, 89, 90, 91, 92, 93)
SM90_WGMMA(__nv_bfloat16, "bf16", 192, 96, 97, 98, 99, 100, 101)

// Four 8 x 8 matrices of 16-bit values to shared memory (stmatrix, sm_90): lane l gives the
// address of row l % 8 of matrix l / 8, and register i holds this lane's pair of matrix i in
// the mma.sync C layout (row lane / 4, columns 2 (lane % 4) and the next).
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                            uint32_t r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
                 "r"(r0), "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
}

// A warpgroup's A fragments of a transposed tile (keys as rows from key0, queries as columns
// from col0, a multiple of 8) into a key-major panel tile of BN rows (row = key, 64 query
// columns): each k16 step's four registers are the four 8 x 8 matrices of one stmatrix, 16
// bytes per lane (as 4-byte st.shared, each with its own swizzled address, the d 64 backward
// spent ~70 instructions per query tile on the stores' addresses).
template <int BN, int NQ>
__device__ __forceinline__ void store_key_major(uint32_t tile, const uint32_t (&a)[1][NQ / 2][4],
                                                int key0, int col0, int tid, int lane) {
    // Lane l addresses row l % 8 of matrix l / 8: rows +8 for odd matrices, the next 8
    // columns for the last two (the A fragment's register order).
    const int m = lane / 8, row = key0 + tid / 32 * 16 + (m % 2) * 8 + lane % 8;
#pragma unroll
    for (int kk = 0; kk < NQ / 2; ++kk)
        stmatrix_x4(tile + panel_offset<BN>(row, col0 / 8 + kk * 2 + m / 2), a[0][kk][0],
                    a[0][kk][1], a[0][kk][2], a[0][kk][3]);
}

// A warp's accumulator fragments (the wgmma m64 layout: its 16 rows from row0, DT n8 tiles of
// columns from 16-byte chunk chunk0) as T into a PANEL_ROWS-row panel tile, rows g scaled by
// s0 and rows g + 8 by s1: one stmatrix per two n8 tiles, 16 bytes per lane (4-byte
// st.shared from the fragments would take four times the instructions). The epilogues of
// the warp-specialized kernels stage their outputs this way for a TMA store.
template <typename T, int PANEL_ROWS, int DT>
__device__ __forceinline__ void stage_fragments(uint32_t tile, const float (&f)[DT][4], int row0,
                                                int chunk0, float s0, float s1, int lane) {
    static_assert(DT % 2 == 0, "stmatrix x4 takes two n8 tiles");
    // Lane l addresses row l % 8 of matrix l / 8: rows +8 for odd matrices, the next 8
    // columns for the last two.
    const int m = lane / 8, row = row0 + (m % 2) * 8 + lane % 8;
#pragma unroll
    for (int i = 0; i < DT; i += 2)
        stmatrix_x4(tile + panel_offset<PANEL_ROWS>(row, chunk0 + i + m / 2),
                    MmaOp<T>::pack(f[i][0] * s0, f[i][1] * s0),
                    MmaOp<T>::pack(f[i][2] * s1, f[i][3] * s1),
                    MmaOp<T>::pack(f[i + 1][0] * s0, f[i + 1][1] * s0),
                    MmaOp<T>::pack(f[i + 1][2] * s1, f[i + 1][3] * s1));
}

// Rows [row0, row0 + rows) x 16-byte chunks [chunk0, chunk0 + valid) of a PANEL_ROWS-row panel
// tile (stage_fragments' output, CHUNKS chunks per row taken), to global memory: row r of the
// range at dst + r * row_stride, chunk c at dst + 8 c; 16 bytes per thread and step, `thread`
// of `threads`. Where a TMA store of the whole box would write rows the caller does not own
// (a packed sequence's end).
template <typename T, int PANEL_ROWS, int CHUNKS>
__device__ __forceinline__ void copy_panel_rows(uint32_t tile, int row0, int chunk0, int rows,
                                                int valid, T* dst, int64_t row_stride,
                                                int thread, int threads) {
    for (int i = thread; i < rows * CHUNKS; i += threads) {
        const int r = i / CHUNKS, c = i % CHUNKS;
        if (c >= valid) continue;
        uint4 x;
        asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w)
                     : "r"(tile + panel_offset<PANEL_ROWS>(row0 + r, chunk0 + c)));
        *reinterpret_cast<uint4*>(dst + r * row_stride + c * 8) = x;
    }
}

}  // namespace sm90
