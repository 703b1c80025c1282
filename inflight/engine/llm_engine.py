"""The synchronous engine: the step loop that joins scheduler and model runner.

    add_request -> waiting
    step():  Scheduler.schedule() -> ModelRunner.execute_model() ->
             Scheduler.update_from_output() -> detokenise, stop strings -> RequestOutput

The offline ``LLM`` class and the server both drive this same surface
(``add_request`` / ``step`` / ``abort_request``).

Errors: a request the engine cannot run raises ``ValueError`` (an
:class:`InvalidRequestError` naming the field) from ``add_request``, changing nothing.
If preparing one request's part of a step fails all the same, that request alone ends
with ``finish_reason="error"`` and the message in ``CompletionOutput.error`` (as vLLM's
FINISHED_ERROR, the output is returned rather than raised, so ``LLM.generate`` still
gives every other prompt its output); the other requests in the step go on unchanged.

Structured outputs: ``add_request`` validates the constraint (a bad schema, regex or
grammar raises there) and starts compiling its grammar on a background thread; the
scheduler's readiness check keeps the request waiting until it is compiled while the
other requests step on (see ``structured_output/manager.py``).

``n > 1`` (vLLM V1's ``ParentRequest``): the request fans out into n child requests
(ids ``"{index}_{request_id}"``, ``seed + index``), merged back into one
``RequestOutput`` with n ``CompletionOutput``s, finished when all are. Child 0 is added
at once and the others only once child 0's prompt is computed, so they find the prompt's
full blocks in the prefix cache and recompute only its partial last block: the prompt is
computed once. Without prefix caching (or with static batching) all children are added
at once and each computes the prompt. Aborting the request aborts every child.

Turning each step's updates into ``RequestOutput``s (logprobs, detokenising, stop
strings, merging the children of an ``n > 1`` request) is ``output_processor.py``'s.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from typing import Any

from inflight.config import DEFAULT_KV_CACHE_MEMORY_BYTES, EngineConfig, make_engine_config
from inflight.core.interface import RequestUpdate, SchedulerOutput
from inflight.core.kv_cache_manager import KVCacheManager, PrefixCacheStats, cdiv
from inflight.core.request import Request
from inflight.core.scheduler import Scheduler
from inflight.engine import internal_runs
from inflight.engine.detokenizer import IncrementalDetokenizer
from inflight.engine.generation_config import generation_defaults
from inflight.engine.output_processor import (
    OutputProcessor,
    ParentState,
    RequestState,
    child_params,
)
from inflight.engine.request_checks import (
    bad_words_token_ids,
    cache_salt_of,
    check_priority,
    check_prompt_token_ids,
    check_token_options,
    truncated_prompt,
)
from inflight.engine.step_timings import StepTimings
from inflight.engine.step_trace import StepTrace, record_step
from inflight.outputs import CompletionOutput, RequestMetrics, RequestOutput
from inflight.sampling_params import InvalidRequestError, RequestOutputKind, SamplingParams
from inflight.vllm_engine_args import take_vllm_only_args

logger = logging.getLogger(__name__)

PromptInput = str | list[int] | dict[str, Any]


class EngineOverloadedError(RuntimeError):
    """``max_waiting_requests`` requests are waiting already: the new one is refused at
    once, changing nothing (the server answers 503 with ``Retry-After``)."""

    def __init__(self, num_waiting: int, max_waiting_requests: int) -> None:
        super().__init__(
            f"the engine is overloaded: {num_waiting} requests are waiting and "
            f"max_waiting_requests is {max_waiting_requests}; retry later"
        )
        self.num_waiting = num_waiting
        self.max_waiting_requests = max_waiting_requests


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        # torch-side imports stay here so that importing the engine module is cheap.
        import torch

        from inflight.model.loader import default_model_path, load_checkpoint
        from inflight.structured_output import StructuredOutputManager
        from inflight.worker.device import (
            block_matmul_rows,
            build_model,
            pick_device,
            pick_dtype,
            pick_kv_cache_dtype,
            pick_matmul_dtype,
        )
        from inflight.worker.kv_cache import bytes_per_block
        from inflight.worker.model_runner import ModelRunner

        torch.manual_seed(config.model.seed)
        if config.model.quantization == "w8a8":  # before loading anything
            from inflight.model import w8a8

            w8a8.check_supported(pick_device(config.model.device))
        path = config.model.model or default_model_path()
        # The model's sampling defaults (vLLM's generation_config), checked before loading.
        self.default_sampling_params = _checked_defaults(generation_defaults(
            str(path), config.model.generation_config, config.model.override_generation_config,
        ))
        checkpoint = load_checkpoint(path)
        arch = checkpoint.arch
        self.tokenizer = checkpoint.tokenizer
        self.vocab_size = arch.vocab_size
        self.model_path = str(path)
        self.eos_token_ids = _eos_ids(arch.eos_token_ids, self.tokenizer)

        self.device = pick_device(config.model.device)
        self.dtype = pick_dtype(config.model.dtype, self.device)
        max_model_len = min(
            config.model.max_model_len or arch.max_position_embeddings,
            arch.max_position_embeddings,
        )
        if config.model.max_model_len and config.model.max_model_len > arch.max_position_embeddings:
            raise ValueError(
                f"max_model_len={config.model.max_model_len} exceeds the model's context "
                f"length ({arch.max_position_embeddings})"
            )
        scheduler_config = dataclasses.replace(config.scheduler, max_model_len=max_model_len)
        self.config = dataclasses.replace(config, scheduler=scheduler_config)

        kv_dtype = pick_kv_cache_dtype(config.cache.cache_dtype, self.dtype)
        block_size = config.cache.block_size
        num_blocks = config.cache.num_kv_blocks or self._default_num_blocks(
            bytes_per_block(arch, block_size, kv_dtype), max_model_len
        )
        if config.model.quantization == "gguf" and not checkpoint.quantized:
            raise ValueError(
                f"quantization='gguf' needs a GGUF file with Q4_0/Q4_1/Q8_0 weights; "
                f"{path} has none"
            )
        # Weights are stored and rounded in self.dtype; the matmuls may compute in float32
        # where this CPU's bfloat16 GEMMs are the slower (the KV cache keeps kv_dtype).
        self.matmul_dtype = pick_matmul_dtype(
            self.dtype, self.device, arch.hidden_size, arch.intermediate_size
        )
        block_rows = block_matmul_rows(
            config.model.quantization, checkpoint.quantized, self.device, self.matmul_dtype
        )
        model = build_model(
            arch, checkpoint.weights, self.device, self.matmul_dtype, max_model_len,
            quantized=checkpoint.quantized, block_max_rows=block_rows, round_to=self.dtype,
        )
        del checkpoint
        self.timings = StepTimings()
        self.structured_output = StructuredOutputManager(
            self.tokenizer, arch.vocab_size, self.eos_token_ids
        )
        self.runner = ModelRunner(
            model, num_blocks, block_size, self.device, kv_dtype, self.timings,
            structured_output=self.structured_output,
        )
        self.kv_cache = KVCacheManager(
            num_blocks, block_size, enable_prefix_caching=config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            scheduler_config, self.kv_cache, readiness=self.structured_output
        )
        self.step_trace = StepTrace(enabled=config.record_trace)
        self.output_processor = OutputProcessor(
            self.tokenizer, self.scheduler, self.structured_output
        )
        self._trace_origin = time.monotonic()
        self._next_id = 0
        if config.model.quantization == "w8a8":
            internal_runs.calibrate_w8a8(self)

    @classmethod
    def from_options(cls, model: str | None = None, **options: Any) -> LLMEngine:
        """vLLM-style options (:func:`make_engine_config`); vLLM-only ones such as
        ``tensor_parallel_size=1`` are accepted at neutral values (:mod:`inflight.vllm_engine_args`)."""
        return cls(make_engine_config(model, **take_vllm_only_args(options, model)))

    def _default_num_blocks(self, block_bytes: int, max_model_len: int) -> int:
        """The memory budget's worth of blocks (each ``block_bytes``), but no more than the
        batch can ever use."""
        cfg, cache = self.config.scheduler, self.config.cache
        useful = cfg.max_num_seqs * cdiv(max_model_len, cache.block_size) + 1
        affordable = cache.kv_cache_memory_bytes // block_bytes
        if affordable < 1:
            raise ValueError(
                f"kv_cache_memory_bytes ({cache.kv_cache_memory_bytes}) is too small for even "
                f"one KV block: a block of block_size={cache.block_size} tokens takes "
                f"{block_bytes} bytes; raise kv_cache_memory_bytes or lower block_size"
            )
        if affordable > useful:  # say so: the budget is not what is used
            # a warning when the user chose the budget; the default's cap is routine
            chosen = self.config.cache.kv_cache_memory_bytes != DEFAULT_KV_CACHE_MEMORY_BYTES
            logger.log(
                logging.WARNING if chosen else logging.INFO,
                "kv_cache_memory_bytes allows %d KV blocks, but %d slots of up to %d tokens "
                "can use at most %d; using %d",
                affordable, cfg.max_num_seqs, max_model_len, useful, useful,
            )
        return min(affordable, useful)

    # ------------------------------------------------------------------ requests

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    @property
    def model_config(self) -> Any:
        """vLLM's ``model_config``: the model's settings (``model``: the path loaded,
        ``dtype``, ...)."""
        # model: the path loaded (the default model's file when none was named), as vLLM
        # names what it loaded.
        return dataclasses.replace(
            self.config.model, max_model_len=self.max_model_len, model=self.model_path
        )

    def get_tokenizer(self) -> Any:
        """The model's transformers tokenizer (vLLM's ``get_tokenizer``; for a GGUF model
        built on this first call: the engine itself encodes and decodes without it)."""
        from inflight.model.gguf_tokenizer import hf_tokenizer

        return hf_tokenizer(self.tokenizer)

    def new_request_id(self) -> str:
        self._next_id += 1
        return str(self._next_id - 1)

    def tokenize_prompt(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
            if unknown:
                raise ValueError(f"unknown prompt field(s) {sorted(unknown)}")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), check_prompt_token_ids(
                    prompt["prompt_token_ids"], self.vocab_size
                )
            if "prompt" in prompt:
                return self.tokenize_prompt(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, list):
            return None, check_prompt_token_ids(prompt, self.vocab_size)
        raise TypeError(f"a prompt must be a string, token ids or a dict, got {type(prompt).__name__}")

    def add_request(
        self, request_id: str, prompt: PromptInput, params: SamplingParams | None = None,
        *, arrival_time: float | None = None, priority: int = 0, stream: bool = False,
    ) -> None:
        """Validate and queue a request; raises ValueError (changing nothing) if it is bad,
        :class:`EngineOverloadedError` (changing nothing) if ``max_waiting_requests`` are
        waiting already.

        ``params.n > 1`` fans out into n child requests (see the module docstring)."""
        self.check_capacity()
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        # The request's own copy (as vLLM clones it): the engine fills in fields (the bad
        # words' token ids) that must follow the caller's later changes, not stick to them.
        params = copy.copy(params)
        if params.output_kind is RequestOutputKind.DELTA:
            raise InvalidRequestError(
                "output_kind DELTA is not supported: the engine's outputs are cumulative "
                "(AsyncLLMEngine streams carry each step's new text)", "output_kind")
        stream = stream and params.output_kind is not RequestOutputKind.FINAL_ONLY
        if request_id in self.output_processor.parent_requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n == 1:
            self._add_one(request_id, prompt, params, arrival_time, priority, stream)
            return
        children = [child_params(params, index) for index in range(params.n)]
        child_ids = [f"{index}_{request_id}" for index in range(params.n)]
        arrival = time.monotonic() if arrival_time is None else arrival_time
        options = dict(arrival_time=arrival, priority=priority, stream=stream)
        self._add_one(child_ids[0], prompt, children[0], arrival, priority, stream)
        state = self.output_processor.request_states[child_ids[0]]
        parent = ParentState(
            request_id=request_id, prompt=state.prompt,
            prompt_token_ids=state.request.prompt_token_ids, child_ids=child_ids,
            stream=stream,
            completions=[CompletionOutput(index=i, text="", token_ids=[]) for i in range(params.n)],
            finished=[False] * params.n,
            pending=list(zip(child_ids[1:], children[1:], strict=True)),
            add_options={"prompt": {"prompt": state.prompt,
                                    "prompt_token_ids": state.request.prompt_token_ids,
                                    "cache_salt": cache_salt_of(prompt)}, **options},
            metrics=state.metrics,
        )
        self.output_processor.add_parent(parent)
        cache = self.config.cache
        if not cache.enable_prefix_caching or self.config.scheduler.batching != "continuous":
            self._add_children(parent)  # nothing to wait for: each computes the prompt

    @property
    def has_waiting_room(self) -> bool:
        """Whether a new request would be accepted now (no limit, or below it)."""
        limit = self.config.max_waiting_requests
        return limit is None or self.scheduler.num_waiting < limit

    def check_capacity(self) -> None:
        """Raise :class:`EngineOverloadedError` when ``max_waiting_requests`` wait already.

        Preempted requests count (they wait too); an ``n > 1`` request counts as one."""
        if not self.has_waiting_room:
            limit = self.config.max_waiting_requests
            assert limit is not None
            raise EngineOverloadedError(self.scheduler.num_waiting, limit)

    def check_request(
        self, prompt: PromptInput, params: SamplingParams | None = None, priority: int = 0,
    ) -> None:
        """Raise as :meth:`add_request` would for a bad request, adding nothing (the
        waiting-room limit aside, which depends on the moment). ``LLM.generate`` checks a
        whole batch this way before any of it runs."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        one = child_params(params, 0) if params.n > 1 else copy.copy(params)
        self._build_request("\x00check", prompt, one, None, priority)

    def _build_request(
        self, request_id: str, prompt: PromptInput, params: SamplingParams,
        arrival_time: float | None, priority: int,
    ) -> tuple[Request, str | None]:
        """The checked request and its prompt text; raises ValueError, changing nothing."""
        check_priority(priority, self.config.scheduler.scheduling_policy)
        if params.structured_outputs is not None:
            self.structured_output.validate(params.structured_outputs)
        check_token_options(params, self.vocab_size, self.config.max_logprobs)
        params._bad_words_token_ids = (
            bad_words_token_ids(self.tokenizer, params.bad_words) if params.bad_words else ()
        )
        text, token_ids = self.tokenize_prompt(prompt)
        token_ids = truncated_prompt(token_ids, params.truncate_prompt_tokens, self.max_model_len)
        request = Request(
            request_id=request_id, prompt_token_ids=token_ids, sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            priority=priority, max_model_len=self.max_model_len, cache_salt=cache_salt_of(prompt),
        )
        self.scheduler.check_admissible(request)
        return request, text

    def _add_one(
        self, request_id: str, prompt: PromptInput, params: SamplingParams,
        arrival_time: float | None, priority: int, stream: bool,
    ) -> None:
        request, text = self._build_request(request_id, prompt, params, arrival_time, priority)
        token_ids = request.prompt_token_ids
        self.scheduler.add_request(request)
        if params.structured_outputs is not None:
            self.structured_output.add_request(request_id, params.structured_outputs)
        detokenizer = None
        if params.detokenize:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, token_ids, params.skip_special_tokens,
                list(params.stop or []), params.include_stop_str_in_output,
                params.min_tokens,
            )
        self.output_processor.request_states[request_id] = RequestState(
            request=request, prompt=text, detokenizer=detokenizer, stream=stream,
            metrics=RequestMetrics(arrival_time=request.arrival_time),
            logprobs=[] if params.logprobs is not None else None,
            cumulative_logprob=0.0 if params.logprobs is not None else None,
            prompt_logprobs=(
                [None] * len(token_ids) if params.prompt_logprobs is not None else None
            ),
        )

    def _add_children(self, parent: ParentState) -> None:
        options = parent.add_options
        for child_id, params in parent.pending:
            self._add_one(
                child_id, options["prompt"], params, options["arrival_time"],
                options["priority"], options["stream"],
            )
        parent.pending = []

    def _add_pending_children(self) -> None:
        """Add the children of parents whose child 0 has computed its prompt (or ended)."""
        for parent in self.output_processor.parent_requests.values():
            if not parent.pending:
                continue
            first = self.scheduler.requests.get(parent.child_ids[0])
            if first is None or first.num_computed_tokens >= first.num_prompt_tokens:
                self._add_children(parent)

    def get_request(self, request_id: str) -> Request:
        """The scheduler's record of a request (child 0's for an ``n > 1`` request)."""
        parent = self.output_processor.parent_requests.get(request_id)
        if parent is not None:
            return self.output_processor.request_states[parent.child_ids[0]].request
        return self.scheduler.requests[request_id]

    def abort_request(self, request_ids: str | list[str]) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            parent = self.output_processor.pop_parent(request_id)
            if parent is not None:
                for child_id in parent.child_ids:
                    self._abort_one(child_id)
                continue
            self._abort_one(request_id)

    def _abort_one(self, request_id: str) -> None:
        if self.scheduler.abort_request(request_id) is not None:
            self.structured_output.free([request_id])
            state = self.output_processor.request_states.pop(request_id)
            state.metrics.finished_time = time.monotonic()

    def populate_kv_cache(self) -> bool:
        """Map all of the KV cache's memory now rather than as blocks are first used (CPU);
        safe to call from another thread while the engine steps. False if unsupported."""
        return self.runner.populate_kv_cache()

    def warm_up(self, num_prompt_tokens: int = 256, num_decode_steps: int = 4) -> float:
        """Run one throwaway request so the first forward passes' one-off costs are paid
        before a client's first request (see :func:`internal_runs.warm_up`); call only while
        no request is in flight. Returns the seconds it took."""
        return internal_runs.warm_up(self, num_prompt_tokens, num_decode_steps)

    def forget_history(self) -> None:
        """Drop what internal requests left behind: cached blocks, counters, trace, timings."""
        self.kv_cache.reset_prefix_cache()
        self.kv_cache.prefix_stats = PrefixCacheStats()
        self.scheduler.reset_counters()
        self.step_trace.clear()
        self._trace_origin = time.monotonic()
        self.timings.reset()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False (nothing changed) while requests hold
        blocks, as in vLLM."""
        return self.kv_cache.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or self.output_processor.has_pending_children()
        )

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns outputs of finished requests (and streaming ones)."""
        started = time.monotonic()
        if self.output_processor.parent_requests:
            self._add_pending_children()
        with self.timings.measure("schedule_s"):
            scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            # Nothing runnable: if grammars are compiling, wait for one (not spin).
            self.structured_output.wait_for_compile(timeout=0.05)
            return []
        runner_output = self.runner.execute_model(scheduler_output)
        with self.timings.measure("update_s"):
            updates = self.scheduler.update_from_output(scheduler_output, runner_output)
        now = time.monotonic()
        with self.timings.measure("outputs_s"):
            outputs = self.output_processor.process_outputs(updates, now, runner_output)
            self._record_step(scheduler_output, updates, started, now)
        self.timings.num_steps += 1
        return outputs

    def _record_step(
        self, scheduler_output: SchedulerOutput, updates: list[RequestUpdate],
        started: float, ended: float,
    ) -> None:
        if not self.step_trace.enabled:
            return
        self.step_trace.append(record_step(
            self.scheduler, scheduler_output, updates,
            start_time=started - self._trace_origin, duration_s=ended - started,
        ))


def _checked_defaults(defaults: dict[str, Any]) -> dict[str, Any]:
    """Generation-config defaults that make valid SamplingParams (ValueError otherwise)."""
    try:
        SamplingParams.from_optional(**defaults)
    except ValueError as error:
        raise ValueError(
            "the generation config (the model's generation_config.json, or "
            f"generation_config / override_generation_config) gives bad sampling defaults: {error}"
        ) from error
    return defaults


def _eos_ids(arch_eos: tuple[int, ...], tokenizer: Any) -> tuple[int, ...]:
    """The model's EOS ids, the primary one (the tokenizer's, as vLLM) first.

    The others (a generation config may list several) stop a request as stop tokens do,
    with themselves as ``stop_reason``; see ``core/request.py``."""
    primary = getattr(tokenizer, "eos_token_id", None)
    ids = [primary] if isinstance(primary, int) else []
    return tuple(dict.fromkeys([*ids, *arch_eos]))
