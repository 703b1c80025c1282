"""Which attention backend a device gets.

``INFLIGHT_ATTENTION_BACKEND`` overrides the choice:

* ``torch``: the PyTorch reference (padded SDPA over gathered blocks) for everything;
* ``cpp``: the C++ varlen kernel for decode tokens and short prompt chunks, padded SDPA
  for steps with a prompt chunk over 1024 tokens (the CPU default: SDPA's flash kernel
  is faster on long chunks; see ``worker/input_batch.py``);
* ``cpp-all``: the C++ kernel for every token.
"""

from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "torch", "cpp", "cpp-all")


def choose_attention_backend(device: torch.device) -> str:
    requested = os.environ.get("INFLIGHT_ATTENTION_BACKEND", "auto")
    if requested not in BACKENDS:
        raise ValueError(f"INFLIGHT_ATTENTION_BACKEND must be one of {BACKENDS}, got {requested!r}")
    if device.type != "cpu" or requested == "torch":
        return "torch"
    from inflight.kernels import cpu as cpu_kernels

    if not cpu_kernels.available():
        return "torch"
    return "cpp" if requested == "auto" else requested
