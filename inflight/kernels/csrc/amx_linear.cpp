// y = x @ W.T with AMX tiles (TDPBF16PS), for bfloat16 linears on CPUs with AMX.
//
//   amx_pack(W) -> packed               once, at load time
//   amx_linear(x, packed, N) -> y       every step in the kernel's row range
//
//   W:       [N, K] bfloat16, N a multiple of 32, K a multiple of 32
//   packed:  [N / 16][K / 32][16][16][2] bfloat16: W^T as AMX B tiles. Tile (n, k) holds
//            pair rows r = 0..15 of columns c = 0..15: (W[16 n + c][32 k + 2 r],
//            W[16 n + c][32 k + 2 r + 1]), 1 KiB; a 16-column strip's tiles follow each
//            other along K, so a strip streams from memory in one run.
//   x:       [M, K] bfloat16, contiguous
//   y:       [M, N] bfloat16 (float32 sums rounded once, to nearest even) or float32
//
// Why: on the Intel Xeon with AMX this project measured (2 cores), oneDNN's bfloat16 GEMM
// (through torch's mkldnn linear on a pre-packed weight) took 18.6 ms for one pass over
// SmolLM2's 120 decoder linears at 57 rows and 16.2 at 64, where streaming the 212 MB of
// weights takes ~8 ms and the tiles' arithmetic ~3: a decode step's weights were neither
// streamed at the memory's rate nor overlapped with the arithmetic.
//
// How: the columns are split into pairs of strips (32 columns), handed to the threads in
// contiguous runs. For a strip pair, the rows go through in blocks of 32 (2 x 2 tiles of
// 16 x 16 float32 accumulators; 2 A tiles of x and 2 B tiles of W per 32 of K) or a last
// block of 16 (1 x 2); the strip pair (2 x K x 32 bytes: 36-96 KB here) stays in L1/L2 for
// the later row blocks, so each weight is read from memory once per step. A thread's strip
// pairs are one contiguous run of the packed weight, which the L2's own streaming
// prefetcher fetches ahead; software prefetches only bring the next k-step's B tiles from
// L2 into L1 (a tile load waits for all its 16 lines, and a tile register is reused only
// once its product is done). Fetching strip pairs ahead into L2 with software prefetches,
// as an earlier version did, was 6-20% slower on the Intel Xeon with AMX this project
// measured (2 cores; 120 decoder linears + output layer, weights from DRAM, at 8, 57 and
// 256 rows): each software prefetch holds one of the core's few L1 fill buffers until its
// line arrives from DRAM, which caps the streaming rate. Rows past M are
// zero padding in a copy of x. Larger steps go through x in chunks of 256 rows (their tiles
// stay in L2) and re-read each strip pair from cache once per chunk.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"

namespace {

constexpr int64_t kStrip = 16;       // columns per B tile
constexpr int64_t kDepth = 32;       // K per tile (16 pairs)

#if defined(INFLIGHT_AMX)

using inflight_amx::tile_permission;

// Tiles 0-3: float32 accumulators C[i][j] (16 x 16), 4-5: A (16 rows x 32 bfloat16),
// 6-7: B (16 pair rows x 16 columns x 2): inflight_amx::load_full_tiles.

// One 16 x 16 float32 tile (row stride 16) into y's rows [0, rows), columns [0, 16).
template <typename out_t>
inline void store_rows(const float* tile, int64_t rows, out_t* y, int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 v = _mm512_loadu_ps(tile + r * 16);
    if constexpr (std::is_same_v<out_t, float>) {
      _mm512_storeu_ps(y + r * ldy, v);
    } else {
      // Round to nearest even, as .to(torch.bfloat16) does.
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy), (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

// One row block of x (two 16-row A tiles at a0 and a1, or one with ONE_ROW_TILE; lda bytes
// between rows) against the strip pair whose B tiles start at b0 and b1; the valid rows
// (rows_valid) go to y.
template <bool ONE_ROW_TILE, typename out_t>
void row_block(const at::BFloat16* a0, const at::BFloat16* a1, int64_t lda, int64_t K,
               const at::BFloat16* b0, const at::BFloat16* b1, int64_t rows_valid, out_t* y,
               int64_t ldy) {
  const int64_t ksteps = K / kDepth;
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (!ONE_ROW_TILE) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < ksteps; ++k) {
    if (k + 1 < ksteps) {  // the next k-step's B tiles (2 x 16 lines) into L1
      const char* next0 = reinterpret_cast<const char*>(b0 + (k + 1) * kStrip * kDepth);
      const char* next1 = reinterpret_cast<const char*>(b1 + (k + 1) * kStrip * kDepth);
      for (int l = 0; l < 16; ++l) {
        _mm_prefetch(next0 + l * 64, _MM_HINT_T0);
        _mm_prefetch(next1 + l * 64, _MM_HINT_T0);
      }
    }
    _tile_loadd(6, b0 + k * kStrip * kDepth, 64);
    _tile_loadd(7, b1 + k * kStrip * kDepth, 64);
    _tile_loadd(4, a0 + k * kDepth, lda);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (!ONE_ROW_TILE) {
      _tile_loadd(5, a1 + k * kDepth, lda);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float c[4][256];
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  const int64_t top = std::min<int64_t>(16, rows_valid);
  store_rows(c[0], top, y, ldy);
  store_rows(c[1], top, y + 16, ldy);
  if constexpr (!ONE_ROW_TILE) {
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
    const int64_t bottom = rows_valid - 16;
    if (bottom > 0) {
      store_rows(c[2], bottom, y + 16 * ldy, ldy);
      store_rows(c[3], bottom, y + 16 * ldy + 16, ldy);
    }
  }
}

// Rows [0, M) of x against strip pairs [p_begin, p_end). For each strip pair, every row
// block in turn (the pair's tiles, 2 x K x 32 bytes, stay in L1/L2 after the first). Rows
// past M read `tail`: the last M % 16 rows of x, padded with zeros to 16.
template <typename out_t>
void strip_pairs(const at::BFloat16* x, int64_t M, int64_t K, const at::BFloat16* tail,
                 const at::BFloat16* packed, int64_t p_begin, int64_t p_end, out_t* y,
                 int64_t N) {
  const int64_t strip_elems = K * kStrip;  // one 16-column strip's tiles
  const int64_t full = M / 16 * 16;  // rows read from x itself
  const int64_t lda = K * 2;
  const int64_t blocks = (M + 31) / 32;
  auto a_tile = [&](int64_t m) { return m < full ? x + m * K : tail; };
  for (int64_t p = p_begin; p < p_end; ++p) {
    const at::BFloat16* b0 = packed + (2 * p) * strip_elems;
    const at::BFloat16* b1 = b0 + strip_elems;
    for (int64_t i = 0; i < blocks; ++i) {
      const int64_t m = 32 * i;
      const int64_t rows = std::min<int64_t>(32, M - m);
      out_t* out = y + m * N + 32 * p;
      if (rows > 16) {
        row_block<false>(a_tile(m), a_tile(m + 16), lda, K, b0, b1, rows, out, N);
      } else {
        row_block<true>(a_tile(m), nullptr, lda, K, b0, b1, rows, out, N);
      }
    }
  }
}

#endif  // INFLIGHT_AMX

bool amx_linear_available() {
#if defined(INFLIGHT_AMX)
  return tile_permission();
#else
  return false;
#endif
}

at::Tensor amx_pack(const at::Tensor& weight_in) {
  const at::Tensor w = weight_in.contiguous();
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16,
              "weight must be a bfloat16 [N, K] tensor");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 32 == 0 && K % kDepth == 0 && K > 0,
              "amx_pack needs N and K multiples of 32, got [", N, ", ", K, "]");
  auto packed = at::empty({N * K}, w.options());
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  const int64_t strips = N / kStrip, ksteps = K / kDepth;
  at::parallel_for(0, strips, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t k = 0; k < ksteps; ++k) {
        uint16_t* tile = dst + (n * ksteps + k) * kStrip * kDepth;
        for (int64_t r = 0; r < 16; ++r)
          for (int64_t c = 0; c < 16; ++c)
            for (int64_t e = 0; e < 2; ++e)
              tile[(r * 16 + c) * 2 + e] = src[(n * kStrip + c) * K + k * kDepth + 2 * r + e];
      }
  });
  return packed;
}

// float32_out: the float32 sums as they are (the output layer's logits, see bf16_linear.cpp).
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                      bool float32_out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "x must be a contiguous bfloat16 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.dim() == 1 && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous() && K % kDepth == 0 && N % 32 == 0 &&
                  packed.numel() == N * K,
              "packed has ", packed.numel(), " elements; [", N, ", ", K, "] needs ", N * K,
              " (from amx_pack)");
  auto y = at::empty({M, N}, x.options().dtype(float32_out ? at::kFloat : at::kBFloat16));
  if (M == 0) return y;
#if defined(INFLIGHT_AMX)
  TORCH_CHECK(tile_permission(), "the OS did not grant AMX tile data to this process");
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* wp = packed.data_ptr<at::BFloat16>();
  // The last M % 16 rows, padded with zeros to a whole tile (tiles read 16 rows).
  const int64_t full = M / 16 * 16;
  std::vector<at::BFloat16> tail(M > full ? 16 * K : 0, at::BFloat16(0.f));
  if (M > full) std::memcpy(tail.data(), xp + full * K, (M - full) * K * sizeof(at::BFloat16));
  const int64_t pairs = N / 32;
  auto run = [&](auto* yp) {
    at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
      inflight_amx::load_full_tiles();
      strip_pairs(xp, M, K, tail.data(), wp, begin, end, yp, N);
      _tile_release();
    });
  };
  if (float32_out) {
    run(y.data_ptr<float>());
  } else {
    run(y.data_ptr<at::BFloat16>());
  }
#else
  TORCH_CHECK(false, "amx_linear needs AMX (amx_tile, amx_bf16); use oneDNN on this CPU");
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inflight, m) {
  m.def("amx_pack(Tensor weight) -> Tensor");
  m.impl("amx_pack", c10::DispatchKey::CPU, &amx_pack);
  m.def("amx_linear(Tensor x, Tensor packed, int N, bool float32_out=False) -> Tensor");
  m.impl("amx_linear", c10::DispatchKey::CPU, &amx_linear);
  m.def("amx_linear_available() -> bool", &amx_linear_available);
}
