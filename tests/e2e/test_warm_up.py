"""The server's start-up warm-up run leaves no trace a client could see.

``LLMEngine.warm_up`` runs one throwaway request; afterwards the prefix cache must not
hit on its tokens, the counters must be back at zero, every KV block must be free, and
greedy outputs must equal those of an engine that never warmed up.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from inflight import SamplingParams
from inflight.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _run(engine: LLMEngine, request_id: str, ids: list[int]):  # noqa: ANN202
    engine.add_request(request_id, {"prompt_token_ids": ids}, GREEDY)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    return finished[0]


def test_warm_up_forgets_its_request(tiny_llama_dir: Path) -> None:
    options = dict(block_size=4, record_trace=True)
    cold = LLMEngine.from_options(str(tiny_llama_dir), **options)
    warm = LLMEngine.from_options(str(tiny_llama_dir), **options)
    assert warm.warm_up(num_prompt_tokens=24, num_decode_steps=3) > 0

    kv = warm.kv_cache
    assert kv.prefix_stats.queries == kv.prefix_stats.hits == kv.prefix_stats.requests == 0
    assert warm.scheduler.num_preemptions == 0
    assert warm.step_trace.records == []
    assert kv.num_free_blocks == kv.num_blocks  # nothing held, nothing cached

    # The warm-up's own prompt (ids 1..24) finds nothing cached afterwards.
    same_prompt = list(range(1, 25))
    out_warm = _run(warm, "a", same_prompt)
    out_cold = _run(cold, "a", same_prompt)
    assert out_warm.num_cached_tokens == 0
    assert out_warm.outputs[0].token_ids == out_cold.outputs[0].token_ids
    # The step trace starts at step 0 with the client's request, as on a cold engine.
    assert [(r.step, [e.request_id for e in r.entries]) for r in warm.step_trace.records] == [
        (r.step, [e.request_id for e in r.entries]) for r in cold.step_trace.records
    ]


def test_warm_up_refuses_a_busy_engine(tiny_llama_dir: Path) -> None:
    engine = LLMEngine.from_options(str(tiny_llama_dir))
    engine.add_request("busy", {"prompt_token_ids": [5, 6, 7]}, GREEDY)
    with pytest.raises(RuntimeError, match="idle"):
        engine.warm_up()
