"""Building a Hugging Face tokenizer from a GGUF file's ``tokenizer.*`` metadata.

``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` takes ~4 s on SmolLM2 (it re-parses the
file and goes through the slow-tokenizer classes), which alone would blow the engine's 3 s
start-up budget. For byte-level BPE vocabularies whose pre-tokenizer is GPT-2's regex we build
the identical ``tokenizers.Tokenizer`` directly from the already-parsed metadata (~0.15 s);
anything else falls back to transformers, which is slow but knows every vocabulary flavour.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

# llama.cpp ``tokenizer.ggml.pre`` values for which transformers uses plain GPT-2 byte-level
# pre-tokenisation (no extra split regex), so our direct build reproduces it exactly. Other
# values (llama-bpe, qwen2, ...) need a different split regex: left to transformers.
_GPT2_REGEX_PRE_TYPES = {None, "default", "gpt-2", "smollm"}
_CONTROL = 3  # llama.cpp token type: special token such as <|im_start|>
_USER_DEFINED = 4  # llama.cpp token type: added token matched whole, but not special


def build_gguf_tokenizer(metadata: dict[str, Any], path: str) -> PreTrainedTokenizerBase:
    """The tokenizer described by ``metadata`` (a parsed GGUF header) of the file at ``path``."""
    model = metadata.get("tokenizer.ggml.model")
    pre = metadata.get("tokenizer.ggml.pre")
    if model == "gpt2" and pre in _GPT2_REGEX_PRE_TYPES:
        return _byte_level_bpe(metadata)
    # Imported here: AutoTokenizer's import alone costs ~0.3 s the fast path does not need.
    from transformers import AutoTokenizer

    directory, name = os.path.split(os.path.abspath(path))
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable-character table that byte-level BPE vocabularies are spelt in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_bpe(metadata: dict[str, Any]) -> PreTrainedTokenizerFast:
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types = metadata.get("tokenizer.ggml.token_type")
    token_types = [] if token_types is None else token_types.tolist()
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())

    def respell(token: str) -> str:
        # A token written in plain text (not in the byte alphabet) would never match the
        # byte-level pre-tokenizer's output; transformers spells it out byte by byte.
        if set(token) <= spelled:
            return token
        return "".join(alphabet[b] for b in token.encode("utf-8"))

    vocab = {respell(token): i for i, token in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in metadata.get("tokenizer.ggml.merges", [])]
    backend = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    add_prefix_space = bool(metadata.get("tokenizer.ggml.add_space_prefix", False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    backend.decoder = decoders.ByteLevel()

    # Control tokens must stay whole and count as special. One spelt outside the byte alphabet
    # is a llama.cpp mislabel that would grow the vocabulary, so (like transformers) skip it.
    control = [
        AddedToken(tok, normalized=False, special=True)
        for tok, kind in zip(tokens, token_types, strict=False)
        if kind == _CONTROL and set(tok) <= spelled
    ]
    user_defined = [
        AddedToken(tok, normalized=False, special=False)
        for tok, kind in zip(tokens, token_types, strict=False)
        if kind == _USER_DEFINED and tok in vocab
    ]
    backend.add_special_tokens(control)
    backend.add_tokens(user_defined)

    def token_at(key: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    kwargs: dict[str, Any] = {
        "bos_token": token_at("bos_token_id"),
        "eos_token": token_at("eos_token_id"),
        "unk_token": token_at("unknown_token_id"),
        "pad_token": token_at("padding_token_id"),
    }
    # Only pass the flags the file states: passing them makes transformers rebuild the
    # post-processor (BOS/EOS insertion) from them, exactly as its own GGUF path does.
    for flag in ("add_bos_token", "add_eos_token"):
        if f"tokenizer.ggml.{flag}" in metadata:
            kwargs[flag] = bool(metadata[f"tokenizer.ggml.{flag}"])
    if "tokenizer.chat_template" in metadata:
        kwargs["chat_template"] = metadata["tokenizer.chat_template"]
    return PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
