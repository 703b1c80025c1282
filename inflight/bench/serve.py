"""``inflight bench serve``: a load client for any OpenAI-compatible server.

Sends a workload (a JSONL file, or synthetic lengths) as streaming requests, on a
schedule: the workload's own ``arrival_s``, Poisson arrivals at ``--request-rate``, or all
at once (``inf``), optionally capped at ``--max-concurrency`` requests in flight. For
each request it records the time to the first streamed token (TTFT), the gaps between
streamed chunks (inter-token latency, ITL), the mean time per output token after the
first (TPOT) and the end-to-end latency; it reports throughput and mean / median / P95 /
P99 of each, and writes them as JSON.

Workloads: the named ones of ``bench throughput`` (``seed8``, ``mixed``, ``online`` with
its ``--rate``, ``single``, ``shared-prefix``, ``multi-turn``), generated in-process, or a
JSONL file of ``{"id", "prompt_token_ids" | "prompt", "max_tokens", "arrival_s"}`` lines
(what ``inflight bench workload`` and ``make_workload.py`` write); run greedy with EOS
ignored. A request with ``"after": ID`` (a multi-turn chat's next turn) is sent
``think_s`` seconds after request ID's response has fully arrived, with the prompt ID's
prompt + ID's generated token ids + its own tokens (see ``inflight.bench.workloads``); the
generated ids come from vLLM's ``return_token_ids`` field, asked for only then. The
report adds the prompt tokens the server says it served from its prefix cache (OpenAI's
``usage.prompt_tokens_details.cached_tokens``) and the prefill tokens left to compute.

The timed run holds the benchmark lock (see ``inflight.bench.lock``). A server that cannot
be reached, or that refuses the API key, is reported in one line before anything is timed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

MS = 1000.0


class ServerUnavailable(RuntimeError):
    """The server cannot be benchmarked at all: unreachable, or it refuses our key."""


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt: str | list[int]
    max_tokens: int
    arrival_s: float = 0.0  # offset from the benchmark's start
    # Multi-turn: this request's id, the id whose answer it continues (prompt then holds
    # only the new tokens) and the think time after that answer; see the module docstring.
    id: int | None = None
    after: int | None = None
    think_s: float = 0.0

    @property
    def prompt_len(self) -> int | None:
        return len(self.prompt) if isinstance(self.prompt, list) else None


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


# ---------------------------------------------------------------------- workloads


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
    requests = []
    with open(path) as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            prompt = row.get("prompt_token_ids", row.get("prompt"))
            if prompt is None or "max_tokens" not in row:
                raise ValueError(
                    f"{path}:{number}: needs 'prompt_token_ids' (or 'prompt') and 'max_tokens'"
                )
            after = row.get("after")
            requests.append(
                BenchRequest(
                    prompt,
                    int(row["max_tokens"]),
                    float(row.get("arrival_s", 0.0)),
                    int(row.get("id", number - 1)),
                    None if after is None else int(after),
                    float(row.get("think_s", 0.0)),
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


# ---------------------------------------------------------------------- the client


async def send_request(
    client: Any,
    url: str,
    model: str,
    request: BenchRequest,
    chat: bool,
    headers: dict[str, str],
    return_token_ids: bool = False,
) -> RequestResult:
    """One streaming request; every chunk carrying a choice counts as produced tokens.

    With ``return_token_ids`` it asks for (vLLM's field) and keeps the generated ids."""
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        if not isinstance(request.prompt, str):
            raise ValueError("the chat endpoint needs text prompts ('prompt' in the workload)")
        payload["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        payload["prompt"] = request.prompt
    if return_token_ids:
        payload["return_token_ids"] = True
    result = RequestResult(prompt_tokens=request.prompt_len or 0, prompt=request.prompt)
    chunks = 0
    sent = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"])
                    return result
                now = time.perf_counter()
                if event.get("choices"):
                    result.output_token_ids.extend(event["choices"][0].get("token_ids") or [])
                    if chunks == 0:
                        result.ttft = now - sent
                    else:
                        result.itl.append(now - last)
                    last = now
                    chunks += 1
                if usage := event.get("usage"):
                    result.output_tokens = int(usage.get("completion_tokens", 0))
                    result.prompt_tokens = int(usage.get("prompt_tokens", 0))
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = int(details.get("cached_tokens") or 0)
        result.latency = time.perf_counter() - sent
        # Servers that do not report usage: assume one token per chunk.
        result.output_tokens = result.output_tokens or chunks
        result.ok = chunks > 0
        if not result.ok:
            result.error = "the stream carried no tokens"
        elif return_token_ids and len(result.output_token_ids) != result.output_tokens:
            result.ok = False
            result.error = "the server did not return the generated token ids"
    except Exception as error:  # the run goes on; the request counts as failed
        result.error = f"{type(error).__name__}: {error}"
    return result


async def run_benchmark(
    base_url: str,
    endpoint: str,
    model: str | None,
    requests: list[BenchRequest],
    max_concurrency: int | None,
    api_key: str | None,
    timeout_s: float,
    show_progress: bool,
) -> tuple[list[RequestResult], float, str]:
    """Send every request on its schedule; returns results, wall duration and model name."""
    import httpx
    from tqdm.auto import tqdm

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(timeout_s, connect=30.0)
    async with httpx.AsyncClient(
        base_url=base_url, timeout=timeout, limits=limits, trust_env=False
    ) as client:
        chat = "chat" in endpoint
        check_dependencies(requests, chat)
        model = await check_server(client, base_url, model, headers)
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = tqdm(total=len(requests), desc="requests", disable=not show_progress, unit="req")
        # Results of the requests a later turn waits on, resolved when their stream ends.
        awaited = {r.after for r in requests if r.after is not None}
        loop = asyncio.get_running_loop()
        answers: dict[int, asyncio.Future[RequestResult]] = {
            i: loop.create_future() for i in awaited
        }
        start = time.perf_counter()

        async def send(request: BenchRequest) -> RequestResult:
            if request.after is not None:
                previous = await answers[request.after]
                if not previous.ok:
                    return RequestResult(error=f"its previous turn {request.after} failed")
                await asyncio.sleep(request.think_s)
                request = replace(request, prompt=turn_prompt(request, previous))
            else:
                delay = start + request.arrival_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            want_ids = request.id in answers
            if gate is None:
                return await send_request(client, endpoint, model, request, chat, headers, want_ids)
            async with gate:
                return await send_request(client, endpoint, model, request, chat, headers, want_ids)

        async def one(request: BenchRequest) -> RequestResult:
            result = await send(request)
            if request.id in answers:
                answers[request.id].set_result(result)
            bar.update(1)
            return result

        try:
            results = await asyncio.gather(*(one(r) for r in requests))
        finally:
            bar.close()
        return list(results), time.perf_counter() - start, model


async def check_server(
    client: Any, base_url: str, model: str | None, headers: dict[str, str]
) -> str:
    """``GET /v1/models`` before timing: reachable, key accepted; returns the model name.

    Raises :class:`ServerUnavailable` with a one-line reason otherwise. A server without
    the route is fine when ``model`` is given.
    """
    import httpx

    try:
        listing = await client.get("/v1/models", headers=headers)
    except httpx.TransportError as error:
        raise ServerUnavailable(
            f"cannot reach the server at {base_url} ({type(error).__name__}: {error}); "
            "is it running? (--base-url, or --host/--port)"
        ) from None
    if listing.status_code in (401, 403):
        reason = _error_message(listing)
        raise ServerUnavailable(
            f"the server at {base_url} refused the API key (HTTP {listing.status_code}: "
            f"{reason}); pass --api-key KEY or set OPENAI_API_KEY"
        )
    if listing.status_code == 200:
        served = listing.json().get("data") or []
        if model is None and served:
            return str(served[0]["id"])
    if model is None:
        raise ServerUnavailable(
            f"GET {base_url}/v1/models answered HTTP {listing.status_code} "
            f"({_error_message(listing)}); pass --model NAME"
        )
    return model


def _error_message(response: Any) -> str:
    """OpenAI's ``error.message`` when the body has one, else the start of the body."""
    try:
        return str(response.json()["error"]["message"])
    except Exception:  # noqa: BLE001 - any other body: show it as text
        return response.text[:200].strip() or "no body"


# ---------------------------------------------------------------------- the report


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


# ---------------------------------------------------------------------- the command


def _plan(requests: list[BenchRequest], base_url: str, endpoint: str) -> str:
    known = [n for r in requests if (n := r.prompt_len) is not None]
    turns = sum(r.after is not None for r in requests)
    return (
        f"dry run: would send {len(requests)} requests to {base_url}{endpoint} over "
        f"{max(r.arrival_s for r in requests):.1f} s of arrivals; "
        f"{sum(known)} prompt tokens (token-id prompts"
        + (f"; {turns} later turns counted by their new tokens only" if turns else "")
        + f"), {sum(r.max_tokens for r in requests)} output tokens"
    )


def _rate(value: str) -> float:
    rate = float(value)
    if not rate > 0:
        raise argparse.ArgumentTypeError("the request rate must be positive (or inf)")
    return rate


def register(bench_subparsers: argparse._SubParsersAction) -> None:
    from inflight.bench.lock import add_lock_args

    parser = bench_subparsers.add_parser(
        "serve",
        help="load-test an OpenAI-compatible server (inflight's or another)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    target = parser.add_argument_group("target")
    target.add_argument(
        "--base-url",
        default=None,
        help="server root, e.g. http://127.0.0.1:8000 (default: --host/--port)",
    )
    target.add_argument("--host", default="127.0.0.1")
    target.add_argument("--port", type=int, default=8000)
    target.add_argument(
        "--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"]
    )
    target.add_argument(
        "--model",
        default=None,
        help="model name to send (default: the server's first /v1/models entry)",
    )
    target.add_argument(
        "--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY, if set)"
    )
    load = parser.add_argument_group("workload")
    load.add_argument(
        "--workload",
        "--dataset-path",
        dest="workload",
        default=None,
        help="seed8, mixed, online, single, shared-prefix, multi-turn (generated "
        "in-process, as in bench throughput) or a JSONL file (make_workload.py format); "
        "default: synthetic",
    )
    load.add_argument(
        "--rate",
        type=_rate,
        default=None,
        help="arrival rate (req/s) built into the 'online' workload's arrival_s "
        "(default: 4.0, as in bench throughput)",
    )
    load.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="the first N workload requests (synthetic default: 100)",
    )
    load.add_argument("--random-input-len", type=int, default=256)
    load.add_argument("--random-output-len", type=int, default=64)
    load.add_argument(
        "--random-token-low",
        type=int,
        default=1000,
        help="synthetic prompt ids are drawn from [low, high)",
    )
    load.add_argument("--random-token-high", type=int, default=30000)
    load.add_argument(
        "--request-rate",
        type=_rate,
        default=None,
        help="Poisson arrivals at this rate (req/s), or inf for all at once; "
        "default: the workload's arrival_s, else inf",
    )
    load.add_argument(
        "--max-concurrency", type=int, default=None, help="at most this many requests in flight"
    )
    load.add_argument("--seed", type=int, default=0)
    out = parser.add_argument_group("output")
    out.add_argument("--result-json", default=None, help="write the summary and config here")
    out.add_argument("--label", default=None, help="a name for this run, kept in the JSON")
    out.add_argument("--request-timeout", type=float, default=3600.0)
    out.add_argument("--disable-tqdm", action="store_true")
    out.add_argument(
        "--dry-run",
        action="store_true",
        help="build the workload and schedule, print the plan, send nothing",
    )
    add_lock_args(parser)
    parser.set_defaults(handler=run)


_NOT_SAVED = ("itl", "output_token_ids", "prompt")


def run(args: argparse.Namespace) -> int:
    from inflight.bench.lock import bench_lock, lock_path

    if args.workload:
        requests = load_workload(args.workload, args.num_prompts, args.rate)
    else:
        requests = synthetic_workload(
            args.num_prompts or 100,
            args.random_input_len,
            args.random_output_len,
            args.random_token_low,
            args.random_token_high,
            args.seed,
        )
    rate = args.request_rate
    if rate is None and not args.workload:
        rate = math.inf
    requests = schedule(requests, rate, args.seed)
    check_dependencies(requests, "chat" in args.endpoint)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    if args.dry_run:
        print(_plan(requests, base_url, args.endpoint))
        return 0
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    try:
        with bench_lock(lock_path(args)):
            results, duration, model = asyncio.run(
                run_benchmark(
                    base_url,
                    args.endpoint,
                    args.model,
                    requests,
                    args.max_concurrency,
                    api_key,
                    args.request_timeout,
                    not args.disable_tqdm,
                )
            )
    except ServerUnavailable as error:
        print(f"inflight bench serve: error: {error}", file=sys.stderr)
        return 1
    summary = summarize(results, duration)
    print(format_report(summary))
    errors = [r.error for r in results if not r.ok]
    if errors:
        print(f"{len(errors)} request(s) failed; first error: {errors[0]}", file=sys.stderr)
    if args.result_json:
        rate_label: str | float = "workload" if rate is None else rate
        if math.isinf(rate or 0.0):
            rate_label = "inf"  # JSON has no infinity
        record = {
            "label": args.label,
            "base_url": base_url,
            "endpoint": args.endpoint,
            "model": model,
            "workload": args.workload,
            "num_prompts": len(requests),
            "request_rate": rate_label,
            "workload_rate": args.rate,  # the rate built into the online workload (--rate)
            "max_concurrency": args.max_concurrency,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            **summary,
            "requests": [
                {k: v for k, v in asdict(r).items() if k not in _NOT_SAVED} | {"tpot": r.tpot}
                for r in results
            ],
        }
        Path(args.result_json).write_text(json.dumps(record, indent=2) + "\n")
    # Some failures still make a (flagged) benchmark; none succeeding is an error.
    return 0 if summary["completed"] else 1
