#!/usr/bin/env python3
"""Offline throughput of OpenVINO GenAI's ContinuousBatchingPipeline on JSONL workloads.

Peer benchmark for inflight; runs in its own venv (see README.md here), not in inflight's.

Every request: greedy, ignore_eos, min_new_tokens = max_new_tokens = max_tokens, so each
generates exactly max_tokens tokens. All requests of a workload go to one generate() call
(arrival_s is ignored). Settings default to the best measured on a 2-core CPU:
INFERENCE_NUM_THREADS=2, INFERENCE_PRECISION_HINT=f32, cache_size=4 GiB,
max_num_batched_tokens=1024.

  python openvino_bench.py --model OV_MODEL_DIR --workload workload_seed8.jsonl \
      [--workload workload_mixed.jsonl] [--out results.jsonl]

Prints one JSON line per workload (also appended to --out). Run it under the shared
benchmark lock (flock) so that no two timed runs overlap.
"""
import argparse
import hashlib
import json
import os
import resource
import sys
import time


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=os.environ.get("OV_MODEL_DIR", "ov-smollm2-fp32"),
                   help="optimum-cli OpenVINO export dir (default: $OV_MODEL_DIR or ./ov-smollm2-fp32)")
    p.add_argument("--workload", required=True, action="append",
                   help="JSONL workload; repeat the flag to run several in one process")
    p.add_argument("--out", default=None, help="append one JSON result line per workload here")
    p.add_argument("--num-prompts", type=int, default=0,
                   help="use only the first N requests of each workload (0: all)")
    p.add_argument("--precision", choices=["f32", "bf16"], default="f32",
                   help="INFERENCE_PRECISION_HINT (default f32; OpenVINO's own default is bf16)")
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--cache-size", type=int, default=4, help="KV cache size in GiB")
    p.add_argument("--threads", type=int, default=2, help="INFERENCE_NUM_THREADS")
    p.add_argument("--kv-cache-precision", default=None,
                   help="KV_CACHE_PRECISION (e.g. u8, f16, f32; unset: OpenVINO default)")
    p.add_argument("--tag", default="")
    p.add_argument("--dump-tokens", default=None,
                   help="write output token ids (JSONL) here; '{wl}' expands to the workload name")
    return p.parse_args()


def cpu_seconds():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main():
    a = parse()
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    import openvino as ov
    import openvino_genai as ov_genai
    t_import = time.perf_counter() - t0

    sched = ov_genai.SchedulerConfig()
    sched.cache_size = a.cache_size
    sched.max_num_batched_tokens = a.max_num_batched_tokens
    props = {"INFERENCE_NUM_THREADS": a.threads, "INFERENCE_PRECISION_HINT": a.precision}
    if a.kv_cache_precision:
        props["KV_CACHE_PRECISION"] = a.kv_cache_precision

    t1 = time.perf_counter()
    pipe = ov_genai.ContinuousBatchingPipeline(a.model, sched, "CPU", props)
    t_build = time.perf_counter() - t1

    effective = dict(
        cache_size_gib=sched.cache_size,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        max_num_seqs=sched.max_num_seqs,
        dynamic_split_fuse=sched.dynamic_split_fuse,
        enable_prefix_caching=sched.enable_prefix_caching,
    )

    for wl in a.workload:
        run_workload(a, ov, ov_genai, pipe, wl, props, effective, t_import, t_build, load0)
    del pipe


def run_workload(a, ov, ov_genai, pipe, wl, props, effective, t_import, t_build, load0):
    import numpy as np

    reqs = [json.loads(line) for line in open(wl) if line.strip()]
    if a.num_prompts:
        reqs = reqs[: a.num_prompts]
    n_prompt = sum(len(r["prompt_token_ids"]) for r in reqs)
    n_out_expected = sum(r["max_tokens"] for r in reqs)

    inputs, configs = [], []
    for r in reqs:
        inputs.append(ov.Tensor(np.asarray([r["prompt_token_ids"]], dtype=np.int64)))
        g = ov_genai.GenerationConfig()
        g.max_new_tokens = r["max_tokens"]
        g.min_new_tokens = r["max_tokens"]
        g.ignore_eos = True
        g.do_sample = False
        configs.append(g)

    load_w = os.getloadavg()
    cpu0 = cpu_seconds()
    ts = time.perf_counter()
    results = pipe.generate(inputs, configs)
    wall = time.perf_counter() - ts
    cpu = cpu_seconds() - cpu0

    outs = [list(res.m_generation_ids[0]) for res in results]
    n_out = sum(len(o) for o in outs)
    bad = [r["id"] for r, o in zip(reqs, outs, strict=True) if len(o) != r["max_tokens"]]
    # same fingerprint scheme as vllm_bench_offline.py, for cross-engine checks
    h = hashlib.sha256()
    for r, o in zip(reqs, outs, strict=True):
        h.update(json.dumps([r["id"], o]).encode())
    if a.dump_tokens:
        path = a.dump_tokens.replace("{wl}", os.path.basename(wl).replace(".jsonl", ""))
        with open(path, "w") as f:
            for r, o in zip(reqs, outs, strict=True):
                f.write(json.dumps({"id": r["id"], "output_token_ids": o}) + "\n")

    res = dict(
        engine="openvino-genai", version=ov_genai.__version__, tag=a.tag,
        workload=os.path.basename(wl), n_requests=len(reqs),
        prompt_tokens=n_prompt, expected_output_tokens=n_out_expected,
        output_tokens=n_out, requests_with_wrong_length=bad,
        wall_s=round(wall, 3),
        output_tok_s=round(n_out / wall, 2),
        total_tok_s=round((n_prompt + n_out) / wall, 2),
        req_s=round(len(reqs) / wall, 3),
        cpu_s=round(cpu, 1),
        pipeline_build_s=round(t_build, 2), import_s=round(t_import, 2),
        settings=dict(properties=props, **effective),
        peak_rss_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3),
        outputs_sha256=h.hexdigest()[:16],
        loadavg_start=load0, loadavg_before_workload=load_w, loadavg_end=os.getloadavg(),
    )
    line = json.dumps(res)
    print(line, flush=True)
    if a.out:
        with open(a.out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    sys.exit(main())
