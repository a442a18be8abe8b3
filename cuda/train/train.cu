// Fused training ops with their backward passes (src/train/): RMSNorm, rotary embedding,
// SwiGLU, embedding, cross-entropy and AdamW. Each replaces a chain of Candle element-wise
// ops and, in a training graph, the per-op gradient bookkeeping of that chain. Entry points
// are named `train_<op>_<dtypes>`; the launchers pick them by dtype.
#include "train/norm.cuh"
#include "train/rotary.cuh"
#include "train/swiglu.cuh"
#include "train/embed.cuh"
#include "train/xent.cuh"
#include "train/adamw.cuh"

using bf16 = __nv_bfloat16;
using f16 = __half;
using f32 = float;

#define NORM(T, W)                                                                           \
  extern "C" __global__ void train_rms_fwd_##T##_##W(const T* x, const W* w, T* y,           \
                                                     int64_t rows, int cols, float eps) {    \
    train::rms_norm_fwd(x, w, y, rows, cols, eps);                                           \
  }                                                                                          \
  extern "C" __global__ void train_rms_bwd_##T##_##W(const T* x, const W* w, const T* dy,    \
                                                     T* dx, float* dw_part, int64_t rows,    \
                                                     int cols, float eps) {                  \
    train::rms_norm_bwd(x, w, dy, dx, dw_part, rows, cols, eps);                             \
  }
NORM(bf16, f32)
NORM(f16, f32)
NORM(f32, f32)
NORM(bf16, bf16)
NORM(f16, f16)

#define PER_DTYPE(T)                                                                         \
  extern "C" __global__ void train_rotary_##T(const T* x, const float* c, const float* s,    \
                                              T* y, int64_t n, int heads, int half,          \
                                              float sign) {                                  \
    train::rotary(x, c, s, y, n, heads, half, sign);                                         \
  }                                                                                          \
  extern "C" __global__ void train_swiglu_fwd_##T(const T* g, const T* u, T* y, int64_t n) { \
    train::swiglu_fwd(g, u, y, n);                                                           \
  }                                                                                          \
  extern "C" __global__ void train_swiglu_bwd_##T(const T* g, const T* u, const T* dy,       \
                                                  T* dg, T* du, int64_t n) {                 \
    train::swiglu_bwd(g, u, dy, dg, du, n);                                                  \
  }                                                                                          \
  extern "C" __global__ void train_embed_bwd_##T(const T* dy, const uint32_t* ids,           \
                                                 float* dtable, int64_t n, int64_t vocab,    \
                                                 int cols) {                                 \
    train::embed_bwd(dy, ids, dtable, n, vocab, cols);                                       \
  }                                                                                          \
  extern "C" __global__ void train_embed_bwd_sorted_##T(const T* dy, const uint32_t* ids,    \
                                                        const uint32_t* order,               \
                                                        const uint32_t* seg, float* dtable,  \
                                                        int cols) {                          \
    train::embed_bwd_sorted(dy, ids, order, seg, dtable, cols);                              \
  }                                                                                          \
  extern "C" __global__ void train_xent_fwd_##T(const T* logits, const uint32_t* targets,    \
                                                float* loss, float* lse, int64_t vocab) {    \
    train::xent_fwd(logits, targets, loss, lse, vocab);                                      \
  }                                                                                          \
  extern "C" __global__ void train_xent_bwd_##T(const T* logits, const uint32_t* targets,    \
                                                const float* lse, const float* dloss,        \
                                                T* dlogits, int64_t vocab) {                 \
    train::xent_bwd(logits, targets, lse, dloss, dlogits, vocab);                            \
  }                                                                                          \
  extern "C" __global__ void train_adamw_moments_##T(float* mv, const T* g, int64_t n,       \
                                                     float gscale, float b1, float b2) {     \
    train::adamw_moments(mv, g, n, gscale, b1, b2);                                          \
  }                                                                                          \
  extern "C" __global__ void train_sum_squares_##T(const T* x, float* acc, int64_t n) {      \
    train::sum_squares(x, acc, n);                                                           \
  }
PER_DTYPE(bf16)
PER_DTYPE(f16)
PER_DTYPE(f32)

#define EMBED(W, T)                                                                          \
  extern "C" __global__ void train_embed_fwd_##W##_##T(const W* table, const uint32_t* ids,  \
                                                       T* y, int64_t n, int64_t vocab,       \
                                                       int cols) {                           \
    train::embed_fwd(table, ids, y, n, vocab, cols);                                         \
  }
EMBED(f32, bf16)
EMBED(f32, f16)
EMBED(f32, f32)
EMBED(bf16, bf16)
EMBED(f16, f16)

extern "C" __global__ void train_rms_dw(const float* dw_part, float* dw, int blocks, int cols) {
  train::rms_norm_dw(dw_part, dw, blocks, cols);
}

extern "C" __global__ void train_adamw_apply(float* w, const float* mv, int64_t n, float lr,
                                             float decay, float c1, float c2, float eps) {
  train::adamw_apply(w, mv, n, lr, decay, c1, c2, eps);
}
