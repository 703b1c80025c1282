"""The structured-output manager: grammar compilation, matchers and per-step bitmasks.

Owns, for every request with ``SamplingParams.structured_outputs``:

* its compiled grammar: compiled once per distinct constraint (``StructuredOutputsParams.key``)
  on a background thread and cached, so the step loop never compiles; the llguidance view of
  the engine's tokenizer (~1 s to build) is made on that thread too, on first use;
* its matcher (a copy of the cached compiled grammar, made at its first sampling step),
  which consumes every token the request samples; it is dropped when the request ends.

Contracts with the rest of the engine:

* the scheduler asks :meth:`is_ready` (its readiness policy) before admitting a waiting
  request; a request whose grammar is still compiling stays waiting and the others go on;
* the model runner asks :meth:`fill_bitmask` for the step's constrained rows, masks the
  logits, samples, then calls :meth:`accept_tokens`; a request whose grammar failed to
  compile or rejected its token is reported as failed and ends alone;
* preemption needs nothing: the output tokens survive it and the matcher has consumed
  exactly them, so recomputation only rebuilds the KV cache and the next sampled token
  continues from the matcher's state.

Bitmask layout (llguidance's): one int32 word per 32 token ids, bit ``i`` of word ``j``
set when token ``32 * j + i`` is allowed::

    bitmask[row] = [ w0 | w1 | ... | w(W-1) ]     W = ceil(vocab / 32)
                     tokens 0..31, 32..63, ...
"""

from __future__ import annotations

import concurrent.futures as futures
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from inflight.sampling_params import (
    CONSTRAINT_FAILED,
    InvalidRequestError,
    StructuredOutputsParams,
)
from inflight.structured_output.grammar import validate_grammar

logger = logging.getLogger(__name__)

_GrammarKey = tuple[str, str, bool, bool, str | None]
# A failed request's message keeps this much of llguidance's error text.
_MAX_ERROR_CHARS = 500


class _HasRequestId(Protocol):
    request_id: str


@dataclass
class _RequestGrammar:
    key: _GrammarKey
    compiled: futures.Future[llguidance.LLMatcher]  # the cached, never-advanced matcher
    matcher: llguidance.LLMatcher | None = None  # this request's own, from its first step


class StructuredOutputManager:
    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...],
        max_cached_grammars: int = 256,
    ) -> None:
        self.tokenizer = tokenizer
        # Logit rows may be wider than the tokenizer (padded embeddings) or narrower.
        self.vocab_size = max(vocab_size, len(tokenizer))
        self.eos_token_ids = list(eos_token_ids)
        self.max_cached_grammars = max_cached_grammars
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._compiler = futures.ThreadPoolExecutor(1, thread_name_prefix="inflight-grammar")
        self._executor: llguidance.LLExecutor | None = None
        self._cache: OrderedDict[_GrammarKey, futures.Future[llguidance.LLMatcher]] = OrderedDict()
        self._requests: dict[str, _RequestGrammar] = {}

    # ------------------------------------------------------------------ requests

    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise InvalidRequestError if ``params`` can never be compiled (milliseconds)."""
        if not hasattr(self.tokenizer, "backend_tokenizer"):
            raise InvalidRequestError(
                "structured outputs need a fast (Rust `tokenizers`) tokenizer; this model's "
                f"is {type(self.tokenizer).__name__}",
                "structured_outputs",
            )
        validate_grammar(params)

    def add_request(self, request_id: str, params: StructuredOutputsParams) -> None:
        """Start compiling the request's grammar (or reuse the cached one); no wait."""
        key = params.key
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self._compiler.submit(self._compile, params)
            self._cache[key] = compiled
            self._evict()
        self._cache.move_to_end(key)
        self._requests[request_id] = _RequestGrammar(key, compiled)

    def free(self, request_ids: list[str]) -> None:
        """Forget finished requests' matchers (unknown ids are ignored)."""
        for request_id in request_ids:
            self._requests.pop(request_id, None)

    def is_ready(self, request: _HasRequestId) -> bool:
        """The scheduler's readiness check: False while the request's grammar compiles."""
        state = self._requests.get(request.request_id)
        return state is None or state.compiled.done()

    def has_pending(self) -> bool:
        return any(not s.compiled.done() for s in self._requests.values())

    def wait_for_compile(self, timeout: float) -> None:
        """Block until some pending grammar is compiled, or ``timeout`` seconds pass."""
        pending = [s.compiled for s in self._requests.values() if not s.compiled.done()]
        if pending:
            futures.wait(pending, timeout=timeout, return_when=futures.FIRST_COMPLETED)

    @property
    def num_requests(self) -> int:
        """Requests whose grammar state is held (0 once every request has ended)."""
        return len(self._requests)

    @property
    def num_compiling(self) -> int:
        """Requests whose grammar is still compiling (all waiting: none can be scheduled)."""
        return sum(not s.compiled.done() for s in self._requests.values())

    @property
    def num_cached_grammars(self) -> int:
        return len(self._cache)

    def shutdown(self) -> None:
        self._compiler.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ one step

    def fill_bitmask(self, request_ids: list[str]) -> tuple[np.ndarray, dict[str, str]]:
        """The allowed-token bitmask of each request (row i for request_ids[i]), filled in
        parallel, and the requests that cannot be constrained (their rows allow all)."""
        bitmask = np.full(llg_numpy.get_bitmask_shape(len(request_ids), self.vocab_size), -1,
                          dtype=np.int32)
        failed: dict[str, str] = {}
        rows: list[tuple[llguidance.LLMatcher, int]] = []
        for row, request_id in enumerate(request_ids):
            try:
                rows.append((self._matcher(request_id), row))
            except Exception as error:  # this request's grammar: it alone fails
                failed[request_id] = self._failure(request_id, str(error))
        if rows:
            llg_numpy.fill_next_token_bitmask_par(self._mask_executor(), rows, bitmask)
        for matcher, row in rows:
            if matcher.is_error():  # e.g. a regex too complex for the lexer
                failed[request_ids[row]] = self._failure(request_ids[row], matcher.get_error())
        return bitmask, failed

    def accept_tokens(self, tokens: dict[str, int]) -> tuple[set[str], dict[str, str]]:
        """Advance each constrained request's matcher by its sampled token.

        Returns the requests whose grammar is now complete (nothing but the end may
        follow: they finish with "stop") and those whose token was rejected."""
        finished: set[str] = set()
        failed: dict[str, str] = {}
        for request_id, token in tokens.items():
            if request_id not in self._requests:
                continue  # unconstrained
            try:
                matcher = self._matcher(request_id)
            except Exception as error:
                failed[request_id] = self._failure(request_id, str(error))
                continue
            # A matcher in error may also say "stopped": that is a failure, never a stop.
            if not matcher.consume_token(token) or matcher.is_error():
                failed[request_id] = self._failure(
                    request_id, f"the grammar rejected token {token}: {matcher.get_error()}"
                )
            elif matcher.is_stopped():
                finished.add(request_id)
        return finished, failed

    # ------------------------------------------------------------------ internals

    def _failure(self, request_id: str, error: str) -> str:
        """The failed request's message (llguidance's first lines, without its dump of
        the parser state and the whole grammar); its grammar leaves the cache, so the
        next request with the same constraint starts afresh."""
        state = self._requests.get(request_id)
        if state is not None and self._cache.get(state.key) is state.compiled:
            del self._cache[state.key]
        summary = error.split("\n<state>")[0].strip()
        if len(summary) > _MAX_ERROR_CHARS:
            summary = summary[:_MAX_ERROR_CHARS] + " ..."
        return f"{CONSTRAINT_FAILED} {summary}"

    def _matcher(self, request_id: str) -> llguidance.LLMatcher:
        state = self._requests.get(request_id)
        if state is None:
            raise RuntimeError(f"request {request_id!r} was never added")
        if state.matcher is None:
            # done (is_ready admitted it); re-raises the compile error if it failed
            state.matcher = state.compiled.result(timeout=0).deep_copy()
        return state.matcher

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """Runs on the compile thread: the grammar's matcher, before any token."""
        grammar = validate_grammar(params)
        matcher = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the {params.kind} constraint does not compile: {matcher.get_error()}")
        return matcher

    def _tokenizer(self) -> llguidance.LLTokenizer:
        # Only the (single) compile thread builds it, so no lock is needed.
        if self._ll_tokenizer is None:
            from inflight.model.gguf_tokenizer import hf_tokenizer
            from inflight.structured_output.ll_tokenizer import build_ll_tokenizer

            self._ll_tokenizer = build_ll_tokenizer(
                hf_tokenizer(self.tokenizer), self.vocab_size, self.eos_token_ids
            )
        return self._ll_tokenizer

    def _mask_executor(self) -> llguidance.LLExecutor:
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        return self._executor

    def _evict(self) -> None:
        while len(self._cache) > self.max_cached_grammars:
            key, oldest = next(iter(self._cache.items()))
            if not oldest.done():
                return  # still compiling; a later add evicts it
            del self._cache[key]
