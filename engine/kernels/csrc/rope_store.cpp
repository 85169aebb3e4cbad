// The C entry points of rope_store.h (see there), built by `engine.native_build`.
#include "rope_store.h"

extern "C" {
void rope_store_f32(void* qkv, const float* cos, const float* sin, const int64_t* pos, const int64_t* slots,
                    void* kc, void* vc, int64_t T, int64_t H, int64_t KV, int64_t D, int64_t R) {
  rope_store((float*)qkv, cos, sin, pos, slots, (float*)kc, (float*)vc, T, H, KV, D, R);
}
void rope_store_bf16(void* qkv, const float* cos, const float* sin, const int64_t* pos, const int64_t* slots,
                     void* kc, void* vc, int64_t T, int64_t H, int64_t KV, int64_t D, int64_t R) {
  rope_store((uint16_t*)qkv, cos, sin, pos, slots, (uint16_t*)kc, (uint16_t*)vc, T, H, KV, D, R);
}
}
