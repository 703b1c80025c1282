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
//  - otherwise one call of PyTorch's scaled_dot_product_attention per prompt (its CPU
//    flash kernel) on strided views, so nothing is padded or copied.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vec_math.h"

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

#if defined(__AVX512BF16__)
constexpr int64_t kTile = 16;  // query tokens per work item; keys come in blocks of 16

// One bfloat16 pair (two adjacent elements) as the 32-bit lane vdpbf16ps broadcasts.
inline uint32_t pair_at(const at::BFloat16* p) {
  uint32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return bits;
}

inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
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
  uint32_t* keys;    // [ceil(L / 16)][D / 2][16] pairs
  float* values;     // [L][D] float32 (bfloat16 widened exactly)
};

void pack(const PromptShape& sh, const at::BFloat16* k, const at::BFloat16* v, int64_t kv_head,
          const Packed& p) {
  const int64_t D = sh.D, pairs = D / 2, blocks = (p.length + 15) / 16;
  for (int64_t b = 0; b < blocks; ++b) {
    uint32_t* dst = p.keys + b * pairs * 16;
    for (int64_t i = 0; i < 16; ++i) {
      const int64_t t = b * 16 + i;
      if (t >= p.length) {
        for (int64_t dp = 0; dp < pairs; ++dp) dst[dp * 16 + i] = 0;
        continue;
      }
      const at::BFloat16* row = k + (p.first + t) * sh.k_token_stride + kv_head * sh.k_head_stride;
      for (int64_t dp = 0; dp < pairs; ++dp) dst[dp * 16 + i] = pair_at(row + 2 * dp);
    }
  }
  for (int64_t t = 0; t < p.length; ++t) {
    const at::BFloat16* row = v + (p.first + t) * sh.v_token_stride + kv_head * sh.v_head_stride;
    float* dst = p.values + t * D;
    for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(dst + d, load16(row + d));
  }
}

// scores[r][16 * NB * j ...] for NR query rows against NB key blocks.
template <int NR, int NB>
inline void score_tile(const uint32_t* const* qrows, const uint32_t* kblock, int64_t pairs,
                       float scale, float* scores, int64_t stride) {
  __m512 acc[NR * NB];
  for (int i = 0; i < NR * NB; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t dp = 0; dp < pairs; ++dp) {
    __m512i kv[NB];
    for (int b = 0; b < NB; ++b)
      kv[b] = _mm512_loadu_si512(kblock + (b * pairs + dp) * 16);
    for (int r = 0; r < NR; ++r) {
      const __m512i qv = _mm512_set1_epi32(static_cast<int>(qrows[r][dp]));
      for (int b = 0; b < NB; ++b) acc[r * NB + b] = dot_pairs(acc[r * NB + b], qv, kv[b]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < NR; ++r)
    for (int b = 0; b < NB; ++b)
      _mm512_storeu_ps(scores + r * stride + b * 16, _mm512_mul_ps(acc[r * NB + b], sc));
}

template <int NR>
void score_rows(const uint32_t* const* qrows, const uint32_t* keys, int64_t blocks,
                int64_t pairs, float scale, float* scores, int64_t stride) {
  int64_t b = 0;
  for (; b + 4 <= blocks; b += 4)
    score_tile<NR, 4>(qrows, keys + b * pairs * 16, pairs, scale, scores + b * 16, stride);
  for (; b < blocks; ++b)
    score_tile<NR, 1>(qrows, keys + b * pairs * 16, pairs, scale, scores + b * 16, stride);
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

void bf16_prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const int64_t* fp, const int64_t* cp, int64_t num_prompts,
                           double scale, at::Tensor& out) {
  const PromptShape sh{q.size(1), k.size(1), q.size(1) / k.size(1), q.size(2),
                       q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                       v.stride(0), v.stride(1), out.stride(0), out.stride(1)};
  const int64_t D = sh.D, pairs = D / 2, KVH = sh.kv_heads, G = sh.group;

  // Scratch for every (prompt, KV head)'s packed keys and values.
  std::vector<Packed> packed(num_prompts * KVH);
  int64_t key_words = 0, value_words = 0;
  for (int64_t s = 0; s < num_prompts; ++s) {
    key_words += (cp[s] + 15) / 16 * 16 * pairs * KVH;
    value_words += cp[s] * D * KVH;
  }
  std::vector<uint32_t> key_buf(key_words);
  std::vector<float> value_buf(value_words);
  std::vector<TileItem> items;
  std::vector<int64_t> costs;
  {
    int64_t ko = 0, vo = 0;
    for (int64_t s = 0; s < num_prompts; ++s) {
      for (int64_t h = 0; h < KVH; ++h) {
        packed[s * KVH + h] = {fp[s], cp[s], key_buf.data() + ko, value_buf.data() + vo};
        ko += (cp[s] + 15) / 16 * 16 * pairs;
        vo += cp[s] * D;
        for (int64_t b = 0; b < cp[s]; b += kTile) {
          const int64_t e = std::min(cp[s], b + kTile);
          items.push_back({static_cast<int32_t>(s), static_cast<int32_t>(h),
                           static_cast<int32_t>(b), static_cast<int32_t>(e)});
          costs.push_back((e - b) * e);
        }
      }
    }
  }
  const auto* kp = k.data_ptr<at::BFloat16>();
  const auto* vp = v.data_ptr<at::BFloat16>();
  at::parallel_for(0, num_prompts * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) pack(sh, kp, vp, i % KVH, packed[i]);
  });

  // Dearest items first, handed out one by one (long prompts' late tiles cost the most).
  std::vector<int32_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return costs[a] > costs[b]; });
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
  const auto* qp = q.data_ptr<at::BFloat16>();
  auto* op = out.data_ptr<at::BFloat16>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> scores, result, inv_sums;
    std::vector<const uint32_t*> qrows;
    for (int64_t w = next++; w < num_items; w = next++) {
      const TileItem it = items[order[w]];
      const Packed& p = packed[it.prompt * KVH + it.kv_head];
      const int64_t rows = static_cast<int64_t>(it.q_end - it.q_begin) * G;
      const int64_t blocks = (it.q_end + 15) / 16;
      const int64_t stride = blocks * 16;  // scores per row
      scores.resize(rows * stride);
      result.resize(rows * D);
      inv_sums.resize(rows);
      qrows.resize(rows);
      // row r = (query it.q_begin + r / G, head kv_head * G + r % G)
      auto token_of = [&](int64_t r) { return p.first + it.q_begin + r / G; };
      auto head_of = [&](int64_t r) { return it.kv_head * G + r % G; };
      for (int64_t r = 0; r < rows; ++r)
        qrows[r] = reinterpret_cast<const uint32_t*>(
            qp + token_of(r) * sh.q_token_stride + head_of(r) * sh.q_head_stride);
      float* sc = scores.data();
      int64_t r = 0;
      for (; r + 6 <= rows; r += 6)
        score_rows<6>(qrows.data() + r, p.keys, blocks, pairs, fscale, sc + r * stride, stride);
      switch (rows - r) {
        case 1: score_rows<1>(qrows.data() + r, p.keys, blocks, pairs, fscale, sc + r * stride, stride); break;
        case 2: score_rows<2>(qrows.data() + r, p.keys, blocks, pairs, fscale, sc + r * stride, stride); break;
        case 3: score_rows<3>(qrows.data() + r, p.keys, blocks, pairs, fscale, sc + r * stride, stride); break;
        case 4: score_rows<4>(qrows.data() + r, p.keys, blocks, pairs, fscale, sc + r * stride, stride); break;
        case 5: score_rows<5>(qrows.data() + r, p.keys, blocks, pairs, fscale, sc + r * stride, stride); break;
        default: break;
      }
      for (int64_t row = 0; row < rows; ++row)
        inv_sums[row] = softmax_numerators(sc + row * stride, it.q_begin + row / G + 1, stride);
      // Rows per pass keep NR * CH accumulators in registers (CH = D / 16); each pass runs
      // to the keys its last row sees (the others' numerators are zero there).
      for (int64_t row = 0; row < rows;) {
        const int64_t n = std::min<int64_t>(D == 64 ? 6 : D == 128 ? 3 : 1, rows - row);
        const int64_t keys = it.q_begin + (row + n - 1) / G + 1;
        const float* pr = sc + row * stride;
        float* o = result.data() + row * D;
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
        at::BFloat16* dst = op + token_of(row) * sh.out_token_stride + head_of(row) * sh.out_head_stride;
        const __m512 inv = _mm512_set1_ps(inv_sums[row]);
        for (int64_t d = 0; d < D; d += 16)
          store16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(result.data() + row * D + d), inv));
      }
    }
  });
}
#endif

void prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& starts, const at::Tensor& lengths, double scale,
                      at::Tensor& out) {
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
#if defined(__AVX512BF16__)
  const bool bf16 = q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                    v.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16;
  const bool rows_contiguous = q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 &&
                               out.stride(2) == 1;
  if (bf16 && rows_contiguous && q.size(2) % 32 == 0) {
    bf16_prompt_attention(q, k, v, fp, cp, num_prompts, scale, out);
    return;
  }
#endif
  sdpa_per_prompt(q, k, v, fp, cp, num_prompts, scale, out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inflight, m) {
  m.def(
      "prompt_attention(Tensor q, Tensor k, Tensor v, Tensor starts, Tensor lengths, "
      "float scale, Tensor(a!) out) -> ()");
  m.impl("prompt_attention", c10::DispatchKey::CPU, &prompt_attention);
}
