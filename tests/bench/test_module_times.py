"""``bench throughput --module-times``: per-module self times by forward hooks. The counts
and FLOPs follow from the workload's shape, so a hook that misses calls, counts a nested
call twice or sizes a matmul wrongly fails here."""

from __future__ import annotations

import json
import time
from pathlib import Path

from inflight import LLM, SamplingParams
from inflight.bench.module_times import ModuleTimes
from inflight.entrypoints.cli import main

PROMPTS = [list(range(5, 5 + n)) for n in (7, 19, 33)]
MAX_TOKENS = 5


def test_counts_flops_and_self_times_follow_the_workload(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), enable_prefix_caching=False, max_num_seqs=4)
    model = llm.llm_engine.runner.model
    arch = model.arch
    times = ModuleTimes(model)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    started = time.perf_counter()
    with times.recording():
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    wall = time.perf_counter() - started
    rows = {r.kind: r for r in times.rows.values()}

    forwards = rows["model (embedding, final norm, fused decode layers)"].calls
    layers = arch.num_hidden_layers
    assert forwards >= 1
    for kind in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        assert rows[f"linear {kind}"].calls == forwards * layers, kind
    assert rows["attention (RoPE, K/V write, kernel)"].calls == forwards * layers
    # Every token the model ran: each prompt, then each new token but the last.
    tokens = sum(len(p) + MAX_TOKENS - 1 for p in PROMPTS)
    q_kv = (arch.num_attention_heads + 2 * arch.num_key_value_heads) * arch.head_dim
    assert rows["linear qkv_proj"].flops == 2 * tokens * arch.hidden_size * q_kv * layers
    assert rows["linear down_proj"].flops == (
        2 * tokens * arch.intermediate_size * arch.hidden_size * layers
    )
    # The output layer runs only on the rows that sample: one per new token.
    sampled = len(PROMPTS) * MAX_TOKENS
    assert rows["linear lm_head"].flops == 2 * sampled * arch.hidden_size * arch.vocab_size
    # Self times exclude the timed modules inside: they add up to less than the wall time.
    assert all(r.self_s >= 0 for r in rows.values())
    assert times.total_s() <= wall
    # The hooks are gone after recording.
    before = rows["linear qkv_proj"].calls
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
    assert rows["linear qkv_proj"].calls == before


def test_bench_throughput_reports_module_times(tiny_llama_dir: Path, tmp_path: Path) -> None:
    code = main([
        "bench", "throughput", "--model", str(tiny_llama_dir), "--dtype", "float32",
        "--input-len", "16", "--output-len", "6", "--num-prompts", "4", "--max-num-seqs", "4",
        "--module-times", "--no-isolate", "--no-bench-lock", "--no-plots",
        "--output-json", str(tmp_path / "results.json"),
    ])
    assert code == 0
    (run,) = json.loads((tmp_path / "results.json").read_text())["runs"]
    rows = {row["kind"]: row for row in run["module_times"]}
    assert rows["linear lm_head"]["calls"] >= 6 and rows["linear lm_head"]["gflops"] > 0
    assert sum(row["self_s"] for row in rows.values()) <= run["wall_time_s"]
    table = (tmp_path / "profile_inflight_continuous.txt").read_text()
    assert "linear gate_up_proj" in table and "outside the model" in table
