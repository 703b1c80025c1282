// Every decoder layer of a small decode step in one call: the same kernels, in the same
// order, as the Python modules run them (so outputs are bit-identical), without the
// Python in between.
//
//   stack = torch.classes.inflight.DecodeStack(layer_tensors, layer_types, eps, k_caches,
//                                              v_caches, k_scales, v_scales, num_heads,
//                                              num_kv_heads, scale, int8_dots)  once
//   pending = stack.run(x, positions, cos, sin, slot_mapping, block_tables, query_start,
//                       seq_lens)                                        every small step
//
//   layer_tensors: 6 per layer: input norm weight, post-attention norm weight, then the
//                  GGUF blocks (as gguf_pack left them) of qkv, o, gate_up and down
//   layer_types:   4 per layer: the ggml types of those four blocks
//   k/v_caches:    one per layer, as paged_attention takes them; k/v_scales: one per layer
//                  with an int8 cache, else empty
//   x:             [T, hidden] float32 residual stream, updated in place (x += the previous
//                  layer's MLP output, then x += the attention output), as
//                  rms_norm(..., add=) does in the Python path
//   the rest:      as rope_write_kv and paged_attention take them (csrc/layer_ops.cpp,
//                  csrc/paged_attention.cpp); every token is a decode token
//   returns:       [T, hidden] float32, the last layer's MLP output (still to be added)
//
// Why: a step of one or a few sequences streams the weights once and does little else.
// The ~9 Python-level calls per layer (module dispatch, argument checks, views) were about
// a tenth of it; one Python call per layer still cost ~14 us of argument conversion per
// layer (0.42 ms a token over 30 layers, ~8% of a single stream's step on an AMD EPYC
// Zen 5), so the layers' fixed arguments live here and the step crosses into C++ once.
// Only steps whose every linear layer reads GGUF blocks (at most Linear.block_max_rows
// tokens, float32 activations) and whose attention is one varlen decode group take this
// path (model/fused_decode.py).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

namespace {

using RmsNormFn = at::Tensor(at::Tensor&, const at::Tensor&, double, at::ScalarType,
                             const std::optional<at::Tensor>&);
using GgufMatmulFn = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t);
using RopeFn = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&,
    at::Tensor&, const at::Tensor&, int64_t, int64_t, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&);
using AttentionFn = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                               const std::optional<at::Tensor>&,
                               const std::optional<at::Tensor>&, bool, bool);
using SiluMulFn = at::Tensor(const at::Tensor&);
using GgufAmxFn = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, bool);
using Bf16LinearFn = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, bool);

template <typename Fn>
c10::TypedOperatorHandle<Fn> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

constexpr int64_t kTensorsPerLayer = 6;
constexpr int64_t kTypesPerLayer = 4;

// What both stacks hold: 6 tensors a layer (the two norms' weights, then the qkv, o,
// gate_up and down projections' weights in the stack's form), one integer per projection
// (its ggml type or its output size), the KV caches (and scales of an int8 cache) and the
// attention's constants. Checked once, at construction.
struct StackLayers {
  std::vector<at::Tensor> layer_tensors;
  std::vector<int64_t> per_linear;
  double eps;
  std::vector<at::Tensor> k_caches, v_caches, k_scales, v_scales;
  int64_t num_heads, num_kv_heads;
  double scale;
  bool int8_dots;  // paged_attention's choice for an int8 cache, as the layer path makes it

  StackLayers(const char* name, std::vector<at::Tensor> tensors, std::vector<int64_t> linears,
              double eps_, std::vector<at::Tensor> k, std::vector<at::Tensor> v,
              std::vector<at::Tensor> ks, std::vector<at::Tensor> vs, int64_t heads,
              int64_t kv_heads, double scale_, bool int8_dots_)
      : layer_tensors(std::move(tensors)), per_linear(std::move(linears)), eps(eps_),
        k_caches(std::move(k)), v_caches(std::move(v)), k_scales(std::move(ks)),
        v_scales(std::move(vs)), num_heads(heads), num_kv_heads(kv_heads), scale(scale_),
        int8_dots(int8_dots_) {
    const int64_t layers = static_cast<int64_t>(k_caches.size());
    TORCH_CHECK(layers > 0, name, " needs at least one layer");
    TORCH_CHECK(static_cast<int64_t>(layer_tensors.size()) == kTensorsPerLayer * layers &&
                    static_cast<int64_t>(per_linear.size()) == kTypesPerLayer * layers &&
                    static_cast<int64_t>(v_caches.size()) == layers,
                name, ": ", kTensorsPerLayer, " tensors, ", kTypesPerLayer,
                " projection types or sizes and one K and V cache per layer");
    TORCH_CHECK(k_scales.size() == v_scales.size() &&
                    (k_scales.empty() || static_cast<int64_t>(k_scales.size()) == layers),
                name, ": K/V scales for every layer (int8 caches) or for none");
  }

  const at::Tensor& weight(size_t layer, int64_t which) const {
    return layer_tensors[kTensorsPerLayer * layer + 2 + which];
  }
  int64_t linear_arg(size_t layer, int64_t which) const {
    return per_linear[kTypesPerLayer * layer + which];
  }
};

// The layers of one decode step, as the Python modules run them: `linear(in, layer, which)`
// is the layer's qkv (0), o (1), gate_up (2) or down (3) projection; norms and the matmuls'
// inputs are in `act` (float32 for the GGUF block kernel, bfloat16 for the AMX tiles);
// `bf16_dots`: bfloat16 queries are scored with bfloat16 dot products, else with float32
// FMAs on their values (torch_paged._varlen's choice, where bfloat16 dot products do not
// pay).
template <typename LinearFn>
at::Tensor run_layers(StackLayers& st, LinearFn linear, at::ScalarType act, bool bf16_dots,
                      at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos,
                      const at::Tensor& sin, const at::Tensor& slot_mapping,
                      const at::Tensor& block_tables, const at::Tensor& query_start,
                      const at::Tensor& seq_lens) {
  static const auto rms_norm = find<RmsNormFn>("inflight::rms_norm");
  static const auto rope_write_kv = find<RopeFn>("inflight::rope_write_kv");
  static const auto paged_attention = find<AttentionFn>("inflight::paged_attention");
  static const auto silu_mul = find<SiluMulFn>("inflight::silu_mul");
  std::optional<at::Tensor> pending;
  for (size_t i = 0; i < st.k_caches.size(); ++i) {
    const at::Tensor* w = st.layer_tensors.data() + kTensorsPerLayer * i;
    std::optional<at::Tensor> k_scale, v_scale;
    if (!st.k_scales.empty()) {
      k_scale = st.k_scales[i];
      v_scale = st.v_scales[i];
    }
    const at::Tensor h = rms_norm.call(x, w[0], st.eps, act, pending);
    const at::Tensor qkv = linear(h, i, 0);
    const auto q_k = rope_write_kv.call(qkv, positions, cos, sin, st.k_caches[i], st.v_caches[i],
                                        slot_mapping, st.num_heads, st.num_kv_heads, k_scale,
                                        v_scale);
    const at::Tensor& q = std::get<0>(q_k);
    at::Tensor attn = paged_attention.call(
        q.contiguous(), st.k_caches[i], st.v_caches[i], block_tables, query_start, seq_lens,
        st.scale, k_scale, v_scale, st.int8_dots, bf16_dots);
    if (attn.scalar_type() != act) attn = attn.to(act);
    const at::Tensor o = linear(attn.reshape({x.size(0), -1}).contiguous(), i, 1);
    const at::Tensor h2 = rms_norm.call(x, w[1], st.eps, act, o);
    const at::Tensor gate_up = linear(h2, i, 2);
    pending = linear(silu_mul.call(gate_up).contiguous(), i, 3);
  }
  return *pending;
}

// Every layer's projections read GGUF blocks with the block kernel (float32 activations);
// per_linear holds the blocks' ggml types.
struct DecodeStack : StackLayers, torch::CustomClassHolder {
  DecodeStack(std::vector<at::Tensor> tensors, std::vector<int64_t> types, double eps_,
              std::vector<at::Tensor> k, std::vector<at::Tensor> v,
              std::vector<at::Tensor> ks, std::vector<at::Tensor> vs, int64_t heads,
              int64_t kv_heads, double scale_, bool int8_dots_)
      : StackLayers("DecodeStack", std::move(tensors), std::move(types), eps_, std::move(k),
                    std::move(v), std::move(ks), std::move(vs), heads, kv_heads, scale_,
                    int8_dots_) {}

  at::Tensor run(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos,
                 const at::Tensor& sin, const at::Tensor& slot_mapping,
                 const at::Tensor& block_tables, const at::Tensor& query_start,
                 const at::Tensor& seq_lens) {
    static const auto gguf_matmul = find<GgufMatmulFn>("inflight::gguf_matmul");
    auto linear = [&](const at::Tensor& in, size_t layer, int64_t which) {
      return gguf_matmul.call(in, weight(layer, which), linear_arg(layer, which));
    };
    return run_layers(*this, linear, at::kFloat, /*bf16_dots=*/false, x, positions, cos,
                      sin, slot_mapping, block_tables, query_start, seq_lens);
  }
};

// The same for bfloat16 steps whose decoder linears read 4-bit GGUF blocks with AMX tiles
// (csrc/gguf_amx_linear.cpp; the weights gguf_amx_pack's) or, with pair_tiles, bfloat16
// pair tiles (csrc/bf16_linear.cpp; the weights bf16_pack_pairs'); per_linear holds the
// projections' output sizes; bf16_queries: the attention scores the bfloat16 queries
// with bfloat16 dot products (else with float32 FMAs on their values, as
// torch_paged._varlen does where bfloat16 dot products do not pay).
struct DecodeStackTiles : StackLayers, torch::CustomClassHolder {
  bool bf16_queries;
  bool pair_tiles;

  DecodeStackTiles(std::vector<at::Tensor> tensors, std::vector<int64_t> features, double eps_,
                   std::vector<at::Tensor> k, std::vector<at::Tensor> v,
                   std::vector<at::Tensor> ks, std::vector<at::Tensor> vs, int64_t heads,
                   int64_t kv_heads, double scale_, bool int8_dots_, bool bf16_queries_,
                   bool pair_tiles_)
      : StackLayers("DecodeStackTiles", std::move(tensors), std::move(features), eps_,
                    std::move(k), std::move(v), std::move(ks), std::move(vs), heads, kv_heads,
                    scale_, int8_dots_),
        bf16_queries(bf16_queries_),
        pair_tiles(pair_tiles_) {}

  at::Tensor run(at::Tensor x, const at::Tensor& positions, const at::Tensor& cos,
                 const at::Tensor& sin, const at::Tensor& slot_mapping,
                 const at::Tensor& block_tables, const at::Tensor& query_start,
                 const at::Tensor& seq_lens) {
    auto linear = [&](const at::Tensor& in, size_t layer, int64_t which) {
      if (pair_tiles) {
        static const auto bf16_linear = find<Bf16LinearFn>("inflight::bf16_linear");
        return bf16_linear.call(in, weight(layer, which), linear_arg(layer, which), false);
      }
      static const auto gguf_amx_linear = find<GgufAmxFn>("inflight::gguf_amx_linear");
      return gguf_amx_linear.call(in, weight(layer, which), linear_arg(layer, which), false);
    };
    return run_layers(*this, linear, at::kBFloat16, bf16_queries, x, positions, cos, sin,
                      slot_mapping, block_tables, query_start, seq_lens);
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(inflight, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, double,
                       std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, int64_t,
                       double, bool>())
      .def("run", &DecodeStack::run);
  m.class_<DecodeStackTiles>("DecodeStackTiles")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, double,
                       std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, int64_t,
                       double, bool, bool, bool>())
      .def("run", &DecodeStackTiles::run);
}
