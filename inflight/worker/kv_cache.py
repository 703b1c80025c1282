"""The KV cache tensors: one preallocated K and one V tensor per layer.

::

    k_cache[layer]: [num_blocks, num_kv_heads, head_dim, block_size]   keys transposed
    v_cache[layer]: [num_blocks, block_size, num_kv_heads, head_dim]

Keys are stored transposed inside a block so the CPU kernel can score a whole block of
keys with broadcast FMAs; :func:`key_token_view` gives the logical
``[num_blocks, block_size, num_kv_heads, head_dim]`` view that everything else uses.
Zero-initialised: padded attention reads of never-written slots must be finite.
"""

from __future__ import annotations

import numpy as np
import torch

from inflight.model.arch import LlamaArchConfig


def bytes_per_block(arch: LlamaArchConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * arch.num_hidden_layers * block_size * arch.num_key_value_heads * arch.head_dim * element


def allocate_kv_cache(
    arch: LlamaArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    kv_heads, head_dim = arch.num_key_value_heads, arch.head_dim
    k_shape = (num_blocks, kv_heads, head_dim, block_size)
    v_shape = (num_blocks, block_size, kv_heads, head_dim)
    return [
        (_zeros(k_shape, dtype, device), _zeros(v_shape, dtype, device))
        for _ in range(arch.num_hidden_layers)
    ]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on the CPU without writing it: numpy's zeros is calloc, which maps
    fresh pages the OS zero-fills on first touch, so a large cache costs nothing until
    used (torch.zeros writes every byte: 0.3-0.5 s for 2 GiB at start-up)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    element = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(shape, dtype={2: np.uint16, 4: np.uint32, 8: np.uint64}[element])
    return torch.from_numpy(raw).view(dtype)


def key_token_view(k_cache: torch.Tensor) -> torch.Tensor:
    """The key cache as [num_blocks, block_size, num_kv_heads, head_dim] (a strided view)."""
    return k_cache.permute(0, 3, 1, 2)
