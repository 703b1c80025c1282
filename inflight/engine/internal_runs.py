"""Requests the engine runs on itself, then forgets: the warm-up and W8A8 calibration.

Both add ordinary requests through :meth:`LLMEngine.add_request`, step until they finish
and then call :meth:`LLMEngine.forget_history`, so the cached blocks, prefix-cache counters,
step trace and timings they leave do not show in what clients see.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from inflight.sampling_params import SamplingParams

if TYPE_CHECKING:
    from inflight.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


def warm_up(engine: LLMEngine, num_prompt_tokens: int = 256, num_decode_steps: int = 4) -> float:
    """Run one throwaway request (a prompt of ``num_prompt_tokens``, then
    ``num_decode_steps`` decodes) so the one-off costs of the first forward passes (weight
    packing, kernel loading, first allocations: seconds on CPU) are paid before a client's
    first request, as vLLM's start-up dummy run does; then forget it. Raises RuntimeError
    while a request is in flight. Returns the seconds it took."""
    if engine.has_unfinished_requests():
        raise RuntimeError("warm_up() needs an idle engine")
    started = time.monotonic()
    capacity = engine.kv_cache.num_blocks * engine.kv_cache.block_size
    num_decode_steps = max(1, num_decode_steps)
    length = max(1, min(num_prompt_tokens, engine.max_model_len - num_decode_steps - 1,
                        capacity - num_decode_steps))
    params = SamplingParams(temperature=0.0, max_tokens=num_decode_steps, ignore_eos=True)
    # Two prompts of different lengths: batched prefill and decode, as clients send.
    run(engine, "inflight-warmup", [
        [1 + (index + i) % (engine.vocab_size - 1) for i in range(size)]
        for index, size in enumerate((length, max(1, length // 2)))
    ], params)
    engine.forget_history()
    return time.monotonic() - started


def calibrate_w8a8(engine: LLMEngine) -> None:
    """``quantization="w8a8"``: run the calibration texts through the dense model to find
    each linear's input range per column, then switch the decoder layers to smoothed int8
    weights (model/w8a8.py)."""
    from inflight.model import w8a8

    model = engine.runner.model
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    with w8a8.dense_only(model), w8a8.ActivationRanges(model) as ranges:
        for index, text in enumerate(w8a8.CALIBRATION_TEXTS):
            ids = list(engine.tokenizer.encode(text))[: max(1, engine.max_model_len - 2)]
            # One text at a time, so its steps (and their rounding) do not depend on
            # max_num_seqs; whole in one step unless the token budget is under ~50.
            run(engine, f"inflight-calibration-{index}", [ids], params)
    count = w8a8.quantize_linears(model, ranges.maxima)
    engine.forget_history()
    logger.info("w8a8: %d linear layers in int8, smoothed from %d calibration texts",
                count, len(w8a8.CALIBRATION_TEXTS))


def run(engine: LLMEngine, name: str, prompts: list[list[int]], params: SamplingParams) -> None:
    """Add ``prompts`` as requests ``{name}-{i}`` and step until none is unfinished."""
    for index, ids in enumerate(prompts):
        engine.add_request(f"{name}-{index}", {"prompt_token_ids": ids}, params)
    while engine.has_unfinished_requests():
        engine.step()
