// AVX2 block kernels of cpu_matmul.cc (with FMA and F16C), included there when the compiler does
// not target AVX-512 (AMD Zen 1-3, Intel Haswell to Comet Lake), or when EAGLE_JAX_FORCE_AVX2 is
// defined (to test this path on an AVX-512 machine).
//
// The same kernels as cpu_matmul_avx512.h on 8-float vectors and 16 vector registers: fewer rows
// of w per pass, and a block of 32 quantized weights is dequantised into four vectors. Every
// output is still summed in one fixed order whatever M is: nk, f16 and the quantized kinds add
// the 8-float vectors of k alternately into two accumulators (lane l of the first sums k = l,
// l + 16, l + 32, ..., of the second k = l + 8, l + 24, ...), then the two, then the lanes (so a
// quantized product is bit for bit the float32 nk kernel's on the dequantised weights); kn adds
// k in ascending order per column.
#pragma once

// Rows of w nk_block / h16_block take a pass for t rows of x (2 x T x R accumulators, R weight
// vectors and one x vector within 16 registers), and rows of w kn_block streams at once (one
// row a time would load and store y for every fused multiply-add).
constexpr int kRowsW(int t) { return t == 1 ? 4 : t <= 3 ? 2 : 1; }
constexpr int kKnRowsW(int t) { return t <= 2 ? 4 : 2; }

// Up to 8 rows of x in one pass over quantized weights; more rows take balanced passes of at most
// 8 (row_group). Beyond 8 rows the 2 x T accumulators no longer fit the registers: measured for
// 60 [T, 576] x [576, 1536] Q4_1 products on the 2-core AMD EPYC (Zen 1) VM, 10 rows 31.8 ms in
// one pass against about 25 as 5 + 5.
constexpr int64_t kQOnePass = 8;

// (hsum, the sum of a vector's lanes: cpu_simd_avx2.h, included by cpu_matmul.cc.)

// Lanes [0, r) of an 8-float vector, for masked loads and stores.
inline __m256i lanes_below(int64_t r) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)r), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// ---------------------------------------------------------------- kn: y = x @ w, w [K, N]
// y[t, n0:n1] lives in L1; KB rows of w are streamed at a time, each contiguous.
template <int T, int KB>
void kn_block(const float* x, const float* w, const float*, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t width = n1 - n0;
  const int64_t vec_end = n0 + (width / 8) * 8;
  const __m256i tail = lanes_below(width % 8);
  for (int64_t t = 0; t < T; ++t) std::fill(y + t * N + n0, y + t * N + n1, 0.0f);
  int64_t k = 0;
  for (; k + KB <= K; k += KB) {
    __m256 bx[T][KB];
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < KB; ++j) bx[t][j] = _mm256_set1_ps(x[t * K + k + j]);
    const float* wk = w + k * N;
    int64_t n = n0;
    for (; n < vec_end; n += 8) {
      __m256 wv[KB];
      for (int j = 0; j < KB; ++j) wv[j] = _mm256_loadu_ps(wk + j * N + n);
      for (int t = 0; t < T; ++t) {
        __m256 acc = _mm256_loadu_ps(y + t * N + n);
        for (int j = 0; j < KB; ++j) acc = _mm256_fmadd_ps(bx[t][j], wv[j], acc);
        _mm256_storeu_ps(y + t * N + n, acc);
      }
    }
    if (n < n1) {
      __m256 wv[KB];
      for (int j = 0; j < KB; ++j) wv[j] = _mm256_maskload_ps(wk + j * N + n, tail);
      for (int t = 0; t < T; ++t) {
        __m256 acc = _mm256_maskload_ps(y + t * N + n, tail);
        for (int j = 0; j < KB; ++j) acc = _mm256_fmadd_ps(bx[t][j], wv[j], acc);
        _mm256_maskstore_ps(y + t * N + n, tail, acc);
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
// R rows of w at a time against all T rows of x. Two accumulators per output take the 8-float
// vectors of k in turn (vector v into accumulator v % 2), so each row's sum is two dependency
// chains, not one (a fused multiply-add's latency, not the load of the weights, bounded one-row
// products); the two are added, then the 8 lanes, at the end.
template <int T, int R>
void nk_block(const float* x, const float* w, const float*, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t kvec = (K / 8) * 8;
  const __m256i tail = lanes_below(K % 8);
  for (int64_t n = n0; n < n1; n += R) {
    const int rows = (int)std::min<int64_t>(R, n1 - n);
    const float* wr[R];  // rows past the chunk's end repeat its last row: computed, never stored
    for (int r = 0; r < R; ++r) wr[r] = w + (n + std::min(r, rows - 1)) * K;
    __m256 acc[2][T][R];
    for (int j = 0; j < 2; ++j)
      for (int t = 0; t < T; ++t)
        for (int r = 0; r < R; ++r) acc[j][t][r] = _mm256_setzero_ps();
    auto step = [&](int64_t k, int j) {  // the full vector at k into accumulators j
      __m256 wv[R];
      for (int r = 0; r < R; ++r) wv[r] = _mm256_loadu_ps(wr[r] + k);
      for (int t = 0; t < T; ++t) {
        const __m256 xv = _mm256_loadu_ps(x + t * K + k);
        for (int r = 0; r < R; ++r) acc[j][t][r] = _mm256_fmadd_ps(xv, wv[r], acc[j][t][r]);
      }
    };
    int64_t k = 0;
    for (; k + 16 <= kvec; k += 16) {
      step(k, 0);
      step(k + 8, 1);
    }
    int j = 0;
    if (k < kvec) {
      step(k, 0);
      j = 1;
    }
    if (kvec < K) {  // the masked last vector, into the accumulators whose turn it is
      __m256 wv[R];
      for (int r = 0; r < R; ++r) wv[r] = _mm256_maskload_ps(wr[r] + kvec, tail);
      for (int t = 0; t < T; ++t) {
        const __m256 xv = _mm256_maskload_ps(x + t * K + kvec, tail);
        for (int r = 0; r < R; ++r) acc[j][t][r] = _mm256_fmadd_ps(xv, wv[r], acc[j][t][r]);
      }
    }
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < rows; ++r) y[t * N + n + r] = hsum(_mm256_add_ps(acc[0][t][r], acc[1][t][r]));
  }
}

// ---------------------------------------------------------------- float16 nk: w [N, K] float16
// The float32 nk kernel on weights widened exactly (vcvtph2ps, F16C), in the same order of sums
// (K % 16 == 0: vectors alternate between the two accumulators).
template <int T, int R>
void h16_block(const float* x, const float* w_as_float, const float*, float* y, int64_t K, int64_t N, int64_t n0,
               int64_t n1) {
  const uint16_t* w = reinterpret_cast<const uint16_t*>(w_as_float);  // BlockFn's signature; really halves
  for (int64_t n = n0; n < n1; n += R) {
    const int rows = (int)std::min<int64_t>(R, n1 - n);
    const uint16_t* wr[R];
    for (int r = 0; r < R; ++r) wr[r] = w + (n + std::min(r, rows - 1)) * K;
    __m256 acc[2][T][R];
    for (int j = 0; j < 2; ++j)
      for (int t = 0; t < T; ++t)
        for (int r = 0; r < R; ++r) acc[j][t][r] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      for (int j = 0; j < 2; ++j) {
        __m256 wv[R];
        for (int r = 0; r < R; ++r)
          wv[r] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr[r] + k + 8 * j)));
        for (int t = 0; t < T; ++t) {
          const __m256 xv = _mm256_loadu_ps(x + t * K + k + 8 * j);
          for (int r = 0; r < R; ++r) acc[j][t][r] = _mm256_fmadd_ps(xv, wv[r], acc[j][t][r]);
        }
      }
    }
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < rows; ++r) y[t * N + n + r] = hsum(_mm256_add_ps(acc[0][t][r], acc[1][t][r]));
  }
}

// ---------------------------------------------------------------- quantized nk: GGUF Q4_1 / Q8_0 rows
// A block's 32 weights as four vectors (k = 0-7, 8-15, 16-23, 24-31), exactly gguf's numpy values:
// Q4_1 (d * q) + m by one fused multiply-add (d * q is exact in float32), Q8_0 q * d.
inline void q41_block(const uint8_t* blk, const float* sc, __m256 (&v)[4]) {
  const __m256 d = _mm256_set1_ps(sc[0]), m = _mm256_set1_ps(sc[1]);
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(q, mask), hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
  v[0] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), m);
  v[1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), m);
  v[2] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), m);
  v[3] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), m);
}

inline void q80_block(const uint8_t* blk, const float* sc, __m256 (&v)[4]) {
  const __m256 d = _mm256_set1_ps(sc[0]);
  for (int i = 0; i < 4; ++i)
    v[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
               _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * i)))), d);
}

// T rows of x (up to kQOnePass) against R rows of w per pass: each block is dequantised once per
// call, and its four vectors go to the two accumulators in turn (as in nk_block, so a product is
// the float32 nk kernel's on the dequantised weights, bit for bit). One row of w at a time streams
// best (measured on the Zen 1 VM, 4 rows 10.8 ms against 15.6 for two rows of w a pass), except
// for one row of x, where a second row of w gives more independent chains.
template <bool Q4, int T>
void q_block(const float* x, const float* w_as_float, const float* scales, float* y, int64_t K, int64_t N,
             int64_t n0, int64_t n1) {
  const uint8_t* w = reinterpret_cast<const uint8_t*>(w_as_float);  // BlockFn's signature; really bytes
  constexpr int R = T == 1 ? 2 : 1;
  constexpr int64_t B = Q4 ? kQ41Bytes : kQ80Bytes;
  constexpr int64_t S = Q4 ? 2 : 1;  // float32 scales per block: (d, m) or d
  const int64_t nb = K / 32, row_bytes = nb * B;
  for (int64_t n = n0; n < n1; n += R) {
    const int rows = (int)std::min<int64_t>(R, n1 - n);
    __m256 acc[2][T][R];
    for (int j = 0; j < 2; ++j)
      for (int t = 0; t < T; ++t)
        for (int r = 0; r < R; ++r) acc[j][t][r] = _mm256_setzero_ps();
    const uint8_t* wn = w + n * row_bytes;
    const float* sn = scales + n * nb * S;
    Ahead ahead = prefetch_ahead(w, scales, n, n0, n1, R, row_bytes, nb * S, nb);
    for (int64_t b = 0; b < nb; ++b) {
      ahead.part();
      for (int r = 0; r < R; ++r) {
        if (r >= rows) break;
        __m256 v[4];
        if (Q4) q41_block(wn + r * row_bytes + b * B, sn + (r * nb + b) * S, v);
        else q80_block(wn + r * row_bytes + b * B, sn + (r * nb + b) * S, v);
        for (int t = 0; t < T; ++t)
          for (int i = 0; i < 4; ++i)
            acc[i & 1][t][r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + t * K + 32 * b + 8 * i), v[i], acc[i & 1][t][r]);
      }
    }
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < rows; ++r) y[t * N + n + r] = hsum(_mm256_add_ps(acc[0][t][r], acc[1][t][r]));
  }
}

// ---------------------------------------------------------------- bfloat16 tiles: AVX512-BF16 only
constexpr bool kHaveB16 = false;
template <int T>
void b16_block(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t) {}
constexpr bool kHaveI8 = false;  // int8 tiles need AVX512-VNNI (qx below serves AVX2)
template <int T>
void i8_block(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t) {}

// ---------------------------------------------------------------- GGUF blocks x int8 rows (AVX2)
// The AVX-512 header's qx kernels on a group's 16 columns as two halves of 8, with the same layout,
// the same integers and the same float32 operations in the same order, so the results are bit for
// bit the AVX512-VNNI kernel's. Without vpdpbusd, vpmaddubsw multiplies unsigned by signed bytes and
// adds pairs into int16 (saturating), and vpmaddwd by ones adds pairs of those into int32. Q4_1:
// nibbles (0-15) times int8 rows (|q| <= 127) make pairs of at most 3810, and the 8 vectors of a
// block are summed in int16 (at most 30480) before one vpmaddwd: exact. Q8_0's biased bytes
// (u = q + 128, up to 255) would saturate, so the kernel multiplies |q| by x carrying q's sign
// (vpsignb; pairs at most 2 x 128 x 127 = 32512), widens every vector to int32, and adds back the
// bias as 128 sum(x) (qx_quantize's integer sum): sum(u x) = sum(q x) + 128 sum(x), exactly.
constexpr bool kHaveQx = true;

inline void qx_quantize(const float* x, int64_t M, int64_t K, uint8_t* out) {
  const int64_t nb = K / 32;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t t = 0; t < M; ++t) {
    uint8_t* row = out + t * qx_row_bytes(K);
    float* sx = reinterpret_cast<float*>(row + K);
    int32_t* qs = reinterpret_cast<int32_t*>(sx + 2 * nb);
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + t * K + 32 * b;
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(xb + 8 * i);
      __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
      const __m256 inv = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // to nearest even
      const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + 32 * b), _mm256_permutevar8x32_epi32(p, order));
      const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      const int32_t qsum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
      sx[b] = amax / 127.0f;
      sx[nb + b] = sx[b] * (float)qsum;
      qs[b] = qsum;
    }
  }
}

// T quantised rows (qx_quantize's layout, passed as x) against the 16-column groups of [n0, n1): both
// 8-column halves of a group in one pass over its block, so each broadcast of 4 bytes of x feeds both
// halves' products (Zen 3 issues a broadcast from memory on a vector pipe, which these products are
// bound by). The integer sums are exact in any order (above), and each output's float32 operations
// are the same, in the same order, as when the halves took a pass each (before stop 58), so the
// results are bit for bit the same. Measured on the Zen 3 VM (one thread, [T, 576] x [576, 1536]
// products from memory, a standalone harness), against a pass per half: Q4_1 5%, 4%, 11%, 11%
// faster for 1 to 4 rows, Q8_0 5%, 17%, 14%, 19%.
//
// GCC 12 reassociates the int16 sums of a Q4_1 block (exact, so it may): for 2-5 rows it moved every
// vpmaddubsw ahead of the adds, and their 48-80 products went through the stack (42-94 ymm spills
// and reloads a block, `g++ -S`). An empty asm statement on the sums after each 4 bytes of x keeps
// them in order. Measured on a Zen 4 VM with AVX-512 hidden (stop 63; one thread,
// 200 [T, 576] x [576, 1536] Q4_1 products from memory, a standalone harness), in µs a product:
// T = 2: 31.6 -> 30.0, 3: 46.3 -> 38.6, 4: 57.1 -> 50.6, 5: 72.4 -> 60.3. With one row, and with
// 6-8, the reassociated code was as fast or faster (24.0 against 24.9, 82 against 86 for 8), and
// the same statement on Q8_0's int32 sums made them 7-15% slower; those are left to the compiler.
template <bool Q4, int T>
void qx_block(const float* xq_as_float, const float* w_as_float, const float*, float* y, int64_t K, int64_t N,
              int64_t n0, int64_t n1) {
  const uint8_t* xq = reinterpret_cast<const uint8_t*>(xq_as_float);  // BlockFn's signature; really bytes
  const uint8_t* w = reinterpret_cast<const uint8_t*>(w_as_float);
  constexpr int64_t GB = qx_group_bytes(Q4), WB = GB - 64;
  const int64_t nb = K / 32, stride = qx_row_bytes(K);
  const __m256i low4 = _mm256_set1_epi8(0x0F), bias = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
  for (int64_t n = n0; n < n1; n += kQxCols) {
    const uint8_t* wg = w + (n / kQxCols) * nb * GB;
    Ahead ahead = prefetch_ahead(w, nullptr, n, n0, n1, kQxCols, nb * GB / kQxCols, 0, nb);
    __m256 acc[T][2];
    for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* wb = wg + b * GB;
      ahead.part();
      __m256i isum[T][2];  // [row][half]: the block's integer dot products, 8 columns a vector
      if constexpr (Q4) {
        __m256i s16[T][2];  // the 8 products of 4 bytes, summed in int16
        for (int p = 0; p < 4; ++p) {  // 64 bytes: half 0's, then half 1's nibbles of vectors 2p and 2p + 1
          const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * p));
          const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * p + 32));
          const __m256i w00 = _mm256_and_si256(v0, low4), w01 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low4);
          const __m256i w10 = _mm256_and_si256(v1, low4), w11 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low4);
          for (int t = 0; t < T; ++t) {
            const int32_t* xb = reinterpret_cast<const int32_t*>(xq + t * stride + 32 * b);
            const __m256i b0 = _mm256_set1_epi32(xb[2 * p]), b1 = _mm256_set1_epi32(xb[2 * p + 1]);
            const __m256i a0 = _mm256_add_epi16(_mm256_maddubs_epi16(w00, b0), _mm256_maddubs_epi16(w01, b1));
            const __m256i a1 = _mm256_add_epi16(_mm256_maddubs_epi16(w10, b0), _mm256_maddubs_epi16(w11, b1));
            s16[t][0] = p ? _mm256_add_epi16(s16[t][0], a0) : a0;
            s16[t][1] = p ? _mm256_add_epi16(s16[t][1], a1) : a1;
            if constexpr (T >= 2 && T <= 5) asm("" : "+x"(s16[t][0]), "+x"(s16[t][1]));  // in order (above)
          }
        }
        for (int t = 0; t < T; ++t)
          for (int h = 0; h < 2; ++h) isum[t][h] = _mm256_madd_epi16(s16[t][h], ones);
      } else {
        __m256i s32[T][2][2];  // [row][half][even / odd vector]: |q| times x carrying q's sign, in int32
        for (int j = 0; j < 8; ++j) {
          const __m256i q0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * j)), bias);
          const __m256i q1 =
              _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 64 * j + 32)), bias);
          const __m256i a0 = _mm256_abs_epi8(q0), a1 = _mm256_abs_epi8(q1);
          for (int t = 0; t < T; ++t) {
            const int32_t* xb = reinterpret_cast<const int32_t*>(xq + t * stride + 32 * b);
            const __m256i bx = _mm256_set1_epi32(xb[j]);
            const __m256i p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(bx, q0)), ones);
            const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(bx, q1)), ones);
            s32[t][0][j & 1] = j < 2 ? p0 : _mm256_add_epi32(s32[t][0][j & 1], p0);
            s32[t][1][j & 1] = j < 2 ? p1 : _mm256_add_epi32(s32[t][1][j & 1], p1);
          }
        }
        for (int t = 0; t < T; ++t) {
          const int32_t* qs = reinterpret_cast<const int32_t*>(xq + t * stride + K) + 2 * nb;  // 128 sum(x)
          for (int h = 0; h < 2; ++h)
            isum[t][h] = _mm256_add_epi32(_mm256_add_epi32(s32[t][h][0], s32[t][h][1]), _mm256_set1_epi32(128 * qs[b]));
        }
      }
      for (int h = 0; h < 2; ++h) {
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + WB + 16 * h)));
        const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + WB + 32 + 16 * h)));
        for (int t = 0; t < T; ++t) {
          const float* xs = reinterpret_cast<const float*>(xq + t * stride + K);
          const __m256 sum = _mm256_cvtepi32_ps(isum[t][h]);
          acc[t][h] = _mm256_fmadd_ps(sum, _mm256_mul_ps(d, _mm256_set1_ps(xs[b])), acc[t][h]);
          acc[t][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[nb + b]), acc[t][h]);
        }
      }
    }
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + t * N + n + 8 * h, acc[t][h]);
  }
}
