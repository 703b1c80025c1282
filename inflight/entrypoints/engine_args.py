"""Engine options on the command line, shared by every subcommand that builds an engine."""

from __future__ import annotations

import argparse
import json
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


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    if model_positional:
        parser.add_argument("model", nargs="?", default=None,
                            help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    else:
        parser.add_argument("--model", default=None,
                            help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    group = parser.add_argument_group("engine")
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="weights and activations; auto: float32 on the CPU (matches "
                       "transformers), the model's dtype on CUDA; float16 needs --device cuda")
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
    group.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output (default: the model's context length)")
    group.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS,
                       help=f"batch slots: most requests in one step (default: "
                       f"{DEFAULT_MAX_NUM_SEQS}; bench throughput's seed8: 8)")
    group.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help=f"token budget of one step (default: "
                       f"{DEFAULT_MAX_NUM_BATCHED_TOKENS}; max-model-len without chunked "
                       "prefill)")
    group.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                       help="tokens per KV cache block")
    group.add_argument("--num-kv-blocks", type=int, default=None,
                       help="KV cache capacity in blocks (default: from --kv-cache-memory-bytes)")
    group.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                       help=f"KV cache memory budget (default: {DEFAULT_KV_CACHE_MEMORY_BYTES}, "
                       "2 GiB), capped at what --max-num-seqs slots can use")
    group.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill",
                       action="store_false", default=True,
                       help="schedule whole prompts only (default: chunked prefill on)")
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


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The LLM/LLMEngine keyword options named by ``add_engine_args``."""
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
    return options
