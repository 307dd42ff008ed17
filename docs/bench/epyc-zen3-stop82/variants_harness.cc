// Stop 82 (Zen 3 VM): variants of the AVX2 int8-row kernels (cpu_matmul_avx2.h, qx_quantize / qx_block)
// against the header as it is, in one process: bit identity on random shapes (1-8 rows, Q4_1 and Q8_0),
// then one thread's microseconds a product from memory, the variants taking turns each repetition:
// 60 [T, 576] x [576, 1536] and 60 [T, 1536] x [1536, 576] Q4_1 products, one [T, 576] x [576, 49152] Q8_0.
//   (from the repository root) H=$PWD/docs/bench/epyc-zen3-stop82 K=$PWD/eagle_jax/kernels
//   mkdir -p /tmp/v && cd /tmp/v
//   sed -n 50,60p $K/cpu_matmul.cc > pre.h; sed -n 62,128p $K/cpu_matmul.cc >> pre.h; echo '}' >> pre.h
//   sed 's/#pragma once//; s/constexpr bool kHaveQx = true;/&\nconstexpr int64_t kQxSpread = 1;/' \
//     $K/cpu_matmul_avx2.h > old.h
//   cp old.h spread.h && patch spread.h $H/spread-x.diff            # x's 4-byte groups spread over vectors
//   cp spread.h scales.h && patch scales.h $H/spread-scales.diff    # and the block scales too
//   cp old.h unroll.h && patch unroll.h $H/unroll-4-5-rows.diff     # the Q4_1 loop unrolled for 4-5 rows
//   cp $K/cpu_simd_avx2.h . && g++ -O3 -march=native -std=c++17 -w $H/variants_harness.cc -I. -o h
//   ./h check; ./h 31 1 6    # repetitions, first and last row count
#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>
#include "cpu_simd_avx2.h"
namespace {
#include "pre.h"
}
namespace v_old { inline int64_t qx_row_bytes(int64_t K) { return K + 12 * (K / 32); }
#include "old.h"
}
namespace v_spread { inline int64_t qx_row_bytes(int64_t K) { return 8 * K + 12 * (K / 32); }
#include "spread.h"
}
namespace v_scales { inline int64_t qx_row_bytes(int64_t K) { return 8 * K + 96 * (K / 32); }
#include "scales.h"
}
namespace v_unroll { inline int64_t qx_row_bytes(int64_t K) { return K + 12 * (K / 32); }
#include "unroll.h"
}
namespace v_tiles {  // more than 3 rows: two tiles of rows a 16-column group, the second from L1
using v_old::qx_row_bytes;
template <bool Q4, int T>
void qx_block(const float* xq, const float* w, const float* s, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  if constexpr (T <= 3) {
    v_old::qx_block<Q4, T>(xq, w, s, y, K, N, n0, n1);
  } else {
    constexpr int A = T / 2, B = T - A;
    const float* xq_b = reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(xq) + A * qx_row_bytes(K));
    for (int64_t n = n0; n < n1; n += kQxCols) {
      v_old::qx_block<Q4, A>(xq, w, s, y, K, N, n, n + kQxCols);
      v_old::qx_block<Q4, B>(xq_b, w, s, y + A * N, K, N, n, n + kQxCols);
    }
  }
}
}  // namespace v_tiles

constexpr int kVariants = 5;
const char* kNames[kVariants] = {"header", "spread x", "spread x + scales", "tiles", "unrolled (4-5 rows)"};
int64_t row_bytes(int v, int64_t K) {
  return v == 1 ? v_spread::qx_row_bytes(K) : v == 2 ? v_scales::qx_row_bytes(K) : v_old::qx_row_bytes(K);
}
void quantize(int v, const float* x, int64_t M, int64_t K, uint8_t* out) {
  if (v == 1) v_spread::qx_quantize(x, M, K, out);
  else if (v == 2) v_scales::qx_quantize(x, M, K, out);
  else v_old::qx_quantize(x, M, K, out);
}
template <bool Q4, int T>
void product_t(int v, const uint8_t* xq, const uint8_t* w, float* y, int64_t K, int64_t N) {
  const float *x = (const float*)xq, *wf = (const float*)w;
  if (v == 0) v_old::qx_block<Q4, T>(x, wf, nullptr, y, K, N, 0, N);
  else if (v == 1) v_spread::qx_block<Q4, T>(x, wf, nullptr, y, K, N, 0, N);
  else if (v == 2) v_scales::qx_block<Q4, T>(x, wf, nullptr, y, K, N, 0, N);
  else if (v == 3) v_tiles::qx_block<Q4, T>(x, wf, nullptr, y, K, N, 0, N);
  else v_unroll::qx_block<Q4, T>(x, wf, nullptr, y, K, N, 0, N);
}
template <bool Q4>
void product(int v, int t, const uint8_t* xq, const uint8_t* w, float* y, int64_t K, int64_t N) {
  switch (t) {
    case 1: return product_t<Q4, 1>(v, xq, w, y, K, N); case 2: return product_t<Q4, 2>(v, xq, w, y, K, N);
    case 3: return product_t<Q4, 3>(v, xq, w, y, K, N); case 4: return product_t<Q4, 4>(v, xq, w, y, K, N);
    case 5: return product_t<Q4, 5>(v, xq, w, y, K, N); case 6: return product_t<Q4, 6>(v, xq, w, y, K, N);
    case 7: return product_t<Q4, 7>(v, xq, w, y, K, N); default: return product_t<Q4, 8>(v, xq, w, y, K, N);
  }
}
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
void fill_w(std::vector<uint8_t>& w, bool q4, std::mt19937& g) {
  for (auto& b : w) b = g();
  const int64_t gb = qx_group_bytes(q4);
  for (int64_t grp = 0; (grp + 1) * gb <= (int64_t)w.size(); ++grp) {  // sane f16 scales
    uint16_t* s = (uint16_t*)(w.data() + grp * gb + gb - 64);
    for (int i = 0; i < 32; ++i) s[i] = 0x2000 + (g() % 0x1000);
  }
}
int main(int argc, char** argv) {
  std::mt19937 g(7);
  int bad = 0;
  for (int rep = 0; rep < 20; ++rep) {
    const int64_t K = 32 * (1 + g() % 50), N = 16 * (1 + g() % 40);
    for (int q4 = 0; q4 < 2; ++q4) {
      std::vector<uint8_t> w((N / kQxCols) * (K / 32) * qx_group_bytes(q4));
      fill_w(w, q4, g);
      std::vector<float> x(8 * K);
      for (auto& v : x) v = ((int)(g() % 20001) - 10000) / 3000.0f;
      for (int t = 1; t <= 8; ++t) {
        std::vector<float> want(t * N);
        for (int v = 0; v < kVariants; ++v) {
          std::vector<uint8_t> xq(8 * row_bytes(v, K));
          quantize(v, x.data(), 8, K, xq.data());
          std::vector<float> y(t * N);
          (q4 ? product<true> : product<false>)(v, t, xq.data(), w.data(), y.data(), K, N);
          if (v == 0) want = y;
          else if (memcmp(want.data(), y.data(), 4 * t * N))
            ++bad, printf("%s differs: K=%ld N=%ld q4=%d t=%d\n", kNames[v], K, N, q4, t);
        }
      }
    }
  }
  printf("bit identity with the header: %s\n", bad ? "FAILED" : "ok");
  if (argc > 1 && !strcmp(argv[1], "check")) return bad;
  const int reps = argc > 1 ? atoi(argv[1]) : 15;
  const int tlo = argc > 2 ? atoi(argv[2]) : 1, thi = argc > 3 ? atoi(argv[3]) : 6;
  const int NM = 60;
  std::vector<std::vector<uint8_t>> wa(NM), wb(NM);
  for (int i = 0; i < NM; ++i) {
    wa[i].resize(1536 / 16 * 18 * qx_group_bytes(true)), fill_w(wa[i], true, g);
    wb[i].resize(576 / 16 * 48 * qx_group_bytes(true)), fill_w(wb[i], true, g);
  }
  std::vector<uint8_t> lm(49152 / 16 * 18 * qx_group_bytes(false));
  fill_w(lm, false, g);
  std::vector<float> x(8 * 1536), y(8 * 49152);
  for (auto& v : x) v = ((int)(g() % 20001) - 10000) / 3000.0f;
  printf("us a product, median of %d; columns: 576x1536 Q4_1, 1536x576 Q4_1, 576x49152 Q8_0, each variant\n", reps);
  for (int v = 0; v < kVariants; ++v) printf("  %d: %s\n", v, kNames[v]);
  for (int t = tlo; t <= thi; ++t) {
    std::vector<double> r[3][kVariants];
    for (int rep = 0; rep < reps; ++rep)
      for (int v = 0; v < kVariants; ++v) {
        std::vector<uint8_t> xa(8 * row_bytes(v, 576)), xb(8 * row_bytes(v, 1536));
        const double t0 = now();
        for (int i = 0; i < NM; ++i)
          quantize(v, x.data(), t, 576, xa.data()), product<true>(v, t, xa.data(), wa[i].data(), y.data(), 576, 1536);
        const double t1 = now();
        for (int i = 0; i < NM; ++i)
          quantize(v, x.data(), t, 1536, xb.data()), product<true>(v, t, xb.data(), wb[i].data(), y.data(), 1536, 576);
        const double t2 = now();
        quantize(v, x.data(), t, 576, xa.data()), product<false>(v, t, xa.data(), lm.data(), y.data(), 576, 49152);
        const double t3 = now();
        r[0][v].push_back((t1 - t0) / NM * 1e6), r[1][v].push_back((t2 - t1) / NM * 1e6);
        r[2][v].push_back((t3 - t2) * 1e6);
      }
    printf("T=%d", t);
    for (auto& col : r) {
      printf(" |");
      for (auto& s : col) std::sort(s.begin(), s.end()), printf(" %.1f", s[s.size() / 2]);
    }
    printf("\n");
  }
}
