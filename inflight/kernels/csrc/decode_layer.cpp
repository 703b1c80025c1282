// One decoder layer of a small decode step in one call: the same kernels, in the same
// order, as the Python modules run them (so outputs are bit-identical), without the
// Python in between.
//
//   decode_layer(x, pending, ...) -> mlp_out
//
//   x:        [T, hidden] float32 residual stream, updated in place (x += pending, then
//             x += attention output), as rms_norm(..., add=) does in the Python path
//   pending:  the previous layer's MLP output (None for the first layer)
//   *_blocks: the layer's GGUF weights as gguf_pack left them, with their ggml types
//   the rest: as rope_write_kv and paged_attention take them (csrc/layer_ops.cpp,
//             csrc/paged_attention.cpp); every token is a decode token (one per sequence)
//   returns:  [T, hidden] float32, this layer's MLP output (the next layer's `pending`)
//
// Why: a step of one or a few sequences streams the weights once and does little else,
// so the ~9 Python-level calls per layer (module dispatch, argument checks, views) were
// about a tenth of it. Only steps whose every linear layer reads GGUF blocks (at most
// Linear.block_max_rows tokens, float32 activations) and whose attention is one varlen
// decode group take this path (model/llama.py, LlamaForCausalLM.forward).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

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
                               const std::optional<at::Tensor>&);
using SiluMulFn = at::Tensor(const at::Tensor&);

template <typename Fn>
c10::TypedOperatorHandle<Fn> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

at::Tensor decode_layer(
    at::Tensor& x, const std::optional<at::Tensor>& pending, const at::Tensor& input_norm,
    const at::Tensor& post_norm, double eps, const at::Tensor& qkv_blocks, int64_t qkv_type,
    const at::Tensor& o_blocks, int64_t o_type, const at::Tensor& gate_up_blocks,
    int64_t gate_up_type, const at::Tensor& down_blocks, int64_t down_type,
    const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
    at::Tensor& k_cache, at::Tensor& v_cache, const std::optional<at::Tensor>& k_scale,
    const std::optional<at::Tensor>& v_scale, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& seq_lens,
    int64_t num_heads, int64_t num_kv_heads, double scale) {
  static const auto rms_norm = find<RmsNormFn>("inflight::rms_norm");
  static const auto gguf_matmul = find<GgufMatmulFn>("inflight::gguf_matmul");
  static const auto rope_write_kv = find<RopeFn>("inflight::rope_write_kv");
  static const auto paged_attention = find<AttentionFn>("inflight::paged_attention");
  static const auto silu_mul = find<SiluMulFn>("inflight::silu_mul");

  const at::Tensor h = rms_norm.call(x, input_norm, eps, at::kFloat, pending);
  const at::Tensor qkv = gguf_matmul.call(h, qkv_blocks, qkv_type);
  const auto q_k = rope_write_kv.call(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping,
                                      num_heads, num_kv_heads, k_scale, v_scale);
  const at::Tensor attn = paged_attention.call(std::get<0>(q_k).contiguous(), k_cache, v_cache,
                                               block_tables, query_start, seq_lens, scale,
                                               k_scale, v_scale);
  const at::Tensor o = gguf_matmul.call(attn.reshape({x.size(0), -1}).contiguous(), o_blocks,
                                        o_type);
  const at::Tensor h2 = rms_norm.call(x, post_norm, eps, at::kFloat, o);
  const at::Tensor gate_up = gguf_matmul.call(h2, gate_up_blocks, gate_up_type);
  return gguf_matmul.call(silu_mul.call(gate_up).contiguous(), down_blocks, down_type);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inflight, m) {
  m.def(
      "decode_layer(Tensor(a!) x, Tensor? pending, Tensor input_norm, Tensor post_norm, "
      "float eps, Tensor qkv_blocks, int qkv_type, Tensor o_blocks, int o_type, "
      "Tensor gate_up_blocks, int gate_up_type, Tensor down_blocks, int down_type, "
      "Tensor positions, Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, "
      "Tensor(d!)? k_scale, Tensor(e!)? v_scale, Tensor slot_mapping, Tensor block_tables, "
      "Tensor query_start, Tensor seq_lens, int num_heads, int num_kv_heads, float scale) "
      "-> Tensor");
  m.impl("decode_layer", c10::DispatchKey::CPU, &decode_layer);
}
