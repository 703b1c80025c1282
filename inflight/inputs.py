"""Prompt shapes, named as vLLM's ``vllm.inputs``, for type hints and scripts ported from vLLM.

``LLM.generate`` and ``LLMEngine.add_request`` take a string, a list of token ids, or one
of these dicts; a dict may also carry ``cache_salt`` (prefix-cache isolation).
"""

from __future__ import annotations

from typing import TypedDict


class _Text(TypedDict):
    prompt: str


class TextPrompt(_Text, total=False):
    """A prompt as text, tokenized by the engine."""

    cache_salt: str


class _Tokens(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_Tokens, total=False):
    """A prompt as token ids (``prompt``, if given, is only reported back)."""

    prompt: str
    cache_salt: str


PromptType = str | list[int] | TextPrompt | TokensPrompt

__all__ = ["TextPrompt", "TokensPrompt", "PromptType"]
