"""inflight: continuous batching over a paged KV cache, readable end to end."""

from inflight.beam_search import BeamSearchParams
from inflight.entrypoints.llm import LLM
from inflight.outputs import CompletionOutput, RequestOutput
from inflight.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM", "SamplingParams", "BeamSearchParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
]
__version__ = "0.1.0"
