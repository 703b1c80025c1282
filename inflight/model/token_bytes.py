"""Each token's own bytes, for OpenAI's logprob ``bytes`` field.

A token can hold part of a UTF-8 character (an emoji split over byte-level BPE tokens);
decoded alone its text is U+FFFD, so the bytes of that text cannot be joined back into
the answer. OpenAI defines ``bytes`` as the token's UTF-8 bytes, "useful in instances
where characters are represented by multiple tokens and their byte representations must
be combined": this reads them from the vocabulary instead. vLLM sends the bytes of the
decoded text (U+FFFD's for such a token).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

from inflight.model.gguf_tokenizer import byte_alphabet

TokenBytes = Callable[[int], "bytes | None"]
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.lru_cache(maxsize=8)
def token_bytes_of(tokenizer: Any) -> TokenBytes:
    """``token id -> bytes`` for a tokenizer with a Hugging Face ``tokenizers`` backend:
    byte-level BPE pieces through GPT-2's byte alphabet, SentencePiece pieces with
    ``<0xNN>`` byte fallback and "▁" for a space, added tokens as their text. None for an
    id it cannot spell that way (other vocabularies: the caller keeps the text's bytes)."""
    from tokenizers import decoders

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return lambda token_id: None
    added = set(backend.get_added_tokens_decoder())
    decoder = backend.decoder
    byte_level = isinstance(decoder, decoders.ByteLevel)
    sentencepiece = not byte_level and "ByteFallback" in repr(decoder)
    inverse = {char: byte for byte, char in byte_alphabet().items()}

    @functools.lru_cache(maxsize=1 << 16)
    def of(token_id: int) -> bytes | None:
        piece = backend.id_to_token(token_id)
        if piece is None:
            return None
        if token_id in added:
            return str(piece).encode("utf-8")
        if byte_level:
            try:
                return bytes(inverse[char] for char in piece)
            except KeyError:
                return None
        if sentencepiece:
            match = _BYTE_PIECE.fullmatch(piece)
            if match:
                return bytes([int(match.group(1), 16)])
            return str(piece).replace("\u2581", " ").encode("utf-8")
        return None

    return of
