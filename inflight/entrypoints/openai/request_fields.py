"""Every request field of OpenAI's and vLLM's schemas, and what this server does with it.

One table per endpoint: each known field is either :class:`Implemented` (with what it does
here) or :class:`Refused` (a 400 naming the field, with the reason, but only when the
request sets it to something other than its neutral value: ``"n": 1``, ``"logprobs":
null`` or ``"presence_penalty": 0`` still work). A field in neither schema is ignored
with a warning naming it, as vLLM does (:func:`log_unknown_fields`; OpenAI's own API
answers 400, but clients written for other servers send their own extras).

The field lists follow OpenAI's ``openai`` package (3.57) and vLLM 0.32.0's protocol
(``vllm/entrypoints/openai/completion/protocol.py``, ``chat_completion/protocol.py``,
``responses/protocol.py`` and ``vllm/entrypoints/serve/tokenize/protocol.py``);
``tests/server/test_request_schema.py``, ``test_responses.py`` and ``test_tokenize.py``
check that every one of them has a row here and behaves as its row says.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from inflight.entrypoints.openai.errors import bad_request

logger = logging.getLogger(__name__)


def unset(value: Any) -> bool:
    """Neutral when null, false, zero or empty."""
    return value is None or value is False or value == 0 or value in ([], {}, "")


def equals(*neutral: Any) -> Callable[[Any], bool]:
    """Neutral when null or one of ``neutral``."""
    return lambda value: value is None or value in neutral


@dataclass(frozen=True, slots=True)
class Implemented:
    what: str


@dataclass(frozen=True, slots=True)
class Refused:
    reason: str
    neutral: Callable[[Any], bool] = field(default=unset)


Treatment = Implemented | Refused

_LATER = "not supported by this server yet"
_DEPRECATED_FUNCTIONS = "OpenAI deprecated it; use 'tools' and 'tool_choice'"
# vLLM's request fields before 0.12, replaced by ``structured_outputs``: in neither schema
# any more, but a migrating client still sends them, so they are refused by name rather
# than ignored (their output would silently be unconstrained).
LEGACY_GUIDED_FIELDS = frozenset({
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_json_object",
    "guided_decoding_backend", "guided_whitespace_pattern",
})
_TEXT_ONLY = "this model reads and writes text only"
_NO_REASONING = "this model has no reasoning mode"
_NO_DISAGG = "this server has no disaggregated prefill/encoder"


def _text_modalities(value: Any) -> bool:
    return value is None or value == ["text"]


# Fields both generation endpoints share, by treatment.
_SHARED: dict[str, Treatment] = {
    "model": Implemented("the served model name; null or '' means the first one"),
    "max_tokens": Implemented("the most tokens to generate"),
    "temperature": Implemented("sampling temperature; 0 is greedy"),
    "top_p": Implemented("nucleus sampling"),
    "n": Implemented("n completions per prompt, choices interleaved by index when streaming"),
    "stream": Implemented("server-sent events"),
    "stream_options": Implemented("include_usage, continuous_usage_stats"),
    "stop": Implemented("stop strings (text answers; a required or named tool call ends by its grammar)"),
    "seed": Implemented("per-request sampling seed"),
    "presence_penalty": Implemented("minus the penalty once for each token generated already"),
    "frequency_penalty": Implemented("minus the penalty per time a token was generated"),
    "logit_bias": Implemented("token id (a string) -> bias in [-100, 100] added to its logit"),
    "user": Implemented("accepted: an end-user id for abuse monitoring, no effect on output"),
    "response_format": Implemented(
        "text, json_object or json_schema: the output is constrained by a grammar (llguidance);"
        " a required or named tool_choice's grammar takes its place"
    ),
    # vLLM's sampling extras
    "top_k": Implemented("top-k sampling (0 or -1: off)"),
    "min_p": Implemented("min-p sampling"),
    "repetition_penalty": Implemented("HF/vLLM's penalty on prompt and generated tokens"),
    "min_tokens": Implemented("tokens to generate before EOS/stop may end the request"),
    "ignore_eos": Implemented("keep generating past EOS"),
    "stop_token_ids": Implemented("token ids that end the request (text answers, as stop)"),
    "include_stop_str_in_output": Implemented("keep the stop string in the text"),
    "skip_special_tokens": Implemented("drop special tokens from the text"),
    "spaces_between_special_tokens": Implemented(
        "accepted, as offline: fast tokenizers (the only kind inflight runs) put no spaces "
        "between special tokens either way"
    ),
    "use_beam_search": Implemented("n beams per prompt, the n best returned (serving_beam_search.py)"),
    "length_penalty": Implemented("the final ranking's length exponent (with use_beam_search only)"),
    "watermarking": Refused("watermarking is not supported"),
    "truncate_prompt_tokens": Implemented("keep only k prompt tokens (-1: max_model_len)"),
    "truncation_side": Implemented("which end truncate_prompt_tokens keeps: left keeps the last"),
    "allowed_token_ids": Implemented("only these token ids may be sampled"),
    "bad_words": Implemented("words never generated"),
    "prompt_logprobs": Implemented("the prompt tokens' logprobs and top k (not when streaming)"),
    "logprob_token_ids": Refused(f"logprobs of chosen token ids are {_LATER}"),
    "structured_outputs": Implemented(
        "vLLM's json, regex, choice, grammar (Lark or GBNF), json_object constraints"
    ),
    "priority": Implemented("scheduling priority (lower first) with --scheduling-policy priority"),
    "request_id": Implemented("the response's id (cmpl-/chatcmpl- + request_id)"),
    "session_id": Implemented("accepted: a routing hint for multi-server setups, no effect here"),
    "return_tokens_as_token_ids": Implemented(
        'logprob tokens (and top-logprob keys) as "token_id:<id>" strings'
    ),
    "return_token_ids": Implemented("prompt_token_ids and token_ids in the response"),
    "routed_experts_prompt_start": Refused("this model has no experts (MoE)"),
    "return_token_offsets": Implemented(
        "accepted: vLLM reads it on its render endpoints only, as here"
    ),
    "return_mm_kwargs": Implemented("accepted: vLLM reads it on its render endpoints only"),
    "mm_payload": Implemented("accepted: vLLM reads it on its render endpoints only"),
    "cache_salt": Implemented(
        "mixed into the prefix-cache hash: only requests with the same salt share cached blocks"
    ),
    "kv_transfer_params": Refused(_NO_DISAGG),
    "ec_transfer_params": Refused(_NO_DISAGG),
    "vllm_xargs": Refused("this server has no custom extensions to read it"),
    "repetition_detection": Refused(f"repetition_detection is {_LATER}"),
    "thinking_token_budget": Refused(_NO_REASONING, equals(-1)),
    "stream_interval": Refused("only one token per streamed chunk is supported", equals(1)),
    # inflight's own extension (in neither schema)
    "request_timeout": Implemented(
        "inflight: seconds (> 0) from arrival after which the request is aborted and "
        "answered 504 (a stream ends with an error event); overrides --request-timeout"
    ),
}

COMPLETION_FIELDS: dict[str, Treatment] = _SHARED | {
    "prompt": Implemented("string, strings, token ids or lists of token ids"),
    "echo": Implemented(
        "the prompt's text (and, with logprobs, its tokens') before the completion"
    ),
    "logprobs": Implemented("each token's raw logprob and the top k (OpenAI's logprobs object)"),
    "best_of": Implemented("accepted when equal to n: no extra candidates are ranked"),
    "suffix": Refused(f"suffix (fill-in-the-middle) is {_LATER}"),
    "prompt_embeds": Refused("prompt embeddings are not supported"),
    "add_special_tokens": Implemented("add the tokenizer's special tokens (BOS) to text prompts"),
}

CHAT_FIELDS: dict[str, Treatment] = _SHARED | {
    "messages": Implemented("the conversation, rendered with the chat template"),
    "max_completion_tokens": Implemented("the most tokens to generate (wins over max_tokens)"),
    "logprobs": Implemented("each token's raw logprob (OpenAI's logprobs.content)"),
    "top_logprobs": Implemented("the k most likely tokens at each position, with logprobs"),
    "tools": Implemented(
        "function tools, rendered by the chat template (or the default Hermes tool prompt)"
    ),
    "tool_choice": Implemented(
        "none, auto (Hermes <tool_call> parsing), required or a named function (grammar)"
    ),
    "parallel_tool_calls": Implemented("false: at most one call (auto keeps the first; required's grammar allows one)"),
    "functions": Refused(_DEPRECATED_FUNCTIONS),
    "function_call": Refused(_DEPRECATED_FUNCTIONS, equals("none", "auto")),
    "reasoning_effort": Refused(_NO_REASONING, equals("none")),  # "none": what it does anyway
    "include_reasoning": Implemented("accepted: no reasoning is separated from the answer"),
    "audio": Refused(_TEXT_ONLY),
    "modalities": Refused(_TEXT_ONLY, _text_modalities),
    "prediction": Refused(f"predicted outputs are {_LATER}"),
    # Only null is neutral: an empty object turns OpenAI's web search on.
    "web_search_options": Refused("this server has no web search", equals()),
    "verbosity": Refused("this model has no verbosity setting", equals("medium")),  # the default
    "moderation": Refused("this server has no moderation"),
    "metadata": Implemented(
        "accepted: tags for stored completions, which this server keeps none of"
    ),
    "store": Implemented("accepted: this server stores no completions"),
    "service_tier": Implemented("accepted: there is one processing tier"),
    "prompt_cache_key": Implemented("accepted: a cache routing hint, no effect on output"),
    "prompt_cache_options": Implemented("accepted: a cache hint, no effect on output"),
    "prompt_cache_retention": Implemented("accepted: a cache hint, no effect on output"),
    "safety_identifier": Implemented("accepted: an end-user id for abuse monitoring"),
    "echo": Implemented("the last message's content before the answer, if it has the same role"),
    "add_generation_prompt": Implemented("open an assistant turn after the messages"),
    "continue_final_message": Implemented("leave the final assistant message open"),
    "add_special_tokens": Implemented(
        "add the tokenizer's special tokens on top of the template's"
    ),
    "documents": Implemented("passed to the chat template"),
    "chat_template": Implemented("a Jinja template overriding the model's"),
    "chat_template_kwargs": Implemented("passed to the chat template"),
    "media_io_kwargs": Refused(_TEXT_ONLY),
    "mm_processor_kwargs": Refused(_TEXT_ONLY),
    "return_prompt_text": Implemented("the rendered prompt text in the response"),
}

def _no_reasoning(value: Any) -> bool:
    """Reasoning off: null, {} or every setting null (an effort of 'none' says off too)."""
    if not isinstance(value, dict):
        return value is None
    return all(v is None or (k == "effort" and v == "none") for k, v in value.items())


_NO_STORE = (
    "this server keeps no responses (as vLLM without VLLM_ENABLE_RESPONSES_API_STORE); "
    "send the whole conversation in 'input'"
)

RESPONSES_FIELDS: dict[str, Treatment] = {
    name: _SHARED[name]
    for name in (
        "model", "temperature", "top_p", "stream", "user", "top_k", "repetition_penalty",
        "seed", "stop", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
        "logit_bias", "priority", "cache_salt", "structured_outputs", "request_timeout",
        "min_p", "presence_penalty", "frequency_penalty", "stop_token_ids", "session_id",
        "watermarking", "kv_transfer_params", "ec_transfer_params", "return_mm_kwargs",
        "mm_payload",
    )
} | {
    name: CHAT_FIELDS[name]
    for name in ("chat_template_kwargs", "include_reasoning", "media_io_kwargs")
} | {
    "input": Implemented(
        "a string (one user message) or a list of messages, function_call and "
        "function_call_output items, rendered with the chat template as chat messages"
    ),
    "instructions": Implemented("a system message before the input"),
    "max_output_tokens": Implemented("the most tokens to generate"),
    "stream_options": Implemented("accepted: include_obfuscation (no padding is sent)"),
    "tools": Implemented(
        "function tools ({type, name, description, parameters, strict}), rendered and "
        "parsed as on chat completions; built-in tools are a 400"
    ),
    "tool_choice": Implemented(
        "none, auto, required or {type: function, name}; other choices are a 400"
    ),
    "parallel_tool_calls": Implemented("false: at most one call (auto keeps the first; required's grammar allows one)"),
    "text": Implemented(
        "format text, json_object or json_schema: the output is constrained by a grammar"
    ),
    "include": Implemented(
        "message.output_text.logprobs adds the output tokens' logprobs; the others name "
        "items (built-in tools, images, reasoning) that this server never outputs"
    ),
    "top_logprobs": Implemented("the k most likely tokens at each position (with include)"),
    "metadata": Implemented("echoed in the response"),
    "safety_identifier": Implemented("accepted: an end-user id for abuse monitoring"),
    "store": Implemented(
        "accepted: nothing is stored, as in vLLM by default (it turns store=true off "
        "silently unless VLLM_ENABLE_RESPONSES_API_STORE is set)"
    ),
    "truncation": Refused(
        "only 'disabled' is supported: a prompt too long for the context is a 400",
        equals("disabled"),
    ),
    "service_tier": Implemented("accepted: there is one processing tier"),
    "max_tool_calls": Implemented("accepted: it bounds built-in tool calls, of which there are none"),
    "prompt_cache_key": Implemented("accepted: a cache routing hint, no effect on output"),
    "prompt_cache_options": Implemented("accepted: a cache hint, no effect on output"),
    "prompt_cache_retention": Implemented("accepted: a cache hint, no effect on output"),
    "background": Refused(f"background responses need a store, and {_NO_STORE}"),
    "background_options": Refused(f"background responses need a store, and {_NO_STORE}"),
    "previous_response_id": Refused(_NO_STORE),
    "conversation": Refused(_NO_STORE),
    "prompt": Refused("prompt templates are not supported (vLLM refuses them too)"),
    "reasoning": Refused(_NO_REASONING, _no_reasoning),
    "context_management": Refused("context compaction is not supported"),
    "access_programs": Refused("access programs are OpenAI's own"),
    "image": Refused(_TEXT_ONLY),
    "moderation": Refused("this server has no moderation"),
    # vLLM's extras
    "request_id": Implemented("the response's id (default resp_<random>), as in vLLM"),
    "mm_processor_kwargs": Refused(_TEXT_ONLY),
    "enable_response_messages": Refused("vLLM supports it for gpt-oss (Harmony) models only"),
    "previous_input_messages": Refused("vLLM reads them for gpt-oss (Harmony) models only"),
    "previous_response": Refused(
        "stateless multi-turn needs reasoning state this model does not have; send the "
        "conversation in 'input'"
    ),
    "vllm_xargs": Refused("this server has no custom extensions to read it"),
}

TOKENIZE_FIELDS: dict[str, Treatment] = {
    "model": Implemented("the served model name"),
    "prompt": Implemented("text to tokenize"),
    "messages": Implemented("a conversation, rendered with the chat template"),
    "add_special_tokens": Implemented("default: true for a prompt, false for messages"),
    "add_generation_prompt": Implemented("open an assistant turn after the messages"),
    "continue_final_message": Implemented("leave the final assistant message open"),
    "return_token_strs": Implemented("the tokens' strings in token_strs"),
    "chat_template": Implemented("a Jinja template overriding the model's"),
    "chat_template_kwargs": Implemented("passed to the chat template"),
    "documents": Implemented("passed to the chat template"),
    "tools": Implemented("function tools, rendered with the messages as the chat endpoint does"),
    "mm_processor_kwargs": Refused(_TEXT_ONLY),
    "media_io_kwargs": Refused(_TEXT_ONLY),
}


def refuse_unsupported(request: BaseModel, table: Mapping[str, Treatment]) -> None:
    """A 400 naming the first refused field the request sets to a non-neutral value."""
    for name in request.model_fields_set:
        treatment = table.get(name)
        if isinstance(treatment, Refused) and not treatment.neutral(getattr(request, name)):
            raise bad_request(
                f"'{name}' is not supported: {treatment.reason}.", name, "unsupported_parameter"
            )


def refuse_legacy_guided_fields(request: BaseModel) -> None:
    """A 400 naming a pre-0.12 vLLM ``guided_*`` field, pointing at its replacement."""
    for name in sorted(set(request.model_extra or {}) & LEGACY_GUIDED_FIELDS):
        raise bad_request(
            f"'{name}' is not supported: vLLM replaced the guided_* fields with "
            "'structured_outputs' (json, regex, choice, grammar, json_object).",
            name,
            "unsupported_parameter",
        )


def log_unknown_fields(request: BaseModel, endpoint: str) -> None:
    """Fields in neither schema are ignored, as vLLM does: say which, at warning level
    (also inside an object field such as ``stream_options.include_usuage``)."""
    unknown = sorted(unknown_fields(request))
    if unknown:
        logger.warning(
            "%s: the following fields were present in the request but ignored: %s",
            endpoint, unknown,
        )


def unknown_fields(request: BaseModel, prefix: str = "") -> list[str]:
    """The request's fields in neither schema, and those of its object-valued fields (not of
    messages: their extra keys go to the chat template)."""
    names = [prefix + name for name in request.model_extra or {}]
    for name in request.model_fields_set:
        value = getattr(request, name)
        if isinstance(value, BaseModel):
            names += unknown_fields(value, f"{prefix}{name}.")
    return names
