// Causal prefill attention in fp32 for CPUs (flash-attention style: no [S, L] score matrix), built by
// `engine.native_prefill`.
//
// Layout: q [S, H, D] (token i's heads at q + i * q_rs, heads contiguous), k / v [L, KV, D] (key j at
// k + j * k_rs); out [S, H, D] contiguous; D = 16 * ND (64 or 128 here). Query i sits at position
// q_start + i and sees keys j <= q_start + i (j < L); head h reads KV head h / (H / KV) (GQA).
//
// Work items: (KV head g, block of BQ queries) x its G = H / KV query heads, so an item is M = G * BQ
// rows that share every K and V row; heaviest items first (a later query block sees more keys), one
// item per thread at a time. K is transposed once per call ([KV, D, Lp], Lp = L rounded up to BK),
// so a block of scores is an outer-product tile: for each d, 8 query values broadcast against 32 keys
// in two vectors (16 accumulators; no horizontal sums). Then the online softmax per row over that key
// block (running max m, sum l, O rescaled by e^(m_old - m_new); unseen keys contribute exactly 0), in
// steps that are each vectorized over a row's 32 keys or over 16 rows (scalar per-row bookkeeping was
// half the kernel's time), then O += P V as tiles of rows x D (V rows read in place). Every row ends
// O / l. The math is fp32 (`exp_nonpos_z`, ~1e-7 relative); the order of the sums is fixed by the
// arguments alone, never the schedule, so the same call gives the same bits whatever the thread count.
// Built with -O3 -march=native -fopenmp, no fast-math (figures against torch's SDPA:
// docs/benchmarks-notes.md).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vec8.h"

namespace prefill {

constexpr int64_t BQ = 32, BK = 32;

static const fz IOTA = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

#if defined(__AVX512F__)
static inline float hmax(fz v) { return _mm512_reduce_max_ps((__m512)v); }  // a shuffle tree
static inline float hsumz(fz v) { return _mm512_reduce_add_ps((__m512)v); }
#else
static inline float hmax(fz v) {
  float mx = v[0];
  for (int i = 1; i < 16; ++i) mx = std::max(mx, v[i]);
  return mx;
}
static inline float hsumz(fz v) {
  float t = 0.f;
  for (int i = 0; i < 16; ++i) t += v[i];
  return t;
}
#endif

// s[r][0, 32) = sum_d qs[r][d] * kt[d][0, 32), computed for 8 rows (the scratch always holds them),
// stored for r < nr; qs rows are D apart, kt rows ld_kt apart.
template <int ND>
static inline void score_tile(const float* qs, const float* kt, int64_t ld_kt, int nr, float* s) {
  constexpr int D = 16 * ND;
  fz a[8][2];
  for (int r = 0; r < 8; ++r) a[r][0] = a[r][1] = fz{};
  for (int d = 0; d < D; ++d) {
    const fz k0 = loadz(kt + d * ld_kt), k1 = loadz(kt + d * ld_kt + 16);
    for (int r = 0; r < 8; ++r) {
      const fz qv = splatz(qs[r * D + d]);
      a[r][0] += qv * k0;
      a[r][1] += qv * k1;
    }
  }
  for (int r = 0; r < nr; ++r) { storez(s + r * BK, a[r][0]); storez(s + r * BK + 16, a[r][1]); }
}

// o[r][0, D) += sum_{j < nk} p[r][j] * v_j for rows r < nr (<= RT; all RT computed); v_j = v + j * v_rs.
template <int ND, int RT>
static inline void pv_tile(const float* p, const float* v, int64_t v_rs, int nk, int nr, float* o) {
  constexpr int D = 16 * ND;
  fz a[RT][ND];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < ND; ++c) a[r][c] = r < nr ? loadz(o + r * D + 16 * c) : fz{};
  for (int j = 0; j < nk; ++j) {
    fz vr[ND];
    for (int c = 0; c < ND; ++c) vr[c] = loadz(v + j * v_rs + 16 * c);
    for (int r = 0; r < RT; ++r) {
      const fz pr = splatz(p[r * BK + j]);
      for (int c = 0; c < ND; ++c) a[r][c] += pr * vr[c];
    }
  }
  for (int r = 0; r < nr; ++r)
    for (int c = 0; c < ND; ++c) storez(o + r * D + 16 * c, a[r][c]);
}

template <int ND>
static void attend(const float* q, int64_t q_rs, const float* k, int64_t k_rs, const float* v, int64_t v_rs,
                   float* out, int64_t S, int64_t L, int64_t H, int64_t KV, int64_t q_start, float scale,
                   int nthreads) {
  constexpr int64_t D = 16 * ND;
  constexpr int RT = ND <= 4 ? 4 : 2;  // rows per P V tile: RT x ND accumulators (16)
  const int64_t G = H / KV, Lp = (L + BK - 1) / BK * BK, nqb = (S + BQ - 1) / BQ, items = KV * nqb;
  // M = G * BQ rows per item, a multiple of 8: the last score / P V tile of an item never runs past
  // the scratch (rows past the item's hold stale finite values and are never stored).
  std::vector<float> kt(KV * D * Lp, 0.f);  // [KV, D, Lp]: K transposed, zero past L
#pragma omp parallel num_threads(nthreads)
  {
#pragma omp for schedule(static)
    for (int64_t gd = 0; gd < KV * D; ++gd) {
      const int64_t g = gd / D, d = gd % D;
      float* dst = kt.data() + gd * Lp;
      for (int64_t j = 0; j < L; ++j) dst[j] = k[j * k_rs + g * D + d];
    }
    const int64_t M = G * BQ;
    // Per-row state padded to 16 rows for the vector steps: max m, sum l, this block's max / sum and factor.
    const int64_t Mp = (M + 15) / 16 * 16;
    std::vector<float> qs(M * D), o(M * D), s(M * BK), m(Mp), l(Mp), bmax(Mp), bsum(Mp), alpha(Mp);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int64_t qb = nqb - 1 - it / KV, g = it % KV;  // heaviest (last) query blocks first
      const int64_t i0 = qb * BQ, nq = std::min(BQ, S - i0), rows = G * nq;
      for (int64_t hg = 0; hg < G; ++hg)  // row hg * nq + i: query i0 + i of head g * G + hg, scaled
        for (int64_t i = 0; i < nq; ++i) {
          const float* src = q + (i0 + i) * q_rs + (g * G + hg) * D;
          float* dst = qs.data() + (hg * nq + i) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * scale;
        }
      std::fill(o.begin(), o.begin() + rows * D, 0.f);
      std::fill(m.begin(), m.end(), -INFINITY);
      std::fill(l.begin(), l.end(), 0.f);
      std::fill(bmax.begin(), bmax.end(), -INFINITY);
      const int64_t kend = std::min(L, q_start + i0 + nq);  // keys the block's last query sees
      for (int64_t j0 = 0; j0 < kend; j0 += BK) {
        const int64_t nk = std::min(BK, kend - j0);
        for (int64_t r0 = 0; r0 < rows; r0 += 8)
          score_tile<ND>(qs.data() + r0 * D, kt.data() + g * D * Lp + j0, Lp, (int)std::min<int64_t>(8, rows - r0),
                         s.data() + r0 * BK);
        // The online softmax over this key block, each step vectorized over the keys of a row or over rows.
        for (int64_t r = 0; r < rows; ++r) {  // unseen keys -> -inf (never the max); each row's block max
          float* sr = s.data() + r * BK;
          const float seen = (float)std::min(nk, q_start + i0 + r % nq - j0 + 1);  // keys j0 .. j0 + seen - 1
          const fz fv = splatz(seen), neg = splatz(-INFINITY);
          const fz a = IOTA < fv ? loadz(sr) : neg, b = IOTA + 16.f < fv ? loadz(sr + 16) : neg;
          storez(sr, a);
          storez(sr + 16, b);
          bmax[r] = hmax(a > b ? a : b);  // -inf where the whole block lies in the row's future
        }
        for (int64_t r = 0; r < rows; r += 16) {  // new max, the old sums' factor; rows past `rows` are scratch
          const fz mo = loadz(m.data() + r), mn = mo > loadz(bmax.data() + r) ? mo : loadz(bmax.data() + r);
          storez(alpha.data() + r, exp_nonpos_z(mo - mn));  // 1 where the max stays; m = -inf: ~0 (o = l = 0)
          storez(m.data() + r, mn);
        }
        for (int64_t r = 0; r < rows; ++r) {  // numerators (exactly 0 for unseen keys) and their sum
          float* sr = s.data() + r * BK;
          const fz a = loadz(sr), b = loadz(sr + 16), mn = splatz(m[r]), neg = splatz(-INFINITY);
          const fz ea = a > neg ? exp_nonpos_z(a - mn) : fz{}, eb = b > neg ? exp_nonpos_z(b - mn) : fz{};
          storez(sr, ea);
          storez(sr + 16, eb);
          bsum[r] = hsumz(ea + eb);
        }
        for (int64_t r = 0; r < rows; r += 16)
          storez(l.data() + r, loadz(l.data() + r) * loadz(alpha.data() + r) + loadz(bsum.data() + r));
        for (int64_t r = 0; r < rows; ++r) {
          if (alpha[r] == 1.f) continue;
          float* orow = o.data() + r * D;
          const fz f = splatz(alpha[r]);
          for (int64_t c = 0; c < D; c += 16) storez(orow + c, loadz(orow + c) * f);
        }
        const float* vb = v + j0 * v_rs + g * D;
        for (int64_t r0 = 0; r0 < rows; r0 += RT)
          pv_tile<ND, RT>(s.data() + r0 * BK, vb, v_rs, (int)nk, (int)std::min<int64_t>(RT, rows - r0),
                          o.data() + r0 * D);
      }
      for (int64_t hg = 0; hg < G; ++hg)
        for (int64_t i = 0; i < nq; ++i) {
          const int64_t r = hg * nq + i;
          const float inv = 1.f / l[r];
          float* dst = out + ((i0 + i) * H + g * G + hg) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = o[r * D + d] * inv;
        }
    }
  }
}

}  // namespace prefill
