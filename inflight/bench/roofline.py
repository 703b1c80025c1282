"""Each kernel's time against its roofline bound, for ``inflight bench throughput --profile``.

Three parts:

- :class:`MachinePeaks`, measured once per profiled run before timing: the memory read
  bandwidth (a streaming read of a buffer far larger than the last-level cache) and the
  arithmetic peaks (register-only loops in ``kernels/csrc/peak_probe.cpp``), with
  PyTorch's float32 GEMM rate printed beside them as what a library reaches.
- :class:`KernelWork`, the work ledger: the model runner calls :meth:`KernelWork.add_step`
  once per forward pass, and the ledger derives analytically what each kernel had to do in
  that step (FLOPs, compulsory bytes) from the step's attention metadata, the model's
  shapes, and which matmul path each linear layer takes. The roofline time
  ``max(flops / peak, bytes / bandwidth)`` is summed per step, so a step's paged
  attention counts as memory-bound for its decode tokens and compute-bound for a long
  continued prompt chunk.
- :func:`kernel_bounds`: the profiler's measured time of each kernel (its ops grouped by
  :data:`KERNEL_OPS`) against the ledger's roofline time; ``fraction`` = roofline time /
  measured time, 1 being the limit.

Bytes are the compulsory traffic (each operand read once, each result written once); a
kernel whose operands sit in cache can beat that memory roof, so small steps' elementwise
kernels may show tiny fractions that no faster DRAM would change.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from inflight.attention.metadata import AttentionMetadata
    from inflight.model.llama import Linear, LlamaForCausalLM
    from inflight.worker.model_runner import ModelRunner

GIB = 1 << 30

# Report rows, each the profiler op names whose time it gets. An op called inside another
# listed op (prompt_attention's SDPA, aten::linear's addmm) counts in the outer one only.
KERNEL_OPS: dict[str, tuple[str, ...]] = {
    "paged_attention": ("inflight::paged_attention",),
    "prompt_attention": ("inflight::prompt_attention",),
    "padded attention (SDPA)": (
        "aten::scaled_dot_product_attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_attention_math",
    ),
    "linear (dense)": (
        "aten::linear", "aten::addmm", "aten::mm", "mkldnn::_linear_pointwise",
        "inflight::bf16_gemm",
    ),
    "linear (GGUF blocks)": ("inflight::gguf_matmul",),
    "rms_norm": ("inflight::rms_norm",),
    "rope_write_kv": ("inflight::rope_write_kv",),
    "silu_mul": ("inflight::silu_mul",),
}
OP_TO_KERNEL = {op: kernel for kernel, ops in KERNEL_OPS.items() for op in ops}

FOOTNOTE = (
    "time: the profiler's CPU time of each kernel's ops (the profiler slows the run "
    "somewhat, so fractions are a little low); roofline: max(FLOPs / compute peak, "
    "compulsory bytes / memory bandwidth) summed per step; fraction = roofline / time. "
    "Elementwise kernels of small steps work in cache, where the DRAM roof understates "
    "their limit."
)


# ---------------------------------------------------------------- machine peaks


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

    def compute_gflops(self, dtype: torch.dtype) -> float:
        """The compute roof for arithmetic on ``dtype`` operands: float32 FMA, or for
        bfloat16 the faster of vdpbf16ps and float32 FMA on converted operands (without
        AMX, vdpbf16ps can be the slower: a roof must bound whichever a library picks).
        With AMX the true bfloat16 roof is higher than either (see :func:`format_peaks`)."""
        if dtype == torch.bfloat16:
            return max(self.bf16_gflops, self.fp32_gflops)
        return self.fp32_gflops


def measure_peaks(
    seconds: float = 0.15, buffer_bytes: int = GIB, repeats: int = 3
) -> MachinePeaks:
    """Measure :class:`MachinePeaks` with torch's current thread count (about 2-3 s)."""
    flags = cpu_flags()
    fp32 = max(_probe("fp32_fma", seconds) for _ in range(repeats))
    bf16 = max(_probe("bf16_dot", seconds) for _ in range(repeats))
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


def cpu_model_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    for line in _read_lines(cpuinfo):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    import platform

    return platform.processor() or platform.machine()


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    for line in _read_lines(cpuinfo):
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []


# ---------------------------------------------------------------- the work ledger


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
        from inflight.model.llama import Linear

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


# ---------------------------------------------------------------- measured against bound


@dataclass(frozen=True, slots=True)
class KernelBound:
    """One row of the report."""

    kernel: str
    calls: int  # the profiler's (outermost listed ops)
    time_s: float
    share_of_forward: float
    flops: float
    bytes: float
    bound: str  # "compute" or "memory"
    roofline_s: float
    ledger_calls: int = 0  # the calls the ledger expected from the steps' shapes

    @property
    def achieved_gflops(self) -> float:
        return self.flops / self.time_s / 1e9 if self.time_s > 0 else 0.0

    @property
    def achieved_gbps(self) -> float:
        return self.bytes / self.time_s / 1e9 if self.time_s > 0 else 0.0

    @property
    def fraction(self) -> float:
        """Roofline time / measured time: 1 is the machine's limit."""
        return self.roofline_s / self.time_s if self.time_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "achieved_gflops": self.achieved_gflops,
            "achieved_gbps": self.achieved_gbps,
            "fraction": self.fraction,
        }


def kernel_times(events: Iterable[Any]) -> dict[str, tuple[int, float]]:
    """(calls, seconds) per kernel from the profiler's events: each outermost listed op's
    total CPU time (its children included, e.g. prompt_attention's SDPA)."""
    times: dict[str, tuple[int, float]] = {}
    for event in events:
        kernel = OP_TO_KERNEL.get(event.name)
        if kernel is None or _inside_listed_op(event):
            continue
        calls, seconds = times.get(kernel, (0, 0.0))
        times[kernel] = (calls + 1, seconds + event.cpu_time_total / 1e6)
    return times


def _inside_listed_op(event: Any) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in OP_TO_KERNEL:
            return True
        parent = parent.cpu_parent
    return False


def kernel_bounds(ledger: KernelWork, events: Iterable[Any], forward_s: float) -> list[KernelBound]:
    """Every kernel the ledger or the profiler saw, in :data:`KERNEL_OPS` order."""
    times = kernel_times(events)
    rows = []
    for kernel in KERNEL_OPS:
        tally = ledger.tallies.get(kernel)
        if tally is None and kernel not in times:
            continue
        tally = tally or KernelTally()
        calls, seconds = times.get(kernel, (0, 0.0))
        rows.append(KernelBound(
            kernel, calls, seconds, seconds / forward_s if forward_s > 0 else 0.0,
            tally.flops, tally.bytes, tally.bound, tally.roofline_s, tally.calls,
        ))
    return rows


def format_peaks(peaks: MachinePeaks) -> str:
    bf16 = f"{peaks.bf16_gflops:.0f}" if peaks.bf16_gflops > 0 else "n/a"
    return "\n".join([
        f"CPU: {peaks.cpu_model}; AVX512-BF16: {'yes' if peaks.avx512_bf16 else 'no'}, "
        f"AMX: {'yes' if peaks.amx else 'no'}; {peaks.threads} threads",
        f"peaks: memory read {peaks.memory_gbps:.1f} GB/s, float32 FMA "
        f"{peaks.fp32_gflops:.0f} GFLOP/s (PyTorch float32 GEMM reaches "
        f"{peaks.library_fp32_gemm_gflops:.0f}), bfloat16 dot {bf16} GFLOP/s",
        *(["note: AMX is not measured: bfloat16 matmul fractions may exceed 1"]
          if peaks.amx else []),
    ])


def format_kernel_bounds(peaks: MachinePeaks, rows: list[KernelBound]) -> str:
    header = (
        f"{'kernel':<24} {'calls':>7} {'time s':>8} {'fwd %':>6} {'GFLOP/s':>8} "
        f"{'GB/s':>7} {'bound':>8} {'roof s':>8} {'fraction':>8}"
    )
    lines = [format_peaks(peaks), "", header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r.kernel:<24} {r.calls:>7} {r.time_s:>8.3f} {100 * r.share_of_forward:>6.1f} "
            f"{r.achieved_gflops:>8.1f} {r.achieved_gbps:>7.2f} {r.bound:>8} "
            f"{r.roofline_s:>8.3g} {r.fraction:>8.3g}"
        )
    return "\n".join([*lines, "", FOOTNOTE])


def bounds_json(peaks: MachinePeaks, rows: list[KernelBound]) -> dict[str, Any]:
    return {"peaks": asdict(peaks), "kernels": [r.to_json() for r in rows], "note": FOOTNOTE}
