"""vLLM's stop semantics in the core, and its range checks on every request value.

Expected values come from vLLM's ``check_stop`` (``vllm/v1/core/sched/utils.py``), its
``SamplingParams.update_from_generation_config`` and its OpenAI protocol (seed bounded to
torch.long). The fake model's own unconstrained output says which tokens occur.
"""

from __future__ import annotations

import math

import pytest
from fake_engine import Spec, drive, make_scheduler, reference_output

from inflight.core.request import Request
from inflight.sampling_params import InvalidRequestError, SamplingParams

PROMPT = (5, 17, 301, 42, 7, 999)


def free_run(n: int = 12) -> list[int]:
    tokens, _ = reference_output(Spec("x", PROMPT, max_tokens=n))
    assert len(set(tokens)) == len(tokens)
    return tokens


def run_one(spec: Spec, **config: object) -> tuple[list[int], str | None, int | str | None]:
    result = drive(make_scheduler(**config), arrivals={0: [spec.make()]})
    rid = spec.request_id
    return result.outputs[rid], result.finish_reasons[rid], result.stop_reasons[rid]


# ---------------------------------------------------------------- finish / stop reasons


def test_primary_eos_gives_stop_and_no_stop_reason() -> None:
    tokens = free_run()
    assert run_one(Spec("a", PROMPT, max_tokens=12, eos=(tokens[2],))) == (
        tokens[:3], "stop", None
    )


def test_stop_token_id_gives_stop_and_the_id_as_stop_reason() -> None:
    tokens = free_run()
    spec = Spec("a", PROMPT, max_tokens=12, stop_token_ids=(tokens[4],))
    assert run_one(spec) == (tokens[:5], "stop", tokens[4])


def test_a_generation_config_eos_id_acts_as_a_stop_token() -> None:
    # vLLM merges the generation config's extra EOS ids into stop_token_ids (unless
    # ignore_eos), so hitting one reports it as stop_reason.
    tokens = free_run()
    spec = Spec("a", PROMPT, max_tokens=12, eos=(99999, tokens[3]))
    assert run_one(spec) == (tokens[:4], "stop", tokens[3])
    ignored = Spec("b", PROMPT, max_tokens=12, eos=(99999, tokens[3]), ignore_eos=True)
    assert run_one(ignored) == (tokens, "length", None)


def test_max_tokens_gives_length_and_no_stop_reason() -> None:
    assert run_one(Spec("a", PROMPT, max_tokens=3)) == (free_run()[:3], "length", None)


def test_ignore_eos_with_min_tokens_runs_to_max_tokens() -> None:
    tokens = free_run()
    spec = Spec("a", PROMPT, max_tokens=12, eos=(tokens[1],), ignore_eos=True, min_tokens=4)
    assert run_one(spec) == (tokens, "length", None)


def test_max_tokens_beyond_the_context_ends_with_length_at_the_context() -> None:
    # vLLM offline: prompt + max_tokens > max_model_len runs until the context is full.
    out, reason, stop_reason = run_one(Spec("a", PROMPT, max_tokens=50), max_model_len=9)
    assert (out, reason, stop_reason) == (free_run()[:3], "length", None)


def test_max_tokens_none_means_up_to_max_model_len() -> None:
    request = Request("a", list(PROMPT), SamplingParams(max_tokens=None))
    make_scheduler(max_model_len=20).add_request(request)
    assert request.max_output_tokens == 20 - len(PROMPT)


# ---------------------------------------------------------------- min_tokens masking


def suppressed_per_step(spec: Spec) -> list[tuple[int, ...]]:
    result = drive(make_scheduler(), arrivals={0: [spec.make()]})
    return [s.output.scheduled[0].suppressed_token_ids for s in result.steps]


def test_min_tokens_suppresses_every_stop_and_eos_id_until_met() -> None:
    spec = Spec("a", PROMPT, max_tokens=6, eos=(3, 4), stop_token_ids=(9,), min_tokens=2)
    # vLLM's all_stop_token_ids: stop ids plus every EOS id, for the first 2 samples.
    assert suppressed_per_step(spec) == [(3, 4, 9), (3, 4, 9), (), (), (), ()]


def test_min_tokens_suppresses_eos_even_with_ignore_eos() -> None:
    spec = Spec("a", PROMPT, max_tokens=3, eos=(3,), ignore_eos=True, min_tokens=1)
    assert suppressed_per_step(spec) == [(3,), (), ()]


def test_nothing_is_suppressed_without_min_tokens() -> None:
    assert suppressed_per_step(Spec("a", PROMPT, max_tokens=3, eos=(3,))) == [(), (), ()]


def test_chunks_that_do_not_sample_suppress_nothing() -> None:
    spec = Spec("a", PROMPT, max_tokens=2, eos=(3,), min_tokens=2)
    result = drive(
        make_scheduler(max_num_batched_tokens=4, max_model_len=64, enable_chunked_prefill=True),
        arrivals={0: [spec.make()]},
    )
    items = [s.output.scheduled[0] for s in result.steps]
    assert [(i.sample, i.suppressed_token_ids) for i in items] == [
        (False, ()), (True, (3,)), (True, (3,))
    ]


# ---------------------------------------------------------------- value ranges


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"seed": 18446744073709551616}, "seed"),  # the seed: 2**64
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": True}, "seed"),
        ({"max_tokens": 2**63}, "max_tokens"),
        ({"min_tokens": 2**63, "max_tokens": None}, "min_tokens"),
        ({"min_tokens": 1.5}, "min_tokens"),
        ({"top_k": 2**63}, "top_k"),
        ({"stop_token_ids": [2**63]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": 10**400}, "temperature"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"skip_special_tokens": 1}, "skip_special_tokens"),
        ({"include_stop_str_in_output": None}, "include_stop_str_in_output"),
        ({"stop": ["x"], "detokenize": False}, "stop"),
    ],
)
def test_values_outside_what_the_engine_can_use_are_rejected(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequestError, match=field) as caught:
        SamplingParams(**kwargs)
    assert caught.value.parameter == field
    assert isinstance(caught.value, ValueError)


@pytest.mark.parametrize("seed", [0, -2, 2**63 - 1, -(2**63)])
def test_the_whole_torch_long_range_of_seeds_is_accepted(seed: int) -> None:
    assert SamplingParams(seed=seed).seed == seed


def test_seed_minus_one_means_no_seed_as_in_vllm() -> None:
    assert SamplingParams(seed=-1).seed is None


def test_boolean_logprobs_are_counts_as_in_vllm() -> None:
    params = SamplingParams(logprobs=True, prompt_logprobs=False)
    assert (params.logprobs, params.prompt_logprobs) == (1, 0)
    assert type(params.logprobs) is int and type(params.prompt_logprobs) is int


def test_a_bool_priority_is_rejected() -> None:
    scheduler = make_scheduler()
    request = Request("a", list(PROMPT), SamplingParams(), priority=True)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="priority"):
        scheduler.add_request(request)
    assert not scheduler.requests


def test_an_empty_prompt_gets_vllms_message() -> None:
    with pytest.raises(ValueError, match="^The decoder prompt cannot be empty$"):
        make_scheduler().add_request(Spec("a", ()).make())
