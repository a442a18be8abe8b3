// Fused training ops with their backward passes (src/train/): RMSNorm, rotary embedding,
// SwiGLU, embedding, cross-entropy and AdamW. Each replaces a chain of Candle element-wise
// ops and, in a training graph, the per-op gradient bookkeeping of that chain. The attention's
// own helpers live here too: the sinks' fix-up and gradient (src/sinks.rs), the merge of
// partial attentions (src/combine.rs); and the decoding step's: the residual add fused with
// its norm, the few-row matrix products and the greedy argmax (src/infer/); FP8 quantization
// (src/quant/). One macro per kernel kind holds its signature; the
// kernels themselves, their names and element types, come from the catalogue
// (cuda/train/catalogue.rs), which build.rs turns into the `instances/train.inc` included at
// the end. The launchers find them there by op and dtypes.
#include "train/norm.cuh"
#include "train/rotary.cuh"
#include "train/swiglu.cuh"
#include "train/embed.cuh"
#include "train/xent.cuh"
#include "train/adamw.cuh"
#include "train/sinks.cuh"
#include "train/combine.cuh"
#include "train/gemv.cuh"
#include "train/gemv_mma.cuh"
#include "train/argmax.cuh"
#include "train/quant.cuh"

using bf16 = __nv_bfloat16;
using f16 = __half;
using f32 = float;

// RMSNorm: x in T, the weight in W (f32 or T).
#define TRAIN_RMS_FWD(NAME, T, W)                                                            \
  extern "C" __global__ void NAME(const T* x, const W* w, T* y, int64_t rows, int cols,      \
                                  float eps) {                                               \
    train::rms_norm_fwd(x, w, y, rows, cols, eps);                                           \
  }
#define TRAIN_RMS_BWD(NAME, T, W)                                                            \
  extern "C" __global__ void NAME(const T* x, const W* w, const T* dy, T* dx, float* dw_part, \
                                  int64_t rows, int cols, float eps) {                       \
    train::rms_norm_bwd(x, w, dy, dx, dw_part, rows, cols, eps);                             \
  }
#define TRAIN_RMS_DW(NAME)                                                                   \
  extern "C" __global__ void NAME(const float* dw_part, float* dw, int blocks, int cols) {   \
    train::rms_norm_dw(dw_part, dw, blocks, cols);                                           \
  }

// Residual add and RMSNorm in one pass: h = x + r, y = rms_norm(h).
#define TRAIN_ADD_RMS_FWD(NAME, T, W)                                                        \
  extern "C" __global__ void NAME(const T* x, const T* r, const W* w, T* h, T* y,            \
                                  int64_t rows, int cols, float eps) {                       \
    train::add_rms_norm_fwd(x, r, w, h, y, rows, cols, eps);                                 \
  }

#define TRAIN_ROTARY(NAME, T)                                                                \
  extern "C" __global__ void NAME(const T* x, const float* c, const float* s, T* y,          \
                                  int64_t n, int heads, int half, float sign) {              \
    train::rotary(x, c, s, y, n, heads, half, sign);                                         \
  }

#define TRAIN_SWIGLU_FWD(NAME, T)                                                            \
  extern "C" __global__ void NAME(const T* g, int64_t g_row, const T* u, int64_t u_row, T* y, \
                                  int64_t rows, int cols) {                                  \
    train::swiglu_fwd(g, g_row, u, u_row, y, rows, cols);                                    \
  }
#define TRAIN_SWIGLU_BWD(NAME, T)                                                            \
  extern "C" __global__ void NAME(const T* g, const T* u, const T* dy, T* dg, T* du,         \
                                  int64_t n) {                                               \
    train::swiglu_bwd(g, u, dy, dg, du, n);                                                  \
  }

// Embedding: a table in W gathered into rows of T.
#define TRAIN_EMBED_FWD(NAME, W, T)                                                          \
  extern "C" __global__ void NAME(const W* table, const uint32_t* ids, T* y, int64_t n,      \
                                  int64_t vocab, int cols) {                                 \
    train::embed_fwd(table, ids, y, n, vocab, cols);                                         \
  }
#define TRAIN_EMBED_BWD(NAME, T)                                                             \
  extern "C" __global__ void NAME(const T* dy, const uint32_t* ids, float* dtable, int64_t n, \
                                  int64_t vocab, int cols) {                                 \
    train::embed_bwd(dy, ids, dtable, n, vocab, cols);                                       \
  }
#define TRAIN_EMBED_BWD_SORTED(NAME, T)                                                      \
  extern "C" __global__ void NAME(const T* dy, const uint32_t* ids, const uint32_t* order,   \
                                  const uint32_t* seg, float* dtable, int cols) {            \
    train::embed_bwd_sorted(dy, ids, order, seg, dtable, cols);                              \
  }

#define TRAIN_XENT_FWD(NAME, T)                                                              \
  extern "C" __global__ void NAME(const T* logits, const uint32_t* targets, float* loss,     \
                                  float* lse, int64_t vocab) {                               \
    train::xent_fwd(logits, targets, loss, lse, vocab);                                      \
  }
#define TRAIN_XENT_BWD(NAME, T)                                                              \
  extern "C" __global__ void NAME(const T* logits, const uint32_t* targets, const float* lse, \
                                  const float* dloss, T* dlogits, int64_t vocab) {           \
    train::xent_bwd(logits, targets, lse, dloss, dlogits, vocab);                            \
  }

#define TRAIN_ADAMW_MOMENTS(NAME, T)                                                         \
  extern "C" __global__ void NAME(float* mv, const T* g, int64_t n, float gscale, float b1,  \
                                  float b2) {                                                \
    train::adamw_moments(mv, g, n, gscale, b1, b2);                                          \
  }
#define TRAIN_ADAMW_APPLY(NAME)                                                              \
  extern "C" __global__ void NAME(float* w, const float* mv, int64_t n, float lr,            \
                                  float decay, float c1, float c2, float eps) {              \
    train::adamw_apply(w, mv, n, lr, decay, c1, c2, eps);                                    \
  }
#define TRAIN_SUM_SQUARES(NAME, T)                                                           \
  extern "C" __global__ void NAME(const T* x, float* acc, int64_t n) {                       \
    train::sum_squares(x, acc, n);                                                           \
  }

// A decoding step's few rows times a weight (src/infer/linear.rs): plain (+ add), or the
// SwiGLU of a stacked gate-and-up weight.
#define TRAIN_GEMV(NAME, T)                                                                  \
  extern "C" __global__ void NAME(const T* x, const T* w, const T* add, T* y, int m, int n,  \
                                  int k, int split, const T* g, float eps) {                 \
    train::gemv<T, false>(x, w, add, y, m, n, k, split, g, eps);                             \
  }
#define TRAIN_GEMV_SWIGLU(NAME, T)                                                           \
  extern "C" __global__ void NAME(const T* x, const T* w, const T* add, T* y, int m, int n,  \
                                  int k, int split, const T* g, float eps) {                 \
    train::gemv<T, true>(x, w, add, y, m, n, k, split, g, eps);                              \
  }

// Five to sixteen rows on tensor cores (same operands).
#define TRAIN_GEMV_MMA(NAME, T)                                                              \
  extern "C" __global__ void NAME(const T* x, const T* w, const T* add, T* y, int m, int n,  \
                                  int k, int split, const T* g, float eps) {                 \
    train::gemv_mma<T, false>(x, w, add, y, m, n, k, split, g, eps);                         \
  }
#define TRAIN_GEMV_MMA_SWIGLU(NAME, T)                                                       \
  extern "C" __global__ void NAME(const T* x, const T* w, const T* add, T* y, int m, int n,  \
                                  int k, int split, const T* g, float eps) {                 \
    train::gemv_mma<T, true>(x, w, add, y, m, n, k, split, g, eps);                          \
  }

// Each row's first largest element (src/infer/argmax.rs).
#define TRAIN_ARGMAX(NAME, T)                                                                \
  extern "C" __global__ void NAME(const T* x, unsigned long long* part, unsigned* counters,  \
                                  uint32_t* out, int64_t rows, int64_t n, int64_t stride,    \
                                  int64_t chunk, int vec) {                                  \
    train::argmax_rows(x, part, counters, out, rows, n, stride, chunk, vec != 0);           \
  }

// The merge of partial attentions: parts in T, the output in O; the parameter block by value.
#define TRAIN_COMBINE(NAME, T, O)                                                            \
  extern "C" __global__ void NAME(const train::CombineParams p) { train::combine<T, O>(p); }

// Attention sinks: O in T (f16/bf16, the attention's dtypes), lse and sinks in f32.
#define TRAIN_SINKS_FWD(NAME, T)                                                             \
  extern "C" __global__ void NAME(T* o, float* lse, const float* sinks, int64_t n, int rows,  \
                                  int heads, int d) {                                        \
    train::sinks_fwd(o, lse, sinks, n, rows, heads, d);                                      \
  }
#define TRAIN_SINKS_GRAD(NAME, T)                                                            \
  extern "C" __global__ void NAME(const T* o, const T* dout, const float* lse,               \
                                  const float* sinks, float* part, int64_t n, int rows,      \
                                  int heads, int d) {                                        \
    train::sinks_grad(o, dout, lse, sinks, part, n, rows, heads, d);                         \
  }

// FP8 (e4m3) quantization of a (b, s, h, d) tensor and back (src/quant/): T the float side.
#define TRAIN_FP8_QUANTIZE(NAME, T)                                                          \
  extern "C" __global__ void NAME(const T* x, uint8_t* q, const float* scales, int64_t n,    \
                                  int d, int h, int s, int block_rows, int mode) {           \
    train::fp8_quantize(x, q, scales, n, d, h, s, block_rows, mode);                         \
  }
#define TRAIN_FP8_DEQUANTIZE(NAME, T)                                                        \
  extern "C" __global__ void NAME(const uint8_t* q, T* y, const float* scales, int64_t n,    \
                                  int d, int h, int s, int block_rows, int mode) {           \
    train::fp8_dequantize(q, y, scales, n, d, h, s, block_rows, mode);                       \
  }
// A strided rank-4 tensor of e4m3 bytes into a contiguous one (src/layout.rs).
#define TRAIN_FP8_COPY(NAME)                                                                 \
  extern "C" __global__ void NAME(const uint8_t* src, uint8_t* dst, int64_t n, int64_t d1,   \
                                  int64_t d2, int64_t d3, int64_t s0, int64_t s1,            \
                                  int64_t s2, int64_t s3) {                                  \
    train::fp8_copy(src, dst, n, d1, d2, d3, s0, s1, s2, s3);                                \
  }

#include "instances/train.inc"
