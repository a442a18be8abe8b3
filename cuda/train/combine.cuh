// The merge of attentions over disjoint key sets (src/combine.rs): from each part's output
// o_i (b, s, h, d) and row log-sum-exp lse_i (b, h, s), lse = log sum_i exp(lse_i) and
// o = sum_i exp(lse_i - lse) o_i, in f32, in one pass over the parts. The split-KV decode
// kernels merge their splits the same way on chip; this is the merge for parts that come
// from separate calls (cascade attention over a shared prompt, ring attention).
//
// The arithmetic is the one the host's op-by-op form does (src/combine.rs), so that the CPU
// and CUDA results differ only by rounding: the largest lse_i as the exponents' origin (0
// where every part is -inf, so that no -inf - -inf appears), weights exp(lse_i - origin)
// times 1 / their sum (0 where the sum is 0: a row no part's keys reach comes out zero with
// lse -inf), each part's products summed in part order. A NaN lse_i makes its row NaN (fmaxf
// alone would skip it), and a NaN in o_i reaches o even at weight 0 (0 * NaN), as there.
#pragma once
#include "train/common.cuh"

namespace train {

// Parts per launch: the parameter block holds them by value (constant bank, no upload). The
// host folds more parts in groups of this many into f32 partial results.
constexpr int COMBINE_MAX_PARTS = 16;

// One part: element addresses (start offsets applied) and strides in elements. The head_dim
// stride of o is 1 (the host makes a part contiguous first where it is not).
struct CombinePart {
  const void* o;
  const float* lse;
  int64_t o_stride[3];    // batch, seqlen_q, head
  int64_t lse_stride[3];  // batch, head, seqlen_q
};

// The kernel's only argument (its Rust twin: `CombineParams` in src/combine.rs).
struct CombineParams {
  CombinePart part[COMBINE_MAX_PARTS];
  void* out;        // (b, s, h, d) contiguous, in the output dtype
  float* out_lse;   // (b, h, s) contiguous
  int64_t rows;     // b * s * h
  int32_t seqlen_q;
  int32_t heads;
  int32_t head_dim;
  int32_t parts;    // 1..=COMBINE_MAX_PARTS
  int32_t vec;      // elements per load: 1, 2, 4 or 8; every o row and stride a multiple
  int32_t pad;
};
static_assert(sizeof(CombinePart) == 64, "CombinePart: layout shared with src/combine.rs");
static_assert(sizeof(CombineParams) == 64 * COMBINE_MAX_PARTS + 48,
              "CombineParams: layout shared with src/combine.rs");

template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T x[V];
};

// One thread per V-element chunk of an output row, grid-stride; each thread of a row derives
// the row's weights itself (the lse loads of a row's threads hit the same lines), and the
// row's first chunk writes its lse.
template <typename T, typename O, int V>
__device__ void combine_rows(const CombineParams& p) {
  const int chunks = p.head_dim > 0 ? p.head_dim / V : 1;
  const int64_t total = p.rows * chunks;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t row = i / chunks;  // (b, s, h) in o's order
    const int c = (int)(i - row * chunks);
    const int hh = (int)(row % p.heads);
    const int64_t bs = row / p.heads;
    const int ss = (int)(bs % p.seqlen_q);
    const int64_t bb = bs / p.seqlen_q;
    float l[COMBINE_MAX_PARTS];
    float m = -INFINITY;
    bool nan = false;
#pragma unroll
    for (int k = 0; k < COMBINE_MAX_PARTS; ++k) {
      if (k < p.parts) {
        const CombinePart& q = p.part[k];
        l[k] = q.lse[bb * q.lse_stride[0] + hh * q.lse_stride[1] + ss * q.lse_stride[2]];
        nan |= l[k] != l[k];
        m = fmaxf(m, l[k]);
      }
    }
    const float origin = nan ? __int_as_float(0x7fc00000) : (m == -INFINITY ? 0.f : m);
    float total_w = 0.f;
#pragma unroll
    for (int k = 0; k < COMBINE_MAX_PARTS; ++k) {
      if (k < p.parts) {
        // Under --use_fast_math this is ex2.approx, whose -inf gives exactly 0 (a part
        // without keys weighs nothing) and whose error (a few ulp) is far below bf16's.
        l[k] = expf(l[k] - origin);
        total_w += l[k];
      }
    }
    const float inv = total_w > 0.f ? 1.f / total_w : 0.f;
    if (c == 0) {
      p.out_lse[(bb * p.heads + hh) * p.seqlen_q + ss] = origin + logf(total_w);
    }
    if (p.head_dim == 0) continue;
    float acc[V];
#pragma unroll
    for (int j = 0; j < V; ++j) acc[j] = 0.f;
#pragma unroll
    for (int k = 0; k < COMBINE_MAX_PARTS; ++k) {
      if (k < p.parts) {
        const CombinePart& q = p.part[k];
        const T* o = static_cast<const T*>(q.o) + bb * q.o_stride[0] + ss * q.o_stride[1] +
                     hh * q.o_stride[2] + c * V;
        const Pack<T, V> x = *reinterpret_cast<const Pack<T, V>*>(o);
        const float w = l[k] * inv;
#pragma unroll
        for (int j = 0; j < V; ++j) acc[j] += to_f(x.x[j]) * w;
      }
    }
    Pack<O, V> y;
#pragma unroll
    for (int j = 0; j < V; ++j) y.x[j] = from_f<O>(acc[j]);
    *reinterpret_cast<Pack<O, V>*>(static_cast<O*>(p.out) + row * p.head_dim + c * V) = y;
  }
}

// The parts in T, the output in O: T = O, or f32 on one side for the host's groups of more
// than COMBINE_MAX_PARTS parts.
template <typename T, typename O>
__device__ void combine(const CombineParams& p) {
  switch (p.vec) {
    case 8: combine_rows<T, O, 8>(p); break;
    case 4: combine_rows<T, O, 4>(p); break;
    case 2: combine_rows<T, O, 2>(p); break;
    default: combine_rows<T, O, 1>(p); break;
  }
}

}  // namespace train
