// Row-wise prologues of the wrapped (oneDNN / BLAS) linear kernels: y = pre(x) in x's dtype, for
// prefill chunks and decode batches beyond the C++ matrix-vector kernel's rows. Built by
// `engine.native_rows`.
//
// Layout: x [M, Kx] fp32 or bf16 (raw uint16 bits), row-major; y [M, K] in x's dtype. pre: 1 =
// RMSNorm without gain (x * 1 / sqrt(mean(x^2) + eps), Kx = K: the gain lives in the next weight);
// 2 = GLU, silu(x[:, :K]) * x[:, K:] (Kx = 2K). The math is fp32, rounded once to y's dtype (torch's
// bf16 GLU rounds silu(gate) before the product: two roundings). silu(a) = a / (1 + e^-a), with e^-|a|
// from `exp_nonpos` (rel. error ~1e-7) so the loop vectorizes: a >= 0: a / (1 + e), else a e / (1 + e).
// Rows are split over the threads when there are enough of them (>= 8K values); each row is
// computed the same way whatever the split, so the result does not depend on the thread count.
#pragma once
#include <cmath>
#include <cstdint>

#include "vec8.h"

static inline float silu_f(float a) {
  const float e = exp_nonpos(-std::fabs(a)), r = 1.f / (1.f + e);
  return a >= 0.f ? a * r : a * e * r;
}

template <typename X>
static inline float sum_squares(const X* s, int64_t K) {
  f8 acc{};
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) { const f8 v = load8(s + k); acc += v * v; }
  float ss = hsum(acc);
  for (; k < K; ++k) { const float v = load1(s + k); ss += v * v; }
  return ss;
}

template <typename X>
static void rows_pre(const X* x, X* y, int64_t M, int64_t K, int pre, float eps, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (M * K >= 8192)
  for (int64_t m = 0; m < M; ++m) {
    X* d = y + m * K;
    if (pre == 2) {
      const X* g = x + m * 2 * K;
#pragma omp simd
      for (int64_t k = 0; k < K; ++k) store1(d + k, silu_f(load1(g + k)) * load1(g + K + k));
    } else {
      const X* s = x + m * K;
      const float inv = 1.f / std::sqrt(sum_squares(s, K) / (float)K + eps);
#pragma omp simd
      for (int64_t k = 0; k < K; ++k) store1(d + k, load1(s + k) * inv);
    }
  }
}
