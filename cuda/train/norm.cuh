// RMSNorm, forward and backward: y = x * rstd * w with rstd = (mean(x^2) + eps)^-1/2 per
// row, f32 arithmetic and one rounding. The backward recomputes rstd from x rather than
// saving it (one more read of a row that is in L2 anyway) and sums dw over rows in a fixed
// order: per block of rows a partial per column, then a pass over the partials (bitwise
// repeatable, unlike an atomic per column per block). rstd is correctly rounded (__fsqrt_rn,
// __fdiv_rn: the build's --use_fast_math would make 1/sqrtf and rsqrtf approximate): dx
// cancels to ~eps/x^2 of its terms on short rows, and a 2-ulp rsqrtf showed there.
#pragma once
#include "common/pdl.cuh"
#include "train/common.cuh"

namespace train {

__device__ __forceinline__ float exact_rstd(float sum_sq, int cols, float eps) {
  return __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sum_sq, (float)cols), eps)));
}

// acc + the squares of the eight half-precision elements of one 16-byte vector, in order.
template <typename T> __device__ __forceinline__ float sum_sq8(float acc, uint4 v) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = pair_f(w[i], T());
    acc = fmaf(f.x, f.x, acc);
    acc = fmaf(f.y, f.y, acc);
  }
  return acc;
}

// Eight elements of x normalised, x * rstd * g, rounded as rms_norm_fwd rounds them.
template <typename T> __device__ __forceinline__ uint4 norm8(uint4 x, uint4 g, float rstd) {
  const uint32_t a[4] = {x.x, x.y, x.z, x.w}, b[4] = {g.x, g.y, g.z, g.w};
  uint32_t o[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = pair_f(a[i], T()), w = pair_f(b[i], T());
    o[i] = pack_pair(from_f<T>(f.x * rstd * w.x), from_f<T>(f.y * rstd * w.y));
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

// One warp per row; or, launched with a block per row (gridDim.x >= rows: a decoding step's
// few long rows, where a warp alone waits on each of its loads in turn), a block per row.
template <typename T, typename W>
__device__ void rms_norm_fwd(const T* __restrict__ x, const W* __restrict__ w, T* __restrict__ y,
                             int64_t rows, int cols, float eps) {
  if (gridDim.x >= rows) {
    __shared__ float scratch[32];
    const int64_t row = blockIdx.x;
    if (row >= rows) return;  // the whole block
    const T* xr = x + row * cols;
    float ss = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
      const float v = to_f(xr[c]);
      ss += v * v;
    }
    const float rstd = exact_rstd(block_sum(ss, scratch), cols, eps);
    T* yr = y + row * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
      yr[c] = from_f<T>(to_f(xr[c]) * rstd * to_f(w[c]));
    return;
  }
  const int64_t row = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const T* xr = x + row * cols;
  float ss = 0.f;
  for (int c = lane; c < cols; c += 32) {
    const float v = to_f(xr[c]);
    ss += v * v;
  }
  const float rstd = exact_rstd(warp_sum(ss), cols, eps);
  T* yr = y + row * cols;
  for (int c = lane; c < cols; c += 32) yr[c] = from_f<T>(to_f(xr[c]) * rstd * to_f(w[c]));
}

// The residual stream's add and the next norm of a transformer block, one block of threads
// per row: h = x + r rounded to T (what the unfused add stores), y = rms_norm(h) from that
// rounded h. A decoding step has a handful of rows, so a row is spread over a block rather
// than a warp, eight elements (16 bytes) per load where the rows allow; the second pass
// recomputes h from x and r (cached reads) instead of reading back what it wrote.
template <typename T>
__device__ __forceinline__ float add_pair_sq(uint32_t a, uint32_t b, uint32_t& out) {
  const float2 x = pair_f(a, T()), r = pair_f(b, T());
  const T s0 = from_f<T>(x.x + r.x), s1 = from_f<T>(x.y + r.y);
  out = pack_pair(s0, s1);
  const float f0 = to_f(s0), f1 = to_f(s1);
  return f0 * f0 + f1 * f1;
}

// Sum of squares of one row's h = x + r over 16-byte chunks (8 half-precision elements),
// h stored; the caller has checked that every row pointer is 16-byte aligned.
template <typename T>
__device__ __forceinline__ float add_row_vec(const T* x, const T* r, T* h, int cols) {
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  const uint4* rv = reinterpret_cast<const uint4*>(r);
  uint4* hv = reinterpret_cast<uint4*>(h);
  float ss = 0.f;
  for (int c = threadIdx.x; c < cols / 8; c += blockDim.x) {
    const uint4 a = __ldg(xv + c), b = __ldg(rv + c);
    uint4 s;
    ss += add_pair_sq<T>(a.x, b.x, s.x) + add_pair_sq<T>(a.y, b.y, s.y) +
          add_pair_sq<T>(a.z, b.z, s.z) + add_pair_sq<T>(a.w, b.w, s.w);
    hv[c] = s;
  }
  return ss;
}

template <typename T, typename W>
__device__ void add_rms_norm_fwd(const T* __restrict__ x, const T* __restrict__ r,
                                 const W* __restrict__ w, T* __restrict__ h, T* __restrict__ y,
                                 int64_t rows, int cols, float eps) {
  __shared__ float scratch[32];
  // Launched programmatically: x is the output of the kernel ahead.
  pdl_wait();
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = row * cols;
    bool vec = false;  // block-uniform: every thread of the block is on the same row
    if constexpr (sizeof(T) == 2) {
      const uintptr_t addr =
          reinterpret_cast<uintptr_t>(x + base) | reinterpret_cast<uintptr_t>(r + base) |
          reinterpret_cast<uintptr_t>(h + base);
      vec = cols % 8 == 0 && addr % 16 == 0;
    }
    float ss = 0.f;
    if constexpr (sizeof(T) == 2) {
      if (vec) ss = add_row_vec(x + base, r + base, h + base, cols);
    }
    if (!vec) {
#pragma unroll 4
      for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const T s = from_f<T>(to_f(__ldg(x + base + c)) + to_f(__ldg(r + base + c)));
        h[base + c] = s;
        const float v = to_f(s);
        ss += v * v;
      }
    }
    const float rstd = exact_rstd(block_sum(ss, scratch), cols, eps);
#pragma unroll 4
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
      const float v = to_f(from_f<T>(to_f(__ldg(x + base + c)) + to_f(__ldg(r + base + c))));
      y[base + c] = from_f<T>(v * rstd * to_f(w[c]));
    }
  }
}

constexpr int NORM_BWD_ROWS = 32;

// A block of NORM_BWD_ROWS rows: its warps find each row's rstd and the coefficient of the
// rstd term, then every thread walks its columns down the rows (coalesced along a row),
// writing dx and its column's dw over the block's rows into row blockIdx.x of dw_part
// (f32, (blocks, cols)), which rms_norm_dw sums.
//   dx_j = rstd * w_j * dy_j - x_j * rstd^3 * sum_k(dy_k w_k x_k) / cols
//   dw_j = sum_rows dy_j * x_j * rstd
template <typename T, typename W>
__device__ void rms_norm_bwd(const T* __restrict__ x, const W* __restrict__ w,
                             const T* __restrict__ dy, T* __restrict__ dx,
                             float* __restrict__ dw_part, int64_t rows, int cols, float eps) {
  __shared__ float rstd_s[NORM_BWD_ROWS], coef_s[NORM_BWD_ROWS];
  const int64_t row0 = (int64_t)blockIdx.x * NORM_BWD_ROWS;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int r = warp; r < NORM_BWD_ROWS; r += warps) {
    const int64_t row = row0 + r;
    float ss = 0.f, dot = 0.f;
    if (row < rows) {
      for (int c = lane; c < cols; c += 32) {
        const float xv = to_f(x[row * cols + c]);
        ss += xv * xv;
        dot += to_f(dy[row * cols + c]) * to_f(w[c]) * xv;
      }
    }
    ss = warp_sum(ss);
    dot = warp_sum(dot);
    if (lane == 0) {
      const float rstd = exact_rstd(ss, cols, eps);
      rstd_s[r] = rstd;
      coef_s[r] = rstd * rstd * rstd * dot / cols;
    }
  }
  __syncthreads();
  const int nrows = (int)min((int64_t)NORM_BWD_ROWS, rows - row0);
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const float wc = to_f(w[c]);
    float dw = 0.f;
    for (int r = 0; r < nrows; ++r) {
      const int64_t i = (row0 + r) * cols + c;
      const float xv = to_f(x[i]), g = to_f(dy[i]);
      dx[i] = from_f<T>(rstd_s[r] * wc * g - xv * coef_s[r]);
      dw += g * xv * rstd_s[r];
    }
    dw_part[(int64_t)blockIdx.x * cols + c] = dw;
  }
}

constexpr int NORM_DW_COLS = 32, NORM_DW_GROUPS = 8;

// dw = the column sums of dw_part (blocks, cols), in the same order on every run: a block of
// NORM_DW_COLS x NORM_DW_GROUPS threads per NORM_DW_COLS columns, group g summing the
// partials g, g + GROUPS, ... (coalesced along a row of partials), then the groups in order.
__device__ void rms_norm_dw(const float* __restrict__ dw_part, float* __restrict__ dw,
                            int blocks, int cols) {
  __shared__ float sums[NORM_DW_GROUPS][NORM_DW_COLS];
  const int lane = threadIdx.x % NORM_DW_COLS, g = threadIdx.x / NORM_DW_COLS;
  const int c = blockIdx.x * NORM_DW_COLS + lane;
  float s = 0.f;
  if (c < cols)
    for (int b = g; b < blocks; b += NORM_DW_GROUPS) s += dw_part[(int64_t)b * cols + c];
  sums[g][lane] = s;
  __syncthreads();
  if (g == 0 && c < cols) {
    float t = sums[0][lane];
    for (int i = 1; i < NORM_DW_GROUPS; ++i) t += sums[i][lane];
    dw[c] = t;
  }
}

}  // namespace train
