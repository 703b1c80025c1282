"""The step cost model: features derived from a trace, and a fit that recovers known costs.

The synthetic trace is a simulated run whose step durations come from a known cost model
(computed from the scheduler's exact positions); the fit reads only the trace file, so it
must rebuild every position from the trace's history, preemptions and prefix hits
included, to recover the coefficients.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace

import numpy as np
import pytest

from inflight.bench.workloads import Workload, WorkloadRequest
from inflight.engine.step_trace import StepTrace
from inflight.planner.cost_model import (
    BUILTIN,
    CostModel,
    EntryShape,
    StepFeatures,
    features_from_trace,
    fit_trace,
    load_cost_model,
)
from inflight.planner.simulator import simulate

KNOWN = CostModel(
    intercept_s=0.012,
    per_prefill_token_s=3e-4,
    per_prefill_chunk_s=2e-3,
    per_decode_seq_s=8e-4,
    per_decode_kv_token_s=4e-7,
    per_prefill_kv_pair_s=6e-9,
)


def _workload(n: int = 60, seed: int = 1) -> Workload:
    """Varied prompts (some sharing a 64-token prefix) and outputs, arrivals spread out."""
    rng = random.Random(seed)
    common = [rng.randrange(1000, 40000) for _ in range(64)]
    requests, t = [], 0.0
    for i in range(n):
        own = [rng.randrange(1000, 40000) for _ in range(rng.randint(8, 700))]
        requests.append(WorkloadRequest(i, (common if i % 3 == 0 else []) + own,
                                        rng.randint(2, 200), round(t, 3)))
        t += rng.expovariate(4.0)
    return Workload("fit", requests)


def _simulated_trace(tmp_path, **options):
    result = simulate(_workload(), KNOWN, max_num_seqs=16, max_num_batched_tokens=256,
                      num_kv_blocks=120, **options)
    path = tmp_path / "trace.jsonl"
    StepTrace(enabled=True, records=result.records).write_jsonl(path)
    return result, StepTrace.read_jsonl(path)


def test_features_of_a_step() -> None:
    shapes = [EntryShape(4, 10, True), EntryShape(1, 50, False), EntryShape(1, 7, False)]
    f = StepFeatures.of(shapes)
    # a 4-token chunk at 10 attends 11+12+13+14 keys; decodes at 50 and 7 read 51 and 8
    assert f == StepFeatures(prefill_tokens=4, prefill_chunks=1, decode_seqs=2,
                             decode_kv_tokens=59, prefill_kv_pairs=50)


def test_trace_positions_are_rebuilt_from_its_history(tmp_path) -> None:
    result, records = _simulated_trace(tmp_path)
    assert result.num_preemptions > 0  # the history includes recomputation
    assert any(e.num_cached_tokens for r in records for e in r.entries)
    derived = features_from_trace(records)
    durations = [r.duration_s for r in records]
    assert [KNOWN.step_time(f) for f in derived] == pytest.approx(durations, rel=1e-9)


def test_fit_recovers_known_coefficients(tmp_path) -> None:
    _, records = _simulated_trace(tmp_path)
    exact = fit_trace(records, source="synthetic")
    assert exact.coefficients == pytest.approx(KNOWN.coefficients, rel=1e-6, abs=1e-12)
    assert exact.held_out is not None and exact.held_out.mean_abs_pct_error < 1e-6

    # 3% multiplicative noise: still close, and the held-out error says how close
    rng = np.random.default_rng(0)
    noisy = [replace(r, duration_s=r.duration_s * (1 + 0.03 * rng.standard_normal()))
             for r in records]
    fitted = fit_trace(noisy, source="synthetic, noisy")
    assert fitted.per_prefill_token_s == pytest.approx(KNOWN.per_prefill_token_s, rel=0.1)
    assert fitted.per_decode_seq_s == pytest.approx(KNOWN.per_decode_seq_s, rel=0.1)
    assert fitted.intercept_s == pytest.approx(KNOWN.intercept_s, rel=0.1)
    assert fitted.held_out is not None
    assert 0.01 < fitted.held_out.mean_abs_pct_error < 0.05
    assert fitted.held_out.num_steps == len(records) // 5


def test_fit_never_returns_negative_costs(tmp_path) -> None:
    _, records = _simulated_trace(tmp_path)
    # durations that fall with prefill tokens would need a negative coefficient
    skewed = [replace(r, duration_s=max(1e-4, 0.05 - 1e-5 * r.num_batched_tokens))
              for r in records]
    fitted = fit_trace(skewed, source="skewed")
    assert all(c >= 0 for c in fitted.coefficients)


def test_saved_fit_round_trips_and_is_the_default(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert load_cost_model(None) is BUILTIN  # nothing calibrated on this "machine" yet
    _, records = _simulated_trace(tmp_path)
    fitted = fit_trace(records, source="synthetic", kv_bytes_per_token=512, max_model_len=512)
    fitted.save(tmp_path / "cache" / "inflight" / "calibration.json")
    loaded = load_cost_model(None)
    assert loaded == fitted and loaded.kv_bytes_per_token == 512


def test_default_kv_cache_is_sized_like_the_engines() -> None:
    from inflight.planner.simulator import make_sim_config

    # SmolLM2-135M in bfloat16: 2 x 30 layers x 3 KV heads x 64 dims x 2 bytes per token;
    # the default 2 GiB budget affords 2**31 // (23040 * 16) = 5825 blocks of 16 tokens,
    # fewer than 64 full-length (8192-token) requests could use.
    config = make_sim_config(BUILTIN)
    assert config.num_kv_blocks == (2 << 30) // (23040 * 16) == 5825
    small = make_sim_config(BUILTIN, max_num_seqs=2, max_model_len=1024)
    assert small.num_kv_blocks == 2 * 1024 // 16 + 1


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"intercept_s": -0.01}, "intercept_s"),
        ({"per_prefill_token_s": -1e-4}, "per_prefill_token_s"),
        ({"per_decode_seq_s": float("nan")}, "per_decode_seq_s"),
        ({"per_decode_kv_token_s": float("inf")}, "per_decode_kv_token_s"),
        ({"intercept_s": "fast"}, "intercept_s"),
        ({"intercept_s": True}, "intercept_s"),
        ({"kv_bytes_per_token": 0}, "kv_bytes_per_token"),
        ({"kv_bytes_per_token": 1.5}, "kv_bytes_per_token"),
        ({"max_model_len": -1}, "max_model_len"),
        # every step would take 0 s: no intercept, and decodes cost nothing
        ({"intercept_s": 0.0, "per_decode_seq_s": 0.0, "per_decode_kv_token_s": 0.0}, "0 s"),
        ({**dict.fromkeys(KNOWN.__dataclass_fields__, 0.0), "source": "zero",
          "kv_bytes_per_token": 2, "max_model_len": 16, "held_out": None, "info": {},
          "num_fit_steps": 0, "num_outliers": 0}, "0 s"),
    ],
)
def test_a_cost_model_that_cannot_time_steps_is_refused(tmp_path, fields, named) -> None:
    """Negative, NaN, infinite or non-numeric costs and impossible model sizes would
    simulate negative or zero-length steps (or crash mid-run): refused when built and
    when loaded, with the field named."""
    with pytest.raises(ValueError, match=named):
        replace(KNOWN, **fields)
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({**KNOWN.to_json(), **fields}))
    with pytest.raises(ValueError, match=f"{path} is not a cost model.*{named}"):
        CostModel.load(path)


def test_prefill_and_decode_costs_without_intercept_are_enough() -> None:
    """A fit may drop the intercept: every step still takes time."""
    model = replace(KNOWN, intercept_s=0.0)
    assert model.step_time(StepFeatures(decode_seqs=1, decode_kv_tokens=10)) > 0
    assert model.step_time(StepFeatures(prefill_tokens=4, prefill_chunks=1)) > 0


def test_a_fit_that_would_time_steps_at_zero_is_refused(tmp_path, monkeypatch) -> None:
    """When the best non-negative fit (of a short, noisy trace) has no intercept and no
    decode cost, calibrating fails with a line saying so, instead of saving a model that
    simulates free decode steps."""
    _, records = _simulated_trace(tmp_path)
    no_intercept_no_decode = np.array([0.0, 3e-4, 2e-3, 0.0, 0.0, 6e-9])
    monkeypatch.setattr("inflight.planner.cost_model._robust_fit",
                        lambda x, y: (no_intercept_no_decode, 0))
    with pytest.raises(ValueError, match="times some steps at 0 s.*too short or too noisy"):
        fit_trace(records, source="noisy")


def test_a_poor_fit_is_flagged(tmp_path, capsys) -> None:
    """A calibration whose held-out steps miss by half (a busy machine) was saved and used
    by every later simulate without a word; now both say so. A good fit says nothing."""
    from inflight.entrypoints.cli import main
    from inflight.planner.cost_model import FitError

    good = replace(KNOWN, held_out=FitError(20, 1.0, 0.14, -0.04, 0.99))
    poor = replace(KNOWN, held_out=FitError(18, 574.0, 0.56, -0.69, 0.13))
    assert good.fit_warning() is None and KNOWN.fit_warning() is None
    warning = poor.fit_warning()
    assert warning is not None and "56% per step, -69% in total" in warning
    path = poor.save(tmp_path / "poor.json")
    assert main(["simulate", "--workload", "seed8", "--cost", str(path), "--no-plots",
                 "--output-dir", str(tmp_path / "sim")]) == 0
    assert warning in capsys.readouterr().err
