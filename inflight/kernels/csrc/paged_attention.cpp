// Varlen paged attention for the CPU: one call per layer for every sequence in a step,
// prompt chunks and decode tokens alike, reading K/V in place through block tables.
//
//   q:            [T, H, D]   float32 or bfloat16, the step's query tokens, sequence after sequence
//   k_cache:      [num_blocks, KVH, D, block_size]   float32, bfloat16 or int8 (keys transposed)
//   v_cache:      [num_blocks, block_size, KVH, D]   same dtype
//   k_scale, v_scale: [num_blocks, KVH, block_size] float32, only with int8 caches: the
//                 value of a stored int8 x is x * scale (one scale per token and head)
//   block_tables: [S, max_blocks] int32
//   query_start:  [S + 1] int32   tokens of sequence s are q[query_start[s] : query_start[s+1]]
//   seq_lens:     [S] int32       context length of s after this step (cached + new)
//   int8_dots:    an int8 cache's keys scored with int8 dot products where the CPU has
//                 AVX512-VNNI and VBMI (the queries rounded per row, see score_blocks_int8),
//                 and (head_dim 64) its values weighed with int16 dot products (the
//                 probabilities rounded per row to 15 bits, see weigh_values_int16)
//   bf16_dots:    bfloat16 queries on a bfloat16 cache scored (and their values weighed)
//                 with bfloat16 dot products where the CPU has AVX512-BF16; false: float32
//                 FMAs on the queries' values, the result rounded to bfloat16 once, as
//                 passing them widened to float32 and rounding the float32 result gives
//   returns:      [T, H, D] in q's dtype (float32 or bfloat16; computed in float32)
//
// Query i of sequence s sits at position seq_lens[s] - q_len + i and sees keys 0..position
// (causal over the cached prefix and the chunk). Work is split into (sequence, query tile,
// KV head) items; the G = H / KVH query heads that share a KV head are done together. A
// decode token's item holds all its KV heads, whose keys are scored block by block
// (score_heads_by_block).
//
// Why keys are stored transposed: with a block's keys laid out [D][block_size], the scores
// of 16 keys for one query are 16 lanes of one vector accumulated over d by broadcast FMAs,
// with no horizontal reductions. Values stay row-major: out += p * v is a plain AXPY.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "vec_math.h"

namespace {

using namespace inflight_vec;

constexpr int64_t kQueryTile = 16;
constexpr int64_t kPrefetchBlocks = 4;
// The next work item's first kNextItemBlocks blocks (K and V of all its KV heads) are
// fetched kNextItemLines cache lines at a time while this item's values are weighed, where
// the memory bus would otherwise idle: its value rows came into L2 with the keys' pass.
// Intel Xeon with AMX (model 167), `decode_attention --order engine --kv-cache-dtype
// int8`: 0.60-0.64 against 0.65-0.68 ms a layer (bfloat16 cache: level, 1.00-1.04 ms);
// 8 lines / 8 blocks 0.60-0.64, 32 / 32 0.64-0.71.
constexpr int64_t kNextItemLines = 16;
constexpr int64_t kNextItemBlocks = 16;

// Into L2, not L1 (locality 1: prefetcht2). A few blocks ahead is 16-32 KiB, as much as
// L1 holds: fetched into L1 it evicts the block being worked on. On an AMD EPYC (Zen 4),
// 57 sequences x 450 tokens x 30 layers from DRAM: 1.0-1.1 against 1.3-1.6 ms per layer.
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 1);
}
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Shape {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
};

struct WorkItem {
  int32_t seq;
  int32_t q_begin;  // first query of the tile, as an offset within the sequence
  int32_t q_end;
  int32_t kv_head_begin;  // KV heads done one after the other by this item
  int32_t kv_head_end;
};

// Cache lines to fetch a few at a time (see kNextItemLines): spans of memory, in order.
struct NextItemFetch {
  std::vector<std::pair<const char*, int64_t>> spans;  // (first byte, bytes)
  size_t span = 0;
  int64_t offset = 0;
  void clear() { spans.clear(); span = 0; offset = 0; }
  void add(const void* p, int64_t bytes) { spans.emplace_back(static_cast<const char*>(p), bytes); }
  void step(int64_t lines) {
    for (; lines > 0 && span < spans.size(); --lines) {
      __builtin_prefetch(spans[span].first + offset, 0, 1);
      offset += 64;
      if (offset >= spans[span].second) { ++span; offset = 0; }
    }
  }
};

// ---------------------------------------------------------------- vector helpers (AVX-512)
#if defined(__AVX512F__)
// Scores of NR query rows against the 16 keys of each of NB blocks (keys stored [D][16]).
// NR and NB are compile-time so the NR * NB accumulators live in registers; NB > 1 gives a
// few query rows (a decode token's heads) enough independent FMA chains to hide latency.
template <int NR, int NB, typename kv_t>
inline void score_blocks(const float* queries, int64_t D, const kv_t* const* kb, float* scores,
                         int64_t row_stride, int64_t key_stride) {
  __m512 acc[NR * NB];
  for (int i = 0; i < NR * NB; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m512 kd[NB];
    for (int b = 0; b < NB; ++b) kd[b] = load16(kb[b] + d * key_stride);
    for (int j = 0; j < NR; ++j) {
      const __m512 qd = _mm512_set1_ps(queries[j * D + d]);
      for (int b = 0; b < NB; ++b) acc[j * NB + b] = _mm512_fmadd_ps(qd, kd[b], acc[j * NB + b]);
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int b = 0; b < NB; ++b) _mm512_storeu_ps(scores + j * row_stride + b * 16, acc[j * NB + b]);
}

#if defined(__AVX512BF16__)
// score_blocks for bfloat16 queries and keys with bfloat16 dot products (vdpbf16ps: two
// multiply-adds per float32 lane). A 64-byte load holds key rows d and d+1 of a block;
// one permute interleaves them into (k[d][i], k[d+1][i]) pairs, against the broadcast
// query pair (q[d], q[d+1]). Per two dimensions: one load, one permute and NR dot products
// per block, where converting to float32 takes two loads, four conversions and 2 NR FMAs.
// The queries are unscaled (exactly the model's bfloat16 values); the scale comes after.
// Key rows d and d+1 of a tile of 16 keys (32 bytes each, `key_stride` elements apart).
inline __m512i load_rows(const at::BFloat16* row, int64_t key_stride) {
  if (key_stride == 16) return _mm512_loadu_si512(row);
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + key_stride));
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

template <int NR, int NB>
inline void score_blocks_bf16(const at::BFloat16* queries, int64_t D,
                              const at::BFloat16* const* kb, float* scores, int64_t row_stride,
                              int64_t key_stride, float scale) {
  static const __m512i interleave = [] {
    alignas(64) int16_t lanes[32];
    for (int i = 0; i < 16; ++i) {
      lanes[2 * i] = static_cast<int16_t>(i);
      lanes[2 * i + 1] = static_cast<int16_t>(16 + i);
    }
    return _mm512_load_si512(lanes);
  }();
  __m512 acc[NR * NB];
  for (int i = 0; i < NR * NB; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 2) {
    __m512i kd[NB];
    for (int b = 0; b < NB; ++b)
      kd[b] = _mm512_permutexvar_epi16(interleave, load_rows(kb[b] + d * key_stride, key_stride));
    for (int j = 0; j < NR; ++j) {
      uint32_t pair;
      std::memcpy(&pair, queries + j * D + d, sizeof(pair));
      const __m512i qd = _mm512_set1_epi32(static_cast<int>(pair));
      for (int b = 0; b < NB; ++b)
        acc[j * NB + b] = _mm512_dpbf16_ps(acc[j * NB + b], (__m512bh)qd, (__m512bh)kd[b]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int j = 0; j < NR; ++j)
    for (int b = 0; b < NB; ++b)
      _mm512_storeu_ps(scores + j * row_stride + b * 16, _mm512_mul_ps(acc[j * NB + b], sc));
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
// score_blocks for an int8 cache with int8 dot products (vpdpbusd: four u8 x s8 products
// summed into each int32 lane), instead of widening every key to float32. The queries come
// quantised per row (quantize_query: q = step * s, s a signed byte, four dimensions to a
// 32-bit word, and the row's sum of s). One 64-byte load holds key rows 4g .. 4g + 3 of a
// tile (the cache's [D][16] layout) and one byte permute (vpermb) makes each 32-bit lane one
// key's four dimensions; flipping each key byte's top bit makes it the unsigned k + 128, and
// the offset comes back out once per row: q . k = step * ((k + 128) . s - 128 sum s). (An
// earlier version biased the queries instead, which needed each key's dimension sum: one
// more vpdpbusd per four dimensions of a tile.) The integer sums are exact (|(k + 128) . s|
// <= 255 * 127 * D), so the only change from the float32 path is the queries' rounding to
// int8 steps (at most half a step each, step = max|q| / 127), of the size of the keys' own.
inline __m512i load_key_quad(const int8_t* row, int64_t key_stride) {
  if (key_stride == 16) return _mm512_loadu_si512(row);
  __m512i rows = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
  for (int j = 1; j < 4; ++j) {
    const __m128i r = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + j * key_stride));
    rows = _mm512_inserti32x4(rows, r, j);
  }
  return rows;
}

template <int NR, int NB>
inline void score_blocks_int8(const uint32_t* words, const float* steps, const int32_t* sums,
                              int64_t D, const int8_t* const* kb, float* scores,
                              int64_t row_stride, int64_t key_stride) {
  static const __m512i by_key = [] {  // byte 4 i + j <- row j, key i
    alignas(64) int8_t lanes[64];
    for (int p = 0; p < 64; ++p) lanes[p] = static_cast<int8_t>((p % 4) * 16 + p / 4);
    return _mm512_load_si512(lanes);
  }();
  const __m512i top_bits = _mm512_set1_epi8(static_cast<char>(0x80));
  const int64_t groups = D / 4;
  __m512i acc[NR * NB];
  for (int i = 0; i < NR * NB; ++i) acc[i] = _mm512_setzero_si512();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i kd[NB];
    for (int b = 0; b < NB; ++b)
      kd[b] = _mm512_xor_si512(
          _mm512_permutexvar_epi8(by_key, load_key_quad(kb[b] + 4 * g * key_stride, key_stride)),
          top_bits);
    for (int j = 0; j < NR; ++j) {
      const __m512i qd = _mm512_set1_epi32(static_cast<int>(words[j * groups + g]));
      for (int b = 0; b < NB; ++b) acc[j * NB + b] = _mm512_dpbusd_epi32(acc[j * NB + b], kd[b], qd);
    }
  }
  for (int j = 0; j < NR; ++j) {
    const __m512 step = _mm512_set1_ps(steps[j]);
    const __m512i offset = _mm512_set1_epi32(128 * sums[j]);
    for (int b = 0; b < NB; ++b) {
      const __m512i dot = _mm512_sub_epi32(acc[j * NB + b], offset);
      _mm512_storeu_ps(scores + j * row_stride + b * 16, _mm512_mul_ps(_mm512_cvtepi32_ps(dot), step));
    }
  }
}
#endif

// Lane k of permutex2var(even, index, odd): element first + k / 2 of even (k even) or of
// odd (k odd), which puts split even/odd dimensions back in order.
inline __m512i interleave_index(int first) {
  alignas(64) int32_t lanes[16];
  for (int k = 0; k < 16; ++k) lanes[k] = (k % 2 ? 16 : 0) + first + k / 2;
  return _mm512_load_si512(lanes);
}

// out[NR][16 * CH] = probs[NR][:num_keys] @ V. Walks V block by block: block_rows(b) is
// the first value row of block b, the next rows follow at row_stride elements.
template <int NR, int CH, typename kv_t, typename BlockFn>
inline void weigh_values(const float* probs, int64_t prob_stride, int64_t num_keys,
                         int64_t block_size, BlockFn block_rows, int64_t row_stride, float* out,
                         int64_t D) {
  __m512 acc[NR * CH];
  for (int i = 0; i < NR * CH; ++i) acc[i] = _mm512_setzero_ps();
  // bfloat16 values: one 64-byte load holds 32 of them, and its even and odd elements
  // become float32 with one shift or one mask each (instead of a widening and a shift
  // per 16). Accumulator pair (2c, 2c + 1) then holds dimensions 32c + (0, 2, ...) and
  // 32c + (1, 3, ...): the same float32 FMAs in the same order, only the lanes permuted,
  // and put back in order once at the end.
  constexpr bool split = std::is_same_v<kv_t, at::BFloat16> && CH % 2 == 0;
  const __m512i high_half = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t first = 0; first < num_keys; first += block_size) {
    const kv_t* v = block_rows(first / block_size);
    const int64_t n = std::min(block_size, num_keys - first);
    for (int64_t t = 0; t < n; ++t, v += row_stride) {
      __m512 vc[CH];
      if constexpr (split) {
        for (int c = 0; c < CH / 2; ++c) {
          const __m512i raw = _mm512_loadu_si512(v + c * 32);
          vc[2 * c] = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
          vc[2 * c + 1] = _mm512_castsi512_ps(_mm512_and_si512(raw, high_half));
        }
      } else {
        for (int c = 0; c < CH; ++c) vc[c] = load16(v + c * 16);
      }
      for (int j = 0; j < NR; ++j) {
        const __m512 p = _mm512_set1_ps(probs[j * prob_stride + first + t]);
        for (int c = 0; c < CH; ++c) acc[j * CH + c] = _mm512_fmadd_ps(p, vc[c], acc[j * CH + c]);
      }
    }
  }
  if constexpr (split) {
    static const __m512i first_half = interleave_index(0), second_half = interleave_index(8);
    for (int j = 0; j < NR; ++j)
      for (int c = 0; c < CH / 2; ++c) {
        const __m512 even = acc[j * CH + 2 * c], odd = acc[j * CH + 2 * c + 1];
        _mm512_storeu_ps(out + j * D + c * 32, _mm512_permutex2var_ps(even, first_half, odd));
        _mm512_storeu_ps(out + j * D + c * 32 + 16, _mm512_permutex2var_ps(even, second_half, odd));
      }
    return;
  }
  for (int j = 0; j < NR; ++j)
    for (int c = 0; c < CH; ++c) _mm512_storeu_ps(out + j * D + c * 16, acc[j * CH + c]);
}
#if defined(__AVX512BF16__)
// weigh_values for bfloat16 values with bfloat16 dot products (vdpbf16ps), for bfloat16
// queries against a bfloat16 cache: the probabilities are rounded to bfloat16 (relative
// error at most 2^-9 each, the size of the output's own final rounding to bfloat16) and
// each instruction takes two tokens: unpacking value rows t and t + 1 word by word puts
// (v[t][d], v[t+1][d]) side by side, against the broadcast pair (p[t], p[t+1]). Per two
// tokens and 32 dimensions: two loads, two unpacks and 2 NR dot products, where widening
// to float32 takes 4 NR FMAs. The unpacks work within 128-bit lanes, so accumulator pair
// (2c, 2c + 1) holds dimensions 32c + {0-3, 8-11, 16-19, 24-27} and {4-7, ..., 28-31}, put
// back in order once at the end. D = 32 CH / 2, CH even.
template <int NR, int CH, typename BlockFn>
inline void weigh_values_bf16(const float* probs, int64_t prob_stride, int64_t num_keys,
                              int64_t padded_keys, int64_t block_size, BlockFn block_rows,
                              int64_t row_stride, float* out, int64_t D) {
  static_assert(CH % 2 == 0, "32 dimensions per accumulator pair");
  // The probabilities as bfloat16, row after row: (p[t], p[t+1]) is one 32-bit word for
  // even t. Keys past num_keys (up to the padded length) have probability 0.
  thread_local std::vector<uint16_t> pairs;
  const int64_t width = (padded_keys + 31) / 32 * 32;
  pairs.resize(NR * width);
  for (int j = 0; j < NR; ++j) {
    const float* p = probs + j * prob_stride;
    for (int64_t t = 0; t < width; t += 32) {
      const __mmask16 lo = t < padded_keys ? 0xFFFF : 0, hi = t + 16 < padded_keys ? 0xFFFF : 0;
      const __m512bh words = _mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(hi, p + t + 16),
                                                 _mm512_maskz_loadu_ps(lo, p + t));
      _mm512_storeu_si512(pairs.data() + j * width + t, (__m512i)words);
    }
  }
  __m512 acc[NR * CH];
  for (int i = 0; i < NR * CH; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t first = 0; first < num_keys; first += block_size) {
    const at::BFloat16* v = block_rows(first / block_size);
    const int64_t n = std::min(block_size, num_keys - first);
    for (int64_t t = 0; t < n; t += 2, v += 2 * row_stride) {
      __m512i vc[CH];
      for (int c = 0; c < CH / 2; ++c) {
        const __m512i r0 = _mm512_loadu_si512(v + c * 32);
        // the last key of an odd count pairs with zeros (its slot's neighbour is unwritten)
        const __m512i r1 = t + 1 < n ? _mm512_loadu_si512(v + row_stride + c * 32)
                                     : _mm512_setzero_si512();
        vc[2 * c] = _mm512_unpacklo_epi16(r0, r1);
        vc[2 * c + 1] = _mm512_unpackhi_epi16(r0, r1);
      }
      for (int j = 0; j < NR; ++j) {
        uint32_t pair;
        std::memcpy(&pair, pairs.data() + j * width + first + t, sizeof(pair));
        const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
        for (int c = 0; c < CH; ++c)
          acc[j * CH + c] = _mm512_dpbf16_ps(acc[j * CH + c], (__m512bh)vc[c], pp);
      }
    }
  }
  // Output dimension i of a 32-dimension chunk: from the first accumulator if i % 8 < 4.
  static const __m512i first_half = [] {
    alignas(64) int32_t lanes[16];
    for (int i = 0; i < 16; ++i) lanes[i] = (i % 8 < 4 ? 0 : 16) + 4 * (i / 8) + i % 4;
    return _mm512_load_si512(lanes);
  }();
  const __m512i second_half = _mm512_add_epi32(first_half, _mm512_set1_epi32(8));
  for (int j = 0; j < NR; ++j)
    for (int c = 0; c < CH / 2; ++c) {
      const __m512 a = acc[j * CH + 2 * c], b = acc[j * CH + 2 * c + 1];
      _mm512_storeu_ps(out + j * D + c * 32, _mm512_permutex2var_ps(a, first_half, b));
      _mm512_storeu_ps(out + j * D + c * 32 + 16, _mm512_permutex2var_ps(a, second_half, b));
    }
}
#endif
#endif

#if defined(__AVX512VNNI__)
// weigh_values for an int8 cache whose keys took int8 dot products (the same choice,
// int8_dots), 64 dimensions: int16 dot products (vpdpwssd: two int16 products summed into
// each int32 lane) instead of widening every value to float32. Each row's probabilities
// (already scaled by their values' scales) are rounded to 15-bit steps of the row's
// largest (row_largest[j], found by softmax_row), step = max / 32767 (at most half a step
// each: relative to the largest, 2^-16; the values' own int8 rounding is 2^-8); value
// rows t and t + 1 are interleaved byte by byte and widened to int16 pairs, against the
// broadcast pair (u[t], u[t+1]). Per two keys: two loads, two unpacks, four widenings and
// 4 NR dot products, where widening to float32 takes eight conversions and 8 NR FMAs. The
// int32 sums move to float32 every 240 keys (each sum stays below 240 * 32767 * 128 <
// 2^31). A NaN probability (a NaN query) makes its row's step NaN, so the row's outputs
// are NaN as on the float32 path.
// Measured (Intel Xeon with AMX, `python -m inflight.bench.decode_attention --kv-cache-dtype
// int8 --order engine`, 57 x 450 tokens, 30 layers from DRAM): 0.69-0.71 against
// 0.78-0.82 ms a layer.
template <int NR, typename BlockFn>
inline void weigh_values_int16(const float* probs, int64_t prob_stride, int64_t num_keys,
                               int64_t block_size, BlockFn block_rows, int64_t row_stride,
                               float* out, const float* row_largest) {
  constexpr int D = 64;
  thread_local std::vector<uint32_t> pairs;  // row j: (u[2i], u[2i+1]) as one word
  const int64_t half = (num_keys + 1) / 2;
  pairs.resize(NR * half);
  float step[NR];
  for (int j = 0; j < NR; ++j) {
    const float* p = probs + j * prob_stride;
    // The softmax's own largest (NaN for a row with a NaN; see softmax_row).
    const bool any_nan = std::isnan(row_largest[j]);
    const float largest = any_nan ? 0.f : row_largest[j];
    int64_t t = 0;
    step[j] = any_nan ? std::numeric_limits<float>::quiet_NaN() : largest / 32767.f;
    const float inv = largest > 0.f && !any_nan ? 32767.f / largest : 0.f;
    pairs[j * half + half - 1] = 0u;  // an odd count's last key pairs with 0
    uint16_t* u = reinterpret_cast<uint16_t*>(pairs.data() + j * half);
    const __m512 scale = _mm512_set1_ps(inv);
    for (t = 0; t + 16 <= num_keys; t += 16)  // round to nearest (even), 0 .. 32767
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(u + t),
                          _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(
                              _mm512_mul_ps(_mm512_loadu_ps(p + t), scale))));
    for (; t < num_keys; ++t) u[t] = static_cast<uint16_t>(std::nearbyint(p[t] * inv));
  }
  __m512i acc[NR * 4];
  __m512 total[NR * 4];
  for (int i = 0; i < NR * 4; ++i) {
    acc[i] = _mm512_setzero_si512();
    total[i] = _mm512_setzero_ps();
  }
  int64_t pending_pairs = 0;
  for (int64_t first = 0; first < num_keys; first += block_size) {
    const int8_t* v = block_rows(first / block_size);
    const int64_t n = std::min(block_size, num_keys - first);
    for (int64_t t = 0; t < n; t += 2, v += 2 * row_stride) {
      const __m512i r0 = _mm512_loadu_si512(v);
      const __m512i r1 = t + 1 < n ? _mm512_loadu_si512(v + row_stride) : _mm512_setzero_si512();
      // Within each 128-bit lane: bytes 0-7 (lo) and 8-15 (hi) of both rows, interleaved.
      const __m512i lo = _mm512_unpacklo_epi8(r0, r1), hi = _mm512_unpackhi_epi8(r0, r1);
      const __m512i w[4] = {_mm512_cvtepi8_epi16(_mm512_castsi512_si256(lo)),
                            _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(lo, 1)),
                            _mm512_cvtepi8_epi16(_mm512_castsi512_si256(hi)),
                            _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(hi, 1))};
      const int64_t word = (first + t) / 2;
      for (int j = 0; j < NR; ++j) {
        const __m512i up = _mm512_set1_epi32(static_cast<int>(pairs[j * half + word]));
        for (int c = 0; c < 4; ++c) acc[j * 4 + c] = _mm512_dpwssd_epi32(acc[j * 4 + c], w[c], up);
      }
      if (++pending_pairs == 120) {
        for (int i = 0; i < NR * 4; ++i) {
          total[i] = _mm512_add_ps(total[i], _mm512_cvtepi32_ps(acc[i]));
          acc[i] = _mm512_setzero_si512();
        }
        pending_pairs = 0;
      }
    }
  }
  // Lane i of w[c] holds dimension first_dim[c] + i (i < 8) or first_dim[c] + 8 + i.
  constexpr int first_dim[4] = {0, 32, 8, 40};
  for (int j = 0; j < NR; ++j) {
    const __m512 s = _mm512_set1_ps(step[j]);
    for (int c = 0; c < 4; ++c) {
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, _mm512_mul_ps(
                                 _mm512_add_ps(total[j * 4 + c], _mm512_cvtepi32_ps(acc[j * 4 + c])), s));
      for (int i = 0; i < 16; ++i) out[j * D + first_dim[c] + (i < 8 ? i : 8 + i)] = lanes[i];
    }
  }
}
#endif

// ---------------------------------------------------------------- one work item
template <typename kv_t>
struct Item {
  const Shape& shape;
  const kv_t* k_cache;
  const kv_t* v_cache;
  const int32_t* table;
  int64_t kv_head;
  int64_t rows;        // queries in the tile x heads in the group
  int64_t num_keys;    // keys the last query of the tile can see
  int64_t padded_keys; // num_keys rounded up to whole blocks
  const float* queries;  // [rows, D], already scaled
  // bfloat16 queries and cache with AVX512-BF16: the rows unscaled, for score_blocks_bf16
  const at::BFloat16* queries_bf16;
  // int8 caches with int8 dot products: the rows quantised ([rows][D / 4] words of four
  // biased bytes, see score_blocks_int8) and each row's step; else null
  const uint32_t* query_words;
  const float* query_steps;
  const int32_t* query_sums;
  float scale;
  float* scores;         // [rows, padded_keys]
  float* out;            // [rows, D]
  // int8 caches: the cache's [num_blocks, KVH, block_size] scales, and this item's copies
  // in key order ([padded_keys], filled block by block as keys are scored); else null.
  const float* k_scale_cache;
  const float* v_scale_cache;
  float* key_scales;
  float* value_scales;
  NextItemFetch* next_fetch = nullptr;
  // int8 caches: each row's largest probability (times its value's scale; NaN for a row
  // holding a NaN), found by softmax_row for weigh_values_int16; else null
  float* row_largest = nullptr;

  int64_t scale_offset(int64_t b) const {
    return (static_cast<int64_t>(table[b]) * shape.num_kv_heads + kv_head) * shape.block_size;
  }
  void take_scales(int64_t b) {  // copy block b's scales (prefetched with its keys)
    if (key_scales == nullptr) return;
    const int64_t bs = shape.block_size, at = scale_offset(b);
    std::memcpy(key_scales + b * bs, k_scale_cache + at, bs * sizeof(float));
    std::memcpy(value_scales + b * bs, v_scale_cache + at, bs * sizeof(float));
  }

  const kv_t* key_block(int64_t b) const {  // [D][block_size]
    const int64_t block = table[b];
    return k_cache + (block * shape.num_kv_heads + kv_head) * shape.head_dim * shape.block_size;
  }
  const kv_t* value_block(int64_t b) const {  // row 0 of block b for this head: [D]
    const int64_t first_slot = static_cast<int64_t>(table[b]) * shape.block_size;
    return v_cache + (first_slot * shape.num_kv_heads + kv_head) * shape.head_dim;
  }

  int64_t num_key_blocks() const { return (num_keys + shape.block_size - 1) / shape.block_size; }

  void compute_scores() {
    const int64_t D = shape.head_dim, bs = shape.block_size;
#if defined(__AVX512F__)
    if (bs % 16 == 0) {
      // A decode token has only the group's few query rows: score several tiles per
      // pass so there are enough independent accumulators.
      switch (rows) {
        case 1: score_few_rows<1, 8>(); return;
        case 2: score_few_rows<2, 4>(); return;
        case 3: score_few_rows<3, 3>(); return;
        case 4: score_few_rows<4, 2>(); return;
        default: score_many_rows(); return;
      }
    }
#endif
    for (int64_t b = 0; b * bs < num_keys; ++b) {
      take_scales(b);
      const kv_t* kb = key_block(b);
      for (int64_t r = 0; r < rows; ++r) {
        float* row = scores + r * padded_keys + b * bs;
        for (int64_t i = 0; i < bs; ++i) row[i] = 0.f;
        for (int64_t d = 0; d < D; ++d) {
          const float qd = queries[r * D + d];
          for (int64_t i = 0; i < bs; ++i) row[i] += qd * load(kb[d * bs + i]);
        }
      }
    }
  }

#if defined(__AVX512F__)
  // Blocks sit anywhere in the cache, so the hardware prefetcher cannot guess the next
  // one: fetch the blocks `ahead` blocks on while these are scored.
  void prefetch_key_blocks(int64_t first, int64_t count) const {
    const int64_t bytes = shape.head_dim * shape.block_size * static_cast<int64_t>(sizeof(kv_t));
    const int64_t end = std::min(first + count, num_key_blocks());
    const int64_t row_stride = shape.num_kv_heads * shape.head_dim;
    const int64_t value_bytes = shape.head_dim * static_cast<int64_t>(sizeof(kv_t));
    for (int64_t b = first; b < end; ++b) {
      prefetch(key_block(b), bytes);
      // The values follow in the next pass: fetch them now, while the keys are scored,
      // so the block's DRAM reads overlap (a sequence's K/V for one head fit in L2).
      const kv_t* values = value_block(b);
      for (int64_t i = 0; i < shape.block_size; ++i) prefetch(values + i * row_stride, value_bytes);
      if (key_scales != nullptr) {
        const int64_t scale_bytes = shape.block_size * static_cast<int64_t>(sizeof(float));
        prefetch(k_scale_cache + scale_offset(b), scale_bytes);
        prefetch(v_scale_cache + scale_offset(b), scale_bytes);
      }
    }
  }

  // Keys are scored in tiles of 16 (a block of 16 * m keys holds m tiles side by side in
  // each of its [D][block_size] rows): tile j is columns 16 (j % m) of block j / m.
  int64_t num_key_tiles() const { return (num_keys + 15) / 16; }
  const kv_t* key_tile(int64_t j) const {
    const int64_t m = shape.block_size / 16;
    return key_block(j / m) + (j % m) * 16;
  }
  // Block-level work for tiles [first, first + count): a block's scales are gathered, and
  // the block kPrefetchBlocks on fetched, as its first tile comes up.
  void enter_tiles(int64_t first, int64_t count) {
    const int64_t m = shape.block_size / 16;
    const int64_t ahead = std::max<int64_t>(1, kPrefetchBlocks * 16 / shape.block_size);
    for (int64_t j = first; j < first + count; ++j) {
      if (j % m != 0) continue;
      take_scales(j / m);
      prefetch_key_blocks(j / m + ahead, 1);
    }
  }

  // Scores of NR rows (from `row`) against NB tiles: bfloat16 dot products where the
  // queries came as bfloat16 (see attend), else float32 FMAs on the scaled queries.
  template <int NR, int NB>
  void score(int64_t row, const kv_t* const* kb, float* out) {
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
    if constexpr (std::is_same_v<kv_t, int8_t>) {
      if (query_words != nullptr) {
        score_blocks_int8<NR, NB>(query_words + row * (shape.head_dim / 4), query_steps + row,
                                  query_sums + row,
                                  shape.head_dim, kb, out, padded_keys, shape.block_size);
        return;
      }
    }
#endif
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<kv_t, at::BFloat16>) {
      if (queries_bf16 != nullptr) {
        score_blocks_bf16<NR, NB>(queries_bf16 + row * shape.head_dim, shape.head_dim, kb, out,
                                  padded_keys, shape.block_size, scale);
        return;
      }
    }
#endif
    score_blocks<NR, NB>(queries + row * shape.head_dim, shape.head_dim, kb, out, padded_keys,
                         shape.block_size);
  }

  // The first blocks (enter_tiles fetches only ahead of itself).
  void prefetch_first_blocks() const {
    prefetch_key_blocks(0, std::max<int64_t>(1, kPrefetchBlocks * 16 / shape.block_size));
  }

  template <int NR, int NB>
  void score_run(int64_t j) {  // rows == NR: key tiles j .. j + NB
    enter_tiles(j, NB);
    const kv_t* kb[NB];
    for (int t = 0; t < NB; ++t) kb[t] = key_tile(j + t);
    score<NR, NB>(0, kb, scores + j * 16);
  }

  template <int NR, int NB>
  void score_few_rows() {  // rows == NR, NB tiles per pass
    const int64_t tiles = num_key_tiles();
    prefetch_first_blocks();
    int64_t j = 0;
    for (; j + NB <= tiles; j += NB) score_run<NR, NB>(j);
    for (; j < tiles; ++j) score_run<NR, 1>(j);
  }

  void score_many_rows() {  // a prompt chunk's tile: each key tile is scored for 8 rows at a time
    prefetch_first_blocks();
    for (int64_t j = 0; j < num_key_tiles(); ++j) {
      enter_tiles(j, 1);
      const kv_t* kb[1] = {key_tile(j)};
      int64_t r = 0;
      for (; r + 8 <= rows; r += 8)
        score<8, 1>(r, kb, scores + r * padded_keys + j * 16);
      float* out_scores = scores + r * padded_keys + j * 16;
      switch (rows - r) {
        case 1: score<1, 1>(r, kb, out_scores); break;
        case 2: score<2, 1>(r, kb, out_scores); break;
        case 3: score<3, 1>(r, kb, out_scores); break;
        case 4: score<4, 1>(r, kb, out_scores); break;
        case 5: score<5, 1>(r, kb, out_scores); break;
        case 6: score<6, 1>(r, kb, out_scores); break;
        case 7: score<7, 1>(r, kb, out_scores); break;
        default: break;
      }
    }
  }

#endif

  // Softmax of row r over its visible keys [0, visible); the rest become 0. With an int8
  // cache the raw dot products are scaled by each key's scale first, and each probability
  // is scaled by its value's scale after, so the V pass can use the int8 rows as they are.
  void softmax_row(int64_t r, int64_t visible) {
    float* row = scores + r * padded_keys;
    for (int64_t t = visible; t < padded_keys; ++t) row[t] = kNegInf;
    float max_score = kNegInf;
    int64_t t = 0;
#if defined(__AVX512F__)
    // 16 running maxima: the same value as a scalar scan (max is exact in any order),
    // which is one dependent vmaxss per key: 15% of this function's perf samples in a
    // decode step with K/V in L3 (Zen 5). An int8 cache's key scales are applied in the
    // same pass.
    __m512 running = _mm512_set1_ps(kNegInf);
    if (key_scales != nullptr) {
      for (; t + 16 <= visible; t += 16) {
        const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(row + t), _mm512_loadu_ps(key_scales + t));
        _mm512_storeu_ps(row + t, x);
        running = _mm512_max_ps(running, x);
      }
    } else {
      for (; t + 16 <= visible; t += 16) running = _mm512_max_ps(running, _mm512_loadu_ps(row + t));
    }
    max_score = _mm512_reduce_max_ps(running);
#endif
    for (; t < visible; ++t) {
      if (key_scales != nullptr) row[t] *= key_scales[t];
      max_score = std::max(max_score, row[t]);
    }
    float total = 0.f;
    t = 0;
#if defined(__AVX512F__)
    const __m512 m = _mm512_set1_ps(max_score);
    __m512 sum = _mm512_setzero_ps();
    for (; t + 16 <= padded_keys; t += 16) {
      const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(row + t), m));
      _mm512_storeu_ps(row + t, e);
      sum = _mm512_add_ps(sum, e);
    }
    total = _mm512_reduce_add_ps(sum);
#endif
    for (; t < padded_keys; ++t) {
      row[t] = t < visible ? std::exp(row[t] - max_score) : 0.f;
      total += row[t];
    }
    const float inv = 1.f / total;
    float largest = 0.f;  // of the row's values, NaN if any is: for weigh_values_int16
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 invs = _mm512_set1_ps(inv);
    if (value_scales != nullptr) {
      __m512 top = _mm512_setzero_ps();
      __mmask16 nan = 0;
      for (; i + 16 <= visible; i += 16) {
        const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(row + i),
                                       _mm512_mul_ps(invs, _mm512_loadu_ps(value_scales + i)));
        _mm512_storeu_ps(row + i, x);
        nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        top = _mm512_max_ps(top, x);
      }
      largest = nan != 0 ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(top);
    } else {
      for (; i + 16 <= visible; i += 16)
        _mm512_storeu_ps(row + i, _mm512_mul_ps(_mm512_loadu_ps(row + i), invs));
    }
#endif
    if (value_scales != nullptr) {
      for (; i < visible; ++i) {
        row[i] *= inv * value_scales[i];
        largest = std::isnan(row[i]) || std::isnan(largest) ? std::numeric_limits<float>::quiet_NaN()
                                                          : std::max(largest, row[i]);
      }
      if (row_largest != nullptr) row_largest[r] = largest;
    } else {
      for (; i < visible; ++i) row[i] *= inv;
    }
  }

#if defined(__AVX512F__)
  // probs rows [NR, padded_keys] @ V into out rows: bfloat16 dot products where the
  // queries came as bfloat16 (as for the scores), int16 dot products for an int8 cache
  // whose keys took int8 dot products, else float32 FMAs.
  template <int NR, int CH, typename BlockFn>
  void weigh(const float* p, float* o, BlockFn block_rows, int64_t row_stride) {
    const int64_t D = shape.head_dim, bs = shape.block_size;
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<kv_t, at::BFloat16>) {
      if (queries_bf16 != nullptr) {
        weigh_values_bf16<NR, CH>(p, padded_keys, num_keys, padded_keys, bs, block_rows,
                                  row_stride, o, D);
        return;
      }
    }
#endif
#if defined(__AVX512VNNI__)
    if constexpr (std::is_same_v<kv_t, int8_t> && CH == 4) {
      if (query_words != nullptr && D == 64) {  // int8_dots (see weigh_values_int16)
        weigh_values_int16<NR>(p, padded_keys, num_keys, bs, block_rows, row_stride, o,
                               row_largest + (p - scores) / padded_keys);
        return;
      }
    }
#endif
    weigh_values<NR, CH, kv_t>(p, padded_keys, num_keys, bs, block_rows, row_stride, o, D);
  }
#endif

  void accumulate_values() {
    const int64_t D = shape.head_dim, bs = shape.block_size;
    const int64_t row_stride = shape.num_kv_heads * D;  // V rows of one head within a block
#if defined(__AVX512F__)
    if (D == 64 || D == 128) {
      auto block_rows = [this, bs, row_stride](int64_t b) {
        if (next_fetch != nullptr) next_fetch->step(kNextItemLines);
        // Value rows of the block kPrefetchBlocks ahead (see prefetch_key_blocks).
        if ((b + kPrefetchBlocks) * bs < num_keys) {
          const kv_t* ahead = value_block(b + kPrefetchBlocks);
          const int64_t bytes = shape.head_dim * static_cast<int64_t>(sizeof(kv_t));
          for (int64_t i = 0; i < bs; ++i) prefetch(ahead + i * row_stride, bytes);
        }
        return value_block(b);
      };
      // Rows per pass keep NR * CH accumulators (plus CH value vectors) in registers.
      const int64_t per_pass = D == 64 ? 6 : 2;
      for (int64_t r = 0; r < rows; r += per_pass) {
        const int64_t nr = std::min(per_pass, rows - r);
        const float* p = scores + r * padded_keys;
        float* o = out + r * D;
#define INFLIGHT_WEIGH(NR, CH) weigh<NR, CH>(p, o, block_rows, row_stride)
        if (D == 64) {
          switch (nr) {
            case 1: INFLIGHT_WEIGH(1, 4); break;
            case 2: INFLIGHT_WEIGH(2, 4); break;
            case 3: INFLIGHT_WEIGH(3, 4); break;
            case 4: INFLIGHT_WEIGH(4, 4); break;
            case 5: INFLIGHT_WEIGH(5, 4); break;
            default: INFLIGHT_WEIGH(6, 4); break;
          }
        } else if (nr == 1) {
          INFLIGHT_WEIGH(1, 8);
        } else {
          INFLIGHT_WEIGH(2, 8);
        }
#undef INFLIGHT_WEIGH
      }
      return;
    }
#endif
    std::fill(out, out + rows * D, 0.f);
    for (int64_t t = 0; t < num_keys; ++t) {
      const kv_t* v = value_block(t / bs) + (t % bs) * row_stride;
      for (int64_t r = 0; r < rows; ++r) {
        const float p = scores[r * padded_keys + t];
        if (p == 0.f) continue;
        for (int64_t d = 0; d < D; ++d) out[r * D + d] += p * load(v[d]);
      }
    }
  }
};

// One output row, rounded to the query's dtype (bfloat16: as .to(torch.bfloat16) would).
template <typename T>
inline void store_row(const float* src, int64_t D, T* dst) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, D * sizeof(float));
  } else {
    int64_t d = 0;
#if defined(__AVX512F__)
    for (; d + 16 <= D; d += 16) store16(dst + d, _mm512_loadu_ps(src + d));
#endif
    for (; d < D; ++d) dst[d] = store<T>(src[d]);
  }
}

// One query row [D] (float32, already scaled) as int8 steps for score_blocks_int8: signed
// bytes s = round(q / step) (round half to even; -127..127), four dimensions to a
// little-endian word, step = max|q| / 127 (1 for an all-zero row), and *sum = the sum of
// s. Returns the step: NaN for a row with a NaN, so its scores are NaN as on the float32
// path (the rounding would clamp a NaN to a finite byte).
inline float query_step(float top, bool nan) {
  return nan ? std::numeric_limits<float>::quiet_NaN() : top > 0.f ? top / 127.f : 1.f;
}

inline float quantize_query(const float* q, int64_t D, uint32_t* words, int32_t* sum) {
  float top = 0.f;
#if defined(__AVX512F__)
  if (D % 16 == 0) {  // 16 lanes at a time, the same arithmetic (a scalar loop was ~7% of a
                      // decode item's time)
    __m512 m = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 x = _mm512_loadu_ps(q + d);
      nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      m = _mm512_max_ps(m, _mm512_abs_ps(x));
    }
    top = _mm512_reduce_max_ps(m);
    const float step = query_step(top, nan != 0);
    const __m512 steps = _mm512_set1_ps(step);
    const __m512 low = _mm512_set1_ps(-127.f), high = _mm512_set1_ps(127.f);
    auto* bytes = reinterpret_cast<int8_t*>(words);
    __m512i total = _mm512_setzero_si512();
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 x = _mm512_div_ps(_mm512_loadu_ps(q + d), steps);
      __m512 u = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      u = _mm512_min_ps(_mm512_max_ps(u, low), high);
      const __m512i v = _mm512_cvtps_epi32(u);
      total = _mm512_add_epi32(total, v);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(bytes + d), _mm512_cvtepi32_epi8(v));
    }
    *sum = _mm512_reduce_add_epi32(total);
    return step;
  }
#endif
  bool nan = false;
  for (int64_t d = 0; d < D; ++d) {
    top = std::max(top, std::abs(q[d]));
    nan = nan || std::isnan(q[d]);
  }
  const float step = query_step(top, nan);
  int32_t total = 0;
  for (int64_t g = 0; g < D / 4; ++g) {
    uint32_t word = 0;
    for (int64_t j = 0; j < 4; ++j) {
      const float x = std::nearbyint(q[4 * g + j] / step);  // NaN: the step is NaN anyway
      const int32_t u = std::isnan(x) ? 0 : static_cast<int32_t>(std::clamp(x, -127.f, 127.f));
      total += u;
      word |= static_cast<uint32_t>(static_cast<uint8_t>(static_cast<int8_t>(u))) << (8 * j);
    }
    words[g] = word;
  }
  *sum = total;
  return step;
}

#if defined(__AVX512F__)
// The scores of one decode token's KV heads taken block by block instead of head after
// head: a run of key tiles for every head, then the next run. The cache holds a block's
// heads side by side (keys [KVH][D][block_size]), so each block's keys are read front to
// back within a short time, where head after head reads a third of every block per pass.
// Every score is the same sum in the same order as in compute_scores. 57 sequences x 450
// tokens, 30 layers from DRAM, Intel Xeon with AMX: 1.05 against 1.19 ms a layer with
// blocks laid out as the engine lays them (a prompt's contiguous, decode blocks
// interleaved), 1.13 against 1.26 with every block scattered, int8 cache 0.78 against 0.93
// (`python -m inflight.bench.decode_attention`). heads[h]: the token's item for KV head h,
// rows == NR.
template <int NR, int NB, typename kv_t>
void score_heads_by_block(std::vector<Item<kv_t>>& heads) {
  for (auto& head : heads) head.prefetch_first_blocks();
  const int64_t tiles = heads[0].num_key_tiles();
  int64_t j = 0;
  for (; j + NB <= tiles; j += NB)
    for (auto& head : heads) head.template score_run<NR, NB>(j);
  for (; j < tiles; ++j)
    for (auto& head : heads) head.template score_run<NR, 1>(j);
}

// score_heads_by_block where its tile kernels apply (score_few_rows' row counts); false
// where they do not.
template <typename kv_t>
bool try_score_heads_by_block(std::vector<Item<kv_t>>& heads) {
  if (heads[0].shape.block_size % 16 != 0) return false;
  switch (heads[0].rows) {
    case 1: score_heads_by_block<1, 8>(heads); return true;
    case 2: score_heads_by_block<2, 4>(heads); return true;
    case 3: score_heads_by_block<3, 3>(heads); return true;
    case 4: score_heads_by_block<4, 2>(heads); return true;
    default: return false;
  }
}
#endif

template <typename kv_t, typename q_t>
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& query_start,
            const at::Tensor& seq_lens, double scale, const std::optional<at::Tensor>& k_scale,
            const std::optional<at::Tensor>& v_scale, bool int8_dots_allowed,
            bool bf16_dots_allowed, at::Tensor& out) {
  const Shape shape{q.size(1), k_cache.size(1), q.size(1) / k_cache.size(1), q.size(2),
                    k_cache.size(3), block_tables.size(1)};
  const q_t* q_ptr = q.data_ptr<q_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* starts = query_start.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  q_t* out_ptr = out.data_ptr<q_t>();
  const int64_t D = shape.head_dim, G = shape.group;

  std::vector<WorkItem> items;
  std::vector<int64_t> costs;  // query rows x keys seen, the item's share of the work
  // Fewer sequences than threads (one sequence decoding alone): split decode tokens by
  // KV head too, or all but one thread would wait.
  const bool whole_decode_tokens = seq_lens.size(0) >= at::get_num_threads();
  for (int32_t s = 0; s < seq_lens.size(0); ++s) {
    const int32_t q_len = starts[s + 1] - starts[s];
    for (int32_t b = 0; b < q_len; b += kQueryTile) {
      const int32_t e = std::min<int32_t>(q_len, b + kQueryTile);
      const int64_t cost = static_cast<int64_t>(e - b) * (lens[s] - q_len + e);
      if (q_len == 1 && whole_decode_tokens) {
        // A decode token: all KV heads in one item, one after the other, so the cache
        // lines of a block (its heads sit side by side) are read by one core in order.
        items.push_back({s, b, e, 0, static_cast<int32_t>(shape.num_kv_heads)});
        costs.push_back(cost * shape.num_kv_heads);
        continue;
      }
      for (int32_t h = 0; h < shape.num_kv_heads; ++h) {
        items.push_back({s, b, e, h, h + 1});
        costs.push_back(cost);
      }
    }
  }
  // A step mixes decode tokens (cheap) with prompt-chunk tiles (up to 16x dearer), in
  // sequence order. Contiguous static shares would give one thread all the prompt tiles:
  // hand items out one by one instead, dearest first, so threads finish together.
  std::vector<int32_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return costs[a] > costs[b]; });
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);

  // int8 caches: [num_blocks, KVH, block_size] scales, gathered per item into key order.
  const float* k_scale_ptr = k_scale.has_value() ? k_scale->data_ptr<float>() : nullptr;
  const float* v_scale_ptr = v_scale.has_value() ? v_scale->data_ptr<float>() : nullptr;

  // bfloat16 queries against a bfloat16 cache: keys scored with bfloat16 dot products
  // (score_blocks_bf16), the queries' exact values, unless the caller asks for float32
  // FMAs (as float32 queries always get).
  bool bf16_dots = false;
#if defined(__AVX512BF16__)
  bf16_dots = bf16_dots_allowed && std::is_same_v<q_t, at::BFloat16> &&
              std::is_same_v<kv_t, at::BFloat16> &&
              shape.block_size % 16 == 0 && D % 2 == 0;
#endif
  // An int8 cache: keys scored with int8 dot products on the queries quantised per row
  // (score_blocks_int8) where the CPU has them, unless the caller asks for float32 FMAs.
  bool int8_dots = false;
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
  int8_dots = int8_dots_allowed && std::is_same_v<kv_t, int8_t> && shape.block_size % 16 == 0 &&
              D % 4 == 0;
#endif
  // A worker's buffers, one set for each KV head of an item.
  struct Buffers {
    std::vector<float> queries, scores, result, key_scales, value_scales, query_steps, largest;
    std::vector<at::BFloat16> queries16;
    std::vector<uint32_t> query_words;
    std::vector<int32_t> query_sums;
  };
  // The blocks of a work item to fetch during the one before it (see kNextItemLines): a
  // decode token's (all its KV heads) first kNextItemBlocks, keys, values and scales.
  auto plan_fetch = [&](const WorkItem& item, NextItemFetch& fetch) {
    if (item.kv_head_end - item.kv_head_begin != shape.num_kv_heads) return;
    const int64_t bs = shape.block_size, block_bytes = shape.num_kv_heads * D * bs * sizeof(kv_t);
    const int64_t scale_floats = shape.num_kv_heads * bs;
    const int32_t* table = tables + static_cast<int64_t>(item.seq) * shape.max_blocks;
    const char* keys = reinterpret_cast<const char*>(k_cache.data_ptr<kv_t>());
    const char* values = reinterpret_cast<const char*>(v_cache.data_ptr<kv_t>());
    const int64_t blocks = std::min<int64_t>(kNextItemBlocks, (lens[item.seq] + bs - 1) / bs);
    for (int64_t b = 0; b < blocks; ++b) {
      fetch.add(keys + table[b] * block_bytes, block_bytes);
      fetch.add(values + table[b] * block_bytes, block_bytes);
      if (k_scale_ptr != nullptr) {
        fetch.add(k_scale_ptr + table[b] * scale_floats, scale_floats * sizeof(float));
        fetch.add(v_scale_ptr + table[b] * scale_floats, scale_floats * sizeof(float));
      }
    }
  };
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<Buffers> buffers(shape.num_kv_heads);
    std::vector<Item<kv_t>> heads;
    NextItemFetch fetch;
    // The next item is claimed before this one is worked, so that its blocks can be
    // fetched, while enough remain that a claimed item does not leave the other threads
    // idle at the end of the step.
    for (int64_t w = next++; w < num_items;) {
      const WorkItem it = items[order[w]];
      const int64_t w_next = num_items - w > 4 * workers ? next++ : -1;
      fetch.clear();
      if (w_next >= 0 && w_next < num_items) plan_fetch(items[order[w_next]], fetch);
      const int64_t q_len = starts[it.seq + 1] - starts[it.seq];
      const int64_t first_pos = lens[it.seq] - q_len;  // position of query 0
      const int64_t rows = static_cast<int64_t>(it.q_end - it.q_begin) * G;
      const int64_t num_keys = first_pos + it.q_end;
      const int64_t padded = (num_keys + shape.block_size - 1) / shape.block_size * shape.block_size;
      const int32_t* table = tables + static_cast<int64_t>(it.seq) * shape.max_blocks;
      const bool int8 = k_scale_ptr != nullptr;
      // row r of a head's item = (query r / G of the tile, query head r % G of the group)
      auto token_head = [&](int64_t kv_head, int64_t r) {
        const int64_t token = starts[it.seq] + it.q_begin + r / G;
        return token * shape.num_heads + kv_head * G + r % G;
      };
      heads.clear();
      for (int64_t kv_head = it.kv_head_begin; kv_head < it.kv_head_end; ++kv_head) {
        Buffers& buf = buffers[kv_head - it.kv_head_begin];
        buf.queries.resize(rows * D);
        buf.scores.resize(rows * padded);
        buf.result.resize(rows * D);
        for (int64_t r = 0; r < rows; ++r) {
          const q_t* src = q_ptr + token_head(kv_head, r) * D;
          for (int64_t d = 0; d < D; ++d)
            buf.queries[r * D + d] = load(src[d]) * static_cast<float>(scale);
        }
        if (bf16_dots) {
          buf.queries16.resize(rows * D);
          for (int64_t r = 0; r < rows; ++r)
            std::memcpy(buf.queries16.data() + r * D, q_ptr + token_head(kv_head, r) * D,
                        D * sizeof(q_t));
        }
        if (int8_dots) {
          buf.query_words.resize(rows * (D / 4));
          buf.query_steps.resize(rows);
          buf.query_sums.resize(rows);
          for (int64_t r = 0; r < rows; ++r)
            buf.query_steps[r] = quantize_query(buf.queries.data() + r * D, D,
                                                buf.query_words.data() + r * (D / 4),
                                                buf.query_sums.data() + r);
        }
        if (int8) {
          buf.key_scales.resize(padded);
          buf.value_scales.resize(padded);
          buf.largest.resize(rows);
        }
        heads.push_back(Item<kv_t>{
            shape, k_cache.data_ptr<kv_t>(), v_cache.data_ptr<kv_t>(), table, kv_head, rows,
            num_keys, padded, buf.queries.data(),
            bf16_dots ? reinterpret_cast<const at::BFloat16*>(buf.queries16.data()) : nullptr,
            int8_dots ? buf.query_words.data() : nullptr,
            int8_dots ? buf.query_steps.data() : nullptr,
            int8_dots ? buf.query_sums.data() : nullptr, static_cast<float>(scale),
            buf.scores.data(), buf.result.data(), k_scale_ptr, v_scale_ptr,
            int8 ? buf.key_scales.data() : nullptr, int8 ? buf.value_scales.data() : nullptr});
        if (int8) heads.back().row_largest = buf.largest.data();
      }
      for (auto& head : heads) head.next_fetch = &fetch;
      bool scored = false;
#if defined(__AVX512F__)
      if (heads.size() > 1 && q_len == 1) scored = try_score_heads_by_block(heads);
#endif
      for (size_t h = 0; h < heads.size(); ++h) {
        Item<kv_t>& item = heads[h];
        if (!scored) item.compute_scores();
        for (int64_t r = 0; r < rows; ++r) item.softmax_row(r, first_pos + it.q_begin + r / G + 1);
        item.accumulate_values();
        for (int64_t r = 0; r < rows; ++r)
          store_row(buffers[h].result.data() + r * D, D, out_ptr + token_head(item.kv_head, r) * D);
      }
      w = w_next >= 0 ? w_next : next++;
    }
  });
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& query_start, const at::Tensor& seq_lens,
                           double scale, const std::optional<at::Tensor>& k_scale,
                           const std::optional<at::Tensor>& v_scale, bool int8_dots,
                           bool bf16_dots) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "q must be a contiguous float32 or bfloat16 [T, H, D] tensor");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "caches must be contiguous: K [blocks, KVH, D, bs], V [blocks, bs, KVH, D]");
  TORCH_CHECK(k_cache.size(1) == v_cache.size(2) && k_cache.size(2) == v_cache.size(3) &&
                  k_cache.size(3) == v_cache.size(1),
              "K and V cache shapes do not match");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches differ in dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.size(2) == k_cache.size(2), "q and cache head_dim differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && query_start.scalar_type() == at::kInt &&
                  seq_lens.scalar_type() == at::kInt,
              "block_tables, query_start and seq_lens must be int32");
  auto out = at::empty_like(q);
  auto tables = block_tables.contiguous();
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(int8 == (k_scale.has_value() && v_scale.has_value()),
              "an int8 KV cache needs k_scale and v_scale, other dtypes none");
  if (int8) {
    for (const at::Tensor* sc : {&*k_scale, &*v_scale})
      TORCH_CHECK(sc->scalar_type() == at::kFloat && sc->is_contiguous() && sc->dim() == 3 &&
                      sc->size(0) == k_cache.size(0) && sc->size(1) == k_cache.size(1) &&
                      sc->size(2) == k_cache.size(3),
                  "KV scales must be contiguous float32 [num_blocks, KVH, block_size]");
  }
  auto run = [&](auto kv_zero) {
    using kv_t = decltype(kv_zero);
    if (q.scalar_type() == at::kFloat) {
      attend<kv_t, float>(q, k_cache, v_cache, tables, query_start, seq_lens, scale, k_scale,
                          v_scale, int8_dots, bf16_dots, out);
    } else {
      attend<kv_t, at::BFloat16>(q, k_cache, v_cache, tables, query_start, seq_lens, scale,
                                 k_scale, v_scale, int8_dots, bf16_dots, out);
    }
  };
  if (k_cache.scalar_type() == at::kFloat) {
    run(float{});
  } else if (k_cache.scalar_type() == at::kBFloat16) {
    run(at::BFloat16{});
  } else if (int8) {
    run(int8_t{});
  } else {
    TORCH_CHECK(false, "KV cache dtype must be float32, bfloat16 or int8");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(inflight, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor query_start, Tensor seq_lens, float scale, Tensor? k_scale=None, "
      "Tensor? v_scale=None, bool int8_dots=True, bool bf16_dots=True) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, &paged_attention);
}
