// RMSNorm, forward and backward: y = x * rstd * w with rstd = (mean(x^2) + eps)^-1/2 per
// row, f32 arithmetic and one rounding. The backward recomputes rstd from x rather than
// saving it (one more read of a row that is in L2 anyway) and sums dw over rows in a fixed
// order: per block of rows a partial per column, then a pass over the partials (bitwise
// repeatable, unlike an atomic per column per block). rstd is correctly rounded (__fsqrt_rn,
// __fdiv_rn: the build's --use_fast_math would make 1/sqrtf and rsqrtf approximate): dx
// cancels to ~eps/x^2 of its terms on short rows, and a 2-ulp rsqrtf showed there.
#pragma once
#include "train/common.cuh"

namespace train {

__device__ __forceinline__ float exact_rstd(float sum_sq, int cols, float eps) {
  return __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fdiv_rn(sum_sq, (float)cols), eps)));
}

// One warp per row.
template <typename T, typename W>
__device__ void rms_norm_fwd(const T* __restrict__ x, const W* __restrict__ w, T* __restrict__ y,
                             int64_t rows, int cols, float eps) {
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
