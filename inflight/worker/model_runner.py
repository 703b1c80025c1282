"""Runs one step of the model over a ``SchedulerOutput``; knows nothing of queues.

execute_model: build flat inputs -> forward over all scheduled tokens (paged attention)
-> logits only at each sampling sequence's last token -> per-request logits transforms
(``logits_processors``: allowed tokens, bad words, logit bias, penalties) -> batched
sampling. Logprobs (``logprobs``) come from the raw logits, only for rows that ask;
prompt logprobs from the hidden states of the prompt positions of requests that ask.

Failure isolation: a request whose part of the step cannot be prepared (its inputs, its
sampler state) is left out of the step and reported in ``ModelRunnerOutput.failed_requests``;
the scheduler ends it alone and every other request's tokens are computed as usual. A
failure that no single request explains (the forward pass itself) still raises.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch

from inflight.attention.backend import choose_attention_backend
from inflight.core.interface import (
    ModelRunnerOutput,
    PromptLogprobsChunk,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from inflight.engine.step_timings import StepTimings
from inflight.model.llama import LlamaForCausalLM
from inflight.worker.input_batch import InvalidInputsError, ModelInputs, build_model_inputs
from inflight.worker.kv_cache import allocate_kv_cache, populate
from inflight.worker.logits_processors import LogitsProcessors, ProcessorRow
from inflight.worker.logprobs import prompt_token_logprobs, token_logprobs
from inflight.worker.sampler import Sampler
from inflight.worker.structured_output import mask_constrained_rows

if TYPE_CHECKING:
    from inflight.bench.work_ledger import KernelWork
    from inflight.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self, model: LlamaForCausalLM, num_blocks: int, block_size: int,
        device: torch.device, kv_dtype: torch.dtype, timings: StepTimings | None = None,
        structured_output: StructuredOutputManager | None = None,
    ) -> None:
        self.timings = timings if timings is not None else StepTimings()
        self.model = model
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_caches = allocate_kv_cache(model.arch, num_blocks, block_size, kv_dtype, device)
        self.sampler = Sampler(device)
        self.structured_output = structured_output
        self.logits_processors = LogitsProcessors(model.arch.vocab_size, device)
        backend = choose_attention_backend(device)
        self.varlen_decode = backend in ("cpp", "cpp-all")
        self.varlen_prefill = backend == "cpp-all"
        # `bench throughput --profile` sets this to account each step's work per kernel
        self.work_ledger: KernelWork | None = None

    def populate_kv_cache(self) -> bool:
        """Map the KV cache's memory now (see ``worker/kv_cache.populate``)."""
        return populate(self.kv_caches)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.sampler.forget(scheduler_output.finished_request_ids)
        self.logits_processors.forget(scheduler_output.finished_request_ids)
        if scheduler_output.is_empty:
            return ModelRunnerOutput(sampled_token_ids={})
        with self.timings.measure("prepare_inputs_s"):
            inputs, failed = self._prepare_inputs(scheduler_output)
        if inputs is None:
            return ModelRunnerOutput(sampled_token_ids={}, failed_requests=failed)
        if self.work_ledger is not None:
            self.work_ledger.add_step(inputs.attention, inputs.positions, len(inputs.sampled))
        with self.timings.measure("forward_s"):
            hidden = self.model(
                inputs.input_ids, inputs.positions, self.kv_caches, inputs.attention
            )
            prompt_logprobs = self._prompt_logprobs(inputs, hidden)
            if not inputs.sampled:
                return ModelRunnerOutput(
                    sampled_token_ids={}, failed_requests=failed, prompt_logprobs=prompt_logprobs
                )
            sampled_hidden = hidden[inputs.logits_indices]
            tokens = self._greedy_without_logits(inputs.sampled, sampled_hidden)
            logits = None if tokens is not None else self.model.compute_logits(sampled_hidden)
        with self.timings.measure("sample_s"):
            logprobs: dict[str, TokenLogprobs] = {}
            if logits is not None:
                request_ids = [s.request_id for s in inputs.sampled]
                # structured outputs: -inf where a constrained row's grammar forbids a
                # token. Applied before the sampler as in vLLM; -inf masks commute with
                # the penalties and the min_tokens mask, so their order is immaterial.
                if self.structured_output is not None:
                    failed.update(mask_constrained_rows(
                        self.structured_output, logits, request_ids,
                        [s.sampling_params for s in inputs.sampled],
                    ))
                tokens, logprobs = self._sample(inputs.sampled, logits, failed)
        assert tokens is not None
        grammar_finished: set[str] = set()
        if self.structured_output is not None:  # advance the matchers by the new tokens
            grammar_finished, rejected = self.structured_output.accept_tokens(tokens)
            failed.update(rejected)
            tokens = {rid: t for rid, t in tokens.items() if rid not in rejected}
            logprobs = {rid: lp for rid, lp in logprobs.items() if rid not in rejected}
        return ModelRunnerOutput(
            sampled_token_ids=tokens, failed_requests=failed,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            grammar_finished_request_ids=grammar_finished,
        )

    def _greedy_without_logits(
        self, sampled: list[ScheduledRequest], hidden: torch.Tensor
    ) -> dict[str, int] | None:
        """The rows' tokens straight from the output layer (``greedy_tokens``: the argmax
        fused into its kernel, the [rows, vocab] logits never written) where every row is
        plain greedy sampling, so the logits would only be argmax'ed: no logits processing,
        no suppressed tokens (min_tokens), no logprobs, no grammar. The same tokens as the
        sampler's. None where a row needs more, where the model's kernel cannot fuse it,
        or where a row needs its logits after all (a NaN)."""
        for s in sampled:
            params = s.sampling_params
            if (not params.is_greedy or params.needs_logits_processing
                    or params.logprobs is not None or params.structured_outputs is not None
                    or s.suppressed_token_ids):
                return None
        ids = self.model.greedy_tokens(hidden)
        if ids is None or bool((ids < 0).any()):
            return None
        # No row has logits-processor state to count its token in (needs_logits_processing).
        return dict(zip([s.request_id for s in sampled], ids.tolist(), strict=True))

    def _sample(
        self, sampled: list[ScheduledRequest], logits: torch.Tensor, failed: dict[str, str]
    ) -> tuple[dict[str, int], dict[str, TokenLogprobs]]:
        """Transform the logits, sample, count the new tokens; logprobs from the raw
        logits for the rows that ask. Rows that fail are added to ``failed``."""
        request_ids = [s.request_id for s in sampled]
        rows = [
            ProcessorRow(s.request_id, s.sampling_params, s.prompt_token_ids) for s in sampled
        ]
        processed = self.logits_processors.apply(logits, rows)
        suppressed = [s.suppressed_token_ids for s in sampled]
        result = self.sampler.sample(
            processed, request_ids, [s.sampling_params for s in sampled],
            suppressed if any(suppressed) else None,
        )
        failed.update(result.failed)
        tokens = {
            rid: token
            for rid, token in zip(request_ids, result.token_ids, strict=True)
            if rid not in failed
        }
        self.logits_processors.record(rows, [tokens.get(rid) for rid in request_ids])
        return tokens, self._sample_logprobs(sampled, logits, tokens)

    @staticmethod
    def _sample_logprobs(
        sampled: list[ScheduledRequest], logits: torch.Tensor, tokens: dict[str, int]
    ) -> dict[str, TokenLogprobs]:
        asking = [
            i for i, s in enumerate(sampled)
            if s.sampling_params.logprobs is not None and s.request_id in tokens
        ]
        if not asking:
            return {}
        ids = [sampled[i].request_id for i in asking]
        entries = token_logprobs(
            logits[torch.tensor(asking, device=logits.device)],
            [tokens[rid] for rid in ids],
            [sampled[i].sampling_params.logprobs or 0 for i in asking],
        )
        return dict(zip(ids, entries, strict=True))

    def _prompt_logprobs(
        self, inputs: ModelInputs, hidden: torch.Tensor
    ) -> dict[str, PromptLogprobsChunk]:
        """Logprobs of the prompt tokens this step's chunks predict, for requests asking."""
        chunks: dict[str, PromptLogprobsChunk] = {}
        for index, item in enumerate(inputs.scheduled):
            targets = item.prompt_logprob_targets
            if not targets:
                continue
            first = inputs.query_start[index]
            entries = prompt_token_logprobs(
                hidden[first : first + len(targets)], self.model.compute_logits, targets,
                item.sampling_params.prompt_logprobs or 0,
            )
            chunks[item.request_id] = PromptLogprobsChunk(item.start_position + 1, entries)
        return chunks

    def _prepare_inputs(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[ModelInputs | None, dict[str, str]]:
        """The step's inputs without the requests whose inputs cannot be built (reported
        by id with the reason); None if no request is left."""
        failed: dict[str, str] = {}
        step = scheduler_output
        while step.scheduled:
            try:
                return self._build(step), failed
            except InvalidInputsError as error:
                failed.update(error.reasons)
            except Exception:
                culprits = self._find_failing_requests(step)
                if not culprits:
                    raise  # not any one request's fault
                failed.update(culprits)
            step = dataclasses.replace(
                step, scheduled=[s for s in step.scheduled if s.request_id not in failed]
            )
        return None, failed

    def _build(self, scheduler_output: SchedulerOutput) -> ModelInputs:
        return build_model_inputs(
            scheduler_output, self.block_size, self.device,
            varlen_decode=self.varlen_decode, varlen_prefill=self.varlen_prefill,
            vocab_size=self.model.arch.vocab_size, num_kv_blocks=self.num_blocks,
        )

    def _find_failing_requests(self, scheduler_output: SchedulerOutput) -> dict[str, str]:
        """Build each request's inputs alone; the ones that raise are at fault."""
        culprits: dict[str, str] = {}
        for item in scheduler_output.scheduled:
            try:
                self._build(dataclasses.replace(scheduler_output, scheduled=[item]))
            except Exception as error:
                logger.exception("preparing the inputs of request %s failed", item.request_id)
                culprits[item.request_id] = f"preparing the request's inputs failed: {error}"
        return culprits
