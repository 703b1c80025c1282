// The small per-layer operations of a decoder layer, each fused into one call.
//
// In a step with one or a few sequences every PyTorch op is a few microseconds of dispatch
// for almost no arithmetic, and a layer written in plain PyTorch issues about forty of
// them (RMSNorm alone is eight). These three replace all but the matmuls and attention:
//
//   rms_norm(x, weight, eps, dtype, add) weight * (x / rms(x)) rounded as transformers does;
//                                        with add, x += add first (in place: the residual
//                                        stream takes the previous sublayer's output)
//   rope_write_kv(qkv, positions, ...)   rotary embedding of q and k, K/V written to the
//                                        paged cache; returns the rotated q and k
//   silu_mul(gate_up)                    silu(gate) * up
//
// Each computes in float32 and rounds where the PyTorch reference (model/llama.py) rounds,
// so outputs match it to float32 rounding.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>

#include "vec_math.h"

namespace {

using namespace inflight_vec;

// ------------------------------------------------------------------------------ rms_norm
template <typename w_t, typename round_t, typename out_t, typename add_t>
void rms_norm_rows(float* x, const add_t* add, const w_t* w, float eps, out_t* out, int64_t T,
                   int64_t H) {
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* row = x + t * H;
      if (add != nullptr) {  // x + add in float32, as PyTorch promotes a bfloat16 add
        const add_t* a = add + t * H;
        for (int64_t i = 0; i < H; ++i) row[i] += load(a[i]);
      }
      float sum_sq = 0.0f;
#pragma omp simd reduction(+ : sum_sq)
      for (int64_t i = 0; i < H; ++i) sum_sq += row[i] * row[i];
      const float inv_rms = 1.0f / std::sqrt(sum_sq / static_cast<float>(H) + eps);
      out_t* o = out + t * H;
      for (int64_t i = 0; i < H; ++i) {
        const float normed = load(store<round_t>(row[i] * inv_rms));  // x.to(dtype)
        o[i] = store<out_t>(load(w[i]) * normed);                   // weight * that
      }
    }
  });
}

at::Tensor rms_norm(at::Tensor& x, const at::Tensor& weight, double eps, at::ScalarType dtype,
                    const std::optional<at::Tensor>& add) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [T, hidden] tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "weight must be a contiguous [hidden] tensor");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype must be float32 or bfloat16");
  const bool weight_f32 = weight.scalar_type() == at::kFloat;
  TORCH_CHECK(weight_f32 || weight.scalar_type() == at::kBFloat16,
              "weight must be float32 or bfloat16");
  at::Tensor delta;
  if (add.has_value()) {
    delta = add->contiguous();
    TORCH_CHECK(delta.sizes() == x.sizes() && (delta.scalar_type() == at::kFloat ||
                                               delta.scalar_type() == at::kBFloat16),
                "add must be a float32 or bfloat16 tensor shaped like x");
  }
  // transformers: weight * x.to(dtype); a float32 weight times bfloat16 promotes to float32.
  const bool round_bf16 = dtype == at::kBFloat16;
  const at::ScalarType out_dtype = weight_f32 ? at::kFloat : dtype;
  auto out = at::empty(x.sizes(), x.options().dtype(out_dtype));
  float* xp = x.data_ptr<float>();
  const int64_t T = x.size(0), H = x.size(1);
  const float e = static_cast<float>(eps);
  using bf16 = at::BFloat16;
  auto run = [&](auto add_zero) {
    using add_t = decltype(add_zero);
    const add_t* ap = delta.defined() ? delta.data_ptr<add_t>() : nullptr;
    if (weight_f32 && !round_bf16) {
      rms_norm_rows<float, float>(xp, ap, weight.data_ptr<float>(), e, out.data_ptr<float>(), T, H);
    } else if (weight_f32) {
      rms_norm_rows<float, bf16>(xp, ap, weight.data_ptr<float>(), e, out.data_ptr<float>(), T, H);
    } else if (!round_bf16) {
      rms_norm_rows<bf16, float>(xp, ap, weight.data_ptr<bf16>(), e, out.data_ptr<float>(), T, H);
    } else {
      rms_norm_rows<bf16, bf16>(xp, ap, weight.data_ptr<bf16>(), e, out.data_ptr<bf16>(), T, H);
    }
  };
  if (delta.defined() && delta.scalar_type() == at::kBFloat16) {
    run(bf16{});
  } else {
    run(float{});
  }
  return out;
}

// ------------------------------------------------------------------------- rope_write_kv
constexpr int64_t kPrefetchTokens = 4;

struct RopeShape {
  int64_t T, H, KVH, D, block_size;
};

// Rotate-half RoPE of one head: out[i] = x[i] cos[i] - x[i+h] sin[i],
// out[i+h] = x[i+h] cos[i+h] + x[i] sin[i+h], rounded once into act_t.
template <typename act_t>
inline void rotate(const act_t* x, const float* c, const float* s, int64_t D, act_t* out) {
  const int64_t half = D / 2;
  int64_t i = 0;
#if defined(__AVX512F__)
  // Separate multiplies and adds (no FMA): the same roundings as the PyTorch expression.
  for (; i + 16 <= half; i += 16) {
    const __m512 a = load16(x + i), b = load16(x + i + half);
    store16(out + i, _mm512_sub_ps(_mm512_mul_ps(a, _mm512_loadu_ps(c + i)),
                                   _mm512_mul_ps(b, _mm512_loadu_ps(s + i))));
    store16(out + i + half, _mm512_add_ps(_mm512_mul_ps(b, _mm512_loadu_ps(c + i + half)),
                                          _mm512_mul_ps(a, _mm512_loadu_ps(s + i + half))));
  }
#endif
  for (; i < half; ++i) {
    const float a = load(x[i]), b = load(x[i + half]);
    out[i] = store<act_t>(a * c[i] - b * s[i]);
    out[i + half] = store<act_t>(b * c[i + half] + a * s[i + half]);
  }
}

// int8 KV: one head's D values as round(x / scale) with scale = max|x| / 127, written at
// dst[d * stride]; the same arithmetic as torch_paged.quantize_kv.
template <typename act_t>
inline void quantize_head(const act_t* x, int64_t D, int8_t* dst, int64_t stride, float* scale) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {  // the same per-lane division and round-to-nearest-even, 16 at a time
    __m512 amax_v = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) amax_v = _mm512_max_ps(amax_v, _mm512_abs_ps(load16(x + d)));
    const float s = _mm512_reduce_max_ps(amax_v) / 127.0f;
    *scale = s;
    const __m512 sv = _mm512_set1_ps(s);
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 q = _mm512_roundscale_ps(_mm512_div_ps(load16(x + d), sv),
                                            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      __m128i bytes = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q));
      if (s == 0.f) bytes = _mm_setzero_si128();
      if (stride == 1) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d), bytes);
      } else {
        alignas(16) int8_t lanes[16];
        _mm_store_si128(reinterpret_cast<__m128i*>(lanes), bytes);
        for (int i = 0; i < 16; ++i) dst[(d + i) * stride] = lanes[i];
      }
    }
    return;
  }
#endif
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(load(x[d])));
  const float s = amax / 127.0f;
  *scale = s;
  for (int64_t d = 0; d < D; ++d)
    dst[d * stride] = s > 0.f ? static_cast<int8_t>(std::nearbyint(load(x[d]) / s)) : 0;
}

template <typename act_t, typename kv_t>
void rope_kv(const RopeShape& sh, const act_t* qkv, const int64_t* positions, const float* cos,
             const float* sin, const int64_t* slots, kv_t* k_cache, kv_t* v_cache,
             float* k_scale, float* v_scale, act_t* q_out, act_t* k_out) {
  const int64_t D = sh.D, KVH = sh.KVH, bs = sh.block_size;
  const int64_t row_size = (sh.H + 2 * KVH) * D;
  // A token's key is one column of its block's [D][bs] tile: D scattered writes across
  // ~32 cache lines per head, in a block anywhere in the cache. Fetching the lines of the
  // token kPrefetchTokens ahead lets those misses overlap instead of queueing.
  const int64_t d_per_line = std::max<int64_t>(1, 64 / (bs * static_cast<int64_t>(sizeof(kv_t))));
  auto prefetch_key_column = [&](int64_t t) {
    const int64_t block = slots[t] / bs, offset = slots[t] % bs;
    for (int64_t h = 0; h < KVH; ++h) {
      const kv_t* column = k_cache + (block * KVH + h) * D * bs + offset;
      for (int64_t d = 0; d < D; d += d_per_line) __builtin_prefetch(column + d * bs, 1, 3);
    }
  };
  at::parallel_for(0, sh.T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < std::min(end, begin + kPrefetchTokens); ++t) prefetch_key_column(t);
    for (int64_t t = begin; t < end; ++t) {
      if (t + kPrefetchTokens < end) prefetch_key_column(t + kPrefetchTokens);
      const act_t* row = qkv + t * row_size;
      const float* c = cos + positions[t] * D;
      const float* s = sin + positions[t] * D;
      for (int64_t h = 0; h < sh.H; ++h) rotate(row + h * D, c, s, D, q_out + (t * sh.H + h) * D);
      const int64_t block = slots[t] / bs, offset = slots[t] % bs;
      for (int64_t h = 0; h < KVH; ++h) {
        act_t* k = k_out + (t * KVH + h) * D;
        rotate(row + (sh.H + h) * D, c, s, D, k);
        const act_t* v = row + (sh.H + KVH + h) * D;
        kv_t* k_dst = k_cache + (block * KVH + h) * D * bs + offset;  // [D][bs] per block
        kv_t* v_dst = v_cache + ((block * bs + offset) * KVH + h) * D;
        if constexpr (std::is_same_v<kv_t, int8_t>) {
          const int64_t scale_at = (block * KVH + h) * bs + offset;  // [blocks, KVH, bs]
          quantize_head(k, D, k_dst, bs, k_scale + scale_at);
          quantize_head(v, D, v_dst, 1, v_scale + scale_at);
        } else {
          for (int64_t d = 0; d < D; ++d) k_dst[d * bs] = store<kv_t>(load(k[d]));
          int64_t d = 0;
#if defined(__AVX512F__)
          for (; d + 16 <= D; d += 16) store16(v_dst + d, load16(v + d));
#endif
          for (; d < D; ++d) v_dst[d] = store<kv_t>(load(v[d]));
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> rope_write_kv(
    const at::Tensor& qkv_in, const at::Tensor& positions, const at::Tensor& cos,
    const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
    const at::Tensor& slot_mapping, int64_t num_heads, int64_t num_kv_heads,
    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  const at::Tensor qkv = qkv_in.contiguous();
  TORCH_CHECK(qkv.dim() == 2, "qkv must be [T, (H + 2 KVH) * D]");
  const int64_t T = qkv.size(0);
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(),
              "caches must be contiguous: K [blocks, KVH, D, bs], V [blocks, bs, KVH, D]");
  const int64_t D = k_cache.size(2), bs = k_cache.size(3);
  TORCH_CHECK(k_cache.size(1) == num_kv_heads && v_cache.size(2) == num_kv_heads &&
                  v_cache.size(3) == D && v_cache.size(1) == bs && D % 2 == 0,
              "cache shapes do not match the heads");
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * D, "qkv width does not match");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == D &&
                  sin.sizes() == cos.sizes(),
              "cos/sin must be contiguous float32 [max_positions, D]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                  positions.numel() == T && slot_mapping.numel() == T,
              "positions and slot_mapping must be int64 [T]");
  const at::Tensor pos = positions.contiguous(), slots = slot_mapping.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * bs;
  for (int64_t t = 0; t < T; ++t) {  // out-of-range indices would write outside the cache
    TORCH_CHECK(pp[t] >= 0 && pp[t] < cos.size(0), "position ", pp[t], " out of range");
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot ", sp[t], " out of range");
  }
  auto q_out = at::empty({T, num_heads, D}, qkv.options());
  auto k_out = at::empty({T, num_kv_heads, D}, qkv.options());
  const RopeShape sh{T, num_heads, num_kv_heads, D, bs};
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  const bool int8 = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(int8 == (k_scale.has_value() && v_scale.has_value()),
              "an int8 KV cache needs k_scale and v_scale, other dtypes none");
  float* ksp = nullptr;
  float* vsp = nullptr;
  if (int8) {
    for (const at::Tensor* sc : {&*k_scale, &*v_scale})
      TORCH_CHECK(sc->scalar_type() == at::kFloat && sc->is_contiguous() &&
                      sc->numel() == k_cache.size(0) * num_kv_heads * bs,
                  "KV scales must be contiguous float32 [num_blocks, KVH, block_size]");
    ksp = k_scale->data_ptr<float>();
    vsp = v_scale->data_ptr<float>();
  }
  auto run = [&](auto act_zero, auto kv_zero) {
    using act_t = decltype(act_zero);
    using kv_t = decltype(kv_zero);
    rope_kv(sh, qkv.data_ptr<act_t>(), pp, c, s, sp, k_cache.data_ptr<kv_t>(),
            v_cache.data_ptr<kv_t>(), ksp, vsp, q_out.data_ptr<act_t>(), k_out.data_ptr<act_t>());
  };
  const bool act_f32 = qkv.scalar_type() == at::kFloat;
  const bool kv_f32 = k_cache.scalar_type() == at::kFloat;
  TORCH_CHECK(act_f32 || qkv.scalar_type() == at::kBFloat16, "qkv must be float32 or bfloat16");
  TORCH_CHECK(kv_f32 || int8 || k_cache.scalar_type() == at::kBFloat16,
              "KV cache dtype must be float32, bfloat16 or int8");
  using bf16 = at::BFloat16;
  if (int8 && act_f32) run(float{}, int8_t{});
  else if (int8) run(bf16{}, int8_t{});
  else if (act_f32 && kv_f32) run(float{}, float{});
  else if (act_f32) run(float{}, bf16{});
  else if (kv_f32) run(bf16{}, float{});
  else run(bf16{}, bf16{});
  return {q_out, k_out};
}

// ------------------------------------------------------------------------------ silu_mul
inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

template <typename T>
void silu_mul_rows(const T* gate_up, int64_t rows, int64_t I, T* out) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gate_up + r * 2 * I;
      const T* up = gate + I;
      T* o = out + r * I;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.0f), minus_log2e = _mm512_set1_ps(-1.44269504088896341f);
      const __m512 floor = _mm512_set1_ps(-100.0f);
      for (; i + 16 <= I; i += 16) {
        // silu(x) = x / (1 + e), e = exp(-x) = 2^t, t = -x log2(e) as 2^n 2^f (n = round(t),
        // f = t - n by vreduceps). t is floored at -100 (e <= 2^-100 leaves 1 + e = 1, and
        // nothing is subnormal); past 128, e is infinite and silu -0, as it rounds to in
        // bfloat16 (float32: -0 for under ~1e-36 in size). About half the instructions of
        // exp(-|x|) with a sign blend (silu_mul is compute-bound at decode sizes).
        const __m512 x = load16(gate + i);
        const __m512 t = _mm512_max_ps(_mm512_mul_ps(x, minus_log2e), floor);
        const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512 e = _mm512_scalef_ps(exp2_fraction(f), _mm512_sub_ps(t, f));
        const __m512 s = _mm512_div_ps(x, _mm512_add_ps(one, e));
        // Round silu to T first, as F.silu(gate) * up does.
        store16(o + i, _mm512_mul_ps(round_to<T>(s), load16(up + i)));
      }
#endif
      for (; i < I; ++i) o[i] = store<T>(load(store<T>(silu(load(gate[i])))) * load(up[i]));
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up_in) {
  const at::Tensor gate_up = gate_up_in.contiguous();
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [T, 2 * I]");
  const int64_t rows = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = at::empty({rows, I}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {
    silu_mul_rows(gate_up.data_ptr<float>(), rows, I, out.data_ptr<float>());
  } else if (gate_up.scalar_type() == at::kBFloat16) {
    silu_mul_rows(gate_up.data_ptr<at::BFloat16>(), rows, I, out.data_ptr<at::BFloat16>());
  } else {
    TORCH_CHECK(false, "gate_up must be float32 or bfloat16");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inflight, m) {
  m.def(
      "rms_norm(Tensor(a!) x, Tensor weight, float eps, ScalarType dtype, Tensor? add=None) "
      "-> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.def(
      "rope_write_kv(Tensor qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, Tensor slot_mapping, int num_heads, int num_kv_heads, "
      "Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None) -> (Tensor, Tensor)");
  m.impl("rope_write_kv", c10::DispatchKey::CPU, &rope_write_kv);
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, &silu_mul);
}
