"""The step cost model: how long one engine step takes, from what the step computes.

A step's wall time is modelled as a linear function of its shape::

    time = intercept
         + per_prefill_token   * prefill tokens          (MLP and projections, per token)
         + per_prefill_chunk   * prompt chunks           (per-sequence prefill overhead)
         + per_decode_seq      * decode sequences        (per-sequence decode overhead)
         + per_decode_kv_token * KV tokens decodes read  (decode attention, memory-bound)
         + per_prefill_kv_pair * query-key pairs of the prompt chunks (prefill attention)

A prompt chunk of ``n`` tokens starting at position ``s`` attends ``n*s + n(n+1)/2``
query-key pairs; a decode at position ``s`` reads ``s + 1`` KV tokens.

This module owns the features (:class:`StepFeatures`, from a ``SchedulerOutput`` or from
step-trace entries), the fit (least squares with non-negative coefficients, numpy only,
scored on held-out steps), and the JSON file a fit is saved in. It imports neither torch
nor the engine.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from inflight.core.interface import SchedulerOutput
from inflight.cpu_info import cpu_model_name
from inflight.engine.step_trace import StepRecord

FORMAT = "inflight-step-cost/1"
FEATURES = (
    "prefill_tokens",
    "prefill_chunks",
    "decode_seqs",
    "decode_kv_tokens",
    "prefill_kv_pairs",
)
# Every 5th step is held out of the fit and scores it.
HOLD_OUT_EVERY = 5
# A fit whose held-out steps miss by more than this (mean per step, or in total) is
# flagged: a quiet machine gives about 14% and -4% (README), a busy one 40-70%.
POOR_FIT_STEP_ERROR = 0.30
POOR_FIT_TOTAL_ERROR = 0.20
# SmolLM2-135M-Instruct's KV bytes per token in bfloat16: K and V x 30 layers x 3 KV heads
# x 64 dims x 2 bytes. The simulator sizes the default KV cache with it, as the engine does.
SMOLLM2_KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2
SMOLLM2_MAX_MODEL_LEN = 8192


@dataclass(frozen=True, slots=True)
class EntryShape:
    """One request's share of a step: ``num_tokens`` tokens from position ``start``."""

    num_tokens: int
    start: int
    is_prefill: bool


@dataclass(frozen=True, slots=True)
class StepFeatures:
    prefill_tokens: int = 0
    prefill_chunks: int = 0
    decode_seqs: int = 0
    decode_kv_tokens: int = 0
    prefill_kv_pairs: int = 0

    @classmethod
    def of(cls, entries: Sequence[EntryShape]) -> StepFeatures:
        prefill = [e for e in entries if e.is_prefill]
        decode = [e for e in entries if not e.is_prefill]
        return cls(
            prefill_tokens=sum(e.num_tokens for e in prefill),
            prefill_chunks=len(prefill),
            decode_seqs=len(decode),
            decode_kv_tokens=sum(e.start + e.num_tokens for e in decode),
            prefill_kv_pairs=sum(
                e.num_tokens * e.start + e.num_tokens * (e.num_tokens + 1) // 2 for e in prefill
            ),
        )

    @classmethod
    def of_scheduler_output(cls, output: SchedulerOutput) -> StepFeatures:
        return cls.of(
            [EntryShape(s.num_tokens, s.start_position, s.is_prefill) for s in output.scheduled]
        )

    def vector(self) -> list[float]:
        return [1.0, *(float(getattr(self, name)) for name in FEATURES)]


@dataclass(frozen=True, slots=True)
class FitError:
    """How well a fit predicts steps it was not fitted on."""

    num_steps: int
    mean_abs_error_ms: float
    mean_abs_pct_error: float  # mean of |predicted - measured| / measured
    total_time_error: float  # (sum predicted - sum measured) / sum measured
    r2: float


@dataclass(frozen=True, slots=True)
class CostModel:
    """Step time in seconds = intercept_s + sum(coefficient * feature)."""

    intercept_s: float
    per_prefill_token_s: float = 0.0
    per_prefill_chunk_s: float = 0.0
    per_decode_seq_s: float = 0.0
    per_decode_kv_token_s: float = 0.0
    per_prefill_kv_pair_s: float = 0.0
    # KV bytes per token of the calibrated model and its context length: the simulator
    # sizes the default KV cache and max_model_len from them, as the engine does.
    kv_bytes_per_token: int = SMOLLM2_KV_BYTES_PER_TOKEN
    max_model_len: int = SMOLLM2_MAX_MODEL_LEN
    source: str = "built-in"
    held_out: FitError | None = None
    num_fit_steps: int = 0
    # Training steps left out as slowed down by something else (see ``_robust_fit``).
    num_outliers: int = 0
    info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_cost_model(self)

    @property
    def coefficients(self) -> list[float]:
        return [
            self.intercept_s,
            self.per_prefill_token_s,
            self.per_prefill_chunk_s,
            self.per_decode_seq_s,
            self.per_decode_kv_token_s,
            self.per_prefill_kv_pair_s,
        ]

    def step_time(self, features: StepFeatures) -> float:
        # plain Python: called once per simulated step, where numpy's overhead dominates
        return sum(c * x for c, x in zip(self.coefficients, features.vector(), strict=True))

    # ------------------------------------------------------------------ file format

    def to_json(self) -> dict:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_json(cls, row: dict) -> CostModel:
        if row.get("format") != FORMAT:
            raise ValueError(f"not a step cost file (format {row.get('format')!r}, want {FORMAT!r})")
        fields = {k: v for k, v in row.items() if k != "format"}
        if fields.get("held_out") is not None:
            fields["held_out"] = FitError(**fields["held_out"])
        return cls(**fields)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """A saved fit; ``ValueError`` naming ``path`` when it is not one."""
        try:
            row = json.loads(Path(path).read_text(encoding="utf-8"))
            if not isinstance(row, dict):
                raise ValueError("it holds no JSON object")
            return cls.from_json(row)
        except (ValueError, TypeError) as error:  # JSON, UTF-8 and field errors
            raise ValueError(
                f"{path} is not a cost model from 'inflight calibrate': {error}"
            ) from None

    def fit_warning(self) -> str | None:
        """A line when the held-out steps say the fit predicts poorly (typically: it was
        timed on a busy machine), else None."""
        e = self.held_out
        if e is None or (e.mean_abs_pct_error <= POOR_FIT_STEP_ERROR
                         and abs(e.total_time_error) <= POOR_FIT_TOTAL_ERROR):
            return None
        return (
            f"warning: this fit predicts its held-out steps poorly (mean error "
            f"{e.mean_abs_pct_error:.0%} per step, {e.total_time_error:+.0%} in total): the "
            "machine was probably busy; calibrate again on a quiet one, or check the "
            "predictions with 'inflight simulate --validate'"
        )

    def describe(self) -> str:
        lines = [
            f"step cost model ({self.source}):",
            f"  intercept               {self.intercept_s * 1e3:9.3f} ms",
            f"  per prefill token       {self.per_prefill_token_s * 1e6:9.3f} us",
            f"  per prompt chunk        {self.per_prefill_chunk_s * 1e3:9.3f} ms",
            f"  per decode sequence     {self.per_decode_seq_s * 1e3:9.3f} ms",
            f"  per KV token (decode)   {self.per_decode_kv_token_s * 1e9:9.3f} ns",
            f"  per query-key pair      {self.per_prefill_kv_pair_s * 1e9:9.3f} ns (prefill)",
        ]
        if self.held_out is not None:
            e = self.held_out
            lines.append(
                f"  held-out steps: {e.num_steps}, mean abs error {e.mean_abs_error_ms:.2f} ms "
                f"({e.mean_abs_pct_error:.1%}), total time error {e.total_time_error:+.1%}, "
                f"R2 {e.r2:.3f}"
            )
        if self.num_outliers:
            lines.append(f"  {self.num_outliers} slowed-down training steps left out of the fit")
        return "\n".join(lines)


COEFFICIENT_NAMES = (
    "intercept_s", "per_prefill_token_s", "per_prefill_chunk_s", "per_decode_seq_s",
    "per_decode_kv_token_s", "per_prefill_kv_pair_s",
)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def times_every_step(coefficients: Sequence[float]) -> bool:
    """Whether every step takes time: a step has at least one prefill or decode entry, so
    it needs an intercept, or else a cost for prefill entries and one for decodes."""
    a, b, c, d, e, f = coefficients
    return bool(a or ((b or c or f) and (d or e)))


def check_cost_model(model: CostModel) -> None:
    """ValueError naming the field unless ``model`` can time steps: every coefficient a
    finite number >= 0, and every step (at least one prefill or decode entry) taking
    time; the model's KV bytes per token >= 1 and context length >= 2 (whole numbers)."""
    for name in COEFFICIENT_NAMES:
        value = getattr(model, name)
        if not _is_number(value) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    for name, low in (("kv_bytes_per_token", 1), ("max_model_len", 2)):
        value = getattr(model, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be a whole number >= {low}, got {value!r}")
    if not times_every_step(model.coefficients):
        raise ValueError(
            "the cost model would time some steps at 0 s: it needs a positive intercept_s, "
            "or a positive prefill cost and a positive decode cost"
        )
    if not isinstance(model.source, str):
        raise ValueError(f"source must be a string, got {model.source!r}")


# Used when no calibration exists on a machine. Not a step-level calibration: fitted by
# hand, through the simulator, to the README's quiet-machine measurements of whole runs of
# SmolLM2-135M-Instruct in bfloat16 on the project's 2-core Xeon VM (mixed with 256 slots
# and 4096 batched tokens 60.8-64.6 s, simulated 61.7 s; seed8 8.4 s, simulated 7.8 s; one
# stream 70.0 tokens/s, simulated 69.8).
BUILTIN = CostModel(
    intercept_s=0.0135,
    per_prefill_token_s=0.0006,
    per_decode_seq_s=0.0004,
    per_decode_kv_token_s=5e-7,
    source="built-in (SmolLM2-135M-Instruct, bfloat16, fitted to whole runs on a 2-core "
    "Xeon VM; run 'inflight calibrate' for this machine)",
)


def default_calibration_path() -> Path:
    """Where ``inflight calibrate`` saves, and ``inflight simulate`` looks by default."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "inflight" / "calibration.json"


def load_cost_model(path: str | Path | None) -> CostModel:
    """``path`` if given; else this machine's last calibration; else :data:`BUILTIN`."""
    if path is not None:
        return CostModel.load(path)
    default = default_calibration_path()
    if default.is_file():
        return CostModel.load(default)
    return BUILTIN


# ---------------------------------------------------------------------- fitting


def features_from_trace(records: Sequence[StepRecord]) -> list[StepFeatures]:
    """Each step's features, deriving start positions from the trace's history.

    The trace gives each entry's token count, kind and prefix-cache hit, not its position;
    reading in order, a request's position is the tokens computed for it so far. A request
    that is not running (new, or preempted and back) starts at its prefix-cache hit.
    """
    computed: dict[str, int] = {}
    features = []
    for record in records:
        for request_id in record.preempted:
            computed.pop(request_id, None)  # recomputed from scratch when readmitted
        shapes = []
        for e in record.entries:
            start = computed.get(e.request_id, e.num_cached_tokens)
            shapes.append(EntryShape(e.num_tokens, start, e.kind != "decode"))
            computed[e.request_id] = start + e.num_tokens
        for request_id in record.finished:
            computed.pop(request_id, None)
        features.append(StepFeatures.of(shapes))
    return features


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (a negative cost is unphysical): drop the
    most negative term and refit until none is negative."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    # Columns scaled to unit norm: features span ten orders of magnitude.
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    while active:
        solution = np.linalg.lstsq(x[:, active] / scale[active], y, rcond=None)[0]
        solution = solution / scale[active]
        if (solution >= 0).all():
            coef[:] = 0
            coef[active] = solution
            return coef
        del active[int(np.argmin(solution))]
    return coef


def _robust_fit(x: np.ndarray, y: np.ndarray, rounds: int = 4) -> tuple[np.ndarray, int]:
    """Fit relative errors (steps span milliseconds to seconds, and a serving run is
    mostly short decode steps), then leave out steps far *slower* than the fit says and
    refit. On a shared machine other processes only ever add time, and a few steps
    slowed tenfold would otherwise drag every coefficient; the held-out score still
    counts every held-out step."""
    y = np.maximum(y, 1e-6)
    keep = np.ones(len(y), dtype=bool)
    coef = np.zeros(x.shape[1])
    for _ in range(rounds):
        weight = 1.0 / y[keep]
        coef = _nonnegative_lstsq(x[keep] * weight[:, None], y[keep] * weight)
        log_ratio = np.log(y / np.maximum(x @ coef, 1e-9))
        centre = float(np.median(log_ratio[keep]))
        spread = 1.4826 * float(np.median(np.abs(log_ratio[keep] - centre)))
        new_keep = log_ratio <= centre + 3 * max(spread, 0.05)
        if (new_keep == keep).all() or new_keep.sum() < x.shape[1] + 2:
            break
        keep = new_keep
    return coef, int((~keep).sum())


def score(model: CostModel, features: Sequence[StepFeatures], durations: Sequence[float]) -> FitError:
    predicted = np.array([model.step_time(f) for f in features])
    measured = np.asarray(durations, dtype=float)
    residual = predicted - measured
    spread = float(((measured - measured.mean()) ** 2).sum())
    return FitError(
        num_steps=len(measured),
        mean_abs_error_ms=float(np.abs(residual).mean() * 1e3),
        mean_abs_pct_error=float((np.abs(residual) / np.maximum(measured, 1e-9)).mean()),
        total_time_error=float(residual.sum() / max(measured.sum(), 1e-12)),
        r2=1.0 - float((residual**2).sum()) / spread if spread > 0 else 0.0,
    )


def fit(
    features: Sequence[StepFeatures],
    durations: Sequence[float],
    *,
    source: str,
    kv_bytes_per_token: int = SMOLLM2_KV_BYTES_PER_TOKEN,
    max_model_len: int = SMOLLM2_MAX_MODEL_LEN,
    info: dict | None = None,
) -> CostModel:
    """Fit on all steps but every ``HOLD_OUT_EVERY``-th, and score on those."""
    if len(features) != len(durations):
        raise ValueError("one duration per step is needed")
    if len(features) < 2 * HOLD_OUT_EVERY:
        raise ValueError(f"need at least {2 * HOLD_OUT_EVERY} steps to fit, got {len(features)}")
    held = [i % HOLD_OUT_EVERY == HOLD_OUT_EVERY - 1 for i in range(len(features))]
    x = np.array([f.vector() for f in features])
    y = np.asarray(durations, dtype=float)
    train = ~np.array(held)
    coef, num_outliers = _robust_fit(x[train], y[train])
    a, b, c, d, e, f = (float(v) for v in coef)
    if not times_every_step([a, b, c, d, e, f]):
        raise ValueError(
            f"the fit of {int(train.sum())} steps times some steps at 0 s (no intercept, and "
            "no cost for prefill or for decode steps): the trace is too short or too noisy; "
            "fit a longer trace, or calibrate on a quieter machine"
        )
    model = CostModel(
        a, b, c, d, e, f,
        kv_bytes_per_token=kv_bytes_per_token,
        max_model_len=max_model_len,
        source=source,
        num_fit_steps=int(train.sum()) - num_outliers,
        num_outliers=num_outliers,
        info={"created": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": cpu_model_name(),
              **(info or {})},
    )
    test = [i for i, h in enumerate(held) if h]
    error = score(model, [features[i] for i in test], [durations[i] for i in test])
    return dataclasses.replace(model, held_out=error)


def fit_trace(records: Sequence[StepRecord], *, source: str, skip_steps: int = 0,
              **kwargs: object) -> CostModel:
    """Fit a step trace (``LLM(record_trace=True)``, ``inflight generate --trace``, bench)."""
    if not records:
        raise ValueError("the trace holds no steps")
    features = features_from_trace(records)[skip_steps:]
    durations = [r.duration_s for r in records][skip_steps:]
    return fit(features, durations, source=source, **kwargs)  # type: ignore[arg-type]
