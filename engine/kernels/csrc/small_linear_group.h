// y = (gain * pre(x)) @ W.T (+ bias) (+ residual) for a few rows of x, W an int8 matrix with one scale
// per `G` consecutive inputs of a row (GGUF's Q8_0: G = 32): W[n][k] = q[n][k] * scale[n][k / G].
// Built by `engine.native_linear` for `engine.group_int8`'s weights.
//
// Layout: as small_linear.h, with scale [N, K / G] fp32 and gain [K] fp32 or null (an RMSNorm gain
// that could not be folded into W: it multiplies pre(x) column by column).
//
// How: pre(x) once (small_linear.h's `pre_rows`), times the gain; on AVX2 rounded to int16 per row
// (`quantize_i16`) and each group's dot product summed exactly in int32 by vpmaddwd (|lane| <= 2 x
// 2 x 127 x 32767 < 2^24 for G = 32, so its conversion to fp32 is exact), then scaled by the group's
// scale into an fp32 vector accumulator; elsewhere in fp32, group by group. Output channels are split
// into contiguous ranges, one per thread; weight rows are read side by side (4 against one row of x,
// else 2 against tiles of 2 rows of x: independent accumulator chains), the next ones prefetched.
#pragma once
#include "small_linear.h"

#if defined(__AVX2__)
// out[m][r] = sum over groups g of scale_r[g] * (x[m] . rows[r]) over the group's G inputs, for M rows
// of int16 x (row stride K) and R int8 weight rows: each group's sum exact in int32 (vpmaddwd), then
// scaled into an fp32 vector accumulator.
template <int M, int R>
static inline void group_dots(const int16_t* x, int64_t K, const int8_t* const* rows, const float* const* scs,
                              int64_t NG, int64_t G, float out[4][4]) {
  __m256 facc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) facc[m][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < NG; ++g) {
    __m256i acc[M][R];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_si256();
    for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
      __m256i wv[R];
      for (int r = 0; r < R; ++r) wv[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(rows[r] + k)));
      for (int m = 0; m < M; ++m) {
        const __m256i xv = _mm256_loadu_si256((const __m256i*)(x + m * K + k));
        for (int r = 0; r < R; ++r) acc[m][r] = _mm256_add_epi32(acc[m][r], _mm256_madd_epi16(xv, wv[r]));
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 s = _mm256_set1_ps(scs[r][g]);
      for (int m = 0; m < M; ++m)
        facc[m][r] = _mm256_add_ps(facc[m][r], _mm256_mul_ps(_mm256_cvtepi32_ps(acc[m][r]), s));
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) out[m][r] = hsum((f8)facc[m][r]);
}
#endif

template <typename X>
static void small_linear_group(const X* x, const int8_t* w, const float* scale, int64_t G, const float* gain,
                               const float* bias, const X* residual, X* y, int64_t M, int64_t N, int64_t K, int pre,
                               float eps, int nthreads) {
  std::vector<float> xs(M * K);  // gain * pre(x) [M, K] fp32
  pre_rows(x, xs.data(), M, K, pre, eps);
  if (gain)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) xs[m * K + k] *= gain[k];
  const int64_t NG = K / G;
  auto emit = [&](int64_t c, int64_t m, float v) {
    const int64_t i = m * N + c;
    store1(y + i, v + (bias ? bias[c] : 0.f) + (residual ? load1(residual + i) : 0.f));
  };
#if defined(__AVX2__)
  if (G % 16 == 0) {
    std::vector<int16_t> xq;
    std::vector<float> sx;
    quantize_i16(xs.data(), M, K, xq, sx);
    // Weight rows side by side (independent accumulator chains): 4 against one row of x, else 2 against
    // tiles of 2 rows of x (8 accumulators in registers either way).
    const int R = M == 1 ? 4 : 2;
#pragma omp parallel num_threads(nthreads)
    {
      const int64_t T = omp_get_num_threads(), t = omp_get_thread_num();
      const int64_t a = N * t / T, b = N * (t + 1) / T;
      float out[4][4];
      for (int64_t c = a; c < b; c += R) {
        const int rc = (int)(b - c < R ? b - c : R);
        const int8_t* rows[4];
        const float* scs[4];
        for (int r = 0; r < rc; ++r) {
          rows[r] = w + (c + r) * K;
          scs[r] = scale + (c + r) * NG;
          for (int64_t j = 0; j < K; j += 64) __builtin_prefetch(rows[r] + R * K + j, 0, 3);
        }
        for (int64_t m0 = 0; m0 < M; m0 += 2) {
          const int mc = (int)(M - m0 < 2 ? M - m0 : 2);
          const int16_t* xm = xq.data() + m0 * K;
          if (rc == 4) group_dots<1, 4>(xm, K, rows, scs, NG, G, out);
          else if (rc == 2) (mc == 1 ? group_dots<1, 2> : group_dots<2, 2>)(xm, K, rows, scs, NG, G, out);
          else
            for (int r = 0; r < rc; ++r) {  // the last 1 or 3 rows of a thread's range
              float one[4][4];
              (mc == 1 ? group_dots<1, 1> : group_dots<2, 1>)(xm, K, rows + r, scs + r, NG, G, one);
              for (int m = 0; m < mc; ++m) out[m][r] = one[m][0];
            }
          for (int r = 0; r < rc; ++r)
            for (int m = 0; m < mc; ++m) emit(c + r, m0 + m, out[m][r] * sx[m0 + m]);
        }
      }
    }
    return;
  }
#endif
#pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t c = 0; c < N; ++c) {
    const int8_t* row = w + c * K;
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = xs.data() + m * K;
      float tot = 0.f;
      for (int64_t g = 0; g < NG; ++g) {
        float s = 0.f;
        for (int64_t k = g * G; k < (g + 1) * G; ++k) s += xm[k] * (float)row[k];
        tot += s * scale[c * NG + g];
      }
      emit(c, m, tot);
    }
  }
}
