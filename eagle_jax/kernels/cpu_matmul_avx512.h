// AVX-512 block kernels of cpu_matmul.cc (included there when the compiler targets AVX-512F/DQ).
// Each output lane l of a 16-float vector sums k = l, l + 16, ... in order.
#pragma once

// Rows of w a float block kernel takes a pass for t rows of x: the T x R accumulators stay in
// the 32 vector registers.
constexpr int kRowsW(int t) { return t <= 4 ? 4 : 2; }
constexpr int kKnRowsW(int t) { return kRowsW(t); }  // rows of w kn_block streams at once

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

// Q4_1: w = d * q + m; Q8_0: w = q * d. The scales come as float32 (converted from the blocks'
// float16 once, at load), read with embedded broadcasts. d times a 4- or 8-bit q is exact in
// float32, so the fused multiply-add rounds exactly as gguf's numpy `(d * q) + m` does: the
// kernel multiplies by the same float32 weights as the converted checkpoint holds.
inline void q41_block(const uint8_t* blk, const float* sc, __m512& lo, __m512& hi) {
  // The 16 values a block's nibbles can take, d * q + m for q = 0..15 (one multiply-add, rounded
  // as gguf's numpy rounds each weight), looked up by vpermps, which reads only an index's low
  // four bits: the high nibble needs one shift, the low one nothing. 5 vector instructions a
  // block instead of 9 converting each nibble, for the same float32 weights.
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 lut = _mm512_fmadd_ps(_mm512_set1_ps(sc[0]), iota, _mm512_set1_ps(sc[1]));
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4)));
  lo = _mm512_permutexvar_ps(q, lut);
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut);
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
    Ahead ahead = prefetch_ahead(w, scales, n, n0, n1, R, row_bytes, nb * S, nb);
    for (int64_t b = 0; b < nb; ++b) {
      ahead.part();
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

// ---------------------------------------------------------------- int8 tiles (draft heads, AVX512-VNNI)
// w quantised per output column (w[k, n] ~ s[n] * q, q in [-127, 127]) and stored as u = q + 128,
// packed as uint32 [ceil(N/64), K/4, 64]: word (tile, k4, j) holds u[4 k4 .. 4 k4 + 3, n] for
// n = 64 tile + j (u = 128, a zero weight, past N). Each row of x is rounded to int8 with its own
// scale (sx = max |x| / 127), and vpdpbusd sums four u8 x s8 products a lane and instruction into
// int32, exactly; sum_k u q_x = sum_k q q_x + 128 sum_k q_x, so y = (acc - 128 sum_k q_x) sx s[n].
// Drafting only: a product of the rounded values, not float32's.
#ifdef __AVX512VNNI__
constexpr bool kHaveI8 = true;
template <int T>
void i8_block(const float* x, const float* w_as_float, const float* scales, float* y, int64_t K, int64_t N,
              int64_t n0, int64_t n1) {
  const uint32_t* w = reinterpret_cast<const uint32_t*>(w_as_float);  // BlockFn's signature; really quads
  const int64_t K4 = K / 4;  // K % 16 == 0 (I8Matmul checks)
  thread_local uint32_t xq[4 * kI8MaxK / 4];
  float sx[T];
  int32_t corr[T];
  for (int t = 0; t < T; ++t) {
    const float* xt = x + t * K;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(xt + k)));
    const float m = _mm512_reduce_max_ps(amax);
    sx[t] = m / 127.0f;
    const __m512 inv = _mm512_set1_ps(m > 0.0f ? 127.0f / m : 0.0f);
    __m512i qsum = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 16) {
      __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xt + k), inv));  // to nearest even
      q = _mm512_max_epi32(_mm512_min_epi32(q, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
      qsum = _mm512_add_epi32(qsum, q);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + t * K4 + k / 4), _mm512_cvtepi32_epi8(q));
    }
    corr[t] = 128 * _mm512_reduce_add_epi32(qsum);
  }
  constexpr int A = T <= 2 ? 2 : 1;  // few rows: two accumulator sets hide vpdpbusd's latency
  constexpr int J = kI8Tile / 16;
  for (int64_t n = n0; n < n1; n += kI8Tile) {
    const uint32_t* wt = w + (n / kI8Tile) * K4 * kI8Tile;
    __m512i acc[A][T][J];
    for (int a = 0; a < A; ++a)
      for (int t = 0; t < T; ++t)
        for (int j = 0; j < J; ++j) acc[a][t][j] = _mm512_setzero_si512();
    for (int64_t k4 = 0; k4 < K4; ++k4) {
      const int a = A == 2 ? (int)(k4 & 1) : 0;
      const uint32_t* wk = wt + k4 * kI8Tile;
      __m512i wv[J];
      for (int j = 0; j < J; ++j) wv[j] = _mm512_loadu_si512(wk + 16 * j);
      for (int t = 0; t < T; ++t) {
        const __m512i xv = _mm512_set1_epi32((int)xq[t * K4 + k4]);
        for (int j = 0; j < J; ++j) acc[a][t][j] = _mm512_dpbusd_epi32(acc[a][t][j], wv[j], xv);
      }
    }
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < J; ++j) {
        const int64_t c = n + 16 * j;
        if (c >= n1) break;
        __m512i v = acc[0][t][j];
        if (A == 2) v = _mm512_add_epi32(v, acc[A - 1][t][j]);
        v = _mm512_sub_epi32(v, _mm512_set1_epi32(corr[t]));
        const __mmask16 m = n1 - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n1 - c)) - 1u);
        const __m512 s = _mm512_maskz_loadu_ps(m, scales + c);
        const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(v), _mm512_set1_ps(sx[t]));
        _mm512_mask_storeu_ps(y + t * N + c, m, _mm512_mul_ps(f, s));
      }
  }
}
#else
constexpr bool kHaveI8 = false;
template <int T>
void i8_block(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t) {}
#endif

// ---------------------------------------------------------------- GGUF blocks x int8 rows (AVX512-VNNI)
// The target's Q4_1 / Q8_0 blocks regrouped for int8 rows of x, as llama.cpp multiplies them (its
// Q8_1 rows): each 32-value block of a row of x is rounded to int8 with its own scale (qx_quantize),
// and vpdpbusd sums a block's 32 products of 4-bit (Q4_1) or biased 8-bit (Q8_0: u = q + 128)
// weights with them exactly in int32, for 16 output columns at once; the sums are scaled per block in
// float32. A weight is d u + m (Q4_1: the block's d, m; Q8_0: d, -128 d), so a block adds
// d sx sum(u qx) + m sx sum(qx) to its column. Per 16 columns and block, 320 (Q4_1) or 576 (Q8_0)
// bytes: kQxQuads(Q4) x 64 bytes of weights, then float16 d[16], m[16]; vector j's lane i holds
// the weights of column i that meet bytes 4j .. 4j + 3 of the block of x (Q4_1: the low nibbles of
// vector p pair with x bytes 8p .. 8p + 3, the high ones with 8p + 4 .. 8p + 7). A row's sums
// depend on its own x only and run in one fixed order, whatever rows share the call.

#ifdef __AVX512VNNI__
constexpr bool kHaveQx = true;
// M rows of x [M, K] (K % 32 == 0) → M rows of qx_row_bytes(K): per block of 32, sx = max |x| / 127,
// q = x * (127 / max |x|) rounded to nearest even (0 for a zero block), ms = sx * sum(q), then sum(q).
inline void qx_quantize(const float* x, int64_t M, int64_t K, uint8_t* out) {
  const int64_t nb = K / 32;
  for (int64_t t = 0; t < M; ++t) {
    uint8_t* row = out + t * qx_row_bytes(K);
    float* sx = reinterpret_cast<float*>(row + K);
    for (int64_t b = 0; b < nb; ++b) {
      const __m512 lo = _mm512_loadu_ps(x + t * K + 32 * b), hi = _mm512_loadu_ps(x + t * K + 32 * b + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(row + 32 * b), _mm512_cvtepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(row + 32 * b + 16), _mm512_cvtepi32_epi8(qhi));
      sx[b] = amax / 127.0f;
      const int32_t qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
      sx[nb + b] = sx[b] * (float)qsum;
      reinterpret_cast<int32_t*>(sx + 2 * nb)[b] = qsum;
    }
  }
}

// T quantised rows (qx_quantize's layout, passed as x) against the 16-column groups of [n0, n1).
template <bool Q4, int T>
void qx_block(const float* xq_as_float, const float* w_as_float, const float*, float* y, int64_t K, int64_t N,
              int64_t n0, int64_t n1) {
  const uint8_t* xq = reinterpret_cast<const uint8_t*>(xq_as_float);  // BlockFn's signature; really bytes
  const uint8_t* w = reinterpret_cast<const uint8_t*>(w_as_float);
  constexpr int64_t GB = qx_group_bytes(Q4), WB = GB - 64;
  const int64_t nb = K / 32, stride = qx_row_bytes(K);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; n += kQxCols) {
    const uint8_t* wg = w + (n / kQxCols) * nb * GB;
    Ahead ahead = prefetch_ahead(w, nullptr, n, n0, n1, kQxCols, nb * GB / kQxCols, 0, nb);
    __m512 acc[T];
    for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* wb = wg + b * GB;
      ahead.part();
      __m512i wv[8];
      if (Q4) {
        for (int p = 0; p < 4; ++p) {
          const __m512i v = _mm512_loadu_si512(wb + 64 * p);
          wv[2 * p] = _mm512_and_si512(v, low4);
          wv[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        }
      } else {
        for (int j = 0; j < 8; ++j) wv[j] = _mm512_loadu_si512(wb + 64 * j);
      }
      const __m512i sc = _mm512_loadu_si512(wb + WB);
      const __m512 d = _mm512_cvtph_ps(_mm512_castsi512_si256(sc));
      const __m512 m = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(sc, 1));
      for (int t = 0; t < T; ++t) {
        const uint8_t* xr = xq + t * stride;
        const int32_t* xb = reinterpret_cast<const int32_t*>(xr + 32 * b);
        const float* xs = reinterpret_cast<const float*>(xr + K);
        __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[0], _mm512_set1_epi32(xb[0]));
        __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[1], _mm512_set1_epi32(xb[1]));
        for (int j = 2; j < 8; j += 2) {
          s0 = _mm512_dpbusd_epi32(s0, wv[j], _mm512_set1_epi32(xb[j]));
          s1 = _mm512_dpbusd_epi32(s1, wv[j + 1], _mm512_set1_epi32(xb[j + 1]));
        }
        const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
        acc[t] = _mm512_fmadd_ps(sum, _mm512_mul_ps(d, _mm512_set1_ps(xs[b])), acc[t]);
        acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[nb + b]), acc[t]);
      }
    }
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(y + t * N + n, acc[t]);
  }
}
#else
constexpr bool kHaveQx = false;
inline void qx_quantize(const float*, int64_t, int64_t, uint8_t*) {}
template <bool Q4, int T>
void qx_block(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t) {}
#endif

// Quantized rows: up to 12 rows of x in one pass over the weights (kQOnePass; R = 1 row of w at a
// time above 8), so a verification pass of 9 to 12 tree tokens decodes each block once. Above 12
// the one-row-of-w passes run out of load bandwidth (every block reloads all T rows of x), and two
// balanced passes of at most 8 rows (R = 2) are faster: measured for 60 [T, 576] x [576, 1536]
// Q4_1 products on the EPYC VM, 9 rows 7.4 ms in one pass against 8.9 as 8 + 1, 12 rows 9.4
// against 9.9 as 8 + 4, 16 rows 16.2 in one pass against 12.4 as 8 + 8.
constexpr int64_t kQOnePass = 12;
