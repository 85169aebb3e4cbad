// Paged decode attention for CPUs: one new query token per sequence against its cached positions,
// read in place through the block table (no gathered copy), built by `engine.native_attention`.
//
// Layout: q [B, H, D] fp32; k/v caches [num_blocks, BS, KV, D] fp32 or bf16 (raw uint16 bits);
// block_table [B, NB] int64; lens [B] int64, 1 <= lens[b] <= NB * BS (the caller's invariant: they
// are positions + 1); out [B, H, D] fp32. Head h reads KV head h / (H / KV) (GQA).
//
// One sequence per OpenMP work item (one sequence and KV head when there are fewer sequences than
// threads, so batch 1 keeps every thread busy): its blocks are read once, row by row (each row holds
// every KV head: KV * D contiguous values), for the scores of all its heads, then softmax over
// [0, lens[b]) in fp32 (only visible positions are visited, so no -inf ever enters), then once more
// for the weighted sum of V. Built with -O3 -march=native -fopenmp (no -ffast-math: it would set
// FTZ/DAZ process-wide): the `omp simd` loops, exp included (`exp_nonpos`), vectorize for whatever
// the build machine has (AVX2, AVX-512).
#pragma once
#include <cstdint>
#include <cmath>
#include <cstring>
#include <vector>
#include <algorithm>

static inline void to_float(const float* p, float* dst, int64_t n) { std::memcpy(dst, p, n * sizeof(float)); }
static inline void to_float(const uint16_t* p, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) { uint32_t u = (uint32_t)p[i] << 16; float f; std::memcpy(&f, &u, 4); dst[i] = f; }
}

typedef float f8 __attribute__((vector_size(32)));

// a . b over D values: four independent vector accumulators when D is a multiple of 32 (head dims
// 64, 128), so the sum is not one chain of dependent FMAs; an `omp simd` reduction otherwise.
static inline float dot(const float* a, const float* b, int64_t D) {
  if (D % 32 == 0) {
    f8 s0{}, s1{}, s2{}, s3{}, x, y;
    for (int64_t d = 0; d < D; d += 32) {
      std::memcpy(&x, a + d, 32); std::memcpy(&y, b + d, 32); s0 += x * y;
      std::memcpy(&x, a + d + 8, 32); std::memcpy(&y, b + d + 8, 32); s1 += x * y;
      std::memcpy(&x, a + d + 16, 32); std::memcpy(&y, b + d + 16, 32); s2 += x * y;
      std::memcpy(&x, a + d + 24, 32); std::memcpy(&y, b + d + 24, 32); s3 += x * y;
    }
    const f8 t = (s0 + s1) + (s2 + s3);
    return ((t[0] + t[4]) + (t[1] + t[5])) + ((t[2] + t[6]) + (t[3] + t[7]));
  }
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t d = 0; d < D; ++d) acc += a[d] * b[d];
  return acc;
}

// exp(x) for x <= 0 (softmax scores minus their max) in plain arithmetic, so the softmax loop
// vectorizes (glibc's vector exp is declared only under -ffast-math): 2^n * p(r), n = round(x / ln 2),
// r = x - n ln 2 in two steps (Cody-Waite), p Cephes' expf polynomial (relative error ~1e-7). x is
// clamped at -87 (exp = 1.6e-38), so 2^n stays a normal float; in a softmax that term is 0 anyway.
static inline float exp_nonpos(float x) {
  x = x < -87.f ? -87.f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return p * __builtin_bit_cast(float, ((int32_t)n + 127) << 23);
}

// The first n values of a block as fp32: in place for fp32 caches, else converted into buf.
static inline const float* block_rows(const float* p, int64_t, float*) { return p; }
static inline const float* block_rows(const uint16_t* p, int64_t n, float* buf) { to_float(p, buf, n); return buf; }

template <typename T>
static void attend(const float* q, const T* kc, const T* vc, const int64_t* bt, const int64_t* lens,
                   float* out, int64_t B, int64_t H, int64_t KV, int64_t D, int64_t BS, int64_t NB,
                   float scale, int nthreads) {
  const int64_t G = H / KV, row = KV * D, blk = BS * row;
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<float> s, acc(H * D), buf(BS * row);
    // Fewer sequences than threads: each KV head of a sequence is a work item of its own.
    const int64_t split = B < nthreads ? KV : 1, per = KV / split;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < B * split; ++item) {
      const int64_t b = item / split, h0 = (item % split) * per * G, h1 = h0 + per * G;  // heads [h0, h1)
      const int64_t L = lens[b];
      s.resize(H * L);
      const float* qb = q + b * H * D;
      const int64_t* table = bt + b * NB;
      for (int64_t t0 = 0; t0 < L; t0 += BS) {
        const int64_t n = std::min(BS, L - t0);
        const float* kf = block_rows(kc + table[t0 / BS] * blk, n * row, buf.data());
        for (int64_t r = 0; r < n; ++r) {
          for (int64_t h = h0; h < h1; ++h) {
            const float* qh = qb + h * D;
            const float* kp = kf + r * row + (h / G) * D;
            s[h * L + t0 + r] = dot(qh, kp, D) * scale;
          }
        }
      }
      for (int64_t h = h0; h < h1; ++h) {
        float* sh = s.data() + h * L;
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int64_t t = 0; t < L; ++t) m = std::max(m, sh[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < L; ++t) { float e = exp_nonpos(sh[t] - m); sh[t] = e; sum += e; }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t t = 0; t < L; ++t) sh[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t0 = 0; t0 < L; t0 += BS) {
        const int64_t n = std::min(BS, L - t0);
        const float* vf = block_rows(vc + table[t0 / BS] * blk, n * row, buf.data());
        for (int64_t r = 0; r < n; ++r) {
          for (int64_t h = h0; h < h1; ++h) {
            const float p = s[h * L + t0 + r];
            const float* vp = vf + r * row + (h / G) * D;
            float* ah = acc.data() + h * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ah[d] += p * vp[d];
          }
        }
      }
      std::memcpy(out + (b * H + h0) * D, acc.data() + h0 * D, sizeof(float) * (h1 - h0) * D);
    }
  }
}
