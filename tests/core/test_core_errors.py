"""User errors raise clear ValueErrors and leave the scheduler serving; stop conditions."""

from __future__ import annotations

import math

import pytest
from fake_engine import Spec, assert_matches_reference, drive, make_scheduler, reference_output

from inflight.config import CacheConfig, SchedulerConfig
from inflight.core.request import Request
from inflight.sampling_params import SamplingParams

PROMPT = (5, 17, 301, 42, 7, 999)


# ---------------------------------------------------------------- rejected requests


def test_bad_requests_are_rejected_and_others_keep_running() -> None:
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=32)
    good = [Spec("a", PROMPT, max_tokens=6), Spec("b", PROMPT[:3], max_tokens=4)]
    scheduler.add_request(good[0].make())

    with pytest.raises(ValueError, match="empty"):
        scheduler.add_request(Spec("empty", ()).make())
    with pytest.raises(ValueError, match=r"maximum context length is 32 tokens.*contains 33 input tokens"):
        scheduler.add_request(Spec("long", tuple(range(33)), max_tokens=1).make())
    with pytest.raises(ValueError, match=r"KV blocks.*whole cache has 4"):
        # 6 + 20 - 1 = 25 tokens need 7 blocks of 4; the cache has 4.
        scheduler.add_request(Spec("huge", PROMPT, max_tokens=20).make())
    with pytest.raises(ValueError, match="'a' is already in use"):
        scheduler.add_request(Spec("a", PROMPT[:2], max_tokens=2).make())

    # Nothing of the rejected requests stayed behind.
    assert set(scheduler.requests) == {"a"}
    assert len(scheduler.waiting) == 1
    scheduler.check_invariants()
    result = drive(scheduler, arrivals={1: [good[1].make()]})
    assert_matches_reference(result, good)
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_unbounded_request_on_a_small_cache_runs_until_the_cache_is_full() -> None:
    # max_tokens=None would run to max_model_len=32, but 4 blocks of 4 hold 16 tokens:
    # the request is accepted and ends with "length" once the cache is full (16 cached
    # tokens plus the final sampled one: 17 in all, 11 of them generated).
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=32)
    request = Spec("unbounded", PROMPT, max_tokens=None).make()
    scheduler.add_request(request)
    drive(scheduler)
    assert request.num_output_tokens == 17 - len(PROMPT)
    assert request.status.finish_reason == "length"
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_a_request_that_exactly_fills_the_cache_is_accepted() -> None:
    # 6 + 11 - 1 = 16 cached tokens = 4 blocks of 4: the final token needs no slot.
    spec = Spec("fits", PROMPT, max_tokens=11)
    scheduler = make_scheduler(num_blocks=4, block_size=4)
    result = drive(scheduler, arrivals={0: [spec.make()]})
    assert_matches_reference(result, [spec])


def test_a_finished_request_id_can_be_reused() -> None:
    scheduler = make_scheduler()
    first = Spec("same", PROMPT, max_tokens=2)
    second = Spec("same", PROMPT[:4], max_tokens=3)
    result = drive(scheduler, arrivals={0: [first.make()], 5: [second.make()]})
    assert result.outputs["same"] == reference_output(first)[0] + reference_output(second)[0]


# ---------------------------------------------------------------- parameter validation


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"n": 0}, "n must be"),
        ({"n": -1}, "n must be"),
        ({"best_of": 3, "n": 2}, "best_of is not supported"),
        ({"seed": "x"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"logprobs": -2}, "logprobs"),
        ({"prompt_logprobs": 1.5}, "prompt_logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.01}, "presence_penalty"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be greater than zero"),
        ({"repetition_penalty": -1}, "repetition_penalty"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {5: -101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
    ],
)
def test_sampling_params_reject_bad_values(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_accept_good_values() -> None:
    params = SamplingParams(temperature=0, top_k=-1, stop="end", max_tokens=None, seed=3)
    assert params.is_greedy and params.stop == ["end"] and params.stop_token_ids == []
    assert SamplingParams.from_dict({"max_tokens": 3, "top_p": 0.9}).max_tokens == 3
    # The edges of the documented ranges are accepted; JSON's string keys become ints.
    edge = SamplingParams(
        n=4, presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.01,
        logit_bias={"7": 100, 8: -100}, allowed_token_ids=[3], logprobs=0,
        prompt_logprobs=0, max_tokens=0,
    )
    assert edge.logit_bias == {7: 100, 8: -100} and edge.max_tokens == 0


def test_sampling_params_from_dict_names_unknown_fields() -> None:
    with pytest.raises(ValueError, match="bogus"):
        SamplingParams.from_dict({"bogus": 1, "max_tokens": 3})
    with pytest.raises(ValueError, match="unknown"):
        SamplingParams.from_dict({"_eos_token_ids": (1,)})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_num_seqs": 0},
        {"max_num_batched_tokens": 0},
        {"max_model_len": 1},
        {"scheduling_policy": "lifo"},
        {"batching": "dynamic"},
        {"enable_chunked_prefill": False, "max_num_batched_tokens": 100, "max_model_len": 200},
    ],
)
def test_scheduler_config_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs", [{"block_size": 0}, {"num_kv_blocks": 0}, {"kv_cache_memory_bytes": 0}]
)
def test_cache_config_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        CacheConfig(**kwargs)


# ---------------------------------------------------------------- stop conditions


def free_run(n: int = 12) -> list[int]:
    tokens, _ = reference_output(Spec("x", PROMPT, max_tokens=n))
    assert len(set(tokens)) == len(tokens), "pick a prompt whose fake output has no repeats"
    return tokens


def run_one(spec: Spec, **config: object):
    scheduler = make_scheduler(**config)
    result = drive(scheduler, arrivals={0: [spec.make()]})
    return result.outputs[spec.request_id], result.finish_reasons[spec.request_id], result


def test_eos_stops_with_reason_stop() -> None:
    tokens = free_run()
    out, reason, result = run_one(Spec("a", PROMPT, max_tokens=12, eos=(tokens[3],)))
    assert out == tokens[:4] and reason == "stop"
    assert result.stop_reasons["a"] is None  # vLLM: stop_reason is None for EOS


def test_ignore_eos_runs_to_max_tokens() -> None:
    tokens = free_run()
    out, reason, _ = run_one(Spec("a", PROMPT, max_tokens=12, eos=(tokens[3],), ignore_eos=True))
    assert out == tokens and reason == "length"


def test_stop_token_ids_stop_even_with_ignore_eos() -> None:
    tokens = free_run()
    spec = Spec("a", PROMPT, max_tokens=12, ignore_eos=True, stop_token_ids=(tokens[5],))
    out, reason, result = run_one(spec)
    assert out == tokens[:6] and reason == "stop" and result.stop_reasons["a"] == tokens[5]


def test_min_tokens_suppresses_eos_and_stop_tokens() -> None:
    tokens = free_run()
    out, reason, _ = run_one(Spec("a", PROMPT, max_tokens=12, eos=(tokens[3],), min_tokens=5))
    assert out == tokens and reason == "length"
    out, reason, _ = run_one(
        Spec("b", PROMPT, max_tokens=12, stop_token_ids=(tokens[4],), min_tokens=5)
    )
    assert out == tokens[:5] and reason == "stop"  # the 5th token meets min_tokens


def test_max_tokens_gives_reason_length() -> None:
    out, reason, _ = run_one(Spec("a", PROMPT, max_tokens=1))
    assert out == free_run()[:1] and reason == "length"


@pytest.mark.parametrize("max_tokens", [None, 100])
def test_generation_is_capped_by_max_model_len(max_tokens: int | None) -> None:
    out, reason, _ = run_one(Spec("a", PROMPT, max_tokens=max_tokens), max_model_len=10)
    assert out == free_run()[:4] and reason == "length"


def test_prompt_of_exactly_max_model_len_is_rejected() -> None:
    # vLLM: no room for even one output token is an error, in its words.
    scheduler = make_scheduler(max_model_len=len(PROMPT))
    with pytest.raises(ValueError, match=r"maximum context length is 6 tokens\. However, your "
                       r"prompt contains 6 input tokens, which leaves no room for an output"):
        scheduler.add_request(Spec("a", PROMPT, max_tokens=None).make())
    assert not scheduler.requests


def test_request_max_model_len_is_clamped_to_the_config() -> None:
    scheduler = make_scheduler(max_model_len=10)
    request = Request("a", list(PROMPT), SamplingParams(max_tokens=None))
    scheduler.add_request(request)
    assert request.max_model_len == 10 and request.max_output_tokens == 4
