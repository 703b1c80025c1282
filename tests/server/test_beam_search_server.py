"""``use_beam_search`` over HTTP with the official ``openai`` client: the choices are the
offline ``LLM.beam_search``'s beams (itself checked against transformers in
tests/e2e/test_beam_search.py), best first, without the prompt; streamed they arrive
whole; fields a beam search cannot honour are 400s that name them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from inflight import LLM, BeamSearchParams

PROMPT = "w10 w11 w12 w13 w14 w15"
BEAM = {"use_beam_search": True, "return_token_ids": True}


def extra(choice: Any, name: str) -> Any:
    return (choice.model_extra or {})[name]


def offline_beams(offline: LLM, prompt_ids: list[int], width: int, max_tokens: int, **kw: Any):
    out = offline.beam_search([prompt_ids], BeamSearchParams(width, max_tokens, **kw))[0]
    return [s.tokens[len(prompt_ids):] for s in out.sequences], out.sequences


def test_completion_choices_are_the_offline_beams(client: openai.OpenAI, offline: LLM) -> None:
    response = client.completions.create(
        model="tiny", prompt=PROMPT, n=3, max_tokens=6, logprobs=2, extra_body=BEAM,
    )
    prompt_ids = list(extra(response.choices[0], "prompt_token_ids"))
    expected, sequences = offline_beams(offline, prompt_ids, 3, 6)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [list(extra(c, "token_ids")) for c in response.choices] == expected
    tokenizer = offline.get_tokenizer()
    for choice, tokens, seq in zip(response.choices, expected, sequences, strict=True):
        assert choice.text == tokenizer.decode(tokens, skip_special_tokens=True)
        assert choice.finish_reason == seq.finish_reason
        # logprobs: one entry per token, its own logprob plus the top 2 (up to 3 entries)
        assert choice.logprobs is not None and len(choice.logprobs.token_logprobs) == len(tokens)
        assert sum(choice.logprobs.token_logprobs) == pytest.approx(seq.cum_logprob, abs=1e-4)
        assert all(1 <= len(top) <= 3 for top in choice.logprobs.top_logprobs)
    assert response.usage.completion_tokens == sum(len(t) for t in expected)
    assert response.usage.prompt_tokens == len(prompt_ids)


def test_streamed_beams_equal_the_whole_answer(client: openai.OpenAI) -> None:
    whole = client.completions.create(
        model="tiny", prompt=PROMPT, n=2, max_tokens=5, extra_body=BEAM,
    )
    texts = {0: "", 1: ""}
    finish = {}
    stream = client.completions.create(
        model="tiny", prompt=PROMPT, n=2, max_tokens=5, stream=True, extra_body=BEAM,
    )
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}


def test_chat_beams_are_the_offline_beams(client: openai.OpenAI, offline: LLM) -> None:
    response = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "w3 w4 w5"}], n=2, max_tokens=4,
        extra_body=BEAM | {"length_penalty": 0.0},
    )
    prompt_ids = list((response.model_extra or {})["prompt_token_ids"])
    expected, _ = offline_beams(offline, prompt_ids, 2, 4, length_penalty=0.0)
    assert [list(extra(c, "token_ids")) for c in response.choices] == expected


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"top_p": 0.5}, "top_p"),
        ({"stop": ["w3"]}, "stop"),
        ({"seed": 3}, "seed"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"n": 11}, "n"),
        ({"use_beam_search": False, "length_penalty": 0.5}, "length_penalty"),
        ({"structured_outputs": {"choice": ["w3"]}}, "structured_outputs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
         "tool_choice"),
        ({"logprobs": True, "top_logprobs": 5, "n": 2}, "top_logprobs"),  # over 2 * n
    ],
)
def test_what_a_beam_search_cannot_honour_is_refused(
    client: openai.OpenAI, body: dict[str, Any], param: str
) -> None:
    known = {k: body.pop(k) for k in list(body) if k in (
        "top_p", "stop", "seed", "n", "response_format", "tools", "tool_choice", "logprobs",
        "top_logprobs")}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "w3"}], max_tokens=3,
            extra_body={"use_beam_search": True} | body, **known,
        )
    assert info.value.status_code == 400
    assert info.value.body["param"] == param  # type: ignore[index]


def test_echo_with_logprobs_is_refused_by_its_own_name(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=PROMPT, n=2, max_tokens=3, echo=True,
                                  logprobs=1, extra_body=BEAM)
    assert info.value.body["param"] == "echo"  # type: ignore[index]


def test_a_step_refused_mid_stream_ends_it_in_band(tiny_llama_dir: Path) -> None:
    """Each search step adds new engine requests after the answer began; one refused then
    (here: the engine says it is overloaded from the second step on) ends a stream with an
    error event and [DONE], and a whole answer with the refusal's own status, never a
    dropped connection."""
    import json

    import httpx
    from inprocess_server import InProcessServer

    from inflight.engine.llm_engine import EngineOverloadedError

    server = InProcessServer(tiny_llama_dir).start()
    engine = server.async_engine
    real_add, calls = engine.add_request, []

    async def overloaded_after_the_first_step(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) > 1:
            raise EngineOverloadedError(1, 1)
        return await real_add(*args, **kwargs)

    engine.add_request = overloaded_after_the_first_step  # type: ignore[method-assign]
    try:
        body = {"model": "tiny", "prompt": PROMPT, "n": 3, "max_tokens": 4,
                "use_beam_search": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            events = [line.removeprefix("data: ") for line in r.iter_lines()
                      if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "engine_overloaded"
        calls.clear()
        whole = httpx.post(f"{server.url}/v1/completions", json=body | {"stream": False},
                           timeout=60)
        assert whole.status_code == 503 and whole.json()["error"]["code"] == "engine_overloaded"
    finally:
        engine.add_request = real_add  # type: ignore[method-assign]
        server.stop()


def test_usage_reports_the_prompt_s_cached_tokens(client: openai.OpenAI) -> None:
    long_prompt = [5 + i for i in range(40)]  # two full blocks of 16 to cache
    runs = [client.completions.create(model="tiny", prompt=long_prompt, n=2, max_tokens=2,
                                      extra_body=BEAM) for _ in range(2)]
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in runs]  # type: ignore[union-attr]
    assert cached[1] == 32 and runs[1].usage.prompt_tokens == 40
