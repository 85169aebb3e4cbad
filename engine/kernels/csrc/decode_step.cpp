// A whole decode step of a Llama-family model for a few sequences in one call: every layer's
// RMSNorm + qkv product, RoPE + cache store, paged attention, o_proj + residual, RMSNorm + gate_up,
// GLU + down + residual, then the final norm + lm_head. Built by `engine.native_step`.
//
// Why: at batch 1 the per-layer path spends more time in Python and the dispatcher between its
// native kernels (about 150 us a layer) than the kernels spend outside the weight read. This runs
// the same kernels (small_linear.h, rope_store.h, paged_decode.h) in the same order on the same
// values, so its logits and cache writes equal the per-layer native path's bit for bit.
//
// Layout (all row-major; X = the activation dtype, fp32 or bf16 as raw uint16 bits):
//   h [B, hidden] X: the embedded tokens on entry, the last layer's output on return;
//   logits [B, vocab] X; per layer k/v caches [num_blocks, BS, KV, D] X; cos / sin [P, R] fp32
//   (rope_store.h); pos [B] int64: each token's table row; slots [B] int64; table [B, NB] int64;
//   lens [B] int64 (= the token's position + 1).
//   A `Lin` is one linear layer: W [n, k] fp32 / bf16 / int8 (kind 0 / 1 / 2), scale / bias [n]
//   fp32 or null (small_linear.h); the weights of the norms are folded into qkv, gate_up, lm_head.
//   Kind 3: int8 W with a scale per `group` inputs, scale [n, k / group], and the norm's gain [k]
//   (or null) applied to the normed rows, as it cannot be folded into such a W (small_linear_group.h).
// The caller checks every shape, dtype and index (the kernels trust them).
#include <cstdint>
#include <vector>

#include "paged_decode.h"
#include "rope_store.h"
#include "small_linear.h"
#include "small_linear_group.h"

struct Lin {
  const void* w;
  const float* scale;
  const float* bias;
  int64_t kind, n, k;  // kind: 0 fp32, 1 bf16, 2 int8, 3 int8 with group scales
  int64_t group;       // kind 3: inputs per scale
  const float* gain;   // kind 3: the RMSNorm gain [k] or null
};

struct StepLayer {
  Lin qkv, o, gate_up, down;
  void* kc;
  void* vc;
};

struct StepArgs {
  int64_t B, num_layers, H, KV, D, R, BS, NB, hidden, nthreads;
  float eps, scale;
  const StepLayer* layers;
  Lin lm_head;
  const float* cos;
  const float* sin;
  const int64_t* pos;
  const int64_t* slots;
  const int64_t* table;
  const int64_t* lens;
  void* h;
  void* logits;
};

// y [M, n] = pre(x) @ W.T (* scale + bias) (+ residual); y may be the residual itself (each element
// is read, then written, by one thread).
template <typename X>
static void linear(const Lin& l, const X* x, const X* residual, X* y, int64_t M, int pre, float eps, int nt) {
  switch (l.kind) {
    case 0: small_linear(x, (const float*)l.w, l.scale, l.bias, residual, y, M, l.n, l.k, pre, eps, nt); break;
    case 1: small_linear(x, (const uint16_t*)l.w, l.scale, l.bias, residual, y, M, l.n, l.k, pre, eps, nt); break;
    case 2: small_linear(x, (const int8_t*)l.w, l.scale, l.bias, residual, y, M, l.n, l.k, pre, eps, nt); break;
    default:
      small_linear_group(x, (const int8_t*)l.w, l.scale, l.group, pre == PRE_RMS ? l.gain : nullptr, l.bias, residual,
                         y, M, l.n, l.k, pre, eps, nt);
      break;
  }
}

template <typename X>
static void decode_step(const StepArgs& a) {
  const int64_t B = a.B, qw = a.H * a.D, width = (a.H + 2 * a.KV) * a.D;
  const int nt = (int)a.nthreads;
  X* h = (X*)a.h;
  std::vector<X> qkv(B * width), attn(B * qw), gate_up(B * a.layers[0].gate_up.n);
  std::vector<float> q(B * qw), out(B * qw);  // [B, H, D] fp32: attention's query and output
  for (int64_t l = 0; l < a.num_layers; ++l) {
    const StepLayer& L = a.layers[l];
    linear(L.qkv, h, (const X*)nullptr, qkv.data(), B, PRE_RMS, a.eps, nt);  // [B, width]
    rope_store(qkv.data(), a.cos, a.sin, a.pos, a.slots, (X*)L.kc, (X*)L.vc, B, a.H, a.KV, a.D, a.R);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < qw; ++i) q[b * qw + i] = load1(qkv.data() + b * width + i);
    attend(q.data(), (const X*)L.kc, (const X*)L.vc, a.table, a.lens, out.data(), B, a.H, a.KV, a.D, a.BS, a.NB,
           a.scale, nt);
    for (int64_t i = 0; i < B * qw; ++i) store1(attn.data() + i, out[i]);  // rounded once, as the per-layer path
    linear(L.o, attn.data(), h, h, B, PRE_NONE, 0.f, nt);
    linear(L.gate_up, h, (const X*)nullptr, gate_up.data(), B, PRE_RMS, a.eps, nt);  // [B, 2I]
    linear(L.down, gate_up.data(), h, h, B, PRE_GLU, 0.f, nt);
  }
  linear(a.lm_head, h, (const X*)nullptr, (X*)a.logits, B, PRE_RMS, a.eps, nt);  // [B, vocab]
}

extern "C" {
void decode_step_f32(const StepArgs* a) { decode_step<float>(*a); }
void decode_step_bf16(const StepArgs* a) { decode_step<uint16_t>(*a); }
}
