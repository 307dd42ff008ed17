// AVX2 helpers shared by cpu_matmul_avx2.h (the block kernels) and cpu_attention.cc's AVX2 half.
#pragma once

#include <immintrin.h>

// The sum of an 8-float vector's lanes in one fixed order: the two halves, then lanes 0+2 and
// 1+3, then those two.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
