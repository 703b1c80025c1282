"""Stop conditions behave as in vLLM, one test per rule, offline and streaming.

Rules (vLLM's ``check_stop`` and V1 detokenizer): EOS -> "stop" with stop_reason None;
a ``stop_token_ids`` hit -> "stop" with the id; a stop string -> "stop" with the string;
``max_tokens`` or the context's end -> "length". The text of a stop token or EOS that
ended the request is left out unless ``include_stop_str_in_output`` (its id stays in
``token_ids``). ``min_tokens`` masks EOS and stop ids from sampling, and holds back stop
strings, until that many tokens exist.

Expected texts are the engine's own unconstrained greedy outputs for the same prompt
(a prefix of ``n`` tokens is the output of ``max_tokens=n``), and, for the default model,
the texts the issue gives from transformers (" Paris", " Paris.").
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from inflight import LLM, SamplingParams
from inflight.engine.async_engine import AsyncLLMEngine

PROMPT = {"prompt_token_ids": [7, 8, 9]}
N = 16


def greedy(**extra: object) -> SamplingParams:
    options: dict = {"temperature": 0.0, "max_tokens": N, "ignore_eos": True, **extra}
    return SamplingParams(**options)


def generate(llm: LLM, params: SamplingParams, prompt: object = PROMPT):
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]  # type: ignore[arg-type]


def streamed_text(llm: LLM, params: SamplingParams, prompt: object = PROMPT) -> str:
    """The concatenated deltas of the same request through the async engine."""

    async def main() -> str:
        engine = AsyncLLMEngine(llm.llm_engine)
        engine.start()
        try:
            parts = [d.text async for d in engine.generate("s", prompt, params)]  # type: ignore[arg-type]
        finally:
            await engine.shutdown()
        return "".join(parts)

    return asyncio.run(main())


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def free(llm: LLM):
    out = generate(llm, greedy())
    assert len(out.token_ids) == N
    return out


def prefix_text(llm: LLM, n: int) -> str:
    return generate(llm, greedy(max_tokens=n)).text


def first_new(tokens: list[int]) -> int:
    """Index of a token that does not occur before it (so stopping on it is unambiguous)."""
    for i in range(3, len(tokens)):
        if tokens[i] not in tokens[:i]:
            return i
    raise AssertionError("no fresh token in the free run")


@pytest.fixture
def eos_is(llm: LLM) -> Iterator:
    """Make a token the model's (primary) EOS for one test."""
    engine = llm.llm_engine
    saved = engine.eos_token_ids

    def set_eos(*ids: int) -> None:
        engine.eos_token_ids = ids

    yield set_eos
    engine.eos_token_ids = saved


# ---------------------------------------------------------------- stop tokens


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_is_left_out_unless_included(llm: LLM, free, include: bool) -> None:
    i = first_new(free.token_ids)
    params = greedy(stop_token_ids=[free.token_ids[i]], include_stop_str_in_output=include)
    out = generate(llm, params)
    assert out.token_ids == free.token_ids[: i + 1]  # the id stays
    assert (out.finish_reason, out.stop_reason) == ("stop", free.token_ids[i])
    expected = prefix_text(llm, i + 1 if include else i)
    assert out.text == expected
    assert streamed_text(llm, params) == expected


@pytest.mark.parametrize("include", [False, True])
def test_eos_gives_no_stop_reason_and_its_text_is_left_out(
    llm: LLM, free, eos_is, include: bool
) -> None:
    i = first_new(free.token_ids)
    eos_is(free.token_ids[i])
    params = SamplingParams(temperature=0.0, max_tokens=N, include_stop_str_in_output=include)
    out = generate(llm, params)
    assert out.token_ids == free.token_ids[: i + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    expected = prefix_text(llm, i + 1 if include else i)
    assert out.text == expected
    assert streamed_text(llm, params) == expected


def test_a_second_model_eos_id_stops_with_itself_as_stop_reason(llm: LLM, free, eos_is) -> None:
    i = first_new(free.token_ids)
    eos_is(llm.llm_engine.vocab_size - 1, free.token_ids[i])
    out = generate(llm, SamplingParams(temperature=0.0, max_tokens=N))
    assert out.token_ids == free.token_ids[: i + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", free.token_ids[i])
    assert out.text == prefix_text(llm, i)


def test_ignore_eos_runs_past_eos_to_length(llm: LLM, free, eos_is) -> None:
    eos_is(free.token_ids[first_new(free.token_ids)])
    out = generate(llm, greedy())
    assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == (
        free.token_ids, free.text, "length", None
    )


# ---------------------------------------------------------------- min_tokens


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_keeps_eos_from_being_sampled(llm: LLM, free, eos_is, ignore_eos) -> None:
    i = first_new(free.token_ids)
    eos = free.token_ids[i]
    eos_is(eos)
    k = i + 3
    out = generate(llm, greedy(min_tokens=k, ignore_eos=ignore_eos))
    # Up to the EOS position nothing changes; there a different token is chosen, and EOS
    # never appears among the first min_tokens tokens (vLLM masks it, ignore_eos or not).
    assert out.token_ids[:i] == free.token_ids[:i]
    assert eos not in out.token_ids[:k]
    assert out.token_ids[i] != eos


def test_min_tokens_keeps_stop_token_ids_from_being_sampled(llm: LLM, free) -> None:
    i = first_new(free.token_ids)
    stop = free.token_ids[i]
    out = generate(llm, greedy(stop_token_ids=[stop], min_tokens=i + 2))
    assert out.token_ids[:i] == free.token_ids[:i] and stop not in out.token_ids[: i + 2]


def test_requests_without_min_tokens_are_unchanged_beside_one_with_it(llm: LLM, free) -> None:
    stop = free.token_ids[first_new(free.token_ids)]
    prompts = [PROMPT, {"prompt_token_ids": [7, 8, 9]}]
    outs = llm.generate(prompts, [greedy(stop_token_ids=[stop], min_tokens=N), greedy()],
                        use_tqdm=False)
    assert outs[1].outputs[0].token_ids == free.token_ids


def expected_with_min_tokens(llm: LLM, stop: str, min_tokens: int) -> tuple[str, int] | None:
    """vLLM's rule: the stop string is searched from the (min_tokens+1)-th token on, in
    text after the first min_tokens tokens' text (less len(stop) - 1 characters)."""
    floor = max(0, len(prefix_text(llm, min_tokens)) - len(stop) + 1)
    for n in range(min_tokens + 1, N + 1):
        text = prefix_text(llm, n)
        index = text.find(stop, floor)
        if index != -1:
            return text[:index], n
    return None


def test_min_tokens_holds_back_stop_strings(llm: LLM, free) -> None:
    words = free.text.split()
    stop = next(w for w in words if words.count(w) == 1 and free.text.index(w) > 0)
    where = free.text.index(stop)
    # The first token whose text reaches the stop string: without min_tokens it stops there.
    n_plain = next(n for n in range(1, N + 1) if stop in prefix_text(llm, n))
    plain = generate(llm, greedy(stop=[stop]))
    assert (plain.text, len(plain.token_ids)) == (free.text[:where], n_plain)
    # With min_tokens past that token, the string is not searched in those tokens' text.
    params = greedy(stop=[stop], min_tokens=n_plain + 1)
    held = generate(llm, params)
    expected = expected_with_min_tokens(llm, stop, n_plain + 1)
    if expected is None:
        assert (held.text, held.finish_reason) == (free.text, "length")
    else:
        assert (held.text, len(held.token_ids), held.stop_reason) == (*expected, stop)
    assert streamed_text(llm, params) == held.text


# ---------------------------------------------------------------- lengths


@pytest.fixture(scope="module")
def short_llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), max_model_len=32)


def test_max_tokens_none_runs_to_the_context_limit(short_llm: LLM) -> None:
    out = generate(short_llm, greedy(max_tokens=None), {"prompt_token_ids": list(range(3, 30))})
    assert (len(out.token_ids), out.finish_reason, out.stop_reason) == (5, "length", None)


def test_max_tokens_past_the_context_ends_with_length_at_the_context(short_llm: LLM) -> None:
    # vLLM offline: no error; generation stops when the context is full.
    prompt = {"prompt_token_ids": list(range(3, 30))}
    out = generate(short_llm, greedy(max_tokens=20), prompt)
    assert (len(out.token_ids), out.finish_reason) == (5, "length")
    assert out.token_ids == generate(short_llm, greedy(max_tokens=5), prompt).token_ids


def test_a_prompt_filling_the_context_is_rejected_in_vllms_words(short_llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"^This model's maximum context length is 32 tokens\. "
                       r"However, your prompt contains 32 input tokens, which leaves no room "
                       r"for an output token"):
        generate(short_llm, greedy(), {"prompt_token_ids": list(range(3, 35))})
    with pytest.raises(ValueError, match=r"^This model's maximum context length is 32 tokens\. "
                       r"However, your prompt contains 33 input tokens, which exceeds this "
                       r"limit even without any output tokens"):
        generate(short_llm, greedy(), {"prompt_token_ids": list(range(3, 36))})


def test_an_empty_prompt_is_rejected_in_vllms_words(short_llm: LLM) -> None:
    with pytest.raises(ValueError, match="^The decoder prompt cannot be empty$"):
        generate(short_llm, greedy(), {"prompt_token_ids": []})


# ---------------------------------------------------------------- the issue's examples


@pytest.fixture(scope="module")
def smollm() -> LLM:
    return LLM(max_num_seqs=4)


CAPITAL = "The capital of France is"


def test_issue_min_tokens_holds_back_the_stop_string(smollm: LLM) -> None:
    free = generate(smollm, SamplingParams(temperature=0, max_tokens=24), CAPITAL)
    assert free.text.startswith(" Paris.")  # transformers' greedy answer (the issue)
    eos = smollm.llm_engine.eos_token_ids
    assert not set(eos) & set(free.token_ids[:8]), "masking EOS must change nothing here"
    params = SamplingParams(temperature=0, max_tokens=24, stop=["."], min_tokens=8)
    out = generate(smollm, params, CAPITAL)
    assert len(out.token_ids) > 2 and out.text != " Paris"
    # vLLM's rule against the free run: the first "." after the 8th token's text.
    floor = len(smollm.get_tokenizer().decode(free.token_ids[:8]))
    index = free.text.find(".", floor)
    assert out.text == (free.text if index == -1 else free.text[:index])
    assert streamed_text(smollm, params, CAPITAL) == out.text


@pytest.mark.parametrize("include, text", [(False, " Paris"), (True, " Paris.")])
def test_issue_stop_token_ids(smollm: LLM, include: bool, text: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[30],
                            include_stop_str_in_output=include)
    out = generate(smollm, params, CAPITAL)
    assert (out.text, out.token_ids[-1], out.finish_reason, out.stop_reason) == (
        text, 30, "stop", 30
    )
    assert streamed_text(smollm, params, CAPITAL) == text


@pytest.mark.parametrize("skip", [True, False])
def test_issue_chat_eos_text_is_left_out(smollm: LLM, skip: bool) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0, max_tokens=40, skip_special_tokens=skip)
    out = smollm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    assert out.text.endswith("Paris.") and "<|im_end|>" not in out.text
    assert (out.token_ids[-1], out.finish_reason, out.stop_reason) == (
        smollm.llm_engine.eos_token_ids[0], "stop", None
    )
    included = SamplingParams(temperature=0, max_tokens=40, skip_special_tokens=skip,
                              include_stop_str_in_output=True)
    with_eos = smollm.chat(messages, included, use_tqdm=False)[0].outputs[0].text
    assert with_eos == out.text + ("" if skip else "<|im_end|>")


# ---------------------------------------------------------------- multi-byte characters


@pytest.mark.parametrize("prompt", ["Write the emoji for a smile:", "日本の首都は"])
def test_text_cut_inside_a_character_keeps_every_whole_one(smollm: LLM, prompt: str) -> None:
    """max_tokens may end a request between the tokens of one emoji or CJK character; its
    text is then every whole character (the tokenizer's decode less the trailing U+FFFD),
    whole or streamed, with or without stop strings (which decode token by token)."""
    tokenizer = smollm.get_tokenizer()
    cut_inside = 0
    for max_tokens in range(1, 13):
        params = SamplingParams(temperature=0, max_tokens=max_tokens)
        out = generate(smollm, params, prompt)
        decoded = tokenizer.decode(out.token_ids)
        cut_inside += decoded.endswith("\ufffd")
        assert out.text == decoded.rstrip("\ufffd"), max_tokens
        with_stop = SamplingParams(temperature=0, max_tokens=max_tokens, stop=["never seen"])
        assert generate(smollm, with_stop, prompt).text == out.text
        assert streamed_text(smollm, params, prompt) == out.text
    assert cut_inside >= 3  # the prompts really do cut characters
