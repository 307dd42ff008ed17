// Few-query attention over the stacked KV cache, in place (an XLA FFI custom call, AVX-512 or AVX2).
//
// A decoding step or a tree verification attends T queries per row (a few) to one layer of the
// cache [L, B, S, Hkv, D]. XLA:CPU first copies that layer's keys and values into [B, Hkv, S, D]
// for its dot kernels (≈ 2.7 ms of a 17 ms SmolLM2 step on a 2-core Xeon, plus ≈ 2 ms of small
// dots). This kernel reads the cache where it lies: one task per (row b, KV head, block of queries),
// each streaming the layer's keys and values once for its queries and the G query heads that share
// the KV head; scores 16 slots at a time, p @ v with its accumulators in registers.
//
//   eagle_jax_attention: out[B, T, H, D] = softmax(q k^T / sqrt(D), masked) v
//     q [B, T, H, D] f32, k/v [L, B, S, Hkv, D] f32, layer [] s32, mask [B, T, S] pred
//
// Numbers: scores and the softmax in float32 (exp by a degree-6 polynomial on a power-of-two
// reduction, Cephes' expf coefficients); a query with no visible key gets zeros, as the reference.
// Each query's result depends only on its own mask and the values of the slots it sees, not on
// where those slots lie: p @ v and the softmax's denominator are summed one visible slot at a time
// in ascending order (a lane-wise sum of the exponentials would group them by slot % 16), so a
// tree node, whose ancestors' keys sit at scattered slots, gets the bits a decoding step gets with
// the same keys in consecutive slots.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <type_traits>
#include <vector>

#include "xla/ffi/api/ffi.h"

#include "cpu_exp.h"        // exp512 / exp256
#include "cpu_simd_avx2.h"  // hsum

namespace ffi = xla::ffi;

namespace {

// a[0, D) += w * vs[0, D) (defined below for each instruction set).
inline void axpy(float w, const float* vs, float* a, int64_t D);

// p @ v one value row and query at a time (acc [Q, D] and den [Q], zeroed by the caller): each
// query's sums (of w v_s into acc, of w into den) run over the slots in ascending order, zero
// weights skipped. Either instruction set's `pv` falls back to it.
inline void pv_by_rows(const float* p, int64_t sp, int64_t Q, const float* vb, int64_t row, int64_t s_end, int64_t D,
                       float* acc, float* den) {
  for (int64_t s = 0; s < s_end; ++s)
    for (int64_t qi = 0; qi < Q; ++qi) {
      const float w = p[qi * sp + s];
      if (w != 0.0f) {
        axpy(w, vb + s * row, acc + qi * D, D);
        den[qi] += w;
      }
    }
}

// f(std::integral_constant<int, V>{}) for the V in [1, N] equal to v, else fallback(): picks the
// instance of a kernel templated on the vectors a head holds (VD) from a run-time D.
template <int V, int N, class F, class G>
inline void with_vectors(int64_t v, F&& f, G&& fallback) {
  if constexpr (V > N) {
    fallback();
  } else if (v == V) {
    f(std::integral_constant<int, V>{});
  } else {
    with_vectors<V + 1, N>(v, f, fallback);
  }
}

#if defined(__AVX512F__) && defined(__AVX512DQ__) && !defined(EAGLE_JAX_FORCE_AVX2)
// ---------------------------------------------------------------- AVX-512: 16-float vectors
// max of ps[0, sp), sp % 16 == 0.
inline float row_max(const float* ps, int64_t sp) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t s = 0; s < sp; s += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(ps + s));
  return _mm512_reduce_max_ps(mx);
}

// ps[s] = exp(ps[s] - mval) where ps[s] > -inf, else 0 (sp % 16 == 0).
inline void exp_row(float* ps, int64_t sp, float mval) {
  const __m512 mv = _mm512_set1_ps(mval);
  for (int64_t s = 0; s < sp; s += 16) {
    const __m512 x = _mm512_loadu_ps(ps + s);
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    _mm512_storeu_ps(ps + s, _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(x, mv))));
  }
}

inline void axpy(float w, const float* vs, float* a, int64_t D) {
  const __m512 wv = _mm512_set1_ps(w);
  int64_t d = 0;
  for (; d + 16 <= D; d += 16)
    _mm512_storeu_ps(a + d, _mm512_fmadd_ps(wv, _mm512_loadu_ps(vs + d), _mm512_loadu_ps(a + d)));
  for (; d < D; ++d) a[d] += w * vs[d];
}

// Lane j of the result: the sum of v[j]'s 16 lanes (a fixed tree of adds, the same for every j):
// sixteen horizontal sums for 45 shuffles and adds instead of 16 x 8.
inline __m512 hsum16(const __m512* v) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // [a0+a2, b0+b2, a1+a3, b1+b3] in each 128-bit chunk
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // [a, b, c, d]: each chunk's four lanes summed, vectors 4i..4i+3
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  const __m512 s0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 s1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s0, s1, 0x88), _mm512_shuffle_f32x4(s0, s1, 0xDD));
}

// out[j] = (q · k_{s0+j}) * scale for j < n (slots s0 + j, `row` floats apart), j < 16; the rest
// unspecified. Lane l of each dot sums d = l, l + 16, ... in order (a masked tail past D % 16).
inline void scores16(const float* qv, const float* ks, int64_t row, int n, int64_t D, float scale, float* out) {
  __m512 v[16];
  const int64_t dv = D / 16 * 16;
  const __mmask16 tail = (__mmask16)((1u << (D % 16)) - 1u);
  for (int j = 0; j < 16; ++j) {
    __m512 a = _mm512_setzero_ps();
    if (j < n) {
      const float* kr = ks + j * row;
      for (int64_t d = 0; d < dv; d += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(qv + d), _mm512_loadu_ps(kr + d), a);
      if (tail) a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, qv + dv), _mm512_maskz_loadu_ps(tail, kr + dv), a);
    }
    v[j] = a;
  }
  _mm512_storeu_ps(out, _mm512_mul_ps(hsum16(v), _mm512_set1_ps(scale)));
}

// scores_rows' queries taken together (none here: scores16 a query at a time); returns how many.
inline int64_t scores_grouped(const float* const*, int64_t, const float*, int64_t, int64_t, int64_t, int64_t, float,
                              float*) {
  return 0;
}

// acc[qi][0, 16 VD) += sum over s < s_end (ascending) of p[qi][s] * v_s for NQ queries, and
// den[qi] += p[qi][s], skipping zero weights as pv_by_rows does; the accumulators stay in
// registers (NQ * VD <= 16).
template <int VD, int NQ>
void pv_block(const float* p, int64_t sp, int nq, const float* vb, int64_t row, int64_t s_end, float* acc,
              float* den) {
  __m512 a[NQ][VD];
  float dn[NQ];
  for (int i = 0; i < NQ; ++i) dn[i] = i < nq ? den[i] : 0.0f;
  for (int i = 0; i < NQ; ++i)
    for (int j = 0; j < VD; ++j) a[i][j] = i < nq ? _mm512_loadu_ps(acc + (i * VD + j) * 16) : _mm512_setzero_ps();
  for (int64_t s = 0; s < s_end; ++s) {
    const float* vs = vb + s * row;
    __m512 vv[VD];
    for (int j = 0; j < VD; ++j) vv[j] = _mm512_loadu_ps(vs + 16 * j);
    for (int i = 0; i < NQ; ++i) {
      if (i >= nq) break;
      const float w = p[i * sp + s];
      if (w == 0.0f) continue;
      const __m512 wv = _mm512_set1_ps(w);
      for (int j = 0; j < VD; ++j) a[i][j] = _mm512_fmadd_ps(wv, vv[j], a[i][j]);
      dn[i] += w;
    }
  }
  for (int i = 0; i < nq; ++i) {
    for (int j = 0; j < VD; ++j) _mm512_storeu_ps(acc + (i * VD + j) * 16, a[i][j]);
    den[i] = dn[i];
  }
}

template <int VD>
void pv_all(const float* p, int64_t sp, int64_t Q, const float* vb, int64_t row, int64_t s_end, float* acc,
            float* den) {
  constexpr int NQ = 16 / VD < 1 ? 1 : (16 / VD > 4 ? 4 : 16 / VD);
  for (int64_t q0 = 0; q0 < Q; q0 += NQ)
    pv_block<VD, NQ>(p + q0 * sp, sp, (int)std::min<int64_t>(NQ, Q - q0), vb, row, s_end, acc + q0 * VD * 16,
                     den + q0);
}

// p @ v for Q queries (acc [Q, D], zeroed by the caller): D = 16, 32, ..., 128 in registers, else
// axpy row by row. Either way each query's sum runs over the slots in ascending order.
inline void pv(const float* p, int64_t sp, int64_t Q, const float* vb, int64_t row, int64_t s_end, int64_t D,
               float* acc, float* den) {
  with_vectors<1, 8>(D % 16 ? 0 : D / 16, [&](auto vd) { pv_all<vd.value>(p, sp, Q, vb, row, s_end, acc, den); },
                     [&] { pv_by_rows(p, sp, Q, vb, row, s_end, D, acc, den); });
}
#else
// ---------------------------------------------------------------- AVX2 + FMA: 8-float vectors
inline float dot_row(const float* qv, const float* ks, int64_t D) {
  __m256 a = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qv + d), _mm256_loadu_ps(ks + d), a);
  float dot = hsum(a);
  for (; d < D; ++d) dot += qv[d] * ks[d];
  return dot;
}

inline float row_max(const float* ps, int64_t sp) {
  __m256 mx = _mm256_set1_ps(-INFINITY);
  for (int64_t s = 0; s < sp; s += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(ps + s));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline void exp_row(float* ps, int64_t sp, float mval) {
  const __m256 mv = _mm256_set1_ps(mval);
  for (int64_t s = 0; s < sp; s += 8) {
    const __m256 x = _mm256_loadu_ps(ps + s);
    const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    _mm256_storeu_ps(ps + s, _mm256_and_ps(live, exp256(_mm256_sub_ps(x, mv))));
  }
}

inline void axpy(float w, const float* vs, float* a, int64_t D) {
  const __m256 wv = _mm256_set1_ps(w);
  int64_t d = 0;
  for (; d + 8 <= D; d += 8)
    _mm256_storeu_ps(a + d, _mm256_fmadd_ps(wv, _mm256_loadu_ps(vs + d), _mm256_loadu_ps(a + d)));
  for (; d < D; ++d) a[d] += w * vs[d];
}

// Scores 8 slots at a time and p @ v with the accumulators in registers, as the AVX-512 path does
// (before stop 62: one dot with its own horizontal sum a slot, and p @ v by axpy, a load and a
// store of the accumulators a slot). SmolLM2's 9 heads on 3 KV heads, 200 visible slots, a layer
// (the Zen 3 VM, best of 200): 1 query 31 -> 23 us, 3 queries 59 -> 38 us.

// Lane j of the result: the sum of v[j]'s 8 lanes, ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))
// for every j alike (eight horizontal sums for 6 vhaddps, 2 permutes and an add).
inline __m256 hsum8(const __m256* v) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // u0 = [v0 l0-3, v1 l0-3, v2 l0-3, v3 l0-3 | v0 l4-7, ..., v3 l4-7], u1 the same for v4..v7
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// out[j] = (q · k_{s0+j}) * scale for j < n (slots `row` floats apart), j < 8; the rest unspecified.
// Lane l of each dot sums d = l, l + 8, ... in order, then hsum8: eight dots' chains side by side.
template <int VD>
inline void scores8(const float* qv, const float* ks, int64_t row, int n, float scale, float* out) {
  __m256 v[8];
  for (int j = 0; j < 8; ++j) {
    __m256 a = _mm256_setzero_ps();
    if (j < n) {
      const float* kr = ks + j * row;
      for (int d = 0; d < VD; ++d) a = _mm256_fmadd_ps(_mm256_loadu_ps(qv + 8 * d), _mm256_loadu_ps(kr + 8 * d), a);
    }
    v[j] = a;
  }
  _mm256_storeu_ps(out, _mm256_mul_ps(hsum8(v), _mm256_set1_ps(scale)));
}

template <int VD>
inline void scores16_v(const float* qv, const float* ks, int64_t row, int n, float scale, float* out) {
  scores8<VD>(qv, ks, row, std::min(n, 8), scale, out);
  if (n > 8) scores8<VD>(qv, ks + 8 * row, row, n - 8, scale, out + 8);
}

// The AVX-512 path's interface: 8 dots at a time where D is 8, 16, ..., 128; else one dot at a
// time. Either way a dot's value does not depend on its slot or on the other slots.
inline void scores16(const float* qv, const float* ks, int64_t row, int n, int64_t D, float scale, float* out) {
  with_vectors<1, 16>(D % 8 ? 0 : D / 8, [&](auto vd) { scores16_v<vd.value>(qv, ks, row, n, scale, out); }, [&] {
    for (int j = 0; j < n; ++j) out[j] = dot_row(qv, ks + j * row, D) * scale;
  });
}

// acc[qi][0, 8 VD) += sum over s < s_end (ascending) of p[qi][s] * v_s, den[qi] += p[qi][s], one
// query at a time with its accumulators in registers (VD <= 8): the same fused multiply-adds in the
// same order as pv_by_rows' axpy, so the same bits, without a load and a store of acc a slot.
template <int VD>
void pv_regs(const float* p, int64_t sp, int64_t Q, const float* vb, int64_t row, int64_t s_end, float* acc,
             float* den) {
  for (int64_t qi = 0; qi < Q; ++qi) {
    __m256 a[VD];
    for (int j = 0; j < VD; ++j) a[j] = _mm256_loadu_ps(acc + qi * VD * 8 + 8 * j);
    float dn = den[qi];
    const float* pq = p + qi * sp;
    for (int64_t s = 0; s < s_end; ++s) {
      const float w = pq[s];
      if (w == 0.0f) continue;
      const __m256 wv = _mm256_set1_ps(w);
      const float* vs = vb + s * row;
      for (int j = 0; j < VD; ++j) a[j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(vs + 8 * j), a[j]);
      dn += w;
    }
    for (int j = 0; j < VD; ++j) _mm256_storeu_ps(acc + qi * VD * 8 + 8 * j, a[j]);
    den[qi] = dn;
  }
}

// Three queries at a time (stop 63): a (row, KV head) task's G query heads (and tree nodes) read
// the same keys and values, which (SmolLM2: 200 slots x 64 floats, 51 KB each) do not fit L1, so
// a pass per query streamed them from L2 once per query. Each dot and each query's p @ v sum
// keeps its own chain, in the same order as scores8 and pv_regs: the same bits (checked against
// the code before on 30 shapes, G 1-4, D 32-128, 1-5 queries). SmolLM2's attention, 200 visible
// slots, a layer (the Zen 4 VM, AVX2, best of 200, in turns): 1 query 18.4 -> 16.8 us, 3 queries
// 29.3 -> 26.7, 4 queries 34.0 -> 30.7. p @ v also keeps D up to 128 in registers now (pv_q3 takes
// 4 vectors of d a pass), where D = 72-128 went row by row through axpy (the same bits): D = 128,
// 32 heads on 8, 300 slots, 3 queries about 360 -> 280 us a layer (noisy runs).

// scores8 for three queries: slots in two halves of 4 (3 x 4 accumulators, the 3 queries' vectors
// of d and one key vector in registers), then each query's 8 dots through hsum8. Slots j >= n
// read slot 0's key (in bounds), and their scores are left unspecified.
template <int VD>
inline void scores8_q3(const float* const* qv, const float* ks, int64_t row, int n, float scale, float* const* out) {
  __m256 v[3][8];
  for (int h = 0; h < 2; ++h) {
    const float* kr[4];
    for (int j = 0; j < 4; ++j) kr[j] = ks + (4 * h + j < n ? 4 * h + j : 0) * row;
    __m256 a[3][4];
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < 4; ++j) a[i][j] = _mm256_setzero_ps();
    for (int d = 0; d < VD; ++d) {
      __m256 qd[3];
      for (int i = 0; i < 3; ++i) qd[i] = _mm256_loadu_ps(qv[i] + 8 * d);
      for (int j = 0; j < 4; ++j) {
        const __m256 kv = _mm256_loadu_ps(kr[j] + 8 * d);
        for (int i = 0; i < 3; ++i) a[i][j] = _mm256_fmadd_ps(qd[i], kv, a[i][j]);
      }
    }
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < 4; ++j) v[i][4 * h + j] = a[i][j];
  }
  for (int i = 0; i < 3; ++i) _mm256_storeu_ps(out[i], _mm256_mul_ps(hsum8(v[i]), _mm256_set1_ps(scale)));
}

// scores_rows' queries taken together: three at a time where D is 8, 16, ..., 128; returns how many.
inline int64_t scores_grouped(const float* const* qv, int64_t Q, const float* kb, int64_t row, int64_t s_end,
                              int64_t sp, int64_t D, float scale, float* p) {
  int64_t q3 = 0;
  with_vectors<1, 16>(D % 8 ? 0 : D / 8, [&](auto vd) {
    for (; q3 + 3 <= Q; q3 += 3)
      for (int64_t s0 = 0; s0 < s_end; s0 += 8) {
        float* out[3] = {p + q3 * sp + s0, p + (q3 + 1) * sp + s0, p + (q3 + 2) * sp + s0};
        scores8_q3<vd.value>(qv + q3, kb + s0 * row, row, (int)std::min<int64_t>(8, s_end - s0), scale, out);
      }
  }, [] {});
  return q3;
}

// pv_regs for three queries: C vectors of d at a time (3 x C accumulators), each value row read
// from L2 once for the three (then from L1), the denominators summed on the first pass.
template <int VD, int C>
void pv_q3(const float* p, int64_t sp, const float* vb, int64_t row, int64_t s_end, float* acc, float* den) {
  float dn[3] = {den[0], den[1], den[2]};
  for (int c = 0; c < VD; c += C) {
    __m256 a[3][C];
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < C; ++j) a[i][j] = _mm256_loadu_ps(acc + i * VD * 8 + 8 * (c + j));
    for (int64_t s = 0; s < s_end; ++s) {
      const float* vs = vb + s * row + 8 * c;
      for (int i = 0; i < 3; ++i) {
        const float w = p[i * sp + s];
        if (w == 0.0f) continue;
        const __m256 wv = _mm256_set1_ps(w);
        for (int j = 0; j < C; ++j) a[i][j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(vs + 8 * j), a[i][j]);
        if (c == 0) dn[i] += w;
      }
    }
    for (int i = 0; i < 3; ++i)
      for (int j = 0; j < C; ++j) _mm256_storeu_ps(acc + i * VD * 8 + 8 * (c + j), a[i][j]);
  }
  for (int i = 0; i < 3; ++i) den[i] = dn[i];
}

inline void pv(const float* p, int64_t sp, int64_t Q, const float* vb, int64_t row, int64_t s_end, int64_t D,
               float* acc, float* den) {
  with_vectors<1, 16>(D % 8 ? 0 : D / 8, [&](auto vd) {
    constexpr int VD = vd.value, C = VD % 4 == 0 ? 4 : VD % 2 == 0 ? 2 : 1;
    int64_t qi = 0;
    for (; qi + 3 <= Q; qi += 3) pv_q3<VD, C>(p + qi * sp, sp, vb, row, s_end, acc + qi * D, den + qi);
    pv_regs<VD>(p + qi * sp, sp, Q - qi, vb, row, s_end, acc + qi * D, den + qi);
  }, [&] { pv_by_rows(p, sp, Q, vb, row, s_end, D, acc, den); });
}
#endif

// Whether a single query (a one-row decoding step) of a short cache runs inline on the calling
// thread instead of taking the pool (Attention): EAGLE_JAX_CPU_ATTENTION_INLINE=1; by default no.
inline bool one_query_inline() {
  static const bool inline_one = [] {
    const char* v = std::getenv("EAGLE_JAX_CPU_ATTENTION_INLINE");
    return v != nullptr && v[0] == '1';
  }();
  return inline_one;
}

// p[qi][s] = (q_qi · k_s) * scale for s < s_end, each query's row sp floats (the rest unspecified):
// the queries scores_grouped takes, then the others one at a time.
inline void scores_rows(const float* const* qv, int64_t Q, const float* kb, int64_t row, int64_t s_end, int64_t sp,
                        int64_t D, float scale, float* p) {
  for (int64_t qi = scores_grouped(qv, Q, kb, row, s_end, sp, D, scale, p); qi < Q; ++qi)
    for (int64_t s0 = 0; s0 < s_end; s0 += 16)
      scores16(qv[qi], kb + s0 * row, row, (int)std::min<int64_t>(16, s_end - s0), D, scale, p + qi * sp + s0);
}

struct Job {
  const float *q, *k, *v;
  const bool* mask;
  float* out;
  int64_t B, T, H, Hkv, D, S, layer;
  int64_t parts = 1;  // query blocks per (row, KV head): tasks = B * Hkv * parts
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // One (row, KV head, block of queries t0..t1-1): its G query heads x those queries against the
  // layer's visible slots, the keys and values streamed once for all of them.
  void task(int64_t i) {
    const int64_t part = i % parts, b = i / parts / Hkv, kh = i / parts % Hkv, G = H / Hkv;
    const int64_t t0 = T * part / parts, t1 = T * (part + 1) / parts, Q = (t1 - t0) * G;
    const bool* m = mask + b * T * S;
    int64_t s_end = 0;  // one past the last slot any of these queries sees
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t s = S - 1; s >= s_end; --s)
        if (m[t * S + s]) { s_end = s + 1; break; }
    const int64_t row = Hkv * D;  // floats between consecutive slots
    const float* kb = k + ((layer * B + b) * S) * row + kh * D;
    const float* vb = v + ((layer * B + b) * S) * row + kh * D;
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    const int64_t sp = (s_end + 15) / 16 * 16;
    thread_local std::vector<float> p_buf, acc_buf, denom;
    p_buf.resize(Q * sp);  // scores, then probabilities: every entry written below
    acc_buf.assign(Q * D, 0.0f);
    denom.assign(Q, 0.0f);
    float* p = p_buf.data();
    float* acc = acc_buf.data();
    // scores: q · k for the slots before s_end, then -inf where a query does not see a slot
    thread_local std::vector<const float*> q_rows;
    q_rows.resize(Q);
    for (int64_t qi = 0; qi < Q; ++qi) q_rows[qi] = q + ((b * T + t0 + qi / G) * H + kh * G + qi % G) * D;
    scores_rows(q_rows.data(), Q, kb, row, s_end, sp, D, scale, p);
    for (int64_t qi = 0; qi < Q; ++qi) {
      const bool* mt = m + (t0 + qi / G) * S;
      float* ps = p + qi * sp;
      for (int64_t s = 0; s < sp; ++s)
        if (s >= s_end || !mt[s]) ps[s] = -INFINITY;
    }
    // softmax per query (unnormalised; divided at the end)
    for (int64_t qi = 0; qi < Q; ++qi) {
      float* ps = p + qi * sp;
      const float mval = row_max(ps, sp);
      if (mval == -INFINITY) {  // no visible key: zeros
        for (int64_t s = 0; s < sp; ++s) ps[s] = 0.0f;
        continue;
      }
      exp_row(ps, sp, mval);
    }
    pv(p, sp, Q, vb, row, s_end, D, acc, denom.data());  // p @ v and the denominators, slots ascending
    for (int64_t qi = 0; qi < Q; ++qi) {
      const int64_t t = t0 + qi / G, g = qi % G;
      float* o = out + ((b * T + t) * H + kh * G + g) * D;
      const float inv = denom[qi] > 0.0f ? 1.0f / denom[qi] : 0.0f;
      for (int64_t d = 0; d < D; ++d) o[d] = acc[qi * D + d] * inv;
    }
  }

  void work() {
    const int64_t n = B * Hkv * parts;
    for (int64_t i; (i = next.fetch_add(1)) < n;) {
      task(i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error Attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                     ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::PRED> mask, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k.dimensions(), md = mask.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || md.size() != 3)
    return ffi::Error::InvalidArgument("q [B,T,H,D], k/v [L,B,S,Hkv,D] and mask [B,T,S] expected");
  auto vd = v.dimensions();
  if (vd.size() != 5) return ffi::Error::InvalidArgument("k and v differ in shape");
  for (int i = 0; i < 5; ++i)
    if (vd[i] != kd[i]) return ffi::Error::InvalidArgument("k and v differ in shape");
  auto job = std::make_shared<Job>();
  job->B = qd[0]; job->T = qd[1]; job->H = qd[2]; job->D = qd[3];
  job->S = kd[2]; job->Hkv = kd[3];
  if (kd[1] != job->B || kd[4] != job->D || job->H % job->Hkv || md[0] != job->B || md[1] != job->T || md[2] != job->S)
    return ffi::Error::InvalidArgument("q, k/v and mask disagree on B, S, heads or D");
  job->layer = layer.typed_data()[0];
  if (job->layer < 0 || job->layer >= kd[0]) return ffi::Error::InvalidArgument("layer out of range");
  job->q = q.typed_data(); job->k = k.typed_data(); job->v = v.typed_data();
  job->mask = mask.typed_data(); job->out = out->typed_data();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  // Every call takes the pool's threads, a single query too. With one query the keys and values
  // stream from L3 at about 18 GB/s on one core; two cores took SmolLM2's attention from 16.8 to
  // 12.1 us a layer at 200 visible slots (no slower at 8: 2.0 against 2.0), the Zen 4 VM, AVX2
  // build, stop 63: plain decoding 136 / 134 / 137 -> 149 / 156 / 157 tok/s. The AVX-512 build ran
  // one query inline until stop 76, as measured on the Xeon VM at stop 48 (waking a helper cost
  // more than the work there); on the Zen 4 VM with AVX-512 shown that left the helper asleep for
  // the o_proj product after it (o_proj 26-30 us a layer against 13-15 with AVX2's kernels), and
  // taking the pool made plain decoding 10-12% faster (124 / 138 -> 137 / 154 tok/s, in turns).
  // EAGLE_JAX_CPU_ATTENTION_INLINE=1 brings the inline single query back (`one_query_inline`).
  // A longer inline attention slows the product after it more (a 5-token tree's o_proj took 61 µs
  // a layer against 33 with the helper kept busy; a plain step of 4 rows 20.3-22.1 ms against
  // 18.3-19.9; the 2-core Xeon VM, stop 48), so trees take the pool on every CPU.
  // A tree's queries are cut into blocks so that every thread gets about two tasks: 3 KV heads
  // over 2 threads took two rounds of whole heads. With that and the 16-slot scores, a 5-token
  // tree's attention takes 22 µs a layer against 35 (the 2-core Xeon VM, stop 49).
  const bool inline_only = one_query_inline() && job->B * job->T == 1 && job->S < 4096;
  if (!inline_only) job->parts = std::min<int64_t>(job->T, (2 * threads + job->B * job->Hkv - 1) / (job->B * job->Hkv));
  const int64_t tasks = job->B * job->Hkv * job->parts;
  const int64_t helpers = inline_only ? 0 : std::min<int64_t>(threads, tasks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->work(); });
  job->work();
  while (job->done.load(std::memory_order_acquire) < tasks) _mm_pause();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EagleAttention, Attention,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
