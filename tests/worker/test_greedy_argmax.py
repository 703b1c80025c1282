"""Greedy sampling's argmax kernel (csrc/greedy_argmax.cpp) against PyTorch's
``logits.max(dim=-1).indices``, the reference the sampler used before: the first index of
each row's maximum, ties and infinities included; rows holding a NaN are left to PyTorch
(-1 from the kernel) and the sampler's tokens for them are PyTorch's."""

from __future__ import annotations

import pytest
import torch

from inflight.kernels import cpu
from inflight.sampling_params import SamplingParams
from inflight.worker.sampler import Sampler

pytestmark = pytest.mark.skipif(not cpu.available(), reason="needs the C++ CPU kernels")

# Vocabulary sizes below, at and around the 16-lane vector width, and SmolLM2's.
SHAPES = [(1, 1), (3, 5), (2, 16), (4, 17), (5, 33), (57, 49152), (1, 49152)]


def reference(logits: torch.Tensor) -> torch.Tensor:
    return logits.max(dim=-1).indices


@pytest.mark.parametrize("shape", SHAPES)
def test_random_logits(shape: tuple[int, int]) -> None:
    logits = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    assert torch.equal(cpu.greedy_argmax(logits), reference(logits))


@pytest.mark.parametrize("shape", SHAPES)
def test_ties_take_the_first_index(shape: tuple[int, int]) -> None:
    # three distinct values: every row's maximum is repeated many times (for V > 3)
    logits = torch.randint(0, 3, shape, generator=torch.Generator().manual_seed(1)).float()
    assert torch.equal(cpu.greedy_argmax(logits), reference(logits))
    # a maximum tied between the last vector lane and the scalar tail
    if shape[1] >= 17:
        logits = torch.zeros(shape)
        logits[:, 15] = logits[:, shape[1] - 1] = 1.0
        assert cpu.greedy_argmax(logits).tolist() == [15] * shape[0]


def test_infinities() -> None:
    logits = torch.randn(4, 100)
    logits[0] = float("-inf")  # every token suppressed: index 0, as PyTorch
    logits[1, 70] = float("inf")
    logits[2, 3] = logits[2, 90] = float("inf")
    logits[3, :50] = float("-inf")
    assert torch.equal(cpu.greedy_argmax(logits), reference(logits))


def test_nan_rows_are_flagged_and_sampled_as_pytorch_does() -> None:
    logits = torch.randn(4, 40)
    logits[1, 7] = float("nan")  # in the vector part
    logits[2, 39] = float("nan")  # in the scalar tail
    assert cpu.greedy_argmax(logits).tolist()[1:3] == [-1, -1]
    tokens = Sampler(torch.device("cpu")).sample(
        logits, ["a", "b", "c", "d"], [SamplingParams(temperature=0.0)] * 4
    ).token_ids
    assert tokens == reference(logits).tolist()


def test_non_contiguous_rows() -> None:
    logits = torch.randn(8, 200)[::2, 10:150]
    assert torch.equal(cpu.greedy_argmax(logits), reference(logits))


def test_bad_input_is_refused() -> None:
    with pytest.raises(RuntimeError, match="float32"):
        cpu.greedy_argmax(torch.randn(2, 8).bfloat16())
    with pytest.raises(RuntimeError, match="V > 0"):
        cpu.greedy_argmax(torch.randn(2, 0))
