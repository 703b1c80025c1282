"""``inflight plot TRACE.jsonl [TRACE.jsonl ...]``: schedule pictures from saved step traces.

Any trace written by ``inflight generate --trace``, ``LLM.step_trace.write_jsonl`` or
``inflight bench throughput`` works; several traces are drawn side by side (stacked on one
step axis), e.g. the static and continuous runs of the same workload.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from inflight.output_paths import prepare_output_dir


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plot",
        help="draw schedule timeline, batch/KV and latency pictures from step traces",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument("traces", nargs="+", metavar="TRACE.jsonl", help="step trace files")
    parser.add_argument(
        "--label",
        action="append",
        default=None,
        help="a name per trace, in order (default: the file name)",
    )
    parser.add_argument(
        "--out-dir",
        default=None,
        help="where to write the PNGs (default: the first trace's folder)",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from inflight.bench.plots import LabelledTrace, draw_all
    from inflight.engine.step_trace import StepTrace

    labels = args.label or [Path(p).stem for p in args.traces]
    if len(labels) != len(args.traces):
        raise ValueError(f"{len(labels)} --label for {len(args.traces)} traces")
    out_dir = Path(args.out_dir) if args.out_dir else Path(args.traces[0]).parent
    prepare_output_dir(out_dir, "--out-dir")
    traces = [
        LabelledTrace(label, StepTrace.read_jsonl(path))
        for label, path in zip(labels, args.traces, strict=True)
    ]
    for path in draw_all(traces, out_dir):
        print(path)
    return 0
