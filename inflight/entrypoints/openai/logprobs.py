"""The engine's logprobs in OpenAI's and vLLM's response shapes.

The engine gives, per position, a dict token id -> :class:`Logprob` with the sampled (or
prompt) token first, then the top k (ranks 1..k). Logprobs are raw: from the model's
distribution before temperature, penalties and truncation (vLLM's default). JSON has no
``-inf``, so a logprob below -9999 is sent as -9999.0, OpenAI's "very unlikely" value.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from inflight.entrypoints.openai.protocol import (
    ChatTokenLogprob,
    CompletionLogprobs,
    LogprobInfo,
    PromptLogprobsBody,
    TopLogprob,
)
from inflight.model.token_bytes import TokenBytes
from inflight.outputs import Logprob, PositionLogprobs, PromptLogprobs

_FLOOR = -9999.0

Decode = Callable[[int], str]


def _clamp(logprob: float) -> float:
    return max(logprob, _FLOOR)


def _text(token_id: int, entry: Logprob | None, decode: Decode) -> str:
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return decode(token_id)


def token_id_label(token_id: int) -> str:
    """vLLM's ``return_tokens_as_token_ids`` form of a logprob's token: a string that names
    the token even where its text is not valid UTF-8 on its own."""
    return f"token_id:{token_id}"


@dataclass(slots=True)
class CompletionLogprobsBuilder:
    """Builds one choice's completions ``logprobs`` a piece at a time (streaming sends
    each piece in its chunk); ``text_offset`` runs on across pieces."""

    decode: Decode
    offset: int = 0  # where the next token starts in the choice's text
    # return_tokens_as_token_ids: tokens as "token_id:<id>"; text_offset then runs over
    # those strings, as in vLLM
    as_token_ids: bool = False

    def _label(self, token_id: int, entry: Logprob | None) -> str:
        return token_id_label(token_id) if self.as_token_ids else _text(token_id, entry, self.decode)

    def prompt(
        self, token_ids: Sequence[int], prompt_logprobs: PromptLogprobs
    ) -> CompletionLogprobs:
        """The echoed prompt: each token's logprob (the first one null) and the top k."""
        out = CompletionLogprobs()
        for token_id, position in zip(token_ids, prompt_logprobs, strict=True):
            self._add(out, token_id, position)
        return out

    def generated(
        self, token_ids: Sequence[int], logprobs: Sequence[PositionLogprobs]
    ) -> CompletionLogprobs:
        """Generated tokens: the sampled token's logprob and the top k plus the sampled
        one (OpenAI: up to k + 1 entries)."""
        out = CompletionLogprobs()
        for token_id, position in zip(token_ids, logprobs, strict=True):
            self._add(out, token_id, position)
        return out

    def _add(
        self, out: CompletionLogprobs, token_id: int, position: PositionLogprobs | None
    ) -> None:
        entry = None if position is None else position.get(token_id)
        text = self._label(token_id, entry)
        out.tokens.append(text)
        out.text_offset.append(self.offset)
        self.offset += len(text)
        if position is None or entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            return
        out.token_logprobs.append(_clamp(entry.logprob))
        out.top_logprobs.append(
            {self._label(t, lp): _clamp(lp.logprob) for t, lp in position.items()}
        )


def merge(parts: Sequence[CompletionLogprobs]) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for part in parts:
        out.text_offset.extend(part.text_offset)
        out.token_logprobs.extend(part.token_logprobs)
        out.tokens.extend(part.tokens)
        out.top_logprobs.extend(part.top_logprobs)
    return out


def chat_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[PositionLogprobs], top: int, decode: Decode,
    as_token_ids: bool = False, raw_bytes: TokenBytes | None = None,
) -> list[ChatTokenLogprob]:
    """OpenAI's chat ``logprobs.content``: per token its logprob, UTF-8 bytes and the
    ``top`` most likely tokens, best first. ``raw_bytes`` gives a token's own bytes (see
    ``inflight.model.token_bytes``; joined, they are the answer's text even where a
    character spans tokens), else the bytes of its text. ``as_token_ids`` (vLLM's
    ``return_tokens_as_token_ids``): each ``token`` is "token_id:<id>"; ``bytes`` stay
    the token's own."""

    def label(token_id: int, text: str) -> str:
        return token_id_label(token_id) if as_token_ids else text

    def bytes_of(token_id: int, text: str) -> list[int]:
        raw = raw_bytes(token_id) if raw_bytes is not None else None
        return list(raw if raw is not None else text.encode("utf-8"))

    content: list[ChatTokenLogprob] = []
    for token_id, position in zip(token_ids, logprobs, strict=True):
        entry = position.get(token_id)
        text = _text(token_id, entry, decode)
        best = sorted(
            (item for item in position.items() if item[1].rank is not None and item[1].rank <= top),
            key=lambda item: item[1].rank or 0,
        )[:top]
        content.append(
            ChatTokenLogprob(
                token=label(token_id, text),
                logprob=_FLOOR if entry is None else _clamp(entry.logprob),
                bytes=bytes_of(token_id, text),
                top_logprobs=[
                    TopLogprob(
                        token=label(t, t_text := _text(t, lp, decode)),
                        logprob=_clamp(lp.logprob),
                        bytes=bytes_of(t, t_text),
                    )
                    for t, lp in best
                ],
            )
        )
    return content


def prompt_logprobs_body(prompt_logprobs: PromptLogprobs | None) -> PromptLogprobsBody | None:
    """vLLM's ``prompt_logprobs`` field: per prompt token, id -> {logprob, rank,
    decoded_token}; the first entry null."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if position is None
        else {
            t: LogprobInfo(logprob=_clamp(lp.logprob), rank=lp.rank, decoded_token=lp.decoded_token)
            for t, lp in position.items()
        }
        for position in prompt_logprobs
    ]
