"""llguidance's view of the model's tokenizer: each token's bytes, and how text is tokenized.

llguidance's own ``llguidance.hf.from_tokenizer`` tokenizes with the Rust tokenizer as
serialized, which always reads a special token's text as that token: a constraint whose
literal text is ``<|im_end|>`` then forces the special token, which the grammar refuses
(the request failed at its first step). Here llguidance gets the vocabulary as bytes
(:func:`inflight.model.token_bytes.token_bytes_of`) and a tokenizer that spells special
tokens' text in ordinary tokens (``split_special_tokens``), as xgrammar, vLLM's default
backend, treats special tokens; a vocabulary whose tokens cannot all be spelled as bytes
falls back to llguidance's own reading.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.hf
from llguidance._tokenizer import TokenizerWrapper

from inflight.model.token_bytes import token_bytes_of


class _Vocabulary:
    """What llguidance's ``TokenizerWrapper`` reads: ``tokens`` (bytes per id),
    ``special_token_ids``, the EOS/BOS ids, and a call that tokenizes text."""

    def __init__(self, hf_tokenizer: Any, tokens: list[bytes], special: list[int],
                 eos_token_id: int) -> None:
        self._hf = hf_tokenizer
        self.tokens = tokens
        self.special_token_ids = special
        self.eos_token_id = eos_token_id
        self.bos_token_id = hf_tokenizer.bos_token_id

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._hf.encode(text, add_special_tokens=False, split_special_tokens=True))


def build_ll_tokenizer(
    hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]
) -> llguidance.LLTokenizer:
    """The ``LLTokenizer`` for ``hf_tokenizer`` (a transformers fast tokenizer) over the
    model's ``vocab_size`` rows; ``eos_token_ids`` end a grammar's output."""
    eos = list(eos_token_ids) or None
    added = getattr(hf_tokenizer, "added_tokens_decoder", {}) or {}
    special = sorted(i for i, token in added.items() if getattr(token, "special", False))
    spell = token_bytes_of(hf_tokenizer)
    tokens: list[bytes] = []
    for token_id in range(vocab_size):
        spelled = spell(token_id)
        if spelled is None and token_id < len(hf_tokenizer) and token_id not in special:
            # a token we cannot spell: llguidance reads the tokenizer itself
            return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
        tokens.append(spelled or b"")
    primary = eos[0] if eos else hf_tokenizer.eos_token_id
    vocabulary = _Vocabulary(hf_tokenizer, tokens, special, primary)
    return llguidance.LLTokenizer(TokenizerWrapper(vocabulary), n_vocab=vocab_size, eos_token=eos)
