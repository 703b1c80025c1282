"""``inflight generate "PROMPT"``: one-shot generation, text printed to stdout."""

from __future__ import annotations

import argparse
import os
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    from inflight.entrypoints.engine_args import add_engine_args

    parser = subparsers.add_parser(
        "generate",
        help="generate a continuation of one or more prompts",
        description="Generate a continuation of each prompt and print it. By default the "
        "decoding is greedy (temperature 0) and stops at the end-of-sequence token or after "
        "128 new tokens. Several prompts run as one batch; each answer is printed under a "
        "'=== [i] prompt' header line.",
    )
    parser.add_argument("prompts", nargs="+", help="prompt text (several run as one batch)")
    parser.add_argument("--max-tokens", type=int, default=128, help="most new tokens per prompt")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 is greedy; above 0 samples"
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest; 0: all")
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    parser.add_argument("--chat", action="store_true",
                        help="wrap each prompt as a user message in the model's chat template")
    parser.add_argument(
        "--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens"
    )
    parser.add_argument("--trace", metavar="JSONL", default=None,
                        help="write the step trace to this file")
    add_engine_args(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from inflight import LLM, SamplingParams
    from inflight.entrypoints.engine_args import engine_options

    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.sampling_seed, ignore_eos=args.ignore_eos,
    )
    if args.trace:
        check_writable(args.trace, "--trace")  # before minutes of generation, not after
    llm = LLM(args.model, record_trace=args.trace is not None, **engine_options(args))
    if args.chat:
        conversations = [[{"role": "user", "content": p}] for p in args.prompts]
        outputs = llm.chat(conversations, params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    print(format_answers(args.prompts, [o.outputs[0].text for o in outputs]))
    if args.trace:
        llm.step_trace.write_jsonl(args.trace)
    return 0


def format_answers(prompts: list[str], answers: list[str]) -> str:
    """One answer alone as it is; several each under a ``=== [i] prompt`` header line."""
    if len(answers) == 1:
        return answers[0]
    blocks = []
    for number, (prompt, answer) in enumerate(zip(prompts, answers, strict=True), 1):
        shown = " ".join(prompt.split())
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        blocks.append(f"=== [{number}] {shown}\n{answer.strip()}")
    return "\n\n".join(blocks)


def check_writable(path: str, flag: str) -> None:
    """ValueError unless ``path`` can be written: an existing folder, or a file in a folder
    that is missing or read-only."""
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise ValueError(f"{flag} {path} is a folder, not a file")
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ValueError(f"{flag} {path} cannot be written")
