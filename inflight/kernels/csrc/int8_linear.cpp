// Dynamic W8A8 int8 linear layer: int8 weights per output channel, int8 activations per
// token quantised on the fly, int32 accumulation, float32 out.
//
//   int8_quantize_weight(w) -> (wq, w_scale)   once, at load time
//   int8_linear(x, wq, w_scale, smooth_inv) -> y   every large step
//
//   w:       [N, K] float32 (the checkpoint's weight, already rounded to its dtype)
//   wq:      [N, K] int8, round(w / w_scale[n]), |wq| <= 127 (symmetric, no zero point)
//   w_scale: [N] float32, max_k |w[n, k]| / 127
//   x:       [M, K] float32
//   smooth_inv: optional [K] float32, multiplies x's columns before they are quantised
//            (SmoothQuant's 1 / s, the weight's columns having been multiplied by s)
//   y:       [M, N] float32, y[m, n] = float(sum_k xq[m, k] wq[n, k]) * x_scale[m] * w_scale[n]
//            with x' = x * smooth_inv, x_scale[m] = max_k |x'[m, k]| / 127 and
//            xq = round(x' / x_scale[m])
//
// Why: on CPUs without AMX, int8 dot products (AVX512-VNNI vpdpbusd, through oneDNN's
// int8 GEMM behind at::_int_mm) run ~4x the float32 FMA rate (900-1000 GOP/s against
// 230-250 GFLOP/s on 2 cores at this model's shapes), and the weights take a quarter of
// the bytes. The scheme is SmoothQuant's W8A8 (Xiao et al. 2023, "SmoothQuant": per-token
// activations, per-channel weights, activation outliers moved into the weights by a
// per-column factor), as vLLM's W8A8-int8 (compressed-tensors) runs it; here the weights
// are smoothed and quantised at load (model/w8a8.py), not in advance.
//
// Work: rows are quantised in parallel, then multiplied in chunks of kChunk rows so the
// int32 products stay in cache and are rescaled into y right away: one pass over y, no
// [M, N] int32 or temporary float tensors (fresh large allocations cost page faults).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>

namespace {

constexpr int64_t kChunk = 512;  // rows per int8 GEMM call (oneDNN slows past ~1k rows)

// Row x (times mul, column by column, when given) -> int8 row and its scale. Ties round
// to even, as torch.round does.
void quantize_row(const float* x, const float* mul, int64_t K, int8_t* q, float* scale) {
  float amax = 0.0f;
  if (mul == nullptr) {
#pragma omp simd reduction(max : amax)
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  } else {
#pragma omp simd reduction(max : amax)
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[k] * mul[k]));
  }
  const float s = amax / 127.0f;
  *scale = s;
  const float inv = s > 0.0f ? 127.0f / amax : 0.0f;
#pragma omp simd
  for (int64_t k = 0; k < K; ++k) {
    const float v = std::nearbyint((mul == nullptr ? x[k] : x[k] * mul[k]) * inv);
    q[k] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, v)));
  }
}

void quantize_rows(const float* x, const float* mul, int64_t M, int64_t K, int8_t* q,
                   float* scale) {
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) quantize_row(x + m * K, mul, K, q + m * K, scale + m);
  });
}

std::tuple<at::Tensor, at::Tensor> int8_quantize_weight(const at::Tensor& w_in) {
  TORCH_CHECK(w_in.dim() == 2, "weight must be [N, K]");
  const at::Tensor w = w_in.to(at::kFloat).contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  auto wq = at::empty({N, K}, w.options().dtype(at::kChar));
  auto scale = at::empty({N}, w.options());
  quantize_rows(w.data_ptr<float>(), nullptr, N, K, wq.data_ptr<int8_t>(),
                scale.data_ptr<float>());
  return {wq, scale};
}

at::Tensor int8_linear(const at::Tensor& x_in, const at::Tensor& wq, const at::Tensor& w_scale,
                       const std::optional<at::Tensor>& smooth_inv) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "x must be float32 [M, K]");
  TORCH_CHECK(wq.dim() == 2 && wq.scalar_type() == at::kChar && wq.is_contiguous() &&
                  wq.size(1) == x_in.size(1),
              "wq must be contiguous int8 [N, K] with K = ", x_in.size(1));
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.dim() == 1 &&
                  w_scale.is_contiguous() && w_scale.size(0) == wq.size(0),
              "w_scale must be contiguous float32 [N]");
  TORCH_CHECK(!smooth_inv.has_value() ||
                  (smooth_inv->scalar_type() == at::kFloat && smooth_inv->dim() == 1 &&
                   smooth_inv->is_contiguous() && smooth_inv->size(0) == x_in.size(1)),
              "smooth_inv must be contiguous float32 [K]");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = wq.size(0);
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  auto xq = at::empty({M, K}, x.options().dtype(at::kChar));
  auto x_scale = at::empty({M}, x.options());
  quantize_rows(x.data_ptr<float>(),
                smooth_inv.has_value() ? smooth_inv->data_ptr<float>() : nullptr, M, K,
                xq.data_ptr<int8_t>(), x_scale.data_ptr<float>());
  const at::Tensor wt = wq.t();  // [K, N], column-major: oneDNN reads it as is
  auto acc = at::empty({std::min(M, kChunk), N}, x.options().dtype(at::kInt));
  const float* xs = x_scale.data_ptr<float>();
  const float* ws = w_scale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t m0 = 0; m0 < M; m0 += kChunk) {
    const int64_t rows = std::min(kChunk, M - m0);
    at::Tensor out = acc.narrow(0, 0, rows);
    at::_int_mm_out(out, xq.narrow(0, m0, rows), wt);
    const int32_t* a = out.data_ptr<int32_t>();
    at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const float s = xs[m0 + r];
        const int32_t* ar = a + r * N;
        float* yr = yp + (m0 + r) * N;
#pragma omp simd
        for (int64_t n = 0; n < N; ++n) yr[n] = static_cast<float>(ar[n]) * s * ws[n];
      }
    });
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inflight, m) {
  m.def("int8_quantize_weight(Tensor w) -> (Tensor, Tensor)");
  m.impl("int8_quantize_weight", c10::DispatchKey::CPU, &int8_quantize_weight);
  m.def("int8_linear(Tensor x, Tensor wq, Tensor w_scale, Tensor? smooth_inv=None) -> Tensor");
  m.impl("int8_linear", c10::DispatchKey::CPU, &int8_linear);
}
