// y = x @ W.T with AMX tiles, W read as 4-bit GGUF blocks (Q4_0, Q4_1) and rounded to
// bfloat16 in registers: the same products as csrc/amx_linear.cpp on the dense bfloat16
// weight, from 6 bits a weight instead of 16.
//
//   gguf_amx_pack(blocks, qtype) -> packed      once, at load time
//   gguf_amx_linear(x, packed, N, float32_out) -> y
//
//   blocks:  [N, K / 32 * type_size] uint8, a GGUF tensor's rows (row n = output feature n)
//   packed:  [N / 16][K / 64][16][48] uint8: for each 16-column strip, each 64 of K and each
//            column c: 32 bytes whose byte j holds the 4-bit q of weight j of the first
//            block (low nibble) and of the second (high nibble), then that column's d and m
//            of both blocks as float32 (d0, d1, m0, m1; Q4_0's m is -8 d). 6 bits a weight,
//            one strip streamed as one run.
//   x:       [M, K] bfloat16, contiguous;  y: [M, N] bfloat16 (float32 sums rounded once,
//            to nearest even) or float32
//
// Exactness: w = q * d + m is computed with one fused multiply-add (q * d is exact in
// float32, so this is the loader's float32 weight) and rounded to bfloat16 to nearest even,
// as the dense weight's .to(torch.bfloat16) does; each output then sums the same bfloat16
// products in the same order of K as amx_linear (TDPBF16PS products of two bfloat16 are
// exact in float32, so swapping the operands changes nothing): y is bit-identical to
// amx_linear(x, amx_pack(weight.bfloat16())).
//
// Why: on the Intel Xeon with AMX this project measures (2 cores), a decode step's linears
// read every weight from memory once; at 9-128 rows amx_linear streams SmolLM2's 212 MB of
// bfloat16 decoder weights at ~20 GB/s (10-26 ms a step), where these blocks are 80 MB.
// Measured there (120 fused decoder linears, weights from DRAM): 1.20-1.25x amx_linear's
// speed at 1-16 rows, 1.10-1.18x at 64-128, 0.92-0.96x at 192-256; dequantising costs
// ~3 ns per 64 weights on a core and does not overlap the DRAM reads well, so the gain is
// far from the 2.7x in bytes.
//
// How: the weight is the A operand (16 output features x 32 of K per tile: a column's
// dequantised 32 weights are one tile row, with no transposes), x^T the B operand (16
// pair rows of K x 16 tokens, built once per call). A thread's strip pairs (32 features)
// go in turn; each is dequantised into one of two per-thread scratches of A tiles (a
// 16-entry bfloat16 table per block, looked up with one vpermw per 32 weights) while the
// previous one's tiles are multiplied, every block of 32 tokens with 2 x 2 tile
// accumulators, and the pair after that is fetched into L2 (software prefetch, 1.05-1.1x).
// Accumulators hold y^T; they are transposed on the way out.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"

namespace {

constexpr int64_t kStrip = 16;      // output features per A tile
constexpr int64_t kUnitBytes = 48;  // one column's 64 weights: 32 bytes of nibbles, 4 floats
enum QType : int64_t { kQ4_0 = 2, kQ4_1 = 3 };

int64_t q4_type_size(int64_t qtype) {
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1, "gguf_amx_linear takes Q4_0 or Q4_1 blocks, not ",
              qtype);
  return qtype == kQ4_1 ? 20 : 18;
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

#if defined(INFLIGHT_AMX)

// 64 of K (unit kp) of one strip pair's weights (features 32 p .. 32 p + 31) into A tiles:
// scratch[(k * 2 + s) * 512 ...] is tile (k-step k, strip s): 16 rows of 32 bfloat16.
inline void dequantize_unit(const uint8_t* strips, int64_t units_per_strip, int64_t kp,
                            at::BFloat16* scratch) {
  const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i low_nibble = _mm512_set1_epi16(0x0F);
  for (int64_t s = 0; s < 2; ++s) {
    const uint8_t* unit = strips + ((s * units_per_strip + kp) * kStrip) * kUnitBytes;
    at::BFloat16* tile0 = scratch + ((2 * kp) * 2 + s) * 512;
    at::BFloat16* tile1 = scratch + ((2 * kp + 1) * 2 + s) * 512;
    for (int64_t c = 0; c < kStrip; ++c, unit += kUnitBytes) {
      const float* dm = reinterpret_cast<const float*>(unit + 32);
      const __m512i q =
          _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit)));
      const __m256bh lut0 = _mm512_cvtneps_pbh(
          _mm512_fmadd_ps(iota, _mm512_set1_ps(dm[0]), _mm512_set1_ps(dm[2])));
      const __m256bh lut1 = _mm512_cvtneps_pbh(
          _mm512_fmadd_ps(iota, _mm512_set1_ps(dm[1]), _mm512_set1_ps(dm[3])));
      const __m512i w0 = _mm512_permutexvar_epi16(_mm512_and_si512(q, low_nibble),
                                                  _mm512_castsi256_si512((__m256i)lut0));
      const __m512i w1 = _mm512_permutexvar_epi16(_mm512_srli_epi16(q, 4),
                                                  _mm512_castsi256_si512((__m256i)lut1));
      _mm512_store_si512(tile0 + c * 32, w0);
      _mm512_store_si512(tile1 + c * 32, w1);
    }
  }
}

// x [M, K] -> B tiles: xt[(k * tiles + t) * 512 ...] is tile (k-step k, token tile t): 16 pair
// rows r of 16 tokens j, (x[16 t + j][32 k + 2 r], x[16 t + j][32 k + 2 r + 1]); tokens past
// M are zeros.
void build_xt(const at::BFloat16* x, int64_t M, int64_t K, int64_t tiles, at::BFloat16* xt) {
  const int64_t ksteps = K / 32;
  const int64_t row_dwords = K / 2;
  const auto* x32 = reinterpret_cast<const int32_t*>(x);
  // Small steps build it on this thread: a fork and join of the thread pool costs more.
  const int64_t grain = tiles <= 4 ? ksteps * tiles : 1;
  at::parallel_for(0, ksteps * tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t k = w / tiles, t = w % tiles;
      const int64_t valid = std::min<int64_t>(16, M - 16 * t);
      const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1u);
      const __m512i rows = _mm512_mullo_epi32(
          _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
          _mm512_set1_epi32(static_cast<int32_t>(row_dwords)));
      const int32_t* base = x32 + (16 * t) * row_dwords + 16 * k;
      auto* out = reinterpret_cast<int32_t*>(xt + w * 512);
      for (int64_t r = 0; r < 16; ++r) {
        const __m512i v =
            _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, rows, base + r, 4);
        _mm512_store_si512(out + r * 16, v);
      }
    }
  });
}

// A 16 x 16 float32 accumulator tile holding y^T (rows: features f0.., columns: tokens
// t0..) into y's rows t0 .. t0 + tokens - 1, columns f0 .. f0 + 15.
template <typename out_t>
inline void store_transposed(const float* tile, int64_t tokens, out_t* y, int64_t ldy) {
  const __m512i column = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80,
                                          64, 48, 32, 16, 0);
  for (int64_t j = 0; j < tokens; ++j) {
    const __m512 v = _mm512_i32gather_ps(column, tile + j, 4);
    if constexpr (std::is_same_v<out_t, float>) {
      _mm512_storeu_ps(y + j * ldy, v);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + j * ldy), (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

// Strip pair (A tiles in `a`, ksteps of them per strip) against token tiles t0 (and t0 + 1
// unless ONE_TOKEN_TILE), features from f0, into y.
// While it runs, units [unit_begin, unit_end) of the next strip pair (`next`, or none) are
// dequantised into `next_a`, one per two k-steps (a whole strip pair dequantised up front,
// then its products, took 1.2-1.3x as long), and the same units of the pair after that
// (`after_next`, or none) are fetched into L2.
template <bool ONE_TOKEN_TILE, typename out_t>
void token_block(const at::BFloat16* a, const at::BFloat16* xt, int64_t ksteps, int64_t tiles,
                 int64_t t0, int64_t M, out_t* y, int64_t N, int64_t f0, const uint8_t* next,
                 const uint8_t* after_next, int64_t units_per_strip, int64_t unit_begin,
                 int64_t unit_end,
                 at::BFloat16* next_a) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (!ONE_TOKEN_TILE) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < ksteps; ++k) {
    const int64_t unit = unit_begin + k / 2;
    if (next != nullptr && k % 2 == 0 && unit < unit_end) {
      if (after_next != nullptr) {  // the same unit of the pair after, into L2
        for (int64_t s = 0; s < 2; ++s) {
          const char* u = reinterpret_cast<const char*>(
              after_next + (s * units_per_strip + unit) * kStrip * kUnitBytes);
          for (int64_t o = 0; o < kStrip * kUnitBytes; o += 64) _mm_prefetch(u + o, _MM_HINT_T1);
        }
      }
      dequantize_unit(next, units_per_strip, unit, next_a);
    }
    _tile_loadd(4, a + (k * 2) * 512, 64);
    _tile_loadd(5, a + (k * 2 + 1) * 512, 64);
    _tile_loadd(6, xt + (k * tiles + t0) * 512, 64);
    _tile_dpbf16ps(0, 4, 6);  // C[strip 0][t0]
    _tile_dpbf16ps(1, 5, 6);  // C[strip 1][t0]
    if constexpr (!ONE_TOKEN_TILE) {
      _tile_loadd(7, xt + (k * tiles + t0 + 1) * 512, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float c[256];
  const int64_t first = std::min<int64_t>(16, M - 16 * t0);
  out_t* out = y + (16 * t0) * N + f0;
  _tile_stored(0, c, 64);
  store_transposed(c, first, out, N);
  _tile_stored(1, c, 64);
  store_transposed(c, first, out + 16, N);
  if constexpr (!ONE_TOKEN_TILE) {
    const int64_t second = std::min<int64_t>(16, M - 16 * (t0 + 1));
    out += 16 * N;
    _tile_stored(2, c, 64);
    store_transposed(c, second, out, N);
    _tile_stored(3, c, 64);
    store_transposed(c, second, out + 16, N);
  }
}

// This thread's A-tile scratch of at least `elements` (64-byte aligned, kept between calls:
// zero-filling or faulting in up to 96 KiB per call showed in the profile).
at::BFloat16* scratch_tiles(int64_t elements) {
  thread_local std::vector<at::BFloat16> storage;
  if (static_cast<int64_t>(storage.size()) < elements + 32) storage.resize(elements + 32);
  return reinterpret_cast<at::BFloat16*>(
      (reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t(63));
}

#endif  // INFLIGHT_AMX

bool gguf_amx_linear_available() {
#if defined(INFLIGHT_AMX) && defined(__AVX512BF16__) && defined(__AVX512BW__)
  return inflight_amx::tile_permission();
#else
  return false;
#endif
}

at::Tensor gguf_amx_pack(const at::Tensor& blocks_in, int64_t qtype) {
  const at::Tensor blocks = blocks_in.contiguous();
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte,
              "blocks must be a uint8 [N, row_bytes] tensor");
  const int64_t size = q4_type_size(qtype);
  const int64_t N = blocks.size(0), row_bytes = blocks.size(1);
  TORCH_CHECK(row_bytes % size == 0, "row of ", row_bytes, " bytes is not whole blocks");
  const int64_t K = row_bytes / size * 32;
  TORCH_CHECK(N % 32 == 0 && K % 64 == 0 && K > 0,
              "gguf_amx_pack needs N a multiple of 32 and K of 64, got [", N, ", ", K, "]");
  const int64_t units = K / 64;
  auto packed = at::empty({N / kStrip * units * kStrip * kUnitBytes}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  const int64_t nibbles_at = qtype == kQ4_1 ? 4 : 2;
  at::parallel_for(0, N / kStrip, 1, [&](int64_t begin, int64_t end) {
    for (int64_t strip = begin; strip < end; ++strip)
      for (int64_t kp = 0; kp < units; ++kp)
        for (int64_t c = 0; c < kStrip; ++c) {
          const uint8_t* row = src + (strip * kStrip + c) * row_bytes;
          uint8_t* unit = dst + ((strip * units + kp) * kStrip + c) * kUnitBytes;
          float dm[4];
          for (int64_t h = 0; h < 2; ++h) {
            const uint8_t* block = row + (2 * kp + h) * size;
            const float d = half_at(block);
            dm[h] = d;
            dm[2 + h] = qtype == kQ4_1 ? half_at(block + 2) : -8.0f * d;
          }
          for (int64_t j = 0; j < 32; ++j) {
            uint8_t byte = 0;
            for (int64_t h = 0; h < 2; ++h) {
              const uint8_t* qs = row + (2 * kp + h) * size + nibbles_at;
              const uint8_t q = j < 16 ? (qs[j] & 0x0F) : (qs[j - 16] >> 4);
              byte |= static_cast<uint8_t>(q << (4 * h));
            }
            unit[j] = byte;
          }
          std::memcpy(unit + 32, dm, sizeof(dm));
        }
  });
  return packed;
}

at::Tensor gguf_amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                           bool float32_out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "x must be a contiguous bfloat16 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.dim() == 1 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  K % 64 == 0 && N % 32 == 0 && packed.numel() == N * K / 64 * kUnitBytes,
              "packed has ", packed.numel(), " bytes; [", N, ", ", K, "] needs ",
              N * K / 64 * kUnitBytes, " (from gguf_amx_pack)");
  auto y = at::empty({M, N}, x.options().dtype(float32_out ? at::kFloat : at::kBFloat16));
  if (M == 0) return y;
#if defined(INFLIGHT_AMX) && defined(__AVX512BF16__) && defined(__AVX512BW__)
  TORCH_CHECK(inflight_amx::tile_permission(),
              "the OS did not grant AMX tile data to this process");
  const int64_t ksteps = K / 32, units = K / 64, tiles = (M + 15) / 16;
  auto xt = at::empty({ksteps * tiles * 512}, x.options());
  build_xt(x.data_ptr<at::BFloat16>(), M, K, tiles, xt.data_ptr<at::BFloat16>());
  const at::BFloat16* xtp = xt.data_ptr<at::BFloat16>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const int64_t pair_bytes = 2 * units * kStrip * kUnitBytes;
  auto run = [&](auto* yp) {
    at::parallel_for(0, N / 32, 1, [&](int64_t begin, int64_t end) {
      // Two scratches of one strip pair's A tiles (K / 32 k-steps x 2 strips x 1 KiB
      // each): the next pair is dequantised into one while the other's are multiplied.
      at::BFloat16* scratch = scratch_tiles(2 * ksteps * 2 * 512);
      at::BFloat16* a[2] = {scratch, scratch + ksteps * 2 * 512};
      inflight_amx::load_full_tiles();
      for (int64_t kp = 0; kp < units; ++kp)
        dequantize_unit(wp + begin * pair_bytes, units, kp, a[0]);
      const int64_t blocks = (tiles + 1) / 2;
      // Each token block dequantises its share of the next pair's units.
      const int64_t share = (units + blocks - 1) / blocks;
      for (int64_t p = begin; p < end; ++p) {
        const at::BFloat16* cur = a[(p - begin) % 2];
        at::BFloat16* nxt = a[(p - begin + 1) % 2];
        const uint8_t* next = p + 1 < end ? wp + (p + 1) * pair_bytes : nullptr;
        const uint8_t* after_next = p + 2 < end ? wp + (p + 2) * pair_bytes : nullptr;
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t t = 2 * b, u0 = b * share, u1 = std::min(units, u0 + share);
          if (t + 2 <= tiles) {
            token_block<false>(cur, xtp, ksteps, tiles, t, M, yp, N, 32 * p, next, after_next,
                               units, u0, u1, nxt);
          } else {
            token_block<true>(cur, xtp, ksteps, tiles, t, M, yp, N, 32 * p, next, after_next,
                              units, u0, u1, nxt);
          }
        }
      }
      _tile_release();
    });
  };
  if (float32_out) {
    run(y.data_ptr<float>());
  } else {
    run(y.data_ptr<at::BFloat16>());
  }
#else
  TORCH_CHECK(false, "gguf_amx_linear needs AMX tiles and AVX512-BF16");
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inflight, m) {
  m.def("gguf_amx_pack(Tensor blocks, int qtype) -> Tensor");
  m.impl("gguf_amx_pack", c10::DispatchKey::CPU, &gguf_amx_pack);
  m.def("gguf_amx_linear(Tensor x, Tensor packed, int N, bool float32_out=False) -> Tensor");
  m.impl("gguf_amx_linear", c10::DispatchKey::CPU, &gguf_amx_linear);
  m.def("gguf_amx_linear_available() -> bool", &gguf_amx_linear_available);
}
