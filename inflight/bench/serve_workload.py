"""The requests of ``inflight bench serve``: loading a workload (a named one, generated
in-process, or a JSONL file), synthetic prompts, the arrival schedule, and the prompts of
a multi-turn chat's later turns (see ``inflight.bench.serve``'s docstring).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inflight.bench.serve_report import RequestResult


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt: str | list[int]
    max_tokens: int
    arrival_s: float = 0.0  # offset from the benchmark's start
    # Multi-turn: this request's id, the id whose answer it continues (prompt then holds
    # only the new tokens) and the think time after that answer; see ``serve.py``'s docstring.
    id: int | None = None
    after: int | None = None
    think_s: float = 0.0

    @property
    def prompt_len(self) -> int | None:
        return len(self.prompt) if isinstance(self.prompt, list) else None


def load_workload(
    spec: str, num_prompts: int | None, rate: float | None = None
) -> list[BenchRequest]:
    """A named workload (generated in-process, with its own arrivals) or a JSONL file."""
    from inflight.bench import workloads

    if spec in workloads.NAMED_WORKLOADS:
        named = workloads.named(spec, rate).head(num_prompts)
        return [
            BenchRequest(r.prompt_token_ids, r.max_tokens, r.arrival_s, r.id, r.after, r.think_s)
            for r in named.requests
        ]
    if not Path(spec).is_file():
        raise FileNotFoundError(
            f"workload {spec!r} is neither one of {workloads.NAMED_WORKLOADS} nor a file"
        )
    return read_workload_file(spec, num_prompts)


def read_workload_file(path: str, num_prompts: int | None) -> list[BenchRequest]:
    """A JSONL workload (``bench.workloads.read_jsonl``'s format; a line may give a text
    ``prompt`` instead of ``prompt_token_ids``); ``ValueError`` naming the file and line."""
    from inflight.bench.workloads import parse_request
    from inflight.jsonl import numbered_lines

    requests = []
    for number, line in numbered_lines(path, "a JSONL workload"):
        try:
            row = json.loads(line)
            prompt: str | list[int] | None = None
            if isinstance(row, dict) and "prompt_token_ids" not in row and "prompt" in row:
                prompt = row["prompt"]
                if not isinstance(prompt, str) or not prompt:
                    raise ValueError("prompt must be a non-empty string")
                row = {**row, "prompt_token_ids": [0]}  # the other fields checked alike
            request = parse_request(row, number)
        except ValueError as error:  # json's decode errors included
            raise ValueError(f"{path}:{number}: {error}") from None
        requests.append(
            BenchRequest(
                request.prompt_token_ids if prompt is None else prompt,
                request.max_tokens,
                request.arrival_s,
                request.id,
                request.after,
                request.think_s,
            )
        )
        if num_prompts is not None and len(requests) >= num_prompts:
            break
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests


def synthetic_workload(
    num_prompts: int,
    input_len: int,
    output_len: int,
    token_low: int,
    token_high: int,
    seed: int,
) -> list[BenchRequest]:
    """Random token-id prompts of fixed lengths (valid for any vocabulary above token_high)."""
    rng = random.Random(seed)
    return [
        BenchRequest([rng.randrange(token_low, token_high) for _ in range(input_len)], output_len)
        for _ in range(num_prompts)
    ]


def schedule(requests: list[BenchRequest], rate: float | None, seed: int) -> list[BenchRequest]:
    """Arrival offsets: the workload's own when ``rate`` is None, else Poisson (or 0 for inf).

    Only independent requests get an arrival; a dependent one is sent after its predecessor.
    """
    if rate is None:
        return requests
    rng = random.Random(seed)
    offset, out = 0.0, []
    for request in requests:
        if request.after is not None:
            out.append(request)
            continue
        out.append(replace(request, arrival_s=offset))
        if not math.isinf(rate):
            offset += rng.expovariate(rate)
    return out


def check_dependencies(requests: list[BenchRequest], chat: bool) -> None:
    """Every ``after`` names an earlier request; dependent turns need token-id prompts."""
    seen: set[int] = set()
    for request in requests:
        if request.after is not None:
            if request.after not in seen:
                raise ValueError(f"request {request.id} comes after {request.after}, not before it")
            if chat or not isinstance(request.prompt, list):
                raise ValueError("multi-turn requests need token-id prompts on /v1/completions")
        if request.id is not None:
            seen.add(request.id)


def turn_prompt(request: BenchRequest, previous: RequestResult) -> list[int]:
    """A dependent request's prompt: the previous turn's prompt and answer, then its own."""
    assert isinstance(previous.prompt, list) and isinstance(request.prompt, list)
    return [*previous.prompt, *previous.output_token_ids, *request.prompt]
