"""``inflight bench throughput``: offline throughput of a workload, static vs continuous.

    inflight bench throughput --workload seed8 --compare          # the source's example
    inflight bench throughput --workload mixed --num-prompts 40 --compare --hf-baseline
    inflight bench throughput --input-len 256 --output-len 128 --num-prompts 64
    inflight bench throughput --workload multi-turn --compare-prefix-caching

This module owns the command: choosing the workload and the runs, running each in its own
process (so each peak RSS is its own), and writing the results: a table and the ratios on
stdout, and ``results.json``, one step trace per run and the pictures in one folder.
The runs themselves live in ``engine_run`` (inflight) and ``hf_baseline`` (transformers).
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inflight.bench.cli_types import fraction, int_at_least
from inflight.bench.workloads import rate_arg

# Workload-specific engine defaults, applied only where the user gave no value: the
# source document's example is about a batch of 8 slots.
WORKLOAD_PRESETS: dict[str, dict[str, Any]] = {"seed8": {"max_num_seqs": 8}}
DEFAULT_SYNTHETIC_PROMPTS = 64
RESULTS_DIR = "bench-results"


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    from inflight.bench.lock import add_lock_args
    from inflight.entrypoints.engine_args import add_engine_args

    parser = bench_subparsers.add_parser(
        "throughput",
        help="offline throughput of a workload; static vs continuous batching",
        description="Run a workload through the offline engine and report throughput, "
        "schedule statistics, latency and peak RSS; greedy, EOS ignored.",
    )
    source = parser.add_argument_group("workload")
    source.add_argument(
        "--workload",
        default=None,
        help="seed8, mixed, online, single (seed8's first prompt, 256 new tokens), "
        "shared-prefix (64 requests sharing a 512-token system prompt), multi-turn (16 "
        "chats of 5 turns, each turn sent after the previous answer), or a JSONL file (id, "
        "prompt_token_ids, max_tokens, arrival_s[, after, think_s]); arrival and think "
        "times are ignored offline; seed8 defaults to --max-num-seqs 8",
    )
    source.add_argument(
        "--rate",
        type=rate_arg,
        default=None,
        help="arrival rate of the 'online' workload (only its token ids matter; default 4.0)",
    )
    source.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="run only the first N requests of the workload (or generate N)",
    )
    source.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run N back-to-back copies of the workload (more requests than slots)",
    )
    source.add_argument("--input-len", type=int, default=None, help="synthetic prompt length")
    source.add_argument("--output-len", type=int, default=None, help="synthetic output length")
    source.add_argument(
        "--range-ratio",
        "--random-range-ratio",
        dest="range_ratio",
        type=fraction,
        default=0.0,
        help="synthetic lengths uniform in len*[1-r, 1+r]",
    )
    runs = parser.add_argument_group("runs")
    runs.add_argument(
        "--compare",
        action="store_true",
        help="run both static and continuous batching (ignores --batching)",
    )
    runs.add_argument(
        "--compare-prefix-caching",
        action="store_true",
        help="run inflight twice, prefix caching on and off (overrides "
        "--[no-]enable-prefix-caching), and compare prefill tokens computed",
    )
    runs.add_argument(
        "--hf-baseline",
        action="store_true",
        help="also run transformers' generate in static padded batches",
    )
    runs.add_argument(
        "--hf-batch-size",
        type=int,
        default=None,
        help="transformers batch size (default: max-num-seqs)",
    )
    runs.add_argument(
        "--threads",
        type=int_at_least(1),
        default=None,
        help="torch threads per run (default: torch's choice); 1 is steadier on a busy machine",
    )
    runs.add_argument("--no-warmup", dest="warmup", action="store_false", default=True)
    runs.add_argument(
        "--no-isolate",
        dest="isolate",
        action="store_false",
        default=True,
        help="run in this process (faster start; peak RSS is then shared)",
    )
    runs.add_argument(
        "--progress",
        action="store_true",
        help="show a progress bar for inflight's runs too (transformers' run shows one "
        "whenever stderr is a terminal)",
    )
    runs.add_argument(
        "--sampling-extras",
        action="store_true",
        help="every inflight request also asks for presence/frequency/repetition penalties "
        "and logprobs=5 (still greedy with EOS ignored): what those options cost",
    )
    runs.add_argument(
        "--profile",
        action="store_true",
        help="record inflight runs with torch's profiler; writes the per-op table next to "
        "the JSON (the step-phase breakdown is always reported)",
    )
    runs.add_argument(
        "--module-times",
        action="store_true",
        help="time each part of the model (linear layers, attention, MLP, norms) by forward "
        "hooks, without the profiler's overhead on small ops; the table goes with the "
        "profile's, next to the JSON",
    )
    out = parser.add_argument_group("output")
    out.add_argument(
        "--output-json",
        default=None,
        help=f"results file; traces and pictures go next to it "
        f"(default: {RESULTS_DIR}/WORKLOAD/results.json)",
    )
    out.add_argument("--no-plots", dest="plots", action="store_false", default=True)
    out.add_argument(
        "--dry-run",
        action="store_true",
        help="build the workload and the plan, print the runs and the files they would "
        "write, run nothing",
    )
    add_lock_args(parser)
    add_engine_args(parser)
    parser.set_defaults(handler=run, max_num_seqs=None)


@dataclass(frozen=True, slots=True)
class PlannedRun:
    engine: str  # "inflight" or "transformers"
    batching: str
    # inflight: force prefix caching on or off; None keeps --[no-]enable-prefix-caching
    prefix_caching: bool | None = None

    @property
    def name(self) -> str:
        suffix = "_no-prefix-caching" if self.prefix_caching is False else ""
        return f"{self.engine}_{self.batching}{suffix}"

    @property
    def trace_name(self) -> str:
        return f"trace_{self.name}.jsonl"

    @property
    def label_suffix(self) -> str:
        return ", no prefix caching" if self.prefix_caching is False else ""


def load_workload(args: argparse.Namespace) -> Any:  # -> Workload
    from inflight.bench import workloads

    if args.workload is not None:
        workload = workloads.resolve(args.workload, args.rate).head(args.num_prompts)
    elif args.input_len is not None and args.output_len is not None:
        workload = workloads.synthetic(
            args.num_prompts or DEFAULT_SYNTHETIC_PROMPTS,
            args.input_len,
            args.output_len,
            args.range_ratio,
            args.seed,
        )
    else:
        raise ValueError(
            "give --workload (seed8, mixed, online or a .jsonl file), or "
            "--input-len and --output-len for a synthetic workload"
        )
    return workload.repeat(args.repeat)


def plan_runs(args: argparse.Namespace) -> list[PlannedRun]:
    modes = ["static", "continuous"] if args.compare else [args.batching]
    caching: list[bool | None] = [True, False] if args.compare_prefix_caching else [None]
    planned = [PlannedRun("inflight", m, c) for c in caching for m in modes]
    if args.hf_baseline:
        planned.append(PlannedRun("transformers", "static"))
    return planned


def engine_options_for(args: argparse.Namespace, workload_spec: str | None) -> dict[str, Any]:
    from inflight.config import DEFAULT_MAX_NUM_SEQS
    from inflight.entrypoints.engine_args import engine_options

    options = engine_options(args)
    preset = WORKLOAD_PRESETS.get(workload_spec or "", {})
    for key, value in preset.items():
        if options.get(key) is None:
            options[key] = value
    if options["max_num_seqs"] is None:
        options["max_num_seqs"] = DEFAULT_MAX_NUM_SEQS
    return options


def _check_engine_options(args: argparse.Namespace, options: dict[str, Any]) -> None:
    """What the engine would refuse at start-up, refused by a dry run too (without
    loading the model)."""
    from inflight.config import make_engine_config
    from inflight.vllm_engine_args import take_vllm_only_args

    make_engine_config(args.model, **take_vllm_only_args(dict(options), args.model))


def output_path(args: argparse.Namespace, workload_name: str) -> Path:
    if args.output_json:
        return Path(args.output_json)
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", workload_name).strip("-")
    return Path(RESULTS_DIR) / safe / "results.json"


def execute(
    planned: PlannedRun, workload: Any, args: argparse.Namespace, options: dict[str, Any]
) -> Any:  # -> RunResult
    """One run, in a fresh process unless ``--no-isolate``."""
    from inflight.bench.engine_run import run_inflight, run_isolated
    from inflight.bench.hf_baseline import run_transformers

    if planned.engine == "transformers":
        fn: Any = run_transformers
        call_args: tuple = (workload, args.model, args.hf_batch_size or options["max_num_seqs"])
        kwargs: dict[str, Any] = {
            "warmup": args.warmup,
            "threads": args.threads,
            # minutes per batch on a CPU: a bar whenever stderr is a terminal
            "progress": True if args.progress else None,
        }
    else:
        fn = run_inflight
        run_options = {**options, "batching": planned.batching}
        if planned.prefix_caching is not None:
            run_options["enable_prefix_caching"] = planned.prefix_caching
        call_args = (workload, args.model, run_options)
        kwargs = {
            "warmup": args.warmup,
            "use_tqdm": args.progress,
            "threads": args.threads,
            "profile": args.profile,
            "sampling_extras": args.sampling_extras,
            "module_times": args.module_times,
        }
    return run_isolated(fn, *call_args, **kwargs) if args.isolate else fn(*call_args, **kwargs)


def run(args: argparse.Namespace) -> int:
    from inflight.bench.lock import bench_lock, lock_path
    from inflight.bench.plots import LabelledTrace, draw_all
    from inflight.bench.report import format_ratios, format_table, ratios, write_json

    workload = load_workload(args)
    if args.hf_baseline and workload.has_dependencies:
        raise ValueError(
            "--hf-baseline cannot run a multi-turn workload (its turns wait on answers)"
        )
    options = engine_options_for(args, args.workload)
    path = output_path(args, workload.name)
    print(
        f"workload {workload.name}: {len(workload.requests)} requests, "
        f"{workload.num_prompt_tokens} prompt + {workload.num_output_tokens} output tokens",
        file=sys.stderr,
    )

    if args.dry_run:
        _check_engine_options(args, options)
        print(_dry_run_plan(args, options, path))
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with bench_lock(lock_path(args)):
        results = [_run_one(planned, workload, args, options, path) for planned in plan_runs(args)]

    reports = [r.report for r in results]
    print(format_table(reports))
    if ratios(reports):
        print()
        print(format_ratios(ratios(reports)))
    for line in prefix_caching_lines(reports):
        print(line)
    for report in reports:
        if report.batching == "static":
            s = report.slots
            print(
                f"{report.label}: {s.working} of {s.total} slot-steps did work; "
                f"{s.idle_share:.1%} were held idle by finished requests"
            )
    write_json(path, workload.name, reports, _command_line())
    print(f"\nresults: {path}")
    if args.plots:
        traces = [LabelledTrace(r.report.label, r.records) for r in results]
        for picture in draw_all(traces, path.parent, reports):
            print(f"picture: {picture}")
    return 0


def _run_one(
    planned: PlannedRun,
    workload: Any,
    args: argparse.Namespace,
    options: dict[str, Any],
    path: Path,
) -> Any:  # -> RunResult
    """One timed run, its trace (and profile) written next to the results file."""
    from inflight.engine.step_trace import StepTrace

    print(f"running {planned.engine} {planned.batching} ...", file=sys.stderr, flush=True)
    result = execute(planned, workload, args, options)
    result.report.label += planned.label_suffix
    if result.folded_token_ids:
        print("note: token ids were folded into the model's vocabulary", file=sys.stderr)
    trace_path = path.parent / planned.trace_name
    StepTrace(enabled=True, records=result.records).write_jsonl(trace_path)
    result.report.trace_path = str(trace_path)
    step_ms = result.report.options.get("step_time_ms")
    if step_ms:
        print(_format_step_time(planned.batching, step_ms), file=sys.stderr)
    if result.profile_table:
        profile_path = path.parent / f"profile_{planned.name}.txt"
        profile_path.write_text(result.profile_table)
        print(result.profile_table, file=sys.stderr)
        print(f"profile: {profile_path}", file=sys.stderr)
    return result


def planned_files(args: argparse.Namespace, path: Path) -> list[Path]:
    """Every file a run with these arguments writes: results, traces, pictures."""
    from inflight.bench.plots import PICTURES

    planned = plan_runs(args)
    files = [path, *(path.parent / p.trace_name for p in planned)]
    if args.plots:
        files += [path.parent / name for name in (*PICTURES, "throughput.png")]
    if args.profile or args.module_times:
        files += [path.parent / f"profile_{p.name}.txt" for p in planned if p.engine == "inflight"]
    return files


def _dry_run_plan(args: argparse.Namespace, options: dict[str, Any], path: Path) -> str:
    runs = ", ".join(f"{p.engine} {p.batching}{p.label_suffix}" for p in plan_runs(args))
    lines = [f"dry run: would run {runs}", f"engine options: {options}", "would write:"]
    return "\n".join([*lines, *(f"  {f}" for f in planned_files(args, path))])


def prefix_caching_lines(reports: list[Any]) -> list[str]:  # reports: list[BenchReport]
    """For each run with caching off, its prefill tokens against the same batching's
    run with caching on: the machine-independent saving."""
    lines = []
    for off in reports:
        if off.engine != "inflight" or off.options.get("enable_prefix_caching", True):
            continue
        on = next(
            (
                r
                for r in reports
                if r.engine == "inflight"
                and r.batching == off.batching
                and r.options.get("enable_prefix_caching")
            ),
            None,
        )
        if on is None:
            continue
        saved = off.num_prefill_tokens_computed / max(on.num_prefill_tokens_computed, 1)
        lines.append(
            f"prefix caching ({on.batching}): {on.num_prefill_tokens_computed} prefill tokens "
            f"computed vs {off.num_prefill_tokens_computed} without ({saved:.2f}x less), "
            f"{on.cached_share:.1%} of prompt tokens cached; "
            f"{on.output_tokens_per_s / off.output_tokens_per_s:.2f}x output tokens/s"
        )
    return lines


def _format_step_time(batching: str, ms: dict[str, float]) -> str:
    """Where an average step's time went, host-side phases vs the model."""
    return (
        f"{batching}: per step {ms['forward_s']:.1f} ms forward, {ms['sample_s']:.1f} ms "
        f"sampling, {ms['host_overhead_s']:.1f} ms host overhead (schedule "
        f"{ms['schedule_s']:.1f}, inputs {ms['prepare_inputs_s']:.1f}, update "
        f"{ms['update_s']:.1f}, outputs {ms['outputs_s']:.1f})"
    )


def _command_line() -> str | None:
    """The command as typed, when this process is the ``inflight`` script."""
    if Path(sys.argv[0]).name != "inflight":
        return None
    return shlex.join(["inflight", *sys.argv[1:]])
