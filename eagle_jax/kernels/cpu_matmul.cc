// Few-row float32 matmuls for decoding on x86-64 CPUs with AVX-512 or AVX2 (an XLA FFI custom call).
// The block kernels are in cpu_matmul_avx512.h and cpu_matmul_avx2.h (one is compiled, by the
// compiler's target); the dispatch over rows and threads below is shared.
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
//   eagle_jax_matmul_i8: y = x @ w with w as int8 quads packed in 64-column tiles, one scale a column
//     (draft heads only: each row of x is rounded to int8 too and AVX512-VNNI's vpdpbusd sums four
//     products a lane and instruction in int32; built where the CPU has AVX512-VNNI)
//   eagle_jax_matmul_q4_1 / _q8_0: the same with w as GGUF Q4_1 / Q8_0 rows (uint8 [N, K/32 * 20|34]),
//     plus their float32 scales, dequantised in registers: a step reads ~120 MiB of SmolLM2's
//     weights instead of 540 MB.
//   eagle_jax_matmul_q4_1x8 / _q8_0x8: those blocks regrouped 16 columns at a time, multiplied by
//     rows of x rounded to int8 a 32-value block (as llama.cpp does; AVX512-VNNI's vpdpbusd, or AVX2's
//     vpmaddubsw and vpmaddwd, sum a block's products exactly in int32, then one float32 multiply-add
//     scales them): kernels/cpu_qx.py.
//
// Every output is summed over k in one fixed order whatever M is and whichever rows share a
// call, so one token's logits do not depend on how many tokens were verified with it.
// Work is split over the columns of y across XLA's intra-op thread pool: each thread streams a
// contiguous range of the chunks and then takes what is left of the others' ranges (Job::work), so
// the calling thread never waits on a task that has not started.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>

#include "xla/ffi/api/ffi.h"

#include "cpu_simd_avx2.h"  // hsum (the AVX2 kernels)

namespace ffi = xla::ffi;

namespace {

// Shared by both instruction sets' kernels and the dispatch below.
constexpr int64_t kQ41Bytes = 20;  // GGUF Q4_1 block: f16 d, f16 m, 16 bytes of nibbles (weights j and j + 16)
constexpr int64_t kQ80Bytes = 34;  // GGUF Q8_0 block: f16 d, 32 int8
constexpr int64_t kB16Tile = 64;   // output columns per packed bfloat16 tile
constexpr int64_t kB16MaxK = 16384;
constexpr int64_t kI8Tile = 64;    // output columns per packed int8 tile
constexpr int64_t kI8MaxK = 16384;
constexpr int64_t kQxCols = 16;  // output columns per group of GGUF blocks regrouped for int8 rows of x
constexpr int64_t qx_group_bytes(bool q4) { return q4 ? 4 * 64 + 64 : 8 * 64 + 64; }  // a group's block
// A row of x rounded for the qx kernels: int8 x[K], then per block of 32 float sx, float ms (sx sum(q))
// and int32 sum(q) (K/32 each; the AVX2 kernels' Q8_0 products need the integer sum).
inline int64_t qx_row_bytes(int64_t K) { return K + 12 * (K / 32); }

// The quantized kernels stream their rows of w (and the rows' float32 scales) from memory, a few
// rows at a time, with little work per byte; left to the hardware prefetchers, a step's 120 MiB of
// SmolLM2 blocks arrive at about 7-8 GB/s a core on the Xeon VM. So each pass asks for the rows of
// the pass kPrefetchPasses ahead, a slice per block of 32 k (prefetch_ahead, Ahead::part), and a
// chunk's first pass for the passes in between at once. Asking for a whole pass at its start
// (before stop 62) gained 33% tokens/s on the Xeon VM against none; spreading the same requests
// over the pass's blocks keeps a few lines in flight all the time, rather than a burst of 90 that
// (we think) fills the core's miss buffers and stalls the arithmetic behind it. Measured on the Zen 3 VM
// (one thread, from memory, [T, 576] x [576, 1536] blocks regrouped for int8 rows, a standalone harness):
// Q4_1 41 -> 33 us for T = 1, 66 -> 49 for T = 3; Q8_0 [T, 576] x [576, 49152] (the tied LM head)
// 2.8 -> 1.8 ms for T = 1, 4.3 -> 3.0 for T = 3.
//
// Whether the kernels ask for lines at all is a switch (eagle_jax_set_prefetch), set at load from a
// measurement on the machine (eagle_jax_time_prefetch; cpu_matmul.py). On the Zen 4 VM (stop 69;
// AVX2 build), with each thread streaming a contiguous range of a product's rows (Job), the
// hardware prefetchers alone were faster: 120 [1, 576] x [576, 1536] Q4_1 products in 1.38 ms
// against 1.54 (one row of x) and 1.90 against 2.36 (three); plain decoding 212 tok/s against 193.
constexpr int64_t kPrefetchPasses = 2;
std::atomic<bool> g_prefetch{true};

// prefetcht0 as a volatile asm statement: a loop of _mm_prefetch calls has no effect the compiler
// must keep, and GCC 12 deletes it once inlined (C++'s forward-progress rule).
inline void prefetch_line(const char* c) { asm volatile("prefetcht0 %0" : : "m"(*c)); }

inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) prefetch_line(c + o);
}

// The weights of the pass kPrefetchPasses ahead, asked for a few cache lines at a time: a kernel
// calls part() once a block of 32 k of its pass (K / 32 times), and each call asks for the next
// lines_per_part lines (at least 1/(K/32) of them, so all are asked for within the pass). No
// division or branch beyond the loop's: the draft head's products run from cache, where the
// requests only cost.
struct Ahead {
  const char* next = nullptr;  // the next line to ask for (none left when next >= end)
  const char* end = nullptr;
  int64_t lines_per_part = 0;
  void part() {
    for (int64_t i = 0; i < lines_per_part && next < end; ++i, next += 64) prefetch_line(next);
  }
};

// Called by a quantized kernel at the start of its pass over rows [n, n + rows_per_pass) of the
// chunk [n0, n1), which takes `parts` blocks. On the chunk's first pass, asks for the passes before
// the one kPrefetchPasses ahead at once; asks for that one's scales (a few lines) at once too, and
// returns its weights, for the pass to ask for a part a block. w: the chunk's matrix (row_bytes a
// row), scales: its float32 scales (scale_floats a row) or null.
inline Ahead prefetch_ahead(const uint8_t* w, const float* scales, int64_t n, int64_t n0, int64_t n1,
                            int64_t rows_per_pass, int64_t row_bytes, int64_t scale_floats, int64_t parts) {
  if (!g_prefetch.load(std::memory_order_relaxed)) return {};
  for (int64_t p = 1; n == n0 && p < kPrefetchPasses; ++p) {
    const int64_t m = n + p * rows_per_pass;
    if (m >= n1) break;
    const int64_t rows = std::min(rows_per_pass, n1 - m);
    prefetch_bytes(w + m * row_bytes, rows * row_bytes);
    if (scales != nullptr) prefetch_bytes(scales + m * scale_floats, rows * scale_floats * 4);
  }
  const int64_t m = n + kPrefetchPasses * rows_per_pass;
  if (m >= n1) return {};
  const int64_t rows = std::min(rows_per_pass, n1 - m);
  if (scales != nullptr) prefetch_bytes(scales + m * scale_floats, rows * scale_floats * 4);
  const uintptr_t first = reinterpret_cast<uintptr_t>(w + m * row_bytes) & ~uintptr_t{63};
  const uintptr_t last = reinterpret_cast<uintptr_t>(w + (m + rows) * row_bytes);  // one past the end
  const int64_t lines = (int64_t)((last - first + 63) / 64);
  return {reinterpret_cast<const char*>(first), reinterpret_cast<const char*>(last), (lines + parts - 1) / parts};
}

// The block kernels: kn_block, nk_block, h16_block, q_block, b16_block, i8_block, kRowsW, kQOnePass,
// kHaveB16, kHaveI8.
#if defined(__AVX512F__) && defined(__AVX512DQ__) && !defined(EAGLE_JAX_FORCE_AVX2)
#include "cpu_matmul_avx512.h"
#else
#include "cpu_matmul_avx2.h"
#endif

// ---------------------------------------------------------------- dispatch over rows and threads
using BlockFn = void (*)(const float*, const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t);

// The <T rows of x, R rows of w a pass> instance of a float block kernel for t rows, R = RFN(t)
// (the ISA header's choice: the accumulators stay in registers).
#define EAGLE_ROWS_FN(NAME, BLOCK, RFN)                                   \
  BlockFn NAME(int t) {                                                   \
    switch (t) {                                                          \
      case 1: return BLOCK<1, RFN(1)>;                                    \
      case 2: return BLOCK<2, RFN(2)>;                                    \
      case 3: return BLOCK<3, RFN(3)>;                                    \
      case 4: return BLOCK<4, RFN(4)>;                                    \
      case 5: return BLOCK<5, RFN(5)>;                                    \
      case 6: return BLOCK<6, RFN(6)>;                                    \
      case 7: return BLOCK<7, RFN(7)>;                                    \
      default: return BLOCK<8, RFN(8)>;                                   \
    }                                                                     \
  }
EAGLE_ROWS_FN(kn_fn, kn_block, kKnRowsW)
EAGLE_ROWS_FN(nk_fn, nk_block, kRowsW)
EAGLE_ROWS_FN(h16_fn, h16_block, kRowsW)

BlockFn b16_fn(int t) {  // at most 4 rows a pass (Job::run_chunk): the T x 4 accumulators fit registers
  switch (t) {
    case 1: return b16_block<1>;
    case 2: return b16_block<2>;
    case 3: return b16_block<3>;
    default: return b16_block<4>;
  }
}

BlockFn i8_fn(int t) {  // at most 4 rows a pass, as b16
  switch (t) {
    case 1: return i8_block<1>;
    case 2: return i8_block<2>;
    case 3: return i8_block<3>;
    default: return i8_block<4>;
  }
}

// The <Q4, T rows of x> instance of a quantized block kernel (T <= 12: kQOnePass).
#define EAGLE_Q_ROWS_FN(NAME, BLOCK)          \
  template <bool Q4>                          \
  BlockFn NAME(int t) {                       \
    switch (t) {                              \
      case 1: return BLOCK<Q4, 1>;            \
      case 2: return BLOCK<Q4, 2>;            \
      case 3: return BLOCK<Q4, 3>;            \
      case 4: return BLOCK<Q4, 4>;            \
      case 5: return BLOCK<Q4, 5>;            \
      case 6: return BLOCK<Q4, 6>;            \
      case 7: return BLOCK<Q4, 7>;            \
      case 8: return BLOCK<Q4, 8>;            \
      case 9: return BLOCK<Q4, 9>;            \
      case 10: return BLOCK<Q4, 10>;          \
      case 11: return BLOCK<Q4, 11>;          \
      default: return BLOCK<Q4, 12>;          \
    }                                         \
  }
EAGLE_Q_ROWS_FN(q_fn, q_block)
EAGLE_Q_ROWS_FN(qx_fn, qx_block)

// Rows of x per pass over the weights for M rows.
inline int64_t row_group(int64_t M, bool tiles, bool quantized) {
  if (tiles) return 4;  // b16 / i8
  if (!quantized) return 8;
  if (M <= kQOnePass) return M;
  const int64_t passes = (M + 7) / 8;
  return (M + passes - 1) / passes;  // balanced: 13-16 rows as two passes of 7 or 8
}

enum class Kind { kKN, kNK, kQ41, kQ80, kH16, kB16, kI8, kQX41, kQX80 };

inline bool is_qx(Kind k) { return k == Kind::kQX41 || k == Kind::kQX80; }

struct Job {
  const float* x;
  std::unique_ptr<uint8_t[]> xq;  // qx kinds: the rows of x rounded to int8 once (qx_quantize), shared by all chunks
  const void* w;
  const float* scales;
  float* y;
  int64_t M, K, N, chunk, chunks;
  Kind kind;
  std::atomic<int64_t> done{0};

  void run_chunk(int64_t c) {
    const int64_t n0 = c * chunk, n1 = std::min(N, n0 + chunk);
    const int64_t group = row_group(M, kind == Kind::kB16 || kind == Kind::kI8,
                                    kind == Kind::kQ41 || kind == Kind::kQ80 || is_qx(kind));
    for (int64_t m0 = 0; m0 < M; m0 += group) {
      const int t = (int)std::min<int64_t>(group, M - m0);
      BlockFn f = kind == Kind::kKN ? kn_fn(t) : kind == Kind::kNK ? nk_fn(t) : kind == Kind::kH16 ? h16_fn(t)
                : kind == Kind::kB16 ? b16_fn(t) : kind == Kind::kI8 ? i8_fn(t)
                : kind == Kind::kQ41 ? q_fn<true>(t) : kind == Kind::kQ80 ? q_fn<false>(t)
                : kind == Kind::kQX41 ? qx_fn<true>(t) : qx_fn<false>(t);
      const float* xs = is_qx(kind) ? reinterpret_cast<const float*>(xq.get() + m0 * qx_row_bytes(K)) : x + m0 * K;
      f(xs, static_cast<const float*>(w), scales, y + m0 * N, K, N, n0, n1);
    }
  }
  // Each worker (the caller and the pool tasks it schedules) owns a contiguous range of the chunks,
  // [lo, hi) in one word (lo in the low 32 bits), and takes them in order from its front; then it
  // takes what is left of the others' ranges from their backs (a helper that starts late finds its
  // range shortened). So each thread streams one run of consecutive rows of w, which the hardware
  // prefetchers follow; chunks claimed in turns from one counter (before stop 69) gave each thread
  // every other chunk, and streams broken every 34 KB. Measured on the Zen 4 VM (stop 69), 120
  // sequential [1, 576] x [576, 1536] Q4_1 products, two threads: 1.44 ms against 1.94 (without
  // software prefetches) and 2.34 (with), and 1.57 with the helper starting 2 us late.
  std::unique_ptr<std::atomic<uint64_t>[]> ranges;
  int64_t workers = 1;
  std::atomic<int64_t> joined{1};  // the caller is worker 0; pool tasks number themselves
  void init_ranges(int64_t p) {
    workers = p;
    ranges.reset(new std::atomic<uint64_t>[p]);
    for (int64_t i = 0; i < p; ++i) {
      const uint64_t lo = chunks * i / p, hi = chunks * (i + 1) / p;
      ranges[i].store(lo | (hi << 32), std::memory_order_relaxed);
    }
  }
  int64_t claim(int64_t i, bool front) {
    uint64_t v = ranges[i].load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t lo = v & 0xffffffffu, hi = v >> 32;
      if (lo >= hi) return -1;
      const uint64_t nv = front ? (lo + 1) | (hi << 32) : lo | ((hi - 1) << 32);
      if (ranges[i].compare_exchange_weak(v, nv, std::memory_order_acq_rel))
        return front ? (int64_t)lo : (int64_t)hi - 1;
    }
  }
  void work(bool helper = false) {
    const int64_t me = helper ? joined.fetch_add(1) : 0;
    if (me >= workers) return;
    for (int64_t k = 0; k < workers; ++k)  // its own range from the front, then the others' from the back
      for (int64_t c; (c = claim((me + k) % workers, k == 0)) >= 0;) {
        run_chunk(c);
        done.fetch_add(1, std::memory_order_release);
      }
  }
};

// y[M, N] with N split into chunks, taken by the caller and pool tasks (Job::work).
void Run(ffi::ThreadPool& pool, const float* x, const void* w, const float* scales, float* y, int64_t M, int64_t K,
         int64_t N, Kind kind) {
  auto job = std::make_shared<Job>();
  job->x = x; job->w = w; job->scales = scales; job->y = y;
  job->M = M; job->K = K; job->N = N; job->kind = kind;
  if (is_qx(kind)) {  // once, before any chunk: every chunk reads the same int8 rows
    job->xq.reset(new uint8_t[M * qx_row_bytes(K)]);
    qx_quantize(x, M, K, job->xq.get());
  }
  static const int64_t max_threads = [] {
    const char* v = std::getenv("EAGLE_JAX_CPU_KERNEL_THREADS");
    return v && *v ? std::max<int64_t>(1, std::atoll(v)) : INT64_MAX;
  }();
  const int64_t threads = std::min(max_threads, std::max<int64_t>(1, pool.num_threads()));
  const bool tiles = kind == Kind::kB16 || kind == Kind::kI8;  // kB16Tile == kI8Tile
  const int64_t align = kind == Kind::kKN ? 16 : tiles ? kB16Tile : is_qx(kind) ? kQxCols : 4;
  // Row-wise kinds (nk, quantized) take many small chunks: a helper thread that wakes late finds
  // little left to do, and the caller never waits for more than one chunk after its own. kn
  // streams every row of w across its chunk's columns, so its chunks stay wide.
  const int64_t chunks = threads == 1 ? 1
      : kind == Kind::kKN ? std::min<int64_t>(2 * threads, std::max<int64_t>(1, N / 256))
      : tiles ? std::min<int64_t>(8 * threads, (N + kB16Tile - 1) / kB16Tile)
                          : std::min<int64_t>(8 * threads, std::max<int64_t>(1, N / 64));
  int64_t chunk = (N + chunks - 1) / chunks;
  chunk = (chunk + align - 1) / align * align;
  job->chunk = chunk;
  job->chunks = (N + chunk - 1) / chunk;
  const int64_t workers = std::min(threads, job->chunks);
  job->init_ranges(workers);
  for (int64_t i = 1; i < workers; ++i) pool.Schedule([job] { job->work(true); });
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

ffi::Error I8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U32> w, ffi::Buffer<ffi::F32> sc,
                    ffi::ResultBuffer<ffi::F32> y) {
  if (!kHaveI8) return ffi::Error::Internal("built without AVX512-VNNI: eagle_jax_matmul_i8 is unavailable");
  auto xd = x.dimensions(), wd = w.dimensions(), sd = sc.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 3 || sd.size() != 1 || yd.size() != 2)
    return ffi::Error::InvalidArgument("x [M, K], w [tiles, K/4, 64], scales [N]");
  const int64_t M = xd[0], K = xd[1], N = yd[1];
  if (K % 16 || K > kI8MaxK || wd[1] != K / 4 || wd[2] != kI8Tile || wd[0] != (N + kI8Tile - 1) / kI8Tile
      || sd[0] != N)
    return ffi::Error::InvalidArgument("int8 tiles do not fit x and y (K % 16 == 0, K <= 16384, N scales)");
  Run(pool, x.typed_data(), w.untyped_data(), sc.typed_data(), y->typed_data(), M, K, N, Kind::kI8);
  return ffi::Error::Success();
}

ffi::Error XMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, ffi::ResultBuffer<ffi::F32> y,
                   bool q4) {
  if (!kHaveQx)
    return ffi::Error::Internal("built without AVX512-VNNI or AVX2: the int8-row GGUF kernels are unavailable");
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2) return ffi::Error::InvalidArgument("x, w and y must be 2-D");
  const int64_t M = xd[0], K = xd[1], N = yd[1];
  if (K % 32 || N % kQxCols || wd[0] != N / kQxCols || wd[1] != K / 32 * qx_group_bytes(q4))
    return ffi::Error::InvalidArgument("regrouped blocks must be [N / 16, K / 32 * group bytes] (K % 32 == 0)");
  Run(pool, x.typed_data(), w.untyped_data(), nullptr, y->typed_data(), M, K, N, q4 ? Kind::kQX41 : Kind::kQX80);
  return ffi::Error::Success();
}

}  // namespace

#include "cpu_matmul_prefetch.h"  // eagle_jax_set_prefetch, eagle_jax_time_prefetch

extern "C" int eagle_jax_has_qx() { return kHaveQx ? 1 : 0; }
extern "C" int eagle_jax_has_b16() { return kHaveB16 ? 1 : 0; }
extern "C" int eagle_jax_has_i8() { return kHaveI8 ? 1 : 0; }

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
XLA_FFI_DEFINE_HANDLER_SYMBOL(EagleMatmulI8, I8Matmul,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
#define EAGLE_QX_HANDLER(NAME, Q4)                                                                     \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(NAME, [](ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w, \
                                         ffi::ResultBuffer<ffi::F32> y) { return XMatmul(pool, x, w, y, Q4); },   \
                                ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()           \
                                    .Arg<ffi::Buffer<ffi::U8>>().Ret<ffi::Buffer<ffi::F32>>())
EAGLE_QX_HANDLER(EagleMatmulQX41, true);
EAGLE_QX_HANDLER(EagleMatmulQX80, false);
XLA_FFI_DEFINE_HANDLER_SYMBOL(EagleMatmulF16, HMatmul,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F16>>().Ret<ffi::Buffer<ffi::F32>>());
