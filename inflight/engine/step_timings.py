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

    @property
    def host_overhead_s(self) -> float:
        """Time outside the model's forward pass and sampling."""
        return self.schedule_s + self.prepare_inputs_s + self.update_s + self.outputs_s

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "host_overhead_s": self.host_overhead_s}
