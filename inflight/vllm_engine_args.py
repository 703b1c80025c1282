"""vLLM's engine arguments that inflight has no use for, so that a vLLM script runs as is.

``LLM(model, tensor_parallel_size=1, enforce_eager=True, gpu_memory_utilization=0.9, ...)``
is how vLLM scripts start. Each such argument is accepted at a value that changes nothing
here (logged when it would change something in vLLM), and refused by name, with the
reason, at any other value: never silently ignored. Arguments inflight implements are in
:func:`inflight.config.make_engine_config`; anything in neither is a ``TypeError`` there.

``inflight serve`` takes the same table as vLLM's command-line flags (``-tp 1``,
``--enforce-eager``, ``--gpu-memory-utilization 0.9``): see
:func:`inflight.entrypoints.engine_args.add_vllm_only_args`.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Accepts:
    """A test of a value, with the values it lets through in words (for ``--help``)."""

    test: Callable[[Any], bool]
    text: str

    def __call__(self, value: Any) -> bool:
        return self.test(value)


@dataclass(frozen=True, slots=True)
class Neutral:
    """Accepted when ``accepts(value)``; ``note`` says what inflight does instead.

    ``parse`` reads the value from vLLM's command-line flag (``--tensor-parallel-size``,
    plus ``aliases`` such as ``-tp``); None for an on/off flag (``--x`` / ``--no-x``)."""

    accepts: Accepts
    note: str
    parse: Callable[[str], Any] | None = None
    aliases: tuple[str, ...] = ()
    several: bool = False  # the flag takes one or more values (vLLM's nargs="+")

    @property
    def is_switch(self) -> bool:
        return self.parse is None


def equals(*values: Any) -> Accepts:
    """Accepts exactly these values."""
    return Accepts(lambda value: value in values, " or ".join(_spelled(v) for v in values))


def _spelled(value: Any) -> str:
    """A value as ``--help`` writes it: None, 1, auto; an empty string or dict as JSON."""
    if isinstance(value, (dict, str)) and not value:
        return json.dumps(value)
    return str(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


IS_BOOL = Accepts(lambda value: isinstance(value, bool), "True or False")
_IS_INT = Accepts(lambda value: isinstance(value, int), "any integer")
_FRACTION = Accepts(lambda value: _is_number(value) and 0 < value <= 1, "a fraction in (0, 1]")
_NON_NEGATIVE = Accepts(lambda value: _is_number(value) and value >= 0, "any number >= 0")
_NO_OVERRIDES = Accepts(lambda value: value is None or value == {}, "None or {}")
# the model's own path is accepted too: see refusal()
_OWN_TOKENIZER = Accepts(lambda value: value is None, "None or the model's own path")
_ANY_NAMES = Accepts(
    lambda value: value is None or isinstance(value, (str, list, tuple)), "any name(s)")
_NO_MEDIA = Accepts(
    lambda value: value is None or (isinstance(value, dict) and not any(value.values())),
    'None or zero items per modality ({"image": 0})')


def optional_str(text: str) -> str | None:
    """vLLM's reading of an optional string flag: '' and 'None' are None."""
    return None if text in ("", "None") else text


def json_value(text: str) -> Any:
    """A flag's JSON value (vLLM's dict flags); 'None' is None."""
    if text == "None":
        return None
    return json.loads(text)


def level_or_json(text: str) -> Any:
    """``--compilation-config`` / ``-O``: an optimisation level, or a JSON object."""
    return int(text) if text.strip().isdigit() else json_value(text)


_ONE_DEVICE = "one engine runs on one device; scale out with data-parallel replicas on Ray"
_FROM_PATH = "models load from a local path, not the Hub"
VLLM_ONLY_ARGS: dict[str, Neutral] = {
    "tensor_parallel_size": Neutral(
        equals(1), f"tensor parallelism is not supported ({_ONE_DEVICE})", int, ("-tp",)),
    "pipeline_parallel_size": Neutral(
        equals(1), f"pipeline parallelism is not supported ({_ONE_DEVICE})", int, ("-pp",)),
    "data_parallel_size": Neutral(
        equals(1), "data parallelism runs on Ray: inflight serve --data-parallel-size", int,
        ("-dp",)),
    "enforce_eager": Neutral(IS_BOOL, "inflight always runs eagerly (no CUDA graphs)"),
    "max_seq_len_to_capture": Neutral(_IS_INT, "inflight captures no CUDA graphs", int),
    "disable_custom_all_reduce": Neutral(IS_BOOL, "inflight has no all-reduce"),
    "disable_async_output_proc": Neutral(IS_BOOL, "outputs are processed in the engine step"),
    "disable_log_stats": Neutral(
        IS_BOOL, "inflight logs no periodic stats (a server's are at /metrics)"),
    "trust_remote_code": Neutral(
        IS_BOOL, "inflight runs its own Llama code, never a checkpoint's"),
    "gpu_memory_utilization": Neutral(
        _FRACTION, "the KV cache is sized by kv_cache_memory_bytes (or num_kv_blocks), as "
        "vLLM's CPU backend sizes it by VLLM_CPU_KVCACHE_SPACE", float),
    "swap_space": Neutral(
        _NON_NEGATIVE, "preempted requests are recomputed, never swapped", float),
    "cpu_offload_gb": Neutral(equals(0), "weights are never offloaded", float),
    "tokenizer": Neutral(
        _OWN_TOKENIZER, "the tokenizer always comes with the model (its directory or GGUF "
        "file)", optional_str),
    "tokenizer_mode": Neutral(
        equals("auto"), "the model's fast tokenizer is always used", str),
    "skip_tokenizer_init": Neutral(equals(False), "the tokenizer is always loaded"),
    "revision": Neutral(equals(None), _FROM_PATH, optional_str),
    "tokenizer_revision": Neutral(equals(None), _FROM_PATH, optional_str),
    "code_revision": Neutral(equals(None), _FROM_PATH, optional_str),
    "download_dir": Neutral(equals(None), _FROM_PATH, optional_str),
    "hf_token": Neutral(equals(None), _FROM_PATH, optional_str),
    "load_format": Neutral(
        equals("auto"), "the format is read from the model path (safetensors or GGUF)", str),
    "hf_overrides": Neutral(_NO_OVERRIDES, "the model's config is used as it is", json_value),
    "compilation_config": Neutral(
        equals(None, 0), "inflight compiles no graphs", level_or_json, ("-O",)),
    "enable_lora": Neutral(equals(False), "LoRA adapters are not supported"),
    "enable_sleep_mode": Neutral(equals(False), "the engine never sleeps"),
    "distributed_executor_backend": Neutral(
        equals(None, "mp", "uni"), "the engine runs in this process (data parallelism: "
        "inflight serve --data-parallel-backend ray)", optional_str),
    "task": Neutral(equals("auto", "generate"), "inflight runs generative models only", str),
    "runner": Neutral(equals("auto", "generate"), "inflight runs generative models only", str),
    "served_model_name": Neutral(
        _ANY_NAMES, "offline outputs carry no model name (the server's is inflight serve "
        "--served-model-name)", str),
    "limit_mm_per_prompt": Neutral(_NO_MEDIA, "this model reads text only", json_value),
    "mm_processor_kwargs": Neutral(_NO_OVERRIDES, "this model reads text only", json_value),
    "speculative_config": Neutral(
        equals(None), "speculative decoding is not supported", json_value),
    "kv_transfer_config": Neutral(equals(None), "KV transfer is not supported", json_value),
    "structured_outputs_config": Neutral(
        equals(None), "structured outputs always use llguidance", json_value),
    "disable_log_requests": Neutral(IS_BOOL, "the offline engine logs no requests"),
    "enable_log_requests": Neutral(equals(False), "the offline engine logs no requests"),
    "logprobs_mode": Neutral(
        equals("raw_logprobs"),
        "logprobs are always the model's raw distribution (vLLM's raw_logprobs)", str),
    "async_scheduling": Neutral(IS_BOOL, "each step is scheduled after the previous one"),
    "disable_sliding_window": Neutral(IS_BOOL, "Llama models have no sliding window"),
    "model_impl": Neutral(equals("auto", "vllm"), "inflight runs its own Llama code", str),
    "use_tqdm_on_load": Neutral(IS_BOOL, "loading shows no progress bar"),
    "allowed_local_media_path": Neutral(equals(""), "this model reads text only", str),
}


def _same_path(a: Any, b: str | None) -> bool:
    if not isinstance(a, str) or b is None:
        return False
    target = Path(b).expanduser().resolve()
    given = Path(a).expanduser().resolve()
    # a GGUF file's tokenizer is inside it: its folder names the same model
    return given == target or (target.suffix == ".gguf" and given == target.parent)


def refusal(name: str, value: Any, model: str | None = None) -> str | None:
    """Why vLLM-only argument ``name`` cannot be ``value`` here, or None if it may.
    ``tokenizer`` may also name ``model`` itself (vLLM's ``LLM(model=p, tokenizer=p)``)."""
    if name == "tokenizer" and _same_path(value, model):
        return None
    rule = VLLM_ONLY_ARGS[name]
    return None if rule.accepts(value) else rule.note


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
    for name, rule in VLLM_ONLY_ARGS.items():
        if name not in kept:
            continue
        value = kept.pop(name)
        if (reason := refusal(name, value, model)) is not None:
            raise ValueError(f"{name}={value!r} is not supported: {reason}")
        logger.info("%s=%r accepted with no effect: %s", name, value, rule.note)
    unknown = sorted(set(kept) - set(defaults) - {"seed"})
    if unknown:
        raise TypeError(
            f"unexpected keyword argument(s) {unknown}: neither an engine option of inflight "
            "(see inflight.config.make_engine_config) nor a vLLM argument it accepts "
            "(inflight.vllm_engine_args.VLLM_ONLY_ARGS)"
        )
    return kept
