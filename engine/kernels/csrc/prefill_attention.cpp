// The C entry point of prefill_attention.h (see there), built by `engine.native_prefill`.
#include "prefill_attention.h"

extern "C" {
void prefill_attention_f32(const float* q, int64_t q_rs, const float* k, int64_t k_rs, const float* v, int64_t v_rs,
                           float* out, int64_t S, int64_t L, int64_t H, int64_t KV, int64_t D, int64_t q_start,
                           float scale, int nthreads) {
  if (D == 64) prefill::attend<4>(q, q_rs, k, k_rs, v, v_rs, out, S, L, H, KV, q_start, scale, nthreads);
  else if (D == 128) prefill::attend<8>(q, q_rs, k, k_rs, v, v_rs, out, S, L, H, KV, q_start, scale, nthreads);
}
}
