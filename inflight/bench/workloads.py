"""Benchmark workloads: named, synthetic, or read from JSONL.

This module owns the workload record and every way of getting one:

* the named workloads ``seed8``, ``mixed`` and ``online``, generated in-process with the
  very algorithm and seeds of the project's ``bench/make_workload.py`` (so the token ids
  are identical, without importing anything from outside the package at run time), and
  ``single``: seed8's first prompt with 256 new tokens (the single-stream measurement);
* vLLM-style synthetic workloads (``--input-len``, ``--output-len``, ``--num-prompts``,
  ``--range-ratio``);
* JSONL files with one ``{"id", "prompt_token_ids", "max_tokens", "arrival_s"}`` per line.

Every request is run greedy with EOS ignored, so it generates exactly ``max_tokens``
tokens and token counts are known before the run.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path

# The named workloads target SmolLM2 (vocab 49152) and stay clear of its special and
# byte tokens, exactly as bench/make_workload.py does.
LOW_ID, HIGH_ID = 1000, 49000
NAMED_WORKLOADS = ("seed8", "mixed", "online", "single")
SINGLE_MAX_TOKENS = 256
DEFAULT_ONLINE_RATE = 4.0


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    id: int
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_s: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Workload:
    name: str  # a named workload, a file stem, or "random-IN-OUT"
    requests: list[WorkloadRequest]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def head(self, num_prompts: int | None) -> Workload:
        """The first ``num_prompts`` requests (a documented prefix of a bigger workload)."""
        if num_prompts is None or num_prompts >= len(self.requests):
            return self
        if num_prompts < 1:
            raise ValueError(f"--num-prompts must be >= 1, got {num_prompts}")
        return Workload(f"{self.name}[:{num_prompts}]", self.requests[:num_prompts])

    def repeat(self, times: int) -> Workload:
        """``times`` back-to-back copies, renumbered: more requests than batch slots."""
        if times < 1:
            raise ValueError(f"--repeat must be >= 1, got {times}")
        if times == 1:
            return self
        n = len(self.requests)
        copies = [
            WorkloadRequest(k * n + i, list(r.prompt_token_ids), r.max_tokens, r.arrival_s)
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


def mixed(n: int = 200, seed: int = 0, rate: float | None = None) -> Workload:
    """Heterogeneous lengths: input log-uniform 32..1024, output log-uniform 16..512."""
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


# ---------------------------------------------------------------- files and resolution


def read_jsonl(path: str | Path) -> Workload:
    requests = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            try:
                request = WorkloadRequest(
                    int(row.get("id", n - 1)),
                    [int(t) for t in row["prompt_token_ids"]],
                    int(row["max_tokens"]),
                    float(row.get("arrival_s", 0.0)),
                )
            except (KeyError, TypeError) as error:
                raise ValueError(f"{path}:{n}: needs prompt_token_ids and max_tokens") from error
            if request.max_tokens < 1 or not request.prompt_token_ids:
                raise ValueError(f"{path}:{n}: empty prompt or max_tokens < 1")
            requests.append(request)
    if not requests:
        raise ValueError(f"{path} holds no requests")
    return Workload(Path(path).stem, requests)


def named(name: str, rate: float | None = None) -> Workload:
    if name == "seed8":
        return seed8()
    if name == "mixed":
        return mixed()
    if name == "online":
        return online(rate or DEFAULT_ONLINE_RATE)
    if name == "single":
        return single()
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
        )
        for r in workload.requests
    ]
    return Workload(workload.name, folded), True
