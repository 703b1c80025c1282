// Varlen paged attention for the CPU: one call per layer for every sequence in a step,
// prompt chunks and decode tokens alike, reading K/V in place through block tables.
//
//   q:            [T, H, D]   float32, the step's query tokens, sequence after sequence
//   k/v_cache:    [num_blocks, block_size, KVH, D]   float32 or bfloat16
//   block_tables: [S, max_blocks] int32
//   query_start:  [S + 1] int32   tokens of sequence s are q[query_start[s] : query_start[s+1]]
//   seq_lens:     [S] int32       context length of s after this step (cached + new)
//   out:          [T, H, D] float32
//
// Query i of sequence s sits at position seq_lens[s] - q_len + i and sees keys 0..position
// (causal over the cached prefix and the chunk). Work is split into (sequence, query tile,
// KV head) items; the G = H / KVH query heads sharing a KV head are processed together so
// each key and value row is loaded once per tile.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kQueryTile = 16;

inline float load(float x) { return x; }
inline float load(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename kv_t>
inline void to_float(const kv_t* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = load(src[i]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

struct WorkItem {
  int32_t seq;
  int32_t q_begin;  // first query of the tile, as an offset within the sequence
  int32_t q_end;
  int32_t kv_head;
};

template <typename kv_t>
void attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& query_start,
            const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t num_seqs = seq_lens.size(0);

  const float* q_ptr = q.data_ptr<float>();
  const kv_t* k_ptr = k_cache.data_ptr<kv_t>();
  const kv_t* v_ptr = v_cache.data_ptr<kv_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* starts = query_start.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  float* out_ptr = out.data_ptr<float>();

  std::vector<WorkItem> items;
  for (int32_t s = 0; s < num_seqs; ++s) {
    const int32_t q_len = starts[s + 1] - starts[s];
    for (int32_t b = 0; b < q_len; b += kQueryTile) {
      const int32_t e = std::min<int32_t>(q_len, b + kQueryTile);
      for (int32_t h = 0; h < num_kv_heads; ++h) items.push_back({s, b, e, h});
    }
  }

  const int64_t token_stride = num_kv_heads * head_dim;  // one position inside a block
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc, key_row(head_dim), value_row(head_dim);
    for (int64_t w = begin; w < end; ++w) {
      const WorkItem item = items[w];
      const int32_t seq_len = lens[item.seq];
      const int32_t q_len = starts[item.seq + 1] - starts[item.seq];
      const int32_t first_pos = seq_len - q_len;  // position of query 0
      const int64_t rows = static_cast<int64_t>(item.q_end - item.q_begin) * group;
      const int64_t num_keys = first_pos + item.q_end;  // keys the last query can see
      scores.assign(rows * num_keys, -std::numeric_limits<float>::infinity());
      acc.assign(rows * head_dim, 0.f);
      const int32_t* table = tables + static_cast<int64_t>(item.seq) * max_blocks;

      auto q_row = [&](int64_t r) {  // row r = (query in tile, head in group)
        const int64_t token = starts[item.seq] + item.q_begin + r / group;
        const int64_t head = item.kv_head * group + r % group;
        return q_ptr + (token * num_heads + head) * head_dim;
      };
      auto kv_offset = [&](int64_t t) {
        const int64_t block = table[t / block_size];
        return (block * block_size + t % block_size) * token_stride + item.kv_head * head_dim;
      };

      // scores = q . k * scale, causal
      for (int64_t t = 0; t < num_keys; ++t) {
        to_float(k_ptr + kv_offset(t), key_row.data(), head_dim);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t pos = first_pos + item.q_begin + r / group;
          if (t <= pos) scores[r * num_keys + t] = dot(q_row(r), key_row.data(), head_dim) * scale;
        }
      }
      // softmax per row
      for (int64_t r = 0; r < rows; ++r) {
        float* row = scores.data() + r * num_keys;
        const int64_t visible = first_pos + item.q_begin + r / group + 1;
        float max_score = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < visible; ++t) max_score = std::max(max_score, row[t]);
        float total = 0.f;
        for (int64_t t = 0; t < visible; ++t) {
          row[t] = std::exp(row[t] - max_score);
          total += row[t];
        }
        const float inv = 1.f / total;
        for (int64_t t = 0; t < visible; ++t) row[t] *= inv;
        for (int64_t t = visible; t < num_keys; ++t) row[t] = 0.f;
      }
      // acc = probs @ v
      for (int64_t t = 0; t < num_keys; ++t) {
        to_float(v_ptr + kv_offset(t), value_row.data(), head_dim);
        for (int64_t r = 0; r < rows; ++r) {
          const float p = scores[r * num_keys + t];
          if (p != 0.f) axpy(p, value_row.data(), acc.data() + r * head_dim, head_dim);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t token = starts[item.seq] + item.q_begin + r / group;
        const int64_t head = item.kv_head * group + r % group;
        std::memcpy(out_ptr + (token * num_heads + head) * head_dim, acc.data() + r * head_dim,
                    head_dim * sizeof(float));
      }
    }
  });
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                           const at::Tensor& v_cache, const at::Tensor& block_tables,
                           const at::Tensor& query_start, const at::Tensor& seq_lens,
                           double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "q must be a contiguous float32 [T, H, D] tensor");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches must be contiguous [num_blocks, block_size, KVH, D]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches differ in dtype");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
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
