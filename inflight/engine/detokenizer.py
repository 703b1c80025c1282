"""Incremental detokenisation and stop-string detection for one request.

Decoding token by token is wrong for byte-level BPE (a character can span tokens) and
for SentencePiece (leading spaces depend on the previous token), so each new piece is
the difference between decoding a short window with and without the new tokens.
"""

from __future__ import annotations

from typing import Any

# Tokens of context decoded before the first output token, so its leading space is right.
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool,
        stop: list[str], include_stop_str_in_output: bool,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Append tokens to ``text``; returns the stop string if one now appears."""
        self._ids.extend(token_ids)
        before = len(self.text)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        # A trailing U+FFFD means an incomplete UTF-8 sequence: wait for more tokens.
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
        return self._find_stop(before)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _find_stop(self, new_text_start: int) -> str | None:
        for stop in self.stop:
            # Only text that could contain a stop string ending in the new piece.
            search_from = max(0, new_text_start - len(stop) + 1)
            index = self.text.find(stop, search_from)
            if index != -1:
                end = index + len(stop) if self.include_stop else index
                self.text = self.text[:end]
                return stop
        return None
