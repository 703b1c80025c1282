"""What this machine can do at most, measured once per profiled run before timing: the
memory read bandwidth (a streaming read of a buffer far larger than the last-level cache)
and the arithmetic peaks (register-only loops in ``kernels/csrc/peak_probe.cpp``), with
PyTorch's float32 GEMM rate beside them as what a library reaches. The roofline report
(``bench/roofline``) measures each kernel against these."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from inflight.cpu_info import cpu_flags, cpu_model_name

GIB = 1 << 30



@dataclass(frozen=True, slots=True)
class MachinePeaks:
    """What this machine can do at most, with the engine's thread count."""

    cpu_model: str
    threads: int
    memory_gbps: float  # streaming read of a buffer far larger than the caches
    fp32_gflops: float  # float32 FMA peak (register-only loop)
    bf16_gflops: float  # vdpbf16ps peak; 0 without AVX512-BF16
    library_fp32_gemm_gflops: float  # torch.mm of 2048 x 2048 x 2048 float32
    avx512_bf16: bool
    amx: bool
    amx_gflops: float = 0.0  # TDPBF16PS on AMX tiles (register-only loop); 0 without AMX

    def compute_gflops(self, dtype: torch.dtype) -> float:
        """The compute roof for arithmetic on ``dtype`` operands: float32 FMA, or for
        bfloat16 the fastest of AMX tiles, vdpbf16ps and float32 FMA on converted operands
        (without AMX, vdpbf16ps can be the slower: a roof must bound whichever a kernel
        picks)."""
        if dtype == torch.bfloat16:
            return max(self.amx_gflops, self.bf16_gflops, self.fp32_gflops)
        return self.fp32_gflops


def measure_peaks(
    seconds: float = 0.15, buffer_bytes: int = GIB, repeats: int = 3
) -> MachinePeaks:
    """Measure :class:`MachinePeaks` with torch's current thread count (about 2-3 s)."""
    flags = cpu_flags()
    fp32 = max(_probe("fp32_fma", seconds) for _ in range(repeats))
    bf16 = max(_probe("bf16_dot", seconds) for _ in range(repeats))
    amx = max(_probe("amx_bf16", seconds) for _ in range(repeats)) if "amx_bf16" in flags else 0.0
    gemm = library_gemm_gflops(repeats=repeats)
    return MachinePeaks(
        cpu_model=cpu_model_name(),
        threads=torch.get_num_threads(),
        memory_gbps=memory_read_gbps(buffer_bytes, repeats),
        # without the C++ probe the library's GEMM is the best roof there is
        fp32_gflops=fp32 if fp32 > 0 else gemm,
        bf16_gflops=bf16,
        library_fp32_gemm_gflops=gemm,
        avx512_bf16="avx512_bf16" in flags,
        amx="amx_bf16" in flags,
        amx_gflops=amx,
    )


def _probe(kind: str, seconds: float) -> float:
    from inflight.kernels import cpu

    return cpu.peak_gflops(kind, seconds) if cpu.available() else 0.0


def memory_read_gbps(buffer_bytes: int = GIB, repeats: int = 3) -> float:
    """GB/s of a parallel float32 sum over ``buffer_bytes``: best of ``repeats``."""
    buffer = torch.ones(buffer_bytes // 4, dtype=torch.float32)  # touched: pages mapped
    best = min(_timed(lambda: buffer.sum()) for _ in range(repeats))
    return buffer_bytes / best / 1e9


def library_gemm_gflops(n: int = 2048, repeats: int = 3) -> float:
    """GFLOP/s of PyTorch's float32 ``a @ b`` for ``n x n x n``: best of ``repeats``."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    torch.mm(a, b, out=out)  # warm-up: thread pool, library dispatch
    best = min(_timed(lambda: torch.mm(a, b, out=out)) for _ in range(repeats))
    return 2 * n**3 / best / 1e9


def _timed(fn: Any) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def format_peaks(peaks: MachinePeaks) -> str:
    bf16 = f"{peaks.bf16_gflops:.0f}" if peaks.bf16_gflops > 0 else "n/a"
    return "\n".join([
        f"CPU: {peaks.cpu_model}; AVX512-BF16: {'yes' if peaks.avx512_bf16 else 'no'}, "
        f"AMX: {'yes' if peaks.amx else 'no'}; {peaks.threads} threads",
        f"peaks: memory read {peaks.memory_gbps:.1f} GB/s, float32 FMA "
        f"{peaks.fp32_gflops:.0f} GFLOP/s (PyTorch float32 GEMM reaches "
        f"{peaks.library_fp32_gemm_gflops:.0f}), bfloat16 dot {bf16} GFLOP/s"
        + (f", AMX bfloat16 tiles {peaks.amx_gflops:.0f} GFLOP/s" if peaks.amx_gflops > 0 else ""),
        *(["note: AMX tiles could not be measured: bfloat16 matmul fractions may exceed 1"]
          if peaks.amx and peaks.amx_gflops <= 0 else []),
    ])
