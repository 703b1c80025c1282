"""Offline throughput of a running llama.cpp ``llama-server`` on a JSONL workload.

Sends every request of the workload at once (arrival times are ignored, as in the other
offline peers) to the server's native ``/completion`` endpoint with the prompt as token ids,
greedy sampling, ``n_predict = max_tokens`` and ``ignore_eos``; the server's slots batch
them continuously. Prints one JSON line with the same fields as ``openvino_bench.py``.
Standard library only, so any Python 3.10+ runs it.

    python llama_server_bench.py --url http://127.0.0.1:8080 --workload workload_seed8.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor


def complete(url: str, request: dict) -> list[int]:
    body = {
        "prompt": request["prompt_token_ids"],
        "n_predict": request["max_tokens"],
        "ignore_eos": True,
        "temperature": 0.0,
        "cache_prompt": False,
        "return_tokens": True,
        "stream": False,
    }
    req = urllib.request.Request(
        url + "/completion", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=3600) as response:
        return list(json.loads(response.read())["tokens"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--workload", required=True)
    parser.add_argument("--out", default=None, help="append the JSON line to this file")
    parser.add_argument("--num-prompts", type=int, default=None)
    args = parser.parse_args()
    with open(args.workload) as f:
        requests = [json.loads(line) for line in f if line.strip()]
    requests = requests[: args.num_prompts] if args.num_prompts else requests
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        outputs = list(pool.map(lambda r: complete(args.url, r), requests))
    wall = time.perf_counter() - start
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in requests)
    output_tokens = sum(len(o) for o in outputs)
    digest = hashlib.sha256()
    for r, o in zip(requests, outputs, strict=True):
        digest.update(json.dumps([r["id"], o]).encode())
    line = {
        "engine": "llama-server",
        "workload": os.path.basename(args.workload),
        "n_requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "wall_s": round(wall, 2),
        "output_tok_s": round(output_tokens / wall, 1),
        "total_tok_s": round((prompt_tokens + output_tokens) / wall, 1),
        "req_s": round(len(requests) / wall, 3),
        "requests_with_wrong_length": [
            r["id"] for r, o in zip(requests, outputs, strict=True) if len(o) != r["max_tokens"]
        ],
        "outputs_sha256": digest.hexdigest()[:16],
        "loadavg": os.getloadavg(),
    }
    print(json.dumps(line))
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
