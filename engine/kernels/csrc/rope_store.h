// RoPE on the new tokens' q and k, in place in the qkv projection's output, and k, v stored into the
// paged cache at each token's slot: what follows every layer's qkv product, in one call. Built by
// `engine.native_rope`.
//
// Layout: qkv [T, (H + 2 KV) * D] fp32 or bf16 (raw uint16 bits), row-major: q heads, then k heads,
// then v heads; cos / sin [P, R] fp32, R <= D even (sin with its first half negated: rotate_half(x) *
// sin == roll(x, R / 2) * sin_signed); pos [T] int64 in [0, P): each token's table row; slots [T]
// int64 in [0, num_blocks * BS); k / v caches [num_blocks, BS, KV, D] in qkv's dtype, so slot s is
// row s of a [slots, KV * D] view. The first R dims of head h (q or k) become x * cos[pos] +
// roll(x, R / 2) * sin[pos], in fp32, rounded once to bf16; its dims from R on are left as they are
// (partial rotary).
// The caller checks every index (the kernel trusts them).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec8.h"


template <typename X>
static void rope_store(X* qkv, const float* cos, const float* sin, const int64_t* pos, const int64_t* slots,
                       X* kc, X* vc, int64_t T, int64_t H, int64_t KV, int64_t D, int64_t R) {
  const int64_t width = (H + 2 * KV) * D, half = R / 2, kv = KV * D;
  // Tokens are independent: a prefill chunk's rows are split over the threads (decode batches, and
  // calls from inside decode_step.cpp's parallel region, run on one), the same result either way.
#pragma omp parallel for schedule(static) if (T >= 64)
  for (int64_t t = 0; t < T; ++t) {
    float tmp[1024];  // one head (D <= 1024, checked by the caller)
    X* row = qkv + t * width;
    const float* c = cos + pos[t] * R;
    const float* s = sin + pos[t] * R;
    for (int64_t h = 0; h < H + KV; ++h) {  // q heads, then k heads
      X* x = row + h * D;
      for (int64_t i = 0; i < R; ++i) tmp[i] = load1(x + i);
      for (int64_t i = 0; i < half; ++i) store1(x + i, tmp[i] * c[i] + tmp[i + half] * s[i]);
      for (int64_t i = half; i < R; ++i) store1(x + i, tmp[i] * c[i] + tmp[i - half] * s[i]);
    }
    std::memcpy(kc + slots[t] * kv, row + H * D, sizeof(X) * kv);
    std::memcpy(vc + slots[t] * kv, row + (H + KV) * D, sizeof(X) * kv);
  }
}
