"""Loading a Llama-family checkpoint from a Hugging Face model directory.

This module owns the translation of ``config.json`` (+ ``generation_config.json``) into a
``LlamaArchConfig`` and reading the ``*.safetensors`` weights as float32.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from transformers import AutoTokenizer

from inflight.model.arch import LlamaArchConfig
from inflight.model.loader import LoadedCheckpoint

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def load_hf_directory(directory: Path) -> LoadedCheckpoint:
    """Read a ``save_pretrained``-style directory: config, safetensors weights, tokenizer."""
    config = _read_json(directory / "config.json")
    generation = directory / "generation_config.json"
    generation_config = _read_json(generation) if generation.is_file() else {}
    arch = hf_arch_config(config, generation_config, source=str(directory))
    weights = _load_safetensors(directory)
    if arch.tie_word_embeddings:
        # Some tied checkpoints still store the (identical) head; the contract omits it.
        weights.pop("lm_head.weight", None)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return LoadedCheckpoint(arch=arch, weights=weights, tokenizer=tokenizer, source=str(directory))


def hf_arch_config(
    config: dict[str, Any], generation_config: dict[str, Any], source: str = "config.json"
) -> LlamaArchConfig:
    """The architecture record for a transformers ``config.json`` dict; ``ValueError``
    naming ``source`` and the field for a missing or malformed one."""
    try:
        return _arch_config(config, generation_config, source)
    except (KeyError, TypeError) as error:
        what = f"missing {error}" if isinstance(error, KeyError) else f"malformed: {error}"
        raise ValueError(f"{source}: config {what}") from None


def _arch_config(
    config: dict[str, Any], generation_config: dict[str, Any], source: str
) -> LlamaArchConfig:
    if not isinstance(config, dict):
        raise ValueError(f"{source}: config.json must hold a JSON object")
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{source}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    max_positions = int(config.get("max_position_embeddings", 2048))
    _reject_unsupported_features(config, model_type, max_positions, source)

    # transformers >= 5 writes RoPE settings under rope_parameters; older files use
    # rope_theta + rope_scaling at top level.
    rope = dict(config.get("rope_parameters") or {})
    rope_theta = float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0)
    scaling = config.get("rope_scaling") or rope
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    llama3 = None
    if rope_type == "llama3":
        llama3 = (
            float(scaling["factor"]),
            float(scaling["low_freq_factor"]),
            float(scaling["high_freq_factor"]),
            int(scaling["original_max_position_embeddings"]),
        )
    elif rope_type != "default":
        raise ValueError(
            f"{source}: rope scaling type {rope_type!r} is not supported (only llama3)"
        )

    eos: list[int] = []
    for cfg in (config, generation_config):
        value = cfg.get("eos_token_id")
        eos += [value] if isinstance(value, int) else list(value or [])
    bos = config.get("bos_token_id", generation_config.get("bos_token_id"))
    return LlamaArchConfig(
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_hidden_layers=int(config["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
        rope_llama3_scaling=llama3,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos)),
    )


def _reject_unsupported_features(
    config: dict[str, Any], model_type: str, max_positions: int, source: str
) -> None:
    """Raise for config options the engine would otherwise silently compute wrongly."""
    window = config.get("sliding_window")
    # Qwen2 configs carry a sliding_window that only applies with use_sliding_window=True.
    uses_window = model_type == "mistral" or config.get("use_sliding_window", False)
    if uses_window and window is not None and int(window) < max_positions:
        raise ValueError(
            f"{source}: sliding-window attention (sliding_window={window} < "
            f"max_position_embeddings={max_positions}) is not supported"
        )
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(
            f"{source}: hidden_act {config['hidden_act']!r} is not supported (only silu)"
        )
    if model_type != "qwen2" and config.get("attention_bias", False):
        # Llama's attention_bias also biases o_proj, which the architecture record lacks.
        raise ValueError(f"{source}: attention_bias=True is only supported for qwen2")
    if config.get("mlp_bias", False):
        raise ValueError(f"{source}: mlp_bias=True is not supported")


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON file; ``ValueError`` naming it when it does not parse."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)  # type: ignore[no-any-return]
    except ValueError as error:  # JSON and UTF-8 decode errors
        raise ValueError(f"{path} is not valid JSON: {error}") from None


def _load_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shard_names = sorted(set(_read_json(index)["weight_map"].values()))
        shards = [directory / name for name in shard_names]
    else:
        shards = sorted(directory.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{directory}: no *.safetensors weight files found")
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        try:
            tensors = load_file(shard)
        except SafetensorError as error:
            raise ValueError(f"{shard} is not a valid safetensors file: {error}") from None
        for name, tensor in tensors.items():
            # Some older exports include the (recomputed) RoPE inverse-frequency buffer.
            if not name.endswith("rotary_emb.inv_freq"):
                weights[name] = tensor.float()
    return weights
