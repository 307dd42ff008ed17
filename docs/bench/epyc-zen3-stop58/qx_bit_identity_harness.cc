// Bit-identity check of stop 58's AVX2 int8-row kernels (cpu_matmul_avx2.h, qx_block) against the
// header before them: each build writes its outputs for both block kinds (Q4_1, Q8_0), 1-8 rows and
// 20 random shapes to a file, and the files must be equal byte for byte.
//   sed -n 47,93p eagle_jax/kernels/cpu_matmul.cc > /tmp/pre.h   # the constants and prefetch helpers
//   git show 2219f98:eagle_jax/kernels/cpu_matmul_avx2.h > /tmp/old_avx2.h
//   g++ -O3 -march=native -std=c++17 -I/tmp -Ieagle_jax/kernels -DHDR='"old_avx2.h"' THIS.cc -o /tmp/d_old
//   g++ -O3 -march=native -std=c++17 -I/tmp -Ieagle_jax/kernels -DHDR='"cpu_matmul_avx2.h"' THIS.cc -o /tmp/d_new
//   /tmp/d_old /tmp/o.bin && /tmp/d_new /tmp/n.bin && cmp /tmp/o.bin /tmp/n.bin && echo bit-identical
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>
#include <random>
#include "cpu_simd_avx2.h"
#include "pre.h"
#include HDR
}
template <int T> void one(std::vector<uint8_t>& w, std::vector<uint8_t>& xq, int64_t K, int64_t N, FILE* f) {
  std::vector<float> y(T * N);
  qx_block<true, T>((const float*)xq.data(), (const float*)w.data(), nullptr, y.data(), K, N, 0, N);
  fwrite(y.data(), 4, y.size(), f);
  qx_block<false, T>((const float*)xq.data(), (const float*)w.data(), nullptr, y.data(), K, N, 0, N);
  fwrite(y.data(), 4, y.size(), f);
}
int main(int argc, char** argv) {
  FILE* f = fopen(argv[1], "wb");
  std::mt19937 g(7);
  for (int rep = 0; rep < 20; ++rep) {
    const int64_t K = 32 * (1 + g() % 40), N = 16 * (1 + g() % 40), nb = K / 32;
    std::vector<uint8_t> w((N / kQxCols) * nb * qx_group_bytes(false));
    for (auto& b : w) b = g();
    for (int64_t grp = 0; grp < (N / kQxCols) * nb; ++grp) {  // sane f16 scales for both layouts
      for (int q4 = 0; q4 < 2; ++q4) {
        uint16_t* s = (uint16_t*)(w.data() + grp * qx_group_bytes(q4) + qx_group_bytes(q4) - 64);
        if ((grp + 1) * qx_group_bytes(q4) <= (int64_t)w.size()) for (int i = 0; i < 32; ++i) s[i] = 0x2000 + (g() % 0x1000);
      }
    }
    std::vector<float> x(8 * K); for (auto& v : x) v = ((int)(g() % 20001) - 10000) / 3000.0f;
    std::vector<uint8_t> xq(8 * qx_row_bytes(K)); qx_quantize(x.data(), 8, K, xq.data());
    one<1>(w, xq, K, N, f); one<2>(w, xq, K, N, f); one<3>(w, xq, K, N, f); one<4>(w, xq, K, N, f);
    one<5>(w, xq, K, N, f); one<6>(w, xq, K, N, f); one<7>(w, xq, K, N, f); one<8>(w, xq, K, N, f);
  }
  fclose(f);
}
