"""Dynamic W8A8 int8 linear layers with SmoothQuant smoothing (``quantization="w8a8"``).

Every decoder layer's linear (qkv, o, gate_up, down; not the output layer) keeps an int8
copy of its weight, one scale per output channel, and steps that do not read GGUF blocks
multiply in int8 with activations quantised per token at run time
(``csrc/int8_linear.cpp``). On a CPU without AMX int8 dot products run about 4x the
float32 FMA rate, so large steps take about half the time; the cost is precision.

Activations of a transformer have a few outlier columns (the same features in every
token), and one scale per token spends the int8 range on them. SmoothQuant (Xiao et al.
2023, arXiv:2211.10438, section 4) moves that range into the weights: column j of the input
is divided by ``s_j = max|X_j| ** alpha / max|W_:,j| ** (1 - alpha)`` and column j of the
weight multiplied by it, which leaves the product unchanged in exact arithmetic. ``max|X_j|``
comes from a calibration pass at start-up: the engine runs :data:`CALIBRATION_TEXTS` (about
160 tokens, cut to the context length, a fraction of a second) through the dense model
and records the largest input per column of each linear (:class:`ActivationRanges`). The
factors are rounded to powers of two, so the same checkpoint gets the same factors
whatever the engine's options. Afterwards each quantised linear's ``weight`` keeps only its
shape and dtype (a zero expanded to it): the int8 copy is the weight.

Measured on SmolLM2-135M-Instruct (README, "W8A8"): with smoothing at alpha 0.5 the top-1
token under teacher forcing matched float32's on 93.6-94.4% of positions (without
smoothing 89.9%; bfloat16 weights 99.7%), the mean negative log-likelihood of float32's
greedy tokens 0.724-0.727 against 0.709.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from inflight.model.llama import LlamaForCausalLM

# SmoothQuant's migration strength: 0.5 splits the range evenly between activations and
# weights (the paper's default; 0.3 and 0.65 measured worse on SmolLM2-135M).
SMOOTHING_ALPHA = 0.5

# Calibration prompts: prose, code, numbers and a chat turn, so that the outlier columns
# of each kind of input are seen. Only their range per column is kept.
CALIBRATION_TEXTS = (
    "The history of the Roman Empire spans more than a thousand years, from the founding "
    "of the city to the fall of Constantinople in 1453.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n\nprint([fibonacci(i) for i in range(10)])\n",
    "Dear team, thank you all for your hard work this quarter. Our sales grew by 12% and "
    "customer satisfaction improved from 4.1 to 4.6 out of 5.",
    "<|im_start|>user\nWhat is the boiling point of water at sea level?<|im_end|>\n"
    "<|im_start|>assistant\nWater boils at 100 degrees Celsius (212 F) at sea level.",
)


def check_supported(device: torch.device) -> None:
    """Raise ValueError unless the int8 kernel can run here (a CPU with the C++ kernels)."""
    from inflight.kernels import cpu

    if device.type != "cpu":
        raise ValueError(
            f"quantization='w8a8' runs on the CPU only (the device is {device.type}); use "
            "the default quantization here"
        )
    if not cpu.available():
        raise ValueError(
            "quantization='w8a8' needs the C++ CPU kernels, which are off "
            "(INFLIGHT_ATTENTION_BACKEND=torch) or failed to build (see the warning above)"
        )


class ActivationRanges:
    """Largest |input| per column of each decoder-layer linear, over every forward pass
    while open (forward pre-hooks). Use as a context manager; ``maxima[name]`` is a float32
    ``[in_features]`` tensor for each linear that ran."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        from inflight.model.linear import Linear

        self.maxima: dict[str, torch.Tensor] = {}
        self._hooks = [
            module.register_forward_pre_hook(self._hook(name))
            for name, module in model.layers.named_modules()
            if isinstance(module, Linear)
        ]

    def _hook(self, name: str):  # type: ignore[no-untyped-def]
        def record(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            seen = args[0].detach().abs().float().amax(dim=0)
            known = self.maxima.get(name)
            self.maxima[name] = seen if known is None else torch.maximum(known, seen)

        return record

    def __enter__(self) -> ActivationRanges:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


@contextmanager
def dense_only(model: LlamaForCausalLM) -> Iterator[None]:
    """While open, every step of ``model`` runs its dense weights, none the GGUF blocks:
    calibration then sees the same activations whatever sizes the engine's options give
    its steps (a short prompt chunk would otherwise read the blocks, whose weights differ
    from bfloat16-rounded dense ones)."""
    from inflight.model.linear import Linear

    linears = [m for m in model.modules() if isinstance(m, Linear)]
    saved = model.block_max_rows, [m.block_max_rows for m in linears]
    model.block_max_rows = 0
    for linear in linears:
        linear.block_max_rows = 0
    try:
        yield
    finally:
        model.block_max_rows = saved[0]
        for linear, rows in zip(linears, saved[1], strict=True):
            linear.block_max_rows = rows


def smoothing_factors(
    activation_max: torch.Tensor, weight: torch.Tensor, alpha: float = SMOOTHING_ALPHA
) -> torch.Tensor:
    """SmoothQuant's ``s [in]`` for a linear with ``weight [out, in]``:
    ``max|X_j| ** alpha / max_i |W_ij| ** (1 - alpha)``, clamped to at least 1e-5 (as
    the paper's code does) so that no column is divided by zero, then rounded to the
    nearest power of two."""
    weight_max = weight.detach().abs().float().amax(dim=0).clamp(min=1e-5)
    act_max = activation_max.float().clamp(min=1e-5)
    factors = (act_max.pow(alpha) / weight_max.pow(1.0 - alpha)).clamp(min=1e-5)
    # Rounded to a power of two: multiplying the weight and dividing the activations by
    # it is then exact, and the factors do not move with the calibration pass's rounding
    # (its step sizes follow the engine's options; exact factors differed by ~1e-5 between
    # options and flipped int8 roundings).
    return torch.exp2(torch.round(torch.log2(factors)))


def quantize_linears(
    model: LlamaForCausalLM, activation_maxima: dict[str, torch.Tensor],
    alpha: float = SMOOTHING_ALPHA,
) -> int:
    """Give every decoder-layer linear its smoothed int8 weight; a linear without a
    calibration range is quantised unsmoothed. Returns how many were quantised."""
    from inflight.model.linear import Linear

    count = 0
    for name, module in model.layers.named_modules():
        if isinstance(module, Linear):
            act_max = activation_maxima.get(name)
            smooth = None if act_max is None else smoothing_factors(act_max, module.weight, alpha)
            module.use_int8(smooth)
            count += 1
    model.use_fused_decode()  # without the blocks' AMX tiles the int8 layers now take
    return count
