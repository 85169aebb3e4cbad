// The C entry points of rows.h (see there), built by `engine.native_rows`.
#include "rows.h"

extern "C" {
void rows_pre_f32(const float* x, float* y, int64_t M, int64_t K, int pre, float eps, int nthreads) {
  rows_pre(x, y, M, K, pre, eps, nthreads);
}
void rows_pre_bf16(const uint16_t* x, uint16_t* y, int64_t M, int64_t K, int pre, float eps, int nthreads) {
  rows_pre(x, y, M, K, pre, eps, nthreads);
}
}
