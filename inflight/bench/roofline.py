"""Each kernel's time against its roofline bound, for ``inflight bench throughput --profile``.

The machine's peaks come from ``bench/machine_peaks`` and what each kernel had to do from
the work ledger (``bench/work_ledger``); :func:`kernel_bounds` sets the profiler's measured
time of each kernel (its ops grouped by :data:`KERNEL_OPS`) against the ledger's roofline
time: ``fraction`` = roofline time / measured time, 1 being the limit.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from inflight.bench.machine_peaks import MachinePeaks, format_peaks
from inflight.bench.work_ledger import KernelTally, KernelWork

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
    # The 4-bit AMX steps (gguf_amx_linear) are bfloat16 tile products like the dense
    # ones; the ledger counts their bytes as the dense weight's, so their memory roof is
    # the dense one (above theirs: their fraction reads a little high).
    "linear (dense)": (
        "aten::linear", "aten::addmm", "aten::mm", "mkldnn::_linear_pointwise",
        "inflight::bf16_linear", "inflight::bf16_linear_argmax", "inflight::f32_linear",
        "inflight::f32_linear_argmax", "inflight::amx_linear",
        "inflight::amx_linear_argmax",
        "inflight::gguf_amx_linear",
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
