"""Fuzzing ``SamplingParams`` construction (pure Python, no model).

Property: any keyword arguments either build a valid object (validating it again passes,
and every field has the type the engine relies on) or raise ``InvalidRequestError`` naming
one of the fields passed, never another exception. The regression tests pin the inputs
the fuzzer found crashing with other exceptions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from helpers.fuzz_strategies import sampling_kwargs
from inflight.sampling_params import InvalidRequestError, SamplingParams, StructuredOutputsParams

CASES_TRIED = {"built": 0, "refused": 0}


def _assert_usable(params: SamplingParams) -> None:
    """What the scheduler and sampler rely on after construction."""
    params._validate()  # idempotent: a valid object stays valid
    assert isinstance(params.stop, list) and all(isinstance(s, str) and s for s in params.stop)
    assert isinstance(params.stop_token_ids, list)
    assert all(type(t) is int for t in params.stop_token_ids)
    assert params.logit_bias is None or all(type(t) is int for t in params.logit_bias)
    assert params.bad_words is None or all(isinstance(w, str) for w in params.bad_words)
    assert params.allowed_token_ids is None or all(
        type(t) is int for t in params.allowed_token_ids
    )


@settings(
    max_examples=600, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(kwargs=sampling_kwargs())
def test_construction_succeeds_or_names_the_field(kwargs: dict[str, Any]) -> None:
    try:
        params = SamplingParams(**kwargs)
    except InvalidRequestError as error:
        CASES_TRIED["refused"] += 1
        assert error.parameter in kwargs, (error.parameter, str(error))
        return
    CASES_TRIED["built"] += 1
    _assert_usable(params)


def test_report_cases_tried(report_figure: Callable[[str], None]) -> None:
    """Runs after the property (file order): the figure for the README."""
    total = sum(CASES_TRIED.values())
    report_figure(f"hypothesis SamplingParams cases tried: {total} {dict(CASES_TRIED)}")
    if total:  # zero when this test runs alone
        assert CASES_TRIED["built"] > 0 and CASES_TRIED["refused"] > 0


# ------------------------------------------------ regressions: inputs the fuzzer found

@pytest.mark.parametrize(
    "kwargs, parameter",
    [
        # int(inf) raised OverflowError out of the logit_bias key conversion
        (dict(logit_bias={float("inf"): 1.0}), "logit_bias"),
        (dict(logit_bias={float("-inf"): 1.0}), "logit_bias"),
        # list(5) raised a bare TypeError that named no field
        (dict(stop=5), "stop"),
        (dict(stop_token_ids=5), "stop_token_ids"),
        (dict(allowed_token_ids=7), "allowed_token_ids"),
        (dict(bad_words=3), "bad_words"),
        # a lone string was split into one-character bad words
        (dict(bad_words="w5"), "bad_words"),
        # structured_outputs JSON text nested deeper than the recursion limit
        (dict(structured_outputs={"json": "[" * 5000}), "structured_outputs"),
        (dict(structured_outputs={1: "x"}), "structured_outputs"),
    ],
)
def test_fuzz_regressions(kwargs: dict[str, Any], parameter: str) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        SamplingParams(**kwargs)
    assert raised.value.parameter == parameter


def test_from_dict_with_non_string_keys_names_them() -> None:
    # sorted() over mixed key types raised TypeError before the unknown fields were named
    with pytest.raises(ValueError, match="unknown sampling field"):
        SamplingParams.from_dict({1: 2, "a": 3})  # type: ignore[dict-item]
    with pytest.raises(InvalidRequestError, match="unknown field"):
        StructuredOutputsParams.from_dict({1: 2, "regex": "a"})  # type: ignore[dict-item]
