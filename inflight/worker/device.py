"""Device and dtype choice at start-up, and building the model on them."""

from __future__ import annotations

import torch

from inflight.model.arch import LlamaArchConfig
from inflight.model.llama import LlamaForCausalLM

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


def build_model(
    arch: LlamaArchConfig, weights: dict[str, torch.Tensor], device: torch.device,
    dtype: torch.dtype, max_positions: int,
) -> LlamaForCausalLM:
    """Construct without random init (meta device), then copy the weights in."""
    with torch.device("meta"):
        model = LlamaForCausalLM(arch, max_positions=max_positions)
    model.to_empty(device=device)
    model.tie_weights()
    model.load_hf_weights(weights)
    model.to(dtype)
    model.rotary.build(device)  # after .to(dtype): RoPE tables stay float32
    return model.eval()
