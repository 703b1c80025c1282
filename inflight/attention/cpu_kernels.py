"""The C++ paged-attention kernel for the CPU: built on first use, cached by torch.

``csrc/paged_attention.cpp`` is compiled with ``torch.utils.cpp_extension`` (g++ and ninja)
into torch's extension cache, once per source version; ``scripts/bootstrap.sh`` builds it
at install time so the first engine start does not pay for it. If the build fails (no
compiler), :func:`available` says so and the engine uses the PyTorch reference backend.
"""

from __future__ import annotations

import logging
import os
from functools import cache
from pathlib import Path

import torch

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
logger = logging.getLogger(__name__)


@cache
def available() -> bool:
    """Build (or load the cached build of) the kernel; False if that is impossible."""
    if os.environ.get("INFLIGHT_ATTENTION_BACKEND", "auto") == "torch":
        return False
    try:
        from torch.utils.cpp_extension import load

        load(
            name="inflight_cpu_kernels",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as error:  # a missing compiler must not stop the engine
        logger.warning("C++ paged attention unavailable (%s); using the PyTorch backend", error)
        return False
    return True


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start: torch.Tensor, seq_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """See csrc/paged_attention.cpp for shapes; q and the result are float32."""
    return torch.ops.inflight.paged_attention(
        q, k_cache, v_cache, block_tables, query_start, seq_lens, scale
    )
