"""Calibration: time real engine steps of known shapes and fit the step cost model.

This module owns the calibration sweep. It drives a real engine (the step trace on)
through short phases whose steps cover the cost model's features:

* decode batches: ``B`` prompts of ``L`` tokens each, decoded for a few steps, for every
  batch size ``B`` and context length ``L`` (skipping those over ``max_prompt_tokens``);
* prefill chunks: one prompt of each length in ``prefill_lens`` (chunked by the budget);
* mixed steps: a prompt arriving while a batch decodes.

Prompts are random distinct token ids (no prefix-cache hits); requests are greedy with
EOS ignored. The trace is then fitted exactly as ``--from-trace`` fits a trace recorded
elsewhere (:func:`inflight.planner.cost_model.fit_trace`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from inflight.engine.step_trace import StepRecord
from inflight.planner.cost_model import CostModel, fit_trace


@dataclass(frozen=True, slots=True)
class CalibrationPlan:
    batch_sizes: tuple[int, ...] = (1, 4, 16, 32)
    context_lens: tuple[int, ...] = (32, 256, 1024)
    prefill_lens: tuple[int, ...] = (64, 512, 1024)
    decode_steps: int = 6
    # A decode phase's prompts hold at most this many tokens in all (prefill is slow).
    max_prompt_tokens: int = 4096
    seed: int = 0

    def num_kv_blocks(self, block_size: int) -> int:
        """Blocks enough for the largest phase of the sweep."""
        longest = max(self.max_prompt_tokens, *self.prefill_lens)
        per_request = self.decode_steps + 2 + block_size  # generated tokens, partial blocks
        return (longest + max(self.batch_sizes) * 2 * per_request) // block_size + 64

    def decode_phases(self, max_model_len: int) -> list[tuple[int, int]]:
        return [
            (b, length)
            for length in self.context_lens
            for b in self.batch_sizes
            if b * length <= self.max_prompt_tokens and length + self.decode_steps < max_model_len
        ]


class _Driver:
    """Adds requests to a live engine and steps it; the engine records the trace."""

    def __init__(self, engine: Any, seed: int) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self.low = min(1000, engine.vocab_size // 8)

    def add(self, prompt_len: int, max_tokens: int) -> None:
        from inflight.sampling_params import SamplingParams

        ids = [self.rng.randrange(self.low, self.engine.vocab_size) for _ in range(prompt_len)]
        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
        )
        self.engine.add_request(self.engine.new_request_id(), {"prompt_token_ids": ids}, params)

    def steps(self, count: int | None = None) -> None:
        """``count`` steps, or until nothing is left to do."""
        done = 0
        while self.engine.has_unfinished_requests() and (count is None or done < count):
            self.engine.step()
            done += 1


def run_sweep(engine: Any, plan: CalibrationPlan) -> list[StepRecord]:
    """Drive ``engine`` (an ``LLMEngine`` with ``record_trace=True``) through the plan."""
    driver = _Driver(engine, plan.seed)
    max_len = engine.max_model_len
    driver.add(16, 4)  # warm-up, not recorded: first steps pay one-off allocations
    driver.steps()
    engine.step_trace.clear()
    for batch, length in plan.decode_phases(max_len):
        for _ in range(batch):
            driver.add(length, plan.decode_steps)
        driver.steps()
    for length in plan.prefill_lens:
        if length < max_len:
            driver.add(length, 1)
            driver.steps()
    for batch in plan.batch_sizes[1:3]:
        for length in plan.prefill_lens[:2]:
            for _ in range(batch):
                driver.add(64, plan.decode_steps + 2)
            driver.steps(2)
            driver.add(length, 2)
            driver.steps()
    return list(engine.step_trace.records)


def calibrate(
    model: str | None, options: dict[str, Any], plan: CalibrationPlan, threads: int | None = None
) -> tuple[CostModel, list[StepRecord]]:
    """Load the model, run the sweep, fit; returns the fit and the trace it came from."""
    from inflight import LLM
    from inflight.bench.engine_run import set_threads
    from inflight.worker.kv_cache import bytes_per_block

    set_threads(threads)
    options = {**options, "record_trace": True, "batching": "continuous"}
    options["max_num_seqs"] = max(options.get("max_num_seqs") or 1, max(plan.batch_sizes))
    if options.get("num_kv_blocks") is None:
        # Room for the largest phase only: mapping a 2 GiB default cache would cost more
        # than the sweep, and step time depends on the blocks read, not on those held.
        options["num_kv_blocks"] = plan.num_kv_blocks(options.get("block_size") or 16)
    engine = LLM(model, **options).llm_engine
    engine.populate_kv_cache()
    records = run_sweep(engine, plan)
    runner = engine.runner
    kv_bytes = bytes_per_block(runner.model.arch, 1, runner.kv_caches[0].k.dtype)
    info = {
        "model": engine.model_path,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "device": str(engine.device),
        "threads": _torch_threads(),
        "plan": {k: getattr(plan, k) for k in plan.__dataclass_fields__},
    }
    cost = fit_trace(
        records, source=f"inflight calibrate ({engine.model_path}, {info['dtype']})",
        kv_bytes_per_token=kv_bytes, max_model_len=engine.max_model_len, info=info,
    )
    return cost, records


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()
