"""The naive server's number: a workload through Hugging Face ``generate`` in static batches.

This module owns the transformers baseline: requests in workload order, ``batch_size`` at
a time, prompts left-padded to the longest in the batch, one ``generate`` call per batch
that runs until the batch's longest ``max_tokens`` (greedy, EOS ignored), the next batch
starting only when the whole previous one is done. That is how most people serve a model
without an engine, and it is static batching in its purest form: members that have their
tokens keep being computed until the batch ends.

Each generation step is timestamped (a stopping criterion that never stops is called once
per step), and the run is written as a :class:`StepRecord` trace in the engine's format:
a member past its ``max_tokens`` shows as an idle slot (here the work is even done and
thrown away), so ``inflight plot`` draws it next to inflight's own traces. KV fields are 0:
transformers' cache is not paged.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from inflight.bench.engine_run import (
    WARMUP_MAX_TOKENS,
    WARMUP_PROMPT_LEN,
    RunResult,
    set_threads,
    summarise,
)
from inflight.bench.report import RequestLatency, request_latency
from inflight.bench.workloads import Workload, WorkloadRequest, fit_to_vocab
from inflight.engine.step_trace import ScheduledEntry, StepRecord


def load_hf_model(model: str | None, dtype: str = "float32") -> Any:
    """A transformers model from an HF directory or a GGUF file (dequantised on load)."""
    import torch
    from transformers import AutoModelForCausalLM

    from inflight.model.loader import default_model_path

    path = Path(model or default_model_path()).expanduser()
    torch_dtype = getattr(torch, dtype)
    if path.is_dir():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    else:  # transformers reads GGUF given the folder and the file name
        hf = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch_dtype
        )
    return hf.eval()


def run_transformers(
    workload: Workload,
    model: str | None,
    batch_size: int,
    *,
    dtype: str = "float32",
    warmup: bool = True,
    threads: int | None = None,
    progress: bool | None = None,
) -> RunResult:
    """Run ``workload`` through ``model.generate`` in static batches of ``batch_size``.

    ``progress``: a bar of generation steps on stderr (None: only if it is a terminal).
    """
    import torch
    from tqdm.auto import tqdm

    set_threads(threads)

    hf = load_hf_model(model, dtype)
    workload, folded = fit_to_vocab(workload, hf.config.vocab_size)
    if warmup:
        ids = workload.requests[0].prompt_token_ids[:1] * WARMUP_PROMPT_LEN
        _generate(hf, [WorkloadRequest(-1, ids, WARMUP_MAX_TOKENS)], time.perf_counter())

    records: list[StepRecord] = []
    latencies: list[RequestLatency] = []
    requests = workload.requests
    batches = [
        requests[first : first + batch_size] for first in range(0, len(requests), batch_size)
    ]
    bar = tqdm(
        total=sum(max(r.max_tokens for r in batch) for batch in batches),
        desc=f"transformers, {len(batches)} batch(es)",
        unit="step",
        disable=None if progress is None else not progress,
    )
    started = time.perf_counter()
    with torch.inference_mode(), bar:
        for first in range(0, len(requests), batch_size):
            batch = requests[first : first + batch_size]
            batch_start = time.perf_counter()
            stamps = _generate(hf, batch, batch_start, on_step=lambda: bar.update(1))
            waiting = len(requests) - first - len(batch)
            records += _batch_records(
                batch, batch_size, stamps, batch_start, started, len(records), waiting
            )
            for r in batch:  # a token is "produced" when its step ends, as in the engine
                latencies.append(
                    request_latency(
                        str(r.id),
                        len(r.prompt_token_ids),
                        r.max_tokens,
                        started,
                        stamps[0],
                        stamps[r.max_tokens - 1],
                    )
                )
    wall = time.perf_counter() - started
    report = summarise(
        "transformers static",
        "transformers",
        "static",
        workload,
        wall,
        records,
        batch_size,
        0,
        latencies,
        {
            "model": str(model or "default"),
            "dtype": dtype,
            "batch_size": batch_size,
            "padding": "left",
            "threads": torch.get_num_threads(),
        },
    )
    return RunResult(report, records, folded)


def _generate(
    hf: Any,
    batch: list[WorkloadRequest],
    batch_start: float,
    on_step: Callable[[], object] = lambda: None,
) -> list[float]:
    """One padded ``generate`` call; returns the end time of every step, checking lengths."""
    import torch
    from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

    stamps: list[float] = []

    class _Stamp(StoppingCriteria):  # called once per generated token, never stops
        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            stamps.append(time.perf_counter())
            on_step()
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    width = max(len(r.prompt_token_ids) for r in batch)
    input_ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, r in enumerate(batch):  # left padding: every row's last token lines up
        input_ids[row, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
        mask[row, width - len(r.prompt_token_ids) :] = 1
    longest = max(r.max_tokens for r in batch)
    config = GenerationConfig(
        max_new_tokens=longest,
        min_new_tokens=longest,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    with torch.inference_mode():
        out = hf.generate(
            input_ids,
            attention_mask=mask,
            generation_config=config,
            stopping_criteria=StoppingCriteriaList([_Stamp()]),
        )
    if out.shape[1] - width != longest or len(stamps) != longest:
        raise RuntimeError(f"transformers generated {out.shape[1] - width} of {longest} tokens")
    return stamps


def _batch_records(
    batch: list[WorkloadRequest],
    num_slots: int,
    stamps: list[float],
    batch_start: float,
    origin: float,
    first_step: int,
    waiting: int,
) -> list[StepRecord]:
    """The batch's steps in the engine's trace format (slot = row in the batch)."""
    records = []
    for k, end in enumerate(stamps):
        begin = stamps[k - 1] if k else batch_start
        working = [(slot, r) for slot, r in enumerate(batch) if k < r.max_tokens]
        entries = [
            ScheduledEntry(
                str(r.id),
                slot,
                len(r.prompt_token_ids) if k == 0 else 1,
                "prefill" if k == 0 else "decode",
            )
            for slot, r in working
        ]
        records.append(
            StepRecord(
                step=first_step + k,
                start_time=begin - origin,
                duration_s=end - begin,
                entries=entries,
                preempted=[],
                finished=[str(r.id) for r in batch if r.max_tokens - 1 == k],
                num_running=len(batch),
                num_waiting=waiting,
                kv_blocks_used=0,
                kv_blocks_total=0,
                num_slots=num_slots,
                idle_slots=[slot for slot, r in enumerate(batch) if k >= r.max_tokens],
            )
        )
    return records
