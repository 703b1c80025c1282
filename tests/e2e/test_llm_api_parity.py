"""vLLM's offline API as its users call it: faults a fresh user found, each by kind.

Expected outputs are the engine's own greedy outputs for the same prompts run alone and
sequentially (themselves checked against transformers in tests/e2e/test_parity_*).
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from inflight import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5 + i, 6 + i, 7 + i]} for i in range(4)]
TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), max_num_seqs=8)


def texts(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_calls_from_several_threads_take_turns(llm: LLM) -> None:
    """(Two threads' generate calls stepped the engine at once, took each other's
    outputs, failed with an IndexError from the model, then hung.) They take turns, and
    each gets its own prompts' greedy outputs."""
    expected = [texts(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)),
                texts(llm.generate(PROMPTS[2:], GREEDY, use_tqdm=False))]
    results: dict[int, list] = {0: [], 1: []}
    errors: list[BaseException] = []

    def worker(which: int) -> None:
        try:
            for _ in range(6):
                outputs = llm.generate(PROMPTS[2 * which:2 * which + 2], GREEDY, use_tqdm=False)
                results[which].append(texts(outputs))
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(t.is_alive() for t in threads), "a generate call hung"
    assert errors == []
    assert results == {0: [expected[0]] * 6, 1: [expected[1]] * 6}
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_call_from_inside_a_running_call_raises(llm: LLM) -> None:
    with llm._exclusive(), pytest.raises(RuntimeError, match="inside a running LLM call"):
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    assert texts(llm.generate(PROMPTS[0], GREEDY, use_tqdm=False))  # still usable


def test_reused_sampling_params_follow_their_changes(llm: LLM) -> None:
    """(The engine cached the bad words' token ids on the caller's object, so removing
    them later changed nothing.) The caller's params are not written to."""
    plain = texts(llm.generate(PROMPTS[0], GREEDY, use_tqdm=False))[0]
    word = llm.llm_engine.tokenizer.decode([plain[0]]).strip()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, bad_words=[word])
    banned = texts(llm.generate(PROMPTS[0], params, use_tqdm=False))[0]
    assert plain[0] not in banned
    assert params._bad_words_token_ids == ()  # the engine used its own copy
    params.bad_words = None
    assert texts(llm.generate(PROMPTS[0], params, use_tqdm=False))[0] == plain


def test_chat_gives_the_rendered_prompt_and_renders_tools(llm: LLM) -> None:
    messages = [{"role": "user", "content": "w3 w4"}]
    out = llm.chat(messages, GREEDY, use_tqdm=False, chat_template=TEMPLATE)[0]
    assert out.prompt == "user w3 w4 "  # vLLM's RequestOutput.prompt: the rendered text
    tokenizer = llm.llm_engine.tokenizer
    assert out.prompt_token_ids == list(tokenizer.encode(out.prompt, add_special_tokens=False))
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    with_tools = llm.chat(messages, GREEDY, use_tqdm=False, chat_template=TEMPLATE,
                          tools=tools)[0]
    # This template knows no tools: the server's default, the Hermes tool prompt.
    assert with_tools.prompt is not None and "<tools>" in with_tools.prompt
    assert '"lookup"' in with_tools.prompt
    with pytest.raises(ValueError, match="tools"):
        llm.chat(messages, GREEDY, use_tqdm=False, chat_template=TEMPLATE,
                 tools=[{"type": "function"}])


def test_vllm_s_neutral_arguments_are_accepted_and_others_refused(llm: LLM) -> None:
    expected = texts(llm.generate(PROMPTS[0], GREEDY, use_tqdm=False))
    assert texts(llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, lora_request=None)) == expected
    with pytest.raises(ValueError, match="lora_request"):
        llm.generate(PROMPTS[0], GREEDY, use_tqdm=False, lora_request=object())
    # vLLM's per-prompt list: all None is no adapter (was refused).
    assert texts(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False,
                              lora_request=[None, None])) == texts(
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False))
    with pytest.raises(ValueError, match="lora_request"):
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False, lora_request=[None, object()])
    # tokenization_kwargs: empty is accepted, anything else refused by name (was a TypeError).
    assert texts(llm.generate(PROMPTS[0], GREEDY, use_tqdm=False,
                              tokenization_kwargs={})) == expected
    with pytest.raises(ValueError, match="tokenization_kwargs.*truncation"):
        llm.generate("w3", GREEDY, use_tqdm=False, tokenization_kwargs={"truncation": True})
    with pytest.raises(NotImplementedError, match="get_metrics.*/metrics"):
        llm.get_metrics()
    # model_config names what was loaded (was None for a model given as a path or the default).
    assert llm.llm_engine.model_config.model == llm.llm_engine.model_path
    messages = [{"role": "user", "content": "w3"}]
    chat = llm.chat(messages, GREEDY, use_tqdm=False, chat_template=TEMPLATE,
                    lora_request=None, mm_processor_kwargs=None,
                    chat_template_content_format="string")
    assert chat[0].outputs[0].finished()  # a method, as vLLM's CompletionOutput.finished
    for bad, match in (({"mm_processor_kwargs": {"size": 1}}, "mm_processor_kwargs"),
                       ({"chat_template_content_format": "markdown"},
                        "chat_template_content_format")):
        with pytest.raises(ValueError, match=match):
            llm.chat(messages, GREEDY, use_tqdm=False, chat_template=TEMPLATE, **bad)


def test_empty_batches_and_apis_it_does_not_offer_answer_as_vllm(llm: LLM) -> None:
    """Found by running the same calls on vLLM 0.32: no prompts is no outputs (was a
    ValueError); the pooling API and sleep mode are refused by name (were AttributeErrors);
    a single message dict instead of a list is a TypeError saying so (was KeyError 0)."""
    from inflight.beam_search import BeamSearchParams

    assert llm.generate([], GREEDY, use_tqdm=False) == []
    assert llm.chat([], GREEDY, use_tqdm=False, chat_template=TEMPLATE) == []
    assert llm.beam_search([], BeamSearchParams(beam_width=2, max_tokens=2)) == []
    for method in ("encode", "embed", "classify", "score", "reward"):
        with pytest.raises(ValueError, match=f"LLM.{method}.*pooling models"):
            getattr(llm, method)(["w3"])
    with pytest.raises(NotImplementedError, match="LLM.sleep"):
        llm.sleep()
    with pytest.raises(NotImplementedError, match="LLM.wake_up"):
        llm.wake_up()
    with pytest.raises(TypeError, match="messages must be a list.*got dict"):
        llm.chat({"role": "user", "content": "w3"}, GREEDY, use_tqdm=False)  # type: ignore[arg-type]
    # the engine still serves
    assert texts(llm.generate(PROMPTS[0], GREEDY, use_tqdm=False))[0]


def test_from_optional_clamps_logit_bias_as_vllm_does() -> None:
    """(vLLM's ``from_optional`` clamps biases to [-100, 100]; ours refused them.) The
    constructor still refuses them, and what is not a number is refused either way."""
    params = SamplingParams.from_optional(logit_bias={"5": 1000.0, 6: -250, 7: 3})
    assert params.logit_bias == {5: 100.0, 6: -100.0, 7: 3.0}
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={5: 150.0})
    for bad in (float("nan"), "high"):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams.from_optional(logit_bias={5: bad})


def test_numpy_integer_token_ids_are_token_ids(llm: LLM) -> None:
    ids = PROMPTS[1]["prompt_token_ids"]
    expected = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    as_numpy = [np.int64(t) for t in ids]
    out = llm.generate({"prompt_token_ids": as_numpy}, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    assert out.prompt_token_ids == ids and all(type(t) is int for t in out.prompt_token_ids)
    with pytest.raises(ValueError, match="integers"):
        llm.generate({"prompt_token_ids": [np.bool_(True)]}, GREEDY, use_tqdm=False)


def test_vllm_s_dtype_names(tiny_llama_dir: Path) -> None:
    engine = LLM(str(tiny_llama_dir), dtype="float").llm_engine
    assert engine.config.model.dtype == "float32"
    with pytest.raises(ValueError, match="float16"):  # 'half' is float16: CUDA only here
        LLM(str(tiny_llama_dir), dtype="half", device="cpu")
