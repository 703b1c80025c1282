"""Logprobs in vLLM's shape, with each token's text as it reads inside a sequence."""

from __future__ import annotations

from typing import Any

from inflight.core.interface import TokenLogprobs
from inflight.outputs import Logprob, PositionLogprobs


class LogprobsDecoder:
    """Turns the sampler's per-position logprobs into ``{token_id: Logprob}`` and decodes
    token texts once per id (the cache lives as long as the engine)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._anchor: list[int] | None = None

    def position(self, entry: TokenLogprobs, detokenize: bool = True) -> PositionLogprobs:
        """vLLM's shape: the chosen token first, then the top k (ranks 1..k); without
        ``detokenize`` (the request's ``detokenize=False``) ``decoded_token`` is None."""
        decode = self.token_text if detokenize else _no_text
        out = {entry.token_id: Logprob(entry.logprob, entry.rank, decode(entry.token_id))}
        for rank, (token, logprob) in enumerate(
            zip(entry.top_token_ids, entry.top_logprobs, strict=True), start=1
        ):
            if token not in out:
                out[token] = Logprob(logprob, rank, decode(token))
        return out

    def token_text(self, token_id: int) -> str:
        """A token's text as it reads inside a sequence, leading space included (decoding
        it alone drops SentencePiece's word-start space): the difference between decoding
        an anchor token with and without it after."""
        text = self._texts.get(token_id)
        if text is None:
            if self._anchor is None:
                self._anchor = list(self._tokenizer.encode("a", add_special_tokens=False))
            anchor = self._anchor
            base = str(self._tokenizer.decode(anchor))
            full = str(self._tokenizer.decode([*anchor, token_id]))
            text = (
                full[len(base):] if anchor and full.startswith(base)
                else str(self._tokenizer.decode([token_id]))
            )
            self._texts[token_id] = text
        return text


def _no_text(token_id: int) -> None:
    return None
