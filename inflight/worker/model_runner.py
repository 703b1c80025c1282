"""Runs one step of the model over a ``SchedulerOutput``; knows nothing of queues.

execute_model: build flat inputs -> forward over all scheduled tokens (paged attention)
-> logits only at each sampling sequence's last token -> batched sampling.
"""

from __future__ import annotations

import torch

from inflight.attention.backend import choose_attention_backend
from inflight.core.interface import ModelRunnerOutput, SchedulerOutput
from inflight.engine.step_timings import StepTimings
from inflight.model.llama import LlamaForCausalLM
from inflight.worker.input_batch import build_model_inputs
from inflight.worker.kv_cache import allocate_kv_cache, populate
from inflight.worker.sampler import Sampler


class ModelRunner:
    def __init__(
        self, model: LlamaForCausalLM, num_blocks: int, block_size: int,
        device: torch.device, kv_dtype: torch.dtype, timings: StepTimings | None = None,
    ) -> None:
        self.timings = timings if timings is not None else StepTimings()
        self.model = model
        self.device = device
        self.block_size = block_size
        self.kv_caches = allocate_kv_cache(model.arch, num_blocks, block_size, kv_dtype, device)
        self.sampler = Sampler(device)
        backend = choose_attention_backend(device)
        self.varlen_decode = backend in ("cpp", "cpp-all")
        self.varlen_prefill = backend == "cpp-all"

    def populate_kv_cache(self) -> bool:
        """Map the KV cache's memory now (see ``worker/kv_cache.populate``)."""
        return populate(self.kv_caches)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.sampler.forget(scheduler_output.finished_request_ids)
        if scheduler_output.is_empty:
            return ModelRunnerOutput(sampled_token_ids={})
        with self.timings.measure("prepare_inputs_s"):
            inputs = build_model_inputs(
                scheduler_output, self.block_size, self.device,
                varlen_decode=self.varlen_decode, varlen_prefill=self.varlen_prefill,
            )
        with self.timings.measure("forward_s"):
            hidden = self.model(
                inputs.input_ids, inputs.positions, self.kv_caches, inputs.attention
            )
            if not inputs.sampled:
                return ModelRunnerOutput(sampled_token_ids={})
            logits = self.model.compute_logits(hidden[inputs.logits_indices])
        request_ids = [s.request_id for s in inputs.sampled]
        with self.timings.measure("sample_s"):
            tokens = self.sampler.sample(
                logits, request_ids, [s.sampling_params for s in inputs.sampled]
            )
        return ModelRunnerOutput(sampled_token_ids=dict(zip(request_ids, tokens, strict=True)))
