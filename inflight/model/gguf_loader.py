"""Loading a Llama-family checkpoint from a single GGUF file (llama.cpp's format).

This module owns the GGUF -> Hugging Face translation: architecture from metadata, tensor
names, dequantisation to float32, and undoing llama.cpp's rotary row permutation of q/k.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from inflight.model.arch import LlamaArchConfig
from inflight.model.gguf_reader import GGUFFile, GGUFTensor, read_gguf
from inflight.model.loader import LoadedCheckpoint, QuantizedWeight

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# llama.cpp stores Llama 3.x RoPE scaling as per-dimension frequency divisors in this tensor.
_ROPE_FREQS = "rope_freqs.weight"
ArrayT = TypeVar("ArrayT", torch.Tensor, np.ndarray)


def load_gguf(path: str) -> LoadedCheckpoint:
    """Read ``path`` (a .gguf file) into float32 HF-named weights, arch and tokenizer."""
    file = read_gguf(path)
    arch = gguf_arch_config(file)
    tensors = [t for t in file.tensors.values() if t.name != _ROPE_FREQS]  # rope_freqs: in arch
    names = [_hf_name(t.name, path) for t in tensors]
    if file.metadata["general.architecture"] == "llama":
        for i, hf_name in enumerate(names):
            if ".q_proj." in hf_name or ".k_proj." in hf_name:
                heads = (
                    arch.num_attention_heads if ".q_proj." in hf_name else arch.num_key_value_heads
                )
                tensors[i] = _unpermute_stored_rows(tensors[i], heads)
    order = sorted(range(len(names)), key=lambda i: _fusion_order(names[i]))
    names, tensors = [names[i] for i in order], [tensors[i] for i in order]
    # Decoding (C++ and page faults, without the GIL) overlaps the tokenizer's build, which
    # is Python (reading the vocabulary; for vocabularies gguf_tokenizer cannot build
    # itself, importing transformers too). The decoding thread must import nothing: imports
    # in two threads at once can see each other's half-initialised modules (measured:
    # transformers failing to find huggingface_hub.utils), so its kernels are loaded here
    # first.
    _load_decoders()
    with ThreadPoolExecutor(max_workers=1) as pool:
        decoded = pool.submit(decode_all, tensors)
        from inflight.model.gguf_tokenizer import build_gguf_tokenizer

        try:
            tokenizer = build_gguf_tokenizer(file.metadata, path)
        except Exception:
            decoded.result()  # a weight that cannot be decoded is the first error to report
            raise
        values, stored = decoded.result()
        weights = dict(zip(names, values, strict=True))
    quantized = {
        name: QuantizedWeight(int(t.ggml_type), _row_blocks(t, raw))
        for name, t, raw in zip(names, tensors, stored, strict=True)
        if t.ggml_type in BLOCK_MATMUL_TYPES and len(t.shape) == 2
    }
    return LoadedCheckpoint(
        arch=arch, weights=weights, tokenizer=tokenizer, source=path, quantized=quantized
    )


_FUSED_PARTS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


def _fusion_order(hf_name: str) -> tuple[str, str, int]:
    """Sort key that puts each layer's q/k/v and gate/up projections next to each other, in
    the order the model fuses them: decoded in that order into one buffer per type, they
    become one fused weight without a copy (see ``LlamaForCausalLM.load_hf_weights``)."""
    for rank, part in enumerate(_FUSED_PARTS):
        if f".{part}." in hf_name:
            return hf_name.split(part)[0], hf_name.rsplit(".", 1)[1], rank
    return hf_name, "", len(_FUSED_PARTS)


# Types the block matmul kernel reads directly (32 weights per block, one f16 scale and for
# Q4_1 one f16 minimum); other types are used only through their float32 decoding.
BLOCK_MATMUL_TYPES = (QT.Q4_0, QT.Q4_1, QT.Q8_0)


def _row_blocks(tensor: GGUFTensor, stored: torch.Tensor | None) -> torch.Tensor:
    """The tensor's stored blocks as [rows, row_bytes] uint8, out of the file map: the copy
    decode_all made (a view into it), else a copy of its own."""
    if stored is not None:
        return stored.view(tensor.shape[0], -1)
    return torch.from_numpy(tensor.data.reshape(tensor.shape[0], -1).copy())


def gguf_arch_config(file: GGUFFile) -> LlamaArchConfig:
    """The architecture record from the file's ``<arch>.*`` and ``tokenizer.ggml.*`` keys."""
    md, path = file.metadata, file.path
    name = md.get("general.architecture")
    if name not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {name!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    def key(suffix: str, default: Any = None) -> Any:
        value = md.get(f"{name}.{suffix}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata lacks required key {name}.{suffix!r}")
        if isinstance(value, (np.ndarray, list)):
            raise ValueError(f"{path}: per-layer {name}.{suffix} is not supported")
        return value

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    if int(key("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"{path}: partial rotary embeddings are not supported")
    scaling = md.get(f"{name}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"{path}: RoPE scaling type {scaling!r} is not supported")
    rope_theta = float(key("rope.freq_base", 10000.0))

    llama3 = None
    if _ROPE_FREQS in file.tensors:
        divisors = dequantize(file.tensors[_ROPE_FREQS]).double()
        llama3 = _llama3_scaling_from_divisors(divisors, rope_theta, path)

    vocab = md.get(f"{name}.vocab_size")
    if vocab is None:
        tokens = md.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens is not None else file.tensors["token_embd.weight"].shape[0]
    # llama.cpp ends generation on any of these; the engine should too.
    eos = [
        md[k]
        for k in (
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        )
        if k in md
    ]
    bos = md.get("tokenizer.ggml.bos_token_id")
    return LlamaArchConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_theta=rope_theta,
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in file.tensors,
        attention_bias="blk.0.attn_q.bias" in file.tensors,
        rope_llama3_scaling=llama3,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
    )


def _hf_name(gguf_name: str, path: str) -> str:
    if gguf_name.endswith(".weight") and gguf_name[: -len(".weight")] in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name[: -len(".weight")]] + ".weight"
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    # An unknown tensor means an architecture variant we would silently compute wrongly.
    raise ValueError(f"{path}: unexpected tensor {gguf_name!r} for a Llama-family model")


def unpermute_rope_rows(w: ArrayT, n_heads: int) -> ArrayT:
    """Undo llama.cpp's q/k row order so rows match HF's rotate-half RoPE layout.

    HF rotates dimension i of a head with dimension i + head_dim/2; ggml's Llama RoPE rotates
    adjacent pairs (2i, 2i+1). llama.cpp's converter therefore reorders each head's rows from
    [first half, second half] to interleaved (x0, x_h, x1, x_h+1, ...); we de-interleave.
    Qwen2 uses ggml's NeoX RoPE (rotate-half, like HF), so its file is not permuted.
    Works on torch tensors and numpy arrays alike (the reshape after swapaxes copies).
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute_stored_rows(tensor: GGUFTensor, n_heads: int) -> GGUFTensor:
    """``tensor`` with its rows put in HF order before decoding.

    Quantisation blocks never straddle rows, so reordering each row's stored bytes is
    equivalent to reordering decoded rows, moves 1/8 of the data for 4-bit types, and keeps
    the per-tensor work in numpy (no extra multi-threaded torch calls, see dequantize_all).
    """
    if len(tensor.shape) == 1 and gguf.GGML_QUANT_SIZES[tensor.ggml_type][0] != 1:
        raise ValueError(f"1-D tensor {tensor.name!r} is block-quantised; cannot reorder it")
    rows = tensor.data.reshape(tensor.shape[0], -1)  # one row of bytes per output feature
    return replace(tensor, data=unpermute_rope_rows(rows, n_heads).reshape(-1))


def _llama3_divisors(
    scaling: tuple[float, float, float, int], head_dim: int, theta: float
) -> torch.Tensor:
    factor, low, high, original = scaling
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = ((original / wavelen - low) / (high - low)).clamp(0, 1)
    # smooth=1 (short wavelengths) keeps the frequency, smooth=0 divides it by `factor`.
    return 1 / ((1 - smooth) / factor + smooth)


def _llama3_scaling_from_divisors(
    divisors: torch.Tensor, theta: float, path: str
) -> tuple[float, float, float, int]:
    """Recover Llama 3.x's (factor, low, high, original_max_pos) from llama.cpp's rope_freqs.

    Every released Llama 3.x uses low=1, high=4, original=8192; only the factor differs, and
    it is the largest divisor. We verify the reconstruction rather than trust the guess.
    """
    candidate = (float(divisors.max()), 1.0, 4.0, 8192)
    expected = _llama3_divisors(candidate, 2 * divisors.numel(), theta)
    if not torch.allclose(expected, divisors, rtol=1e-3):
        raise ValueError(f"{path}: rope_freqs do not match Llama 3 RoPE scaling; not supported")
    return candidate


def dequantize(tensor: GGUFTensor) -> torch.Tensor:
    """One tensor as float32 in torch order (``tensor.shape``)."""
    return dequantize_all([tensor])[0]


def dequantize_all(tensors: Sequence[GGUFTensor]) -> list[torch.Tensor]:
    """Each tensor as float32 in torch order, never sharing memory with the file (see
    :func:`decode_all`)."""
    return decode_all(tensors)[0]


def decode_all(
    tensors: Sequence[GGUFTensor],
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Each tensor as float32 in torch order, never sharing memory with the file, and for
    the types decoded here its stored bytes (flat uint8, copied out of the file once for
    decoding and kept, so the block kernels' weights need no second copy; None otherwise).

    F32/F16/BF16/Q8_0/Q4_0/Q4_1 are decoded with the C++ kernel or torch (bit-identical to
    ``gguf.quants.dequantize``, multi-threaded, ~2x faster single-threaded), all tensors of a
    type in one pass: per-tensor decoding is ~1500 parallel regions for a small model, and
    on a shared CPU each can stall on a descheduled OpenMP thread (measured 4-15 s instead of
    0.5 s). The results are then views into one buffer per type. Other types the gguf
    package can decode go through it; anything else raises ValueError.
    """
    out: list[torch.Tensor | None] = [None] * len(tensors)
    stored: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[QT, list[int]] = {}
    for i, tensor in enumerate(tensors):
        if tensor.ggml_type in _TORCH_DECODERS:
            groups.setdefault(tensor.ggml_type, []).append(i)
        else:
            out[i] = _dequantize_with_gguf(tensor)
    for qtype, indices in groups.items():
        raw = torch.cat([torch.from_numpy(tensors[i].data) for i in indices])  # copies
        flat = _decode(qtype, raw).reshape(-1)
        sizes = [math.prod(tensors[i].shape) for i in indices]
        for i, part in zip(indices, flat.split(sizes), strict=True):
            out[i] = part.view(tensors[i].shape)
        nbytes = [tensors[i].data.size for i in indices]
        for i, part in zip(indices, raw.reshape(-1).split(nbytes), strict=True):
            stored[i] = part
    return out, stored  # type: ignore[return-value]


def _load_decoders() -> None:
    """Import and load (once per process) everything :func:`dequantize_all` uses."""
    from inflight.kernels import cpu

    cpu.available()


def _decode(qtype: QT, raw: torch.Tensor) -> torch.Tensor:
    """Raw bytes of whole blocks -> float32, by the C++ kernel when built (one pass, 4-5x
    faster than the torch decoders, same bits) or by torch."""
    if qtype in BLOCK_MATMUL_TYPES:
        from inflight.kernels import cpu

        if cpu.available():
            return cpu.gguf_dequantize(raw.view(-1, gguf.GGML_QUANT_SIZES[qtype][1]), int(qtype))
    return _TORCH_DECODERS[qtype](raw).float()


def _dequantize_with_gguf(tensor: GGUFTensor) -> torch.Tensor:
    block_size, type_size = gguf.GGML_QUANT_SIZES[tensor.ggml_type]
    rows = tensor.data.reshape(-1, tensor.ggml_shape[0] // block_size * type_size)
    try:
        values = gguf.quants.dequantize(rows, tensor.ggml_type)
    except NotImplementedError:
        raise ValueError(
            f"tensor {tensor.name!r} has unsupported ggml type {tensor.ggml_type.name}"
        ) from None
    return torch.from_numpy(values).float().reshape(tensor.shape)


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The little-endian float16 at byte ``start`` of each block, as a float32 column."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


# The decoders write into one preallocated float32 buffer and scale it in place: the output
# is ~4x the file size, so every extra full-size temporary costs more than the arithmetic.
def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """4-bit values as float32: element j is the low nibble of byte j, j+16 its high nibble."""
    out = torch.empty(qs.shape[0], 2 * qs.shape[1], dtype=torch.float32)
    out[:, : qs.shape[1]] = qs & 0x0F
    out[:, qs.shape[1] :] = qs >> 4
    return out


def _q8_0(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.view(torch.int8).reshape(-1, 34)  # f16 scale, 32 x int8
    return blocks[:, 2:].float().mul_(_half(blocks, 0))


def _q4_0(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.reshape(-1, 18)  # f16 scale, 16 bytes of 4-bit values offset by 8
    return _nibbles(blocks[:, 2:]).sub_(8).mul_(_half(blocks, 0))


def _q4_1(raw: torch.Tensor) -> torch.Tensor:
    blocks = raw.reshape(-1, 20)  # f16 scale, f16 minimum, 16 bytes of 4-bit values
    return _nibbles(blocks[:, 4:]).mul_(_half(blocks, 0)).add_(_half(blocks, 2))


_TORCH_DECODERS = {
    QT.F32: lambda raw: raw.view(torch.float32),
    QT.F16: lambda raw: raw.view(torch.float16),
    QT.BF16: lambda raw: raw.view(torch.bfloat16),
    QT.Q8_0: _q8_0,
    QT.Q4_0: _q4_0,
    QT.Q4_1: _q4_1,
}
