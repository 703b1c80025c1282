"""Memory pressure on the tiny model: a KV cache of a handful of blocks, long requests.

The engine preempts and recomputes (preemptions are counted and must happen), never
livelocks (every request finishes), and each greedy output equals the same prompt run
alone with a large cache. A request that could never fit the whole cache is refused
alone and at once, with a message naming the blocks it needs, while the others finish.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from inflight import LLM, SamplingParams
from inflight.engine.llm_engine import LLMEngine
from inflight.sampling_params import InvalidRequestError

BLOCK_SIZE = 4
NUM_BLOCKS = 20  # 80 token slots; each request below needs up to 59 (15 blocks)
PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(20)] for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(tiny_llama_dir: Path) -> list[list[int]]:
    llm = LLM(str(tiny_llama_dir))  # a large cache: no preemption
    outputs = [
        llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0] for p in PROMPTS
    ]
    assert llm.llm_engine.scheduler.num_preemptions == 0
    return [o.outputs[0].token_ids for o in outputs]


def tiny_cache_engine(tiny_llama_dir: Path) -> LLMEngine:
    return LLMEngine.from_options(
        str(tiny_llama_dir), block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS,
        max_num_seqs=4, max_num_batched_tokens=8,  # recomputing takes several steps
    )


def run_to_end(engine: LLMEngine, max_steps: int = 5_000) -> dict[str, list[int]]:
    """Step until nothing is left, checking block accounting after every step."""
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                assert output.outputs[0].finish_reason == "length", output.outputs[0]
                outputs[output.request_id] = output.outputs[0].token_ids
        engine.scheduler.check_invariants()
    assert not engine.has_unfinished_requests(), f"no end after {max_steps} steps"
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    return outputs


def test_tiny_cache_preempts_and_every_output_equals_running_alone(
    tiny_llama_dir: Path, alone: list[list[int]]
) -> None:
    engine = tiny_cache_engine(tiny_llama_dir)
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(str(index), {"prompt_token_ids": prompt}, GREEDY)
    outputs = run_to_end(engine)
    assert engine.scheduler.num_preemptions > 0
    assert [outputs[str(i)] for i in range(len(PROMPTS))] == alone


def test_a_request_that_can_never_fit_fails_alone_and_at_once(
    tiny_llama_dir: Path, alone: list[list[int]]
) -> None:
    engine = tiny_cache_engine(tiny_llama_dir)
    for index, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(str(index), {"prompt_token_ids": prompt}, GREEDY)
    engine.step()
    too_long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    with pytest.raises(InvalidRequestError, match=r"needs up to 55 KV blocks .* has 20"):
        engine.add_request("huge", {"prompt_token_ids": PROMPTS[2]}, too_long)
    assert "huge" not in engine.scheduler.requests
    outputs = run_to_end(engine)
    assert [outputs["0"], outputs["1"]] == alone[:2]
