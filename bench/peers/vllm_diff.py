"""The same offline calls on vLLM and on inflight, and where their answers differ.

Each engine runs in its own interpreter (vLLM from its venv, inflight from the project's),
greedy on the same float32 checkpoint, and writes one JSON file of normalised answers:
token ids, texts, finish and stop reasons, logprobs (ranks and decoded tokens exact,
values to 0.02), or the exception's type and message. ``--compare`` lists every case
whose answers differ; error messages are not compared, only that both raised.

    PEERS=/path/to/peers   # holds venv-vllm and smollm2-135m-instruct (README.md here)
    $PEERS/venv-vllm/bin/python bench/peers/vllm_diff.py vllm $PEERS/smollm2-135m-instruct vllm.json
    .venv/bin/python bench/peers/vllm_diff.py inflight $PEERS/smollm2-135m-instruct inflight.json
    .venv/bin/python bench/peers/vllm_diff.py --compare inflight.json vllm.json

Run on 2026-12-07 against vLLM 0.32.0 (CPU build), it found what was fixed that day: a
complete grammar's EOS not sampled, beam search texts keeping the EOS, empty batches
refused, the pooling API missing. The rest agreed, token for token. Errors differ only in
wording; ``priority`` without priority scheduling is refused here (vLLM 0.32 ignores it).

Widened the same day to 92 cases (deterministic sampling, logprobs beside penalties and
bias, stop rules combined, unicode, bad input, chat and beam-search forms): 2 differ, both
JSON whitespace. ``structured.json_compact``: vLLM 0.32 ignores the request's
``disable_any_whitespace`` (it reads only the engine-wide setting); inflight honours it.
``structured.json_enum_array``: xgrammar (vLLM's backend) and llguidance (inflight's)
allow different indentation and key tokenisations inside the array; both answers are
valid against the schema, and inflight's is the unconstrained greedy path where allowed.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from typing import Any

P = "The capital of France is"
Q = "List three colors, one per line:"
CHAT = "<|im_start|>user\nWhat is 2+2? Answer briefly.<|im_end|>\n<|im_start|>assistant\n"


def _generate_cases(paris: int) -> dict[str, tuple[Any, dict[str, Any]]]:
    """name -> (prompt, SamplingParams fields); temperature 0 unless set."""
    return {
        "greedy": (P, dict(max_tokens=16)),
        "stop": (P, dict(max_tokens=24, stop=["."])),
        "stop_included": (P, dict(max_tokens=24, stop=["."], include_stop_str_in_output=True)),
        "stop_after_min_tokens": (P, dict(max_tokens=24, stop=["."], min_tokens=8)),
        "stop_across_tokens": (P, dict(max_tokens=24, stop=["of France"])),
        "stop_inside_a_token": (P, dict(max_tokens=24, stop=["ari"], include_stop_str_in_output=True)),
        "stop_token_ids": (P, dict(max_tokens=24, stop_token_ids=[30])),
        "stop_token_ids_included": (P, dict(max_tokens=24, stop_token_ids=[30], include_stop_str_in_output=True)),
        "eos": (CHAT, dict(max_tokens=30)),
        "eos_with_specials": (CHAT, dict(max_tokens=30, skip_special_tokens=False)),
        "ignore_eos": (CHAT, dict(max_tokens=20, ignore_eos=True, skip_special_tokens=False)),
        "min_tokens_hold_eos": (CHAT, dict(max_tokens=30, min_tokens=15)),
        "logprobs": (P, dict(max_tokens=5, logprobs=3)),
        "prompt_logprobs": (P, dict(max_tokens=2, prompt_logprobs=2, logprobs=1)),
        "repetition_penalty": (Q, dict(max_tokens=30, repetition_penalty=1.5)),
        "presence_penalty": (Q, dict(max_tokens=30, presence_penalty=1.5)),
        "frequency_penalty": (Q, dict(max_tokens=30, frequency_penalty=1.5)),
        "logit_bias": (P, dict(max_tokens=8, logit_bias={paris: -100})),
        "bad_words": (P, dict(max_tokens=12, bad_words=["Paris", "capital of France"])),
        "allowed_token_ids": (P, dict(max_tokens=6, allowed_token_ids=[paris, 13, 30, 314])),
        "top_k_1": (P, dict(max_tokens=10, temperature=1.0, top_k=1)),
        "context_limit": ("word " * 2040, dict(max_tokens=50)),
        "prompt_too_long": ("word " * 3000, dict(max_tokens=4)),
        "empty_stop_string": (P, dict(max_tokens=2, stop=[""])),
        # Sampling that leaves one candidate is deterministic, so it compares across RNGs.
        "min_p_one": (Q, dict(max_tokens=12, temperature=1.0, min_p=1.0)),
        "top_p_tiny": (Q, dict(max_tokens=12, temperature=0.7, top_p=1e-6)),
        "top_k_minus_one": (P, dict(max_tokens=6, top_k=-1)),
        # Logprobs are the model's own (vLLM's "raw_logprobs"), before penalties and bias.
        "logprobs_zero": (P, dict(max_tokens=4, logprobs=0)),
        "logprobs_with_penalty": (Q, dict(max_tokens=8, logprobs=2, repetition_penalty=1.5)),
        "logprobs_with_bias": (P, dict(max_tokens=3, logprobs=2, logit_bias={paris: -100})),
        "logprobs_eos_special": (CHAT, dict(max_tokens=30, logprobs=1, skip_special_tokens=False)),
        "prompt_logprobs_zero": (P, dict(max_tokens=1, prompt_logprobs=0)),
        "prompt_logprobs_special": (CHAT, dict(max_tokens=1, prompt_logprobs=1)),
        "stop_first_of_many": (Q, dict(max_tokens=30, stop=["\n\n", "\n", "Red"])),
        "stop_string_and_token": (Q, dict(max_tokens=30, stop=["blue"], stop_token_ids=[198])),
        "stop_eos_token_id": (CHAT, dict(max_tokens=30, stop_token_ids=[2], skip_special_tokens=False)),
        "stop_with_ignore_eos": (CHAT, dict(max_tokens=12, ignore_eos=True, stop=["<|im_end|>"])),
        "min_tokens_hold_stop": (Q, dict(max_tokens=30, min_tokens=6, stop=["\n"])),
        "max_tokens_none": ("word " * 2030, dict(max_tokens=None)),
        "max_tokens_one": (P, dict(max_tokens=1)),
        "specials_no_spaces": (CHAT, dict(max_tokens=30, skip_special_tokens=False,
                                          spaces_between_special_tokens=False)),
        "detokenize_off": (P, dict(max_tokens=6, detokenize=False, logprobs=1)),
        "unicode_prompt": ("日本の首都は", dict(max_tokens=10)),
        "unicode_output": ("Translate 'thank you' to Japanese:", dict(max_tokens=16)),
        "emoji_stop": ("Three emojis: 😀", dict(max_tokens=16, stop=["😀"])),
        "special_text_in_prompt": ("<|im_start|>system\nBe brief<|im_end|>\n", dict(max_tokens=6)),
        "token_ids_prompt": ({"prompt_token_ids": [504, 3575, 282, 4649, 314]}, dict(max_tokens=6)),
        "all_penalties": (Q, dict(max_tokens=24, repetition_penalty=1.2, presence_penalty=0.5,
                                  frequency_penalty=0.5)),
        "negative_penalties": (Q, dict(max_tokens=20, presence_penalty=-1.0, frequency_penalty=-0.5)),
        "bias_forces": (P, dict(max_tokens=4, logit_bias={30: 100})),
        "bad_words_single_token": (Q, dict(max_tokens=16, bad_words=["\n"])),
        "allowed_with_stop": (P, dict(max_tokens=8, allowed_token_ids=[paris, 30, 2],
                                       stop_token_ids=[30])),
        # Bad input: both must raise.
        "min_tokens_over_max": (P, dict(max_tokens=2, min_tokens=5)),
        "negative_temperature": (P, dict(max_tokens=2, temperature=-1.0)),
        "top_p_zero": (P, dict(max_tokens=2, top_p=0.0)),
        "logit_bias_out_of_vocab": (P, dict(max_tokens=2, logit_bias={10**7: 1.0})),
        "allowed_empty": (P, dict(max_tokens=2, allowed_token_ids=[])),
        "allowed_out_of_vocab": (P, dict(max_tokens=2, allowed_token_ids=[10**7])),
        "stop_token_out_of_vocab": (P, dict(max_tokens=2, stop_token_ids=[10**7])),
        "max_tokens_zero": (P, dict(max_tokens=0)),
    }


def _structured_cases() -> dict[str, tuple[str, dict[str, Any]]]:
    """name -> (prompt, StructuredOutputsParams fields)."""
    person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    return {
        "choice": ("Is the sky blue? Answer:", dict(choice=["yes", "no", "maybe"])),
        "regex": ("Phone number:", dict(regex=r"\d{3}-\d{4}")),
        "json": ("A person as JSON:", dict(json=person)),
        "json_object": ("A JSON object:", dict(json_object=True)),
        "grammar": ("Pick:", dict(grammar='root ::= "cat" | "dog"')),
        "json_string_schema": ("A person as JSON:", dict(json=json.dumps(person))),
        "json_enum_array": ("Colors as JSON:", dict(json={
            "type": "object", "properties": {"colors": {
                "type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 3}},
            "required": ["colors"]})),
        "json_compact": ("A person as JSON:", dict(json=person, disable_any_whitespace=True)),
        "choice_shared_prefix": ("Pick a fruit:", dict(choice=["apple", "apricot", "banana split"])),
        "regex_anchored": ("Year:", dict(regex=r"(19|20)\d\d")),
        "bad_regex": ("Year:", dict(regex=r"(unclosed")),
        "bad_schema": ("A:", dict(json={"type": "no-such-type"})),
        "two_kinds": ("A:", dict(choice=["a"], regex="b")),
    }


def _normalised_logprobs(positions: Any) -> Any:
    if positions is None:
        return None
    return [
        None if p is None else {
            str(t): [None if math.isinf(lp.logprob) else round(lp.logprob, 3), lp.rank, lp.decoded_token]
            for t, lp in p.items()
        }
        for p in positions
    ]


def _normalised(outputs: Any) -> Any:
    if isinstance(outputs, list) and outputs and hasattr(outputs[0], "outputs"):
        return [{
            "prompt_token_ids": list(o.prompt_token_ids or []),
            "prompt_logprobs": _normalised_logprobs(o.prompt_logprobs),
            "outputs": [{
                "text": c.text, "token_ids": list(c.token_ids), "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason, "logprobs": _normalised_logprobs(c.logprobs),
            } for c in o.outputs],
        } for o in outputs]
    if isinstance(outputs, list) and outputs and hasattr(outputs[0], "sequences"):
        return [[{"text": s.text, "tokens": list(s.tokens)} for s in o.sequences] for o in outputs]
    return repr(outputs)[:200]


def run(engine: str, model: str, out_path: str) -> None:
    if engine == "vllm":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM, SamplingParams
        from vllm.sampling_params import BeamSearchParams, StructuredOutputsParams
    else:
        from inflight import LLM, SamplingParams
        from inflight.beam_search import BeamSearchParams
        from inflight.sampling_params import StructuredOutputsParams
    llm = LLM(model=model, dtype="float32", max_model_len=2048, enable_prefix_caching=False, seed=0)
    paris = llm.get_tokenizer().encode(" Paris", add_special_tokens=False)[0]

    def greedy(**fields: Any) -> Any:
        return SamplingParams(**{"temperature": 0.0, **fields})

    calls: dict[str, Callable[[], Any]] = {}
    for name, (prompt, fields) in _generate_cases(paris).items():
        calls[f"generate.{name}"] = lambda p=prompt, f=fields: llm.generate([p], greedy(**f), use_tqdm=False)
    for name, (prompt, fields) in _structured_cases().items():
        calls[f"structured.{name}"] = lambda p=prompt, f=fields: llm.generate(
            [p], greedy(max_tokens=60, structured_outputs=StructuredOutputsParams(**f)), use_tqdm=False)
    user = [{"role": "user", "content": "Count to five, comma separated."}]
    calls.update({
        "chat.parts": lambda: llm.chat([{"role": "user", "content": [
            {"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]}],
            greedy(max_tokens=12), use_tqdm=False),
        "chat.continue_final_message": lambda: llm.chat(
            [*user, {"role": "assistant", "content": "1, 2, 3,"}], greedy(max_tokens=8),
            add_generation_prompt=False, continue_final_message=True, use_tqdm=False),
        "chat.developer_role": lambda: llm.chat(
            [{"role": "developer", "content": "Be brief."}, *user], greedy(max_tokens=8), use_tqdm=False),
        "chat.empty": lambda: llm.chat([], greedy(max_tokens=2), use_tqdm=False),
        "generate.empty": lambda: llm.generate([], greedy(max_tokens=2), use_tqdm=False),
        "generate.params_per_prompt": lambda: llm.generate(
            [P, "One two three"], [greedy(max_tokens=4), greedy(max_tokens=6, stop=[" five"])], use_tqdm=False),
        "chat.batch": lambda: llm.chat([user, [{"role": "user", "content": "Say hi."}]],
                                       greedy(max_tokens=8), use_tqdm=False),
        "chat.system_multi_turn": lambda: llm.chat([
            {"role": "system", "content": "You answer in one word."}, *user,
            {"role": "assistant", "content": "1, 2, 3, 4, 5"},
            {"role": "user", "content": "Now backwards."}], greedy(max_tokens=12), use_tqdm=False),
        "chat.no_generation_prompt": lambda: llm.chat(
            user, greedy(max_tokens=6), add_generation_prompt=False, use_tqdm=False),
        "chat.continue_and_add": lambda: llm.chat(
            [*user, {"role": "assistant", "content": "1,"}], greedy(max_tokens=4),
            add_generation_prompt=True, continue_final_message=True, use_tqdm=False),
        "chat.template_kwargs": lambda: llm.chat(
            user, greedy(max_tokens=6), chat_template_kwargs={"custom_flag": True}, use_tqdm=False),
        "chat.custom_template": lambda: llm.chat(
            user, greedy(max_tokens=6), use_tqdm=False,
            chat_template="{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"),
        "generate.batch_order": lambda: llm.generate(
            [Q, P, "Hello", CHAT], greedy(max_tokens=10), use_tqdm=False),
        "beam_search": lambda: llm.beam_search(
            [{"prompt": P}], BeamSearchParams(beam_width=3, max_tokens=8)),
        "beam_search.two_prompts": lambda: llm.beam_search(
            [{"prompt": P}, {"prompt": Q}], BeamSearchParams(beam_width=2, max_tokens=6)),
        "beam_search.length_penalty": lambda: llm.beam_search(
            [{"prompt": CHAT}], BeamSearchParams(beam_width=2, max_tokens=12, length_penalty=0.5)),
        "beam_search.ignore_eos": lambda: llm.beam_search(
            [{"prompt": CHAT}], BeamSearchParams(beam_width=2, max_tokens=12, ignore_eos=True)),
        "beam_search.token_ids": lambda: llm.beam_search(
            [{"prompt_token_ids": [504, 3575, 282, 4649, 314]}], BeamSearchParams(beam_width=2, max_tokens=5)),
        "encode": lambda: llm.encode([P]),
    })
    results: dict[str, Any] = {}
    for name, call in calls.items():
        try:
            results[name] = {"answer": _normalised(call())}
        except Exception as error:  # the difference to report
            results[name] = {"raised": type(error).__name__, "message": str(error)[:200]}
        print(name, json.dumps(results[name])[:160], flush=True)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


def _close(a: Any, b: Any) -> bool:
    """Equal, with floats (logprobs) to 0.02."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 0.02
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def compare(ours_path: str, theirs_path: str) -> int:
    with open(ours_path) as f:
        ours = json.load(f)
    with open(theirs_path) as f:
        theirs = json.load(f)
    differing = 0
    for name in sorted(ours.keys() | theirs.keys()):
        a, b = ours.get(name), theirs.get(name)
        both_raised = a is not None and b is not None and "raised" in a and "raised" in b
        if both_raised or (a is not None and b is not None and _close(a, b)):
            continue
        differing += 1
        print(f"{name}\n  {ours_path}: {json.dumps(a)[:300]}\n  {theirs_path}: {json.dumps(b)[:300]}")
    print(f"{differing} of {len(ours.keys() | theirs.keys())} cases differ")
    return 1 if differing else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    if len(sys.argv) == 4 and sys.argv[1] in ("vllm", "inflight"):
        run(*sys.argv[1:])
        sys.exit(0)
    sys.exit(__doc__)
