// The software-prefetch switch of cpu_matmul.cc's quantized kernels and the measurement that sets it
// (included at the end of cpu_matmul.cc, inside its anonymous namespace's reach).
//
// Asking for the weights ahead of the arithmetic (Ahead, prefetch_ahead) was measured to pay on the
// Xeon VM (stop 52: +33% tokens/s) and in a one-thread harness on the Zen 3 VM (stop 62); on the Zen
// 4 VM (stop 69) the hardware prefetchers alone streamed faster, once each thread read one contiguous
// range of a product's rows (Job). So cpu_matmul.py measures both on the machine, once, and keeps
// the faster (a file beside the built library), unless EAGLE_JAX_CPU_PREFETCH says which. The switch
// changes when lines are asked for, never what is computed: outputs are bit for bit the same.
#pragma once

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

extern "C" void eagle_jax_set_prefetch(int on) { g_prefetch.store(on != 0, std::memory_order_relaxed); }
extern "C" int eagle_jax_prefetch() { return g_prefetch.load(std::memory_order_relaxed) ? 1 : 0; }

// Milliseconds for `products` sequential one-row products [1, 576] x [576, 1536] of int8 rows by
// distinct Q4_1 blocks (120 products: 66 MB, more than most L3 caches hold, as a decoding step's
// layers), each split over `workers` threads in contiguous ranges as Run splits them, with the
// prefetches off (out[0]) and on (out[1]): the best of `reps` sweeps each, in turns. The helper
// threads spin between products, as a decoding step keeps the pool's threads busy. Returns 0, or -1
// where the build has no int8-row kernels (the switch then stays as it is). Leaves the switch on.
// A wait's turn: a pause, and after a while a yield (other processes may be measuring at the same
// time, as pytest's workers do: spinning threads beyond the cores would wait out whole time slices).
inline void spin(int spins) {
  if (spins < 4096) _mm_pause();
  else std::this_thread::yield();
}

extern "C" int eagle_jax_time_prefetch(int64_t products, int64_t workers, int64_t reps, double* out) {
  if (!kHaveQx || products < 1 || reps < 1) return -1;
  constexpr int64_t K = 576, N = 1536, G = qx_group_bytes(true);
  const int64_t groups = N / kQxCols, bytes = groups * (K / 32) * G;
  workers = std::max<int64_t>(1, std::min<int64_t>(workers, 16));
  std::unique_ptr<uint8_t[]> w(new uint8_t[products * bytes]);
  for (int64_t i = 0; i < products * bytes; i += G) {  // nibbles 1, float16 scales d = m = 1.0
    std::memset(w.get() + i, 0x11, G - 64);
    uint16_t* sc = reinterpret_cast<uint16_t*>(w.get() + i + G - 64);
    for (int j = 0; j < 32; ++j) sc[j] = 0x3C00;
  }
  float x[K];
  for (int64_t k = 0; k < K; ++k) x[k] = (float)(k % 7) - 3.0f;
  std::unique_ptr<uint8_t[]> xq(new uint8_t[qx_row_bytes(K)]);
  qx_quantize(x, 1, K, xq.get());
  std::vector<float> y(N * workers);  // a row of y per worker: no shared cache lines written
  const BlockFn f = qx_fn<true>(1);
  auto part = [&](int64_t i, int64_t wk) {
    const int64_t n0 = groups * wk / workers * kQxCols, n1 = groups * (wk + 1) / workers * kQxCols;
    f(reinterpret_cast<const float*>(xq.get()), reinterpret_cast<const float*>(w.get() + i * bytes), nullptr,
      y.data() + wk * N, K, N, n0, n1);
  };
  std::atomic<int64_t> posted{0}, finished{0};
  std::atomic<bool> stop{false};
  std::vector<std::thread> helpers;
  for (int64_t wk = 1; wk < workers; ++wk)
    helpers.emplace_back([&, wk] {
      for (int64_t seen = 0;;) {
        int64_t p;
        for (int spins = 0; (p = posted.load(std::memory_order_acquire)) == seen; ++spins) {
          if (stop.load(std::memory_order_relaxed)) return;
          spin(spins);
        }
        seen = p;
        part((p - 1) % products, wk);
        finished.fetch_add(1, std::memory_order_release);
      }
    });
  auto sweep = [&] {
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < products; ++i) {
      finished.store(0, std::memory_order_relaxed);
      posted.fetch_add(1, std::memory_order_acq_rel);
      part(i, 0);
      for (int spins = 0; finished.load(std::memory_order_acquire) < workers - 1; ++spins) spin(spins);
    }
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  };
  out[0] = out[1] = 1e300;
  for (int64_t r = 0; r <= reps; ++r)  // round 0 warms up (page faults, thread start)
    for (int on = 0; on < 2; ++on) {
      g_prefetch.store(on != 0, std::memory_order_relaxed);
      const double ms = sweep();
      if (r) out[on] = std::min(out[on], ms);
    }
  g_prefetch.store(true, std::memory_order_relaxed);
  stop.store(true);
  for (auto& t : helpers) t.join();
  return 0;
}
