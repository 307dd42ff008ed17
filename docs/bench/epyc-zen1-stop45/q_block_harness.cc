// Single-core timing of the AVX2 Q4_1 block kernel (eagle_jax/kernels/cpu_matmul_avx2.h), stop 45.
// One [T, 576] x [576, 1536] product at a time, T = 1..4, the weights cycled through `mats`
// random matrices (1: they stay in L3; 60: they come from memory); best of 7 runs of 240 calls.
// Also two exact alternatives for turning nibbles into floats (each checked bit for bit against
// the kernel) and the core's peak rate of 256-bit fused multiply-adds.
//
//   g++ -O3 -march=native -std=c++17 -I eagle_jax/kernels \
//       docs/bench/epyc-zen1-stop45/q_block_harness.cc -o /tmp/q_block && /tmp/q_block 1
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

constexpr int64_t kQ41Bytes = 20, kQ80Bytes = 34, kB16Tile = 64, kB16MaxK = 16384;
#include "cpu_simd_avx2.h"
#include "cpu_matmul_avx2.h"

// A block's four vectors by another exact route: MODE 0 ORs each nibble into the float 2^23 and
// subtracts 2^23; MODE 1 interleaves nibbles with 0x64 into the half-precision patterns of 1024 + q,
// widens them (F16C) and subtracts 1024. Both then take gguf's d * q + m by one fused multiply-add.
template <int MODE>
inline void block_alt(const uint8_t* blk, const float* sc, __m256 (&v)[4]) {
  const __m256 d = _mm256_set1_ps(sc[0]), m = _mm256_set1_ps(sc[1]);
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(q, mask), hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
  __m128i parts[4];
  __m256 f[4];
  if (MODE == 0) {
    parts[0] = lo; parts[1] = _mm_srli_si128(lo, 8); parts[2] = hi; parts[3] = _mm_srli_si128(hi, 8);
    const __m256i magic = _mm256_set1_epi32(0x4B000000);
    for (int i = 0; i < 4; ++i)
      f[i] = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_or_si256(_mm256_cvtepu8_epi32(parts[i]), magic)),
                           _mm256_set1_ps(8388608.0f));
  } else {
    const __m128i c64 = _mm_set1_epi8(0x64);
    parts[0] = _mm_unpacklo_epi8(lo, c64); parts[1] = _mm_unpackhi_epi8(lo, c64);
    parts[2] = _mm_unpacklo_epi8(hi, c64); parts[3] = _mm_unpackhi_epi8(hi, c64);
    for (int i = 0; i < 4; ++i) f[i] = _mm256_sub_ps(_mm256_cvtph_ps(parts[i]), _mm256_set1_ps(1024.0f));
  }
  for (int i = 0; i < 4; ++i) v[i] = _mm256_fmadd_ps(d, f[i], m);
}

// q_block's loop (one row of w a pass, two for one row of x) with block_alt<MODE>.
template <int MODE, int T>
void q_alt(const float* x, const float* w_as_float, const float* scales, float* y, int64_t K, int64_t N,
           int64_t n0, int64_t n1) {
  const uint8_t* w = reinterpret_cast<const uint8_t*>(w_as_float);
  constexpr int R = T == 1 ? 2 : 1;
  const int64_t nb = K / 32, row_bytes = nb * kQ41Bytes;
  for (int64_t n = n0; n < n1; n += R) {
    __m256 acc[2][T][R];
    for (auto& a : acc) for (auto& b : a) for (auto& c : b) c = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b)
      for (int r = 0; r < R; ++r) {
        __m256 v[4];
        block_alt<MODE>(w + (n + r) * row_bytes + b * kQ41Bytes, scales + ((n + r) * nb + b) * 2, v);
        for (int t = 0; t < T; ++t)
          for (int i = 0; i < 4; ++i)
            acc[i & 1][t][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + t * K + 32 * b + 8 * i), v[i], acc[i & 1][t][r]);
      }
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < R; ++r) y[t * N + n + r] = hsum(_mm256_add_ps(acc[0][t][r], acc[1][t][r]));
  }
}

using Fn = void (*)(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t);
static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int main(int argc, char** argv) {
  const int64_t N = 1536, K = 576, nb = K / 32;
  const int mats = argc > 1 ? std::atoi(argv[1]) : 1;
  std::vector<std::vector<uint8_t>> W(mats);
  std::vector<std::vector<float>> S(mats);
  std::srand(1);
  for (int m = 0; m < mats; ++m) {  // random blocks; scales as float32 (d, m) pairs, as the engine keeps them
    W[m].resize(N * nb * kQ41Bytes);
    S[m].resize(N * nb * 2);
    for (auto& b : W[m]) b = std::rand() & 255;
    for (auto& s : S[m]) s = (std::rand() % 1000) / 1e4f - 0.05f;
  }
  std::vector<float> x(4 * K), y(4 * N), ref(4 * N);
  for (auto& v : x) v = (std::rand() % 2000) / 1000.f - 1;
  struct Variant { const char* name; Fn f[5]; };
  const Variant variants[] = {
      {"q_block (the kernel)", {nullptr, q_block<true, 1>, q_block<true, 2>, q_block<true, 3>, q_block<true, 4>}},
      {"magic 2^23", {nullptr, q_alt<0, 1>, q_alt<0, 2>, q_alt<0, 3>, q_alt<0, 4>}},
      {"F16C halves", {nullptr, q_alt<1, 1>, q_alt<1, 2>, q_alt<1, 3>, q_alt<1, 4>}}};
  for (const auto& v : variants) {
    for (int t = 1; t <= 4; ++t) {
      const float* w0 = reinterpret_cast<const float*>(W[0].data());
      q_block<true, 4>(x.data(), w0, S[0].data(), ref.data(), K, N, 0, N);
      v.f[t](x.data(), w0, S[0].data(), y.data(), K, N, 0, N);
      const bool same = std::memcmp(y.data(), ref.data(), sizeof(float) * t * N) == 0;
      double best = 1e9;
      for (int rep = 0; rep < 7; ++rep) {
        const double t0 = now();
        for (int i = 0; i < 240; ++i)
          v.f[t](x.data(), reinterpret_cast<const float*>(W[i % mats].data()), S[i % mats].data(), y.data(), K, N,
                 0, N);
        best = std::min(best, (now() - t0) / 240);
      }
      std::printf("%-22s T=%d: %6.1f us a product%s\n", v.name, t, best * 1e6, same ? "" : "  (NOT EXACT)");
    }
  }
  __m256 a[10];  // peak: ten independent chains of 256-bit fused multiply-adds
  for (int i = 0; i < 10; ++i) a[i] = _mm256_set1_ps(i * 1e-3f);
  const __m256 b = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(1e-4f);
  const long n = 100000000;
  const double t0 = now();
  for (long i = 0; i < n; ++i)
    for (int j = 0; j < 10; ++j) a[j] = _mm256_fmadd_ps(a[j], b, c);
  const double dt = now() - t0;
  float s = 0;
  for (int i = 0; i < 10; ++i) s += _mm256_cvtss_f32(a[i]);
  std::printf("peak: %.2f G 256-bit fused multiply-adds a second on one core (checksum %g)\n", n * 10 / dt / 1e9, s);
}
