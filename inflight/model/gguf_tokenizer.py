"""Building a Hugging Face tokenizer from a GGUF file's ``tokenizer.*`` metadata.

``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` takes ~4 s on SmolLM2 (it re-parses the
file and goes through the slow-tokenizer classes), which alone would blow the engine's 3 s
start-up budget. For byte-level BPE vocabularies whose pre-tokenizer is GPT-2's regex we build
the identical ``tokenizers.Tokenizer`` directly from the already-parsed metadata (~0.15 s)
and wrap it in :class:`GGUFTokenizer`, which encodes and decodes on it directly and builds
the transformers tokenizer only when something else is asked of it (a chat template, a
grammar's vocabulary): importing transformers alone takes 0.8-1.3 s, a third of the start-up
on the slower CPUs. Anything else falls back to transformers, which is slow but knows every
vocabulary flavour.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

# llama.cpp ``tokenizer.ggml.pre`` values for which transformers uses plain GPT-2 byte-level
# pre-tokenisation (no extra split regex), so our direct build reproduces it exactly. Other
# values (llama-bpe, qwen2, ...) need a different split regex: left to transformers.
_GPT2_REGEX_PRE_TYPES = {None, "default", "gpt-2", "smollm"}
_CONTROL = 3  # llama.cpp token type: special token such as <|im_start|>
_USER_DEFINED = 4  # llama.cpp token type: added token matched whole, but not special


def build_gguf_tokenizer(
    metadata: dict[str, Any], path: str
) -> GGUFTokenizer | PreTrainedTokenizerBase:
    """The tokenizer described by ``metadata`` (a parsed GGUF header) of the file at ``path``:
    a :class:`GGUFTokenizer` for GPT-2-style byte-level BPE, else transformers' own."""
    model = metadata.get("tokenizer.ggml.model")
    pre = metadata.get("tokenizer.ggml.pre")
    if model == "gpt2" and pre in _GPT2_REGEX_PRE_TYPES:
        return GGUFTokenizer(*_byte_level_bpe(metadata))
    # Imported here: AutoTokenizer's import alone costs ~0.3 s the fast path does not need.
    from transformers import AutoTokenizer

    directory, name = os.path.split(os.path.abspath(path))
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
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


def _byte_level_bpe(metadata: dict[str, Any]) -> tuple[Tokenizer, dict[str, Any]]:
    """The backend tokenizer and the keyword arguments transformers' tokenizer takes."""
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types = metadata.get("tokenizer.ggml.token_type")
    token_types = [] if token_types is None else token_types.tolist()
    alphabet = byte_alphabet()
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
    return backend, kwargs


class GGUFTokenizer:
    """A byte-level BPE tokenizer from GGUF metadata that encodes and decodes without
    transformers, and builds ``transformers.PreTrainedTokenizerFast`` on first use of
    anything else (:attr:`hf`; attribute access falls through to it).

    The backend is prepared as transformers prepares its copy of ``tokenizer_object``
    (``TokenizersBackend.__init__``: the named special tokens added as special tokens, the
    BOS/EOS post-processor from ``add_bos_token``/``add_eos_token``, no truncation or
    padding), so ``encode``/``decode`` give exactly what the transformers tokenizer gives
    (tests/worker/test_loader.py compares both against transformers' own GGUF loader).
    Once the transformers tokenizer exists, everything goes through it, so what a user
    changes on ``LLM.get_tokenizer()`` (a chat template, added tokens) reaches the engine,
    as when both were one object; setting an attribute here sets it there.
    """

    def __init__(self, backend: Tokenizer, hf_kwargs: dict[str, Any]) -> None:
        named = {k: hf_kwargs.get(f"{k}_token") for k in ("bos", "eos", "unk", "pad")}
        added = {str(t) for t in backend.get_added_tokens_decoder().values()}
        missing = [t for t in named.values() if t is not None and t not in added]
        if missing:  # transformers adds these as special tokens, so we do too
            backend.add_tokens([AddedToken(t, special=True) for t in dict.fromkeys(missing)])
        backend.no_truncation()
        backend.no_padding()
        add_bos = bool(hf_kwargs.get("add_bos_token")) and named["bos"] is not None
        add_eos = bool(hf_kwargs.get("add_eos_token")) and named["eos"] is not None
        if backend.post_processor is None or "add_bos_token" in hf_kwargs or (
            "add_eos_token" in hf_kwargs
        ):
            backend.post_processor = _template_processing(backend, named, add_bos, add_eos)
        ids = {f"{k}_token_id": (backend.token_to_id(t) if t is not None else None)
               for k, t in named.items()}
        # Set through __dict__: __setattr__ forwards public names to transformers.
        self.__dict__.update(
            _backend=backend, _hf_kwargs=hf_kwargs, _hf=None, _building=threading.Lock(),
            _own={"chat_template": hf_kwargs.get("chat_template"),
                  **{f"{k}_token": t for k, t in named.items()}, **ids},
        )

    @property
    def hf(self) -> PreTrainedTokenizerFast:
        """The transformers tokenizer over the same backend (built once, thread-safe)."""
        if self._hf is None:
            with self._building:
                if self._hf is None:
                    from transformers import PreTrainedTokenizerFast

                    self.__dict__["_hf"] = PreTrainedTokenizerFast(
                        tokenizer_object=self._backend, **self._hf_kwargs
                    )
        return self._hf

    @property
    def backend_tokenizer(self) -> Tokenizer:
        return self._backend if self._hf is None else self._hf.backend_tokenizer

    def encode(
        self, text: Any, text_pair: Any = None, add_special_tokens: bool = True, **kwargs: Any
    ) -> Any:
        """Token ids of ``text`` (a str); a pair, other arguments, or a built transformers
        tokenizer take transformers' ``encode``."""
        if self._hf is not None or text_pair is not None or kwargs or not isinstance(text, str):
            return self.hf.encode(text, text_pair, add_special_tokens=add_special_tokens, **kwargs)
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> Any:
        """Text of a sequence of ids; batches, tensors, other options or a built
        transformers tokenizer take transformers' ``decode`` (whose BPE path is the
        backend's decode with no clean-up)."""
        if self._hf is not None or kwargs or not _is_id_sequence(token_ids):
            return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        return self._backend.decode(
            [int(i) for i in token_ids], skip_special_tokens=skip_special_tokens
        )

    def __len__(self) -> int:
        if self._hf is not None:
            return len(self._hf)
        return self._backend.get_vocab_size(with_added_tokens=True)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.hf(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not found normally: the special tokens and chat template
        # (ours until transformers' exists), then everything else transformers offers.
        if name.startswith("_"):
            raise AttributeError(name)
        own = self.__dict__["_own"]
        if self.__dict__["_hf"] is None and name in own:
            return own[name]
        return getattr(self.hf, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.hf, name, value)

    def __getstate__(self) -> dict[str, Any]:  # for Ray: everything but the lock
        return {k: v for k, v in self.__dict__.items() if k != "_building"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _building=threading.Lock())

    def __repr__(self) -> str:
        return f"GGUFTokenizer(vocab_size={len(self)}, transformers built: {self._hf is not None})"


def hf_tokenizer(tokenizer: Any) -> Any:
    """The transformers tokenizer behind ``tokenizer`` (itself unless a GGUFTokenizer), for
    libraries that check its class (llguidance) and for users (``LLM.get_tokenizer``)."""
    return tokenizer.hf if isinstance(tokenizer, GGUFTokenizer) else tokenizer


def _is_id_sequence(token_ids: Any) -> bool:
    if isinstance(token_ids, int):
        return False
    return isinstance(token_ids, Sequence) and not isinstance(token_ids, str) and all(
        isinstance(i, int) for i in token_ids
    )


def _template_processing(
    backend: Tokenizer, named: dict[str, str | None], add_bos: bool, add_eos: bool
) -> processors.TemplateProcessing:
    """transformers' ``update_post_processor``: BOS/EOS around each sequence as asked."""
    bos, eos = named["bos"], named["eos"]
    single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
    pair_bos = f" {bos}:1" if add_bos else ""
    pair_eos = f" {eos}:1" if add_eos else ""
    pair = f"{single}{pair_bos} $B:1{pair_eos}"
    special = [(t, backend.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)
