// 4-bit GGUF blocks computed with bfloat16 dot products (csrc/gguf_bf16_dot.cpp), the
// small-step kernel for bfloat16 models on CPUs with AVX512-BF16; csrc/gguf_matmul.cpp
// dispatches to it for the type ids that carry kBf16DotFlag.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace inflight_gguf {

// Set in a ggml type id (Q4_0 = 2, Q4_1 = 3) when the blocks are packed by
// gguf_pack_bf16_dot: gguf_matmul(x, packed, type | kBf16DotFlag) then takes this kernel.
constexpr int64_t kBf16DotFlag = 256;

// Bytes per packed row for K input features (24 per block, blocks rounded up to even).
int64_t bf16_dot_row_bytes(int64_t K);

// y [M, N] = x [M, K] @ W.T from rows packed by gguf_pack_bf16_dot; false where this build
// has no AVX512-BF16 (nothing written then).
bool bf16_dot_matmul(const float* x, int64_t M, int64_t K, const uint8_t* W, float* y,
                     int64_t N);

}  // namespace inflight_gguf
