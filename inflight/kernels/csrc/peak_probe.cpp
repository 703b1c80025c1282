// The CPU's arithmetic peak, measured: the "compute" roof of the roofline that
// `inflight bench throughput --profile` holds each kernel against (bench/roofline.py).
//
//   peak_gflops(kind, seconds)   GFLOP/s all threads reach for `seconds` of wall time
//     "fp32_fma"   float32 fused multiply-add: 2 FLOP per lane (16 lanes per zmm, 8 per ymm)
//     "bf16_dot"   vdpbf16ps: 32 bfloat16 pairs multiplied and summed into 16 float32
//                  lanes, 64 FLOP per instruction (AVX512-BF16 only)
//     "amx_bf16"   TDPBF16PS on AMX tiles: a 16 x 32 by 32 x 16 bfloat16 product into 16 x 16
//                  float32, 16 384 FLOP per instruction, four independent accumulator
//                  tiles (AMX only, and only where the OS grants tile data)
//
// Each thread runs a register-only loop with many independent accumulators (more than
// the FMA latency times the number of FMA ports), so nothing but the FMA units limits it;
// no memory is touched. Returns 0 when this build's CPU lacks the instructions.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>

#include "amx_tiles.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using Clock = std::chrono::steady_clock;

// Instructions per inner iteration (one per accumulator) and iterations between clock reads.
constexpr int kAccumulators = 16;
constexpr int64_t kItersPerCheck = 1024;

std::atomic<float> g_sink{0.0f};  // keeps the accumulators' results alive

#if defined(__AVX512F__)
int64_t fma512_until(Clock::time_point deadline) {
  __m512 acc[kAccumulators];
  for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
  const __m512 a = _mm512_set1_ps(0.999999f);
  const __m512 b = _mm512_set1_ps(1e-6f);
  int64_t iters = 0;
  while (Clock::now() < deadline) {
    for (int64_t n = 0; n < kItersPerCheck; ++n) {
      for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
    }
    iters += kItersPerCheck;
  }
  __m512 total = acc[0];
  for (int i = 1; i < kAccumulators; ++i) total = _mm512_add_ps(total, acc[i]);
  g_sink.store(_mm512_reduce_add_ps(total), std::memory_order_relaxed);
  return iters * kAccumulators * 32;  // 16 lanes x (multiply + add)
}
#elif defined(__AVX2__) && defined(__FMA__)
int64_t fma256_until(Clock::time_point deadline) {
  __m256 acc[kAccumulators];
  for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm256_set1_ps(0.001f * i);
  const __m256 a = _mm256_set1_ps(0.999999f);
  const __m256 b = _mm256_set1_ps(1e-6f);
  int64_t iters = 0;
  while (Clock::now() < deadline) {
    for (int64_t n = 0; n < kItersPerCheck; ++n) {
      for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
    }
    iters += kItersPerCheck;
  }
  float lanes[8];
  __m256 total = acc[0];
  for (int i = 1; i < kAccumulators; ++i) total = _mm256_add_ps(total, acc[i]);
  _mm256_storeu_ps(lanes, total);
  g_sink.store(lanes[0], std::memory_order_relaxed);
  return iters * kAccumulators * 16;  // 8 lanes x (multiply + add)
}
#endif

#if defined(__AVX512BF16__)
int64_t dpbf16_until(Clock::time_point deadline) {
  __m512 acc[kAccumulators];
  for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
  // bfloat16 1.0 is 0x3f80; tiny products keep the sums finite for any duration
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80);
  const __m512bh b = (__m512bh)_mm512_set1_epi16(0x3000);
  int64_t iters = 0;
  while (Clock::now() < deadline) {
    for (int64_t n = 0; n < kItersPerCheck; ++n) {
      for (int i = 0; i < kAccumulators; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    }
    iters += kItersPerCheck;
  }
  __m512 total = acc[0];
  for (int i = 1; i < kAccumulators; ++i) total = _mm512_add_ps(total, acc[i]);
  g_sink.store(_mm512_reduce_add_ps(total), std::memory_order_relaxed);
  return iters * kAccumulators * 64;  // 32 pairs x (multiply + add)
}
#endif

#if defined(INFLIGHT_AMX)
int64_t amx_until(Clock::time_point deadline) {
  if (!inflight_amx::tile_permission()) return -1;
  inflight_amx::TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
  // Zero inputs: the tile unit's rate does not depend on the values.
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  constexpr int64_t kTileIters = 64;  // 4 instructions each, between clock reads
  int64_t iters = 0;
  while (Clock::now() < deadline) {
    for (int64_t n = 0; n < kTileIters; ++n) {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    iters += kTileIters;
  }
  _tile_release();
  return iters * 4 * 16 * 16 * 32 * 2;
}
#endif

// FLOPs one thread does until `deadline`; -1 when the kind is unsupported here.
int64_t flops_until(const std::string& kind, Clock::time_point deadline) {
  if (kind == "fp32_fma") {
#if defined(__AVX512F__)
    return fma512_until(deadline);
#elif defined(__AVX2__) && defined(__FMA__)
    return fma256_until(deadline);
#endif
  } else if (kind == "bf16_dot") {
#if defined(__AVX512BF16__)
    return dpbf16_until(deadline);
#endif
  } else if (kind == "amx_bf16") {
#if defined(INFLIGHT_AMX)
    return amx_until(deadline);
#endif
  } else {
    TORCH_CHECK(false, "peak_gflops: unknown kind '", kind, "' (fp32_fma, bf16_dot or amx_bf16)");
  }
  (void)deadline;
  return -1;
}

double peak_gflops(std::string kind, double seconds) {
  TORCH_CHECK(seconds > 0, "peak_gflops: seconds must be positive");
  const int64_t threads = at::get_num_threads();
  std::atomic<int64_t> flops{0};
  std::atomic<bool> unsupported{false};
  const auto started = Clock::now();
  const auto deadline =
      started + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  // grain 1: one chunk per thread, each running its own register-only loop
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    const int64_t done = flops_until(kind, deadline);
    if (done < 0) {
      unsupported.store(true);
    } else {
      flops.fetch_add(done);
    }
  });
  const double elapsed = std::chrono::duration<double>(Clock::now() - started).count();
  if (unsupported.load()) return 0.0;
  return static_cast<double>(flops.load()) / elapsed / 1e9;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inflight, m) {
  m.def("peak_gflops(str kind, float seconds) -> float", &peak_gflops);
}
