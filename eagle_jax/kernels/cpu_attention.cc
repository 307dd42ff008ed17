// Few-query attention over the stacked KV cache, in place (an XLA FFI custom call, AVX-512 or AVX2).
//
// A decoding step or a tree verification attends T queries per row (a few) to one layer of the
// cache [L, B, S, Hkv, D]. XLA:CPU first copies that layer's keys and values into [B, Hkv, S, D]
// for its dot kernels (≈ 2.7 ms of a 17 ms SmolLM2 step on a 2-core Xeon, plus ≈ 2 ms of small
// dots). This kernel reads the cache where it lies: one task per (row b, KV head), each streaming
// the layer's keys and values once for all T queries and the G query heads that share the KV head.
//
//   eagle_jax_attention: out[B, T, H, D] = softmax(q k^T / sqrt(D), masked) v
//     q [B, T, H, D] f32, k/v [L, B, S, Hkv, D] f32, layer [] s32, mask [B, T, S] pred
//
// Numbers: scores and the softmax in float32 (exp by a degree-6 polynomial on a power-of-two
// reduction, Cephes' expf coefficients); a query with no visible key gets zeros, as the reference.
// Each query's result depends only on its own mask (slots summed in ascending order), so a query
// gives the same bits whether it is verified in a tree or decoded alone.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

#include "cpu_simd_avx2.h"  // hsum

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__) && defined(__AVX512DQ__) && !defined(EAGLE_JAX_FORCE_AVX2)
// ---------------------------------------------------------------- AVX-512: 16-float vectors
// exp(x) for x <= 0 (scores minus their max): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2].
inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// q · k over D floats.
inline float dot_row(const float* qv, const float* ks, int64_t D) {
  __m512 a = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) a = _mm512_fmadd_ps(_mm512_loadu_ps(qv + d), _mm512_loadu_ps(ks + d), a);
  float dot = _mm512_reduce_add_ps(a);
  for (; d < D; ++d) dot += qv[d] * ks[d];
  return dot;
}

// max of ps[0, sp), sp % 16 == 0.
inline float row_max(const float* ps, int64_t sp) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t s = 0; s < sp; s += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(ps + s));
  return _mm512_reduce_max_ps(mx);
}

// ps[s] = exp(ps[s] - mval) where ps[s] > -inf, else 0 (sp % 16 == 0); returns their sum.
inline float exp_row(float* ps, int64_t sp, float mval) {
  const __m512 mv = _mm512_set1_ps(mval);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t s = 0; s < sp; s += 16) {
    const __m512 x = _mm512_loadu_ps(ps + s);
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    const __m512 e = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(x, mv)));
    _mm512_storeu_ps(ps + s, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// a[0, D) += w * vs[0, D).
inline void axpy(float w, const float* vs, float* a, int64_t D) {
  const __m512 wv = _mm512_set1_ps(w);
  int64_t d = 0;
  for (; d + 16 <= D; d += 16)
    _mm512_storeu_ps(a + d, _mm512_fmadd_ps(wv, _mm512_loadu_ps(vs + d), _mm512_loadu_ps(a + d)));
  for (; d < D; ++d) a[d] += w * vs[d];
}
#else
// ---------------------------------------------------------------- AVX2 + FMA: 8-float vectors
// The same exp (Cephes' polynomial); 2^n built in the exponent field (n >= -126: a normal number).
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

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

inline float exp_row(float* ps, int64_t sp, float mval) {
  const __m256 mv = _mm256_set1_ps(mval);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t s = 0; s < sp; s += 8) {
    const __m256 x = _mm256_loadu_ps(ps + s);
    const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    const __m256 e = _mm256_and_ps(live, exp256(_mm256_sub_ps(x, mv)));
    _mm256_storeu_ps(ps + s, e);
    sum = _mm256_add_ps(sum, e);
  }
  return hsum(sum);
}

inline void axpy(float w, const float* vs, float* a, int64_t D) {
  const __m256 wv = _mm256_set1_ps(w);
  int64_t d = 0;
  for (; d + 8 <= D; d += 8)
    _mm256_storeu_ps(a + d, _mm256_fmadd_ps(wv, _mm256_loadu_ps(vs + d), _mm256_loadu_ps(a + d)));
  for (; d < D; ++d) a[d] += w * vs[d];
}
#endif

struct Job {
  const float *q, *k, *v;
  const bool* mask;
  float* out;
  int64_t B, T, H, Hkv, D, S, layer;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // One (row, KV head): its G query heads × T queries against the layer's visible slots.
  void task(int64_t i) {
    const int64_t b = i / Hkv, kh = i % Hkv, G = H / Hkv, Q = T * G;
    const bool* m = mask + b * T * S;
    int64_t s_end = 0;  // one past the last slot any query of this row sees
    for (int64_t t = 0; t < T; ++t)
      for (int64_t s = S - 1; s >= s_end; --s)
        if (m[t * S + s]) { s_end = s + 1; break; }
    const int64_t row = Hkv * D;  // floats between consecutive slots
    const float* kb = k + ((layer * B + b) * S) * row + kh * D;
    const float* vb = v + ((layer * B + b) * S) * row + kh * D;
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    const int64_t sp = (s_end + 15) / 16 * 16;
    std::vector<float> p(Q * sp, 0.0f);  // scores, then probabilities
    std::vector<float> acc(Q * D, 0.0f);
    // scores: q · k for visible slots (others stay -inf)
    for (int64_t qi = 0; qi < Q; ++qi) {
      const int64_t t = qi / G, g = qi % G;
      const float* qv = q + ((b * T + t) * H + kh * G + g) * D;
      float* ps = p.data() + qi * sp;
      for (int64_t s = 0; s < sp; ++s) ps[s] = -INFINITY;
      for (int64_t s = 0; s < s_end; ++s) {
        if (!m[t * S + s]) continue;
        ps[s] = dot_row(qv, kb + s * row, D) * scale;
      }
    }
    // softmax per query (unnormalised; divided at the end)
    std::vector<float> denom(Q, 0.0f);
    for (int64_t qi = 0; qi < Q; ++qi) {
      float* ps = p.data() + qi * sp;
      const float mval = row_max(ps, sp);
      if (mval == -INFINITY) {  // no visible key: zeros
        for (int64_t s = 0; s < sp; ++s) ps[s] = 0.0f;
        continue;
      }
      denom[qi] = exp_row(ps, sp, mval);
    }
    // p @ v: each value row is read once for every query
    for (int64_t s = 0; s < s_end; ++s) {
      const float* vs = vb + s * row;
      for (int64_t qi = 0; qi < Q; ++qi) {
        const float w = p[qi * sp + s];
        if (w == 0.0f) continue;
        axpy(w, vs, acc.data() + qi * D, D);
      }
    }
    for (int64_t qi = 0; qi < Q; ++qi) {
      const int64_t t = qi / G, g = qi % G;
      float* o = out + ((b * T + t) * H + kh * G + g) * D;
      const float inv = denom[qi] > 0.0f ? 1.0f / denom[qi] : 0.0f;
      for (int64_t d = 0; d < D; ++d) o[d] = acc[qi * D + d] * inv;
    }
  }

  void work() {
    const int64_t n = B * Hkv;
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
  const int64_t tasks = job->B * job->Hkv;
  // One query of a short cache (a one-row decoding step) runs inline: waking a helper costs more
  // than the work. Anything more takes the pool's threads, also to keep them awake: a helper idle
  // through a long inline attention wakes late for the o_proj product that follows, which then
  // runs on one thread (a 5-token tree's o_proj took 61 µs a layer against 33 with the helper kept
  // busy; a plain step of 4 rows 20.3-22.1 ms against 18.3-19.9; the 2-core Xeon VM, stop 48).
  const bool inline_only = job->B * job->T == 1 && job->S < 4096;
  const int64_t helpers = inline_only ? 0 : std::min<int64_t>(pool.num_threads(), tasks) - 1;
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
