"""Validation: replay a workload on the real engine and in simulation, compare percentiles.

The real replay drives the offline engine (``LLMEngine``, no HTTP) in real time: each
request is added when its ``arrival_s`` has passed, with that moment as its arrival, and
each token is timed by the engine's own stamp. The simulation gets the very same engine
configuration (KV blocks included) and workload. Both are summarised by ``inflight bench
serve``'s function, so every TTFT / TPOT / ITL / E2E statistic can be compared as
``(predicted - measured) / measured``.

    python -m inflight.planner.validate --workload online --rates 0.25,0.5 --num-prompts 30
    inflight simulate --validate --workload online --sweep request_rate=0.25,0.5 ...
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from inflight.bench.workloads import Workload
from inflight.engine.step_trace import StepRecord
from inflight.planner.cost_model import CostModel, FitError, features_from_trace, score
from inflight.planner.simulator import SimRequest, serve_summary, simulate

STATS = ("mean", "median", "p95", "p99")
METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RealRun:
    requests: list[SimRequest]
    records: list[StepRecord]
    duration_s: float
    num_preemptions: int

    def summary(self) -> dict[str, Any]:
        out = serve_summary(self.requests, self.duration_s)
        out.update(num_steps=len(self.records), num_preemptions=self.num_preemptions)
        return out


def replay_real(engine: Any, workload: Workload) -> RealRun:
    """Run ``workload`` on a live ``LLMEngine`` (trace on) with real-time arrivals."""
    from inflight.sampling_params import SamplingParams

    engine.step_trace.clear()
    preemptions_before = engine.scheduler.num_preemptions
    pending = sorted(workload.requests, key=lambda r: r.arrival_s)
    timings: dict[str, SimRequest] = {}
    start = time.monotonic()
    index = 0
    while index < len(pending) or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while index < len(pending) and pending[index].arrival_s <= now:
            item = pending[index]
            request_id = f"v{item.id}"
            params = SamplingParams(
                temperature=0.0, max_tokens=item.max_tokens, ignore_eos=True, detokenize=False
            )
            engine.add_request(
                request_id, {"prompt_token_ids": item.prompt_token_ids}, params,
                arrival_time=start + item.arrival_s, stream=True,
            )
            timings[request_id] = SimRequest(request_id, item.arrival_s, len(item.prompt_token_ids))
            index += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[index].arrival_s - (time.monotonic() - start)))
            continue
        for output in engine.step():
            sim = timings[output.request_id]
            stamp = output.metrics.last_token_time - start
            new = len(output.outputs[0].token_ids) - len(sim.token_times)
            sim.token_times.extend([stamp] * new)
    requests = [timings[f"v{r.id}"] for r in workload.requests]
    for sim, item in zip(requests, workload.requests, strict=True):
        if len(sim.token_times) != item.max_tokens:
            raise RuntimeError(f"request {item.id} produced {len(sim.token_times)} tokens, "
                               f"expected {item.max_tokens}")
    duration = max(r.token_times[-1] for r in requests)
    return RealRun(requests, list(engine.step_trace.records), duration,
                   engine.scheduler.num_preemptions - preemptions_before)


def sim_options_of(engine: Any) -> dict[str, Any]:
    """The simulator options that reproduce a live engine's configuration exactly."""
    config = engine.config
    return {
        "max_num_seqs": config.scheduler.max_num_seqs,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "max_model_len": engine.max_model_len,
        "enable_chunked_prefill": config.scheduler.enable_chunked_prefill,
        "scheduling_policy": config.scheduler.scheduling_policy,
        "batching": config.scheduler.batching,
        "block_size": config.cache.block_size,
        "num_kv_blocks": engine.kv_cache.num_blocks,
        "enable_prefix_caching": config.cache.enable_prefix_caching,
    }


@dataclass
class Comparison:
    label: str
    measured: dict[str, Any]
    predicted: dict[str, Any]
    step_error: FitError  # the cost model scored on the real run's own steps
    real_records: list[StepRecord] = field(default_factory=list)

    def error(self, key: str) -> float:
        measured = self.measured[key]
        return (self.predicted[key] - measured) / measured if measured else float("nan")

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "measured": self.measured,
            "predicted": self.predicted,
            "errors": {f"{s}_{m}_ms": self.error(f"{s}_{m}_ms") for m in METRICS for s in STATS},
            "step_error": asdict(self.step_error),
        }


def compare(label: str, engine: Any, workload: Workload, cost: CostModel) -> Comparison:
    real = replay_real(engine, workload)
    sim = simulate(workload, cost, **sim_options_of(engine))
    step_error = score(
        cost, features_from_trace(real.records), [r.duration_s for r in real.records]
    )
    return Comparison(label, real.summary(), sim.serve_summary(), step_error, real.records)


def format_comparison(c: Comparison) -> str:
    lines = [f"== {c.label}: measured vs simulated (ms; error = (sim - real) / real)"]
    lines.append(f"{'':14}{'measured':>12}{'simulated':>12}{'error':>9}")
    for metric in METRICS:
        for stat in STATS:
            key = f"{stat}_{metric}_ms"
            lines.append(
                f"{stat + ' ' + metric.upper():14}{c.measured[key]:12.1f}"
                f"{c.predicted[key]:12.1f}{c.error(key):+9.1%}"
            )
    for key in ("duration_s", "output_throughput", "num_steps", "num_preemptions"):
        m, p = c.measured[key], c.predicted[key]
        lines.append(f"{key:20}{m:12.2f}{p:12.2f}")
    e = c.step_error
    lines.append(
        f"cost model on the real run's {e.num_steps} steps: mean abs error "
        f"{e.mean_abs_error_ms:.1f} ms ({e.mean_abs_pct_error:.1%}), total time "
        f"{e.total_time_error:+.1%}"
    )
    return "\n".join(lines)


def validate(
    workload_spec: Any,  # sweep.WorkloadSpec
    rates: Sequence[float | None],
    cost: CostModel,
    model: str | None,
    options: dict[str, Any],
    threads: int | None = None,
    on_result: Callable[[list[Comparison]], None] | None = None,
) -> list[Comparison]:
    """Load the model once, then compare real and simulated runs at each rate;
    ``on_result`` sees the comparisons so far after each (so a cut-short run keeps them)."""
    from inflight import LLM
    from inflight.bench.engine_run import set_threads
    from inflight.bench.workloads import fit_to_vocab

    set_threads(threads)
    engine = LLM(model, **{**options, "record_trace": True}).llm_engine
    engine.populate_kv_cache()
    warm = workload_spec.build(None).requests[0]
    engine.add_request("warmup", {"prompt_token_ids": list(warm.prompt_token_ids[:16])},
                       _greedy(4))
    while engine.has_unfinished_requests():
        engine.step()
    comparisons = []
    for rate in rates:
        workload, _ = fit_to_vocab(workload_spec.build(rate), engine.vocab_size)
        engine.reset_prefix_cache()  # each rate starts cold, as the simulation does
        label = f"{workload.name}" + (f" at {rate:g} req/s" if rate is not None else "")
        comparisons.append(compare(label, engine, workload, cost))
        print(format_comparison(comparisons[-1]), flush=True)
        if on_result is not None:
            on_result(comparisons)
    return comparisons


def _greedy(max_tokens: int) -> Any:
    from inflight.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                          detokenize=False)


def write_json(path: str | Path, comparisons: Sequence[Comparison], cost: CostModel) -> Path:
    from inflight.cpu_info import cpu_model_name

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "machine": cpu_model_name(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cost_model": cost.to_json(),
        "runs": [c.to_json() for c in comparisons],
    }
    path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m inflight.planner.validate``: the same as ``inflight simulate --validate``."""
    from inflight.planner.cli import build_simulate_parser, run_simulate

    parser = argparse.ArgumentParser(prog="python -m inflight.planner.validate")
    build_simulate_parser(parser)
    args = parser.parse_args(argv)
    args.validate = True
    return run_simulate(args)


if __name__ == "__main__":
    sys.exit(main())
