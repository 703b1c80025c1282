"""Beam search on top of the engine, as vLLM runs it (``LLM.beam_search``, and the OpenAI
server's ``use_beam_search``).

The algorithm (vLLM's, after Hugging Face's ``BeamSearchScorer``): each prompt keeps up to
``beam_width`` live beams. A step asks the engine for one more token of every live beam
with ``logprobs=2 * beam_width``; each of those top tokens (plus the sampled one when
``temperature > 0`` puts another there) extends its beam into a candidate scored by the
sum of its tokens' logprobs. A candidate ending in EOS is finished (unless ``ignore_eos``);
the best ``beam_width`` of the others by cumulative logprob live on. After ``max_tokens``
steps, or once no beam lives, the finished and the live beams are ranked together by
``cum_logprob / len(tokens) ** length_penalty`` (``tokens`` counts the prompt and leaves
out a final EOS) and the best ``beam_width`` are returned, best first.

The engine itself knows nothing of beams: every beam is an ordinary request for one token,
and the prefix cache (on by default) keeps each beam's earlier KV, so a step computes only
the tokens after a beam's last full cached block. Logprobs are the model's raw
distribution (before temperature), as everywhere in inflight and vLLM.

:class:`BeamSearchInstance` holds one prompt's search as plain state (no engine, no
torch), so the offline driver (``LLM.beam_search``) and the server's async driver share it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from inflight.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from inflight.sampling_params import InvalidRequestError, SamplingParams


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``: ``beam_width`` beams, up to ``max_tokens`` new tokens.

    ``temperature`` only adds the sampled token to each step's candidates (scores stay
    raw logprobs); ``length_penalty`` is the exponent of the length in the final ranking
    (1.0: average logprob per token; 0.0: total logprob, favouring short beams);
    ``include_stop_str_in_output`` keeps a final EOS in the server's text and token ids;
    ``skip_special_tokens`` leaves special tokens (a final EOS among them) out of
    ``LLM.beam_search``'s texts. vLLM's ``structured_outputs`` and ``watermarking`` are
    refused when set (not implemented here). Raises :class:`InvalidRequestError` (a
    ``ValueError``) for a value out of range.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: Any = None
    watermarking: bool | None = None

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                _fail_beam(name, f"{name} must be a positive integer, got {value!r}")
        if self.structured_outputs is not None:
            _fail_beam("structured_outputs", "structured_outputs are not supported with beam "
                       "search; use LLM.generate with SamplingParams(structured_outputs=...)")
        if self.watermarking:
            _fail_beam("watermarking", "watermarking is not supported")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                _fail_beam(name, f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                _fail_beam(name, f"{name} must be a number, got {value!r}")
            if not math.isfinite(value) or abs(value) > 1e30:
                _fail_beam(name, f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            _fail_beam("temperature", f"temperature must be >= 0, got {self.temperature}")

    def step_params(self) -> SamplingParams:
        """The engine request each live beam makes per step: one token, 2 x width logprobs."""
        return SamplingParams(
            max_tokens=1, logprobs=2 * self.beam_width, temperature=self.temperature,
            ignore_eos=True,  # EOS is a candidate like any other; the search decides
        )


def _fail_beam(name: str, message: str) -> NoReturn:
    raise InvalidRequestError(f"BeamSearchParams: {message}", parameter=name)


def check_beam_search(
    params: BeamSearchParams, num_prompt_tokens: int, max_model_len: int, max_logprobs: int,
) -> None:
    """Raise :class:`InvalidRequestError` for a search the engine could not run: a step
    asks for ``2 * beam_width`` logprobs (at most the engine's ``max_logprobs``), and the
    prompt must leave room for one token."""
    if max_logprobs != -1 and 2 * params.beam_width > max_logprobs:
        raise InvalidRequestError(
            f"a beam search of {params.beam_width} beams needs {2 * params.beam_width} logprobs a step, "
            f"more than max_logprobs={max_logprobs} (start the engine with a larger "
            "max_logprobs)", "beam_width",
        )
    if num_prompt_tokens == 0:
        raise InvalidRequestError("The decoder prompt cannot be empty", "prompt")
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {num_prompt_tokens} input tokens, which leaves no room for an "
            "output token. Please reduce the length of the input prompt.", "prompt",
        )


@dataclass(slots=True)
class BeamSearchSequence:
    """One beam: ``tokens`` are the prompt's then the generated ones (vLLM's layout);
    ``logprobs`` one dict per generated token (the step's top tokens); ``text`` is filled
    in when the search ends."""

    tokens: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    # "stop" for a beam ended by EOS, "length" for one cut by max_tokens or max_model_len.
    finish_reason: str | None = None
    stop_reason: int | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    """The best ``beam_width`` beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(
    tokens: list[int], cumulative_logprob: float, eos_token_ids: frozenset[int] | set[int],
    length_penalty: float = 1.0,
) -> float:
    """``cumulative_logprob / length ** length_penalty``: ``length`` is ``len(tokens)``
    (prompt included, as vLLM counts), less one when the last token is EOS."""
    length = len(tokens) - (1 if tokens and tokens[-1] in eos_token_ids else 0)
    return cumulative_logprob / (max(length, 1) ** length_penalty)


class BeamSearchInstance:
    """One prompt's search: :meth:`prompts` gives the live beams' token ids to run one step
    on, :meth:`advance` takes each one's step logprobs, :meth:`best` ranks the result.

    ``max_len`` is the longest a beam may grow (the engine's ``max_model_len``): a beam
    that reaches it finishes with ``"length"`` instead of asking for another token.
    """

    def __init__(
        self, prompt_token_ids: list[int], params: BeamSearchParams,
        eos_token_ids: Sequence[int], max_len: int,
    ) -> None:
        self.prompt_token_ids = list(prompt_token_ids)
        self.prompt_len = len(prompt_token_ids)
        self.params = params
        # The first is the primary EOS (stop_reason None); others report themselves, as a
        # request's extra EOS ids do.
        self.primary_eos = eos_token_ids[0] if eos_token_ids else None
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_len = max_len
        self.beams = [BeamSearchSequence(tokens=list(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.steps = 0
        self._retire_full_beams()

    @property
    def done(self) -> bool:
        return not self.beams or self.steps >= self.params.max_tokens

    def prompts(self) -> list[list[int]]:
        """The token ids each live beam runs next (empty once done)."""
        return [] if self.done else [beam.tokens for beam in self.beams]

    def advance(self, step_logprobs: list[PositionLogprobs]) -> None:
        """Take one step's logprobs, one dict per beam of :meth:`prompts` (same order)."""
        if len(step_logprobs) != len(self.beams):
            raise ValueError(f"{len(step_logprobs)} results for {len(self.beams)} beams")
        candidates: list[BeamSearchSequence] = []
        for beam, position in zip(self.beams, step_logprobs, strict=True):
            for token_id, logprob in position.items():
                child = BeamSearchSequence(
                    tokens=beam.tokens + [token_id], logprobs=beam.logprobs + [position],
                    cum_logprob=beam.cum_logprob + logprob.logprob,
                )
                if token_id in self.eos_token_ids and not self.params.ignore_eos:
                    child.finish_reason = "stop"
                    child.stop_reason = None if token_id == self.primary_eos else token_id
                    self.completed.append(child)
                else:
                    candidates.append(child)
        # All candidates have one length, so the cumulative logprob ranks them; the stable
        # sort keeps the earlier beam's (and its higher-ranked token's) candidate on a tie.
        candidates.sort(key=lambda beam: beam.cum_logprob, reverse=True)
        self.beams = candidates[: self.params.beam_width]
        self.steps += 1
        self._retire_full_beams()

    def _retire_full_beams(self) -> None:
        full = [beam for beam in self.beams if len(beam.tokens) >= self.max_len]
        for beam in full:
            beam.finish_reason = "length"
            self.completed.append(beam)
        if full:
            self.beams = [beam for beam in self.beams if len(beam.tokens) < self.max_len]

    def best(self) -> list[BeamSearchSequence]:
        """The best ``beam_width`` of the finished and the live beams, best first."""
        for beam in self.beams:
            beam.finish_reason = beam.finish_reason or "length"
        ranked = sorted(
            self.completed + self.beams, reverse=True,
            key=lambda beam: get_beam_search_score(
                beam.tokens, beam.cum_logprob, self.eos_token_ids, self.params.length_penalty
            ),
        )
        return ranked[: self.params.beam_width]

    def request_output(
        self, request_id: str, prompt: str | None, decode: Any,
    ) -> RequestOutput:
        """The result as the server returns it (vLLM's online beam search): one completion
        per beam, text and token ids of the generated part only, a final EOS left out
        unless ``include_stop_str_in_output``. ``decode(token_ids) -> str``."""
        outputs = []
        for index, beam in enumerate(self.best()):
            generated = beam.tokens[self.prompt_len:]
            if (generated and beam.finish_reason == "stop"
                    and not self.params.include_stop_str_in_output):
                generated = generated[:-1]
            outputs.append(CompletionOutput(
                index=index, text=decode(generated), token_ids=generated,
                finish_reason=beam.finish_reason, stop_reason=beam.stop_reason,
                logprobs=beam.logprobs[: len(generated)], cumulative_logprob=beam.cum_logprob,
            ))
        return RequestOutput(
            request_id=request_id, prompt=prompt, prompt_token_ids=self.prompt_token_ids,
            outputs=outputs, finished=True,
        )
