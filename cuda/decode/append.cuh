// The KV-cache append: new K or V rows (b, s_new, h_k, d) written in place at cache rows
// start[b].. (contiguous or paged), optionally rotated on the way (rotary embedding at each
// row's position, FlashAttention's rotary_cos / rotary_sin), and, in the launch that appends
// K, the query rows rotated into a buffer of their own for the decode kernel that follows.
// Grid (max(s_new, s_q), h_k + h, b): block (i, y, b) writes K/V row i of head y < h_k, or
// rotates query row i of head y - h_k. An e4m3 cache gets each row divided by its head's scale
// and rounded (decode/fp8.cuh).
#pragma once
#include <type_traits>
#include "common/mma.cuh"
#include "common/pdl.cuh"
#include "decode/decode_block.cuh"
#include "decode/fp8.cuh"

// 8 elements (one 16-byte chunk) as floats and back.
template <typename T> struct Chunk8 {
    float x[8];
    __device__ __forceinline__ void load(const T* src) {
        const uint4 u = *reinterpret_cast<const uint4*>(src);
        const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float2 f = MmaOp<T>::unpack(w[k]);
            x[2 * k] = f.x;
            x[2 * k + 1] = f.y;
        }
    }
    __device__ __forceinline__ void store(T* dst) const {
        *reinterpret_cast<uint4*>(dst) =
            make_uint4(MmaOp<T>::pack(x[0], x[1]), MmaOp<T>::pack(x[2], x[3]),
                       MmaOp<T>::pack(x[4], x[5]), MmaOp<T>::pack(x[6], x[7]));
    }
    // Into an e4m3 cache (8 bytes): rounded to T first, so that a rotated row is quantized
    // from the value the 16-bit path would have stored (and the CPU, rotating in T, agrees).
    __device__ __forceinline__ void store(uint8_t* dst, float scale) const {
        float r[8];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float2 f = MmaOp<T>::unpack(MmaOp<T>::pack(x[2 * k], x[2 * k + 1]));
            r[2 * k] = f.x;
            r[2 * k + 1] = f.y;
        }
        *reinterpret_cast<uint2*>(dst) = quantize_e4m3x8(r, scale);
    }
};

// A chunk into a cache row of C: T as it is, or e4m3 divided by the head's `scale`.
template <typename T, typename C>
__device__ __forceinline__ void store_chunk(C* dst, const Chunk8<T>& a, float scale) {
    if constexpr (std::is_same_v<C, T>) {
        a.store(dst);
    } else {
        a.store(dst, scale);
    }
}

// The rotary tables a row turns by: none (cos null), or `rows` rows of `half` angles.
struct Rotation {
    const float* cos = nullptr;
    const float* sin = nullptr;
    int rows = 1, half = 0, interleaved = 0;

    // The tables of a parameter block whose fields are named as AppendParams' (the append
    // launch's, or a decode launch's DecodeAppend).
    template <typename P> __device__ __forceinline__ static Rotation of(const P& ap) {
        return {ap.rot_cos, ap.rot_sin, ap.rot_rows, ap.rot_half, ap.rot_interleaved};
    }
};

// Writes row `src` (d elements) to `dst`, rotated at position `pos` by `r` when it has
// tables: the first 2 * r.half elements turn by the angles of row `pos` (clamped to the
// tables: device lengths are unchecked), in pairs (j, j + half) or, interleaved, (2j, 2j + 1);
// the rest is copied. f32 arithmetic, one rounding. half is a multiple of 8 (checked on the
// host), so a chunk never straddles the rotated and copied parts. A cache of C = uint8_t is
// e4m3, each element divided by `scale` (its head's) on the way. Threads t0 of nt share the
// row (the append's block, or one warp of a decode block); dst may be src (a row rotated in
// place: each chunk, or pair of chunks, is one thread's, and the copied part stays put).
template <typename T, typename C>
__device__ __forceinline__ void append_row(const Rotation& r, int d, C* dst, const T* src,
                                           int64_t pos, float scale, int t0, int nt) {
    const int rot = r.cos != nullptr ? 2 * r.half : 0;
    const int64_t row = min(pos, int64_t(r.rows) - 1);
    const float* cs = r.cos + row * r.half;
    const float* sn = r.sin + row * r.half;
    for (int c = t0 * CHUNK; c < d; c += nt * CHUNK) {
        if (c >= rot) {
            if constexpr (std::is_same_v<C, T>) {
                if (static_cast<const void*>(dst) != src)
                    *reinterpret_cast<uint4*>(dst + c) = *reinterpret_cast<const uint4*>(src + c);
            } else {
                Chunk8<T> a;
                a.load(src + c);
                a.store(dst + c, scale);
            }
            continue;
        }
        Chunk8<T> a;
        a.load(src + c);
        if (r.interleaved) {
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int j = c / 2 + k;
                const float x0 = a.x[2 * k], x1 = a.x[2 * k + 1];
                a.x[2 * k] = x0 * cs[j] - x1 * sn[j];
                a.x[2 * k + 1] = x1 * cs[j] + x0 * sn[j];
            }
            store_chunk(dst + c, a, scale);
            continue;
        }
        if (c >= r.half) continue;  // the second half: its partner chunk writes it
        Chunk8<T> b;
        b.load(src + c + r.half);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const float x0 = a.x[k], x1 = b.x[k];
            a.x[k] = x0 * cs[c + k] - x1 * sn[c + k];
            b.x[k] = x1 * cs[c + k] + x0 * sn[c + k];
        }
        store_chunk(dst + c, a, scale);
        store_chunk(dst + c + r.half, b, scale);
    }
}

// C: the cache's element, T (the new rows' type) or uint8_t for an e4m3 cache (ap.scale).
template <typename T, typename C> __device__ __forceinline__ void flash_append(const AppendParams& ap) {
    // Launched programmatically (src/cuda/append.rs): the rows, the lengths and the rotary
    // positions may all come from the kernels just ahead (the projection, a step's length
    // update), so nothing is read before they complete.
    pdl_wait();
    const int i = blockIdx.x, y = blockIdx.y, b = blockIdx.z;
    const int64_t start = unsigned(ap.start[b]);
    // Ragged: the sequence's own count of new (and query) rows.
    const int n = ap.new_lens != nullptr ? int(min(unsigned(ap.new_lens[b]), unsigned(ap.s_new)))
                                         : ap.s_new;
    if (y >= ap.h_k) {  // a query row, rotated into q_out (b, s_q, h, d)
        const int head = y - ap.h_k;
        if (i >= ap.s_q || (ap.new_lens != nullptr && i >= n)) return;
        const T* src = static_cast<const T*>(ap.q) + b * ap.q_batch_stride +
                       int64_t(i) * ap.q_row_stride + head * ap.q_head_stride;
        T* dst = static_cast<T*>(ap.q_out) + ((int64_t(b) * ap.s_q + i) * ap.h + head) * ap.d;
        append_row(Rotation::of(ap), ap.d, dst, src, start + (ap.q_causal ? i : 0), 1.f,
                   threadIdx.x, blockDim.x);
        return;
    }
    if (i >= n) return;
    const CacheRows rows{ap.block_table, ap.max_pages, ap.page_size, b, y, ap.num_pages};
    // Host starts were checked to fit the cache; device ones are dropped past its capacity.
    const int64_t j = start + i;
    if (j >= cache_capacity(ap.block_table, ap.max_pages, ap.page_size)) return;
    C* dst = rows.row(static_cast<C*>(ap.cache), ap.cache_page_stride, ap.cache_row_stride,
                      ap.cache_head_stride, int(j));
    const T* src = static_cast<const T*>(ap.src) + b * ap.src_batch_stride +
                   int64_t(i) * ap.src_row_stride + y * ap.src_head_stride;
    append_row(Rotation::of(ap), ap.d, dst, src, j, std::is_same_v<C, T> ? 1.f : ap.scale[y],
               threadIdx.x, blockDim.x);
}
