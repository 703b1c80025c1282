"""The work ledger of ``bench throughput --profile``: what each kernel had to do, step by step.

The model runner calls :meth:`KernelWork.add_step` once per forward pass, and the ledger
derives analytically what each kernel had to do in that step (FLOPs, compulsory bytes)
from the step's attention metadata, the model's shapes, and which matmul path each linear
layer takes. The roofline time ``max(flops / peak, bytes / bandwidth)`` is summed per
step, so a step's paged attention counts as memory-bound for its decode tokens and
compute-bound for a long continued prompt chunk.

Bytes are the compulsory traffic (each operand read once, each result written once); a
kernel whose operands sit in cache can beat that memory roof, so small steps' elementwise
kernels may show tiny fractions that no faster DRAM would change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from inflight.bench.machine_peaks import MachinePeaks

if TYPE_CHECKING:
    from inflight.attention.metadata import AttentionMetadata
    from inflight.model.linear import Linear
    from inflight.model.llama import LlamaForCausalLM
    from inflight.worker.model_runner import ModelRunner


@dataclass
class KernelTally:
    """One kernel's work over a run; ``*_s`` are roofline seconds summed per step."""

    calls: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    roofline_s: float = 0.0
    compute_bound_s: float = 0.0  # the part of roofline_s where FLOPs were the limit

    @property
    def bound(self) -> str:
        return "compute" if self.compute_bound_s * 2 > self.roofline_s else "memory"


@dataclass(frozen=True, slots=True)
class LinearShape:
    """One linear layer as the ledger needs it (see ``Linear.forward`` for the paths)."""

    out_features: int  # N
    in_features: int  # K
    weight_dtype: torch.dtype
    packed: bool  # oneDNN's blocked copy, used when the input has the weight's dtype
    block_bytes: int  # packed GGUF blocks; 0 without
    block_max_rows: int

    @staticmethod
    def of(linear: Linear) -> LinearShape:
        n, k = linear.weight.shape
        blocks = linear.blocks
        return LinearShape(
            n, k, linear.weight.dtype, linear.packed is not None,
            0 if blocks is None else blocks.blocks.numel() * blocks.blocks.element_size(),
            linear.block_max_rows,
        )

    def reads_blocks(self, rows: int, x_dtype: torch.dtype) -> bool:
        if self.packed and x_dtype == self.weight_dtype:
            return False
        return self.block_bytes > 0 and rows <= self.block_max_rows


@dataclass(frozen=True, slots=True)
class AttendedSequences:
    """Per-sequence query lengths and context lengths (this step's tokens included)."""

    kernel: str
    query_lens: list[int]
    context_lens: list[int]

    def pairs(self) -> int:
        """Query x key pairs under the causal mask: query i of a chunk of q sees the
        c - q earlier tokens and the first i + 1 of its own."""
        return sum(
            q * (c - q) + q * (q + 1) // 2
            for q, c in zip(self.query_lens, self.context_lens, strict=True)
        )


@dataclass
class KernelWork:
    """The work ledger: what each kernel had to do, step by step (module docstring)."""

    peaks: MachinePeaks
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: torch.dtype
    layer_linears: list[LinearShape]  # every decoder layer's, in order
    lm_head: LinearShape
    model: LlamaForCausalLM  # for the activation dtype a step of T tokens uses
    tallies: dict[str, KernelTally] = field(default_factory=dict)
    num_steps: int = 0

    @staticmethod
    def for_model(
        model: LlamaForCausalLM, kv_dtype: torch.dtype, peaks: MachinePeaks
    ) -> KernelWork:
        from inflight.model.linear import Linear

        arch = model.arch
        linears = [LinearShape.of(m) for m in model.layers.modules() if isinstance(m, Linear)]
        return KernelWork(
            peaks, arch.num_hidden_layers, arch.hidden_size, arch.intermediate_size,
            arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim, kv_dtype,
            linears, LinearShape.of(model.lm_head), model,
        )

    @staticmethod
    def for_runner(runner: ModelRunner, peaks: MachinePeaks) -> KernelWork:
        return KernelWork.for_model(runner.model, runner.kv_caches[0].k.dtype, peaks)

    def add_step(
        self, metadata: AttentionMetadata, positions: torch.Tensor, num_sampled: int
    ) -> None:
        """Account one forward pass over ``positions.numel()`` tokens, of which
        ``num_sampled`` rows went through the output layer."""
        num_tokens = int(positions.numel())
        act_dtype = self.model.activation_dtype(num_tokens)
        self.num_steps += 1
        self._add_linears(num_tokens, num_sampled, act_dtype)
        for group in attended_sequences(metadata, positions):
            self._add_attention(group, act_dtype)
        self._add_layer_ops(num_tokens, act_dtype)

    # -------------------------------------------------------------- per kernel

    def _add(
        self, kernel: str, calls: int, flops: float, num_bytes: float, dtype: torch.dtype
    ) -> None:
        tally = self.tallies.setdefault(kernel, KernelTally())
        compute_s = flops / (self.peaks.compute_gflops(dtype) * 1e9)
        memory_s = num_bytes / (self.peaks.memory_gbps * 1e9)
        tally.calls += calls
        tally.flops += flops
        tally.bytes += num_bytes
        tally.roofline_s += max(compute_s, memory_s)
        if compute_s > memory_s:
            tally.compute_bound_s += compute_s

    def _add_linears(self, num_tokens: int, num_sampled: int, act_dtype: torch.dtype) -> None:
        # [(linear, rows)]: the decoder layers over every token, the output layer only
        # over the rows that sample
        calls = [(linear, num_tokens) for linear in self.layer_linears]
        if num_sampled:
            calls.append((self.lm_head, num_sampled))
        work: dict[tuple[str, torch.dtype], list[float]] = {}
        num_bytes: float
        for linear, rows in calls:
            n, k = linear.out_features, linear.in_features
            if linear.reads_blocks(rows, act_dtype):  # float32 in and out, blocks read once
                key = ("linear (GGUF blocks)", torch.float32)
                num_bytes = linear.block_bytes + 4 * rows * (n + k)
            else:
                key = ("linear (dense)", linear.weight_dtype)
                element = _element_size(linear.weight_dtype)
                num_bytes = element * (n * k + rows * (n + k))
            entry = work.setdefault(key, [0.0, 0.0, 0.0])  # calls, FLOPs, bytes
            entry[0] += 1
            entry[1] += 2.0 * rows * n * k
            entry[2] += num_bytes
        for (kernel, dtype), (count, flops, total_bytes) in work.items():
            self._add(kernel, int(count), flops, total_bytes, dtype)

    def _add_attention(self, group: AttendedSequences, act_dtype: torch.dtype) -> None:
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        flops = 4.0 * heads * head_dim * group.pairs() * self.num_layers
        act = _element_size(act_dtype)
        if group.kernel == "prompt_attention":
            # fresh prompts: q, k, v of this step's tokens in, the output out
            tokens = sum(group.query_lens)
            per_layer = act * tokens * head_dim * (2 * heads + 2 * kv_heads)
            compute_dtype = act_dtype
        else:
            # K and V of every context token read from the cache (int8: + a float32
            # scale per token and head)
            per_token_head = head_dim * _element_size(self.kv_dtype)
            if self.kv_dtype == torch.int8:
                per_token_head += 4
            per_layer = sum(group.context_lens) * 2 * kv_heads * per_token_head
            # the C++ kernel computes in float32; padded SDPA in the activations' dtype
            compute_dtype = torch.float32 if group.kernel == "paged_attention" else act_dtype
        self._add(group.kernel, self.num_layers, flops, per_layer * self.num_layers,
                  compute_dtype)

    def _add_layer_ops(self, num_tokens: int, act_dtype: torch.dtype) -> None:
        """RMSNorm, RoPE + K/V write, SiLU-mul: bytes read + written (their FLOPs are a
        few per element and never the limit)."""
        layers, t, hidden = self.num_layers, num_tokens, self.hidden_size
        act = _element_size(act_dtype)
        # the float32 residual stream read, the normalised rows written; with ``add``
        # (every norm but the first) the sublayer's output read and the stream written back
        norms = 2 * layers + 1
        norm_bytes = norms * t * hidden * (4 + act) + (norms - 1) * t * hidden * (act + 4)
        self._add("rms_norm", norms, 4.0 * norms * t * hidden, norm_bytes, torch.float32)

        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        kv_element = _element_size(self.kv_dtype)
        kv_write = 2 * kv_size * kv_element + (
            2 * self.num_kv_heads * 4 if self.kv_dtype == torch.int8 else 0
        )
        rope_bytes = t * (
            act * (q_size + 2 * kv_size)  # qkv read
            + 2 * 4 * self.head_dim  # cos and sin rows
            + act * (q_size + kv_size)  # rotated q and k written
            + kv_write
        )
        rope_flops = 3.0 * t * (q_size + kv_size)
        self._add("rope_write_kv", layers, layers * rope_flops, layers * rope_bytes,
                  torch.float32)

        inter = self.intermediate_size
        self._add("silu_mul", layers, layers * 5.0 * t * inter, layers * act * 3 * t * inter,
                  torch.float32)


def attended_sequences(
    metadata: AttentionMetadata, positions: torch.Tensor
) -> list[AttendedSequences]:
    """Each attention group of a step, as the kernel that serves it and its sequences'
    query and context lengths."""
    from inflight.attention.metadata import PaddedGroup, VarlenGroup

    groups = []
    if metadata.prompts is not None:
        lengths = metadata.prompts.lengths.tolist()
        groups.append(AttendedSequences("prompt_attention", lengths, lengths))
    for group in (metadata.decode, metadata.prefill):
        if isinstance(group, VarlenGroup):
            starts = group.query_start.tolist()
            query_lens = [b - a for a, b in zip(starts, starts[1:], strict=False)]
            groups.append(
                AttendedSequences("paged_attention", query_lens, group.seq_lens.tolist())
            )
        elif isinstance(group, PaddedGroup):
            query_lens = group.valid.sum(dim=1).tolist()
            if group.fresh:
                context_lens = list(query_lens)
            else:  # a chunk's last token sits at position context - 1
                last = group.token_index[torch.arange(len(query_lens)),
                                         torch.tensor(query_lens) - 1]
                context_lens = (positions[last] + 1).tolist()
            groups.append(AttendedSequences("padded attention (SDPA)", query_lens, context_lens))
    return groups


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
