"""Benchmark reports: the numbers of one run, computed from its outputs and step trace.

This module owns :class:`BenchReport` (what ``inflight bench throughput`` prints and writes
to JSON), the slot-step accounting that turns a step trace into utilisation figures, and
per-request latencies. It imports neither torch nor the engine, so reports and traces
can be read and compared anywhere.

Slot-step accounting (the source document's measure): every step, each of the
``num_slots`` batch slots is exactly one of

    working  a request in the slot ran this step (prefill chunk or decode)
    idle     the slot is held by a request that did no work (static batching keeps
             finished members' slots until the whole batch ends)
    empty    nobody holds the slot

so working + idle + empty = num_slots * steps. For the seed example (8 slots, one
request of 500 tokens, seven of 50) static batching gives working = 850 of 4000.
"""

from __future__ import annotations

import json
import resource
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from inflight.engine.step_trace import StepRecord


@dataclass(frozen=True, slots=True)
class SlotSteps:
    """How a run's slot-steps were spent (see the module docstring)."""

    num_steps: int
    num_slots: int
    working: int
    idle: int

    @property
    def total(self) -> int:
        return self.num_steps * self.num_slots

    @property
    def empty(self) -> int:
        return self.total - self.working - self.idle

    @property
    def utilisation(self) -> float:
        return self.working / self.total if self.total else 0.0

    @property
    def idle_share(self) -> float:
        return self.idle / self.total if self.total else 0.0

    @property
    def mean_batch_size(self) -> float:
        return self.working / self.num_steps if self.num_steps else 0.0


def slot_steps(records: Sequence[StepRecord], num_slots: int | None = None) -> SlotSteps:
    """Count working and idle slot-steps; ``num_slots`` defaults to the trace's own."""
    slots = num_slots or max((r.num_slots for r in records), default=0)
    working = sum(len(r.entries) for r in records)
    idle = sum(len(r.idle_slots) for r in records)
    return SlotSteps(len(records), slots, working, idle)


@dataclass(frozen=True, slots=True)
class RequestLatency:
    """One request's latencies in seconds; TPOT is None for single-token outputs."""

    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    ttft_s: float
    tpot_s: float | None
    e2e_s: float


def request_latency(
    request_id: str,
    num_prompt_tokens: int,
    num_output_tokens: int,
    arrival: float,
    first_token: float,
    finished: float,
) -> RequestLatency:
    tpot = (finished - first_token) / (num_output_tokens - 1) if num_output_tokens > 1 else None
    return RequestLatency(
        request_id,
        num_prompt_tokens,
        num_output_tokens,
        first_token - arrival,
        tpot,
        finished - arrival,
    )


@dataclass(frozen=True, slots=True)
class Distribution:
    """Summary of a latency distribution, in seconds."""

    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution | None:
        if not values:
            return None
        ordered = sorted(values)
        return cls(
            statistics.fmean(ordered),
            _quantile(ordered, 0.5),
            _quantile(ordered, 0.9),
            _quantile(ordered, 0.99),
            ordered[-1],
        )


def _quantile(ordered: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass
class BenchReport:
    """Everything one benchmark run measured; ``to_json`` is the file format."""

    label: str  # e.g. "inflight continuous", "transformers static"
    engine: str  # "inflight" or "transformers"
    batching: str  # "continuous" or "static"
    workload: str
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    wall_time_s: float
    num_steps: int
    num_preemptions: int
    max_num_seqs: int
    slots: SlotSteps
    peak_rss_mib: float
    ttft: Distribution | None
    tpot: Distribution | None
    options: dict = field(default_factory=dict)
    requests: list[RequestLatency] = field(default_factory=list)
    trace_path: str | None = None
    # Prompt tokens whose KV came from the prefix cache, and the tokens the model ran in
    # prefill chunks (prompt - cached, plus any recomputation after preemption).
    num_cached_tokens: int = 0
    num_prefill_tokens_computed: int = 0
    # with --profile: machine peaks and each kernel against its roofline (bench/roofline.py)
    kernel_bounds: dict | None = None
    # with --module-times: each module kind's self time (bench/module_times.py)
    module_times: list | None = None

    @property
    def cached_share(self) -> float:
        """The share of prompt tokens the prefix cache supplied."""
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.wall_time_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_time_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.num_prompt_tokens + self.num_output_tokens) / self.wall_time_s

    def to_json(self) -> dict:
        row = asdict(self)
        row["slots"] = {
            **row["slots"],
            "empty": self.slots.empty,
            "utilisation": self.slots.utilisation,
            "idle_share": self.slots.idle_share,
            "mean_batch_size": self.slots.mean_batch_size,
        }
        row.update(
            requests_per_s=self.requests_per_s,
            output_tokens_per_s=self.output_tokens_per_s,
            total_tokens_per_s=self.total_tokens_per_s,
            cached_share=self.cached_share,
        )
        return row


def peak_rss_mib() -> float:
    """This process's peak resident set size so far (model loading included)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024  # bytes vs KiB


# ---------------------------------------------------------------- printing and saving

_ROWS: list[tuple[str, str]] = [
    ("requests", "{r.num_requests}"),
    ("prompt / output tokens", "{r.num_prompt_tokens} / {r.num_output_tokens}"),
    ("wall time (s)", "{r.wall_time_s:.2f}"),
    ("requests/s", "{r.requests_per_s:.3f}"),
    ("output tokens/s", "{r.output_tokens_per_s:.1f}"),
    ("total tokens/s", "{r.total_tokens_per_s:.1f}"),
    ("prefill tokens computed", "{r.num_prefill_tokens_computed}"),
    ("prompt tokens cached", "{r.num_cached_tokens} ({r.cached_share:.1%})"),
    ("steps", "{r.num_steps}"),
    ("preemptions", "{r.num_preemptions}"),
    ("mean batch size", "{r.slots.mean_batch_size:.2f}"),
    ("slot utilisation", "{r.slots.utilisation:.1%}"),
    ("idle slot-steps (held, no work)", "{r.slots.idle_share:.1%}"),
    ("TTFT mean / p99 (s)", "{ttft}"),
    ("TPOT mean / p99 (ms)", "{tpot}"),
    ("peak RSS (MiB)", "{rss}"),
]


def format_table(reports: Sequence[BenchReport]) -> str:
    """One column per run, one row per measure, plus ratios against the first run."""
    header = ["", *[r.label for r in reports]]
    rows = [header]
    for name, template in _ROWS:
        cells = [name]
        for r in reports:
            ttft = f"{r.ttft.mean:.2f} / {r.ttft.p99:.2f}" if r.ttft else "-"
            tpot = f"{r.tpot.mean * 1e3:.1f} / {r.tpot.p99 * 1e3:.1f}" if r.tpot else "-"
            # A simulated run loads nothing: its 0 is "not measured", not a figure.
            rss = f"{r.peak_rss_mib:.0f}" if r.peak_rss_mib else "-"
            cells.append(template.format(r=r, ttft=ttft, tpot=tpot, rss=rss))
        rows.append(cells)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(
            c.rjust(w) if i else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class Ratio:
    """Output tokens/s of one run over another's; on the same workload it is also the
    ratio of their wall times, since both produce the same tokens."""

    numerator: str
    denominator: str
    output_tokens_per_s: float


def ratios(reports: Sequence[BenchReport]) -> list[Ratio]:
    """inflight continuous against every other run on the same workload."""
    best = next((r for r in reports if r.engine == "inflight" and r.batching == "continuous"), None)
    if best is None:
        return []
    return [
        Ratio(best.label, other.label, best.output_tokens_per_s / other.output_tokens_per_s)
        for other in reports
        if other is not best
    ]


def format_ratios(items: Sequence[Ratio]) -> str:
    return "\n".join(
        f"{r.numerator} / {r.denominator}: {r.output_tokens_per_s:.2f}x output tokens/s"
        for r in items
    )


def write_json(
    path: str | Path, workload: str, reports: Sequence[BenchReport], command: str | None
) -> None:
    payload = {
        "workload": workload,
        "command": command,
        "runs": [r.to_json() for r in reports],
        "ratios": [asdict(r) for r in ratios(reports)],
    }
    Path(path).write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")


# ---------------------------------------------------------------- latencies from a trace


def latencies_from_trace(records: Sequence[StepRecord]) -> list[RequestLatency]:
    """Per-request TTFT and TPOT from a step trace alone (what ``inflight plot`` draws).

    Arrival is taken as the start of the first step: right for offline runs, where every
    request is added before the first step. A step's end (start + duration) is when the
    engine stamps that step's tokens. A step yields a token for a request when it decodes,
    or when its prefill chunk is the last one: the request decodes next, or finishes in
    that step. (After a preemption the recomputed prompt's last chunk is not recognised
    as the end of a prefill unless a decode follows; counts stay right.)
    """
    if not records:
        return []
    origin = records[0].start_time
    ends = [r.start_time + r.duration_s - origin for r in records]
    finished_at = {rid: i for i, r in enumerate(records) for rid in r.finished}
    seen: dict[str, list[tuple[int, str, int]]] = {}
    for i, record in enumerate(records):
        for e in record.entries:
            seen.setdefault(e.request_id, []).append((i, e.kind, e.num_tokens))
    latencies = []
    for rid, steps in seen.items():
        if rid not in finished_at:
            continue  # still running when the trace ended
        token_steps: list[int] = []
        prompt_tokens = 0
        for k, (i, kind, num_tokens) in enumerate(steps):
            if kind == "decode":
                token_steps.append(i)
                continue
            if not token_steps:
                prompt_tokens += num_tokens
            next_kind = steps[k + 1][1] if k + 1 < len(steps) else None
            if next_kind == "decode" or finished_at[rid] == i:
                token_steps.append(i)
        if token_steps:
            latencies.append(
                request_latency(
                    rid,
                    prompt_tokens,
                    len(token_steps),
                    0.0,
                    ends[token_steps[0]],
                    ends[token_steps[-1]],
                )
            )
    return latencies
