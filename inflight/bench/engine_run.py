"""One timed benchmark run of inflight's offline engine, and running any run in isolation.

This module owns how a workload goes through ``LLM.generate`` for measuring: greedy,
EOS ignored, every request's ``max_tokens`` from the workload, the step trace on, a short
untimed warm-up first (the first steps pay one-off allocation costs that would otherwise
land on whichever policy runs first) with the KV cache's memory mapped in (it is mapped
lazily, and first touches of fresh memory cost ~1 s per GB on this project's VMs; vLLM
and OpenVINO allocate theirs at start-up too), and the check that every request produced
exactly its ``max_tokens`` tokens before any number is reported.

:func:`generate_workload` drives ``LLMEngine.add_request``/``step`` itself rather than
``LLM.generate``: independent requests are all added before the first step (as
``generate`` does), and a dependent request (a multi-turn chat's next turn) is added only
once its predecessor has finished, with the predecessor's prompt and generated tokens in
front of its own (see ``workloads``). Reports count the prefill tokens the engine really
computed (the step trace's prefill chunks, recomputation after preemption included) next
to the prompt tokens the prefix cache supplied (``RequestOutput.num_cached_tokens``).

:func:`run_isolated` runs a benchmark function in a fresh spawned Python process, so that
each run's peak RSS is its own and no run inherits another's heap.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from multiprocessing import get_context
from typing import TYPE_CHECKING, Any, TypeVar

from inflight.bench.report import (
    BenchReport,
    Distribution,
    RequestLatency,
    peak_rss_mib,
    request_latency,
    slot_steps,
)
from inflight.bench.workloads import (
    Workload,
    WorkloadRequest,
    fit_to_vocab,
    full_prompt,
    full_prompt_lens,
)
from inflight.engine.step_trace import StepRecord

if TYPE_CHECKING:
    from inflight.bench.module_times import ModuleTimes
    from inflight.bench.work_ledger import KernelWork
    from inflight.engine.llm_engine import LLMEngine
    from inflight.outputs import RequestOutput

WARMUP_PROMPT_LEN = 16
WARMUP_MAX_TOKENS = 4

T = TypeVar("T")


@dataclass
class RunResult:
    """A report, the step trace it was computed from, and whether ids were folded."""

    report: BenchReport
    records: list[StepRecord]
    folded_token_ids: bool = False
    # torch profiler's per-op table of the timed run, with --profile
    profile_table: str | None = None


def summarise(
    label: str,
    engine: str,
    batching: str,
    workload: Workload,
    wall_time_s: float,
    records: list[StepRecord],
    max_num_seqs: int,
    num_preemptions: int,
    latencies: list[RequestLatency],
    options: dict[str, Any],
    num_cached_tokens: int = 0,
) -> BenchReport:
    """The report fields every engine shares, from a finished run. Requests and tokens
    are counted from ``latencies`` (what was served), not from the workload's asks: a
    request capped by the context length makes fewer tokens than its ``max_tokens``."""
    return BenchReport(
        label=label,
        engine=engine,
        batching=batching,
        workload=workload.name,
        num_requests=len(latencies),
        num_prompt_tokens=sum(x.num_prompt_tokens for x in latencies),
        num_output_tokens=sum(x.num_output_tokens for x in latencies),
        wall_time_s=wall_time_s,
        num_steps=len(records),
        num_preemptions=num_preemptions,
        max_num_seqs=max_num_seqs,
        slots=slot_steps(records, max_num_seqs),
        peak_rss_mib=peak_rss_mib(),
        ttft=Distribution.of([x.ttft_s for x in latencies]),
        tpot=Distribution.of([x.tpot_s for x in latencies if x.tpot_s is not None]),
        options=options,
        requests=latencies,
        num_cached_tokens=num_cached_tokens,
        num_prefill_tokens_computed=prefill_tokens_computed(records),
    )


def prefill_tokens_computed(records: list[StepRecord]) -> int:
    """Tokens the model ran in prefill chunks: what the prefix cache saves."""
    return sum(e.num_tokens for r in records for e in r.entries if e.kind == "prefill")


def run_inflight(
    workload: Workload,
    model: str | None,
    options: dict[str, Any],
    *,
    warmup: bool = True,
    use_tqdm: bool = False,
    threads: int | None = None,
    profile: bool = False,
    sampling_extras: bool = False,
    module_times: bool = False,
) -> RunResult:
    """Run ``workload`` through ``LLM.generate`` once, timed, with the step trace on.

    With ``module_times`` each part of the model is timed by forward hooks (see
    ``module_times``; the table is returned with the profile's and in the report).

    With ``profile`` the timed run is also recorded by torch's profiler (which slows it a
    little) and its per-op table is returned, followed by each kernel's time against its
    roofline bound (also in the report's ``kernel_bounds``; see ``roofline``).
    """
    set_threads(threads)
    from inflight import LLM, SamplingParams

    llm = LLM(model, **{**options, "record_trace": True})
    engine = llm.llm_engine
    workload, folded = fit_to_vocab(workload, engine.vocab_size)
    _check_fits(workload, engine.max_model_len)
    if warmup:
        ids = [r.prompt_token_ids[0] for r in workload.requests[:1]] * WARMUP_PROMPT_LEN
        warm = SamplingParams(temperature=0.0, max_tokens=WARMUP_MAX_TOKENS, ignore_eos=True)
        llm.generate([{"prompt_token_ids": ids}], warm, use_tqdm=False)
        llm.step_trace.clear()
        llm.reset_prefix_cache()  # the timed run finds no block of the warm-up's
        engine.populate_kv_cache()
    preemptions_before = engine.scheduler.num_preemptions

    ledger = _attach_work_ledger(engine) if profile else None
    engine.timings.reset()
    times = None
    if module_times:  # imported here, as the other torch-side helpers
        from inflight.bench.module_times import ModuleTimes

        times = ModuleTimes(engine.runner.model)
    with _maybe_profile(profile) as profiler, _maybe_time_modules(times):
        started = time.perf_counter()
        outputs = generate_workload(
            engine, workload, use_tqdm=use_tqdm, sampling_extras=sampling_extras
        )
        wall = time.perf_counter() - started
    engine.runner.work_ledger = None
    profile_table = None
    kernel_bounds = None
    if profiler is not None:
        profile_table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        if ledger is not None:
            bounds_table, kernel_bounds = _kernel_bounds(ledger, profiler, engine.timings.forward_s)
            profile_table += "\n\n" + bounds_table + "\n"
    if times is not None:
        profile_table = (profile_table or "") + times.format(wall) + "\n"

    latencies = []
    for request, output in zip(workload.requests, outputs, strict=True):
        produced = len(output.outputs[0].token_ids)
        if produced != request.max_tokens:  # a benchmark of the wrong work is worthless
            raise RuntimeError(
                f"request {request.id} produced {produced} tokens, expected {request.max_tokens}"
            )
        m = output.metrics
        assert m is not None and m.first_token_time is not None and m.finished_time is not None
        latencies.append(
            request_latency(
                str(request.id),
                len(output.prompt_token_ids),
                produced,
                m.arrival_time,
                m.first_token_time,
                m.finished_time,
            )
        )
    batching = options.get("batching", "continuous")
    config = engine.config
    records = list(llm.step_trace.records)
    report = summarise(
        f"inflight {batching}",
        "inflight",
        batching,
        workload,
        wall,
        records,
        config.scheduler.max_num_seqs,
        engine.scheduler.num_preemptions - preemptions_before,
        latencies,
        {
            "model": engine.model_path,
            "enable_prefix_caching": config.cache.enable_prefix_caching,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "device": str(engine.device),
            "max_num_seqs": config.scheduler.max_num_seqs,
            "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
            "block_size": config.cache.block_size,
            "num_kv_blocks": engine.kv_cache.num_blocks,
            "enable_chunked_prefill": config.scheduler.enable_chunked_prefill,
            "threads": _torch_threads(),
            "step_time_ms": engine.timings.per_step_ms(),
        },
        num_cached_tokens=sum(o.num_cached_tokens for o in outputs),
    )
    report.kernel_bounds = kernel_bounds
    report.module_times = times.to_json() if times is not None else None
    return RunResult(report, records, folded, profile_table)


def _attach_work_ledger(engine: LLMEngine) -> KernelWork:
    """Measure the machine's peaks (a few seconds, before timing) and let the model runner
    account every step's work per kernel (see ``roofline``)."""
    from inflight.bench.machine_peaks import measure_peaks
    from inflight.bench.work_ledger import KernelWork

    ledger = KernelWork.for_runner(engine.runner, measure_peaks())
    engine.runner.work_ledger = ledger
    return ledger


def _kernel_bounds(
    ledger: KernelWork, profiler: Any, forward_s: float
) -> tuple[str, dict[str, Any]]:
    """The kernels-against-roofline table and its JSON form."""
    from inflight.bench.roofline import bounds_json, format_kernel_bounds, kernel_bounds

    rows = kernel_bounds(ledger, profiler.events(), forward_s)
    return format_kernel_bounds(ledger.peaks, rows), bounds_json(ledger.peaks, rows)


# --sampling-extras: OpenAI/vLLM options a chat front-end or an eval harness sends.
SAMPLING_EXTRAS: dict[str, Any] = dict(
    presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1, logprobs=5
)


def generate_workload(
    engine: LLMEngine, workload: Workload, *, use_tqdm: bool = False,
    sampling_extras: bool = False,
) -> list[RequestOutput]:
    """Run every request greedy with EOS ignored; outputs in the workload's order.
    ``sampling_extras`` adds :data:`SAMPLING_EXTRAS` to every request.

    Independent requests are added before the first step; a dependent one right after
    the step in which its predecessor finished, with :func:`workloads.full_prompt`.
    """
    from tqdm.auto import tqdm

    from inflight import SamplingParams

    pending: dict[int, list[WorkloadRequest]] = defaultdict(list)  # by predecessor id
    running: dict[str, WorkloadRequest] = {}  # by engine request id
    finished: dict[int, RequestOutput] = {}

    def add(request: WorkloadRequest, prompt: list[int]) -> None:
        request_id = engine.new_request_id()
        params = SamplingParams(
            temperature=0.0, max_tokens=request.max_tokens, ignore_eos=True,
            **(SAMPLING_EXTRAS if sampling_extras else {}),
        )
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        running[request_id] = request

    for request in workload.requests:
        if request.after is None:
            add(request, list(request.prompt_token_ids))
        else:
            pending[request.after].append(request)
    with tqdm(total=len(workload.requests), desc="Processed prompts", disable=not use_tqdm) as bar:
        while running:
            for output in engine.step():
                if not output.finished:
                    continue
                done = running.pop(output.request_id)
                finished[done.id] = output
                bar.update(1)
                for turn in pending.pop(done.id, []):
                    add(
                        turn,
                        full_prompt(turn, output.prompt_token_ids, output.outputs[0].token_ids),
                    )
    if pending:  # only a malformed workload (a dependency on a missing id) gets here
        raise ValueError(f"requests wait on ids that never ran: {sorted(pending)}")
    return [finished[r.id] for r in workload.requests]


def _maybe_time_modules(times: ModuleTimes | None) -> AbstractContextManager[Any]:
    return times.recording() if times is not None else nullcontext()


@contextmanager
def _maybe_profile(enabled: bool) -> Iterator[Any]:
    if not enabled:
        yield None
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        yield profiler


def _check_fits(workload: Workload, max_model_len: int) -> None:
    prompt_lens = full_prompt_lens(workload.requests)
    for r in workload.requests:
        if prompt_lens[r.id] + r.max_tokens > max_model_len:
            raise ValueError(
                f"request {r.id} needs {prompt_lens[r.id]} + {r.max_tokens} tokens, more "
                f"than the model's max_model_len={max_model_len}"
            )


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def set_threads(threads: int | None) -> None:
    """Pin torch's intra-op threads; on a busy shared machine fewer threads wait less
    on each other (an OpenMP team stalls whenever one of its threads is descheduled)."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def run_isolated(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` in a fresh spawned process; exceptions come back raised."""
    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(fn, *args, **kwargs).result()
