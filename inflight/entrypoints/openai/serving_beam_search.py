"""``use_beam_search`` on ``/v1/completions`` and ``/v1/chat/completions``, as in vLLM.

A request with ``use_beam_search: true`` searches ``n`` beams per prompt
(:mod:`inflight.beam_search`) and answers with the ``n`` best as its choices, best first,
in the same response shapes as sampling; streamed, each choice arrives whole in one chunk
once the search ends. The search honours ``n`` (the beam width), ``max_tokens``,
``ignore_eos``, ``length_penalty``, ``include_stop_str_in_output``, ``temperature``
(default 0 here: a sampled token only joins each step's candidates when it is above 0),
``logprobs`` / ``top_logprobs`` and ``skip_special_tokens``; any other sampling field set to
a non-default value is refused by name with a 400 rather than silently ignored.

:class:`BeamSearchStream` reads like an engine :class:`RequestStream`, so the routes'
collect and streaming code serves it unchanged; each search step adds one one-token
engine request per live beam, and ``close()`` (a client that went away) aborts them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

from inflight.beam_search import BeamSearchInstance, BeamSearchParams, check_beam_search
from inflight.engine.protocol import EngineClient
from inflight.engine.request_stream import RequestDelta, RequestStream
from inflight.entrypoints.openai.errors import (
    SERVER_ERROR,
    OpenAIError,
    StepRefusedError,
    bad_request,
    from_engine_error,
)
from inflight.entrypoints.openai.params import GenerationRequest
from inflight.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from inflight.entrypoints.openai.serving import Completion, add_requests, collect
from inflight.outputs import PositionLogprobs
from inflight.sampling_params import SamplingParams

# Adds one engine request per prompt (``serving.add_requests`` with the route's options
# bound), returning their streams.
AddRequests = Callable[
    [list[tuple[str | None, list[int]]], SamplingParams], Awaitable[list[RequestStream]]
]

# SamplingParams fields a beam search honours; every other must keep its default.
_HONOURED = {
    "n", "temperature", "max_tokens", "ignore_eos", "include_stop_str_in_output",
    "skip_special_tokens", "logprobs", "detokenize",
}
def _request_field(request: GenerationRequest, name: str) -> str:
    """The request field that set SamplingParams field ``name``, where they differ."""
    if name == "structured_outputs":
        if isinstance(request, ChatCompletionRequest) and request.tool_choice not in (None, "auto", "none"):
            return "tool_choice"
        return "structured_outputs" if request.structured_outputs is not None else "response_format"
    if name == "prompt_logprobs" and request.prompt_logprobs is None:
        return "echo"  # completions' echo with logprobs asks for the prompt's logprobs
    return name


def beam_search_params(
    request: GenerationRequest, params: SamplingParams, max_tokens: int,
    model_defaults: Mapping[str, Any] | None = None,
) -> BeamSearchParams:
    """The search a ``use_beam_search`` request asks for; a 400 for what it cannot do.

    ``params`` are the request's sampling parameters as built for sampling (so every value
    was validated), with the model's generation-config ``model_defaults`` where the
    request is silent: only what differs from those was the client's choice.
    ``max_tokens`` is the request's (capped by the config), or what the context leaves."""
    defaults = SamplingParams.from_optional(**(model_defaults or {}))
    for name in SamplingParams.__dataclass_fields__:
        if name in _HONOURED or name.startswith("_"):
            continue
        if getattr(params, name) != getattr(defaults, name):
            field = _request_field(request, name)
            raise bad_request(f"{field} cannot be combined with use_beam_search", field)
    logprobs_field = "logprobs" if isinstance(request, CompletionRequest) else "top_logprobs"
    if params.logprobs is not None and params.logprobs > 2 * params.n:
        raise bad_request(
            f"with use_beam_search, {logprobs_field} can be at most 2 * n = {2 * params.n} "
            f"(each step ranks that many tokens per beam), got {params.logprobs}",
            logprobs_field,
        )
    try:
        search = BeamSearchParams(
            beam_width=params.n,
            max_tokens=max_tokens,
            ignore_eos=params.ignore_eos,
            temperature=0.0 if request.temperature is None else params.temperature,
            length_penalty=request.length_penalty,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
    except ValueError as error:
        raise from_engine_error(error) from error
    return search


def beam_search_streams(
    engine: EngineClient,
    request: GenerationRequest,
    request_id: str,
    prompts: Sequence[tuple[str | None, list[int]]],
    params: SamplingParams,
    max_tokens: int | None,
    arrival_time: float,
) -> list[BeamSearchStream]:
    """One search per prompt, checked before any starts (a 400 names ``n`` for the beam
    width); each runs when its stream is read. Without ``max_tokens`` a search may fill
    the context."""
    streams = []
    for index, (text, token_ids) in enumerate(prompts):
        limit = params.max_tokens if params.max_tokens is not None else max_tokens
        search = beam_search_params(
            request, params, limit or engine.max_model_len - len(token_ids),
            engine.default_sampling_params,
        )
        try:
            check_beam_search(search, len(token_ids), engine.max_model_len, engine.max_logprobs)
        except ValueError as error:
            openai_error = from_engine_error(error)
            if openai_error.param == "beam_width":
                openai_error.param = "n"
            raise openai_error from error

        def add(prompts: list[tuple[str | None, list[int]]], step: SamplingParams,
                index: int = index) -> Awaitable[list[RequestStream]]:
            return add_requests(
                engine, f"{request_id}-{index}", prompts, step, request.priority,
                arrival_time, request.cache_salt, request_timeout=request.request_timeout,
            )

        streams.append(BeamSearchStream(
            request_id, (text, token_ids), search, eos_token_ids=engine.eos_token_ids,
            max_model_len=engine.max_model_len, add_requests=add,
            top_logprobs=params.logprobs,
            decode=lambda ids: str(engine.tokenizer.decode(
                ids, skip_special_tokens=params.skip_special_tokens
            )),
        ))
    return streams


class BeamSearchStream:
    """One prompt's beam search, read with ``async for`` like a :class:`RequestStream`:
    when the search ends, one finished delta per beam (``index`` 0 is the best)."""

    def __init__(
        self,
        request_id: str,
        prompt: tuple[str | None, list[int]],
        search: BeamSearchParams,
        *,
        eos_token_ids: Sequence[int],
        max_model_len: int,
        add_requests: AddRequests,
        top_logprobs: int | None,
        decode: Callable[[list[int]], str],
    ) -> None:
        self._request_id = request_id
        self._text, token_ids = prompt
        self._search = BeamSearchInstance(token_ids, search, eos_token_ids, max_model_len)
        self._step = search.step_params()
        self._add_requests = add_requests
        self._top_logprobs = top_logprobs
        self._decode = decode
        self._streams: list[RequestStream] = []
        self._closed = False
        self._cached_tokens = 0  # prompt tokens the first step found in the prefix cache

    def close(self) -> None:
        """Stop the search, aborting the beams' requests of the running step."""
        self._closed = True
        for stream in self._streams:
            stream.close()

    def __aiter__(self) -> AsyncIterator[RequestDelta]:
        return self._run()

    async def _run(self) -> AsyncIterator[RequestDelta]:
        search = self._search
        try:
            while not search.done and not self._closed:
                try:  # a step refused after the answer began fails it, in-band if streamed
                    self._streams = await self._add_requests(
                        [(None, tokens) for tokens in search.prompts()], self._step
                    )
                except OpenAIError as error:
                    raise StepRefusedError(error) from error
                results = await asyncio.gather(*(collect(s) for s in self._streams))
                if search.steps == 0:  # the prompt's own step: what its usage reports
                    self._cached_tokens = results[0].num_cached_tokens
                search.advance([_step_logprobs(r.completions[0]) for r in results])
        finally:
            self.close()
        if not search.done:
            return
        output = search.request_output(self._request_id, self._text, self._decode)
        last = len(output.outputs) - 1
        for completion in output.outputs:
            yield RequestDelta(
                request_id=self._request_id,
                text=completion.text,
                token_ids=completion.token_ids,
                num_prompt_tokens=search.prompt_len,
                num_output_tokens=len(completion.token_ids),
                finished=completion.index == last,
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
                index=completion.index,
                logprobs=_reported(completion.token_ids, completion.logprobs, self._top_logprobs),
                cumulative_logprob=completion.cumulative_logprob,
                num_cached_tokens=self._cached_tokens,
            )


def _step_logprobs(completion: Completion) -> PositionLogprobs:
    """A beam's step result; a beam aborted (server shutting down) ends the search."""
    if not completion.logprobs:
        raise StepRefusedError(OpenAIError(
            503, f"The beam search was cut short: a step ended with {completion.finish_reason!r}",
            SERVER_ERROR,
        ))
    return completion.logprobs[0]


def _reported(
    token_ids: list[int], logprobs: list[PositionLogprobs] | None, top: int | None,
) -> list[PositionLogprobs] | None:
    """Per token: its own logprob first, then the step's ``top`` most likely (the search
    kept ``2 * n`` per step; the client asked for ``top``)."""
    if top is None or logprobs is None:
        return None
    reported = []
    for token_id, position in zip(token_ids, logprobs, strict=True):
        kept = {token_id: position[token_id]}
        for other, entry in position.items():
            if entry.rank is not None and entry.rank <= top:
                kept.setdefault(other, entry)
        reported.append(kept)
    return reported
