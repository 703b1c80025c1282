"""``inflight bench workload NAME``: write a named workload as JSONL.

The same requests ``bench throughput`` and ``bench serve`` generate in-process, as a file
for tools that read one (the peer engines' benchmarks), in ``make_workload.py``'s format:
one ``{"id", "prompt_token_ids", "max_tokens", "arrival_s"}`` per line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from inflight.bench.workloads import rate_arg


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    from inflight.bench.workloads import DEFAULT_ONLINE_RATE, NAMED_WORKLOADS

    parser = bench_subparsers.add_parser(
        "workload",
        help="write a named workload (seed8, mixed, online, single, shared-prefix, multi-turn) "
        "as JSONL",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("name", choices=NAMED_WORKLOADS, help="the workload")
    parser.add_argument(
        "--rate",
        type=rate_arg,
        default=DEFAULT_ONLINE_RATE,
        help="arrival rate (requests/s) of the 'online' workload",
    )
    parser.add_argument("--num-prompts", type=int, default=None, help="only the first N requests")
    parser.add_argument(
        "-o", "--output", default=None, metavar="FILE", help="write here instead of stdout"
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import json

    from inflight.bench.workloads import named

    workload = named(args.name, args.rate).head(args.num_prompts)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        workload.write_jsonl(args.output)
        print(
            f"{args.output}: {len(workload.requests)} requests, {workload.num_prompt_tokens} "
            f"prompt + {workload.num_output_tokens} output tokens",
            file=sys.stderr,
        )
    else:
        for request in workload.requests:
            sys.stdout.write(json.dumps(request.to_json()) + "\n")
    return 0
