"""inflight: continuous batching over a paged KV cache, readable end to end."""

from inflight.beam_search import BeamSearchParams
from inflight.engine.llm_engine import LLMEngine
from inflight.entrypoints.llm import LLM
from inflight.inputs import PromptType, TextPrompt, TokensPrompt
from inflight.outputs import CompletionOutput, RequestOutput
from inflight.sampling_params import (
    GuidedDecodingParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

__all__ = [
    "LLM", "LLMEngine", "SamplingParams", "BeamSearchParams", "StructuredOutputsParams",
    "GuidedDecodingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput",
    "TextPrompt", "TokensPrompt", "PromptType",
]
__version__ = "0.1.0"
