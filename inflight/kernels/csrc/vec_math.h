// Small shared helpers for the CPU kernels: float32 <-> bfloat16 and a vector exp.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace inflight_vec {

inline float load(float x) { return x; }
inline float load(int8_t x) { return static_cast<float>(x); }  // int8 KV: times its scale
inline float load(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Round-to-nearest-even into T (float32: unchanged), as torch's .to(dtype) does.
template <typename T>
inline T store(float x) { return static_cast<T>(x); }

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const int8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
}
inline __m512 load16(const at::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
// Round-to-nearest-even to bfloat16, as torch does (with AVX512-BF16: one instruction).
inline void store16(at::BFloat16* p, __m512 v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, v);
  for (int i = 0; i < 16; ++i) p[i] = static_cast<at::BFloat16>(lanes[i]);
#endif
}

// v rounded to T's precision, back in float32 (T = float: v itself).
template <typename T>
inline __m512 round_to(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
#if defined(__AVX512BF16__)
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {  // in registers, as store16 rounds
    const __m256i bits = (__m256i)_mm512_cvtneps_pbh(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
#endif
  } else {
    alignas(64) T lanes[16];
    store16(lanes, v);
    return load16(lanes);
  }
}

// 2^f for f in [-0.5, 0.5] by a degree-5 polynomial fitted to relative error 1.1e-7.
inline __m512 exp2_fraction(__m512 f) {
  __m512 p = _mm512_set1_ps(1.3218677e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6717076e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5508930e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022238e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314688e-1f));
  return _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
}

// exp(x) for x <= 0 as 2^n * 2^f, f in [-0.5, 0.5], 2^f by a degree-6 polynomial
// (relative error ~1e-7); very negative inputs (masked scores) give exactly 0.
inline __m512 exp512(__m512 x) {
  const __m512 live = x;
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718055994531f));
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  const __mmask16 keep = _mm512_cmp_ps_mask(live, _mm512_set1_ps(-87.0f), _CMP_GT_OQ);
  return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(p, n));
}
#endif

}  // namespace inflight_vec
