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
// into contiguous ranges, one per thread; each weight row is read once for up to 4 rows of x, and the
// next row is prefetched while one is read.
#pragma once
#include "small_linear.h"

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
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t c = 0; c < N; ++c) {
      const int8_t* row = w + c * K;
      const float* sc = scale + c * NG;
      for (int64_t j = 0; j < K; j += 64) __builtin_prefetch(row + K + j, 0, 3);
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int mc = (int)(M - m0 < 4 ? M - m0 : 4);
        __m256 facc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t g = 0; g < NG; ++g) {
          __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                            _mm256_setzero_si256()};
          for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
            const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(row + k)));
            for (int m = 0; m < mc; ++m) {
              const __m256i xv = _mm256_loadu_si256((const __m256i*)(xq.data() + (m0 + m) * K + k));
              acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(xv, wv));
            }
          }
          const __m256 s = _mm256_set1_ps(sc[g]);
          for (int m = 0; m < mc; ++m) facc[m] = _mm256_add_ps(facc[m], _mm256_mul_ps(_mm256_cvtepi32_ps(acc[m]), s));
        }
        for (int m = 0; m < mc; ++m) emit(c, m0 + m, hsum((f8)facc[m]) * sx[m0 + m]);
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
