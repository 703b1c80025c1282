"""Per-request bookkeeping of the async engine: what each completion has sent so far.

:class:`LiveRequest` turns the engine's cumulative outputs into the deltas a stream
receives (new text and token ids, holding back a possible stop string's start) and,
when the request ends, into the statistics the metrics record.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inflight.core.request import Request
from inflight.engine.request_stream import RequestDelta, RequestStream
from inflight.metrics.stats import FinishedRequestStats
from inflight.outputs import CompletionOutput, RequestOutput


@dataclass(slots=True)
class LiveRequest:
    """The async engine's bookkeeping for one request in flight (engine thread only):
    what each of its completions has sent so far, and its timestamps."""

    stream: RequestStream
    request: Request  # the scheduler's record: read only, to see when it is first scheduled
    num_prompt_tokens: int
    arrival_time: float
    holdback: int  # characters kept back while streaming, so a stop string is never sent
    n: int = 1
    # Per completion index: tokens and characters already sent, and whether it ended.
    sent_token_counts: list[int] = field(default_factory=lambda: [0])
    sent_char_counts: list[int] = field(default_factory=lambda: [0])
    ended: list[bool] = field(default_factory=lambda: [False])
    sent_prompt_logprobs: bool = False
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    timeout_s: float | None = None

    @property
    def sent_tokens(self) -> int:
        return sum(self.sent_token_counts)

    def delta(
        self, output: RequestOutput, completion: CompletionOutput, force: bool = False
    ) -> RequestDelta | None:
        """What completion ``index`` produced since its last delta; None if nothing (and
        the request has one completion only: then every output makes a delta, as before)."""
        index = completion.index
        sent_tokens = self.sent_token_counts[index]
        new_ids = completion.token_ids[sent_tokens:]
        text = completion.text
        sent_chars = self.sent_char_counts[index]
        # Hold back the tail that could be the start of a stop string: if the string
        # completes later the engine cuts the text there, and sent text cannot be unsent.
        done = completion.finish_reason is not None
        visible = len(text) if done or output.finished else max(sent_chars, len(text) - self.holdback)
        newly_ended = done and not self.ended[index]
        if self.n > 1 and not (force or new_ids or visible > sent_chars or newly_ended):
            return None
        prompt_logprobs = None
        if not self.sent_prompt_logprobs and output.prompt_logprobs is not None:
            prompt_logprobs = output.prompt_logprobs
            self.sent_prompt_logprobs = True
        logprobs = None
        if completion.logprobs is not None:
            logprobs = completion.logprobs[sent_tokens : sent_tokens + len(new_ids)]
        delta = RequestDelta(
            request_id=output.request_id,
            text=text[sent_chars:visible],
            token_ids=list(new_ids),
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=len(completion.token_ids),
            finished=output.finished and self.n == 1,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            index=index,
            logprobs=logprobs,
            cumulative_logprob=completion.cumulative_logprob,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=output.num_cached_tokens,
        )
        self.sent_token_counts[index] = len(completion.token_ids)
        self.sent_char_counts[index] = max(sent_chars, visible)
        self.ended[index] = done
        return delta

    def finished_stats(self, reason: str, now: float) -> FinishedRequestStats:
        """The request's intervals (vLLM's definitions); one never reached is 0."""
        scheduled = self.first_scheduled_time
        first, last = self.first_token_time, self.last_token_time
        ttft = None if first is None else first - self.arrival_time
        tpot = None
        if first is not None and last is not None and self.sent_tokens > 1:
            tpot = (last - first) / (self.sent_tokens - 1)
        queue = (now if scheduled is None else scheduled) - self.arrival_time
        # Without a token, prefill and inference run until the request ended (an abort).
        prefill = 0.0 if scheduled is None else (now if first is None else first) - scheduled
        inference = 0.0 if scheduled is None else (now if last is None else last) - scheduled
        decode = 0.0 if first is None or last is None else last - first
        return FinishedRequestStats(
            finish_reason=reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.sent_tokens,
            e2e_latency=now - self.arrival_time,
            time_to_first_token=ttft,
            time_per_output_token=tpot,
            queue_time=queue,
            prefill_time=prefill,
            decode_time=decode,
            inference_time=inference,
            max_tokens_param=self.request.max_output_tokens,
            n=self.n,
            num_cached_prompt_tokens=self.request.num_cached_tokens or 0,
            num_preemptions=self.request.num_preemptions,
        )
