"""What scripts ported from vLLM rely on beyond the basics: the model's generation config
as sampling defaults, vLLM's SamplingParams conveniences and fields, its prompt types, and
LLM() arguments (each case found by a fresh user porting vLLM scripts).

Expected outputs are the engine's own outputs for the equivalent explicit request (the
engine itself is checked against transformers in tests/e2e/test_parity_*).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import inflight
from helpers.tiny_model import with_generation_config
from inflight import LLM, SamplingParams
from inflight.sampling_params import (
    GuidedDecodingParams,
    InvalidRequestError,
    RequestOutputKind,
    SamplingType,
    StructuredOutputsParams,
)
from inflight.structured_output.grammar import closed_objects

PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), max_num_seqs=8)


@pytest.fixture(scope="module")
def smollm2() -> LLM:
    """The default model: structured outputs need a real tokenizer."""
    return LLM(max_num_seqs=4)


@pytest.fixture(scope="module")
def configured_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with sampling defaults in its generation_config.json."""
    return with_generation_config(
        tiny_llama_dir, tmp_path_factory.mktemp("configured") / "tiny",
        max_new_tokens=4, temperature=0.0, repetition_penalty=1.3, top_k=7,
    )


# ------------------------------------------------------------ generation config


def test_the_model_s_generation_config_sets_the_defaults(configured_dir: Path) -> None:
    llm = LLM(str(configured_dir))
    defaults = llm.get_default_sampling_params()
    assert (defaults.max_tokens, defaults.temperature, defaults.repetition_penalty,
            defaults.top_k) == (4, 0.0, 1.3, 7)
    out = llm.generate(PROMPT, use_tqdm=False)[0].outputs[0]
    explicit = SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=1.3)
    assert out.token_ids == llm.generate(PROMPT, explicit, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out.token_ids) == 4
    # The same twice: greedy, as the config says (vLLM's default would sample 16 tokens).
    assert llm.generate(PROMPT, use_tqdm=False)[0].outputs[0].token_ids == out.token_ids
    # A request's own SamplingParams are used as given.
    assert len(llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0.0,
                                                   ignore_eos=True), use_tqdm=False)[0]
               .outputs[0].token_ids) == 6


def test_generation_config_vllm_and_overrides(configured_dir: Path, tmp_path: Path) -> None:
    plain = LLM(str(configured_dir), generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
    overridden = LLM(str(configured_dir), override_generation_config={"max_new_tokens": 2,
                                                                      "top_p": 0.5})
    defaults = overridden.get_default_sampling_params()
    assert (defaults.max_tokens, defaults.top_p, defaults.temperature) == (2, 0.5, 0.0)
    # A folder of its own: its generation_config.json, not the model's.
    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.25}))
    from_folder = LLM(str(configured_dir), generation_config=str(folder))
    assert from_folder.get_default_sampling_params().temperature == 0.25
    assert from_folder.get_default_sampling_params().max_tokens == 16
    with pytest.raises(ValueError, match="no generation_config.json"):
        LLM(str(configured_dir), generation_config=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"override_generation_config\) gives bad sampling defaults"):
        LLM(str(configured_dir), override_generation_config={"temperature": -1})
    # (Unknown keys were dropped in silence, as vLLM drops them: a typo changed nothing.)
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['max_tokens'\]"):
        LLM(str(configured_dir), override_generation_config={"max_tokens": 4})


# ------------------------------------------------------------ SamplingParams


def test_seed_minus_one_means_no_seed(llm: LLM) -> None:
    params = SamplingParams(seed=-1, temperature=1.0, max_tokens=12, ignore_eos=True)
    assert params.seed is None and params.sampling_type is SamplingType.RANDOM
    runs = {tuple(llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids)
            for _ in range(4)}
    assert len(runs) > 1  # 12 tokens from a near-uniform tiny model: never 4 equal draws


def test_logprobs_true_and_minus_one(llm: LLM, tiny_llama_dir: Path) -> None:
    assert SamplingParams(logprobs=True, prompt_logprobs=True).logprobs == 1
    one = llm.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0, logprobs=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(one.logprobs[0]) == 1
    vocab = llm.llm_engine.vocab_size
    with pytest.raises(ValueError, match=f"Requested logprobs of {vocab}, which is greater than max allowed: 20"):
        llm.generate(PROMPT, SamplingParams(max_tokens=1, logprobs=-1), use_tqdm=False)
    unlimited = LLM(str(tiny_llama_dir), max_logprobs=-1)
    out = unlimited.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0, logprobs=-1),
                             use_tqdm=False)[0].outputs[0]
    entry = out.logprobs[0]
    assert len(entry) == vocab
    total = sum(__import__("math").exp(lp.logprob) for lp in entry.values())
    assert total == pytest.approx(1.0, abs=1e-3)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    long = {"prompt_token_ids": [9, 10, 11, 5, 6, 7, 8]}
    truncated = llm.generate(long, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                  truncate_prompt_tokens=4), use_tqdm=False)[0]
    alone = llm.generate(PROMPT, greedy, use_tqdm=False)[0]
    assert truncated.prompt_token_ids == [5, 6, 7, 8]
    assert truncated.outputs[0].token_ids == alone.outputs[0].token_ids
    for bad in (0, -2, 1.5):
        with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)


def test_vllm_s_other_fields_and_methods() -> None:
    params = SamplingParams(temperature=0.5, seed=3, stop_token_ids=[4],
                            spaces_between_special_tokens=False, extra_args={"k": 1},
                            output_kind=RequestOutputKind.FINAL_ONLY)
    assert params.sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams(temperature=0).sampling_type is SamplingType.GREEDY
    copy = params.clone()
    assert copy == params and copy is not params and copy.extra_args is not params.extra_args
    assert params.all_stop_token_ids == {4}
    assert SamplingParams.from_optional(temperature=None, top_p=None, max_tokens=None) == \
        SamplingParams(max_tokens=None)
    with pytest.raises(InvalidRequestError, match="logits_processors"):
        SamplingParams(logits_processors=[lambda ids, logits: logits])
    with pytest.raises(InvalidRequestError, match="spaces_between_special_tokens"):
        SamplingParams(spaces_between_special_tokens="no")
    with pytest.raises(InvalidRequestError, match="output_kind"):
        SamplingParams(output_kind="delta")


def test_output_kind(llm: LLM) -> None:
    engine = llm.llm_engine
    with pytest.raises(InvalidRequestError, match="DELTA"):
        engine.add_request("delta", PROMPT, SamplingParams(output_kind=RequestOutputKind.DELTA))
    assert not engine.has_unfinished_requests()
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("final", PROMPT, params, stream=True)
    seen = []
    while engine.has_unfinished_requests():
        seen.extend(engine.step())
    assert [o.finished for o in seen] == [True]  # one output, at the end


def test_guided_decoding_is_structured_outputs(smollm2: LLM) -> None:
    choice = GuidedDecodingParams(choice=["yes please", "no"])
    assert GuidedDecodingParams is StructuredOutputsParams
    params = SamplingParams(temperature=0, max_tokens=8, guided_decoding=choice)
    assert params.structured_outputs == choice and params.guided_decoding is None
    text = smollm2.generate("Do you like tea?", params, use_tqdm=False)[0].outputs[0].text
    assert text in ("yes please", "no")
    with pytest.raises(InvalidRequestError, match="not both"):
        SamplingParams(guided_decoding=choice, structured_outputs=choice)


def test_structured_outputs_extras(smollm2: LLM) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "properties": {"type": "object"}},
              "required": ["a"], "$defs": {"x": {"properties": {}}}}
    closed = closed_objects(schema, every_object=True)  # disable_additional_properties
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]  # a name map, not a schema
    assert closed["$defs"]["x"]["additionalProperties"] is False
    assert closed_objects({"type": "object", "additionalProperties": True}) == \
        {"type": "object", "additionalProperties": True}
    with pytest.raises(InvalidRequestError, match="whitespace_pattern"):
        StructuredOutputsParams(json={"type": "object"}, whitespace_pattern="")
    with pytest.raises(InvalidRequestError, match="structural_tag"):
        StructuredOutputsParams(json={"type": "object"}, structural_tag="{}")
    no_space = StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        whitespace_pattern="[ ]{0}", disable_additional_properties=True)
    out = smollm2.generate("A JSON object with a number:", SamplingParams(
        temperature=0, max_tokens=24, structured_outputs=no_space), use_tqdm=False)
    text = out[0].outputs[0].text
    assert set(json.loads(text)) == {"a"} and " " not in text and "\n" not in text


# ------------------------------------------------------------ prompt types, LLM()


def test_vllm_s_prompt_types_are_exported(llm: LLM) -> None:
    from inflight.inputs import TextPrompt, TokensPrompt

    assert inflight.TokensPrompt is TokensPrompt and inflight.TextPrompt is TextPrompt
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    by_type = llm.generate(TokensPrompt(prompt_token_ids=[5, 6, 7, 8]), greedy, use_tqdm=False)
    assert by_type[0].outputs[0].token_ids == \
        llm.generate(PROMPT, greedy, use_tqdm=False)[0].outputs[0].token_ids


def test_llm_arguments(tiny_llama_dir: Path) -> None:
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['not_an_option'\]"):
        LLM(str(tiny_llama_dir), not_an_option=1)
    with pytest.raises(ValueError, match="speculative_config"):
        LLM(str(tiny_llama_dir), speculative_config={"method": "ngram"})
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(str(tiny_llama_dir), tokenizer="/some/other/tokenizer")
    llm = LLM(str(tiny_llama_dir), tokenizer=str(tiny_llama_dir), served_model_name="x",
              limit_mm_per_prompt={"image": 0}, mm_processor_kwargs=None,
              speculative_config=None, disable_log_requests=True,
              logprobs_mode="raw_logprobs", async_scheduling=False,
              structured_outputs_config=None)
    assert llm.llm_engine.get_tokenizer() is not None
    assert llm.llm_engine.model_config.max_model_len == llm.llm_engine.max_model_len


def test_use_tqdm_callable(llm: LLM) -> None:
    made: list[dict[str, Any]] = []

    class Bar:
        def __init__(self, **options: Any) -> None:
            made.append(options)
            self.count = 0

        def __enter__(self) -> Bar:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def update(self, n: int = 1) -> None:
            self.count += n

        def __getattr__(self, name: str) -> Any:
            return lambda *a, **k: None

    llm.generate([PROMPT, PROMPT], SamplingParams(max_tokens=2), use_tqdm=Bar)
    assert len(made) == 1 and made[0]["total"] == 2


def test_chat_argument_types_are_named(llm: LLM) -> None:
    messages = [{"role": "user", "content": "w3"}]
    with pytest.raises(TypeError, match="chat_template must be"):
        llm.chat(messages, use_tqdm=False, chat_template=5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="chat_template_kwargs must be a dict"):
        llm.chat(messages, use_tqdm=False, chat_template="{{ 1 }}",
                 chat_template_kwargs=[1])  # type: ignore[arg-type]
