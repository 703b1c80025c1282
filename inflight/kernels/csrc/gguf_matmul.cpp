// y = x @ W.T straight from GGUF's quantised blocks, for the small batches of decode steps.
//
//   gguf_pack(blocks, qtype) -> packed    once, at load time
//   gguf_matmul(x, packed, qtype) -> y    every small step
//
//   blocks:  [N, K / 32 * type_size] uint8: row n holds output feature n's GGUF blocks
//   qtype:   ggml type id: 2 = Q4_0, 3 = Q4_1, 8 = Q8_0; plus 256 for 4-bit blocks packed
//            by gguf_pack_bf16_dot (bfloat16 dot products, csrc/gguf_bf16_dot.cpp)
//   packed:  [N, K / 32 * packed_size] uint8 (below)
//   x:       [M, K] float32, contiguous
//   y:       [M, N] float32
//
// Packed 4-bit blocks (24 bytes): float32 d, float32 m (Q4_0: m = -8 d, exact), then the
// 16 bytes of nibbles reordered so one broadcast load plus a per-lane shift puts weight i's
// nibble in the low bits of lane i (see dequant). Float32 scales are loaded as
// broadcasts straight from memory instead of converted from float16 on every use. Q8_0
// blocks are used as stored.
//
// Why: with one or a few sequences per step, a step streams every weight once and does
// almost no arithmetic per byte. Reading packed 4-bit blocks (0.75 bytes per weight) instead
// of bfloat16 (2 bytes) or float32 (4 bytes) copies cuts that traffic 2.7-5x.
//
// Exactness: each block is dequantised in registers with one fused multiply-add,
// w = q * d + m (Q4_1), w = q * d - 8 * d (Q4_0), w = q * d (Q8_0). q * d is exact in float32
// (a 4- or 8-bit integer times a float16), so every w is bit-identical to the float32 weight
// the loader decodes; only the order of the dot product's additions differs from a dense
// matmul, as between any two matmul implementations.
//
// Work: output rows are split between threads in groups of R rows; for each group the
// activations are processed in chunks of up to 8 rows, with M x R accumulators in
// registers, so each block is dequantised once per chunk and each activation load is
// shared by R weight rows. The rows two groups ahead are prefetched: each call streams only
// a few hundred KB, too little for the hardware prefetcher to reach full speed (this alone
// halved the time of a pass over the model's weights).

#include "gguf_bf16_dot.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;  // weights per GGUF block, for all three types
constexpr int64_t kPackedQ4Size = 24;
constexpr int64_t kPrefetchGroups = 2;
enum QType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

int64_t type_size(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return 18;  // f16 d, 16 bytes of nibbles
    case kQ4_1: return 20;  // f16 d, f16 m, 16 bytes of nibbles
    case kQ8_0: return 34;  // f16 d, 32 x int8
    default: TORCH_CHECK(false, "unsupported ggml type ", qtype, " (Q4_0, Q4_1, Q8_0 only)");
  }
  return 0;
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

int64_t packed_size(int64_t qtype) {
  const int64_t stored = type_size(qtype);  // rejects unsupported types
  return qtype == kQ8_0 ? stored : kPackedQ4Size;
}

// Lane i of the broadcast 16 bytes holds bytes 4 (i % 4) .. 4 (i % 4) + 3; shifting it
// right by 8 (i / 4) bits leaves byte p(i) = 4 (i % 4) + i / 4 in its low 8 bits. gguf_pack
// stores GGUF byte i (weight i low, weight i + 16 high) at p(i).
inline int64_t packed_position(int64_t i) { return 4 * (i % 4) + i / 4; }

#if defined(__AVX512F__)

inline float half_fast(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return _cvtsh_ss(bits);  // F16C: one instruction
}

// The 32 weights of one block as two vectors: lo = weights 0..15, hi = weights 16..31.
template <int64_t Q>
inline void dequant(const uint8_t* block, __m512& lo, __m512& hi) {
  if constexpr (Q == kQ8_0) {
    const __m512 d = _mm512_set1_ps(half_fast(block));
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 18));
    lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a)), d);
    hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), d);
  } else {
    // The 16 possible values q * d + m in one register; each weight is looked up by its
    // nibble (a permute reads only the low 4 bits of each lane's index).
    const float* dm = reinterpret_cast<const float*>(block);
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(dm[0]), _mm512_set1_ps(dm[1]));
    const __m512i bytes =
        _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 8)));
    const __m512i shift_lo = _mm512_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8, 16, 16, 16, 16, 24, 24, 24, 24);
    const __m512i shift_hi = _mm512_add_epi32(shift_lo, _mm512_set1_epi32(4));
    lo = _mm512_permutexvar_ps(_mm512_srlv_epi32(bytes, shift_lo), table);
    hi = _mm512_permutexvar_ps(_mm512_srlv_epi32(bytes, shift_hi), table);
  }
}

// Rows [n0, n0 + R) of the output for activation rows [m0, m0 + M).
template <int64_t Q, int M, int R>
void tile(const float* x, int64_t K, const uint8_t* W, int64_t row_bytes, float* y, int64_t N,
          int64_t m0, int64_t n0) {
  constexpr int64_t size = Q == kQ8_0 ? 34 : kPackedQ4Size;
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  const int64_t num_blocks = K / kBlock;
  // Prefetch the rows kPrefetchGroups groups ahead, spread over this group's iterations:
  // each call streams a few hundred KB once, too little for the hardware prefetcher to
  // reach full speed on its own.
  const char* ahead = reinterpret_cast<const char*>(W + (n0 + kPrefetchGroups * R) * row_bytes);
  const char* ahead_end =
      reinterpret_cast<const char*>(W + std::min(n0 + (kPrefetchGroups + 1) * R, N) * row_bytes);
  const int64_t lines = (R * row_bytes + 63) / 64;
  const int64_t lines_per_block = (lines + num_blocks - 1) / num_blocks;
  for (int64_t b = 0; b < num_blocks; ++b) {
    for (int64_t l = 0; l < lines_per_block; ++l) {
      const char* p = ahead + (b * lines_per_block + l) * 64;
      if (p < ahead_end) _mm_prefetch(p, _MM_HINT_T0);
    }
    __m512 lo[R], hi[R];
    for (int r = 0; r < R; ++r) dequant<Q>(W + (n0 + r) * row_bytes + b * size, lo[r], hi[r]);
    for (int m = 0; m < M; ++m) {
      const float* xb = x + (m0 + m) * K + b * kBlock;
      const __m512 xa = _mm512_loadu_ps(xb);
      const __m512 xc = _mm512_loadu_ps(xb + 16);
      for (int r = 0; r < R; ++r) {
        acc[m][r] = _mm512_fmadd_ps(xa, lo[r], acc[m][r]);
        acc[m][r] = _mm512_fmadd_ps(xc, hi[r], acc[m][r]);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) y[(m0 + m) * N + n0 + r] = _mm512_reduce_add_ps(acc[m][r]);
}

// All activation rows against output rows [n0, n0 + R), in chunks of 8, 4, 2, 1 rows.
template <int64_t Q, int R>
void rows(const float* x, int64_t M, int64_t K, const uint8_t* W, int64_t row_bytes, float* y,
          int64_t N, int64_t n0) {
  int64_t m0 = 0;
  if constexpr (R <= 2) {
    for (; m0 + 8 <= M; m0 += 8) tile<Q, 8, R>(x, K, W, row_bytes, y, N, m0, n0);
  }
  for (; m0 + 4 <= M; m0 += 4) tile<Q, 4, R>(x, K, W, row_bytes, y, N, m0, n0);
  for (; m0 + 2 <= M; m0 += 2) tile<Q, 2, R>(x, K, W, row_bytes, y, N, m0, n0);
  for (; m0 < M; ++m0) tile<Q, 1, R>(x, K, W, row_bytes, y, N, m0, n0);
}

template <int64_t Q>
void matmul(const float* x, int64_t M, int64_t K, const uint8_t* W, int64_t row_bytes,
            float* y, int64_t N) {
  // Four weight rows per group while at most 4 activation rows are in flight, two beyond
  // (8 x 2 accumulators): keeps every accumulator in a register.
  if (M < 8) {
    const int64_t groups = N / 4;
    at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) rows<Q, 4>(x, M, K, W, row_bytes, y, N, g * 4);
    });
    for (int64_t n = groups * 4; n < N; ++n) rows<Q, 1>(x, M, K, W, row_bytes, y, N, n);
  } else {
    const int64_t groups = N / 2;
    at::parallel_for(0, groups, 32, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin; g < end; ++g) rows<Q, 2>(x, M, K, W, row_bytes, y, N, g * 2);
    });
    for (int64_t n = groups * 2; n < N; ++n) rows<Q, 1>(x, M, K, W, row_bytes, y, N, n);
  }
}

#endif  // __AVX512F__

bool gguf_matmul_available() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

at::Tensor gguf_pack(const at::Tensor& blocks_in, int64_t qtype) {
  const at::Tensor blocks = blocks_in.contiguous();
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte,
              "blocks must be a uint8 [N, row_bytes] tensor");
  const int64_t size = type_size(qtype);
  TORCH_CHECK(blocks.size(1) % size == 0, "row of ", blocks.size(1), " bytes is not whole blocks");
  if (qtype == kQ8_0) return blocks.clone();
  const int64_t n = blocks.numel() / size;
  auto packed = at::empty({blocks.size(0), blocks.size(1) / size * kPackedQ4Size}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, n, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* in = src + b * size;
      uint8_t* out = dst + b * kPackedQ4Size;
      const float d = half_at(in);
      const float m = qtype == kQ4_1 ? half_at(in + 2) : -8.0f * d;
      std::memcpy(out, &d, 4);
      std::memcpy(out + 4, &m, 4);
      const uint8_t* qs = in + (qtype == kQ4_1 ? 4 : 2);
      for (int64_t i = 0; i < 16; ++i) out[8 + packed_position(i)] = qs[i];
    }
  });
  return packed;
}

// GGUF blocks -> float32, each weight exactly as gguf's own dequantisation computes it
// (q * d is exact in float32, so q * d + m rounds once either way).
at::Tensor gguf_dequantize(const at::Tensor& blocks_in, int64_t qtype) {
  const at::Tensor blocks = blocks_in.contiguous();
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte,
              "blocks must be a uint8 [N, row_bytes] tensor");
  const int64_t size = type_size(qtype);
  TORCH_CHECK(blocks.size(1) % size == 0, "row of ", blocks.size(1), " bytes is not whole blocks");
  const int64_t n = blocks.numel() / size;
  auto out = at::empty({blocks.size(0), blocks.size(1) / size * kBlock}, at::kFloat);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, n, 8192, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* in = src + b * size;
      float* w = dst + b * kBlock;
      const float d = half_at(in);
      if (qtype == kQ8_0) {
        const int8_t* qs = reinterpret_cast<const int8_t*>(in + 2);
        for (int64_t i = 0; i < kBlock; ++i) w[i] = static_cast<float>(qs[i]) * d;
        continue;
      }
      if (qtype == kQ4_0) {
        const uint8_t* qs = in + 2;
        for (int64_t i = 0; i < 16; ++i) {
          w[i] = static_cast<float>((qs[i] & 0x0F) - 8) * d;
          w[i + 16] = static_cast<float>((qs[i] >> 4) - 8) * d;
        }
        continue;
      }
      const uint8_t* qs = in + 4;
      const float m = half_at(in + 2);
      for (int64_t i = 0; i < 16; ++i) {
        w[i] = static_cast<float>(qs[i] & 0x0F) * d + m;
        w[i + 16] = static_cast<float>(qs[i] >> 4) * d + m;
      }
    }
  });
  return out;
}

at::Tensor gguf_matmul(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "blocks must be a contiguous uint8 [N, row_bytes] tensor");
  const int64_t M = x.size(0), K = x.size(1), N = blocks.size(0);
  TORCH_CHECK(K % kBlock == 0, "K = ", K, " is not a multiple of the block size 32");
  if (qtype & inflight_gguf::kBf16DotFlag) {  // packed by gguf_pack_bf16_dot
    const int64_t base = qtype & ~inflight_gguf::kBf16DotFlag;
    TORCH_CHECK(base == kQ4_0 || base == kQ4_1, "bfloat16-dot blocks are Q4_0 or Q4_1, not ",
                base);
    TORCH_CHECK(blocks.size(1) == inflight_gguf::bf16_dot_row_bytes(K), "packed blocks have ",
                blocks.size(1), " bytes per row; K = ", K, " needs ",
                inflight_gguf::bf16_dot_row_bytes(K));
    auto y = at::empty({M, N}, x.options());
    TORCH_CHECK(inflight_gguf::bf16_dot_matmul(x.data_ptr<float>(), M, K,
                                               blocks.data_ptr<uint8_t>(), y.data_ptr<float>(), N),
                "bfloat16-dot GGUF blocks need AVX512-BF16, which this build lacks");
    return y;
  }
  const int64_t row_bytes = K / kBlock * packed_size(qtype);
  TORCH_CHECK(blocks.size(1) == row_bytes, "packed blocks have ", blocks.size(1),
              " bytes per row; K = ", K, " needs ", row_bytes);
  auto y = at::empty({M, N}, x.options());
#if defined(__AVX512F__)
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (qtype == kQ8_0) {
    matmul<kQ8_0>(xp, M, K, wp, row_bytes, yp, N);
  } else {
    matmul<kQ4_1>(xp, M, K, wp, row_bytes, yp, N);  // packed Q4_0 and Q4_1 share a layout
  }
#else
  TORCH_CHECK(false, "gguf_matmul needs AVX-512; use dense weights on this CPU");
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(inflight, m) {
  m.def("gguf_pack(Tensor blocks, int qtype) -> Tensor");
  m.impl("gguf_pack", c10::DispatchKey::CPU, &gguf_pack);
  m.def("gguf_dequantize(Tensor blocks, int qtype) -> Tensor");
  m.impl("gguf_dequantize", c10::DispatchKey::CPU, &gguf_dequantize);
  m.def("gguf_matmul(Tensor x, Tensor blocks, int qtype) -> Tensor");
  m.impl("gguf_matmul", c10::DispatchKey::CPU, &gguf_matmul);
  m.def("gguf_matmul_available() -> bool", &gguf_matmul_available);
}
