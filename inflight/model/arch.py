"""Architecture description of a Llama-family decoder, independent of where weights come from.

Both weight loaders (Hugging Face directory, GGUF file) produce this record; the model
builds itself from it. Field names follow transformers' ``LlamaConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LlamaArchConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Qwen2 puts a bias on the q/k/v projections; Llama and Mistral do not.
    attention_bias: bool = False
    # Llama 3.x "llama3" RoPE frequency scaling, as (factor, low_freq_factor,
    # high_freq_factor, original_max_position_embeddings); None means plain RoPE.
    rope_llama3_scaling: tuple[float, float, float, int] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
