"""Where a step's wall time goes, accumulated over the engine's life.

The host-side phases (scheduling, input preparation, scheduler update, detokenisation
and outputs) are the per-step CPU overhead outside the model; benchmarks report them
beside the model's forward pass and sampling. On CUDA the forward phase only measures
kernel launch unless something synchronises; on the CPU every phase is exact.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass


@dataclass
class StepTimings:
    num_steps: int = 0
    schedule_s: float = 0.0
    prepare_inputs_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    update_s: float = 0.0
    outputs_s: float = 0.0

    @contextmanager
    def measure(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, phase, getattr(self, phase) + time.perf_counter() - started)

    def reset(self) -> None:
        """Start counting afresh (in place: the model runner shares this object)."""
        for name, value in asdict(StepTimings()).items():
            setattr(self, name, value)

    def per_step_ms(self) -> dict[str, float]:
        steps = max(self.num_steps, 1)
        return {
            name: 1000 * value / steps
            for name, value in self.to_dict().items()
            if name != "num_steps"
        }

    @property
    def host_overhead_s(self) -> float:
        """Time outside the model's forward pass and sampling."""
        return self.schedule_s + self.prepare_inputs_s + self.update_s + self.outputs_s

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "host_overhead_s": self.host_overhead_s}
