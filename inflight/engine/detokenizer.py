"""Incremental detokenisation and stop-string detection for one request.

Decoding token by token is wrong for byte-level BPE (a character can span tokens) and
for SentencePiece (leading spaces depend on the previous token), so each new piece is
the difference between decoding a short window with and without the new tokens.

Stop rules, as vLLM's detokenizer:

* the text of the token that ended the request (EOS or a ``stop_token_ids`` hit,
  ``stop_terminated``) is left out unless ``include_stop_str_in_output``;
* stop strings are searched only once more than ``min_tokens`` tokens exist, and never
  in the text of the first ``min_tokens`` tokens (a stop string may still start in their
  last characters and end after them).
"""

from __future__ import annotations

from typing import Any

# Tokens of context decoded before the first output token, so its leading space is right.
_PROMPT_CONTEXT = 5
# The most tokens an incomplete trailing UTF-8 sequence (at most 3 bytes) can span.
_MAX_PARTIAL_TOKENS = 3


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool,
        stop: list[str], include_stop_str_in_output: bool, min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.num_output_tokens = 0
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def add_tokens(self, token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Append the tokens' text to ``text``; returns the stop string if one now appears.

        ``stop_terminated``: the last of ``token_ids`` ended the request (EOS or a stop
        token id), so its text is left out unless ``include_stop_str_in_output``.
        """
        num_new = len(token_ids)
        if stop_terminated and not self.include_stop:
            token_ids = token_ids[:-1]
        # The first min_tokens tokens' text is appended but never searched for stops.
        held = max(0, min(len(token_ids), self.min_tokens - self.num_output_tokens))
        if held:
            self._append(token_ids[:held])
        search_from = len(self.text)
        self._append(token_ids[held:])
        self.num_output_tokens += num_new
        if not self.stop or self.num_output_tokens <= self.min_tokens:
            return None
        return self._find_stop(search_from)

    def _append(self, token_ids: list[int]) -> None:
        if not token_ids:
            return
        self._ids.extend(token_ids)
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        # A trailing U+FFFD means an incomplete UTF-8 sequence: the tokens that carry its
        # first bytes wait for more. Each token adds at least one byte and an incomplete
        # sequence has at most three, so at most the last three tokens wait; the text of
        # the tokens before them is taken now (a request may end here: its text stops at
        # the last whole character, as vLLM's).
        lowest = max(self._read_offset + 1, len(self._ids) - _MAX_PARTIAL_TOKENS)
        for end in range(len(self._ids), lowest - 1, -1):
            full = self._decode(self._ids[self._prefix_offset : end])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.text += full[len(prefix) :]
                self._prefix_offset = self._read_offset
                self._read_offset = end
                return

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _find_stop(self, new_text_start: int) -> str | None:
        """The first of ``stop`` (in list order) found in the new text, as vLLM."""
        for stop in self.stop:
            # Only text that could contain a stop string ending in the new piece.
            search_from = max(0, new_text_start - len(stop) + 1)
            index = self.text.find(stop, search_from)
            if index != -1:
                end = index + len(stop) if self.include_stop else index
                self.text = self.text[:end]
                return stop
        return None
