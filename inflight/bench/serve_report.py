"""The report of ``inflight bench serve``: what one request measured
(:class:`RequestResult`), the run's summary (throughput; mean / median / P95 / P99 of
TTFT, TPOT, ITL and end-to-end latency) and its text table, laid out as vLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MS = 1000.0


@dataclass(slots=True)
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds from sending to the first streamed token
    latency: float = 0.0  # seconds from sending to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens, when reported
    # The generated ids (only when asked for with return_token_ids) and the prompt sent.
    output_token_ids: list[int] = field(default_factory=list)
    prompt: str | list[int] | None = None

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def _stats(name: str, values_s: list[float]) -> dict[str, float]:
    import numpy as np

    values = np.asarray(values_s, dtype=float) * MS if values_s else np.zeros(1)
    return {
        f"mean_{name}_ms": float(values.mean()),
        f"median_{name}_ms": float(np.median(values)),
        f"std_{name}_ms": float(values.std()),
        f"p95_{name}_ms": float(np.percentile(values, 95)),
        f"p99_{name}_ms": float(np.percentile(values, 99)),
    }


def summarize(results: list[RequestResult], duration_s: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    cached_tokens = sum(r.cached_tokens for r in done)
    summary: dict[str, Any] = {
        "duration_s": duration_s,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "total_cached_tokens": cached_tokens,
        "prefill_tokens_computed": input_tokens - cached_tokens,
        "request_throughput": len(done) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
    }
    summary |= _stats("ttft", [r.ttft for r in done])
    summary |= _stats("tpot", [t for r in done if (t := r.tpot) is not None])
    summary |= _stats("itl", [gap for r in done for gap in r.itl])
    summary |= _stats("e2el", [r.latency for r in done])
    return summary


def format_report(summary: dict[str, Any]) -> str:
    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, value: Any, fmt: str = "") -> None:
        lines.append(f"{label:<44}{value:>16{fmt}}")

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Benchmark duration (s):", summary["duration_s"], ".2f")
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Prompt tokens cached (server-reported):", summary["total_cached_tokens"])
    row("Prefill tokens computed:", summary["prefill_tokens_computed"])
    row("Request throughput (req/s):", summary["request_throughput"], ".3f")
    row("Output token throughput (tok/s):", summary["output_throughput"], ".2f")
    row("Total token throughput (tok/s):", summary["total_token_throughput"], ".2f")
    titles = {
        "ttft": "Time to First Token",
        "tpot": "Time per Output Token (excl. 1st token)",
        "itl": "Inter-token Latency",
        "e2el": "End-to-end Latency",
    }
    for key, title in titles.items():
        lines.append("{s:{c}^60}".format(s=f" {title} ", c="-"))
        for stat, name in (("mean", "Mean"), ("median", "Median"), ("p95", "P95"), ("p99", "P99")):
            row(f"{name} {key.upper()} (ms):", summary[f"{stat}_{key}_ms"], ".2f")
    lines.append("=" * 60)
    return "\n".join(lines)
