"""Device and dtype choice at start-up, and building the model on them."""

from __future__ import annotations

import torch
from torch import nn

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
    """Construct (no random init: parameters start empty) and take the weights in."""
    model = LlamaForCausalLM(arch, max_positions=max_positions)
    model.load_hf_weights(weights, dtype, device)
    for module in model.modules():  # the RMSNorm weights were created as float32 ones
        for name, param in module.named_parameters(recurse=False):
            if param.dtype != dtype or param.device != device:
                setattr(module, name, nn.Parameter(param.to(device, dtype), requires_grad=False))
    model.tie_weights()
    model.rotary.build(device)  # RoPE tables stay float32
    return model.eval()
