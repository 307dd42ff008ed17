// Few-row float32 matmuls for decoding on x86-64 CPUs with AVX-512 (an XLA FFI custom call).
//
// Decoding multiplies a handful of rows (one token, or a draft tree of a few tokens) by every
// weight matrix of the model. XLA:CPU's GEMM packs the weight matrix on every call, so a 4-row
// product costs about twice a 1-row one although both read the same weights. These kernels stream
// each weight once, straight from memory, and keep the few rows' partial sums in registers or L1:
// a product of up to 8 rows costs little more than reading the weights.
//
//   eagle_jax_matmul_kn: y[M, N] = x[M, K] @ w[K, N]   (Flax `Dense` kernels)
//   eagle_jax_matmul_nk: y[M, N] = x[M, K] @ w[N, K]^T (tied embeddings used as the LM head)
//   eagle_jax_matmul_f16: y = x @ w[N, K]^T with w stored as float16 (draft heads), widened exactly
//   eagle_jax_matmul_b16: y = x @ w with w as bfloat16 pairs packed in 64-column tiles (draft heads
//     only: x is rounded to bfloat16 too and the products use AVX512-BF16's dot instruction, two
//     multiply-adds per lane and instruction, no exactness; built where the CPU has AVX512-BF16)
//   eagle_jax_matmul_q4_1 / _q8_0: the same with w as GGUF Q4_1 / Q8_0 rows (uint8 [N, K/32 * 20|34]),
//     plus their float32 scales, dequantised in registers: a step reads ~120 MiB of SmolLM2's
//     weights instead of 540 MB.
//
// Every output is summed over k in one fixed order whatever M is and whichever rows share a
// call, so one token's logits do not depend on how many tokens were verified with it.
// Work is split over the columns of y across XLA's intra-op thread pool; chunks are claimed from
// an atomic counter, so the calling thread never waits on a task that has not started.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// ---------------------------------------------------------------- kn: y = x @ w, w [K, N]
// y[t, n0:n1] lives in L1; 4 (or 2) rows of w are streamed at a time, each contiguous.
template <int T, int KB>
void kn_block(const float* x, const float* w, const float*, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t width = n1 - n0;
  const int64_t vec_end = n0 + (width / 16) * 16;
  const __mmask16 tail_mask = (__mmask16)((1u << (width % 16)) - 1u);
  for (int64_t t = 0; t < T; ++t) std::fill(y + t * N + n0, y + t * N + n1, 0.0f);
  int64_t k = 0;
  for (; k + KB <= K; k += KB) {
    __m512 bx[T][KB];
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < KB; ++j) bx[t][j] = _mm512_set1_ps(x[t * K + k + j]);
    const float* wk = w + k * N;
    int64_t n = n0;
    for (; n < vec_end; n += 16) {
      __m512 wv[KB];
      for (int j = 0; j < KB; ++j) wv[j] = _mm512_loadu_ps(wk + j * N + n);
      for (int t = 0; t < T; ++t) {
        __m512 acc = _mm512_loadu_ps(y + t * N + n);
        for (int j = 0; j < KB; ++j) acc = _mm512_fmadd_ps(bx[t][j], wv[j], acc);
        _mm512_storeu_ps(y + t * N + n, acc);
      }
    }
    if (n < n1) {
      __m512 wv[KB];
      for (int j = 0; j < KB; ++j) wv[j] = _mm512_maskz_loadu_ps(tail_mask, wk + j * N + n);
      for (int t = 0; t < T; ++t) {
        __m512 acc = _mm512_maskz_loadu_ps(tail_mask, y + t * N + n);
        for (int j = 0; j < KB; ++j) acc = _mm512_fmadd_ps(bx[t][j], wv[j], acc);
        _mm512_mask_storeu_ps(y + t * N + n, tail_mask, acc);
      }
    }
  }
  for (; k < K; ++k)  // K not a multiple of KB: one row at a time, same order of sums
    for (int t = 0; t < T; ++t) {
      const float xv = x[t * K + k];
      for (int64_t n = n0; n < n1; ++n) y[t * N + n] = std::fma(xv, w[k * N + n], y[t * N + n]);
    }
}

// ---------------------------------------------------------------- nk: y = x @ w^T, w [N, K]
// R rows of w at a time against all T rows of x; 16-lane partial sums reduced at the end.
inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

template <int T, int R>
void nk_block(const float* x, const float* w, const float*, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t kvec = (K / 16) * 16;
  const __mmask16 tail_mask = (__mmask16)((1u << (K % 16)) - 1u);
  int64_t n = n0;
  for (; n < n1; n += R) {
    const int rows = (int)std::min<int64_t>(R, n1 - n);
    __m512 acc[T][R];
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_ps();
    const float* wn = w + n * K;
    if (rows == R) {
      for (int64_t k = 0; k < kvec; k += 16) {
        __m512 wv[R];
        for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_ps(wn + r * K + k);
        for (int t = 0; t < T; ++t) {
          const __m512 xv = _mm512_loadu_ps(x + t * K + k);
          for (int r = 0; r < R; ++r) acc[t][r] = _mm512_fmadd_ps(xv, wv[r], acc[t][r]);
        }
      }
      if (kvec < K) {
        __m512 wv[R];
        for (int r = 0; r < R; ++r) wv[r] = _mm512_maskz_loadu_ps(tail_mask, wn + r * K + kvec);
        for (int t = 0; t < T; ++t) {
          const __m512 xv = _mm512_maskz_loadu_ps(tail_mask, x + t * K + kvec);
          for (int r = 0; r < R; ++r) acc[t][r] = _mm512_fmadd_ps(xv, wv[r], acc[t][r]);
        }
      }
    } else {  // the last few rows of a chunk: same sums, one row at a time
      for (int r = 0; r < rows; ++r) {
        for (int64_t k = 0; k < kvec; k += 16) {
          const __m512 wv = _mm512_loadu_ps(wn + r * K + k);
          for (int t = 0; t < T; ++t) acc[t][r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + t * K + k), wv, acc[t][r]);
        }
        if (kvec < K) {
          const __m512 wv = _mm512_maskz_loadu_ps(tail_mask, wn + r * K + kvec);
          for (int t = 0; t < T; ++t)
            acc[t][r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail_mask, x + t * K + kvec), wv, acc[t][r]);
        }
      }
    }
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < rows; ++r) y[t * N + n + r] = hsum(acc[t][r]);
  }
}

// ---------------------------------------------------------------- float16 nk: y = x @ w^T, w [N, K] float16
// The float32 nk kernel on weights stored as float16 (a draft head's checkpoint): each 16-weight
// vector is widened exactly (vcvtph2ps) and summed in the same lane order, so the result is bit
// for bit the float32 kernel's on the widened weights, from half the bytes. K % 16 == 0.
template <int T, int R>
void h16_block(const float* x, const float* w_as_float, const float*, float* y, int64_t K, int64_t N, int64_t n0,
               int64_t n1) {
  const uint16_t* w = reinterpret_cast<const uint16_t*>(w_as_float);  // BlockFn's signature; really halves
  for (int64_t n = n0; n < n1; n += R) {
    const int rows = (int)std::min<int64_t>(R, n1 - n);
    __m512 acc[T][R];
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_ps();
    const uint16_t* wn = w + n * K;
    for (int64_t k = 0; k < K; k += 16) {
      for (int r = 0; r < R; ++r) {
        if (r >= rows) break;
        const __m512 wv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wn + r * K + k)));
        for (int t = 0; t < T; ++t) acc[t][r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + t * K + k), wv, acc[t][r]);
      }
    }
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < rows; ++r) y[t * N + n + r] = hsum(acc[t][r]);
  }
}

// ---------------------------------------------------------------- quantized nk: GGUF Q4_1 / Q8_0 rows
// w is [N, K/32 blocks] in ggml's block layout. Each 32-weight block is dequantised in registers
// to exactly the float32 values gguf-py's numpy dequantiser gives (Q4_1: (d * q) + m, Q8_0: q * d;
// see q41_block) and then multiplied like the float32 nk kernel (lane l sums k = l, l + 16, ... in order), so the
// result is the float32 product with the dequantised matrix while reading 5 (Q4_1) or 8.5 (Q8_0)
// bits per weight instead of 32.
constexpr int64_t kQ41Bytes = 20;  // f16 d, f16 m, 16 bytes of nibbles (weights j and j + 16)
constexpr int64_t kQ80Bytes = 34;  // f16 d, 32 int8

// Q4_1: w = d * q + m; Q8_0: w = q * d. The scales come as float32 (converted from the blocks'
// float16 once, at load), read with embedded broadcasts. d times a 4- or 8-bit q is exact in
// float32, so the fused multiply-add rounds exactly as gguf's numpy `(d * q) + m` does: the
// kernel multiplies by the same float32 weights as the converted checkpoint holds.
inline void q41_block(const uint8_t* blk, const float* sc, __m512& lo, __m512& hi) {
  const __m512 d = _mm512_set1_ps(sc[0]), m = _mm512_set1_ps(sc[1]);
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
  const __m128i mask = _mm_set1_epi8(0x0F);
  lo = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, mask))), m);
  hi = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), mask))), m);
}

inline void q80_block(const uint8_t* blk, const float* sc, __m512& lo, __m512& hi) {
  const __m512 d = _mm512_set1_ps(sc[0]);
  lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)))), d);
  hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18)))), d);
}

// T rows of x (up to 12) against R rows of w per pass: each block is dequantised once per call
// (the T x R accumulators stay in registers: 12 x 1, 8 x 2, 4 x 4).
template <bool Q4, int T>
void q_block(const float* x, const float* w_as_float, const float* scales, float* y, int64_t K, int64_t N,
             int64_t n0, int64_t n1) {
  const uint8_t* w = reinterpret_cast<const uint8_t*>(w_as_float);  // BlockFn's signature; really bytes
  constexpr int R = T <= 4 ? 4 : T <= 8 ? 2 : 1;
  constexpr int64_t B = Q4 ? kQ41Bytes : kQ80Bytes;
  constexpr int64_t S = Q4 ? 2 : 1;  // float32 scales per block: (d, m) or d
  const int64_t nb = K / 32, row_bytes = nb * B;
  for (int64_t n = n0; n < n1; n += R) {
    const int rows = (int)std::min<int64_t>(R, n1 - n);
    __m512 acc[T][R];
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_ps();
    const uint8_t* wn = w + n * row_bytes;
    const float* sn = scales + n * nb * S;
    for (int64_t b = 0; b < nb; ++b) {
      for (int r = 0; r < R; ++r) {
        if (r >= rows) break;
        __m512 lo, hi;
        if (Q4) q41_block(wn + r * row_bytes + b * B, sn + (r * nb + b) * S, lo, hi);
        else q80_block(wn + r * row_bytes + b * B, sn + (r * nb + b) * S, lo, hi);
        for (int t = 0; t < T; ++t) {
          acc[t][r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + t * K + 32 * b), lo, acc[t][r]);
          acc[t][r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + t * K + 32 * b + 16), hi, acc[t][r]);
        }
      }
    }
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < rows; ++r) y[t * N + n + r] = hsum(acc[t][r]);
  }
}

// ---------------------------------------------------------------- bfloat16 tiles (draft heads)
// w packed as uint32 [ceil(N/64), K/2, 64]: word (tile, k2, j) holds bf16(w[2 k2, n]) in its low and
// bf16(w[2 k2 + 1, n]) in its high half, n = 64 tile + j (zeros past N). A tile's K/2 x 256 bytes
// are contiguous, and each output lane accumulates its own column, so no horizontal sums. The T
// rows of x are rounded to bfloat16 pairs first. Drafting only: the sums are not float32's.
constexpr int64_t kB16Tile = 64;
constexpr int64_t kB16MaxK = 16384;
#ifdef __AVX512BF16__
constexpr bool kHaveB16 = true;
template <int T>
void b16_block(const float* x, const float* w_as_float, const float*, float* y, int64_t K, int64_t N, int64_t n0,
               int64_t n1) {
  const uint32_t* w = reinterpret_cast<const uint32_t*>(w_as_float);  // BlockFn's signature; really pairs
  const int64_t K2 = K / 2;
  thread_local uint32_t xp[T * kB16MaxK / 2];
  for (int t = 0; t < T; ++t) {
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + t * K + k + 16), _mm512_loadu_ps(x + t * K + k));
      _mm512_storeu_si512(xp + t * K2 + k / 2, (__m512i)v);
    }
    if (k < K) {  // K % 32 (K is even): the last pairs, masked
      const int64_t left = K - k;
      const __mmask16 lo = (__mmask16)((1u << std::min<int64_t>(16, left)) - 1u);
      const __mmask16 hi = (__mmask16)(left > 16 ? (1u << (left - 16)) - 1u : 0u);
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, x + t * K + k + 16),
                                             _mm512_maskz_loadu_ps(lo, x + t * K + k));
      _mm512_mask_storeu_epi32(xp + t * K2 + k / 2, (__mmask16)((1u << (left / 2)) - 1u), (__m512i)v);
    }
  }
  constexpr int A = T <= 2 ? 2 : 1;  // few rows: two accumulator sets hide the instruction's latency
  constexpr int J = kB16Tile / 16;    // a tile's 16-column vectors: T x J accumulators (T <= 4) in registers
  for (int64_t n = n0; n < n1; n += kB16Tile) {
    const uint32_t* wt = w + (n / kB16Tile) * K2 * kB16Tile;
    __m512 acc[A][T][J];
    for (int a = 0; a < A; ++a)
      for (int t = 0; t < T; ++t)
        for (int j = 0; j < J; ++j) acc[a][t][j] = _mm512_setzero_ps();
    for (int64_t k2 = 0; k2 < K2; ++k2) {
      const int a = A == 2 ? (int)(k2 & 1) : 0;
      const uint32_t* wk = wt + k2 * kB16Tile;
      __m512bh wv[J];
      for (int j = 0; j < J; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wk + 16 * j);
      for (int t = 0; t < T; ++t) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[t * K2 + k2]);
        for (int j = 0; j < J; ++j) acc[a][t][j] = _mm512_dpbf16_ps(acc[a][t][j], xv, wv[j]);
      }
    }
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < J; ++j) {
        const int64_t c = n + 16 * j;
        if (c >= n1) break;
        __m512 v = acc[0][t][j];
        if (A == 2) v = _mm512_add_ps(v, acc[A - 1][t][j]);
        const __mmask16 m = n1 - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n1 - c)) - 1u);
        _mm512_mask_storeu_ps(y + t * N + c, m, v);
      }
  }
}
#else
constexpr bool kHaveB16 = false;
template <int T>
void b16_block(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t) {}
#endif

// ---------------------------------------------------------------- dispatch over rows and threads
using BlockFn = void (*)(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t);

// The <T rows of x, R rows of w a pass> instance of a float block kernel for t rows: R = 4 up to
// 4 rows of x, else 2 (the T x R accumulators stay in registers).
#define EAGLE_ROWS_FN(NAME, BLOCK)                                        \
  BlockFn NAME(int t) {                                                   \
    switch (t) {                                                          \
      case 1: return BLOCK<1, 4>;                                         \
      case 2: return BLOCK<2, 4>;                                         \
      case 3: return BLOCK<3, 4>;                                         \
      case 4: return BLOCK<4, 4>;                                         \
      case 5: return BLOCK<5, 2>;                                         \
      case 6: return BLOCK<6, 2>;                                         \
      case 7: return BLOCK<7, 2>;                                         \
      default: return BLOCK<8, 2>;                                        \
    }                                                                     \
  }
EAGLE_ROWS_FN(kn_fn, kn_block)
EAGLE_ROWS_FN(nk_fn, nk_block)
EAGLE_ROWS_FN(h16_fn, h16_block)

BlockFn b16_fn(int t) {  // at most 4 rows a pass (Job::run_chunk): the T x 4 accumulators fit registers
  switch (t) {
    case 1: return b16_block<1>;
    case 2: return b16_block<2>;
    case 3: return b16_block<3>;
    default: return b16_block<4>;
  }
}

// Quantized rows: up to 12 rows of x in one pass over the weights (kQOnePass; R = 1 row of w at a
// time above 8), so a verification pass of 9 to 12 tree tokens decodes each block once. Above 12
// the one-row-of-w passes run out of load bandwidth (every block reloads all T rows of x), and two
// balanced passes of at most 8 rows (R = 2) are faster: measured for 60 [T, 576] x [576, 1536]
// Q4_1 products on the EPYC VM, 9 rows 7.4 ms in one pass against 8.9 as 8 + 1, 12 rows 9.4
// against 9.9 as 8 + 4, 16 rows 16.2 in one pass against 12.4 as 8 + 8.
constexpr int64_t kQOnePass = 12;
template <bool Q4>
BlockFn q_fn(int t) {
  switch (t) {
    case 1: return q_block<Q4, 1>;
    case 2: return q_block<Q4, 2>;
    case 3: return q_block<Q4, 3>;
    case 4: return q_block<Q4, 4>;
    case 5: return q_block<Q4, 5>;
    case 6: return q_block<Q4, 6>;
    case 7: return q_block<Q4, 7>;
    case 8: return q_block<Q4, 8>;
    case 9: return q_block<Q4, 9>;
    case 10: return q_block<Q4, 10>;
    case 11: return q_block<Q4, 11>;
    default: return q_block<Q4, 12>;
  }
}

// Rows of x per pass over the weights for M rows.
inline int64_t row_group(int64_t M, bool b16, bool quantized) {
  if (b16) return 4;
  if (!quantized) return 8;
  if (M <= kQOnePass) return M;
  const int64_t passes = (M + 7) / 8;
  return (M + passes - 1) / passes;  // balanced: 13-16 rows as two passes of 7 or 8
}

enum class Kind { kKN, kNK, kQ41, kQ80, kH16, kB16 };

struct Job {
  const float* x;
  const void* w;
  const float* scales;
  float* y;
  int64_t M, K, N, chunk, chunks;
  Kind kind;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void run_chunk(int64_t c) {
    const int64_t n0 = c * chunk, n1 = std::min(N, n0 + chunk);
    const int64_t group = row_group(M, kind == Kind::kB16, kind == Kind::kQ41 || kind == Kind::kQ80);
    for (int64_t m0 = 0; m0 < M; m0 += group) {
      const int t = (int)std::min<int64_t>(group, M - m0);
      BlockFn f = kind == Kind::kKN ? kn_fn(t) : kind == Kind::kNK ? nk_fn(t) : kind == Kind::kH16 ? h16_fn(t)
                : kind == Kind::kB16 ? b16_fn(t)
                : kind == Kind::kQ41 ? q_fn<true>(t) : q_fn<false>(t);
      f(x + m0 * K, static_cast<const float*>(w), scales, y + m0 * N, K, N, n0, n1);
    }
  }
  void work() {
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      run_chunk(c);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// y[M, N] with N split into chunks claimed from an atomic counter by the caller and pool tasks.
void Run(ffi::ThreadPool& pool, const float* x, const void* w, const float* scales, float* y, int64_t M, int64_t K,
         int64_t N, Kind kind) {
  auto job = std::make_shared<Job>();
  job->x = x; job->w = w; job->scales = scales; job->y = y;
  job->M = M; job->K = K; job->N = N; job->kind = kind;
  static const int64_t max_threads = [] {
    const char* v = std::getenv("EAGLE_JAX_CPU_KERNEL_THREADS");
    return v && *v ? std::max<int64_t>(1, std::atoll(v)) : INT64_MAX;
  }();
  const int64_t threads = std::min(max_threads, std::max<int64_t>(1, pool.num_threads()));
  const int64_t align = kind == Kind::kKN ? 16 : kind == Kind::kB16 ? kB16Tile : 4;
  // Row-wise kinds (nk, quantized) take many small chunks: a helper thread that wakes late finds
  // little left to do, and the caller never waits for more than one chunk after its own. kn
  // streams every row of w across its chunk's columns, so its chunks stay wide.
  const int64_t chunks = threads == 1 ? 1
      : kind == Kind::kKN ? std::min<int64_t>(2 * threads, std::max<int64_t>(1, N / 256))
      : kind == Kind::kB16 ? std::min<int64_t>(8 * threads, (N + kB16Tile - 1) / kB16Tile)
                          : std::min<int64_t>(8 * threads, std::max<int64_t>(1, N / 64));
  int64_t chunk = (N + chunks - 1) / chunks;
  chunk = (chunk + align - 1) / align * align;
  job->chunk = chunk;
  job->chunks = (N + chunk - 1) / chunk;
  for (int64_t i = 1; i < std::min(threads, job->chunks); ++i) pool.Schedule([job] { job->work(); });
  job->work();
  while (job->done.load(std::memory_order_acquire) < job->chunks) _mm_pause();
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                  ffi::ResultBuffer<ffi::F32> y, bool nk) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("x and w must be 2-D");
  const int64_t M = xd[0], K = xd[1];
  const int64_t N = nk ? wd[0] : wd[1];
  if ((nk ? wd[1] : wd[0]) != K) return ffi::Error::InvalidArgument("x and w disagree on K");
  Run(pool, x.typed_data(), w.typed_data(), nullptr, y->typed_data(), M, K, N, nk ? Kind::kNK : Kind::kKN);
  return ffi::Error::Success();
}

ffi::Error QMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::F32> sc,
                   ffi::ResultBuffer<ffi::F32> y, bool q4) {
  auto xd = x.dimensions(), wd = w.dimensions(), sd = sc.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || sd.size() != 2) return ffi::Error::InvalidArgument("x, w and scales must be 2-D");
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  if (K % 32 || wd[1] != K / 32 * (q4 ? kQ41Bytes : kQ80Bytes))
    return ffi::Error::InvalidArgument("quantized rows do not hold K / 32 blocks");
  if (sd[0] != N || sd[1] != K / 32 * (q4 ? 2 : 1))
    return ffi::Error::InvalidArgument("scales must be [N, K / 32 * (2 for Q4_1, 1 for Q8_0)]");
  Run(pool, x.typed_data(), w.typed_data(), sc.typed_data(), y->typed_data(), M, K, N, q4 ? Kind::kQ41 : Kind::kQ80);
  return ffi::Error::Success();
}

ffi::Error HMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F16> w,
                   ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("x and w must be 2-D");
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  if (wd[1] != K || K % 16) return ffi::Error::InvalidArgument("float16 rows must be [N, K] with K % 16 == 0");
  Run(pool, x.typed_data(), w.untyped_data(), nullptr, y->typed_data(), M, K, N, Kind::kH16);
  return ffi::Error::Success();
}

ffi::Error BMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U32> w,
                   ffi::ResultBuffer<ffi::F32> y) {
  if (!kHaveB16) return ffi::Error::Internal("built without AVX512-BF16: eagle_jax_matmul_b16 is unavailable");
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2) return ffi::Error::InvalidArgument("x [M, K], w [tiles, K/2, 64]");
  const int64_t M = xd[0], K = xd[1], N = yd[1];
  if (K % 2 || K > kB16MaxK || wd[1] != K / 2 || wd[2] != kB16Tile || wd[0] != (N + kB16Tile - 1) / kB16Tile)
    return ffi::Error::InvalidArgument("bfloat16 tiles do not fit x and y (K even, K <= 16384)");
  Run(pool, x.typed_data(), w.untyped_data(), nullptr, y->typed_data(), M, K, N, Kind::kB16);
  return ffi::Error::Success();
}

}  // namespace

extern "C" int eagle_jax_has_b16() { return kHaveB16 ? 1 : 0; }

#define EAGLE_F32_HANDLER(NAME, NK)                                                                  \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, [](ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,               \
                                         ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {     \
    return Matmul(pool, x, w, y, NK);                                                                \
  }, ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>() \
         .Ret<ffi::Buffer<ffi::F32>>())

#define EAGLE_Q_HANDLER(NAME, Q4)                                                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, [](ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,               \
                                         ffi::Buffer<ffi::U8> w, ffi::Buffer<ffi::F32> sc,             \
                                         ffi::ResultBuffer<ffi::F32> y) {                              \
    return QMatmul(pool, x, w, sc, y, Q4);                                                           \
  }, ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::U8>>()  \
         .Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>())

EAGLE_F32_HANDLER(EagleMatmulKN, false);
EAGLE_F32_HANDLER(EagleMatmulNK, true);
EAGLE_Q_HANDLER(EagleMatmulQ41, true);
EAGLE_Q_HANDLER(EagleMatmulQ80, false);
XLA_FFI_DEFINE_HANDLER_SYMBOL(EagleMatmulB16, BMatmul,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>().Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(EagleMatmulF16, HMatmul,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F16>>().Ret<ffi::Buffer<ffi::F32>>());
