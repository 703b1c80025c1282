"""What structured outputs cost a step: N constrained requests against N unconstrained ones.

Both runs use the same N chat prompts, greedy; the unconstrained run ignores EOS so it
makes exactly ``--max-tokens`` tokens, the constrained run asks for a small JSON schema
(its requests may finish earlier, when the JSON is complete). The figure compared is
the mean duration of the steps in which all N requests decode together, read from the
step trace, so the two runs compare like with like. Also reported: the grammar engine's
one-off tokenizer setup plus first compile, and the compile of a further schema.

    python -m inflight.bench.structured_cost --dtype bfloat16 [--num-requests 64]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "city"],
}


def _compile_seconds(manager: Any, schema: dict[str, Any], request_id: str) -> float:
    from inflight import StructuredOutputsParams

    started = time.perf_counter()
    manager.add_request(request_id, StructuredOutputsParams(json=schema))
    while manager.has_pending():
        manager.wait_for_compile(timeout=1.0)
    elapsed = time.perf_counter() - started
    manager.free([request_id])
    return elapsed


def _full_decode_step_ms(records: list[Any], num_requests: int) -> list[float]:
    return [
        r.duration_s * 1e3 for r in records
        if r.batch_size == num_requests and all(e.kind == "decode" for e in r.entries)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args(argv)

    from inflight import LLM, SamplingParams, StructuredOutputsParams
    from inflight.entrypoints.chat_utils import ChatOptions, render_chat

    n = args.num_requests
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=n, record_trace=True)
    manager = llm.llm_engine.structured_output
    first = _compile_seconds(manager, SCHEMA, "compile-1")
    other = {**SCHEMA, "required": ["name", "age"]}
    second = _compile_seconds(manager, other, "compile-2")
    prompts = [
        {"prompt_token_ids": render_chat(
            llm.get_tokenizer(),
            [{"role": "user", "content": f"Describe person number {i} as a JSON object."}],
            ChatOptions(),
        ).prompt_token_ids}
        for i in range(n)
    ]
    runs = {
        "unconstrained": SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True),
        "json_schema": SamplingParams(
            temperature=0.0, max_tokens=args.max_tokens,
            structured_outputs=StructuredOutputsParams(json=SCHEMA),
        ),
    }
    llm.generate(prompts[:2], runs["unconstrained"], use_tqdm=False)  # warm-up
    means: dict[str, float] = {}
    for label, params in runs.items():
        llm.step_trace.clear()
        llm.reset_prefix_cache()
        llm.generate(prompts, params, use_tqdm=False)
        steps = _full_decode_step_ms(llm.step_trace.records, n)
        if not steps:
            raise SystemExit(f"{label}: no step with all {n} requests decoding")
        means[label] = statistics.mean(steps)
        print(f"{label:>14}: {len(steps)} steps with {n} decoding, mean {means[label]:.1f} ms "
              f"(median {statistics.median(steps):.1f} ms)")
    print(f"constrained / unconstrained step time: {means['json_schema'] / means['unconstrained']:.3f}")
    print(f"grammar: tokenizer setup + first compile {first * 1e3:.0f} ms, "
          f"another schema {second * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
