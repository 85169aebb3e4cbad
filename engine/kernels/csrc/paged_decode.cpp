// The C entry points of paged_decode.h (see there), built by `engine.native_build`.
#include "paged_decode.h"

extern "C" {
void paged_decode_f32(const float* q, const float* k, const float* v, const int64_t* bt, const int64_t* lens,
                      float* out, int64_t B, int64_t H, int64_t KV, int64_t D, int64_t BS, int64_t NB, float scale,
                      int nthreads) {
  attend(q, k, v, bt, lens, out, B, H, KV, D, BS, NB, scale, nthreads);
}
void paged_decode_bf16(const float* q, const uint16_t* k, const uint16_t* v, const int64_t* bt, const int64_t* lens,
                       float* out, int64_t B, int64_t H, int64_t KV, int64_t D, int64_t BS, int64_t NB, float scale,
                      int nthreads) {
  attend(q, k, v, bt, lens, out, B, H, KV, D, BS, NB, scale, nthreads);
}
}
