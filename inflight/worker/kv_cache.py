"""The KV cache tensors: one preallocated K and one V tensor per layer.

::

    k_cache[layer]: [num_blocks, num_kv_heads, head_dim, block_size]   keys transposed
    v_cache[layer]: [num_blocks, block_size, num_kv_heads, head_dim]
    k_scale[layer], v_scale[layer]: [num_blocks, num_kv_heads, block_size]   int8 only

Keys are stored transposed inside a block so the CPU kernel can score a whole block of
keys with broadcast FMAs; :func:`key_token_view` gives the logical
``[num_blocks, block_size, num_kv_heads, head_dim]`` view that everything else uses.
Zero-initialised: padded attention reads of never-written slots must be finite.

An int8 cache (``kv_cache_dtype="int8"``) stores each token's K and V per head as
``round(x / scale)`` with ``scale = max|x| / 127``: half the bytes of bfloat16 for
attention to read, which is what bounds decode attention over long contexts on a CPU.
"""

from __future__ import annotations

import math
import mmap
from typing import NamedTuple

import torch

from inflight.model.arch import LlamaArchConfig


class LayerKVCache(NamedTuple):
    """One layer's cache; the scales exist only for an int8 cache."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


def bytes_per_block(arch: LlamaArchConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    per_head_token = arch.head_dim * element + (4 if dtype == torch.int8 else 0)
    return 2 * arch.num_hidden_layers * block_size * arch.num_key_value_heads * per_head_token


def allocate_kv_cache(
    arch: LlamaArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
    device: torch.device,
) -> list[LayerKVCache]:
    kv_heads, head_dim = arch.num_key_value_heads, arch.head_dim
    k_shape = (num_blocks, kv_heads, head_dim, block_size)
    v_shape = (num_blocks, block_size, kv_heads, head_dim)
    per_tensor = math.prod(k_shape)
    layers = arch.num_hidden_layers
    buffer = _zeros(2 * layers * per_tensor, dtype, device)
    parts = buffer.split(per_tensor)
    if dtype != torch.int8:
        return [
            LayerKVCache(parts[2 * i].view(k_shape), parts[2 * i + 1].view(v_shape))
            for i in range(layers)
        ]
    scale_shape = (num_blocks, kv_heads, block_size)
    per_scale = math.prod(scale_shape)
    scales = _zeros(2 * layers * per_scale, torch.float32, device).split(per_scale)
    return [
        LayerKVCache(
            parts[2 * i].view(k_shape), parts[2 * i + 1].view(v_shape),
            scales[2 * i].view(scale_shape), scales[2 * i + 1].view(scale_shape),
        )
        for i in range(layers)
    ]


def _zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One flat zero tensor for every layer's cache.

    On the CPU it is an anonymous memory map: the OS zero-fills its pages on first touch,
    so a large cache costs nothing at start-up (torch.zeros writes every byte: 0.3-0.5 s for
    2 GiB), and it is marked for transparent huge pages. Attention reads blocks scattered
    over the whole cache, and with 4 KiB pages most reads miss the TLB: huge pages made the
    decode attention kernel about 20% faster (64 sequences x 600 tokens, 2 GiB cache).
    """
    if device.type != "cpu":
        return torch.zeros(numel, dtype=dtype, device=device)
    element = torch.empty((), dtype=dtype).element_size()
    size = max(numel * element, 1)
    try:
        region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, OverflowError) as error:  # ENOMEM: more than the machine can map
        raise ValueError(
            f"the KV cache needs {size / 2**30:.1f} GiB, more than this machine can allocate "
            f"({error}); lower num_kv_blocks or kv_cache_memory_bytes"
        ) from None
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    # frombuffer keeps a reference to the map, which lives as long as the tensor.
    return torch.frombuffer(region, dtype=dtype, count=numel)


def key_token_view(k_cache: torch.Tensor) -> torch.Tensor:
    """The key cache as [num_blocks, block_size, num_kv_heads, head_dim] (a strided view)."""
    return k_cache.permute(0, 3, 1, 2)


def scale_token_view(scale: torch.Tensor) -> torch.Tensor:
    """int8 scales as [num_blocks, block_size, num_kv_heads] (a strided view)."""
    return scale.transpose(1, 2)


_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in, writable, without changing them


def populate(caches: list[LayerKVCache]) -> bool:
    """Fault in every page of the CPU caches now instead of at first use.

    The cache's memory is mapped lazily, and on this project's VMs the first touch of fresh
    memory is slow (about 1 GB/s: the host backs each page then). ``madvise
    (MADV_POPULATE_WRITE)`` maps it without writing, so it is safe while the engine runs;
    the benchmark calls it before timing (vLLM zero-fills its cache at start-up) and the
    server in the background once started. Returns False where unsupported."""
    import ctypes
    import ctypes.util

    tensors = [t for layer in caches for t in layer if t is not None and t.device.type == "cpu"]
    if not tensors:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except OSError:
        return False
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    for tensor in tensors:
        start = tensor.data_ptr() // page * page
        end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
        if libc.madvise(start, end - start, _MADV_POPULATE_WRITE) != 0:
            return False
    return True
