// Paged decode attention for CPUs: one new query token per sequence against its cached positions,
// read in place through the block table (no gathered copy), built by `engine.native_attention`.
//
// Layout: q [B, H, D] fp32; k/v caches [num_blocks, BS, KV, D] fp32 or bf16 (raw uint16 bits);
// block_table [B, NB] int64; lens [B] int64, 1 <= lens[b] <= NB * BS (the caller's invariant: they
// are positions + 1); out [B, H, D] fp32. Head h reads KV head h / (H / KV) (GQA).
//
// Work items: a sequence's positions for every head, cut into chunks of whole blocks when there are
// fewer sequences than 4 x threads (so batch 1 keeps every thread busy: flash-decoding's split).
// An item reads its blocks once for the scores (each row holds every KV head: KV * D contiguous
// values; bf16 is widened as it is loaded), eight positions of a head at a time (eight vector dot
// products reduced together), then the softmax numerators over its positions in fp32 (visible
// positions only, so no -inf ever enters), then its blocks once more for the unnormalized weighted
// sum of V; while a block is read the one two reads ahead is prefetched into L2 (blocks lie anywhere
// in the cache, so the hardware prefetcher cannot guess them). With AVX-512 and D = 64 or 128 the
// products run in 16-float vectors (paged_decode_z.h). A whole sequence writes acc / sum; a chunk c
// leaves (m_c, l_c, acc_c) per head (its max score, sum of numerators, weighted sum), combined after
// every item is done:
// out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c with M = max_c m_c.
// The cut depends only on B, max(lens), BS and the thread count, never on the schedule: the same
// arguments give the same bits on every run. Built with -O3 -march=native -fopenmp (no -ffast-math:
// it would set FTZ/DAZ process-wide); exp is `exp_nonpos`, plain arithmetic that vectorizes.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec8.h"
#include "paged_decode_z.h"

// s[r] = scale * (q . k_r) for r < n, k_r = k + r * rs: D values, D = 8 * ND (ND = 0: D / 8 read at
// run time; ND < 0: any D, scalar). Eight positions at a time on AVX2: eight independent FMA chains,
// then one transpose-and-add of the eight accumulators instead of eight horizontal sums.
template <int ND, typename T>
static inline void scores(const float* q, const T* k, int64_t rs, int64_t n, int64_t D, float scale, float* s) {
  int64_t r = 0;
  if constexpr (ND < 0) {
    for (; r < n; ++r) {
      float acc = 0.f;
      for (int64_t d = 0; d < D; ++d) acc += q[d] * load1(k + r * rs + d);
      s[r] = acc * scale;
    }
    return;
  } else {
    const int64_t nd = ND ? ND : D / 8;
#if defined(__AVX2__)
    for (; r + 8 <= n; r += 8) {
      f8 a[8] = {};
      for (int64_t i = 0; i < nd; ++i) {
        const f8 qv = load8(q + 8 * i);
        for (int j = 0; j < 8; ++j) a[j] += qv * load8(k + (r + j) * rs + 8 * i);
      }
      const __m256 t0 = _mm256_hadd_ps((__m256)a[0], (__m256)a[1]), t1 = _mm256_hadd_ps((__m256)a[2], (__m256)a[3]);
      const __m256 t2 = _mm256_hadd_ps((__m256)a[4], (__m256)a[5]), t3 = _mm256_hadd_ps((__m256)a[6], (__m256)a[7]);
      const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [a0..a3 | a0..a3], [a4..a7 | a4..a7]
      const f8 sum = (f8)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
      const f8 out = sum * scale;
      std::memcpy(s + r, &out, sizeof out);
    }
#endif
    for (; r < n; ++r) {
      f8 a{};
      for (int64_t i = 0; i < nd; ++i) a += load8(q + 8 * i) * load8(k + r * rs + 8 * i);
      s[r] = hsum(a) * scale;
    }
  }
}

// acc[0, D) += sum_r p[r] * v_r for r < n, v_r = v + r * rs (ND as in `scores`; the accumulators stay
// in registers across the rows when ND is known).
template <int ND, typename T>
static inline void weigh(const float* p, const T* v, int64_t rs, int64_t n, int64_t D, float* acc) {
  if constexpr (ND < 0) {
    for (int64_t r = 0; r < n; ++r)
      for (int64_t d = 0; d < D; ++d) acc[d] += p[r] * load1(v + r * rs + d);
  } else if constexpr (ND == 0) {
    for (int64_t r = 0; r < n; ++r) {
      const f8 pr = splat8(p[r]);
      for (int64_t d = 0; d < D; d += 8) {
        const f8 a = load8(acc + d) + pr * load8(v + r * rs + d);
        std::memcpy(acc + d, &a, sizeof a);
      }
    }
  } else {
    f8 a[ND];
    for (int i = 0; i < ND; ++i) a[i] = load8(acc + 8 * i);
    for (int64_t r = 0; r < n; ++r) {
      const f8 pr = splat8(p[r]);
      for (int i = 0; i < ND; ++i) a[i] += pr * load8(v + r * rs + 8 * i);
    }
    std::memcpy(acc, a, sizeof a);
  }
}


// max(s[0, n)), n >= 1, with vector compares (an `omp simd` max reduction stays scalar here).
static inline float max_of(const float* s, int64_t n) {
  float mx = s[0];
  int64_t t = 0;
  if (n >= 8) {
    f8 m = load8(s);
    for (t = 8; t + 8 <= n; t += 8) { const f8 v = load8(s + t); m = m > v ? m : v; }
    for (int i = 0; i < 8; ++i) mx = std::max(mx, m[i]);
  }
  for (; t < n; ++t) mx = std::max(mx, s[t]);
  return mx;
}

// How many block reads ahead the prefetches run, and into which cache (2: L2). Into L2 beats into L1,
// the distance matters little, and prefetching every line beats prefetching only some of them and
// leaving the rest to the hardware prefetcher (figures: docs/benchmarks-notes.md).
constexpr int64_t PREFETCH_AHEAD = 2;
constexpr int PREFETCH_HINT = 2;

// Part i of `parts` of the cache lines holding p[0, n): each block a few reads ahead is fetched while
// the block is read, a few lines per head, so the fetches neither arrive late nor queue up all at once.
template <typename T>
static inline void prefetch_part(const T* p, int64_t n, int64_t i, int64_t parts) {
  constexpr int64_t line = 64 / sizeof(T);
  const int64_t lines = (n + line - 1) / line, per = (lines + parts - 1) / parts;
  for (int64_t j = i * per; j < std::min(lines, (i + 1) * per); ++j)
    __builtin_prefetch(p + j * line, 0, PREFETCH_HINT);
}

// One work item: positions [t0, t1) of one sequence (t0 a multiple of BS; qb its [H, D] queries,
// table its block ids) for every head -> m, l [H] (max score, sum of numerators) and acc [H, D]
// (unnormalized weighted sum of V). s is scratch for [H, t1 - t0] scores.
template <int ND, typename T>
static void attend_chunk(const float* qb, const T* kc, const T* vc, const int64_t* table, int64_t t0, int64_t t1,
                         int64_t H, int64_t KV, int64_t D, int64_t BS, float scale, float* s, float* qz, float* m,
                         float* l, float* acc) {
  const int64_t G = H / KV, row = KV * D, blk = BS * row, n = t1 - t0;
#if defined(__AVX512F__)
  constexpr bool Z = ND > 0 && ND % 4 == 0;
  if constexpr (Z)
    for (int64_t h = 0; h < H; ++h) to_lanes<T>(qb + h * D, D, qz + h * D);
#else
  (void)qz;
#endif
  // The item reads nb K blocks, then the same nb V blocks: read i (< 2 nb) is block i % nb of K or V.
  const int64_t nb = (n + BS - 1) / BS;
  auto read_ptr = [&](int64_t i) -> const T* { return (i < nb ? kc : vc) + table[t0 / BS + i % nb] * blk; };
  auto read_rows = [&](int64_t i) { return std::min(BS, n - (i % nb) * BS) * row; };
  for (int64_t i = 0; i < std::min<int64_t>(PREFETCH_AHEAD, 2 * nb); ++i)
    prefetch_part(read_ptr(i), read_rows(i), 0, 1);
  for (int64_t b0 = t0; b0 < t1; b0 += BS) {
    const T* kb = kc + table[b0 / BS] * blk;
    const int64_t nr = std::min(BS, t1 - b0);
    const int64_t ahead = (b0 - t0) / BS + PREFETCH_AHEAD;
    const T* next = ahead < 2 * nb ? read_ptr(ahead) : nullptr;
    const int64_t next_n = next ? read_rows(ahead) : 0;
    for (int64_t h = 0; h < H; ++h) {
      prefetch_part(next, next_n, h, H);
#if defined(__AVX512F__)
      if constexpr (Z) {
        scores_z<ND / 4>(qz + h * D, kb + (h / G) * D, row, nr, scale, s + h * n + (b0 - t0));
        continue;
      }
#endif
      scores<ND>(qb + h * D, kb + (h / G) * D, row, nr, D, scale, s + h * n + (b0 - t0));
    }
  }
  for (int64_t h = 0; h < H; ++h) {
    float* sh = s + h * n;
    float mx = max_of(sh, n);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) { const float e = exp_nonpos(sh[t] - mx); sh[t] = e; sum += e; }
    m[h] = mx;
    l[h] = sum;
  }
  std::fill(acc, acc + H * D, 0.f);
  for (int64_t b0 = t0; b0 < t1; b0 += BS) {
    const T* vb = vc + table[b0 / BS] * blk;
    const int64_t nr = std::min(BS, t1 - b0);
    const int64_t ahead = nb + (b0 - t0) / BS + PREFETCH_AHEAD;
    const T* next = ahead < 2 * nb ? read_ptr(ahead) : nullptr;
    const int64_t next_n = next ? read_rows(ahead) : 0;
#if defined(__AVX512F__)
    if constexpr (Z) {
      for (int64_t j = 0; j < KV; ++j) {
        prefetch_part(next, next_n, j, KV);
        weigh_kv<ND / 4>(s + j * G * n + (b0 - t0), n, vb + j * D, row, nr, G, acc + j * G * D);
      }
      continue;
    }
#endif
    for (int64_t h = 0; h < H; ++h) {
      prefetch_part(next, next_n, h, H);
      weigh<ND>(s + h * n + (b0 - t0), vb + (h / G) * D, row, nr, D, acc + h * D);
    }
  }
#if defined(__AVX512F__)
  if constexpr (Z)
    for (int64_t h = 0; h < H; ++h) from_lanes<T>(acc + h * D, D);
#endif
}

template <int ND, typename T>
static void attend_d(const float* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* lens, float* out,
                     int64_t B, int64_t H, int64_t KV, int64_t D, int64_t BS, int64_t NB, float scale, int nthreads) {
  int64_t max_len = 1;
  for (int64_t b = 0; b < B; ++b) max_len = std::max(max_len, lens[b]);
  int64_t chunk = (max_len + BS - 1) / BS * BS;  // whole sequences, unless too few of them
  const int64_t want = nthreads > 1 ? 4 * (int64_t)nthreads : 1;
  if (B < want) {
    const int64_t per = (want + B - 1) / B;  // chunks wanted per sequence; at least two blocks each
    chunk = std::max(2 * BS, ((max_len + per - 1) / per + BS - 1) / BS * BS);
  }
  std::vector<int64_t> first(B + 1, 0);  // sequence b's items: [first[b], first[b + 1])
  for (int64_t b = 0; b < B; ++b) first[b + 1] = first[b] + (lens[b] + chunk - 1) / chunk;
  const int64_t items = first[B];
  const bool split = items > B;
  std::vector<float> pm(split ? items * H : 0), pl(split ? items * H : 0), pacc(split ? items * H * D : 0);
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<float> s(H * chunk), qz(H * D), m(H), l(H), acc(H * D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t b = std::upper_bound(first.begin(), first.end(), it) - first.begin() - 1;
      const int64_t t0 = (it - first[b]) * chunk, t1 = std::min(lens[b], t0 + chunk);
      const bool whole = first[b + 1] - first[b] == 1;
      float* mo = whole ? m.data() : pm.data() + it * H;
      float* lo = whole ? l.data() : pl.data() + it * H;
      float* ao = whole ? acc.data() : pacc.data() + it * H * D;
      attend_chunk<ND>(q + b * H * D, kc, vc, bt + b * NB, t0, t1, H, KV, D, BS, scale, s.data(), qz.data(), mo, lo,
                       ao);
      if (whole) {
        for (int64_t h = 0; h < H; ++h) {
          const float inv = 1.f / l[h];
          float* o = out + (b * H + h) * D;
          for (int64_t d = 0; d < D; ++d) o[d] = acc[h * D + d] * inv;
        }
      }
    }
    if (split) {  // after the implicit barrier: every chunk is done
#pragma omp for schedule(static)
      for (int64_t bh = 0; bh < B * H; ++bh) {
        const int64_t b = bh / H, h = bh % H, i0 = first[b], i1 = first[b + 1];
        if (i1 - i0 == 1) continue;
        float mx = -INFINITY, sum = 0.f;
        for (int64_t i = i0; i < i1; ++i) mx = std::max(mx, pm[i * H + h]);
        float* o = out + bh * D;
        std::fill(o, o + D, 0.f);
        for (int64_t i = i0; i < i1; ++i) {
          const float w = exp_nonpos(pm[i * H + h] - mx);
          const float* a = pacc.data() + (i * H + h) * D;
          sum += w * pl[i * H + h];
          for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
        }
        const float inv = 1.f / sum;
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      }
    }
  }
}

template <typename T>
static void attend(const float* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* lens, float* out,
                   int64_t B, int64_t H, int64_t KV, int64_t D, int64_t BS, int64_t NB, float scale, int nthreads) {
  if (D == 64) attend_d<8>(q, kc, vc, bt, lens, out, B, H, KV, D, BS, NB, scale, nthreads);
  else if (D == 128) attend_d<16>(q, kc, vc, bt, lens, out, B, H, KV, D, BS, NB, scale, nthreads);
  else if (D % 8 == 0) attend_d<0>(q, kc, vc, bt, lens, out, B, H, KV, D, BS, NB, scale, nthreads);
  else attend_d<-1>(q, kc, vc, bt, lens, out, B, H, KV, D, BS, NB, scale, nthreads);
}
