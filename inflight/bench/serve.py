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
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from inflight.bench.cli_types import int_at_least, port, seconds
from inflight.bench.serve_report import RequestResult, format_report, summarize
from inflight.bench.serve_workload import (
    BenchRequest,
    check_dependencies,
    load_workload,
    read_workload_file,
    schedule,
    synthetic_workload,
    turn_prompt,
)
from inflight.bench.workloads import check_rate, rate_arg

__all__ = [
    "BenchRequest",
    "RequestResult",
    "ServerUnavailable",
    "check_dependencies",
    "format_report",
    "load_workload",
    "read_workload_file",
    "register",
    "run",
    "run_benchmark",
    "schedule",
    "send_request",
    "summarize",
    "synthetic_workload",
    "turn_prompt",
]


class ServerUnavailable(RuntimeError):
    """The server cannot be benchmarked at all: unreachable, or it refuses our key."""


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


def _rate_or_inf(value: str) -> float:
    try:
        return check_rate(float(value), allow_inf=True)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


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
        type=_base_url,
        default=None,
        help="server root, e.g. http://127.0.0.1:8000 (default: --host/--port)",
    )
    target.add_argument("--host", default="127.0.0.1")
    target.add_argument("--port", type=port, default=8000)
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
        type=rate_arg,
        default=None,
        help="arrival rate (req/s) built into the 'online' workload's arrival_s "
        "(default: 4.0, as in bench throughput)",
    )
    load.add_argument(
        "--num-prompts",
        type=int_at_least(1),
        default=None,
        help="the first N workload requests (synthetic default: 100)",
    )
    load.add_argument("--random-input-len", type=int_at_least(1), default=256)
    load.add_argument("--random-output-len", type=int_at_least(1), default=64)
    load.add_argument(
        "--random-token-low",
        type=int_at_least(0),
        default=1000,
        help="synthetic prompt ids are drawn from [low, high)",
    )
    load.add_argument("--random-token-high", type=int_at_least(1), default=30000)
    load.add_argument(
        "--request-rate",
        type=_rate_or_inf,
        default=None,
        help="Poisson arrivals at this rate (req/s), or inf for all at once; "
        "default: the workload's arrival_s, else inf",
    )
    load.add_argument(
        "--max-concurrency", type=int_at_least(1), default=None,
        help="at most this many requests in flight"
    )
    load.add_argument("--seed", type=int, default=0)
    out = parser.add_argument_group("output")
    out.add_argument("--result-json", default=None, help="write the summary and config here")
    out.add_argument("--label", default=None, help="a name for this run, kept in the JSON")
    out.add_argument("--request-timeout", type=seconds(), default=3600.0)
    out.add_argument("--disable-tqdm", action="store_true")
    out.add_argument(
        "--dry-run",
        action="store_true",
        help="build the workload and schedule, print the plan, send nothing",
    )
    add_lock_args(parser)
    parser.set_defaults(handler=run)


_NOT_SAVED = ("itl", "output_token_ids", "prompt")


def _base_url(text: str) -> str:
    """``--base-url``: an http(s) URL with a host."""
    from urllib.parse import urlsplit

    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"must be an http(s) URL such as http://127.0.0.1:8000, got {text!r}")
    return text


def run(args: argparse.Namespace) -> int:
    from inflight.bench.lock import bench_lock, lock_path

    if args.workload:
        requests = load_workload(args.workload, args.num_prompts, args.rate)
    else:
        if args.random_token_low >= args.random_token_high:
            raise ValueError(
                f"--random-token-low ({args.random_token_low}) must be below "
                f"--random-token-high ({args.random_token_high})"
            )
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
