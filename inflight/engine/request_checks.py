"""Checks of one request's values against the model (the vocabulary, ``max_logprobs``)
and small derivations from its prompt, made by ``LLMEngine.add_request`` before anything
changes. ``SamplingParams`` checks what needs no model; these need the tokenizer or the
vocabulary size. Errors are :class:`InvalidRequestError` naming the field, worded as vLLM.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

from inflight.sampling_params import InvalidRequestError, SamplingParams


def check_in_vocab(token_ids: Iterable[int], vocab_size: int, field: str) -> None:
    """vLLM's wording for out-of-vocabulary ids in a sampling field."""
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"token_id(s) {bad} in {field} contain out-of-vocab token ids. "
            f"Vocabulary size: {vocab_size}",
            field,
        )


def check_token_options(params: SamplingParams, vocab_size: int, max_logprobs: int) -> None:
    """Token ids in stop_token_ids / logit_bias / allowed_token_ids within the vocabulary;
    logprobs within the engine's ``max_logprobs`` (-1: no limit). A logprobs count of -1
    (vLLM's "the whole vocabulary") becomes ``vocab_size`` in ``params``, the request's
    own copy."""
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value == -1:
            value = vocab_size
            setattr(params, name, value)
        if value is not None and max_logprobs != -1 and value > max_logprobs:
            raise InvalidRequestError(
                f"Requested {name} of {value}, which is greater than max allowed: {max_logprobs}",
                name,
            )
    check_in_vocab(params.stop_token_ids or [], vocab_size, "stop_token_ids")
    check_in_vocab(params.logit_bias or {}, vocab_size, "logit_bias")
    check_in_vocab(params.allowed_token_ids or [], vocab_size, "allowed_token_ids")


def _is_integer(value: Any) -> bool:
    """An int or an integer-like scalar (numpy's), never a bool (nor numpy's bool_)."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def check_prompt_token_ids(token_ids: Any, vocab_size: int) -> list[int]:
    """A prompt given as token ids: a list of ints, each below the vocabulary size."""
    if not isinstance(token_ids, list) or not all(_is_integer(t) for t in token_ids):
        raise InvalidRequestError("prompt_token_ids must be a list of integers", "prompt")
    token_ids = [operator.index(t) for t in token_ids]  # numpy integers as ints
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        # vLLM's wording ("Token id N is out of vocabulary"), plus the size.
        raise InvalidRequestError(
            f"Token id {bad[0]} is out of vocabulary (the prompt's token ids must be below "
            f"the vocabulary size, {vocab_size})",
            "prompt",
        )
    return list(token_ids)


def truncated_prompt(token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (-1: the last
    ``max_model_len``); None keeps them all."""
    if keep is None:
        return token_ids
    keep = max_model_len if keep == -1 else keep
    return token_ids[-keep:]


def bad_words_token_ids(tokenizer: Any, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token ids as written and with a leading space (how it is spelled
    after another word), as vLLM; duplicates dropped."""
    found: dict[tuple[int, ...], None] = {}
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                found[ids] = None
    return tuple(found)


def cache_salt_of(prompt: Any) -> str | None:
    """A prompt dict's ``cache_salt`` (vLLM's name): requests with different salts never
    share prefix-cache blocks."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
    return salt


def check_priority(priority: Any, scheduling_policy: str) -> None:
    """An integer, and 0 unless the policy is "priority": vLLM's rule, a priority that
    would be ignored is an error, not a no-op."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise InvalidRequestError(f"priority must be an integer, got {priority!r}", "priority")
    if priority != 0 and scheduling_policy != "priority":
        raise InvalidRequestError(
            f"Got priority {priority} but priority scheduling is not enabled "
            "(scheduling_policy='priority')", "priority",
        )
