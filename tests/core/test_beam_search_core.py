"""The beam search's bookkeeping (inflight.beam_search) on made-up logprobs: which beams
live, which finish, how length_penalty ranks them, where max_model_len cuts."""

from __future__ import annotations

import pytest

from inflight.beam_search import (
    BeamSearchInstance,
    BeamSearchParams,
    check_beam_search,
    get_beam_search_score,
)
from inflight.outputs import Logprob
from inflight.sampling_params import InvalidRequestError

EOS = 0
PROMPT = [7, 8]


def step(**logprobs: float) -> dict[int, Logprob]:
    """{token: logprob} from keyword names t<id>=value, in the order given."""
    return {int(name[1:]): Logprob(value) for name, value in logprobs.items()}


def search(**options) -> BeamSearchInstance:
    max_len = options.pop("max_len", 100)
    params = BeamSearchParams(beam_width=2, max_tokens=options.pop("max_tokens", 3), **options)
    return BeamSearchInstance(PROMPT, params, (EOS,), max_len=max_len)


def test_eos_candidates_finish_and_the_best_others_live() -> None:
    beams = search()
    assert beams.prompts() == [PROMPT]
    beams.advance([step(t1=-0.1, t0=-0.5, t2=-1.0, t3=-2.0)])
    assert beams.prompts() == [[7, 8, 1], [7, 8, 2]]  # best two non-EOS, best first
    assert [(b.tokens, b.cum_logprob, b.finish_reason) for b in beams.completed] == [
        ([7, 8, 0], -0.5, "stop")
    ]
    # Candidates of both beams compete on their cumulative logprob.
    beams.advance([step(t4=-0.2, t5=-3.0), step(t6=-0.05, t9=-0.1)])
    assert beams.prompts() == [[7, 8, 1, 4], [7, 8, 2, 6]]
    assert [b.cum_logprob for b in beams.beams] == pytest.approx([-0.3, -1.05])


def test_length_penalty_decides_between_a_short_finished_beam_and_longer_live_ones() -> None:
    def run(length_penalty: float) -> list[list[int]]:
        beams = search(length_penalty=length_penalty)
        beams.advance([step(t1=-0.1, t0=-0.5, t2=-1.0)])
        beams.advance([step(t3=-0.3, t4=-0.4), step(t5=-0.1)])
        beams.advance([step(t6=-0.3), step(t5=-0.3)])
        assert beams.done
        return [b.tokens for b in beams.best()]

    # Scores with length_penalty 1: finished [7, 8, 0] -0.5 / 2 (EOS not counted) = -0.25;
    # live [7, 8, 1, 3, 6] -0.7 / 5 = -0.14, [7, 8, 1, 4, 5] -0.8 / 5 = -0.16.
    assert run(1.0) == [[7, 8, 1, 3, 6], [7, 8, 1, 4, 5]]
    # Without it the totals rank: -0.5 beats -0.7 and -0.8.
    assert run(0.0) == [[7, 8, 0], [7, 8, 1, 3, 6]]
    assert get_beam_search_score([7, 8, 0], -0.5, {EOS}, 1.0) == pytest.approx(-0.25)


def test_ignore_eos_keeps_eos_as_an_ordinary_token() -> None:
    beams = search(ignore_eos=True)
    beams.advance([step(t0=-0.1, t1=-0.5, t2=-1.0)])
    assert beams.completed == []
    assert beams.prompts() == [[7, 8, 0], [7, 8, 1]]


def test_max_len_finishes_beams_with_length() -> None:
    beams = search(max_len=4, max_tokens=10)
    beams.advance([step(t1=-0.1, t2=-0.2)])
    assert not beams.done
    beams.advance([step(t3=-0.1), step(t4=-0.1)])
    assert beams.done and beams.prompts() == []
    best = beams.best()
    assert [b.tokens for b in best] == [[7, 8, 1, 3], [7, 8, 2, 4]]
    assert {b.finish_reason for b in best} == {"length"}


def test_all_candidates_eos_ends_the_search_early() -> None:
    beams = search(max_tokens=50)
    beams.advance([step(t0=-0.1)])
    assert beams.done and beams.prompts() == []
    assert [b.tokens for b in beams.best()] == [[7, 8, 0]]


def test_server_result_leaves_out_the_prompt_and_a_final_eos() -> None:
    for include, expected in ((False, [[], [1]]), (True, [[0], [1]])):
        beams = search(max_tokens=1, include_stop_str_in_output=include)
        beams.advance([step(t0=-0.1, t1=-0.5)])
        out = beams.request_output("r", None, decode=lambda ids: " ".join(map(str, ids)))
        assert out.prompt_token_ids == PROMPT and out.finished
        assert [c.token_ids for c in out.outputs] == expected
        assert [c.finish_reason for c in out.outputs] == ["stop", "length"]
        assert [c.index for c in out.outputs] == [0, 1]
        assert [len(c.logprobs or []) for c in out.outputs] == [len(ids) for ids in expected]


@pytest.mark.parametrize(
    ("options", "field"),
    [
        (dict(beam_width=0, max_tokens=4), "beam_width"),
        (dict(beam_width=True, max_tokens=4), "beam_width"),
        (dict(beam_width=2, max_tokens=0), "max_tokens"),
        (dict(beam_width=2, max_tokens=4, temperature=-1.0), "temperature"),
        (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
        (dict(beam_width=2, max_tokens=4, ignore_eos="yes"), "ignore_eos"),
    ],
)
def test_bad_params_are_refused_by_name(options, field) -> None:
    with pytest.raises(InvalidRequestError, match=field) as info:
        BeamSearchParams(**options)
    assert info.value.parameter == field


def test_engine_limits_are_checked_before_any_work() -> None:
    params = BeamSearchParams(beam_width=11, max_tokens=4)
    with pytest.raises(InvalidRequestError, match="max_logprobs=20"):
        check_beam_search(params, 5, max_model_len=100, max_logprobs=20)
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    with pytest.raises(InvalidRequestError, match="maximum context length is 100 tokens.*contains 100 input tokens"):
        check_beam_search(params, 100, max_model_len=100, max_logprobs=20)
    with pytest.raises(InvalidRequestError, match="empty"):
        check_beam_search(params, 0, max_model_len=100, max_logprobs=20)
