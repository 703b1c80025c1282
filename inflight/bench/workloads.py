"""Benchmark workloads: named, synthetic, or read from JSONL.

This module owns the workload record and every way of getting one:

* the named workloads ``seed8``, ``mixed`` and ``online``, generated in-process with the
  very algorithm and seeds of the project's ``bench/make_workload.py`` (so the token ids
  are identical, without importing anything from outside the package at run time), and
  ``single``: seed8's first prompt with 256 new tokens (the single-stream measurement);
* two named workloads that show prefix caching, each from its own seeded generator:
  ``shared-prefix`` (N requests sharing one K-token system prompt, distinct suffixes) and
  ``multi-turn`` (chat conversations that resend their whole history every turn);
* vLLM-style synthetic workloads (``--input-len``, ``--output-len``, ``--num-prompts``,
  ``--range-ratio``);
* JSONL files with one ``{"id", "prompt_token_ids", "max_tokens", "arrival_s"}`` per line.

Every request is run greedy with EOS ignored, so it generates exactly ``max_tokens``
tokens and token counts are known before the run.

Dependent requests (multi-turn chat). A turn's prompt must hold the previous turn's
*actual* answer, which exists only once that turn has run, so a workload cannot spell it
out. Design: a request with ``after`` set (the ``id`` of its predecessor, which always
comes earlier in the list) stores in ``prompt_token_ids`` only its *new* user tokens; a
runner sends it once the predecessor has finished (plus ``think_s`` seconds of user think
time, honoured by ``bench serve``; the offline runner has no clock and ignores it) with
the prompt ::

    predecessor's full prompt + predecessor's generated tokens + prompt_token_ids

(:func:`full_prompt`). Because EOS is ignored, every full prompt's *length* is known in
advance (:func:`full_prompt_lens`). In JSONL, ``after`` and ``think_s`` appear only on
dependent requests, so independent workloads keep ``make_workload.py``'s format.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from inflight.jsonl import numbered_lines

# The named workloads target SmolLM2 (vocab 49152) and stay clear of its special and
# byte tokens, exactly as bench/make_workload.py does.
LOW_ID, HIGH_ID = 1000, 49000
NAMED_WORKLOADS = ("seed8", "mixed", "online", "single", "shared-prefix", "multi-turn")
SINGLE_MAX_TOKENS = 256
DEFAULT_ONLINE_RATE = 4.0


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    id: int
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float = 0.0
    # Multi-turn: the id of the request whose answer this one continues (see the module
    # docstring; prompt_token_ids then holds only the new tokens), and the user's think
    # time between that answer and this request.
    after: int | None = None
    think_s: float = 0.0

    def to_json(self) -> dict:
        row = asdict(self)
        if self.after is None:  # independent requests keep make_workload.py's format
            del row["after"], row["think_s"]
        return row


@dataclass(frozen=True, slots=True)
class Workload:
    name: str  # a named workload, a file stem, or "random-IN-OUT"
    requests: list[WorkloadRequest]

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens sent, dependent requests' full (history-resending) prompts included."""
        return sum(full_prompt_lens(self.requests).values())

    @property
    def has_dependencies(self) -> bool:
        return any(r.after is not None for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def head(self, num_prompts: int | None) -> Workload:
        """The first ``num_prompts`` requests (a documented prefix of a bigger workload)."""
        if num_prompts is None or num_prompts >= len(self.requests):
            return self
        if num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
        # Predecessors come first, so a prefix of the list keeps every dependency.
        return Workload(f"{self.name}[:{num_prompts}]", self.requests[:num_prompts])

    def repeat(self, times: int) -> Workload:
        """``times`` back-to-back copies, renumbered: more requests than batch slots."""
        if times < 1:
            raise ValueError(f"--repeat must be >= 1, got {times}")
        if times == 1:
            return self
        n = len(self.requests)
        index = {r.id: i for i, r in enumerate(self.requests)}
        copies = [
            WorkloadRequest(
                k * n + i,
                list(r.prompt_token_ids),
                r.max_tokens,
                r.arrival_s,
                None if r.after is None else k * n + index[r.after],
                r.think_s,
            )
            for k in range(times)
            for i, r in enumerate(self.requests)
        ]
        return Workload(f"{self.name}x{times}", copies)

    def write_jsonl(self, path: str | Path) -> None:
        with open(path, "w", encoding="utf-8") as f:
            for r in self.requests:
                f.write(json.dumps(r.to_json()) + "\n")


# ---------------------------------------------------------------- the shared generator
# Same draws in the same order as bench/make_workload.py: changing the order of any
# rng call would silently change every token id of every published number.


def _loguniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(LOW_ID, HIGH_ID) for _ in range(n)]


def check_rate(rate: float, allow_inf: bool = False) -> float:
    """A request rate in req/s: positive, and finite unless ``allow_inf`` (all at once);
    raises ValueError otherwise (NaN included)."""
    if not rate > 0 or (math.isinf(rate) and not allow_inf):
        bound = "positive" if allow_inf else "positive and finite"
        raise ValueError(f"the request rate must be {bound} (req/s), got {rate}")
    return rate


def rate_arg(value: str) -> float:
    """argparse type for ``--rate``: a positive, finite request rate."""
    try:
        return check_rate(float(value))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def mixed(n: int = 200, seed: int = 0, rate: float | None = None) -> Workload:
    """Heterogeneous lengths: input log-uniform 32..1024, output log-uniform 16..512; with
    ``rate``, Poisson arrivals at that many requests per second (the ``online`` workload)."""
    if rate is not None:
        check_rate(rate)
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        if rate:
            t += rng.expovariate(rate)
        prompt = _prompt(rng, _loguniform(rng, 32, 1024))
        out.append(WorkloadRequest(i, prompt, _loguniform(rng, 16, 512), round(t, 4)))
    return Workload("online" if rate else "mixed", out)


def seed8(seed: int = 0, prompt_len: int = 128) -> Workload:
    """The source document's example: one request of 500 output tokens, seven of 50."""
    rng = random.Random(seed)
    lens = [500] + [50] * 7
    requests = [WorkloadRequest(i, _prompt(rng, prompt_len), m) for i, m in enumerate(lens)]
    return Workload("seed8", requests)


def single(max_tokens: int = SINGLE_MAX_TOKENS) -> Workload:
    """One stream: seed8's first 128-token prompt, ``max_tokens`` new tokens."""
    first = seed8().requests[0]
    return Workload("single", [WorkloadRequest(0, first.prompt_token_ids, max_tokens)])


def online(rate: float = DEFAULT_ONLINE_RATE) -> Workload:
    """``mixed`` with Poisson arrivals at ``rate`` requests per second."""
    return mixed(rate=rate)


def synthetic(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> Workload:
    """vLLM's random dataset shape: lengths uniform in ``len * [1 - r, 1 + r]``."""
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ValueError("--num-prompts, --input-len and --output-len must all be >= 1")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)

    def length(mean: int) -> int:
        lo = max(1, math.floor(mean * (1 - range_ratio)))
        return rng.randint(lo, max(lo, math.ceil(mean * (1 + range_ratio))))

    requests = [
        WorkloadRequest(i, _prompt(rng, length(input_len)), length(output_len))
        for i in range(num_prompts)
    ]
    return Workload(f"random-{input_len}-{output_len}", requests)


# ---------------------------------------------------------------- prefix-caching workloads
# Each has its own seeded generator: the draws above stay exactly as they are.


def shared_prefix(
    num_prompts: int = 64,
    prefix_len: int = 512,
    suffix_len: tuple[int, int] = (16, 128),
    output_len: tuple[int, int] = (32, 128),
    seed: int = 0,
) -> Workload:
    """``num_prompts`` requests: one shared ``prefix_len``-token system prompt, then a
    distinct suffix of uniform ``suffix_len`` tokens; outputs uniform in ``output_len``."""
    if num_prompts < 1 or prefix_len < 1:
        raise ValueError("shared-prefix needs num_prompts >= 1 and prefix_len >= 1")
    rng = random.Random(seed)
    system = _prompt(rng, prefix_len)
    requests = []
    for i in range(num_prompts):
        suffix = _prompt(rng, rng.randint(*suffix_len))
        requests.append(WorkloadRequest(i, system + suffix, rng.randint(*output_len)))
    return Workload("shared-prefix", requests)


def multi_turn(
    num_conversations: int = 16,
    num_turns: int = 5,
    first_len: tuple[int, int] = (64, 256),
    user_len: tuple[int, int] = (16, 128),
    output_len: tuple[int, int] = (32, 128),
    think_s: float = 0.0,
    seed: int = 0,
) -> Workload:
    """``num_conversations`` chats of ``num_turns`` turns each, listed conversation by
    conversation (so ``head`` keeps whole early conversations). Turn 0 is a fresh prompt of
    uniform ``first_len`` tokens, arriving at 0; every later turn adds a user message of
    uniform ``user_len`` tokens after the previous turn's answer (see the module docstring:
    ``after`` and ``think_s``). Answers are uniform in ``output_len`` tokens."""
    if num_conversations < 1 or num_turns < 1:
        raise ValueError("multi-turn needs num_conversations >= 1 and num_turns >= 1")
    rng = random.Random(seed)
    requests: list[WorkloadRequest] = []
    for _ in range(num_conversations):
        previous: int | None = None
        for turn in range(num_turns):
            new_tokens = _prompt(rng, rng.randint(*(user_len if turn else first_len)))
            request_id = len(requests)
            requests.append(
                WorkloadRequest(
                    request_id,
                    new_tokens,
                    rng.randint(*output_len),
                    after=previous,
                    think_s=think_s if previous is not None else 0.0,
                )
            )
            previous = request_id
    return Workload("multi-turn", requests)


def full_prompt(
    request: WorkloadRequest,
    predecessor_prompt: list[int] | None,
    predecessor_output: list[int] | None,
) -> list[int]:
    """The prompt to send: the request's own tokens, or for a dependent request its
    predecessor's full prompt and generated tokens followed by its new tokens."""
    if request.after is None:
        return list(request.prompt_token_ids)
    if predecessor_prompt is None or predecessor_output is None:
        raise ValueError(f"request {request.id} needs the prompt and output of {request.after}")
    return [*predecessor_prompt, *predecessor_output, *request.prompt_token_ids]


def full_prompt_lens(requests: list[WorkloadRequest]) -> dict[int, int]:
    """Every request's full prompt length, known in advance since EOS is ignored."""
    lens: dict[int, int] = {}
    by_id = {r.id: r for r in requests}
    for r in requests:
        if r.after is None:
            lens[r.id] = len(r.prompt_token_ids)
            continue
        if r.after not in lens:
            raise ValueError(f"request {r.id} comes after {r.after}, which is not before it")
        lens[r.id] = lens[r.after] + by_id[r.after].max_tokens + len(r.prompt_token_ids)
    return lens


# ---------------------------------------------------------------- files and resolution


def read_jsonl(path: str | Path) -> Workload:
    """A workload file: one JSON object a line, ``{"prompt_token_ids": [int, ...],
    "max_tokens": int}`` plus optional ``id``, ``arrival_s``, ``after`` and ``think_s``
    (finite seconds >= 0). Raises ``ValueError`` naming the file and line of a bad one."""
    requests = []
    for n, line in numbered_lines(path, "a JSONL workload"):
        try:
            requests.append(parse_request(json.loads(line), n))
        except ValueError as error:  # json's decode errors included
            raise ValueError(f"{path}:{n}: {error}") from None
    if not requests:
        raise ValueError(f"{path} holds no requests")
    full_prompt_lens(requests)  # every dependency points back to an earlier request
    return Workload(Path(path).stem, requests)


def parse_request(row: Any, n: int) -> WorkloadRequest:
    """The request on line ``n`` of a workload file; ``ValueError`` says which field is
    wrong."""
    if not isinstance(row, dict):
        raise ValueError(f"each line must be a JSON object, got {type(row).__name__}")
    if "prompt_token_ids" not in row or "max_tokens" not in row:
        raise ValueError("needs prompt_token_ids and max_tokens")
    ids = row["prompt_token_ids"]
    if not isinstance(ids, list) or not ids or not all(_is_int(t) and t >= 0 for t in ids):
        raise ValueError("prompt_token_ids must be a non-empty list of token ids (integers >= 0)")
    max_tokens = row["max_tokens"]
    if not _is_int(max_tokens) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    after = row.get("after")
    for name, value in (("id", row.get("id", n - 1)), ("after", after)):
        if value is not None and not _is_int(value):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    return WorkloadRequest(
        int(row.get("id", n - 1)),
        list(ids),
        max_tokens,
        _seconds(row, "arrival_s"),
        None if after is None else int(after),
        _seconds(row, "think_s"),
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _seconds(row: dict[str, Any], name: str) -> float:
    value = row.get(name, 0.0)
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value < 0):
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    return float(value)


def named(name: str, rate: float | None = None) -> Workload:
    if name == "seed8":
        return seed8()
    if name == "mixed":
        return mixed()
    if name == "online":
        return online(DEFAULT_ONLINE_RATE if rate is None else rate)
    if name == "single":
        return single()
    if name == "shared-prefix":
        return shared_prefix()
    if name == "multi-turn":
        return multi_turn()
    raise ValueError(f"unknown workload {name!r}; use one of {NAMED_WORKLOADS} or a .jsonl path")


def resolve(spec: str, rate: float | None = None) -> Workload:
    """A named workload, or the path of a JSONL file."""
    if spec in NAMED_WORKLOADS:
        return named(spec, rate)
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(
            f"workload {spec!r} is neither one of {NAMED_WORKLOADS} nor an existing file"
        )
    return read_jsonl(path)


def fit_to_vocab(workload: Workload, vocab_size: int) -> tuple[Workload, bool]:
    """Fold token ids into ``[low, vocab_size)`` for small test models.

    The folding keeps lengths (all that throughput depends on) and is deterministic;
    returns the workload unchanged, with False, when every id already fits.
    """
    if all(t < vocab_size for r in workload.requests for t in r.prompt_token_ids):
        return workload, False
    low = min(LOW_ID, vocab_size // 8)  # clear of the low special ids in any vocabulary
    span = vocab_size - low
    folded = [
        WorkloadRequest(
            r.id,
            [low + (t - LOW_ID) % span for t in r.prompt_token_ids],
            r.max_tokens,
            r.arrival_s,
            r.after,
            r.think_s,
        )
        for r in workload.requests
    ]
    return Workload(workload.name, folded), True
