// y = x @ W.T with AMX tiles (TDPBF16PS), for bfloat16 linears on CPUs with AMX.
//
//   amx_pack(W) -> packed               once, at load time
//   amx_linear(x, packed, N) -> y       every step in the kernel's row range
//   amx_linear_argmax(x, packed, N) -> [M] int64: each row's first index of its largest
//                                       float32 sum, without writing y (greedy sampling)
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
#include <deque>
#include <limits>
#include <mutex>
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

// Where a row block's accumulator tiles go: take(tile, rows, row0, col0) gets one 16 x 16
// float32 tile (row stride 16) holding y[row0 .. row0 + rows)[col0 .. col0 + 16).
template <typename out_t>
struct StoreRows {  // into y [M, ldy]
  out_t* y;
  int64_t ldy;
  void take(const float* tile, int64_t rows, int64_t row0, int64_t col0) {
    store_rows(tile, rows, y + row0 * ldy + col0, ldy);
  }
};

// Each row's largest sum and its first column over the tiles taken, which come in
// ascending column order (a thread's strip pairs), so a later tile replaces the best only
// if strictly greater: the lowest index of the maximum, as torch.max(dim=-1) gives it.
// Starts at -inf with index -1 (a row of -inf keeps -1); a NaN marks its row.
struct RunningArgmax {
  float* top;       // [M]
  int32_t* index;   // [M]
  uint8_t* nan;     // [M]
  void take(const float* tile, int64_t rows, int64_t row0, int64_t col0) {
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 v = _mm512_loadu_ps(tile + r * 16);
      if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0) {
        nan[row0 + r] = 1;
        continue;
      }
      const float m = _mm512_reduce_max_ps(v);
      if (m > top[row0 + r]) {
        const uint32_t lanes = _mm512_cmp_ps_mask(v, _mm512_set1_ps(m), _CMP_EQ_OQ);
        top[row0 + r] = m;
        index[row0 + r] = static_cast<int32_t>(col0 + __builtin_ctz(lanes));
      }
    }
  }
};

// One row block of x (two 16-row A tiles at a0 and a1, or one with ONE_ROW_TILE; lda bytes
// between rows, the first being row0) against the strip pair whose B tiles start at b0
// and b1 (columns from col0); the valid rows (rows_valid) go to the sink.
template <bool ONE_ROW_TILE, typename Sink>
void row_block(const at::BFloat16* a0, const at::BFloat16* a1, int64_t lda, int64_t K,
               const at::BFloat16* b0, const at::BFloat16* b1, int64_t rows_valid, Sink& sink,
               int64_t row0, int64_t col0) {
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
  sink.take(c[0], top, row0, col0);
  sink.take(c[1], top, row0, col0 + 16);
  if constexpr (!ONE_ROW_TILE) {
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
    const int64_t bottom = rows_valid - 16;
    if (bottom > 0) {
      sink.take(c[2], bottom, row0 + 16, col0);
      sink.take(c[3], bottom, row0 + 16, col0 + 16);
    }
  }
}

// Rows [0, M) of x against strip pairs [p_begin, p_end). For each strip pair, every row
// block in turn (the pair's tiles, 2 x K x 32 bytes, stay in L1/L2 after the first). Rows
// past M read `tail`: the last M % 16 rows of x, padded with zeros to 16.
template <typename Sink>
void strip_pairs(const at::BFloat16* x, int64_t M, int64_t K, const at::BFloat16* tail,
                 const at::BFloat16* packed, int64_t p_begin, int64_t p_end, Sink& sink) {
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
      if (rows > 16) {
        row_block<false>(a_tile(m), a_tile(m + 16), lda, K, b0, b1, rows, sink, m, 32 * p);
      } else {
        row_block<true>(a_tile(m), nullptr, lda, K, b0, b1, rows, sink, m, 32 * p);
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

void check_operands(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "x must be a contiguous bfloat16 [M, K] tensor");
  const int64_t K = x.size(1);
  TORCH_CHECK(packed.dim() == 1 && packed.scalar_type() == at::kBFloat16 &&
                  packed.is_contiguous() && K % kDepth == 0 && N % 32 == 0 &&
                  packed.numel() == N * K,
              "packed has ", packed.numel(), " elements; [", N, ", ", K, "] needs ", N * K,
              " (from amx_pack)");
}

#if defined(INFLIGHT_AMX)
// x's strip pairs split between the threads, each pair's rows into `make_sink(begin)`'s
// sink (begin: the thread's first strip pair).
template <typename MakeSink>
void for_strip_pairs(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                     MakeSink make_sink) {
  TORCH_CHECK(tile_permission(), "the OS did not grant AMX tile data to this process");
  const int64_t M = x.size(0), K = x.size(1);
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* wp = packed.data_ptr<at::BFloat16>();
  // The last M % 16 rows, padded with zeros to a whole tile (tiles read 16 rows).
  const int64_t full = M / 16 * 16;
  std::vector<at::BFloat16> tail(M > full ? 16 * K : 0, at::BFloat16(0.f));
  if (M > full) std::memcpy(tail.data(), xp + full * K, (M - full) * K * sizeof(at::BFloat16));
  at::parallel_for(0, N / 32, 1, [&](int64_t begin, int64_t end) {
    auto sink = make_sink(begin);
    inflight_amx::load_full_tiles();
    strip_pairs(xp, M, K, tail.data(), wp, begin, end, sink);
    _tile_release();
  });
}
#endif

// float32_out: the float32 sums as they are (the output layer's logits, see bf16_linear.cpp).
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                      bool float32_out) {
  check_operands(x, packed, N);
  const int64_t M = x.size(0);
  auto y = at::empty({M, N}, x.options().dtype(float32_out ? at::kFloat : at::kBFloat16));
  if (M == 0) return y;
#if defined(INFLIGHT_AMX)
  if (float32_out) {
    float* yp = y.data_ptr<float>();
    for_strip_pairs(x, packed, N, [&](int64_t) { return StoreRows<float>{yp, N}; });
  } else {
    at::BFloat16* yp = y.data_ptr<at::BFloat16>();
    for_strip_pairs(x, packed, N, [&](int64_t) { return StoreRows<at::BFloat16>{yp, N}; });
  }
#else
  TORCH_CHECK(false, "amx_linear needs AMX (amx_tile, amx_bf16); use oneDNN on this CPU");
#endif
  return y;
}

// Greedy sampling's token ids straight from the output layer: for each row of x, the
// lowest column index of the largest float32 sum, exactly what amx_linear(x, packed, N,
// float32_out=True) followed by torch.max(dim=-1).indices gives, without writing the
// [M, N] float32 logits (39 MB at 200 rows of SmolLM2's 49,152, written and read again
// from DRAM). -1 for a row holding a NaN (or only -inf): the caller takes those rows from
// the logits. Each thread keeps its columns' running maxima (RunningArgmax); the threads'
// results are merged in column order.
at::Tensor amx_linear_argmax(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  check_operands(x, packed, N);
  const int64_t M = x.size(0);
  auto tokens = at::empty({M}, x.options().dtype(at::kLong));
  if (M == 0) return tokens;
#if defined(INFLIGHT_AMX)
  struct Part {  // one thread's columns, from strip pair `begin`
    int64_t begin;
    std::vector<float> top;
    std::vector<int32_t> index;
    std::vector<uint8_t> nan;
  };
  std::deque<Part> parts;  // one per parallel chunk; a deque keeps earlier ones in place
  std::mutex adding;
  for_strip_pairs(x, packed, N, [&](int64_t begin) {
    std::lock_guard<std::mutex> hold(adding);
    Part& part = parts.emplace_back();
    part.begin = begin;
    part.top.assign(M, -std::numeric_limits<float>::infinity());
    part.index.assign(M, -1);
    part.nan.assign(M, 0);
    return RunningArgmax{part.top.data(), part.index.data(), part.nan.data()};
  });
  std::sort(parts.begin(), parts.end(),
            [](const Part& a, const Part& b) { return a.begin < b.begin; });
  int64_t* out = tokens.data_ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r) {
    float best = -std::numeric_limits<float>::infinity();
    int64_t token = -1;
    bool nan = false;
    for (const Part& part : parts) {
      nan = nan || part.nan[r] != 0;
      if (part.top[r] > best) {
        best = part.top[r];
        token = part.index[r];
      }
    }
    out[r] = nan ? -1 : token;
  }
#else
  TORCH_CHECK(false, "amx_linear_argmax needs AMX (amx_tile, amx_bf16)");
#endif
  return tokens;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inflight, m) {
  m.def("amx_pack(Tensor weight) -> Tensor");
  m.impl("amx_pack", c10::DispatchKey::CPU, &amx_pack);
  m.def("amx_linear(Tensor x, Tensor packed, int N, bool float32_out=False) -> Tensor");
  m.impl("amx_linear", c10::DispatchKey::CPU, &amx_linear);
  m.def("amx_linear_argmax(Tensor x, Tensor packed, int N) -> Tensor");
  m.impl("amx_linear_argmax", c10::DispatchKey::CPU, &amx_linear_argmax);
  m.def("amx_linear_available() -> bool", &amx_linear_available);
}
