"""Drive an OpenAI-compatible server with vLLM's own load client (`vllm bench serve`).

Runs in the vLLM venv (see README.md next to this file), so that neither engine grades
itself: the same requests as `inflight bench serve` sends (a workload file written by
`inflight bench workload NAME -o FILE.jsonl`: token ids, max_tokens), decoded to text with
the model's tokenizer and sent by `vllm.benchmarks.serve` as a "custom" dataset, in file
order, to /v1/completions with `ignore_eos`, at `--rate` requests/s (vLLM's Poisson
arrivals, seed 0).

usage: vllm_serve_client.py --workload FILE.jsonl --tokenizer HF_DIR --port PORT
           --rate R --num-prompts N --result OUT.json [--label LABEL] [--model NAME]

The result is vLLM's own result JSON (its `--save-result` file: p50/p99 TTFT, TPOT, ITL
and E2E latency in ms, goodput for TTFT <= 2 s and TPOT <= 250 ms), plus the fields
`label` and `workload_rate`, so `python -m inflight.bench.rate_plot` reads it beside
inflight's own results.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def to_custom_dataset(workload: Path, tokenizer_dir: str, out: Path, limit: int) -> int:
    """Write vLLM's custom dataset (one ``{"prompt", "output_tokens"}`` per line)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = [json.loads(line) for line in workload.read_text().splitlines() if line.strip()]
    rows = rows[:limit] if limit > 0 else rows
    with out.open("w") as f:
        for row in rows:
            prompt = tokenizer.decode(row["prompt_token_ids"])
            f.write(json.dumps({"prompt": prompt, "output_tokens": row["max_tokens"]}) + "\n")
    return len(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", type=Path, required=True)
    p.add_argument("--tokenizer", required=True, help="HF model directory (its tokenizer)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--rate", type=float, required=True)
    p.add_argument("--num-prompts", type=int, default=0, help="first N requests (0: all)")
    p.add_argument("--result", type=Path, required=True)
    p.add_argument("--label", default="")
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="the served model name")
    args = p.parse_args()

    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    with tempfile.TemporaryDirectory() as tmp:
        dataset = Path(tmp) / "custom.jsonl"
        n = to_custom_dataset(args.workload, args.tokenizer, dataset, args.num_prompts)
        parser = FlexibleArgumentParser()
        serve.add_cli_args(parser)
        bench_args = parser.parse_args([
            "--backend", "openai", "--endpoint", "/v1/completions",
            "--base-url", f"http://127.0.0.1:{args.port}",
            "--model", args.model, "--tokenizer", args.tokenizer,
            "--dataset-name", "custom", "--dataset-path", str(dataset),
            "--custom-output-len", "-1", "--skip-chat-template", "--disable-shuffle",
            "--num-prompts", str(n), "--request-rate", str(args.rate), "--seed", "0",
            "--ignore-eos", "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--goodput", "ttft:2000", "tpot:250",
            "--save-result", "--result-dir", str(args.result.parent.resolve()),
            "--result-filename", args.result.name,
        ])
        serve.main(bench_args)
    result = json.loads(args.result.read_text())
    result.update(label=args.label or f"vllm-client {args.rate}", workload_rate=args.rate,
                  client="vllm bench serve")
    args.result.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
