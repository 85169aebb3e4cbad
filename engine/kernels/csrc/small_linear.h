// y = pre(x) @ W.T * scale (+ bias) (+ residual) for a few rows of x: the decode-step linear layer,
// a matrix-vector product bound by the read of W. Built by `engine.native_linear`.
//
// Layout: x [M, Kx] fp32 or bf16 (raw uint16 bits), row-major; W [N, K] fp32, bf16 or int8, row-major;
// scale [N] fp32 or null (int8: the per-output-channel scale); bias [N] fp32 or null; residual [M, N]
// in y's dtype or null; y [M, N] in x's dtype. pre: 0 = x as is (Kx = K); 1 = RMSNorm without gain
// (x * rsqrt(mean(x^2) + eps), Kx = K: the gain lives in W); 2 = GLU, silu(x[:, :K]) * x[:, K:]
// (Kx = 2K). Every sum is fp32, except int8 weights on AVX2: exact integer sums over pre(x) rounded
// to int16 per row (max |x| -> 32767; finer than bf16 activations unless max |x| > ~250 x the row's rms).
//
// How: pre(x) is computed once into an fp32 scratch [M, K] (tiny: it stays in L1/L2); the N output
// channels are split into contiguous ranges, one per thread, so each thread streams its part of W
// once; up to 4 rows of x: each weight vector loaded is used for every row; with one row four weight
// rows run side by side, with 2-4 rows two (independent FMA chains, and read streams far apart in
// memory: see the note above the parallel region); beyond 4 rows (`many_rows`) two adjacent weight
// rows, widened to fp32 once, against chunks of up to 6 rows. Vectors are GCC vector extensions of 8 floats: AVX2 / AVX-512 / NEON code from one
// source under -march=native; no -ffast-math (it would set flush-to-zero for the whole process),
// the reductions are written out as explicit vector accumulators instead.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "vec8.h"

enum { PRE_NONE = 0, PRE_RMS = 1, PRE_GLU = 2 };  // pre(x): as is, RMSNorm, GLU

// The rows of pre(x) a product reads: fp32 [M, K] (f); for int8 weights on AVX2 also int16 [M, K]
// (q) with one fp32 scale per row (s): q[m][k] = round(f[m][k] / s[m]), s[m] = max_k |f[m][k]| / 32767.
struct XRows {
  const float* f;
  const int16_t* q;
  const float* s;
};

#if defined(__AVX2__)
static inline int64_t hsum_i32(__m256i v) {
  int32_t l[8];
  std::memcpy(l, &v, sizeof l);
  int64_t s = 0;
  for (int i = 0; i < 8; ++i) s += l[i];
  return s;
}

// out[m][r] = s[m] * (q[m] . rows[r]) for int8 weight rows, the dot product exact in integers:
// vpmaddwd multiplies 16 int16 pairs into 8 int32 pair sums (|pair| <= 2 * 127 * 32767 < 2^23), so
// an int32 lane takes 128 of them (2,048 values of K) before it is flushed into an int64 total.
// Half the instructions of widening each weight to fp32 for an FMA (the int8 kernel was bound by
// them, not by the read).
template <int M, int R>
static inline void dots_i16(const int16_t* q, const float* s, const int8_t* const* rows, int64_t K,
                            float out[8][4]) {
  int64_t tot[M][R] = {};
  const int64_t K16 = K & ~int64_t(15);
  for (int64_t k0 = 0; k0 < K16; k0 += 2048) {
    const int64_t k1 = K16 < k0 + 2048 ? K16 : k0 + 2048;
    __m256i acc[M][R];
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) acc[m][r] = _mm256_setzero_si256();
    for (int64_t k = k0; k < k1; k += 16) {
      __m256i wv[R];
      for (int r = 0; r < R; ++r) wv[r] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(rows[r] + k)));
      for (int m = 0; m < M; ++m) {
        const __m256i xv = _mm256_loadu_si256((const __m256i*)(q + m * K + k));
        for (int r = 0; r < R; ++r) acc[m][r] = _mm256_add_epi32(acc[m][r], _mm256_madd_epi16(xv, wv[r]));
      }
    }
    for (int m = 0; m < M; ++m)
      for (int r = 0; r < R; ++r) tot[m][r] += hsum_i32(acc[m][r]);
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      for (int64_t k = K16; k < K; ++k) tot[m][r] += (int64_t)q[m * K + k] * rows[r][k];
      out[m][r] = (float)((double)tot[m][r] * s[m]);
    }
}
#endif

// out[m][r] = x[m0 + m] . rows[r] over K, for M rows of x (row stride K) and R weight rows.
template <typename W, int M, int R>
static inline void dots(const XRows& x, int64_t m0, const W* const* rows, int64_t K, float out[8][4]) {
#if defined(__AVX2__)
  if constexpr (std::is_same_v<W, int8_t>) {
    dots_i16<M, R>(x.q + m0 * K, x.s + m0, rows, K, out);
    return;
  }
#endif
  const float* xs = x.f + m0 * K;
  f8 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = f8{};
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t k = 0; k < K8; k += 8) {
    f8 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load8(rows[r] + k);
    for (int m = 0; m < M; ++m) {
      const f8 xv = load8(xs + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] += xv * wv[r];
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) {
      float s = hsum(acc[m][r]);
      for (int64_t k = K8; k < K; ++k) s += xs[m * K + k] * load1(rows[r] + k);
      out[m][r] = s;
    }
}

// `dots` with the row count as a compile-time constant (1..6), so every accumulator is a register.
template <typename W, int R>
static inline void dots_n(int M, const XRows& x, int64_t m0, const W* const* rows, int64_t K, float out[8][4]) {
  switch (M) {
    case 1: dots<W, 1, R>(x, m0, rows, K, out); break;
    case 2: dots<W, 2, R>(x, m0, rows, K, out); break;
    case 3: dots<W, 3, R>(x, m0, rows, K, out); break;
    case 4: dots<W, 4, R>(x, m0, rows, K, out); break;
    case 5: dots<W, 5, R>(x, m0, rows, K, out); break;
    default: dots<W, 6, R>(x, m0, rows, K, out); break;
  }
}

// More than 4 rows of x (fp32 or bf16 weights): the product is no longer bound by the read of W but
// by the FMAs and the loads feeding them. Each thread walks its output channels two adjacent rows
// at a time, widens a bf16 pair into an fp32 scratch once (not once per chunk of x rows), and runs
// it against x in balanced chunks of up to 6 rows: 12 accumulators, 8 loads per 12 FMAs.
template <typename W, typename Emit>
static void many_rows(const XRows& xr, const W* w, int64_t M, int64_t N, int64_t K, int nthreads, Emit emit) {
  const int64_t chunks = (M + 5) / 6, MC = (M + chunks - 1) / chunks;
#pragma omp parallel num_threads(nthreads)
  {
    const int64_t T = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t a = N * t / T, b = N * (t + 1) / T;
    std::vector<float> wb(std::is_same_v<W, float> ? 0 : 2 * K);  // [2, K] widened weight rows
    float out[8][4];
    for (int64_t c = a; c < b; c += 2) {
      const int rc = b - c < 2 ? 1 : 2;
      const float* rows[2];
      int64_t cols[2] = {c, c + 1};
      for (int r = 0; r < rc; ++r) {
        if constexpr (std::is_same_v<W, float>) {
          rows[r] = w + (c + r) * K;
        } else {
          float* d = wb.data() + r * K;
          const W* src = w + (c + r) * K;
          const int64_t K8 = K & ~int64_t(7);
          for (int64_t k = 0; k < K8; k += 8) { const f8 v = load8(src + k); std::memcpy(d + k, &v, sizeof v); }
          for (int64_t k = K8; k < K; ++k) d[k] = load1(src + k);
          rows[r] = d;
        }
      }
      for (int64_t m0 = 0; m0 < M; m0 += MC) {
        const int mc = (int)(M - m0 < MC ? M - m0 : MC);
        if (rc == 2) dots_n<float, 2>(mc, xr, m0, rows, K, out);
        else dots_n<float, 1>(mc, xr, m0, rows, K, out);
        emit(cols, rc, m0, mc, out);
      }
    }
  }
}

// pre(x) [M, K] fp32 into xs (see the top of this file for `pre`); small_linear_group.h's too.
template <typename X>
static void pre_rows(const X* x, float* xs, int64_t M, int64_t K, int pre, float eps) {
  for (int64_t m = 0; m < M; ++m) {
    float* d = xs + m * K;
    if (pre == 2) {
      const X* g = x + m * 2 * K;
      for (int64_t k = 0; k < K; ++k) {
        const float a = load1(g + k);
        d[k] = a / (1.f + std::exp(-a)) * load1(g + K + k);
      }
      continue;
    }
    const X* s = x + m * K;
    for (int64_t k = 0; k < K; ++k) d[k] = load1(s + k);
    if (pre == 1) {
      float ss = 0.f;
      for (int64_t k = 0; k < K; ++k) ss += d[k] * d[k];
      const float inv = 1.f / std::sqrt(ss / (float)K + eps);
      for (int64_t k = 0; k < K; ++k) d[k] *= inv;
    }
  }
}

// xs [M, K] as int16 q with one scale s per row (`XRows`): q = round(x / s), s = max |x| / 32767.
static inline void quantize_i16(const float* xs, int64_t M, int64_t K, std::vector<int16_t>& xq,
                                std::vector<float>& sx) {
  xq.resize(M * K);
  sx.resize(M);
  for (int64_t m = 0; m < M; ++m) {
    const float* d = xs + m * K;
    float mx = 0.f;
    for (int64_t k = 0; k < K; ++k) mx = std::max(mx, std::fabs(d[k]));
    sx[m] = mx > 0.f ? mx / 32767.f : 1.f;
    const float inv = 1.f / sx[m];
    for (int64_t k = 0; k < K; ++k) {
      const float v = std::nearbyint(d[k] * inv);
      xq[m * K + k] = (int16_t)(v > 32767.f ? 32767.f : v < -32767.f ? -32767.f : v);
    }
  }
}

template <typename X, typename W>
static void small_linear(const X* x, const W* w, const float* scale, const float* bias, const X* residual, X* y,
                         int64_t M, int64_t N, int64_t K, int pre, float eps, int nthreads) {
  std::vector<float> xs(M * K);  // pre(x) [M, K] fp32
  pre_rows(x, xs.data(), M, K, pre, eps);
  std::vector<int16_t> xq;  // int8 weights on AVX2: pre(x) as int16 [M, K] and a scale per row (`XRows`)
  std::vector<float> sx;
#if defined(__AVX2__)
  if constexpr (std::is_same_v<W, int8_t>) quantize_i16(xs.data(), M, K, xq, sx);
#endif
  const XRows xr{xs.data(), xq.data(), sx.data()};
  auto emit = [&](const int64_t* cols, int rc, int64_t m0, int mc, const float out[8][4]) {
    for (int r = 0; r < rc; ++r) {
      const int64_t c = cols[r];
      const float sc = scale ? scale[c] : 1.f, bi = bias ? bias[c] : 0.f;
      for (int m = 0; m < mc; ++m) {
        const int64_t i = (m0 + m) * N + c;
        store1(y + i, out[m][r] * sc + bi + (residual ? load1(residual + i) : 0.f));
      }
    }
  };
  if constexpr (!std::is_same_v<W, int8_t>) {
    if (M > 4) { many_rows(xr, w, M, N, K, nthreads, emit); return; }
  }
  // Each thread takes a contiguous range of output channels and reads it as S streams, a quarter
  // (one row of x) or a half (more rows) of the range apart: a short weight row (K = 576: 1-2 KB)
  // read as one stream got about half the bandwidth of four far-apart ones.
  const int S = M == 1 ? 4 : 2;
#pragma omp parallel num_threads(nthreads)
  {
    const int64_t T = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t a = N * t / T, b = N * (t + 1) / T, q = (b - a + S - 1) / S;
    float out[8][4];
    for (int64_t i = 0; i < q; ++i) {
      int64_t cols[4];
      const W* rows[4];
      int rc = 0;
      for (int st = 0; st < S; ++st) {
        const int64_t c = a + st * q + i;
        if (c < b) { cols[rc] = c; rows[rc] = w + c * K; ++rc; }
      }
      // bf16 / int8: each stream's next row, fetched while this one is read (a prefetch never faults,
      // past the end either). fp32 rows (twice the lines) run slower with it, so they are left to the
      // hardware prefetcher (docs/benchmarks-notes.md).
      if constexpr (!std::is_same_v<W, float>)
        for (int r = 0; r < rc; ++r)
          for (int64_t j = 0; j < K * (int64_t)sizeof(W); j += 64) __builtin_prefetch((const char*)(rows[r] + K) + j, 0, 3);
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int mc = (int)(M - m0 < 4 ? M - m0 : 4);
        if (rc == S && S == 4) dots<W, 1, 4>(xr, m0, rows, K, out);
        else if (rc == S) dots_n<W, 2>(mc, xr, m0, rows, K, out);
        else {
          for (int r = 0; r < rc; ++r) {
            float one[4][4];
            dots_n<W, 1>(mc, xr, m0, rows + r, K, one);
            for (int m = 0; m < mc; ++m) out[m][r] = one[m][0];
          }
        }
        emit(cols, rc, m0, mc, out);
      }
    }
  }
}
