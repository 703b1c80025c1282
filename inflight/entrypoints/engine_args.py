"""Engine options on the command line, shared by every subcommand that builds an engine."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from typing import Any

from inflight.config import (
    BATCHING_MODES,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_KV_CACHE_MEMORY_BYTES,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    KV_CACHE_DTYPES,
    SCHEDULING_POLICIES,
)
from inflight.vllm_engine_args import VLLM_ONLY_ARGS, Neutral, refusal

MODEL_HELP = "HF model directory or .gguf file (default: SmolLM2-135M-Instruct)"
# vLLM's --dtype values: half is float16, float is float32 (as LLM(dtype=...) takes them)
DTYPES = ["auto", "half", "float16", "bfloat16", "float", "float32"]


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    if model_positional:
        add_model_args(parser)
    else:
        parser.add_argument("--model", default=None, help=MODEL_HELP)
    group = parser.add_argument_group("engine")
    group.add_argument("--dtype", default="auto", choices=DTYPES,
                       help="weights and activations; auto: float32 on the CPU (matches "
                       "transformers), the model's dtype on CUDA; half is float16 (needs "
                       "--device cuda), float is float32")
    group.add_argument("--device", default="auto", help="auto, cpu or cuda")
    group.add_argument(
        "--quantization", default=None, choices=["gguf", "none", "w8a8"],
        help="gguf: small batches read a GGUF file's quantised weights (the default when "
        "the CPU kernel is available); none: dense weights only; w8a8: GGUF blocks for small "
        "steps as by default, and every other step's decoder linears in int8 (weights "
        "per channel, smoothed from a calibration pass at start-up; activations per token, "
        "quantised at run time): faster large batches at a cost in precision; CPU only",
    )
    group.add_argument(
        "--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
        help="KV cache element type: auto (the model's dtype), float32, bfloat16, or int8 "
        "(per-token, per-head scales; half of bfloat16's bytes for attention to read)",
    )
    group.add_argument("--seed", type=int, default=0, help="engine seed for sampling")
    group.add_argument("--max-model-len", type=max_model_len_arg, default=None,
                       help="longest prompt + output, as vLLM reads it: 2048, 4k (4000), 4K "
                       "(4096), 1m, 1M; -1 or auto: the model's context length (the default)")
    group.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS,
                       help=f"batch slots: most requests in one step (default: "
                       f"{DEFAULT_MAX_NUM_SEQS}; bench throughput's seed8: 8)")
    group.add_argument("--max-num-batched-tokens", type=human_readable_int, default=None,
                       help=f"token budget of one step (default: "
                       f"{DEFAULT_MAX_NUM_BATCHED_TOKENS}; max-model-len without chunked "
                       "prefill)")
    group.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                       help="tokens per KV cache block")
    group.add_argument("--num-kv-blocks", type=int, default=None,
                       help="KV cache capacity in blocks (default: from --kv-cache-memory-bytes)")
    group.add_argument("--kv-cache-memory-bytes", type=human_readable_int, default=None,
                       help=f"KV cache memory budget (default: {DEFAULT_KV_CACHE_MEMORY_BYTES}, "
                       "2 GiB; 2G is 2 GiB, 2g 2 GB), capped at what --max-num-seqs slots "
                       "can use")
    group.add_argument(
        "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
        help="split long prompts over steps; --no-enable-chunked-prefill schedules whole "
        "prompts only (on by default, as in vLLM)",
    )
    group.add_argument(
        "--long-prefill-token-threshold", type=int, default=0,
        help="a prompt with more tokens left than this gets at most this many in one step "
        "while other requests run or wait, so it cannot fill a step others wait behind "
        "(default: 0, no cap; as vLLM)",
    )
    group.add_argument(
        "--long-prefill-token-threshold-adaptive", action="store_true", default=False,
        help="floor --long-prefill-token-threshold at the budget's fair share, "
        "max-num-batched-tokens / requests running or waiting",
    )
    group.add_argument(
        "--max-long-partial-prefills", type=int, default=0,
        help="at most this many prompts longer than --long-prefill-token-threshold take "
        "tokens in one step (uncapped; the other long ones wait, shorter ones pass), so "
        "long prompts arriving together go one after another (default: 0, no limit)",
    )
    group.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="reuse the KV blocks of prompt prefixes seen before (on by default, as in vLLM)",
    )
    group.add_argument("--max-logprobs", type=int, default=20,
                       help="the most logprobs / prompt_logprobs / top_logprobs a request may ask for (default: 20)")
    group.add_argument(
        "--max-waiting-requests", type=int, default=None,
        help="backpressure: refuse a new request at once (the server answers 503 with "
        "Retry-After) while this many requests wait for a batch slot (default: unbounded)",
    )
    group.add_argument("--scheduling-policy", default="fcfs", choices=list(SCHEDULING_POLICIES),
                       help="waiting-queue order: fcfs, or priority (lower runs first)")
    group.add_argument("--batching", default="continuous", choices=list(BATCHING_MODES),
                       help="continuous (default) or the static-batching baseline")
    group.add_argument(
        "--generation-config", default="auto",
        help="sampling defaults for requests that leave a field out: auto (the model's "
        "generation_config.json, as vLLM), vllm (none), or a folder holding a "
        "generation_config.json (default: auto)",
    )
    group.add_argument(
        "--override-generation-config", type=_json_object, default=None,
        help='JSON laid over the generation config, e.g. \'{"temperature": 0.5}\'',
    )


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from error
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """MODEL as the positional argument or as ``--model`` (vLLM's serve takes both)."""
    parser.add_argument("model", nargs="?", default=argparse.SUPPRESS, action=ModelArgument,
                        help=MODEL_HELP)
    parser.add_argument("--model", dest="model", default=None, action=ModelArgument,
                        help="MODEL given as an option, as vLLM also takes it")


class ModelArgument(argparse.Action):
    """Stores the model; naming two different models (MODEL and ``--model``) is an error."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        given = getattr(namespace, self.dest, None)
        if given is not None and given != values:
            parser.error(f"two models given: {given!r} and {values!r}; pass MODEL or --model")
        setattr(namespace, self.dest, values)


_SUFFIXED = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(text: str) -> int:
    """vLLM's human-readable integers: ``2048``; ``4k`` is 4000 (k, m, g, t are powers of
    ten, and may follow a decimal: ``25.6k``); ``4K`` is 4096 (K, M, G, T are powers of
    two, after a whole number only)."""
    text = text.strip()
    match = _SUFFIXED.fullmatch(text)
    if match is None:
        return int(text)
    number, suffix = match.groups()
    if suffix in _DECIMAL_SUFFIXES:
        return int(float(number) * _DECIMAL_SUFFIXES[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"decimals are not allowed with binary suffixes like {suffix}; "
            f"did you mean {number}{suffix.lower()}?"
        )
    return int(number) * _BINARY_SUFFIXES[suffix]


def max_model_len_arg(text: str) -> int | None:
    """``--max-model-len`` as vLLM reads it: :func:`human_readable_int`, or ``-1`` /
    ``auto`` for the model's context length (None: inflight's default)."""
    if text.strip() == "-1" or text.strip().lower() == "auto":
        return None
    return human_readable_int(text)


# vLLM-only flags are stored under this prefix, so that a flag a subcommand implements
# itself (serve's --data-parallel-size) is never taken for one.
_VLLM_ONLY_DEST = "vllm_only_"


def add_vllm_only_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's engine flags that mean nothing here, from the table ``LLM()`` uses
    (:data:`inflight.vllm_engine_args.VLLM_ONLY_ARGS`), each under vLLM's spelling.

    Accepted at the values ``LLM()`` accepts and refused otherwise, by
    :func:`engine_options`. A flag the parser already has is left to it."""
    add_neutral_args(
        parser, VLLM_ONLY_ARGS, _VLLM_ONLY_DEST,
        "vLLM engine flags with no effect here (accepted at the values shown, refused "
        "with the reason at any other)",
    )


def add_neutral_args(
    parser: argparse.ArgumentParser, table: dict[str, Neutral], dest: str, title: str
) -> None:
    """One flag per entry of ``table`` under vLLM's spelling, stored as ``dest + name``
    and only when given; :func:`neutral_values` checks them. A flag the parser already
    has is left to it."""
    group = parser.add_argument_group(title)
    for name, rule in table.items():
        flags = vllm_flags(name, rule)
        if any(flag in parser._option_string_actions for flag in flags):
            continue
        group.add_argument(
            *flags, dest=dest + name, default=argparse.SUPPRESS,
            help=f"accepted {_accepted(flags[0], rule)}, with no effect: {rule.note}",
            **_value_kind(rule),
        )


def neutral_values(
    args: argparse.Namespace, table: dict[str, Neutral], dest: str,
    why_not: Callable[[str, Any], str | None],
) -> dict[str, Any]:
    """The flags of ``table`` given on the command line, by name; ``ValueError`` naming
    the flag as typed and ``why_not``'s reason for a value that is not neutral here."""
    given = {name: getattr(args, dest + name) for name in table if hasattr(args, dest + name)}
    for name, value in given.items():
        if (reason := why_not(name, value)) is not None:
            raise ValueError(f"{_as_typed(name, table[name], value)} is not supported: {reason}")
    return given


def vllm_flags(name: str, rule: Neutral) -> list[str]:
    """vLLM's spellings of argument ``name``: ``--tensor-parallel-size``, ``-tp``."""
    return ["--" + name.replace("_", "-"), *rule.aliases]


def _accepted(flag: str, rule: Neutral) -> str:
    """The values ``rule`` accepts, as ``--help`` says them."""
    if not rule.is_switch:
        return f"as {rule.accepts.text}"
    on, off = rule.accepts(True), rule.accepts(False)
    if on and off:
        return "either way"
    return f"as {flag} only" if on else f"as --no-{flag[2:]} only"


def _value_kind(rule: Neutral) -> dict[str, Any]:
    if rule.is_switch:
        return {"action": argparse.BooleanOptionalAction}
    return {"type": rule.parse, "metavar": "VALUE", **({"nargs": "+"} if rule.several else {})}


def vllm_only_options(args: argparse.Namespace) -> dict[str, Any]:
    """The vLLM-only flags given on the command line, as ``LLM()`` keyword arguments;
    ``ValueError`` naming the flag for a value that is not neutral here."""
    return neutral_values(
        args, VLLM_ONLY_ARGS, _VLLM_ONLY_DEST, lambda name, value: refusal(name, value, args.model)
    )


def _as_typed(name: str, rule: Neutral, value: Any) -> str:
    """The flag as the command line gave it: ``-tp 2`` is ``--tensor-parallel-size 2``."""
    flag = vllm_flags(name, rule)[0]
    if rule.is_switch:
        return flag if value else f"--no-{flag[2:]}"
    return f"{flag} {' '.join(map(str, value)) if isinstance(value, list) else value}"


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The LLM/LLMEngine keyword options named by ``add_engine_args`` (and
    ``add_vllm_only_args``, checked: ``ValueError`` for a value ``LLM()`` refuses)."""
    options: dict[str, Any] = dict(
        dtype=args.dtype, device=args.device, seed=args.seed, max_model_len=args.max_model_len,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
        enable_chunked_prefill=args.enable_chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        long_prefill_token_threshold_adaptive=args.long_prefill_token_threshold_adaptive,
        max_long_partial_prefills=args.max_long_partial_prefills,
        enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy, batching=args.batching,
        max_logprobs=args.max_logprobs, max_waiting_requests=args.max_waiting_requests,
        generation_config=args.generation_config,
        override_generation_config=args.override_generation_config,
    )
    if args.kv_cache_memory_bytes is not None:
        options["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    return options | vllm_only_options(args)
