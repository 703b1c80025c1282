// Varlen paged attention for the CPU: one call per layer for every sequence in a step,
// prompt chunks and decode tokens alike, reading K/V in place through block tables.
//
//   q:            [T, H, D]   float32, the step's query tokens, sequence after sequence
//   k_cache:      [num_blocks, KVH, D, block_size]   float32 or bfloat16 (keys transposed)
//   v_cache:      [num_blocks, block_size, KVH, D]   same dtype
//   block_tables: [S, max_blocks] int32
//   query_start:  [S + 1] int32   tokens of sequence s are q[query_start[s] : query_start[s+1]]
//   seq_lens:     [S] int32       context length of s after this step (cached + new)
//   returns:      [T, H, D] float32
//
// Query i of sequence s sits at position seq_lens[s] - q_len + i and sees keys 0..position
// (causal over the cached prefix and the chunk). Work is split into (sequence, query tile,
// KV head) items; the G = H / KVH query heads that share a KV head are done together.
//
// Why keys are stored transposed: with a block's keys laid out [D][block_size], the scores
// of 16 keys for one query are 16 lanes of one vector accumulated over d by broadcast FMAs,
// with no horizontal reductions. Values stay row-major: out += p * v is a plain AXPY.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vec_math.h"

namespace {

using namespace inflight_vec;

constexpr int64_t kQueryTile = 16;
constexpr int64_t kPrefetchBlocks = 2;

inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
}
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Shape {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
};

struct WorkItem {
  int32_t seq;
  int32_t q_begin;  // first query of the tile, as an offset within the sequence
  int32_t q_end;
  int32_t kv_head;
};

// ---------------------------------------------------------------- vector helpers (AVX-512)
#if defined(__AVX512F__)
// Scores of NR query rows against the 16 keys of one block (keys stored [D][16]). NR is a
// compile-time constant so the accumulators live in registers.
template <int NR, typename kv_t>
inline void score_block(const float* queries, int64_t D, const kv_t* kb, float* scores,
                        int64_t row_stride) {
  __m512 acc[NR];
  for (int j = 0; j < NR; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m512 kd = load16(kb + d * 16);
    for (int j = 0; j < NR; ++j)
      acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(queries[j * D + d]), kd, acc[j]);
  }
  for (int j = 0; j < NR; ++j) _mm512_storeu_ps(scores + j * row_stride, acc[j]);
}

// out[NR][16 * CH] = probs[NR][:num_keys] @ V, V rows found through value_row(t).
template <int NR, int CH, typename kv_t, typename RowFn>
inline void weigh_values(const float* probs, int64_t row_stride, int64_t num_keys,
                         RowFn value_row, float* out, int64_t D) {
  __m512 acc[NR * CH];
  for (int i = 0; i < NR * CH; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t t = 0; t < num_keys; ++t) {
    const kv_t* v = value_row(t);
    __m512 vc[CH];
    for (int c = 0; c < CH; ++c) vc[c] = load16(v + c * 16);
    for (int j = 0; j < NR; ++j) {
      const __m512 p = _mm512_set1_ps(probs[j * row_stride + t]);
      for (int c = 0; c < CH; ++c) acc[j * CH + c] = _mm512_fmadd_ps(p, vc[c], acc[j * CH + c]);
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int c = 0; c < CH; ++c) _mm512_storeu_ps(out + j * D + c * 16, acc[j * CH + c]);
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
  float* scores;         // [rows, padded_keys]
  float* out;            // [rows, D]

  const kv_t* key_block(int64_t b) const {  // [D][block_size]
    const int64_t block = table[b];
    return k_cache + (block * shape.num_kv_heads + kv_head) * shape.head_dim * shape.block_size;
  }
  const kv_t* value_row(int64_t t) const {  // [D]
    const int64_t block = table[t / shape.block_size];
    const int64_t slot = block * shape.block_size + t % shape.block_size;
    return v_cache + (slot * shape.num_kv_heads + kv_head) * shape.head_dim;
  }

  void compute_scores() {
    const int64_t D = shape.head_dim, bs = shape.block_size;
#if defined(__AVX512F__)
    if (bs == 16) {
      const int64_t key_block_bytes = D * bs * static_cast<int64_t>(sizeof(kv_t));
      for (int64_t b = 0; b * bs < num_keys; ++b) {
        // Blocks sit anywhere in the cache, so the hardware prefetcher cannot guess the
        // next one: fetch the block kPrefetchBlocks ahead while this one is scored.
        if ((b + kPrefetchBlocks) * bs < num_keys)
          prefetch(key_block(b + kPrefetchBlocks), key_block_bytes);
        const kv_t* kb = key_block(b);
        int64_t r = 0;
        for (; r + 8 <= rows; r += 8)
          score_block<8>(queries + r * D, D, kb, scores + r * padded_keys + b * bs, padded_keys);
        const float* q = queries + r * D;
        float* out_scores = scores + r * padded_keys + b * bs;
        switch (rows - r) {
          case 1: score_block<1>(q, D, kb, out_scores, padded_keys); break;
          case 2: score_block<2>(q, D, kb, out_scores, padded_keys); break;
          case 3: score_block<3>(q, D, kb, out_scores, padded_keys); break;
          case 4: score_block<4>(q, D, kb, out_scores, padded_keys); break;
          case 5: score_block<5>(q, D, kb, out_scores, padded_keys); break;
          case 6: score_block<6>(q, D, kb, out_scores, padded_keys); break;
          case 7: score_block<7>(q, D, kb, out_scores, padded_keys); break;
          default: break;
        }
      }
      return;
    }
#endif
    for (int64_t b = 0; b * bs < num_keys; ++b) {
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

  // Softmax of row r over its visible keys [0, visible); the rest become 0.
  void softmax_row(int64_t r, int64_t visible) {
    float* row = scores + r * padded_keys;
    for (int64_t t = visible; t < padded_keys; ++t) row[t] = kNegInf;
    float max_score = kNegInf;
    for (int64_t t = 0; t < visible; ++t) max_score = std::max(max_score, row[t]);
    float total = 0.f;
    int64_t t = 0;
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
    for (int64_t i = 0; i < visible; ++i) row[i] *= inv;
  }

  void accumulate_values() {
    const int64_t D = shape.head_dim;
#if defined(__AVX512F__)
    if (D == 64 || D == 128) {
      auto row_of = [this](int64_t t) {
        // Value rows of the block kPrefetchBlocks ahead (see compute_scores).
        const int64_t ahead = t + kPrefetchBlocks * shape.block_size;
        if (ahead < num_keys)
          prefetch(value_row(ahead), shape.head_dim * static_cast<int64_t>(sizeof(kv_t)));
        return value_row(t);
      };
      // Rows per pass keep NR * CH accumulators (plus CH value vectors) in registers.
      const int64_t per_pass = D == 64 ? 4 : 2;
      for (int64_t r = 0; r < rows; r += per_pass) {
        const int64_t nr = std::min(per_pass, rows - r);
        const float* p = scores + r * padded_keys;
        float* o = out + r * D;
        if (D == 64) {
          switch (nr) {
            case 1: weigh_values<1, 4, kv_t>(p, padded_keys, num_keys, row_of, o, D); break;
            case 2: weigh_values<2, 4, kv_t>(p, padded_keys, num_keys, row_of, o, D); break;
            case 3: weigh_values<3, 4, kv_t>(p, padded_keys, num_keys, row_of, o, D); break;
            default: weigh_values<4, 4, kv_t>(p, padded_keys, num_keys, row_of, o, D); break;
          }
        } else if (nr == 1) {
          weigh_values<1, 8, kv_t>(p, padded_keys, num_keys, row_of, o, D);
        } else {
          weigh_values<2, 8, kv_t>(p, padded_keys, num_keys, row_of, o, D);
        }
      }
      return;
    }
#endif
    std::fill(out, out + rows * D, 0.f);
    for (int64_t t = 0; t < num_keys; ++t) {
      const kv_t* v = value_row(t);
      for (int64_t r = 0; r < rows; ++r) {
        const float p = scores[r * padded_keys + t];
        if (p == 0.f) continue;
        for (int64_t d = 0; d < D; ++d) out[r * D + d] += p * load(v[d]);
      }
    }
  }
};

template <typename kv_t>
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& query_start,
            const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const Shape shape{q.size(1), k_cache.size(1), q.size(1) / k_cache.size(1), q.size(2),
                    k_cache.size(3), block_tables.size(1)};
  const float* q_ptr = q.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* starts = query_start.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* out_ptr = out.data_ptr<float>();
  const int64_t D = shape.head_dim, G = shape.group;

  std::vector<WorkItem> items;
  for (int32_t s = 0; s < seq_lens.size(0); ++s) {
    const int32_t q_len = starts[s + 1] - starts[s];
    for (int32_t b = 0; b < q_len; b += kQueryTile) {
      const int32_t e = std::min<int32_t>(q_len, b + kQueryTile);
      for (int32_t h = 0; h < shape.num_kv_heads; ++h) items.push_back({s, b, e, h});
    }
  }

  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries, scores, result;
    for (int64_t w = begin; w < end; ++w) {
      const WorkItem it = items[w];
      const int64_t q_len = starts[it.seq + 1] - starts[it.seq];
      const int64_t first_pos = lens[it.seq] - q_len;  // position of query 0
      const int64_t rows = static_cast<int64_t>(it.q_end - it.q_begin) * G;
      const int64_t num_keys = first_pos + it.q_end;
      const int64_t padded = (num_keys + shape.block_size - 1) / shape.block_size * shape.block_size;
      auto token_head = [&](int64_t r) {  // row r = (query in tile, head in group)
        const int64_t token = starts[it.seq] + it.q_begin + r / G;
        return token * shape.num_heads + it.kv_head * G + r % G;
      };
      queries.resize(rows * D);
      scores.resize(rows * padded);
      result.resize(rows * D);
      for (int64_t r = 0; r < rows; ++r) {
        const float* src = q_ptr + token_head(r) * D;
        for (int64_t d = 0; d < D; ++d) queries[r * D + d] = src[d] * static_cast<float>(scale);
      }
      Item<kv_t> item{shape, k_cache.data_ptr<kv_t>(), v_cache.data_ptr<kv_t>(),
                      tables + static_cast<int64_t>(it.seq) * shape.max_blocks, it.kv_head,
                      rows, num_keys, padded, queries.data(), scores.data(), result.data()};
      item.compute_scores();
      for (int64_t r = 0; r < rows; ++r) item.softmax_row(r, first_pos + it.q_begin + r / G + 1);
      item.accumulate_values();
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(out_ptr + token_head(r) * D, result.data() + r * D, D * sizeof(float));
    }
  });
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& query_start, const at::Tensor& seq_lens,
                           double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "q must be a contiguous float32 [T, H, D] tensor");
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
  if (k_cache.scalar_type() == at::kFloat) {
    attend<float>(q, k_cache, v_cache, tables, query_start, seq_lens, scale, out);
  } else if (k_cache.scalar_type() == at::kBFloat16) {
    attend<at::BFloat16>(q, k_cache, v_cache, tables, query_start, seq_lens, scale, out);
  } else {
    TORCH_CHECK(false, "KV cache dtype must be float32 or bfloat16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(inflight, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor query_start, Tensor seq_lens, float scale) -> Tensor");
  m.impl("paged_attention", c10::DispatchKey::CPU, &paged_attention);
}
