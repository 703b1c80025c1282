"""Wall time of each part of the model, by forward hooks: ``bench throughput --module-times``.

torch's profiler (``--profile``) records every op, which inflates the many small ones: on
``mixed`` it gave SiLU-mul 19.3 s where timing the same calls with ``perf_counter`` gave
3.0 s. This module times whole modules instead, with a clock read before and after each
forward (a few microseconds a call), and reports each module kind's *self* time: its
time minus that of the timed modules called inside it. So the linear layers are timed
alone, "attention" is what an ``Attention`` module does besides its two linears (RoPE,
the K/V write, the attention kernel), "MLP" is SiLU-mul, "decoder layer" the two
RMSNorms, and "model" what ``LlamaForCausalLM.forward`` does outside its layers (the
embedding, the final norm and the one-C++-call decode layers of small steps, which run
no module). For the linear layers the FLOPs (2 x rows x in x out) give the achieved
GFLOP/s.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from inflight.model.linear import Linear


@dataclass
class ModuleTime:
    """One module kind's totals over the timed run."""

    kind: str
    calls: int = 0
    self_s: float = 0.0  # its own time, excluding the timed modules it called
    flops: float = 0.0  # linear layers only

    @property
    def gflops(self) -> float:
        return self.flops / self.self_s / 1e9 if self.self_s > 0 and self.flops else 0.0


def _kind(name: str, module: nn.Module) -> str | None:
    """The report row of a module: linears by their attribute name, the rest by class."""
    from inflight.model import llama

    if isinstance(module, llama.Linear):
        return "linear " + name.rsplit(".", 1)[-1]
    kinds = {
        llama.Attention: "attention (RoPE, K/V write, kernel)",
        llama.MLP: "MLP (SiLU-mul)",
        llama.DecoderLayer: "decoder layer (RMSNorms)",
        llama.LlamaForCausalLM: "model (embedding, final norm, fused decode layers)",
    }
    return kinds.get(type(module))


class ModuleTimes:
    """Self time per module kind of ``model`` while :meth:`recording`; see the module
    docstring. Hooks run on the thread that runs the model (one at a time)."""

    def __init__(self, model: nn.Module) -> None:
        self.rows: dict[str, ModuleTime] = {}
        self._stack: list[list[float]] = []  # [start, time of timed children] per open call
        self._modules = [
            (kind, module)
            for name, module in model.named_modules()
            if (kind := _kind(name, module)) is not None
        ]

    @contextmanager
    def recording(self) -> Iterator[ModuleTimes]:
        handles = []
        wrapped = []
        for kind, module in self._modules:
            row = self.rows.setdefault(kind, ModuleTime(kind))
            handles.append(module.register_forward_pre_hook(self._enter))
            handles.append(module.register_forward_hook(self._exit_hook(row)))
            if isinstance(module, Linear):
                # the output layer's fused greedy argmax is a call of its own, not forward
                timed = self._timed_greedy(module, row)
                module.greedy_argmax = timed  # type: ignore[method-assign]
                wrapped.append(module)
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
            for module in wrapped:
                del module.greedy_argmax

    def _timed_greedy(self, module: Linear, row: ModuleTime) -> Any:
        original = module.greedy_argmax  # the bound method, before the instance's wrapper
        exit_ = self._exit_hook(row)

        def timed(x: torch.Tensor) -> torch.Tensor | None:
            self._enter(module, (x,))
            tokens = original(x)
            if tokens is None:  # another kernel takes the step, timed through forward
                self._stack.pop()
                return None
            exit_(module, (x,), tokens)
            return tokens

        return timed

    def _enter(self, module: nn.Module, args: Any) -> None:
        self._stack.append([time.perf_counter(), 0.0])

    def _exit_hook(self, row: ModuleTime) -> Any:
        def exit_(module: nn.Module, args: Any, output: Any) -> None:
            start, children = self._stack.pop()
            elapsed = time.perf_counter() - start
            row.calls += 1
            row.self_s += elapsed - children
            if self._stack:
                self._stack[-1][1] += elapsed
            weight = getattr(module, "weight", None)
            if row.kind.startswith("linear") and weight is not None and args:
                rows = args[0].shape[0]
                row.flops += 2.0 * rows * weight.shape[0] * weight.shape[1]

        return exit_

    def total_s(self) -> float:
        return sum(r.self_s for r in self.rows.values())

    def to_json(self) -> list[dict[str, Any]]:
        return [
            {"kind": r.kind, "calls": r.calls, "self_s": r.self_s, "gflops": r.gflops}
            for r in self.rows.values()
        ]

    def format(self, wall_s: float) -> str:
        """The table, largest first, with each row's share of ``wall_s``."""
        lines = [
            f"{'module (self time)':52s} {'calls':>7s} {'time':>9s} {'share':>6s} {'GFLOP/s':>8s}"
        ]
        for r in sorted(self.rows.values(), key=lambda r: -r.self_s):
            rate = f"{r.gflops:8.0f}" if r.gflops else f"{'':8s}"
            lines.append(
                f"{r.kind:52s} {r.calls:7d} {r.self_s:8.2f}s {100 * r.self_s / wall_s:5.1f}% {rate}"
            )
        rest = wall_s - self.total_s()
        lines.append(
            f"{'outside the model (inputs, sampling, scheduler)':52s} {'':7s} {rest:8.2f}s "
            f"{100 * rest / wall_s:5.1f}%"
        )
        return "\n".join(lines)
