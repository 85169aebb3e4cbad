// The C entry points of small_linear.h (see there), built by `engine.native_build`.
#include "small_linear.h"

extern "C" {
#define SMALL_LINEAR(NAME, X, W)                                                                          \
  void NAME(const void* x, const void* w, const float* scale, const float* bias, const void* residual,   \
            void* y, int64_t M, int64_t N, int64_t K, int pre, float eps, int nthreads) {                 \
    small_linear((const X*)x, (const W*)w, scale, bias, (const X*)residual, (X*)y, M, N, K, pre, eps,    \
                 nthreads);                                                                               \
  }
SMALL_LINEAR(small_linear_f32_f32, float, float)
SMALL_LINEAR(small_linear_f32_bf16, float, uint16_t)
SMALL_LINEAR(small_linear_f32_i8, float, int8_t)
SMALL_LINEAR(small_linear_bf16_f32, uint16_t, float)
SMALL_LINEAR(small_linear_bf16_bf16, uint16_t, uint16_t)
SMALL_LINEAR(small_linear_bf16_i8, uint16_t, int8_t)
}

// int8 weights with a scale per G inputs and an optional gain on pre(x): small_linear_group.h.
#include "small_linear_group.h"

extern "C" {
#define SMALL_LINEAR_GROUP(NAME, X)                                                                        \
  void NAME(const void* x, const void* w, const float* scale, int64_t G, const float* gain, const float* bias, \
            const void* residual, void* y, int64_t M, int64_t N, int64_t K, int pre, float eps, int nthreads) { \
    small_linear_group((const X*)x, (const int8_t*)w, scale, G, gain, bias, (const X*)residual, (X*)y, M, N, K,  \
                       pre, eps, nthreads);                                                                   \
  }
SMALL_LINEAR_GROUP(small_linear_group_f32, float)
SMALL_LINEAR_GROUP(small_linear_group_bf16, uint16_t)
}
