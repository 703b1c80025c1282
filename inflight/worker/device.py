"""Device and dtype choice at start-up, and building the model on them."""

from __future__ import annotations

import logging
import os
import time
from functools import cache

import torch
from torch import nn

from inflight.cpu_info import cpu_flags
from inflight.model.arch import LlamaArchConfig
from inflight.model.linear import Linear
from inflight.model.llama import LlamaForCausalLM
from inflight.model.loader import QuantizedWeight

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but CUDA is not available")
    return device


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # fp32 on the CPU (exact parity with transformers); bf16 on GPUs.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def pick_kv_cache_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: the model's dtype for "auto"."""
    if name == "auto":
        return dtype
    if name == "int8":  # the C++ kernel reads it in place; the PyTorch path dequantises
        return torch.int8
    return _DTYPES[name]


logger = logging.getLogger(__name__)


def pick_matmul_dtype(
    dtype: torch.dtype, device: torch.device, hidden: int, inner: int
) -> torch.dtype:
    """The dtype the matmuls compute in, for weights stored (and rounded) in ``dtype``.

    bfloat16 GEMMs are fast only where the CPU has the instructions oneDNN uses for them
    (AMX; AVX512-BF16 on some parts). On an Intel Xeon with AVX512-BF16 but no AMX,
    oneDNN's packed bfloat16 GEMM measured ~145 GFLOP/s against ~240 for float32 on 2
    cores, so there the bfloat16-rounded weights are kept as float32 copies: the same
    weight values, a float32 compute (closer to the reference, not further), twice the
    weight memory, and the KV cache stays bfloat16. On an AMD EPYC (Zen 5, AVX512-BF16, no
    AMX) the same GEMMs measured ~1000 GFLOP/s in bfloat16 against ~220 in float32 (MKL's
    float32 kernels), so there bfloat16 is computed in bfloat16. Decided by timing both on this
    model's shapes at start-up (about 0.1 s, one thread), unless ``INFLIGHT_BF16_MATMUL`` is
    ``bf16`` or ``fp32``."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return dtype
    forced = os.environ.get("INFLIGHT_BF16_MATMUL", "auto")
    if forced not in ("auto", "bf16", "fp32"):
        raise ValueError(f"INFLIGHT_BF16_MATMUL must be auto, bf16 or fp32, got {forced!r}")
    if forced != "auto":
        return torch.float32 if forced == "fp32" else torch.bfloat16
    bf16_s, fp32_s = _time_gemms(hidden, inner)
    choice = torch.float32 if fp32_s < 0.8 * bf16_s else torch.bfloat16
    logger.info(
        "bfloat16 weights: one %dx%dx%d GEMM on one thread takes %.2f ms of CPU in bfloat16, "
        "%.2f ms in float32: computing in %s", 256, hidden, inner, bf16_s * 1e3, fp32_s * 1e3,
        "float32" if choice == torch.float32 else "bfloat16",
    )
    return choice


@cache
def _time_gemms(hidden: int, inner: int) -> tuple[float, float]:
    """Best-of-5 CPU seconds of a [256, hidden] x [hidden, inner] GEMM on one thread:
    bfloat16 through oneDNN's packed weight (as ``Linear`` runs it), and float32.

    One thread and its CPU time (not wall time): the ratio is the cores' own (bfloat16
    dot products run at half the float32 FMA rate on some CPUs without AMX, twice it on
    others), and a busy machine must not tip the choice. Measured with wall time on 2
    threads while other processes ran, float32 once looked 1.3x slower than bfloat16 when
    it is 1.5x faster."""
    x = torch.randn(256, hidden)
    w = torch.randn(inner, hidden)

    def best(run: object) -> float:
        assert callable(run)
        times = []
        for _ in range(7):
            start = time.thread_time()
            run()
            times.append(time.thread_time() - start)
        return min(times[2:])

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fp32 = best(lambda: torch.nn.functional.linear(x, w))
        if not torch.backends.mkldnn.is_available():
            return float("inf"), fp32
        x16, packed = x.bfloat16(), torch.ops.mkldnn._reorder_linear_weight(w.bfloat16())
        bf16 = best(
            lambda: torch.ops.mkldnn._linear_pointwise(x16, packed, None, "none", [], "")
        )
    finally:
        torch.set_num_threads(threads)
    return bf16, fp32


# Largest batch (tokens in a step) that reads GGUF blocks rather than dense weights, by the
# dense weights' dtype: past it, dense matmuls (AMX for bfloat16, through oneDNN's
# pre-packed weights) are faster. Measured with `python -m inflight.bench.block_matmul` on
# SmolLM2 (one pass over all linear layers, 2 threads): blocks 10/16/24/33/57 ms at
# 1/8/12/16/32 rows, bfloat16 packed 21-22 ms at 1-16 rows and 26 at 32, float32
# 30/76/81/77/83 ms.
BLOCK_MATMUL_MAX_ROWS = {torch.float32: 32, torch.bfloat16: 8, torch.float16: 32}
# float32 where the float32 tile kernel takes the steps past the blocks (see
# F32_TILE_MATMUL_MAX_ROWS): measured on the Intel Xeon without AMX (model 207), one pass
# over SmolLM2's 121 linears, blocks against tiles 23.6 / 28.0 ms at 12 rows, 31.5 / 36.4
# at 16, 44.4 / 42.6 at 20, 59.2 / 43.4 at 24, 85.8 / 47.1 at 32; whole decode steps of
# bf16 weights computed in float32, 16 against 32 block rows: 54-61 / 56-68 ms at 20
# sequences, 54.6 / 79.0 at 24, 66.4 / 94.8 at 32.
BLOCK_MATMUL_MAX_ROWS_BESIDE_F32_TILES = 16


# Largest step (tokens) whose bfloat16 linears run csrc/bf16_linear.cpp instead of oneDNN,
# on CPUs with AVX512-BF16 and no AMX (with AMX, oneDNN's tile GEMMs are far faster).
# Measured on the AMD EPYC (Zen 5), all of SmolLM2's linears per pass, weights from memory,
# minimum of 8 alternations: 1.21-1.33x oneDNN at 9-57 rows, 1.15x at 100, 1.03-1.04x at
# 200-256, 1.02x at 400.
PAIR_MATMUL_MAX_ROWS = 256


def pair_matmul_rows() -> int:
    """Rows up to which bfloat16 linears use the pair-tile kernel here (0: never)."""
    from inflight.kernels import cpu

    if os.environ.get("INFLIGHT_BF16_LINEAR", "auto") == "onednn":
        return 0
    if "amx_bf16" in cpu_flags() or not cpu.bf16_linear_available():
        return 0
    logger.info(
        "bfloat16 linears of up to %d rows: csrc/bf16_linear.cpp (AVX512-BF16, no AMX); "
        "INFLIGHT_BF16_LINEAR=onednn keeps oneDNN", PAIR_MATMUL_MAX_ROWS,
    )
    return PAIR_MATMUL_MAX_ROWS


# Largest step (tokens) whose float32 linears run csrc/bf16_linear.cpp's float32 kernel
# instead of PyTorch's GEMM (MKL), on CPUs with AVX-512; smaller steps than the GGUF blocks
# take read those. Measured on the Intel Xeon without AMX (model 207, 2 cores), one pass
# over SmolLM2's 120 decoder linears, alternating with MKL: 1.65x at 33 rows, 1.2-1.4x at
# 57, 1.0-1.15x at 100-200, 0.86-0.93x at 512-4096 (see the kernel's header).
F32_TILE_MATMUL_MAX_ROWS = 256


def f32_tile_matmul_rows() -> int:
    """Rows up to which float32 linears use the float32 tile kernel here (0: never).
    ``INFLIGHT_F32_LINEAR=torch`` keeps PyTorch's GEMM."""
    from inflight.kernels import cpu

    if os.environ.get("INFLIGHT_F32_LINEAR", "auto") == "torch":
        return 0
    if not cpu.f32_linear_available():
        return 0
    logger.info(
        "float32 linears of up to %d rows: csrc/bf16_linear.cpp's float32 kernel; "
        "INFLIGHT_F32_LINEAR=torch keeps PyTorch's GEMM", F32_TILE_MATMUL_MAX_ROWS,
    )
    return F32_TILE_MATMUL_MAX_ROWS


# Largest step (tokens) whose bfloat16 linears run csrc/amx_linear.cpp instead of oneDNN, on
# CPUs with AMX. Measured on the Intel Xeon with AMX (2 cores), one pass over SmolLM2's 120
# decoder linears, weights from memory, best of 6 alternations: 1.3-1.5x oneDNN at 9-57
# rows, 1.2-1.3x at 64-128, level at 256, 1.1-1.2x at 512-1024, 0.7-0.85x at 4096
# (oneDNN's blocking of large steps is better than this kernel's).
AMX_MATMUL_MAX_ROWS = 1024


def amx_matmul_rows() -> int:
    """Rows up to which bfloat16 linears use the AMX kernel here (0: never)."""
    from inflight.kernels import cpu

    if os.environ.get("INFLIGHT_BF16_LINEAR", "auto") == "onednn":
        return 0
    if "amx_bf16" not in cpu_flags() or not cpu.amx_linear_available():
        return 0
    logger.info(
        "bfloat16 linears of up to %d rows: csrc/amx_linear.cpp (AMX tiles); "
        "INFLIGHT_BF16_LINEAR=onednn keeps oneDNN", AMX_MATMUL_MAX_ROWS,
    )
    return AMX_MATMUL_MAX_ROWS


# Largest bfloat16 step (tokens) whose decoder linears read 4-bit GGUF blocks with AMX tiles
# (csrc/gguf_amx_linear.cpp) instead of the dense bfloat16 weight's AMX tiles: the same
# outputs, bit for bit. Measured on the Intel Xeon with AMX (2 cores), one pass over
# SmolLM2's 120 fused decoder linears, weights from memory, best of 8: 1.20-1.25x faster at
# 1-16 rows, 1.10-1.18x at 64-128, 0.96x at 192 and 0.92x at 256.
GGUF_AMX_MAX_ROWS = 128


def gguf_amx_rows() -> int:
    """Rows up to which bfloat16 decoder linears read 4-bit GGUF blocks with AMX tiles
    here (0: never). ``INFLIGHT_GGUF_AMX=0`` keeps the dense weight's tiles."""
    from inflight.kernels import cpu

    if os.environ.get("INFLIGHT_GGUF_AMX", "1") == "0" or not amx_matmul_rows():
        return 0
    if not cpu.gguf_amx_linear_available():
        return 0
    return GGUF_AMX_MAX_ROWS


def block_matmul_rows(
    quantization: str | None, quantized: dict[str, QuantizedWeight], device: torch.device,
    dtype: torch.dtype,
) -> int:
    """How many rows a batch may have and still use the GGUF block kernel (0: never)."""
    if quantization == "none" or not quantized:
        return 0
    from inflight.kernels import cpu

    usable = device.type == "cpu" and cpu.gguf_matmul_available()
    if not usable:
        if quantization == "gguf":
            raise ValueError(
                "quantization='gguf' needs the C++ CPU kernel with AVX-512 on a CPU device; "
                "use quantization='none' here"
            )
        return 0
    if dtype == torch.float32 and f32_tile_matmul_rows():
        return BLOCK_MATMUL_MAX_ROWS_BESIDE_F32_TILES
    return BLOCK_MATMUL_MAX_ROWS[dtype]


def gguf_bf16_dot(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the GGUF block kernel computes a model's small steps with bfloat16 dot
    products (csrc/gguf_bf16_dot.cpp): for models computed in bfloat16 on CPUs with
    AVX512-BF16. The 4-bit weights stay exact; the activations round to bfloat16, as in
    every larger step's matmuls. ``INFLIGHT_GGUF_KERNEL=float32`` keeps the float32 block
    kernel. Only where bfloat16 dot products outrun float32 FMAs (``cpu.bf16_dots_pay``):
    measured on the AMD EPYC (Zen 4), SmolLM2's 120 decoder linears at one row, see the
    README's Zen 4 section; on the Intel Xeon with AMX, where they run at half the FMA
    rate, the float32 kernel made `seed8` 1.09-1.14x faster."""
    if dtype != torch.bfloat16 or device.type != "cpu":
        return False
    if os.environ.get("INFLIGHT_GGUF_KERNEL", "auto") == "float32":
        return False
    from inflight.kernels import cpu

    return cpu.gguf_bf16_dot_available() and cpu.bf16_dots_pay()


def build_model(
    arch: LlamaArchConfig, weights: dict[str, torch.Tensor], device: torch.device,
    dtype: torch.dtype, max_positions: int,
    quantized: dict[str, QuantizedWeight] | None = None, block_max_rows: int = 0,
    round_to: torch.dtype | None = None,
) -> LlamaForCausalLM:
    """Construct (no random init: parameters start empty) and take the weights in, in
    ``dtype``; with ``round_to``, each weight is first rounded to that dtype (bfloat16
    weights computed in float32, see :func:`pick_matmul_dtype`) **in place**: the caller
    hands its tensors over (rounding copies cost ~0.3 s of start-up on a slow CPU, and
    in place the loader's adjacent q/k/v and gate/up parts still fuse without a copy)."""
    model = LlamaForCausalLM(arch, max_positions=max_positions)
    if round_to is not None and round_to != dtype:
        if all(w.dtype == dtype for w in weights.values()):
            for w in weights.values():
                w.copy_(w.to(round_to))
        else:  # converted to dtype below anyway
            weights = {name: w.to(round_to) for name, w in weights.items()}
    model.load_hf_weights(weights, dtype, device)
    if quantized and block_max_rows > 0:
        model.use_quantized_weights(
            quantized, block_max_rows, bf16_dot=gguf_bf16_dot(dtype, device)
        )
    if device.type == "cpu":
        from inflight.kernels import cpu

        if cpu.available():
            model.use_cpu_kernels()
    for module in model.modules():  # the RMSNorm weights were created as float32 ones
        for name, param in module.named_parameters(recurse=False):
            if param.dtype != dtype or param.device != device:
                setattr(module, name, nn.Parameter(param.to(device, dtype), requires_grad=False))
    model.tie_weights()
    if device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available():
        pair_rows, amx_rows = pair_matmul_rows(), amx_matmul_rows()
        for module in model.modules():
            if isinstance(module, Linear):
                module.use_packed_weight()
                if pair_rows:
                    module.use_pair_weight(pair_rows)
                if amx_rows:
                    module.use_amx_weight(amx_rows)
        gguf_rows = gguf_amx_rows() if amx_rows and quantized and block_max_rows > 0 else 0
        if gguf_rows:
            model.use_gguf_amx_weights(quantized, min(gguf_rows, amx_rows))
    if device.type == "cpu" and dtype == torch.float32:
        tile_rows = f32_tile_matmul_rows()
        if tile_rows:
            for module in model.modules():
                if isinstance(module, Linear):
                    module.use_f32_tiles(tile_rows)
    model.rotary.build(device)  # RoPE tables stay float32
    if device.type == "cpu":
        model.use_fused_decode()  # a no-op unless the layers read GGUF blocks in C++
    return model.eval()

