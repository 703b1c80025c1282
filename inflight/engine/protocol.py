"""What the OpenAI server needs from an engine: :class:`EngineClient`.

Two implementations: :class:`~inflight.engine.async_engine.AsyncLLMEngine` (one engine
in this process) and :class:`~inflight.distributed.client.DataParallelEngineClient`
(replicas in Ray actors behind a router), which also reports per-replica health and
metrics (:class:`ReplicatedEngineClient`).
"""

from __future__ import annotations

from typing import Any, Protocol

from inflight.engine.llm_engine import PromptInput
from inflight.engine.request_stream import RequestStream
from inflight.sampling_params import SamplingParams


class MetricsExporter(Protocol):
    def render(self) -> bytes:
        """The metrics in Prometheus text format."""
        ...


class EngineClient(Protocol):
    @property
    def tokenizer(self) -> Any: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The model's EOS ids, the primary one first."""
        ...

    @property
    def max_logprobs(self) -> int: ...

    @property
    def default_sampling_params(self) -> dict[str, Any]:
        """The model's sampling defaults (``engine/generation_config.py``)."""
        ...

    @property
    def model_path(self) -> str: ...

    @property
    def is_healthy(self) -> bool: ...

    def start(self) -> None:
        """Bind to the running event loop; called once, by the server's lifespan."""
        ...

    async def shutdown(self) -> None: ...

    async def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        request_timeout: float | None = None,
    ) -> RequestStream:
        """Wait until the engine accepted the request; ValueError/TypeError if refused,
        EngineOverloadedError when ``max_waiting_requests`` are waiting already,
        EngineShutdownError while shutting down, EngineDeadError when it cannot serve."""
        ...

    def abort(self, request_id: str) -> None: ...

    def abort_all(self) -> None: ...

    async def reset_prefix_cache(self) -> bool: ...


class ReplicatedEngineClient(EngineClient, Protocol):
    def health_report(self) -> tuple[bool, dict[str, Any]]:
        """Whether the service can answer (some replica alive), and a JSON-able body
        with each replica's state."""
        ...

    def make_metrics(self, model_name: str) -> MetricsExporter:
        """Metrics of every replica, each sample labelled with its ``replica``."""
        ...
