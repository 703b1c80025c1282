"""Decode attention from DRAM: the paged attention kernel alone, at a step's shapes.

    python -m inflight.bench.decode_attention [--seqs 57] [--context 450] [--layers 30]
        [--kv-cache-dtype bfloat16] [--block-size 16] [--order random|sequential|engine]

One decode token per sequence attends to ``context`` cached tokens, layer after layer,
each layer with its own cache region allocated as the engine allocates it (one memory
map with transparent huge pages, ``worker/kv_cache.py``), so that every layer's K/V comes
from DRAM as in a real step; a single repeated layer would sit in L3 and overstate the
kernel. Defaults are SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head_dim
64) at ``mixed``'s mean batch and context on 2 cores. Prints ms per layer, the K/V bytes
read per second and that rate's fraction of the machine's measured memory read peak.

With ``--overlap`` it also times the kernel on K/V that stays in cache (a few sequences'
blocks, one layer called over and over, scaled to the full batch: the arithmetic alone)
and sets it against the time the bytes alone take at the read peak: a kernel whose
reads overlap its arithmetic takes the larger of the two, one whose reads and arithmetic
take turns takes their sum (see :func:`overlap_fraction`).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace

import torch

from inflight.bench.machine_peaks import memory_read_gbps
from inflight.config import KV_CACHE_DTYPES
from inflight.kernels import cpu
from inflight.model.arch import LlamaArchConfig
from inflight.worker.device import pick_kv_cache_dtype
from inflight.worker.kv_cache import allocate_kv_cache, bytes_per_block

# The engine's cache dtypes by name, less "auto" (there is no model dtype here to follow).
CACHE_DTYPE_CHOICES = [name for name in KV_CACHE_DTYPES if name != "auto"]


@dataclass(frozen=True)
class DecodeAttentionShape:
    seqs: int
    context: int  # cached tokens each decode token attends to
    layers: int = 30
    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16
    kv_cache_dtype: str = "bfloat16"

    @property
    def dtype(self) -> torch.dtype:
        return pick_kv_cache_dtype(self.kv_cache_dtype, torch.float32)

    def arch(self) -> LlamaArchConfig:
        """The attention part of a model config (the rest does not matter here)."""
        return LlamaArchConfig(
            vocab_size=1, hidden_size=self.heads * self.head_dim, intermediate_size=1,
            num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, head_dim=self.head_dim, rms_norm_eps=1e-5,
            rope_theta=1e4, max_position_embeddings=self.context + 1,
            tie_word_embeddings=True,
        )

    def kv_bytes_per_layer(self) -> int:
        """Compulsory bytes one layer's call reads: every context token's key and value for
        each KV head, plus, for int8, their float32 scales (the engine's own accounting,
        ``bytes_per_block``, per token and layer)."""
        per_token = bytes_per_block(self.arch(), 1, self.dtype) // self.layers
        return self.seqs * self.context * per_token


@dataclass(frozen=True)
class DecodeAttentionTiming:
    shape: DecodeAttentionShape
    ms_per_layer: float

    @property
    def gbps(self) -> float:
        return self.shape.kv_bytes_per_layer() / (self.ms_per_layer * 1e-3) / 1e9


def block_tables(order: str, seqs: int, per_seq: int, num_blocks: int,
                 generator: torch.Generator) -> torch.Tensor:
    """``[seqs, per_seq]`` int32 block ids, distinct, laid out as ``order`` says (see
    :func:`measure`)."""
    if order == "random":
        blocks = torch.randperm(num_blocks, generator=generator)[: seqs * per_seq]
        return blocks.int().view(seqs, per_seq)
    if order == "engine":
        prompt = per_seq * 2 // 3
        runs = torch.arange(seqs * prompt).view(seqs, prompt)
        grown = seqs * prompt + torch.arange(seqs * (per_seq - prompt))
        return torch.cat([runs, grown.view(per_seq - prompt, seqs).T], dim=1).int()
    if order == "sequential":
        return torch.arange(seqs * per_seq).int().view(seqs, per_seq)
    raise ValueError(f"order must be random, sequential or engine, got {order!r}")


def measure(shape: DecodeAttentionShape, order: str = "random", repeats: int = 10,
            seed: int = 0) -> DecodeAttentionTiming:
    """Mean wall time of one layer's paged attention call over ``repeats`` passes through
    all layers (after two warm-up passes). ``order``: ``random`` scatters each sequence's
    blocks over the cache (a long-running server), ``sequential`` gives them in order,
    ``engine`` lays them out as a fresh engine's block pool does on ``mixed``: each
    sequence's prompt blocks (the first two thirds) in one run, the blocks its decode
    tokens add later taken in turn with the other sequences'."""
    generator = torch.Generator().manual_seed(seed)
    dtype = shape.dtype
    per_seq = -(-shape.context // shape.block_size)
    num_blocks = shape.seqs * per_seq + 64
    # The engine's allocation: one memory map for all layers, transparent huge pages.
    caches = allocate_kv_cache(shape.arch(), num_blocks, shape.block_size, dtype,
                               torch.device("cpu"))
    for layer in caches:
        for part in (layer.k, layer.v):
            if dtype == torch.int8:
                part.copy_(torch.randint(-127, 128, part.shape, generator=generator,
                                         dtype=torch.int8))
            else:
                part.copy_(torch.randn(part.shape, generator=generator))
        for part in (layer.k_scale, layer.v_scale):
            if part is not None:  # int8 only
                part.copy_(torch.rand(part.shape, generator=generator) * 0.02)
    tables = block_tables(order, shape.seqs, per_seq, num_blocks, generator)
    # The queries as the engine passes them (attention/torch_paged._varlen): bfloat16
    # against a bfloat16 cache (scored with bfloat16 dot products where they pay, see
    # cpu.paged_attention's bf16_dots), else float32.
    q_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    q = torch.randn(shape.seqs, shape.heads, shape.head_dim, generator=generator).to(q_dtype)
    query_start = torch.arange(shape.seqs + 1, dtype=torch.int32)
    seq_lens = torch.full((shape.seqs,), shape.context, dtype=torch.int32)
    scale = shape.head_dim**-0.5

    def one_pass() -> None:
        for k, v, k_scale, v_scale in caches:
            cpu.paged_attention(q, k, v, tables, query_start, seq_lens, scale, k_scale, v_scale)

    for _ in range(2):
        one_pass()
    start = time.perf_counter()
    for _ in range(repeats):
        one_pass()
    elapsed = time.perf_counter() - start
    return DecodeAttentionTiming(shape, elapsed / (repeats * shape.layers) * 1e3)


def measure_in_cache(shape: DecodeAttentionShape, order: str = "random", calls: int = 300,
                     cache_bytes: int = 1 << 20) -> DecodeAttentionTiming:
    """The kernel's time per layer at ``shape`` with its K/V in cache: the blocks of as
    many sequences as fit ``cache_bytes`` per thread (at least one per thread), one layer
    called ``calls`` times, the time scaled by ``shape.seqs`` over those sequences (every
    sequence is the same work)."""
    per_seq = shape.kv_bytes_per_layer() // shape.seqs
    threads = torch.get_num_threads()
    seqs = max(threads, min(shape.seqs, cache_bytes * threads // max(per_seq, 1)))
    small = replace(shape, seqs=seqs, layers=1)
    timing = measure(small, order, repeats=calls)
    return DecodeAttentionTiming(shape, timing.ms_per_layer * shape.seqs / seqs)


def overlap_fraction(measured_ms: float, compute_ms: float, memory_ms: float) -> float:
    """How much of the shorter of arithmetic (``compute_ms``) and reads (``memory_ms``)
    hides under the longer one: 1 when ``measured_ms`` is their maximum, 0 when it is
    their sum (they take turns), clamped to [0, 1]."""
    shorter = min(compute_ms, memory_ms)
    if shorter <= 0.0:
        return 1.0  # nothing to hide
    hidden = compute_ms + memory_ms - measured_ms
    return min(1.0, max(0.0, hidden / shorter))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=57)
    parser.add_argument("--context", type=int, default=450)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-dtype", choices=CACHE_DTYPE_CHOICES, default="bfloat16")
    parser.add_argument("--order", choices=["random", "sequential", "engine"], default="random")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--overlap", action="store_true",
                        help="also time the kernel on K/V in cache and report how much of "
                             "its reads overlap its arithmetic")
    args = parser.parse_args(argv)
    if not cpu.available():
        parser.error("the C++ kernels are not available on this machine")
    shape = DecodeAttentionShape(
        args.seqs, args.context, args.layers, block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    timing = measure(shape, args.order, args.repeats)
    peak = memory_read_gbps()
    print(
        f"{shape.seqs} sequences x {shape.context} tokens, {shape.layers} layers, "
        f"{shape.kv_cache_dtype} cache, blocks of {shape.block_size} ({args.order}): "
        f"{timing.ms_per_layer:.3f} ms per layer, {timing.gbps:.1f} GB/s of K/V, "
        f"{timing.gbps / peak:.2f} of the memory read peak ({peak:.1f} GB/s)"
    )
    if args.overlap:
        compute_ms = measure_in_cache(shape, args.order).ms_per_layer
        memory_ms = shape.kv_bytes_per_layer() / (peak * 1e9) * 1e3
        print(
            f"K/V in cache (arithmetic alone): {compute_ms:.3f} ms per layer; the bytes alone "
            f"at the read peak: {memory_ms:.3f} ms; overlapped "
            f"{overlap_fraction(timing.ms_per_layer, compute_ms, memory_ms):.2f} "
            f"(1: the larger of the two, {max(compute_ms, memory_ms):.3f} ms; 0: their sum, "
            f"{compute_ms + memory_ms:.3f} ms)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
