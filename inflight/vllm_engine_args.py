"""vLLM's engine arguments that inflight has no use for, so that a vLLM script runs as is.

``LLM(model, tensor_parallel_size=1, enforce_eager=True, gpu_memory_utilization=0.9, ...)``
is how vLLM scripts start. Each such argument is accepted at a value that changes nothing
here (logged when it would change something in vLLM), and refused by name, with the
reason, at any other value: never silently ignored. Arguments inflight implements are in
:func:`inflight.config.make_engine_config`; anything in neither is a ``TypeError`` there.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Neutral:
    """Accepted when ``accepts(value)``; ``note`` says what inflight does instead."""

    accepts: Callable[[Any], bool]
    note: str


def _equals(*values: Any) -> Callable[[Any], bool]:
    return lambda value: value in values


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _fraction(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1


def _non_negative(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0


_ONE_DEVICE = "one engine runs on one device; scale out with data-parallel replicas on Ray"
VLLM_ONLY_ARGS: dict[str, Neutral] = {
    "tensor_parallel_size": Neutral(_equals(1), f"tensor parallelism is not supported ({_ONE_DEVICE})"),
    "pipeline_parallel_size": Neutral(_equals(1), f"pipeline parallelism is not supported ({_ONE_DEVICE})"),
    "data_parallel_size": Neutral(_equals(1), "data parallelism runs on Ray: inflight serve --data-parallel-size"),
    "enforce_eager": Neutral(_is_bool, "inflight always runs eagerly (no CUDA graphs)"),
    "max_seq_len_to_capture": Neutral(lambda v: isinstance(v, int), "inflight captures no CUDA graphs"),
    "disable_custom_all_reduce": Neutral(_is_bool, "inflight has no all-reduce"),
    "disable_async_output_proc": Neutral(_is_bool, "outputs are processed in the engine step"),
    "disable_log_stats": Neutral(_is_bool, "the offline engine logs no periodic stats"),
    "trust_remote_code": Neutral(_is_bool, "inflight runs its own Llama code, never a checkpoint's"),
    "gpu_memory_utilization": Neutral(
        _fraction, "the KV cache is sized by kv_cache_memory_bytes (or num_kv_blocks), as vLLM's "
        "CPU backend sizes it by VLLM_CPU_KVCACHE_SPACE"),
    "swap_space": Neutral(_non_negative, "preempted requests are recomputed, never swapped"),
    "cpu_offload_gb": Neutral(_equals(0), "weights are never offloaded"),
    "tokenizer": Neutral(_equals(None), "the tokenizer always comes with the model (its directory or GGUF file)"),
    "tokenizer_mode": Neutral(_equals("auto"), "the model's fast tokenizer is always used"),
    "skip_tokenizer_init": Neutral(_equals(False), "the tokenizer is always loaded"),
    "revision": Neutral(_equals(None), "models load from a local path, not the Hub"),
    "tokenizer_revision": Neutral(_equals(None), "models load from a local path, not the Hub"),
    "code_revision": Neutral(_equals(None), "models load from a local path, not the Hub"),
    "download_dir": Neutral(_equals(None), "models load from a local path, not the Hub"),
    "hf_token": Neutral(_equals(None), "models load from a local path, not the Hub"),
    "load_format": Neutral(_equals("auto"), "the format is read from the model path (safetensors or GGUF)"),
    "hf_overrides": Neutral(lambda v: v is None or v == {}, "the model's config is used as it is"),
    "compilation_config": Neutral(_equals(None, 0), "inflight compiles no graphs"),
    "enable_lora": Neutral(_equals(False), "LoRA adapters are not supported"),
    "enable_sleep_mode": Neutral(_equals(False), "the engine never sleeps"),
    "distributed_executor_backend": Neutral(
        _equals(None, "mp", "uni"), "the engine runs in this process (data parallelism: "
        "inflight serve --data-parallel-backend ray)"),
    "task": Neutral(_equals("auto", "generate"), "inflight runs generative models only"),
    "runner": Neutral(_equals("auto", "generate"), "inflight runs generative models only"),
    "served_model_name": Neutral(
        lambda v: v is None or isinstance(v, (str, list, tuple)),
        "offline outputs carry no model name (the server's is inflight serve --served-model-name)"),
    "limit_mm_per_prompt": Neutral(
        lambda v: v is None or (isinstance(v, dict) and not any(v.values())),
        "this model reads text only"),
    "mm_processor_kwargs": Neutral(lambda v: v is None or v == {}, "this model reads text only"),
    "speculative_config": Neutral(_equals(None), "speculative decoding is not supported"),
    "kv_transfer_config": Neutral(_equals(None), "KV transfer is not supported"),
    "structured_outputs_config": Neutral(
        _equals(None), "structured outputs always use llguidance"),
    "disable_log_requests": Neutral(_is_bool, "the offline engine logs no requests"),
    "enable_log_requests": Neutral(_equals(False), "the offline engine logs no requests"),
    "logprobs_mode": Neutral(
        _equals("raw_logprobs"),
        "logprobs are always the model's raw distribution (vLLM's raw_logprobs)"),
    "async_scheduling": Neutral(_is_bool, "each step is scheduled after the previous one"),
    "disable_sliding_window": Neutral(_is_bool, "Llama models have no sliding window"),
    "model_impl": Neutral(_equals("auto", "vllm"), "inflight runs its own Llama code"),
    "use_tqdm_on_load": Neutral(_is_bool, "loading shows no progress bar"),
    "allowed_local_media_path": Neutral(_equals(""), "this model reads text only"),
}


def _same_path(a: Any, b: str | None) -> bool:
    if not isinstance(a, str) or b is None:
        return False
    target = Path(b).expanduser().resolve()
    given = Path(a).expanduser().resolve()
    # a GGUF file's tokenizer is inside it: its folder names the same model
    return given == target or (target.suffix == ".gguf" and given == target.parent)


def take_vllm_only_args(options: dict[str, Any], model: str | None = None) -> dict[str, Any]:
    """``options`` for :func:`inflight.config.make_engine_config`: each vLLM-only argument
    checked and taken out (a neutral value is accepted, logged at INFO with what inflight
    does instead; any other raises ``ValueError`` naming the argument and the reason), and
    an option given as None where inflight's default is not None (vLLM's "unset", as
    scripts pass ``args.max_num_seqs`` through) dropped, so that default applies."""
    from inflight.config import make_engine_config

    defaults = {
        name: parameter.default
        for name, parameter in inspect.signature(make_engine_config).parameters.items()
        if name != "seed"  # seed=None means a fresh seed, not the default
    }
    kept = {
        name: value for name, value in options.items()
        if not (value is None and defaults.get(name) is not None)
    }
    if _same_path(kept.get("tokenizer"), model):
        kept.pop("tokenizer")  # vLLM's LLM(model=p, tokenizer=p): the model's own
    for name, rule in VLLM_ONLY_ARGS.items():
        if name not in kept:
            continue
        value = kept.pop(name)
        if not rule.accepts(value):
            raise ValueError(f"{name}={value!r} is not supported: {rule.note}")
        logger.info("%s=%r accepted with no effect: %s", name, value, rule.note)
    unknown = sorted(set(kept) - set(defaults) - {"seed"})
    if unknown:
        raise TypeError(
            f"unexpected keyword argument(s) {unknown}: neither an engine option of inflight "
            "(see inflight.config.make_engine_config) nor a vLLM argument it accepts "
            "(inflight.vllm_engine_args.VLLM_ONLY_ARGS)"
        )
    return kept
