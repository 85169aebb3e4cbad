// Eight-float vectors and the scalar / vector loads and stores of fp32, bf16 (raw uint16 bits) and
// int8 that every engine kernel shares (small_linear.h, paged_decode.h, rope_store.h, rows.h), and
// `exp_nonpos`.
//
// Vectors are GCC vector extensions (AVX2 / AVX-512 / NEON code from one source under
// -march=native); on AVX2 the widening loads are written as intrinsics (one vpmovzxwd / vpmovsxbd
// each). bf16 -> fp32 is exact (a shift); fp32 -> bf16 rounds to nearest even, NaN stays NaN.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

typedef float f8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef int8_t i8x8 __attribute__((vector_size(8)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

// Sixteen-float vectors (one AVX-512 register; two AVX2 ones elsewhere), for paged_decode_z.h and
// prefill_attention.h.
typedef float fz __attribute__((vector_size(64)));

static inline f8 load8(const float* p) { f8 v; std::memcpy(&v, p, sizeof v); return v; }
static inline fz loadz(const float* p) { fz v; std::memcpy(&v, p, sizeof v); return v; }
static inline void storez(float* p, fz v) { std::memcpy(p, &v, sizeof v); }
// x in every lane: one broadcast (`f8{} + x` is an add of +0.0 the compiler must keep, then the
// broadcast; x - zero folds to x, so it is the broadcast alone).
static inline f8 splat8(float x) { return x - f8{}; }
static inline fz splatz(float x) { return x - fz{}; }
#if defined(__AVX2__)
#include <immintrin.h>
// One widening load each (vpmovzxwd / vpmovsxbd): what the generic versions below compile to in two halves.
static inline f8 load8(const uint16_t* p) {
  const __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16);
  return (f8)_mm256_castsi256_ps(w);
}
static inline f8 load8(const int8_t* p) {
  return (f8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
#else
static inline f8 load8(const uint16_t* p) {
  u16x8 h; std::memcpy(&h, p, sizeof h);
  u32x8 w = __builtin_convertvector(h, u32x8) << 16;
  f8 v; std::memcpy(&v, &w, sizeof v); return v;
}
static inline f8 load8(const int8_t* p) {
  i8x8 b; std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(__builtin_convertvector(b, i32x8), f8);
}
#endif
static inline float load1(const float* p) { return *p; }
static inline float load1(const uint16_t* p) { uint32_t u = (uint32_t)*p << 16; float f; std::memcpy(&f, &u, 4); return f; }
static inline float load1(const int8_t* p) { return (float)*p; }
static inline float hsum(f8 v) {
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}
static inline void store1(float* p, float v) { *p = v; }
static inline void store1(uint16_t* p, float v) {  // fp32 -> bf16, round to nearest even (NaN stays NaN)
  uint32_t u; std::memcpy(&u, &v, 4);
  *p = std::isnan(v) ? (uint16_t)((u >> 16) | 0x40) : (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// e^x for x <= 0 (softmax scores minus their max; silu of -|x|) in plain arithmetic, so the
// softmax loop vectorizes (glibc's vector exp is declared only under -ffast-math): 2^n * p(r), n = round(x / ln 2),
// r = x - n ln 2 in two steps (Cody-Waite), p Cephes' expf polynomial (relative error ~1e-7). x is
// clamped at -87 (exp = 1.6e-38), so 2^n stays a normal float; in a softmax that term is 0 anyway.
// `exp_poly` is the part after n, for a float or a vector of them (`exp_nonpos_z`).
template <typename V>
static inline V exp_poly(V x, V n) {  // e^(x - n ln 2) for |x - n ln 2| <= ln 2 / 2
  V r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.f;
}
static inline float exp_nonpos(float x) {
  x = x < -87.f ? -87.f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  return exp_poly(x, n) * __builtin_bit_cast(float, ((int32_t)n + 127) << 23);
}
// `exp_nonpos` on 16 lanes at once: the same steps with n = x / ln 2 rounded to nearest (the add and
// subtract of 1.5 * 2^23 rounds; exp_nonpos floors x / ln 2 + 1/2: they differ only at ties, where
// either reduction is exact to the polynomial's accuracy).
static inline fz exp_nonpos_z(fz x) {
  x = x < -87.f ? splatz(-87.f) : x;
  const fz n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const fz p = exp_poly(x, n);
  typedef int32_t i32z __attribute__((vector_size(64)));
  const i32z e = (__builtin_convertvector(n, i32z) + 127) << 23;
  fz scale;
  std::memcpy(&scale, &e, sizeof scale);
  return p * scale;
}
