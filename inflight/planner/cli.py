"""``inflight calibrate`` and ``inflight simulate``: the capacity planner's commands.

    inflight calibrate                                  # ~1 min on the default model
    inflight calibrate --from-trace trace.jsonl         # a trace from any machine
    inflight simulate --workload seed8 --compare
    inflight simulate --workload online --sweep request_rate=0.25,0.5,1,2 --ttft-slo 2
    inflight simulate --workload mixed --sweep max_num_seqs=8,16,32,64 --compare
    inflight simulate --validate --workload online --sweep request_rate=0.25,0.5 --num-prompts 30

This module owns argument parsing only; the work lives in ``calibrate``, ``simulator``,
``sweep`` and ``validate``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from inflight.bench.cli_types import int_at_least, ints_at_least, seconds
from inflight.bench.workloads import rate_arg
from inflight.config import BATCHING_MODES, DEFAULT_BLOCK_SIZE, SCHEDULING_POLICIES
from inflight.entrypoints.engine_args import DTYPES, human_readable_int, max_model_len_arg
from inflight.output_paths import prepare_output_dir, prepare_output_file

DEFAULT_OUTPUT_DIR = "planner-results"


def register(subparsers: argparse._SubParsersAction) -> None:
    calibrate = subparsers.add_parser(
        "calibrate",
        help="fit the step cost model from a short sweep on the real model (or a trace)",
        description="Time engine steps of known shapes (decode batches, prompt chunks, "
        "context lengths) and fit step time = a + b*prefill tokens + ... by least squares; "
        "saves the fit with its error on held-out steps.",
    )
    build_calibrate_parser(calibrate)
    simulate = subparsers.add_parser(
        "simulate",
        help="predict latency and throughput of a workload by replaying it through the "
        "real scheduler on a virtual clock",
        description="Drive the real Scheduler and KV cache manager with a fake model whose "
        "steps last what the calibrated cost model says; report what 'inflight bench "
        "serve' reports.",
    )
    build_simulate_parser(simulate)


# ---------------------------------------------------------------------- calibrate


def build_calibrate_parser(parser: argparse.ArgumentParser) -> None:
    from inflight.entrypoints.engine_args import add_engine_args
    from inflight.planner.calibrate import CalibrationPlan
    from inflight.planner.cost_model import default_calibration_path

    plan = CalibrationPlan()
    group = parser.add_argument_group("calibration")
    group.add_argument(
        "--from-trace", default=None, metavar="TRACE.jsonl",
        help="fit a step trace (LLM(record_trace=True), inflight generate --trace, bench) "
        "instead of running the model",
    )
    group.add_argument(
        "--output", default=None,
        help=f"where to save the fit (default: {default_calibration_path()}, which "
        "'inflight simulate' uses without --cost)",
    )
    group.add_argument("--trace-out", default=None, help="also save the sweep's step trace")
    group.add_argument("--batch-sizes", type=ints_at_least(1), default=_csv(plan.batch_sizes),
                       help="decode batch sizes (default: %(default)s)")
    group.add_argument("--context-lens", type=ints_at_least(1), default=_csv(plan.context_lens),
                       help="prompt lengths of the decode batches (default: %(default)s)")
    group.add_argument("--prefill-lens", type=ints_at_least(1), default=_csv(plan.prefill_lens),
                       help="lengths of single prompts, chunked by the budget (default: %(default)s)")
    group.add_argument("--decode-steps", type=int_at_least(1), default=plan.decode_steps,
                       help="output tokens per decode-batch request (default: %(default)s)")
    group.add_argument("--max-prompt-tokens", type=int_at_least(1), default=plan.max_prompt_tokens,
                       help="skip decode batches with more prompt tokens (default: %(default)s)")
    group.add_argument("--skip-steps", type=int_at_least(0), default=0,
                       help="with --from-trace: ignore the trace's first N steps (warm-up)")
    group.add_argument("--kv-bytes-per-token", type=int_at_least(1), default=None,
                       help="with --from-trace: the traced model's KV bytes per token "
                       "(default: SmolLM2-135M in bfloat16)")
    group.add_argument("--threads", type=int_at_least(1), default=None, help="torch threads")
    add_engine_args(parser)
    parser.set_defaults(handler=run_calibrate)


def _or(value: int | None, default: int) -> int:
    """``value`` unless it was not given (0 is a value, refused later, not the default)."""
    return default if value is None else value


def _csv(values: tuple[int, ...]) -> str:
    return ",".join(str(v) for v in values)


def run_calibrate(args: argparse.Namespace) -> int:
    from inflight.engine.step_trace import StepTrace
    from inflight.planner.calibrate import CalibrationPlan, calibrate
    from inflight.planner.cost_model import (
        SMOLLM2_KV_BYTES_PER_TOKEN,
        SMOLLM2_MAX_MODEL_LEN,
        default_calibration_path,
        fit_trace,
    )

    output = prepare_output_file(args.output or default_calibration_path(), "--output")
    if args.trace_out:
        prepare_output_file(args.trace_out, "--trace-out")
    if args.from_trace:
        records = StepTrace.read_jsonl(args.from_trace)
        cost = fit_trace(
            records, source=f"trace {args.from_trace}", skip_steps=args.skip_steps,
            kv_bytes_per_token=_or(args.kv_bytes_per_token, SMOLLM2_KV_BYTES_PER_TOKEN),
            max_model_len=_or(args.max_model_len, SMOLLM2_MAX_MODEL_LEN),
            info={"trace": str(args.from_trace), "num_steps": len(records)},
        )
    else:
        from inflight.entrypoints.engine_args import engine_options

        plan = CalibrationPlan(
            batch_sizes=args.batch_sizes, context_lens=args.context_lens,
            prefill_lens=args.prefill_lens, decode_steps=args.decode_steps,
            max_prompt_tokens=args.max_prompt_tokens,
        )
        print("calibrating: timing engine steps of known shapes ...", file=sys.stderr, flush=True)
        cost, records = calibrate(args.model, engine_options(args), plan, args.threads)
        if args.trace_out:
            StepTrace(enabled=True, records=records).write_jsonl(args.trace_out)
    path = cost.save(output)
    print(cost.describe())
    if warning := cost.fit_warning():
        print(warning, file=sys.stderr)
    print(f"fitted on {cost.num_fit_steps} steps; saved: {path}")
    return 0


# ---------------------------------------------------------------------- simulate


def build_simulate_parser(parser: argparse.ArgumentParser) -> None:
    source = parser.add_argument_group("workload")
    source.add_argument("--workload", required=True,
                        help="seed8, mixed, online, or a JSONL file (id, prompt_token_ids, "
                        "max_tokens, arrival_s); seed8 defaults to --max-num-seqs 8")
    source.add_argument("--request-rate", "--rate", dest="request_rate", type=rate_arg,
                        default=None,
                        help="arrival rate in req/s (online: its rate; other workloads: "
                        "Poisson arrivals); default: the workload's own arrival_s")
    source.add_argument("--num-prompts", type=int, default=None, help="the first N requests")
    source.add_argument("--repeat", type=int, default=1, help="N back-to-back copies")
    source.add_argument("--seed", type=int, default=0, help="seed of Poisson re-timing")
    model = parser.add_argument_group("cost model")
    model.add_argument("--cost", default=None, metavar="CALIBRATION.json",
                       help="a fit from 'inflight calibrate' (default: this machine's last "
                       "calibration, else the built-in SmolLM2 model)")
    engine = parser.add_argument_group("engine (as 'inflight serve')")
    engine.add_argument("--max-num-seqs", type=int, default=None,
                        help="default: 64 (seed8: 8)")
    engine.add_argument("--max-num-batched-tokens", type=human_readable_int, default=None)
    engine.add_argument("--max-model-len", type=max_model_len_arg, default=None,
                        help="as 'inflight serve' reads it (4k, 4K; -1 or auto); default: "
                        "the calibrated model's context length")
    engine.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    engine.add_argument("--num-kv-blocks", type=int, default=None)
    engine.add_argument("--kv-cache-memory-bytes", type=human_readable_int, default=None)
    engine.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill",
                        action="store_false", default=True)
    engine.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                        action="store_false", default=True)
    engine.add_argument("--scheduling-policy", default="fcfs", choices=list(SCHEDULING_POLICIES))
    engine.add_argument("--batching", default="continuous", choices=list(BATCHING_MODES))
    runs = parser.add_argument_group("runs")
    runs.add_argument("--compare", action="store_true",
                      help="simulate static and continuous batching side by side")
    runs.add_argument("--sweep", default=None, metavar="KEY=V1,V2,...",
                      help="request_rate or an engine option (max_num_seqs, "
                      "max_num_batched_tokens, num_kv_blocks, ...)")
    runs.add_argument("--ttft-slo", type=seconds(), default=None, metavar="SECONDS",
                      help="P99 TTFT target: the sweep's knee is where it breaks")
    runs.add_argument("--output-dir", default=None,
                      help=f"results JSON, traces and pictures (default: {DEFAULT_OUTPUT_DIR}/W)")
    runs.add_argument("--no-plots", dest="plots", action="store_false", default=True)
    check = parser.add_argument_group("validation (runs the real model)")
    check.add_argument("--validate", action="store_true",
                       help="replay the workload on the real engine too and report each "
                       "percentile's error (rates: --sweep request_rate=... or --request-rate)")
    check.add_argument("--model", default=None, help="model to validate against (default model)")
    check.add_argument("--dtype", default="auto", choices=DTYPES)
    check.add_argument("--device", default="auto")
    check.add_argument("--threads", type=int_at_least(1), default=None, help="torch threads")
    parser.set_defaults(handler=run_simulate)


def sim_options(args: argparse.Namespace) -> dict[str, Any]:
    from inflight.bench.throughput import WORKLOAD_PRESETS

    options: dict[str, Any] = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "block_size": args.block_size,
        "num_kv_blocks": args.num_kv_blocks,
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "enable_chunked_prefill": args.enable_chunked_prefill,
        "enable_prefix_caching": args.enable_prefix_caching,
        "scheduling_policy": args.scheduling_policy,
        "batching": args.batching,
    }
    for key, value in WORKLOAD_PRESETS.get(args.workload, {}).items():
        if options.get(key) is None:
            options[key] = value
    return options


def run_simulate(args: argparse.Namespace) -> int:
    from inflight.planner.cost_model import load_cost_model
    from inflight.planner.sweep import WorkloadSpec

    cost = load_cost_model(args.cost)
    print(f"cost model: {cost.source}", file=sys.stderr)
    if warning := cost.fit_warning():
        print(warning, file=sys.stderr)
    spec = WorkloadSpec(args.workload, args.num_prompts, args.repeat, args.seed)
    options = sim_options(args)
    modes = ["static", "continuous"] if args.compare else [args.batching]
    out_dir = Path(args.output_dir or Path(DEFAULT_OUTPUT_DIR) / _safe(Path(args.workload).stem))
    prepare_output_dir(out_dir, "--output-dir")  # before the runs, not after them
    if args.validate:
        return _validate(args, spec, cost, options, out_dir)
    if args.sweep:
        return _sweep(args, spec, cost, options, modes, out_dir)
    return _single(args, spec, cost, options, modes, out_dir)


def _single(args: argparse.Namespace, spec: Any, cost: Any, options: dict[str, Any],
            modes: list[str], out_dir: Path) -> int:
    from inflight.bench.report import format_table
    from inflight.bench.serve import format_report
    from inflight.engine.step_trace import StepTrace
    from inflight.planner.simulator import simulate

    workload = spec.build(args.request_rate)
    results = [simulate(workload, cost, **{**options, "batching": m}) for m in modes]
    out_dir.mkdir(parents=True, exist_ok=True)
    for result in results:
        summary = result.serve_summary()
        if note := result.refusal_note():
            print(f"note: {result.label}: {note}", file=sys.stderr)
        print(f"\n{result.label}: {workload.name}, {len(workload.requests)} requests")
        print(format_report(summary))
        print(
            f"steps {summary['num_steps']}, preemptions {summary['num_preemptions']}, KV usage "
            f"peak {summary['kv_usage_peak']:.1%} / mean {summary['kv_usage_mean']:.1%} of "
            f"{summary['num_kv_blocks']} blocks; simulated {result.busy_s:.1f} s of engine "
            f"time in {result.sim_wall_s:.2f} s ({result.speedup:.0f}x)"
        )
        name = result.config.scheduler.batching
        StepTrace(enabled=True, records=result.records).write_jsonl(out_dir / f"trace_simulated_{name}.jsonl")
    reports = [r.bench_report() for r in results]
    print()
    print(format_table(reports))
    for report in reports:
        if report.batching == "static":
            s = report.slots
            print(f"{report.label}: {s.working} of {s.total} slot-steps did work; "
                  f"{s.idle_share:.1%} were held idle by finished requests")
    payload = {
        "workload": workload.name,
        "cost_model": cost.to_json(),
        "runs": [
            {"label": r.label, "config": r.config.describe(), "serve": r.serve_summary(),
             "bench": rep.to_json()}
            for r, rep in zip(results, reports, strict=True)
        ],
    }
    path = out_dir / "simulation.json"
    path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    print(f"\nresults: {path}")
    if args.plots:
        from inflight.bench.plots import LabelledTrace, draw_all

        traces = [LabelledTrace(r.label, r.records) for r in results]
        for picture in draw_all(traces, out_dir, reports):
            print(f"picture: {picture}")
    return 0


def _sweep(args: argparse.Namespace, spec: Any, cost: Any, options: dict[str, Any],
           modes: list[str], out_dir: Path) -> int:
    from inflight.planner.sweep import (
        describe_knees,
        format_sweep_table,
        parse_sweep,
        plot_sweep,
        run_sweep,
    )

    key, values = parse_sweep(args.sweep)
    points = run_sweep(spec, key, values, cost, options, modes, args.request_rate)
    for p in points:
        if p.note:
            print(f"note: {p.batching}, {key}={p.value:g}: {p.note}", file=sys.stderr)
    print(format_sweep_table(points, key, args.ttft_slo))
    if args.ttft_slo is not None:
        print()
        print("\n".join(describe_knees(points, key, args.ttft_slo)))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"sweep_{key}.json"
    payload = {
        "workload": args.workload, "sweep": key, "ttft_slo_s": args.ttft_slo,
        "cost_model": cost.to_json(),
        "points": [{"value": p.value, "batching": p.batching, **p.summary} for p in points],
    }
    path.write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    print(f"\nresults: {path}")
    if args.plots:
        picture = plot_sweep(points, key, args.ttft_slo, out_dir / f"sweep_{key}.png",
                             f"{args.workload}: simulated latency vs {key}")
        print(f"picture: {picture}")
    return 0


def _validate(args: argparse.Namespace, spec: Any, cost: Any, options: dict[str, Any],
              out_dir: Path) -> int:
    from inflight.planner.sweep import RATE_KEY, parse_sweep
    from inflight.planner.validate import validate, write_json

    rates: list[float | None] = [args.request_rate]
    if args.sweep:
        key, values = parse_sweep(args.sweep)
        if key != RATE_KEY:
            raise ValueError("--validate sweeps only request_rate")
        rates = list(values)
    engine_options = {k: v for k, v in options.items() if v is not None}
    engine_options.update(dtype=args.dtype, device=args.device)
    def save(comparisons: list[Any]) -> None:
        from inflight.engine.step_trace import StepTrace

        path = write_json(out_dir / "validation.json", comparisons, cost)
        last = comparisons[-1]
        trace = out_dir / f"trace_real_{len(comparisons)}.jsonl"
        StepTrace(enabled=True, records=last.real_records).write_jsonl(trace)
        print(f"results so far: {path}; the real run's step trace: {trace}", flush=True)

    validate(spec, rates, cost, args.model, engine_options, args.threads, on_result=save)
    return 0


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in name) or "workload"
