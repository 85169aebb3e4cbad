// The AVX-512 path of paged_decode.h's dot products and weighted sums (included there; see its
// layout): for head sizes D that are a multiple of 32, 16-float vectors over 32-value chunks.
//
// Each 32 values of a cache row load as two 16-float vectors in a fixed lane order pi, and q and acc
// are kept in that order too (a dot product and a weighted sum do not care which lane holds which
// dimension): for fp32 pi is the identity (values 0-15, then 16-31); for bf16 the 32 values load as 16
// uint32 lanes and lane i's low half (value 2i) becomes `x << 16`, its high half (value 2i + 1)
// `x & 0xffff0000`: the widening with no shuffle (a vpmovzxwd per 16 values competes with the FMAs
// for one port). V rows are read once for the 2-4 query heads of a KV head where their accumulators
// fit in registers. Shift / mask / FMA beats AVX512-BF16's vdpbf16ps for the bf16 scores (with q split
// as hi + lo bf16) too (docs/benchmarks-notes.md).
#pragma once
#include <cstdint>
#include <cstring>

#include "vec8.h"

#if defined(__AVX512F__)
typedef uint32_t u32z __attribute__((vector_size(64)));

static inline void pair32(const float* p, fz& a, fz& b) { a = loadz(p); b = loadz(p + 16); }
static inline void pair32(const uint16_t* p, fz& a, fz& b) {
  u32z u, lo, hi;
  std::memcpy(&u, p, sizeof u);
  lo = u << 16;
  hi = u & 0xffff0000u;
  std::memcpy(&a, &lo, sizeof a);
  std::memcpy(&b, &hi, sizeof b);
}
// Position of dimension d (< 32) of a chunk in pi order.
template <typename T>
static inline int64_t lane_of(int64_t d) {
  if constexpr (sizeof(T) == 4) return d;
  else return (d & 1) * 16 + d / 2;
}
template <typename T>
static inline void to_lanes(const float* x, int64_t D, float* out) {  // natural order -> pi order
  for (int64_t c = 0; c < D; c += 32)
    for (int64_t d = 0; d < 32; ++d) out[c + lane_of<T>(d)] = x[c + d];
}
template <typename T>
static inline void from_lanes(float* x, int64_t D) {  // pi order -> natural order, in place
  float t[32];
  for (int64_t c = 0; c < D; c += 32) {
    for (int64_t d = 0; d < 32; ++d) t[d] = x[c + lane_of<T>(d)];
    std::memcpy(x + c, t, sizeof t);
  }
}
static inline f8 fold(fz v) {  // 16 lanes -> 8 (lane i + lane i + 8)
  f8 lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + 32, sizeof hi);
  return lo + hi;
}

// s[0, 8) = scale * (the sum of each a[j]'s lanes): one transpose-and-add, as in `scores`.
static inline void reduce8(const fz* a, float scale, float* s) {
  const __m256 t0 = _mm256_hadd_ps((__m256)fold(a[0]), (__m256)fold(a[1]));
  const __m256 t1 = _mm256_hadd_ps((__m256)fold(a[2]), (__m256)fold(a[3]));
  const __m256 t2 = _mm256_hadd_ps((__m256)fold(a[4]), (__m256)fold(a[5]));
  const __m256 t3 = _mm256_hadd_ps((__m256)fold(a[6]), (__m256)fold(a[7]));
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  const f8 sum = (f8)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  const f8 out = sum * scale;
  std::memcpy(s, &out, sizeof out);
}

// `scores` for NC = D / 32 chunks, q in pi order.
template <int NC, typename T>
static inline void scores_z(const float* q, const T* k, int64_t rs, int64_t n, float scale, float* s) {
  fz qa[NC], qb[NC];
  for (int c = 0; c < NC; ++c) { qa[c] = loadz(q + 32 * c); qb[c] = loadz(q + 32 * c + 16); }
  int64_t r = 0;
  for (; r + 8 <= n; r += 8) {
    fz a[8];
    for (int j = 0; j < 8; ++j) {
      fz x, y;
      pair32(k + (r + j) * rs, x, y);
      a[j] = qa[0] * x + qb[0] * y;
    }
    for (int c = 1; c < NC; ++c)
      for (int j = 0; j < 8; ++j) {
        fz x, y;
        pair32(k + (r + j) * rs + 32 * c, x, y);
        a[j] += qa[c] * x;
        a[j] += qb[c] * y;
      }
    reduce8(a, scale, s + r);
  }
  for (; r < n; ++r) {
    fz a{};
    for (int c = 0; c < NC; ++c) {
      fz x, y;
      pair32(k + r * rs + 32 * c, x, y);
      a += qa[c] * x + qb[c] * y;
    }
    s[r] = hsum(fold(a)) * scale;
  }
}

// `weigh` for NC = D / 32 chunks, acc in pi order; even and odd rows have their own accumulators
// (two FMA chains per register instead of one), added at the end.
template <int NC, typename T>
static inline void weigh_z(const float* p, const T* v, int64_t rs, int64_t n, float* acc) {
  fz e[2][2 * NC];
  for (int i = 0; i < 2 * NC; ++i) { e[0][i] = loadz(acc + 16 * i); e[1][i] = fz{}; }
  auto row = [&](int64_t r, fz* a) {
    const fz pr = splatz(p[r]);
    for (int c = 0; c < NC; ++c) {
      fz x, y;
      pair32(v + r * rs + 32 * c, x, y);
      a[2 * c] += pr * x;
      a[2 * c + 1] += pr * y;
    }
  };
  int64_t r = 0;
  for (; r + 2 <= n; r += 2) { row(r, e[0]); row(r + 1, e[1]); }
  if (r < n) row(r, e[0]);
  for (int i = 0; i < 2 * NC; ++i) storez(acc + 16 * i, e[0][i] + e[1][i]);
}

// `weigh_z` for the G query heads that share one KV head (p: G rows of scores `ps` apart; acc: their
// G [D] accumulators, contiguous): each V row is loaded and widened once for all G, and the G x 2NC
// accumulators are enough independent FMA chains without the even / odd rows split.
template <int NC, int G, typename T>
static inline void weigh_zg(const float* p, int64_t ps, const T* v, int64_t rs, int64_t n, float* acc) {
  fz e[G][2 * NC];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 2 * NC; ++i) e[g][i] = loadz(acc + g * 32 * NC + 16 * i);
  for (int64_t r = 0; r < n; ++r) {
    fz x[2 * NC];
    for (int c = 0; c < NC; ++c) pair32(v + r * rs + 32 * c, x[2 * c], x[2 * c + 1]);
    for (int g = 0; g < G; ++g) {
      const fz pr = splatz(p[g * ps + r]);
      for (int i = 0; i < 2 * NC; ++i) e[g][i] += pr * x[i];
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < 2 * NC; ++i) storez(acc + g * 32 * NC + 16 * i, e[g][i]);
}

// The weighted sums of KV head j's G query heads (h = j G .. j G + G - 1) over rows [0, n) of a V block:
// grouped where G x 2NC accumulators fit in registers beside a row (<= 16), else head by head.
template <int NC, typename T>
static inline void weigh_kv(const float* p, int64_t ps, const T* v, int64_t rs, int64_t n, int64_t G, float* acc) {
  if (G == 2 && 2 * 2 * NC <= 16) return weigh_zg<NC, 2>(p, ps, v, rs, n, acc);
  if (G == 3 && 3 * 2 * NC <= 16) return weigh_zg<NC, 3>(p, ps, v, rs, n, acc);
  if (G == 4 && 4 * 2 * NC <= 16) return weigh_zg<NC, 4>(p, ps, v, rs, n, acc);
  for (int64_t g = 0; g < G; ++g) weigh_z<NC>(p + g * ps, v, rs, n, acc + g * 32 * NC);
}
#endif
