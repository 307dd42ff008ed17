// Top-k of each row of a float32 matrix, with the row's log-sum-exp (an XLA FFI custom call,
// AVX-512 or AVX2): the drafting's top-k over the head's vocabulary and the greedy argmax over the
// target's.
//
//   eagle_jax_top_k: x [R, V] f32, attrs k (1 <= k <= V), lse (0 | 1)
//                    -> values [R, k] f32, indices [R, k] s32, lse [R] f32 (zeros when lse = 0)
//
// The order is lax.top_k's and jnp.argmax's: descending, NaN above every number, equal values
// (compared with ==, so -0 == +0) to the lower index. XLA:CPU runs its reductions over a
// vocabulary-wide row as scalar loops (k passes of max and argmax over [3, 12288]: ≈ 0.4 ms of a
// drafting step on the 2-core Xeon VM); one vectorised pass keeps a sorted list of k candidates and
// looks at an element only when it beats the k-th.
//
// lse = max + log(sum exp(x - max)) over the row: -inf where every x is -inf, NaN where one is NaN,
// +inf where one is +inf (jax.nn.logsumexp's values there); exp by cpu_exp.h's polynomial, lanes
// summed in a fixed order.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

#include "cpu_exp.h"        // exp512 / exp256
#include "cpu_simd_avx2.h"  // hsum

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kMaxK = 64;

// a strictly ahead of b: NaN first, then larger values, equal values (NaN too) by the lower index.
inline bool ahead(float a, int32_t ia, float b, int32_t ib) {
  const bool na = std::isnan(a), nb = std::isnan(b);
  if (na || nb) return na && (!nb || ia < ib);
  return a > b || (a == b && ia < ib);
}

struct TopList {
  float v[kMaxK];
  int32_t i[kMaxK];
  int n = 0;

  // Take (x, ix) if it is among the k best so far (x arrives in ascending index order).
  void offer(float x, int32_t ix, int k) {
    if (n == k && !ahead(x, ix, v[k - 1], i[k - 1])) return;
    int j = n < k ? n++ : k - 1;
    for (; j > 0 && ahead(x, ix, v[j - 1], i[j - 1]); --j) v[j] = v[j - 1], i[j] = i[j - 1];
    v[j] = x, i[j] = ix;
  }
};

#if defined(__AVX512F__) && defined(__AVX512DQ__) && !defined(EAGLE_JAX_FORCE_AVX2)
constexpr int kLanes = 16;
// Lanes of x[0, 16) that could enter a full list whose last value is `last` (not NaN): greater, or NaN.
inline uint32_t could_enter(const float* x, float last) {
  const __m512 v = _mm512_loadu_ps(x);
  return (uint32_t)(_mm512_cmp_ps_mask(v, _mm512_set1_ps(last), _CMP_GT_OQ) | _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q));
}

// sum over x[0, n) of exp(x - m) (-inf elements add 0); m finite.
inline float sum_exp(const float* x, int64_t n, float m) {
  const __m512 mv = _mm512_set1_ps(m), ninf = _mm512_set1_ps(-INFINITY);
  __m512 sum = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(x + j);
    const __mmask16 live = _mm512_cmp_ps_mask(v, ninf, _CMP_NEQ_OQ);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(v, mv))));
  }
  if (j < n) {
    const __mmask16 tail = (__mmask16)((1u << (n - j)) - 1u);
    const __m512 v = _mm512_mask_loadu_ps(ninf, tail, x + j);
    const __mmask16 live = _mm512_cmp_ps_mask(v, ninf, _CMP_NEQ_OQ);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(v, mv))));
  }
  return _mm512_reduce_add_ps(sum);
}
#else
constexpr int kLanes = 8;
inline uint32_t could_enter(const float* x, float last) {
  const __m256 v = _mm256_loadu_ps(x);
  return (uint32_t)_mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(v, _mm256_set1_ps(last), _CMP_GT_OQ),
                                                   _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

inline float sum_exp(const float* x, int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m), ninf = _mm256_set1_ps(-INFINITY);
  __m256 sum = _mm256_setzero_ps();
  float buf[8];
  for (int64_t j = 0; j < n; j += 8) {
    const float* src = x + j;
    if (j + 8 > n) {  // the tail, padded with -inf
      for (int64_t l = 0; l < 8; ++l) buf[l] = j + l < n ? x[j + l] : -INFINITY;
      src = buf;
    }
    const __m256 v = _mm256_loadu_ps(src);
    sum = _mm256_add_ps(sum, _mm256_and_ps(_mm256_cmp_ps(v, ninf, _CMP_NEQ_OQ), exp256(_mm256_sub_ps(v, mv))));
  }
  return hsum(sum);
}
#endif

// The k best of x[0, n) (sorted as `ahead`).
inline void top_row(const float* x, int64_t n, int k, TopList& top) {
  int64_t j = 0;
  for (; j < n && top.n < k; ++j) top.offer(x[j], (int32_t)j, k);
  for (; j + kLanes <= n; j += kLanes) {
    if (std::isnan(top.v[k - 1])) return;  // k NaNs of lower index: nothing later gets in
    for (uint32_t m = could_enter(x + j, top.v[k - 1]); m; m &= m - 1) {
      const int l = __builtin_ctz(m);
      top.offer(x[j + l], (int32_t)(j + l), k);
    }
  }
  for (; j < n; ++j) top.offer(x[j], (int32_t)j, k);
}

struct Job {
  const float* x;
  float *vals, *lse;
  int32_t* idx;
  int64_t R, V;
  int k;
  bool with_lse;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void row(int64_t r) {
    const float* xr = x + r * V;
    TopList top;
    top_row(xr, V, k, top);
    for (int j = 0; j < k; ++j) vals[r * k + j] = top.v[j], idx[r * k + j] = top.i[j];
    float out = 0.0f;
    if (with_lse) {
      const float m = top.v[0];  // the row's maximum (NaN if any is NaN)
      out = std::isfinite(m) ? m + std::log(sum_exp(xr, V, m)) : m;
    }
    lse[r] = out;
  }

  void work() {
    for (int64_t r; (r = next.fetch_add(1)) < R;) {
      row(r);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error TopK(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, int64_t k, int64_t lse, ffi::ResultBuffer<ffi::F32> vals,
                ffi::ResultBuffer<ffi::S32> idx, ffi::ResultBuffer<ffi::F32> lse_out) {
  auto xd = x.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("x must be [R, V]");
  if (k < 1 || k > kMaxK || k > xd[1]) return ffi::Error::InvalidArgument("k must be in [1, min(V, 64)]");
  if (xd[1] > INT32_MAX) return ffi::Error::InvalidArgument("rows longer than int32 indices");
  auto job = std::make_shared<Job>();
  job->x = x.typed_data();
  job->vals = vals->typed_data(); job->idx = idx->typed_data(); job->lse = lse_out->typed_data();
  job->R = xd[0]; job->V = xd[1]; job->k = (int)k; job->with_lse = lse != 0;
  // A row is short work (a [1, 49152] argmax ≈ 10 µs): the pool's helpers only for several rows.
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), job->R) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->work(); });
  job->work();
  while (job->done.load(std::memory_order_acquire) < job->R) _mm_pause();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(EagleTopK, TopK,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("k").Attr<int64_t>("lse")
                                  .Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
