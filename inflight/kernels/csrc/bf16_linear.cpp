// y = x @ W.T in bfloat16 dot products, for the mid-sized steps of decoding (tens to a few
// hundred rows) on CPUs with AVX512-BF16 and no AMX.
//
//   bf16_pack_pairs(W) -> packed        once, at load time
//   bf16_linear(x, packed, N) -> y      every step in the kernel's row range
//   bf16_linear_argmax(x, packed, N) -> [M] int64: each row's lowest index of its largest
//                                       float32 output (greedy sampling's tokens), -1
//                                       for a row holding a NaN or only -inf
//
//   f32_pack_tiles(W) -> packed         the same for a float32 W ([N, K], N a multiple of
//   f32_linear(x, packed, N) -> y        16): tiles of [K][w] float32, x and y float32,
//   f32_linear_argmax(x, packed, N)      one vfmadd231ps per weight instead of vdpbf16ps
//
//   W:       [N, K] bfloat16, N a multiple of 16, K even
//   packed:  [N * K / 2] int32: W in tiles of up to 64 output columns; tile t (columns
//            64 t .. 64 t + w) holds [K / 2][w] pairs, pair (kp, c) = W[64 t + c][2 kp .. 2 kp + 1]
//   x:       [M, K] bfloat16, contiguous
//   y:       [M, N] bfloat16 (float32 sums rounded once, to nearest even)
//
// Why: oneDNN's bfloat16 GEMM, measured on the AMD EPYC (Zen 5) this project runs on, reached
// 780 GFLOP/s from 200 rows up but 552 at 57 rows and 259 at 16 (all of SmolLM2's linears,
// weights from memory): a decode step streams every weight once, and at those row counts
// the weight traffic is as long as the arithmetic unless the two overlap.
//
// How: each thread takes an equal run of 16-column blocks, tile by tile (a run may start or
// end inside a tile). For one tile, the activations go
// through in slices of 6 rows against the tile's 4 blocks of 16 columns: 24 float32
// accumulators in registers, each step one vdpbf16ps (two multiply-adds per lane) per
// accumulator, the activation pair broadcast from memory and the tile's 4 vectors loaded
// once per step. The tile (64 x K x 2 bytes: 72-192 KB here) stays in L2 for the later
// slices; while a tile computes, the next one is prefetched into L2, its lines spread evenly
// over the current tile's steps, so DRAM streams under the arithmetic instead of before it.
//
// float32: on CPUs where bfloat16 dot products do not pay, bfloat16 models compute in
// float32 (worker/device.py), and so does the default dtype. The same blocking with float32
// FMAs, measured on the Intel Xeon without AMX (model 207, 2 cores), one pass over
// SmolLM2's 120 decoder linears against PyTorch's float32 GEMM (MKL), alternating: 1.65x
// at 33 rows, 1.2-1.4x at 57, 1.0-1.15x at 100-200, 0.82-0.93x at 512-4096 (MKL's blocking
// of large steps is better): worker/device.py's F32_TILE_MATMUL_MAX_ROWS. Taking K in
// L1-sized ranges for groups of slices (the tile is twice as large as bfloat16 pairs) was
// tried and measured level within this VM's noise.
//
// The output layer's float32 logits ([M, 49152]: 11 MB at 57 rows, 39 MB at 200) are
// written with non-temporal stores: they are read once, later, by the sampler, and written
// through the cache their lines (rows 192 KB apart, all in the same few L2 sets) evicted
// the tile and the activations. Under greedy sampling bf16_linear_argmax writes no logits
// at all: each thread keeps per row 16 lanes of running maxima over its columns. Measured
// on an AMD EPYC (Zen 4), the output layer alone: 57 rows 8.96 ms with cached stores, 8.07
// with non-temporal ones.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include "vec_math.h"

namespace {

constexpr int64_t kTileCols = 64;  // output columns per tile: 4 vectors of 16
constexpr int64_t kSliceRows = 6;  // activation rows per pass over a tile

#if defined(__AVX512F__)

using inflight_vec::store16;

// Where a slice's sums go: rows [M, ldy] of y (bfloat16 rounded to nearest even, or
// float32 with non-temporal stores where y is 64-byte aligned, see the header; ldy and
// the columns are multiples of 16, so every row's stores are aligned then).
template <typename out_t>
struct StoreRows {
  out_t* y;
  int64_t ldy;
  bool wide = true;  // float32 rows worth streaming (the output layer's logits)
  bool stream = wide && std::is_same_v<out_t, float> && reinterpret_cast<uintptr_t>(y) % 64 == 0;
  void take(int64_t row, int64_t col, __m512 sums) {
    if constexpr (std::is_same_v<out_t, float>) {
      if (stream) {
        _mm512_stream_ps(y + row * ldy + col, sums);
        return;
      }
    }
    store16(y + row * ldy + col, sums);
  }
  void finish() {
    if (stream) _mm_sfence();  // order the streamed stores before the caller reads y
  }
};

// One thread's running maxima: for each row 16 lanes, lane i the largest sum seen in
// columns = i (mod 16) and its column. A thread sees each row's columns in ascending
// order and a lane takes a later column only if strictly greater, so each lane holds its
// lowest column of its maximum; a NaN marks its row.
struct RunningArgmax {
  std::vector<float> top;      // [M][16]
  std::vector<int32_t> index;  // [M][16]
  std::vector<uint8_t> nan;    // [M]
  explicit RunningArgmax(int64_t M)
      : top(M * 16, -std::numeric_limits<float>::infinity()), index(M * 16, -1), nan(M, 0) {}
  void take(int64_t row, int64_t col, __m512 sums) {
    nan[row] |= _mm512_cmp_ps_mask(sums, sums, _CMP_UNORD_Q) != 0;
    const __m512 best = _mm512_loadu_ps(&top[row * 16]);
    const __mmask16 greater = _mm512_cmp_ps_mask(sums, best, _CMP_GT_OQ);
    if (greater == 0) return;
    static const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    _mm512_storeu_ps(&top[row * 16], _mm512_mask_mov_ps(best, greater, sums));
    __m512i* at = reinterpret_cast<__m512i*>(&index[row * 16]);
    _mm512_storeu_si512(at, _mm512_mask_add_epi32(_mm512_loadu_si512(at), greater, lanes,
                                                  _mm512_set1_epi32(static_cast<int>(col))));
  }
  void finish() {}
  // Row r's largest value and its lowest column (-inf and -1 when nothing beat -inf).
  std::pair<float, int32_t> best(int64_t r) const {
    float value = -std::numeric_limits<float>::infinity();
    int32_t column = -1;
    for (int i = 0; i < 16; ++i) {
      const float v = top[r * 16 + i];
      const int32_t c = index[r * 16 + i];
      if (v > value || (v == value && c >= 0 && (column < 0 || c < column))) {
        value = v;
        column = c;
      }
    }
    return {value, column};
  }
};

// acc[r][j] over all K for NR activation rows (from row0) and NB 16-column blocks of one
// tile (from col); then into the sink. While it runs, `lines` cache lines from `prefetch`
// go to L2, spread over the steps. kPairs: each 32-bit unit a bfloat16 pair (vdpbf16ps);
// else one float32 (vfmadd231ps).
template <bool kPairs, int NR, int NB, typename Sink>
void slice(const uint32_t* a, int64_t lda, const uint32_t* b, int64_t width, int64_t kpairs,
           Sink& sink, int64_t row0, int64_t col, const char* prefetch, int64_t lines) {
  __m512 acc[NR][NB];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t per_step = (lines + kpairs - 1) / kpairs;
  for (int64_t kp = 0; kp < kpairs; ++kp) {
    for (int64_t l = 0; l < per_step; ++l) {
      const int64_t line = kp * per_step + l;
      if (line < lines) _mm_prefetch(prefetch + line * 64, _MM_HINT_T1);
    }
    __m512i bv[NB];
    for (int j = 0; j < NB; ++j) bv[j] = _mm512_loadu_si512(b + kp * width + 16 * j);
    for (int r = 0; r < NR; ++r) {
      if constexpr (kPairs) {
#if defined(__AVX512BF16__)
        const __m512i av = _mm512_set1_epi32(static_cast<int>(a[r * lda + kp]));
        for (int j = 0; j < NB; ++j)
          acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)av, (__m512bh)bv[j]);
#endif
      } else {
        const __m512 av = _mm512_set1_ps(reinterpret_cast<const float*>(a)[r * lda + kp]);
        for (int j = 0; j < NB; ++j)
          acc[r][j] = _mm512_fmadd_ps(av, _mm512_castsi512_ps(bv[j]), acc[r][j]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < NB; ++j) sink.take(row0 + r, col + 16 * j, acc[r][j]);
}

template <bool kPairs, int NB, typename Sink>
void slice_rows(int64_t rows, const uint32_t* a, int64_t lda, const uint32_t* b, int64_t width,
                int64_t kpairs, Sink& sink, int64_t row0, int64_t col, const char* prefetch,
                int64_t lines) {
#define INFLIGHT_SLICE(NR) \
  slice<kPairs, NR, NB>(a, lda, b, width, kpairs, sink, row0, col, prefetch, lines)
  switch (rows) {
    case 1: INFLIGHT_SLICE(1); break;
    case 2: INFLIGHT_SLICE(2); break;
    case 3: INFLIGHT_SLICE(3); break;
    case 4: INFLIGHT_SLICE(4); break;
    case 5: INFLIGHT_SLICE(5); break;
    default: INFLIGHT_SLICE(6); break;
  }
#undef INFLIGHT_SLICE
}

// All M rows against columns [col, col + width) of the tile that starts at tile_col (width a
// multiple of 16 inside that tile); `next_lines` cache lines from `next` go to L2 meanwhile.
// K counts 32-bit units (bfloat16 pairs, or float32 values).
template <bool kPairs, typename Sink>
void piece(const uint32_t* x, int64_t M, int64_t kpairs, const uint32_t* packed, int64_t N,
           int64_t tile_col, int64_t col, int64_t width, const char* next, int64_t next_lines,
           Sink& sink) {
  const int64_t stride = std::min(kTileCols, N - tile_col);  // the tile's own width
  const uint32_t* b = packed + tile_col * kpairs + (col - tile_col);
  const int64_t slices = (M + kSliceRows - 1) / kSliceRows;
  const int64_t share = (next_lines + slices - 1) / slices;  // lines per slice
  for (int64_t s = 0; s < slices; ++s) {
    const int64_t m0 = s * kSliceRows;
    const int64_t rows = std::min(kSliceRows, M - m0);
    const int64_t begin = std::min(next_lines, s * share);
    const int64_t lines = std::min(next_lines, begin + share) - begin;
    const uint32_t* a = x + m0 * kpairs;
    const char* pf = next + begin * 64;
#define INFLIGHT_ROWS(NB) \
  slice_rows<kPairs, NB>(rows, a, kpairs, b, stride, kpairs, sink, m0, col, pf, lines)
    switch (width / 16) {
      case 1: INFLIGHT_ROWS(1); break;
      case 2: INFLIGHT_ROWS(2); break;
      case 3: INFLIGHT_ROWS(3); break;
      default: INFLIGHT_ROWS(4); break;
    }
#undef INFLIGHT_ROWS
  }
}

// Columns [begin, end) (multiples of 16), tile by tile; a range that starts or ends inside a
// tile takes that tile's part. Each piece prefetches the whole tile of the next one.
template <bool kPairs, typename Sink>
void columns(const uint32_t* x, int64_t M, int64_t kpairs, const uint32_t* packed, int64_t N,
             int64_t begin, int64_t end, Sink& sink) {
  for (int64_t col = begin; col < end;) {
    const int64_t tile_col = col / kTileCols * kTileCols;
    const int64_t stop = std::min(end, tile_col + kTileCols);  // end <= N
    const int64_t next_tile = tile_col + kTileCols;
    const int64_t next_width = stop < end ? std::min(kTileCols, N - next_tile) : 0;
    const char* next = reinterpret_cast<const char*>(packed + next_tile * kpairs);
    piece<kPairs>(x, M, kpairs, packed, N, tile_col, col, stop - col, next,
                  next_width * kpairs * 4 / 64, sink);
    col = stop;
  }
  sink.finish();
}

// Each thread an equal run of 16-column blocks, not of whole 64-column tiles: the 9 tiles
// of a 576-column layer (SmolLM2's o and down projections) split 5 : 4 between two
// threads, so such a call took five tiles' time for four and a half tiles' work.
// make_sink(first column) gives the thread's sink. K counts 32-bit units, as in piece.
template <bool kPairs, typename MakeSink>
void for_column_runs(const uint32_t* x, int64_t M, int64_t K, const uint32_t* packed, int64_t N,
                     MakeSink make_sink) {
  const int64_t blocks = N / 16, threads = at::get_num_threads();
  const int64_t per_thread = (blocks + threads - 1) / threads;
  at::parallel_for(0, blocks, per_thread, [&](int64_t begin, int64_t end) {
    auto&& sink = make_sink(begin * 16);
    columns<kPairs>(x, M, K, packed, N, begin * 16, end * 16, sink);
  });
}

#endif  // __AVX512F__

bool bf16_linear_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// [N][units] 32-bit units (a row of W) -> tiles of up to 64 columns, [units][width] each.
void pack_tiles(const uint32_t* src, uint32_t* dst, int64_t N, int64_t units) {
  const int64_t tiles = (N + kTileCols - 1) / kTileCols;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t col = t * kTileCols, width = std::min(kTileCols, N - col);
      uint32_t* out = dst + col * units;
      for (int64_t u = 0; u < units; ++u)
        for (int64_t c = 0; c < width; ++c) out[u * width + c] = src[(col + c) * units + u];
    }
  });
}

at::Tensor bf16_pack_pairs(const at::Tensor& weight_in) {
  const at::Tensor w = weight_in.contiguous();
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16,
              "weight must be a bfloat16 [N, K] tensor");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 16 == 0 && K % 2 == 0 && K > 0,
              "bf16_pack_pairs needs N a multiple of 16 and K even, got [", N, ", ", K, "]");
  auto packed = at::empty({N * K / 2}, w.options().dtype(at::kInt));
  pack_tiles(reinterpret_cast<const uint32_t*>(w.data_ptr<at::BFloat16>()),
             reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>()), N, K / 2);
  return packed;
}

at::Tensor f32_pack_tiles(const at::Tensor& weight_in) {
  const at::Tensor w = weight_in.contiguous();
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat,
              "weight must be a float32 [N, K] tensor");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(N % 16 == 0 && K > 0,
              "f32_pack_tiles needs N a multiple of 16, got [", N, ", ", K, "]");
  auto packed = at::empty({N, K}, w.options());
  pack_tiles(reinterpret_cast<const uint32_t*>(w.data_ptr<float>()),
             reinterpret_cast<uint32_t*>(packed.data_ptr<float>()), N, K);
  return packed.view({N * K});
}

void check_operands(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "x must be a contiguous bfloat16 [M, K] tensor");
  const int64_t K = x.size(1);
  TORCH_CHECK(packed.dim() == 1 && packed.scalar_type() == at::kInt && packed.is_contiguous() &&
                  K % 2 == 0 && N % 16 == 0 && packed.numel() == N * K / 2,
              "packed has ", packed.numel(), " pairs; [", N, ", ", K, "] needs ", N * K / 2,
              " (from bf16_pack_pairs)");
}

// float32_out: the float32 sums as they are (the output layer's logits: rounded to
// bfloat16 they tie often, and greedy argmax then takes the lowest tied id).
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                       bool float32_out) {
  check_operands(x, packed, N);
  const int64_t M = x.size(0), K = x.size(1);
  auto y = at::empty({M, N}, x.options().dtype(float32_out ? at::kFloat : at::kBFloat16));
  if (M == 0) return y;
#if defined(__AVX512BF16__)
  const auto* xp = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
  auto run = [&](auto* yp) {
    using out_t = std::remove_pointer_t<decltype(yp)>;
    for_column_runs<true>(xp, M, K / 2, wp, N, [&](int64_t) { return StoreRows<out_t>{yp, N}; });
  };
  if (float32_out) {
    run(y.data_ptr<float>());
  } else {
    run(y.data_ptr<at::BFloat16>());
  }
#else
  TORCH_CHECK(false, "bf16_linear needs AVX512-BF16; use oneDNN on this CPU");
#endif
  return y;
}

#if defined(__AVX512F__)
// Each row's lowest column of its largest float32 sum into out[M] (-1: a NaN or only -inf),
// from per-thread RunningArgmax parts merged in column order.
template <bool kPairs>
void argmax_over_columns(const uint32_t* x, int64_t M, int64_t units, const uint32_t* packed,
                         int64_t N, int64_t* out) {
  std::map<int64_t, RunningArgmax> parts;  // by first column: merged in column order
  std::mutex adding;
  for_column_runs<kPairs>(x, M, units, packed, N, [&](int64_t first_column) -> RunningArgmax& {
    std::lock_guard<std::mutex> hold(adding);
    return parts.try_emplace(first_column, M).first->second;
  });
  for (int64_t r = 0; r < M; ++r) {
    float value = -std::numeric_limits<float>::infinity();
    int64_t token = -1;
    bool nan = false;
    for (const auto& [first_column, part] : parts) {
      nan = nan || part.nan[r] != 0;
      const auto [v, c] = part.best(r);
      if (v > value) {  // a later part only if strictly greater: the lowest column
        value = v;
        token = c;
      }
    }
    out[r] = nan ? -1 : token;
  }
}
#endif

// Greedy sampling's tokens from the output layer: for each row of x the lowest column of
// its largest float32 sum, exactly bf16_linear(x, packed, N, true).max(dim=-1).indices,
// without writing the logits (RunningArgmax per thread, merged in column order). -1 for
// a row holding a NaN or only -inf: the caller takes those rows from the logits.
at::Tensor bf16_linear_argmax(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  check_operands(x, packed, N);
  const int64_t M = x.size(0), K = x.size(1);
  auto tokens = at::empty({M}, x.options().dtype(at::kLong));
  if (M == 0) return tokens;
#if defined(__AVX512BF16__)
  argmax_over_columns<true>(reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>()), M,
                            K / 2, reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>()),
                            N, tokens.data_ptr<int64_t>());
#else
  TORCH_CHECK(false, "bf16_linear_argmax needs AVX512-BF16");
#endif
  return tokens;
}

bool f32_linear_available() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

void check_f32_operands(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  const int64_t K = x.size(1);
  TORCH_CHECK(packed.dim() == 1 && packed.scalar_type() == at::kFloat && packed.is_contiguous() &&
                  N % 16 == 0 && packed.numel() == N * K,
              "packed has ", packed.numel(), " values; [", N, ", ", K, "] needs ", N * K,
              " (from f32_pack_tiles)");
}

// y [M, N] float32 = x @ W.T, W as f32_pack_tiles' tiles: the bfloat16 kernel's blocking
// with one float32 FMA per weight. Rows of 16384 columns or more (an output layer's logits)
// are written with non-temporal stores, narrower ones (read by the next layer at once)
// through the cache.
at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  check_f32_operands(x, packed, N);
  const int64_t M = x.size(0), K = x.size(1);
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
#if defined(__AVX512F__)
  float* yp = y.data_ptr<float>();
  for_column_runs<false>(reinterpret_cast<const uint32_t*>(x.data_ptr<float>()), M, K,
                         reinterpret_cast<const uint32_t*>(packed.data_ptr<float>()), N,
                         [&](int64_t) { return StoreRows<float>{yp, N, N >= 16384}; });
#else
  TORCH_CHECK(false, "f32_linear needs AVX-512; use PyTorch's matmul on this CPU");
#endif
  return y;
}

// f32_linear(x, packed, N).max(dim=-1).indices without the logits; -1 as in bf16_linear_argmax.
at::Tensor f32_linear_argmax(const at::Tensor& x, const at::Tensor& packed, int64_t N) {
  check_f32_operands(x, packed, N);
  const int64_t M = x.size(0), K = x.size(1);
  auto tokens = at::empty({M}, x.options().dtype(at::kLong));
  if (M == 0) return tokens;
#if defined(__AVX512F__)
  argmax_over_columns<false>(reinterpret_cast<const uint32_t*>(x.data_ptr<float>()), M, K,
                             reinterpret_cast<const uint32_t*>(packed.data_ptr<float>()), N,
                             tokens.data_ptr<int64_t>());
#else
  TORCH_CHECK(false, "f32_linear_argmax needs AVX-512");
#endif
  return tokens;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inflight, m) {
  m.def("bf16_pack_pairs(Tensor weight) -> Tensor");
  m.impl("bf16_pack_pairs", c10::DispatchKey::CPU, &bf16_pack_pairs);
  m.def("bf16_linear(Tensor x, Tensor packed, int N, bool float32_out=False) -> Tensor");
  m.impl("bf16_linear", c10::DispatchKey::CPU, &bf16_linear);
  m.def("bf16_linear_argmax(Tensor x, Tensor packed, int N) -> Tensor");
  m.impl("bf16_linear_argmax", c10::DispatchKey::CPU, &bf16_linear_argmax);
  m.def("bf16_linear_available() -> bool", &bf16_linear_available);
  m.def("f32_pack_tiles(Tensor weight) -> Tensor");
  m.impl("f32_pack_tiles", c10::DispatchKey::CPU, &f32_pack_tiles);
  m.def("f32_linear(Tensor x, Tensor packed, int N) -> Tensor");
  m.impl("f32_linear", c10::DispatchKey::CPU, &f32_linear);
  m.def("f32_linear_argmax(Tensor x, Tensor packed, int N) -> Tensor");
  m.impl("f32_linear_argmax", c10::DispatchKey::CPU, &f32_linear_argmax);
  m.def("f32_linear_available() -> bool", &f32_linear_available);
}
