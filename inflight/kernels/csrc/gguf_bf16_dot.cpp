// y = x @ W.T from 4-bit GGUF blocks (Q4_0, Q4_1) with bfloat16 dot products: the
// small-step kernel of bfloat16 models on CPUs with AVX512-BF16.
//
//   gguf_pack_bf16_dot(blocks, qtype) -> packed            once, at load time
//   gguf_matmul(x, packed, qtype | 256) -> y               every small step
//
//   blocks:  [N, K / 32 * type_size] uint8, as gguf_pack takes them
//   packed:  [N, bf16_dot_row_bytes(K)] uint8; per row, with the blocks rounded up to an
//            even count nb (a zero block pads an odd count) and taken in pairs:
//              nb / 2 x 32 bytes  each pair's nibble bytes, interleaved (below)
//              nb x float32 d     the blocks' scales, in block order
//              nb x float32 m     their offsets (Q4_1's m; Q4_0: -8 d)
//   x:       [M, K] float32, rounded to bfloat16 inside (round to nearest even)
//   y:       [M, N] float32
//
// Why: with one sequence a step, the float32 kernel (csrc/gguf_matmul.cpp) spends 8 vector
// operations on each block of 32 weights (two variable shifts, two permutes, a table FMA
// and two FMAs): on an AMD EPYC Zen 4, which runs 512-bit operations in two halves, that
// made the 30 layers' matmuls take 3.8-4.0 ms a token against 2.1 ms to stream their bytes.
// Here a pair of blocks (64 weights) costs 7: a widening load, a shift, two word permutes
// that turn nibbles into bfloat16 integers 0..15 (exact), two vdpbf16ps and one FMA by the
// two blocks' scales.
//
// Arithmetic: a weight is w = q d + m with q in 0..15, so a block's share of the dot product
// is d (q . x) + m sum(x). q . x is computed from x rounded to bfloat16 (each product is
// exact, the sums float32); sum(x) from the float32 x. The weights themselves are exact:
// only the activations are rounded, as in every bfloat16 matmul of the model's larger
// steps.
//
// Layout: vdpbf16ps lane k sums the products of words 2k and 2k + 1. The nibble bytes of a
// pair are stored so that the lanes alternate between the pair's two blocks (lane k holds
// block k % 2, GGUF bytes 2 (k / 2) and 2 (k / 2) + 1): the scales then enter as one
// 8-byte broadcast [d_a, d_b, d_a, d_b, ...]. The activations are laid out the same way
// once per call (four two-source permutes and two conversions per pair, shared by every
// weight row).

#include "gguf_bf16_dot.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace inflight_gguf {
namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kPairBytes = 32;  // nibble bytes of two blocks
constexpr int64_t kPrefetchGroups = 2;
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3;

int64_t even_blocks(int64_t K) { return (K / kBlock + 1) / 2 * 2; }

// Byte j of a pair's 32: lane j / 2, so block (j / 2) % 2 of the pair, GGUF byte
// 2 (j / 4) + j % 2 of that block.
inline int64_t pair_block(int64_t j) { return (j / 2) % 2; }
inline int64_t pair_byte(int64_t j) { return 2 * (j / 4) + j % 2; }

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

#if defined(__AVX512BF16__)

// x rounded to bfloat16 in the packed lane order: per row and pair, 32 words against the
// low nibbles (weights 0..15 of each block) then 32 against the high ones (16..31);
// xsum[row][block] the float32 sum of the block's 32 inputs (zero past the last block).
struct Activations {
  std::vector<uint16_t> words;  // [M][pairs][64]
  std::vector<float> xsum;      // [M][nb]
};

Activations prepare(const float* x, int64_t M, int64_t K) {
  const int64_t blocks = K / kBlock, nb = even_blocks(K), pairs = nb / 2;
  Activations a{std::vector<uint16_t>(M * pairs * 64), std::vector<float>(M * nb, 0.0f)};
  // Words 0..15 (lanes 0..7) from inputs 0..7 of both blocks, in pairs; 16..31 from 8..15.
  const __m512i first = _mm512_setr_epi32(0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 20, 21, 6, 7, 22, 23);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    for (int64_t p = 0; p < pairs; ++p) {
      const float* xa = row + 2 * p * kBlock;
      const bool has_b = 2 * p + 1 < blocks;
      const __m512 a_lo = _mm512_loadu_ps(xa), a_hi = _mm512_loadu_ps(xa + 16);
      const __m512 b_lo = has_b ? _mm512_loadu_ps(xa + 32) : _mm512_setzero_ps();
      const __m512 b_hi = has_b ? _mm512_loadu_ps(xa + 48) : _mm512_setzero_ps();
      __m512i* out = reinterpret_cast<__m512i*>(a.words.data() + (m * pairs + p) * 64);
      const __m512bh lo = _mm512_cvtne2ps_pbh(_mm512_permutex2var_ps(a_lo, second, b_lo),
                                              _mm512_permutex2var_ps(a_lo, first, b_lo));
      const __m512bh hi = _mm512_cvtne2ps_pbh(_mm512_permutex2var_ps(a_hi, second, b_hi),
                                              _mm512_permutex2var_ps(a_hi, first, b_hi));
      _mm512_storeu_si512(out, (__m512i)lo);
      _mm512_storeu_si512(out + 1, (__m512i)hi);
      a.xsum[m * nb + 2 * p] = _mm512_reduce_add_ps(_mm512_add_ps(a_lo, a_hi));
      if (has_b) a.xsum[m * nb + 2 * p + 1] = _mm512_reduce_add_ps(_mm512_add_ps(b_lo, b_hi));
    }
  }
  return a;
}

// Word j is bfloat16(j % 16): vpermw reads the low 5 bits of each index, so a whole byte
// (low nibble plus one bit of the high one) looks up its low nibble.
__m512i nibble_table() {
  alignas(64) uint16_t words[32];
  for (int j = 0; j < 32; ++j) {
    const float v = static_cast<float>(j % 16);
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    words[j] = static_cast<uint16_t>(bits >> 16);  // exact: small integers
  }
  return _mm512_load_si512(words);
}

// Rows [n0, n0 + R) of the output for activation rows [m0, m0 + M).
template <int M, int R>
void tile(const Activations& a, __m512i table, int64_t m0, int64_t nb, const uint8_t* W,
          int64_t row_bytes, float* y, int64_t N, int64_t n0) {
  const int64_t pairs = nb / 2;
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const char* ahead = reinterpret_cast<const char*>(W + (n0 + kPrefetchGroups * R) * row_bytes);
  const char* ahead_end =
      reinterpret_cast<const char*>(W + std::min(n0 + (kPrefetchGroups + 1) * R, N) * row_bytes);
  const int64_t lines = (R * row_bytes + 63) / 64;
  const int64_t lines_per_pair = (lines + pairs - 1) / pairs;
  for (int64_t p = 0; p < pairs; ++p) {
    for (int64_t l = 0; l < lines_per_pair; ++l) {
      const char* q = ahead + (p * lines_per_pair + l) * 64;
      if (q < ahead_end) _mm_prefetch(q, _MM_HINT_T0);
    }
    __m512i lo[R], hi[R];
    __m512 d[R];
    for (int r = 0; r < R; ++r) {
      const uint8_t* row = W + (n0 + r) * row_bytes;
      const __m512i bytes = _mm512_cvtepu8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + p * kPairBytes)));
      lo[r] = _mm512_permutexvar_epi16(bytes, table);
      hi[r] = _mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table);
      double scales;  // [d_a, d_b] as one 8-byte broadcast
      std::memcpy(&scales, row + pairs * kPairBytes + 2 * p * sizeof(float), sizeof(scales));
      d[r] = _mm512_castpd_ps(_mm512_set1_pd(scales));
    }
    for (int m = 0; m < M; ++m) {
      const __m512i* xw = reinterpret_cast<const __m512i*>(a.words.data() + ((m0 + m) * pairs + p) * 64);
      const __m512bh x_lo = (__m512bh)_mm512_loadu_si512(xw);
      const __m512bh x_hi = (__m512bh)_mm512_loadu_si512(xw + 1);
      for (int r = 0; r < R; ++r) {
        __m512 t = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)lo[r], x_lo);
        t = _mm512_dpbf16_ps(t, (__m512bh)hi[r], x_hi);
        acc[m][r] = _mm512_fmadd_ps(t, d[r], acc[m][r]);
      }
    }
  }
  // The offsets' share, sum over blocks of m * sum(x), 16 blocks at a time.
  for (int r = 0; r < R; ++r) {
    const float* offsets =
        reinterpret_cast<const float*>(W + (n0 + r) * row_bytes + pairs * kPairBytes) + nb;
    for (int m = 0; m < M; ++m) {
      const float* xs = a.xsum.data() + (m0 + m) * nb;
      __m512 sum = acc[m][r];
      for (int64_t b = 0; b < nb; b += 16) {
        const __mmask16 k = nb - b >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (nb - b)) - 1);
        sum = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, offsets + b),
                              _mm512_maskz_loadu_ps(k, xs + b), sum);
      }
      y[(m0 + m) * N + n0 + r] = _mm512_reduce_add_ps(sum);
    }
  }
}

template <int R>
void rows(const Activations& a, __m512i table, int64_t M, int64_t nb, const uint8_t* W, int64_t row_bytes,
          float* y, int64_t N, int64_t n0) {
  int64_t m0 = 0;
  if constexpr (R <= 2) {
    for (; m0 + 8 <= M; m0 += 8) tile<8, R>(a, table, m0, nb, W, row_bytes, y, N, n0);
  }
  for (; m0 + 4 <= M; m0 += 4) tile<4, R>(a, table, m0, nb, W, row_bytes, y, N, n0);
  for (; m0 + 2 <= M; m0 += 2) tile<2, R>(a, table, m0, nb, W, row_bytes, y, N, n0);
  for (; m0 < M; ++m0) tile<1, R>(a, table, m0, nb, W, row_bytes, y, N, n0);
}

#endif  // __AVX512BF16__

}  // namespace

int64_t bf16_dot_row_bytes(int64_t K) { return even_blocks(K) * 24; }

bool bf16_dot_matmul(const float* x, int64_t M, int64_t K, const uint8_t* W, float* y,
                     int64_t N) {
#if defined(__AVX512BF16__)
  const Activations a = prepare(x, M, K);
  const __m512i table = nibble_table();
  const int64_t nb = even_blocks(K), row_bytes = bf16_dot_row_bytes(K);
  // As the float32 kernel: four weight rows per group up to 4 activation rows in flight,
  // two beyond, so every accumulator stays in a register.
  const int R = M < 8 ? 4 : 2;
  const int64_t groups = N / R;
  at::parallel_for(0, groups, 64 / R, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      if (R == 4) {
        rows<4>(a, table, M, nb, W, row_bytes, y, N, g * 4);
      } else {
        rows<2>(a, table, M, nb, W, row_bytes, y, N, g * 2);
      }
    }
  });
  for (int64_t n = groups * R; n < N; ++n) rows<1>(a, table, M, nb, W, row_bytes, y, N, n);
  return true;
#else
  (void)x, (void)M, (void)K, (void)W, (void)y, (void)N;
  return false;
#endif
}

namespace {

bool bf16_dot_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

at::Tensor gguf_pack_bf16_dot(const at::Tensor& blocks_in, int64_t qtype) {
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1,
              "gguf_pack_bf16_dot takes Q4_0 (2) or Q4_1 (3) blocks, not ggml type ", qtype);
  const at::Tensor blocks = blocks_in.contiguous();
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte,
              "blocks must be a uint8 [N, row_bytes] tensor");
  const int64_t size = qtype == kQ4_1 ? 20 : 18;
  TORCH_CHECK(blocks.size(1) % size == 0, "row of ", blocks.size(1), " bytes is not whole blocks");
  const int64_t N = blocks.size(0), num_blocks = blocks.size(1) / size;
  const int64_t K = num_blocks * kBlock, nb = even_blocks(K), pairs = nb / 2;
  const int64_t row_bytes = bf16_dot_row_bytes(K);
  auto packed = at::zeros({N, row_bytes}, blocks.options());  // zeros: the padding block
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const uint8_t* in_row = src + n * blocks.size(1);
      uint8_t* out_row = dst + n * row_bytes;
      float* d = reinterpret_cast<float*>(out_row + pairs * kPairBytes);
      float* m = d + nb;
      for (int64_t b = 0; b < num_blocks; ++b) {
        const uint8_t* in = in_row + b * size;
        d[b] = half_at(in);
        m[b] = qtype == kQ4_1 ? half_at(in + 2) : -8.0f * d[b];
      }
      for (int64_t p = 0; p < pairs; ++p) {
        for (int64_t j = 0; j < kPairBytes; ++j) {
          const int64_t b = 2 * p + pair_block(j);
          if (b >= num_blocks) continue;
          const uint8_t* qs = in_row + b * size + (qtype == kQ4_1 ? 4 : 2);
          out_row[p * kPairBytes + j] = qs[pair_byte(j)];
        }
      }
    }
  });
  return packed;
}

}  // namespace
}  // namespace inflight_gguf

TORCH_LIBRARY_FRAGMENT(inflight, m) {
  m.def("gguf_pack_bf16_dot(Tensor blocks, int qtype) -> Tensor");
  m.impl("gguf_pack_bf16_dot", c10::DispatchKey::CPU, &inflight_gguf::gguf_pack_bf16_dot);
  m.def("gguf_bf16_dot_available() -> bool", &inflight_gguf::bf16_dot_available);
}
