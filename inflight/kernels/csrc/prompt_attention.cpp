// Causal attention for fresh prompt chunks (chunks that start their sequence), one call
// per layer for all of a step's fresh prompts.
//
//   q:       [T, H, D]    the step's queries (all tokens; only the prompts' rows are used)
//   k, v:    [T, KVH, D]  this step's keys and values, before they went to the cache (a
//                         fresh prompt attends only to itself, so no cache read is needed)
//   starts:  [S] int64    flat index of each prompt's first token
//   lengths: [S] int64    its number of tokens
//   out:     [T, H, D]    the prompts' rows are written, the others left alone
//
// Two paths:
//  - bfloat16 q/k/v on a CPU with AVX512-BF16 (and D a multiple of 32): this file's own
//    kernel. Each prompt's keys are first repacked into pairs along the dot product's axis
//    ([block of 16][D/2][16][2]) and its values widened to float32 ([L][D]); then
//    (prompt, KV head, 16-query tile) items compute exact float32 scores with bfloat16 dot
//    products (`vdpbf16ps`: two multiply-adds per float32 lane, accumulated in float32),
//    the softmax's numerators exp(s - max) in float32, and P @ V in float32 multiply-adds
//    on those numerators, each output row divided by its sum at the end. No probability
//    is rounded (PyTorch's flash kernel rounds them to bfloat16). On the AMD EPYC (Zen 5)
//    this project measured, PyTorch's flash SDPA ran these shapes at 50-120 GFLOP/s while
//    the bfloat16 dot product's peak is ~1000.
//    With AMX (built with amx_tile and amx_bf16, the OS granting tile data, INFLIGHT_AMX
//    not "0", read once) the same items run on AMX tiles instead, 16 rows at a time:
//    S = Q K^T by TDPBF16PS straight from the packed keys (their layout is AMX's B
//    layout), and P @ V by TDPBF16PS on values packed in pairs along the keys
//    ([block of 32][D / 16][16][16][2]), each float32 numerator p entering as two
//    bfloat16 parts, hi = bf16(p) and lo = bf16(p - hi), into the same accumulator
//    (relative error ~2^-16 per probability; values exact). See `amx_item` for the tiles.
//    The op's `allow_amx=False` keeps a call on the AVX512-BF16 path (tests, benchmarks).
//    On the Intel Xeon with AMX this project measured (2 cores), a 4096-token step of 8
//    prompts (9 heads, 3 KV heads, D 64) took 6.3 ms against the AVX512-BF16 path's 26.5
//    (4.2x; 32/8 heads at D 128: 4.8x); the softmax (exp and the split, ~12 cycles per 16
//    numerators) is about 40% of what remains, the tiles' products about 25%.
//  - float32 q/k/v on a CPU with AVX-512 (D a multiple of 16): the same kernel with
//    float32 keys ([block of 16][D][16]) and one float32 multiply-add per query value in
//    the scores. On the Intel Xeon without AMX (model 207) this project measured, where
//    float32 is what bfloat16 models compute in, the first 4096-token step of `mixed`
//    (12 prompts, 9 heads, 3 KV heads, D 64) took 16.9 ms a layer against PyTorch's flash
//    SDPA's 25.6 (1.5x). INFLIGHT_PROMPT_ATTENTION=sdpa keeps PyTorch's.
//  - otherwise one call of PyTorch's scaled_dot_product_attention per prompt (its CPU
//    flash kernel) on strided views, so nothing is padded or copied.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "vec_math.h"

#include "amx_tiles.h"
#if defined(INFLIGHT_AMX)
#define INFLIGHT_PROMPT_AMX 1
#endif

namespace {

using namespace inflight_vec;

void sdpa_per_prompt(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const int64_t* fp, const int64_t* cp, int64_t num_prompts, double scale,
                     at::Tensor& out) {
  for (int64_t s = 0; s < num_prompts; ++s) {
    // [L, heads, D] -> [1, heads, L, D] views
    auto view = [&](const at::Tensor& x) {
      return x.narrow(0, fp[s], cp[s]).transpose(0, 1).unsqueeze(0);
    };
    const at::Tensor o = at::scaled_dot_product_attention(
        view(q), view(k), view(v), /*attn_mask=*/std::nullopt, /*dropout_p=*/0.0,
        /*is_causal=*/true, scale, /*enable_gqa=*/true);
    out.narrow(0, fp[s], cp[s]).copy_(o.squeeze(0).transpose(0, 1));
  }
}

#if defined(__AVX512F__)
constexpr int64_t kTile = 16;  // query tokens per work item; keys come in blocks of 16

// acc += q . k for one 32-bit unit of a query row (broadcast) against 16 keys' units: a
// bfloat16 pair each (vdpbf16ps) or, for float32 prompts, one float32 (vfmadd231ps).
template <typename T>
inline __m512 dot_unit(__m512 acc, uint32_t q, __m512i keys) {
  if constexpr (std::is_same_v<T, float>) {
    float qf;
    std::memcpy(&qf, &q, sizeof(qf));
    return _mm512_fmadd_ps(_mm512_set1_ps(qf), _mm512_castsi512_ps(keys), acc);
  } else {
#if defined(__AVX512BF16__)
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(q)), (__m512bh)keys);
#else
    static_assert(std::is_same_v<T, float>, "bfloat16 prompts need AVX512-BF16");
    return acc;
#endif
  }
}

// 32-bit units per head row: bfloat16 pairs, or float32 values.
template <typename T>
constexpr int64_t units_of(int64_t D) {
  return std::is_same_v<T, float> ? D : D / 2;
}

struct PromptShape {
  int64_t heads, kv_heads, group, D;
  int64_t q_token_stride, q_head_stride, k_token_stride, k_head_stride;
  int64_t v_token_stride, v_head_stride, out_token_stride, out_head_stride;
};

// Where one (prompt, KV head)'s repacked keys and values live in the scratch buffers.
struct Packed {
  int64_t first;   // the prompt's first token in q/k/v/out
  int64_t length;  // its tokens
  uint32_t* keys;    // [ceil(L / 16)][units][16]: bfloat16 pairs (D / 2) or float32 (D)
  float* values;     // [L][D] float32 (bfloat16 widened exactly); dot-product path only
  at::BFloat16* value_pairs;  // [ceil(L / 32)][D / 16][16][16][2]; AMX path only
};

// out[j][i] = rows[i][j] for a 16 x 16 block of 32-bit lanes: pairs within 128-bit lanes,
// then quads, then the 128-bit lanes themselves (64 shuffles).
inline void transpose16(const __m512i (&rows)[16], __m512i (&out)[16]) {
  __m512i a[16], b[16];
  for (int k = 0; k < 8; ++k) {
    a[2 * k] = _mm512_unpacklo_epi32(rows[2 * k], rows[2 * k + 1]);
    a[2 * k + 1] = _mm512_unpackhi_epi32(rows[2 * k], rows[2 * k + 1]);
  }
  // b[4 k + c], 128-bit lane l: rows 4 k .. 4 k + 3 of column 4 l + c
  for (int k = 0; k < 4; ++k) {
    b[4 * k] = _mm512_unpacklo_epi64(a[4 * k], a[4 * k + 2]);
    b[4 * k + 1] = _mm512_unpackhi_epi64(a[4 * k], a[4 * k + 2]);
    b[4 * k + 2] = _mm512_unpacklo_epi64(a[4 * k + 1], a[4 * k + 3]);
    b[4 * k + 3] = _mm512_unpackhi_epi64(a[4 * k + 1], a[4 * k + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // a 4 x 4 transpose of 128-bit lanes
    const __m512i s0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x44);
    const __m512i s1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xEE);
    const __m512i s2 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x44);
    const __m512i s3 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xEE);
    out[c] = _mm512_shuffle_i32x4(s0, s2, 0x88);
    out[4 + c] = _mm512_shuffle_i32x4(s0, s2, 0xDD);
    out[8 + c] = _mm512_shuffle_i32x4(s1, s3, 0x88);
    out[12 + c] = _mm512_shuffle_i32x4(s1, s3, 0xDD);
  }
}

// Keys [block of 16][units][16]: 16 x 16 transposes of 16 keys' rows of 16 units (bfloat16
// pairs or float32 values).
template <typename T>
void pack_keys(const PromptShape& sh, const T* k, int64_t kv_head, const Packed& p) {
  const int64_t pairs = units_of<T>(sh.D), blocks = (p.length + 15) / 16;
  __m512i rows[16], cols[16];
  for (int64_t b = 0; b < blocks; ++b) {
    uint32_t* dst = p.keys + b * pairs * 16;
    for (int64_t dp = 0; dp < pairs; dp += 16) {
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t t = b * 16 + i;
        const T* row = k + (p.first + t) * sh.k_token_stride + kv_head * sh.k_head_stride;
        rows[i] = t < p.length ? _mm512_loadu_si512(reinterpret_cast<const uint32_t*>(row) + dp)
                               : _mm512_setzero_si512();
      }
      transpose16(rows, cols);
      for (int64_t j = 0; j < 16; ++j) _mm512_storeu_si512(dst + (dp + j) * 16, cols[j]);
    }
  }
}

template <typename T>
void pack_values(const PromptShape& sh, const T* v, int64_t kv_head, const Packed& p) {
  const int64_t D = sh.D;
  for (int64_t t = 0; t < p.length; ++t) {
    const T* row = v + (p.first + t) * sh.v_token_stride + kv_head * sh.v_head_stride;
    float* dst = p.values + t * D;
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(dst + d, load16(row + d));
  }
}

// scores[r][16 * NB * j ...] for NR query rows against NB key blocks.
template <typename T, int NR, int NB>
inline void score_tile(const uint32_t* const* qrows, const uint32_t* kblock, int64_t pairs,
                       float scale, float* scores, int64_t stride) {
  __m512 acc[NR * NB];
  for (int i = 0; i < NR * NB; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t dp = 0; dp < pairs; ++dp) {
    __m512i kv[NB];
    for (int b = 0; b < NB; ++b)
      kv[b] = _mm512_loadu_si512(kblock + (b * pairs + dp) * 16);
    for (int r = 0; r < NR; ++r) {
      const uint32_t qv = qrows[r][dp];
      for (int b = 0; b < NB; ++b) acc[r * NB + b] = dot_unit<T>(acc[r * NB + b], qv, kv[b]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < NR; ++r)
    for (int b = 0; b < NB; ++b)
      _mm512_storeu_ps(scores + r * stride + b * 16, _mm512_mul_ps(acc[r * NB + b], sc));
}

template <typename T, int NR>
void score_rows(const uint32_t* const* qrows, const uint32_t* keys, int64_t blocks,
                int64_t pairs, float scale, float* scores, int64_t stride) {
  int64_t b = 0;
  for (; b + 4 <= blocks; b += 4)
    score_tile<T, NR, 4>(qrows, keys + b * pairs * 16, pairs, scale, scores + b * 16, stride);
  for (; b < blocks; ++b)
    score_tile<T, NR, 1>(qrows, keys + b * pairs * 16, pairs, scale, scores + b * 16, stride);
}

// out rows (float32 [NR][16 * CH]) = P[NR][: keys] @ V in float32 multiply-adds, P as the
// softmax's float32 numerators (exact: no rounding of the probabilities; an earlier version
// rounded P to two bfloat16 parts for vdpbf16ps, as many instructions per key and an extra
// pass over the scores).
template <int NR, int CH>
void weigh_rows(const float* probs, int64_t prob_stride, const float* values, int64_t keys,
                int64_t D, float* out) {
  __m512 acc[NR * CH];
  for (int i = 0; i < NR * CH; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t t = 0; t < keys; ++t) {
    __m512 vv[CH];
    for (int c = 0; c < CH; ++c) vv[c] = _mm512_loadu_ps(values + t * D + c * 16);
    for (int r = 0; r < NR; ++r) {
      const __m512 p = _mm512_set1_ps(probs[r * prob_stride + t]);
      for (int c = 0; c < CH; ++c) acc[r * CH + c] = _mm512_fmadd_ps(p, vv[c], acc[r * CH + c]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < CH; ++c) _mm512_storeu_ps(out + r * D + c * 16, acc[r * CH + c]);
}

// One row of scores over its first `visible` keys -> exp(score - max) in place, zero from
// `visible` to `stride`; returns 1 / their sum (applied to the output row, D values, instead
// of to every probability).
float softmax_numerators(float* row, int64_t visible, int64_t stride) {
  const int64_t padded = (visible + 15) / 16 * 16;
  for (int64_t t = visible; t < padded; ++t) row[t] = -std::numeric_limits<float>::infinity();
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < padded; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(row + t));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < padded; t += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(row + t), m));
    _mm512_storeu_ps(row + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  for (int64_t t = padded; t < stride; ++t) row[t] = 0.f;
  return 1.f / _mm512_reduce_add_ps(sum);
}

struct TileItem {
  int32_t prompt, kv_head, q_begin, q_end;
};

// Row r of an item is (query it.q_begin + r / G, head kv_head * G + r % G).
inline int64_t token_of(const Packed& p, const TileItem& it, int64_t G, int64_t r) {
  return p.first + it.q_begin + r / G;
}
inline int64_t head_of(const TileItem& it, int64_t G, int64_t r) { return it.kv_head * G + r % G; }

// n elements of v, 64-byte aligned (v grown as needed and reused).
template <typename T>
T* aligned(std::vector<T>& v, int64_t n) {
  v.resize(n + 64 / sizeof(T));
  const auto address = reinterpret_cast<uintptr_t>(v.data());
  return reinterpret_cast<T*>((address + 63) / 64 * 64);
}

// Per-worker scratch, grown as needed and reused across items.
struct Scratch {
  std::vector<float> scores, result, inv_sums;
  std::vector<const uint32_t*> qrows;
  std::vector<at::BFloat16> q, hi, lo;  // AMX path
};

// One item with AVX512-BF16 dot products (bfloat16 prompts) or float32 multiply-adds
// (float32 prompts) for the scores, float32 multiply-adds for P @ V.
template <typename T>
void dot_item(const PromptShape& sh, const TileItem& it, const Packed& p,
              const T* qp, float fscale, T* op, Scratch& s) {
  const int64_t D = sh.D, pairs = units_of<T>(D), G = sh.group;
  const int64_t rows = static_cast<int64_t>(it.q_end - it.q_begin) * G;
  const int64_t blocks = (it.q_end + 15) / 16;
  const int64_t stride = blocks * 16;  // scores per row
  s.scores.resize(rows * stride);
  s.result.resize(rows * D);
  s.inv_sums.resize(rows);
  s.qrows.resize(rows);
  for (int64_t r = 0; r < rows; ++r)
    s.qrows[r] = reinterpret_cast<const uint32_t*>(
        qp + token_of(p, it, G, r) * sh.q_token_stride + head_of(it, G, r) * sh.q_head_stride);
  float* sc = s.scores.data();
  const uint32_t* const* qrows = s.qrows.data();
  int64_t r = 0;
  for (; r + 6 <= rows; r += 6)
    score_rows<T, 6>(qrows + r, p.keys, blocks, pairs, fscale, sc + r * stride, stride);
#define INFLIGHT_SCORE(NR) \
  score_rows<T, NR>(qrows + r, p.keys, blocks, pairs, fscale, sc + r * stride, stride)
  switch (rows - r) {
    case 1: INFLIGHT_SCORE(1); break;
    case 2: INFLIGHT_SCORE(2); break;
    case 3: INFLIGHT_SCORE(3); break;
    case 4: INFLIGHT_SCORE(4); break;
    case 5: INFLIGHT_SCORE(5); break;
    default: break;
  }
#undef INFLIGHT_SCORE
  for (int64_t row = 0; row < rows; ++row)
    s.inv_sums[row] = softmax_numerators(sc + row * stride, it.q_begin + row / G + 1, stride);
  // Rows per pass keep NR * CH accumulators in registers (CH = D / 16); each pass runs
  // to the keys its last row sees (the others' numerators are zero there).
  for (int64_t row = 0; row < rows;) {
    const int64_t n = std::min<int64_t>(D == 64 ? 6 : D == 128 ? 3 : 1, rows - row);
    const int64_t keys = it.q_begin + (row + n - 1) / G + 1;
    const float* pr = sc + row * stride;
    float* o = s.result.data() + row * D;
    if (D == 64) {
      switch (n) {
        case 1: weigh_rows<1, 4>(pr, stride, p.values, keys, D, o); break;
        case 2: weigh_rows<2, 4>(pr, stride, p.values, keys, D, o); break;
        case 3: weigh_rows<3, 4>(pr, stride, p.values, keys, D, o); break;
        case 4: weigh_rows<4, 4>(pr, stride, p.values, keys, D, o); break;
        case 5: weigh_rows<5, 4>(pr, stride, p.values, keys, D, o); break;
        default: weigh_rows<6, 4>(pr, stride, p.values, keys, D, o); break;
      }
    } else if (D == 128) {
      switch (n) {
        case 1: weigh_rows<1, 8>(pr, stride, p.values, keys, D, o); break;
        case 2: weigh_rows<2, 8>(pr, stride, p.values, keys, D, o); break;
        default: weigh_rows<3, 8>(pr, stride, p.values, keys, D, o); break;
      }
    } else {  // D == 32 or 96: one chunk of 16 at a time
      for (int64_t c = 0; c < D / 16; ++c) weigh_rows<1, 1>(pr, stride, p.values + c * 16, keys, D, o + c * 16);
    }
    row += n;
  }
  for (int64_t row = 0; row < rows; ++row) {
    T* dst = op + token_of(p, it, G, row) * sh.out_token_stride +
                        head_of(it, G, row) * sh.out_head_stride;
    const __m512 inv = _mm512_set1_ps(s.inv_sums[row]);
    for (int64_t d = 0; d < D; d += 16)
      store16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(s.result.data() + row * D + d), inv));
  }
}

#if defined(INFLIGHT_PROMPT_AMX)
// AMX tiles, all 16 rows x 64 bytes (palette 1):
//   tiles 0-3  C: float32 accumulators, 16 rows x 16 columns (keys for S, dims for P @ V)
//   tiles 4-5  A: 16 rows x 32 bfloat16 (queries x dims for S; numerators x keys, hi
//              and lo, for P @ V)
//   tiles 6-7  B: 16 pair rows x 16 columns x 2 bfloat16 (the packed keys or values)
//
// Value pairs, one (prompt, KV head): tile (kb, c) holds keys 32 kb .. 32 kb + 31 and dims
// 16 c .. 16 c + 15, pair row i = keys 32 kb + 2 i and + 1, zero past the prompt:
//   value_pairs[((kb * D / 16 + c) * 16 + i) * 32 + 2 d + j] = V[32 kb + 2 i + j][16 c + d]
constexpr int64_t kTileElems = 512;  // bfloat16 in one A or B tile (1 KiB)

using inflight_amx::TileConfig;

// Linux grants a process AMX tile data only on request (arch_prctl), once per process;
// INFLIGHT_AMX=0 keeps the dot-product path (read once).
bool amx_ready() {
  static const bool ready = [] {
    const char* env = std::getenv("INFLIGHT_AMX");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    return inflight_amx::tile_permission();
  }();
  return ready;
}

// Each thread configures its own tiles (the configuration is per-thread CPU state).
void load_tile_config() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

void pack_value_pairs(const PromptShape& sh, const at::BFloat16* v, int64_t kv_head,
                      const Packed& p) {
  const int64_t D = sh.D, chunks = D / 16, blocks = (p.length + 31) / 32;
  // lane 2 d + j of the result takes dim d of row j (rows: a = first key, b = second)
  alignas(64) int16_t index[32];
  for (int d = 0; d < 16; ++d) {
    index[2 * d] = static_cast<int16_t>(d);
    index[2 * d + 1] = static_cast<int16_t>(16 + d);
  }
  const __m512i interleave = _mm512_load_si512(index);
  for (int64_t kb = 0; kb < blocks; ++kb) {
    for (int64_t i = 0; i < 16; ++i) {
      const int64_t t = 32 * kb + 2 * i;
      const at::BFloat16* a = v + (p.first + t) * sh.v_token_stride + kv_head * sh.v_head_stride;
      const at::BFloat16* b = a + sh.v_token_stride;
      for (int64_t c = 0; c < chunks; ++c) {
        const __m256i ra = t < p.length ? _mm256_loadu_si256((const __m256i*)(a + 16 * c))
                                        : _mm256_setzero_si256();
        const __m256i rb = t + 1 < p.length ? _mm256_loadu_si256((const __m256i*)(b + 16 * c))
                                            : _mm256_setzero_si256();
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(ra), rb, 1);
        at::BFloat16* dst = p.value_pairs + ((kb * chunks + c) * 16 + i) * 32;
        _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(interleave, both));
      }
    }
  }
}

// Raw scores (unscaled) of a 16-row query tile (A, row stride q_ld elements) against NB key blocks of
// 16, into scores[16][stride] at the blocks' columns.
template <int NB>
inline void amx_scores(const at::BFloat16* qtile, int64_t q_ld, int64_t D,
                       const uint32_t* kblock, float* scores, int64_t stride) {
  const int64_t pairs = D / 2;
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NB > 2) _tile_zero(2);
  if constexpr (NB > 3) _tile_zero(3);
  for (int64_t k = 0; k < D / 32; ++k) {
    _tile_loadd(4, qtile + 32 * k, q_ld * 2);
    const uint32_t* kb = kblock + k * 16 * 16;  // pair rows 16 k .. 16 k + 15
    _tile_loadd(6, kb, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB > 1) {
      _tile_loadd(7, kb + pairs * 16, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (NB > 2) {
      _tile_loadd(6, kb + 2 * pairs * 16, 64);
      _tile_dpbf16ps(2, 4, 6);
    }
    if constexpr (NB > 3) {
      _tile_loadd(7, kb + 3 * pairs * 16, 64);
      _tile_dpbf16ps(3, 4, 7);
    }
  }
  _tile_stored(0, scores, stride * 4);
  if constexpr (NB > 1) _tile_stored(1, scores + 16, stride * 4);
  if constexpr (NB > 2) _tile_stored(2, scores + 32, stride * 4);
  if constexpr (NB > 3) _tile_stored(3, scores + 48, stride * 4);
}

// out[16][16 * NC] (row stride D) = (hi + lo)[16][32 * blocks] @ V for NC dim chunks of 16
// starting at `vpairs` (the first chunk's tile in key block 0).
template <int NC>
inline void amx_weigh(const at::BFloat16* hi, const at::BFloat16* lo, int64_t stride,
                      const at::BFloat16* vpairs, int64_t blocks, int64_t D, float* out) {
  const int64_t block_elems = D / 16 * kTileElems;  // one key block's tiles, all chunks
  _tile_zero(0);
  if constexpr (NC > 1) _tile_zero(1);
  if constexpr (NC > 2) _tile_zero(2);
  if constexpr (NC > 3) _tile_zero(3);
  for (int64_t kb = 0; kb < blocks; ++kb) {
    const at::BFloat16* vb = vpairs + kb * block_elems;
    _tile_loadd(4, hi + 32 * kb, stride * 2);
    _tile_loadd(5, lo + 32 * kb, stride * 2);
    // two chunks per B pair, hi then lo, so no accumulator is used twice in a row
    _tile_loadd(6, vb, 64);
    if constexpr (NC > 1) _tile_loadd(7, vb + kTileElems, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NC > 1) _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(0, 5, 6);
    if constexpr (NC > 1) _tile_dpbf16ps(1, 5, 7);
    if constexpr (NC > 2) {
      _tile_loadd(6, vb + 2 * kTileElems, 64);
      if constexpr (NC > 3) _tile_loadd(7, vb + 3 * kTileElems, 64);
      _tile_dpbf16ps(2, 4, 6);
      if constexpr (NC > 3) _tile_dpbf16ps(3, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NC > 3) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, out, D * 4);
  if constexpr (NC > 1) _tile_stored(1, out + 16, D * 4);
  if constexpr (NC > 2) _tile_stored(2, out + 32, D * 4);
  if constexpr (NC > 3) _tile_stored(3, out + 48, D * 4);
}

inline __mmask16 first_lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF)
                 : n <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << n) - 1);
}

// 2^x for x <= 0 (near 0 up to a rounding), lanes outside `keep` zero: 2^n * 2^f with
// n = round(x), f = x - n in [-0.5, 0.5] (vreduceps) and 2^f by vec_math's exp2_fraction. x is clamped at -100: a
// numerator below 2^-100 of the row's largest changes nothing, and no result or lo part
// is subnormal (whose arithmetic can take microcode assists).
inline __m512 exp2_lanes(__m512 x, __mmask16 keep) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-100.0f));
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 n = _mm512_sub_ps(x, f);
  return _mm512_maskz_scalef_ps(keep, exp2_fraction(f), n);
}

// p rounded to bfloat16 (to nearest, ties away from zero), still in float32: exact in
// bfloat16, and p - it is exact in float32.
inline __m512 bf16_part(__m512 p) {
  const __m512i bits = _mm512_add_epi32(_mm512_castps_si512(p), _mm512_set1_epi32(0x8000));
  return _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(0xFFFF0000u)));
}

// One row of raw scores over its first `visible` keys -> the numerators
// p = exp(scale * (s - max)) as hi = bf16(p) and lo = bf16(p - hi), zero from `visible` to
// `width` (a multiple of 32); returns 1 / the sum of the float32 numerators. One pass for
// the max, one for the rest (the row, 4 KiB per 1024 keys, is in L1 for the second).
float split_numerators(const float* row, int64_t visible, int64_t width, float scale,
                       at::BFloat16* hi, at::BFloat16* lo) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t full = visible / 16 * 16;
  const __mmask16 tail = first_lanes(visible - full);
  __m512 mx = _mm512_mask_loadu_ps(neg_inf, tail, row + full);
  for (int64_t t = 0; t < full; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(row + t));
  // exp(scale * (s - max)) = 2^(s * c - max * c), c = scale * log2(e)
  const float c = scale * 1.44269504088896341f;
  const __m512 vc = _mm512_set1_ps(c);
  const __m512 mc = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * c);
  __m512 sum = _mm512_setzero_ps();
  const int64_t live = (visible + 31) / 32 * 32;
  for (int64_t t = 0; t < live; t += 32) {
    const __mmask16 k0 = first_lanes(visible - t), k1 = first_lanes(visible - t - 16);
    const __m512 e0 = exp2_lanes(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k0, row + t), vc, mc), k0);
    const __m512 e1 =
        exp2_lanes(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k1, row + t + 16), vc, mc), k1);
    sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
    const __m512 h0 = bf16_part(e0), h1 = bf16_part(e1);
    _mm512_storeu_si512(hi + t, (__m512i)_mm512_cvtne2ps_pbh(h1, h0));
    _mm512_storeu_si512(lo + t, (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(e1, h1),
                                                             _mm512_sub_ps(e0, h0)));
  }
  for (int64_t t = live; t < width; t += 32) {
    _mm512_storeu_si512(hi + t, _mm512_setzero_si512());
    _mm512_storeu_si512(lo + t, _mm512_setzero_si512());
  }
  return 1.f / _mm512_reduce_add_ps(sum);
}

// The AMX path's rows: an item's tile g holds head kv_head * G + g for each of the item's
// query tokens in order (row r = token q_begin + r), so a full item's query tile is one
// strided load straight from q (a gathered copy made the tile load wait for its stores
// to drain: ~8% of the kernel on the Intel Xeon with AMX).
inline const at::BFloat16* query_row(const PromptShape& sh, const TileItem& it, const Packed& p,
                                     const at::BFloat16* qp, int64_t g, int64_t r) {
  return qp + (p.first + it.q_begin + r) * sh.q_token_stride +
         (it.kv_head * sh.group + g) * sh.q_head_stride;
}
inline at::BFloat16* out_row(const PromptShape& sh, const TileItem& it, const Packed& p,
                             at::BFloat16* op, int64_t g, int64_t r) {
  return op + (p.first + it.q_begin + r) * sh.out_token_stride +
         (it.kv_head * sh.group + g) * sh.out_head_stride;
}

// Prefetches an item's queries, and its output rows for writing: the step's queries and
// outputs are megabytes, in L3 or memory by the time an item reaches them.
inline void prefetch_item_rows(const PromptShape& sh, const TileItem& it, const Packed& p,
                               const at::BFloat16* qp, at::BFloat16* op) {
  const int64_t row_bytes = sh.D * 2;
  for (int64_t r = 0; r < it.q_end - it.q_begin; ++r) {
    for (int64_t g = 0; g < sh.group; ++g) {
      const auto* q = reinterpret_cast<const char*>(query_row(sh, it, p, qp, g, r));
      auto* o = reinterpret_cast<char*>(out_row(sh, it, p, op, g, r));
      for (int64_t b = 0; b < row_bytes; b += 64) {
        _mm_prefetch(q + b, _MM_HINT_T0);
        _m_prefetchw(o + b);
      }
    }
  }
}

// One item on AMX tiles, one head of its KV group at a time (16 rows: the item's query
// tokens, a last item's rows past its prompt zero queries whose numerators are zero and
// outputs dropped): scores against the keys the item's last token sees, the numerators
// split in two bfloat16 parts, P @ V in 4 chunks of 16 dims at a time. `next` / `next_p`:
// the item this worker takes after this one (or null), prefetched during the last head.
void amx_item(const PromptShape& sh, const TileItem& it, const Packed& p,
              const at::BFloat16* qp, float fscale, at::BFloat16* op, Scratch& s,
              const TileItem* next, const Packed* next_p) {
  const int64_t D = sh.D, pairs = D / 2, G = sh.group, chunks = D / 16;
  const int64_t n = it.q_end - it.q_begin;  // query tokens, at most 16
  const int64_t keys = it.q_end;             // what the last token sees
  const int64_t blocks = (keys + 15) / 16, width = (keys + 31) / 32 * 32;
  // Rows of scores and numerators one cache line longer than a power of two's multiple,
  // so a tile's 16 rows do not all fall into the same L1 sets.
  const int64_t ld = width + 16, ldp = width + 32;  // scores', numerators' row strides
  at::BFloat16* qt = aligned(s.q, 16 * D);  // a partial item's queries, gathered and padded
  float* sc = aligned(s.scores, 16 * ld);
  at::BFloat16* hi = aligned(s.hi, 16 * ldp);
  at::BFloat16* lo = aligned(s.lo, 16 * ldp);
  float* result = aligned(s.result, 16 * D);
  float inv_sums[16];
  for (int64_t g = 0; g < G; ++g) {
    if (g == G - 1 && next != nullptr) prefetch_item_rows(sh, *next, *next_p, qp, op);
    const at::BFloat16* qtile = query_row(sh, it, p, qp, g, 0);
    int64_t q_ld = sh.q_token_stride;
    if (n < 16) {
      for (int64_t r = 0; r < 16; ++r)
        for (int64_t d = 0; d < D; d += 32)
          _mm512_store_si512(qt + r * D + d, r < n ? _mm512_loadu_si512(query_row(sh, it, p, qp, g, r) + d)
                                                   : _mm512_setzero_si512());
      qtile = qt;
      q_ld = D;
    }
    int64_t b = 0;
    for (; b + 4 <= blocks; b += 4)
      amx_scores<4>(qtile, q_ld, D, p.keys + b * pairs * 16, sc + b * 16, ld);
    switch (blocks - b) {
      case 1: amx_scores<1>(qtile, q_ld, D, p.keys + b * pairs * 16, sc + b * 16, ld); break;
      case 2: amx_scores<2>(qtile, q_ld, D, p.keys + b * pairs * 16, sc + b * 16, ld); break;
      case 3: amx_scores<3>(qtile, q_ld, D, p.keys + b * pairs * 16, sc + b * 16, ld); break;
      default: break;
    }
    for (int64_t r = 0; r < 16; ++r) {
      const int64_t visible = r < n ? it.q_begin + r + 1 : 0;
      inv_sums[r] = split_numerators(sc + r * ld, visible, width, fscale, hi + r * ldp,
                                     lo + r * ldp);
    }
    for (int64_t c = 0; c < chunks; c += 4) {
      const at::BFloat16* vp = p.value_pairs + c * kTileElems;
      switch (std::min<int64_t>(4, chunks - c)) {
        case 1: amx_weigh<1>(hi, lo, ldp, vp, width / 32, D, result + c * 16); break;
        case 2: amx_weigh<2>(hi, lo, ldp, vp, width / 32, D, result + c * 16); break;
        case 3: amx_weigh<3>(hi, lo, ldp, vp, width / 32, D, result + c * 16); break;
        default: amx_weigh<4>(hi, lo, ldp, vp, width / 32, D, result + c * 16); break;
      }
    }
    for (int64_t r = 0; r < n; ++r) {
      at::BFloat16* dst = out_row(sh, it, p, op, g, r);
      const __m512 inv = _mm512_set1_ps(inv_sums[r]);
      for (int64_t d = 0; d < D; d += 16)
        store16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(result + r * D + d), inv));
    }
  }
}
#endif  // INFLIGHT_PROMPT_AMX

// INFLIGHT_PROMPT_ATTENTION=sdpa keeps float32 prompts on PyTorch's flash kernel (read once).
bool use_float32_kernel() {
  static const bool use = [] {
    const char* choice = std::getenv("INFLIGHT_PROMPT_ATTENTION");
    return choice == nullptr || std::string(choice) != "sdpa";
  }();
  return use;
}

bool use_amx(bool allow_amx) {
#if defined(INFLIGHT_PROMPT_AMX)
  return allow_amx && amx_ready();
#else
  (void)allow_amx;
  return false;
#endif
}

// This file's own kernel for bfloat16 or float32 (T) prompts; AMX only for bfloat16.
template <typename T>
void own_prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const int64_t* fp, const int64_t* cp, int64_t num_prompts,
                          double scale, bool amx, at::Tensor& out) {
  const PromptShape sh{q.size(1), k.size(1), q.size(1) / k.size(1), q.size(2),
                       q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                       v.stride(0), v.stride(1), out.stride(0), out.stride(1)};
  const int64_t D = sh.D, pairs = units_of<T>(D), KVH = sh.kv_heads;
  amx = amx && std::is_same_v<T, at::BFloat16>;

  // Scratch for every (prompt, KV head)'s packed keys and values (float32 values for the
  // dot-product path, bfloat16 pairs padded to 32 keys for AMX).
  std::vector<Packed> packed(num_prompts * KVH);
  int64_t key_words = 0, value_words = 0, value_pair_elems = 0;
  for (int64_t s = 0; s < num_prompts; ++s) {
    key_words += (cp[s] + 15) / 16 * 16 * pairs * KVH;
    if (amx) value_pair_elems += (cp[s] + 31) / 32 * 32 * D * KVH;
    else value_words += cp[s] * D * KVH;
  }
  // Uninitialised (the packing writes every element, padding included).
  const auto bytes = [](int64_t n) { return at::empty({n}, at::TensorOptions().dtype(at::kByte)); };
  const at::Tensor key_buf = bytes(key_words * 4), value_buf = bytes(value_words * 4),
                   value_pair_buf = bytes(value_pair_elems * 2);
  auto* key_words_at = reinterpret_cast<uint32_t*>(key_buf.data_ptr());
  auto* values_at = reinterpret_cast<float*>(value_buf.data_ptr());
  auto* value_pairs_at = reinterpret_cast<at::BFloat16*>(value_pair_buf.data_ptr());
  std::vector<TileItem> items;
  std::vector<int64_t> costs;
  {
    int64_t ko = 0, vo = 0, po = 0;
    for (int64_t s = 0; s < num_prompts; ++s) {
      for (int64_t h = 0; h < KVH; ++h) {
        packed[s * KVH + h] = {fp[s], cp[s], key_words_at + ko,
                               amx ? nullptr : values_at + vo,
                               amx ? value_pairs_at + po : nullptr};
        ko += (cp[s] + 15) / 16 * 16 * pairs;
        if (amx) po += (cp[s] + 31) / 32 * 32 * D;
        else vo += cp[s] * D;
        for (int64_t b = 0; b < cp[s]; b += kTile) {
          const int64_t e = std::min(cp[s], b + kTile);
          items.push_back({static_cast<int32_t>(s), static_cast<int32_t>(h),
                           static_cast<int32_t>(b), static_cast<int32_t>(e)});
          costs.push_back((e - b) * e);
        }
      }
    }
  }
  const auto* kp = k.data_ptr<T>();
  const auto* vp = v.data_ptr<T>();
  const auto* qp = q.data_ptr<T>();
  auto* op = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
#if defined(INFLIGHT_PROMPT_AMX)
  if constexpr (std::is_same_v<T, at::BFloat16>) if (amx) {
    // Whole (prompt, KV head) pairs per worker, dearest first: a pair is packed and its
    // items run in order by the same core, so its keys and values are read from that
    // core's L2 instead of wherever the packing ran (on the Intel Xeon with AMX, 1.1x on
    // `mixed`-like steps against items handed out one by one).
    const int64_t num_pairs = num_prompts * KVH;
    std::vector<int64_t> first_item(num_pairs + 1, 0), pair_order(num_pairs);
    for (int64_t i = 0; i < num_pairs; ++i) {
      first_item[i + 1] = first_item[i] + (cp[i / KVH] + kTile - 1) / kTile;
      pair_order[i] = i;
    }
    std::stable_sort(pair_order.begin(), pair_order.end(),
                     [&](int64_t a, int64_t b) { return cp[a / KVH] > cp[b / KVH]; });
    std::atomic<int64_t> next_pair{0};
    const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_pairs);
    at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
      Scratch scratch;
      load_tile_config();
      for (int64_t w = next_pair++; w < num_pairs; w = next_pair++) {
        const int64_t i = pair_order[w];
        pack_keys(sh, kp, i % KVH, packed[i]);
        pack_value_pairs(sh, vp, i % KVH, packed[i]);
        for (int64_t j = first_item[i]; j < first_item[i + 1]; ++j) {
          const TileItem* following = j + 1 < first_item[i + 1] ? &items[j + 1] : nullptr;
          amx_item(sh, items[j], packed[i], qp, fscale, op, scratch, following, &packed[i]);
        }
      }
      _tile_release();
    });
    return;
  }
#endif
  at::parallel_for(0, num_prompts * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      pack_keys(sh, kp, i % KVH, packed[i]);
      pack_values(sh, vp, i % KVH, packed[i]);
    }
  });

  // Dearest items first, handed out one by one (long prompts' late tiles cost the most).
  std::vector<int32_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return costs[a] > costs[b]; });
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch scratch;
    for (int64_t w = next++; w < num_items; w = next++) {
      const TileItem& it = items[order[w]];
      dot_item(sh, it, packed[it.prompt * KVH + it.kv_head], qp, fscale, op, scratch);
    }
  });
}
#endif

#if defined(INFLIGHT_PROMPT_AMX)
bool prompt_attention_amx_available() { return amx_ready(); }
#else
bool prompt_attention_amx_available() { return false; }
#endif

void prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& starts, const at::Tensor& lengths, double scale,
                      at::Tensor& out, bool allow_amx) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.sizes() == q.sizes(),
              "q/out must be [T, H, D] and k, v [T, KVH, D]");
  TORCH_CHECK(k.size(0) == q.size(0) && v.sizes() == k.sizes() && k.size(2) == q.size(2) &&
                  q.size(1) % k.size(1) == 0,
              "q, k and v shapes do not match");
  TORCH_CHECK(starts.scalar_type() == at::kLong && lengths.scalar_type() == at::kLong &&
                  starts.dim() == 1 && lengths.sizes() == starts.sizes(),
              "starts and lengths must be int64 [S]");
  const auto first = starts.contiguous();
  const auto count = lengths.contiguous();
  const int64_t* fp = first.data_ptr<int64_t>();
  const int64_t* cp = count.data_ptr<int64_t>();
  const int64_t num_prompts = starts.size(0);
  for (int64_t s = 0; s < num_prompts; ++s)
    TORCH_CHECK(fp[s] >= 0 && cp[s] >= 1 && fp[s] + cp[s] <= q.size(0),
                "prompt ", s, " is outside the step's tokens");
#if defined(__AVX512F__)
  const auto all = [&](at::ScalarType t) {
    return q.scalar_type() == t && k.scalar_type() == t && v.scalar_type() == t &&
           out.scalar_type() == t;
  };
  const bool rows_contiguous = q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 &&
                               out.stride(2) == 1;
#if defined(__AVX512BF16__)
  if (all(at::kBFloat16) && rows_contiguous && q.size(2) % 32 == 0) {
    own_prompt_attention<at::BFloat16>(q, k, v, fp, cp, num_prompts, scale, use_amx(allow_amx),
                                       out);
    return;
  }
#endif
  if (all(at::kFloat) && rows_contiguous && q.size(2) % 16 == 0 && use_float32_kernel()) {
    own_prompt_attention<float>(q, k, v, fp, cp, num_prompts, scale, false, out);
    return;
  }
#if !defined(__AVX512BF16__)
  // No vdpbf16ps (Intel Ice Lake): bfloat16 prompts widen to float32 (exact), take the
  // float32 kernel, and round once on the way out; rows outside the prompts round-trip
  // unchanged. SDPA in bfloat16 rounds its intermediate sums too (3% of outputs more than
  // one bfloat16 step off float64 attention, measured on model 106).
  if (all(at::kBFloat16) && rows_contiguous && q.size(2) % 16 == 0 && use_float32_kernel()) {
    auto out32 = out.to(at::kFloat);
    own_prompt_attention<float>(q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat), fp, cp,
                                num_prompts, scale, false, out32);
    out.copy_(out32);
    return;
  }
#endif
#endif
  sdpa_per_prompt(q, k, v, fp, cp, num_prompts, scale, out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inflight, m) {
  m.def(
      "prompt_attention(Tensor q, Tensor k, Tensor v, Tensor starts, Tensor lengths, "
      "float scale, Tensor(a!) out, bool allow_amx=True) -> ()");
  m.impl("prompt_attention", c10::DispatchKey::CPU, &prompt_attention);
  m.def("prompt_attention_amx_available() -> bool", &prompt_attention_amx_available);
}
