"""The source document's worked example, measured from real step traces (tiny model).

8 requests (one of 500 output tokens, seven of 50) in 8 slots: static batching does work
in 500 + 7 x 50 = 850 of 8 x 500 = 4000 slot-steps, so 1 - 850/4000 = 78.75% sit idle.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from inflight.bench import workloads
from inflight.bench.engine_run import run_inflight
from inflight.bench.report import latencies_from_trace, slot_steps

SEED_IDLE_SHARE = 1 - 850 / 4000


@pytest.fixture(scope="module")
def long_tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with room for seed8's 128 + 500 tokens."""
    from helpers.tiny_model import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-1k"), max_position_embeddings=1024)


def _run(model: Path, batching: str, workload: workloads.Workload):
    options = dict(dtype="float32", max_num_seqs=8, batching=batching)
    return run_inflight(workload, str(model), options, warmup=False)


def test_static_idle_share_matches_the_source_document(long_tiny_llama: Path) -> None:
    result = _run(long_tiny_llama, "static", workloads.seed8())
    counts = slot_steps(result.records)
    # one step or two of rounding either way
    assert counts.num_slots == 8 and abs(counts.num_steps - 500) <= 2
    assert abs(counts.working - 850) <= 2 * 8
    assert counts.idle_share == pytest.approx(SEED_IDLE_SHARE, abs=2 * 8 / 4000)
    assert 1 - counts.utilisation == pytest.approx(SEED_IDLE_SHARE, abs=2 * 8 / 4000)

    report = result.report
    assert report.num_output_tokens == 850 and report.num_prompt_tokens == 8 * 128
    assert report.slots == counts and report.num_preemptions == 0
    assert sorted(x.num_output_tokens for x in report.requests) == [50] * 7 + [500]
    # The trace alone gives the same per-request token counts and TTFT as the metrics.
    from_trace = {x.request_id: x for x in latencies_from_trace(result.records)}
    assert len(from_trace) == 8
    ids = [r.request_id for r in result.records[0].entries]  # engine ids, in workload order
    for engine_id, measured in zip(ids, report.requests, strict=True):
        assert from_trace[engine_id].num_output_tokens == measured.num_output_tokens
        assert from_trace[engine_id].num_prompt_tokens == 128
        assert from_trace[engine_id].ttft_s == pytest.approx(measured.ttft_s, abs=0.05)


def test_continuous_refills_the_slots_static_leaves_idle(long_tiny_llama: Path) -> None:
    # Twice the seed's requests: static needs two 500-step batches, continuous lets the
    # second group into the first group's finished slots at once.
    result = _run(long_tiny_llama, "continuous", workloads.seed8().repeat(2))
    counts = slot_steps(result.records)
    assert counts.idle == 0 and counts.working == 2 * 850
    assert counts.num_steps < 600 < 2 * 500
    assert result.report.num_output_tokens == 2 * 850
