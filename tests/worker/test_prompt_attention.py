"""The fresh-prompt attention kernel (csrc/prompt_attention.cpp) against a float32 causal
reference. With bfloat16 inputs on a CPU with AVX512-BF16 it runs the kernel's own
bfloat16 dot products (with AMX: on tiles, unless ``allow_amx=False`` keeps it on the
AVX512-BF16 path); elsewhere PyTorch's SDPA. Each must meet the same contract."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from inflight.cpu_info import cpu_flags
from inflight.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason="the C++ kernels could not be built here"
)

LENGTHS = [1, 5, 15, 16, 17, 33, 100, 190]
# Both bfloat16 paths where the CPU has them; the AMX one skips elsewhere.
AMX = [
    pytest.param(False, id="dot"),
    pytest.param(True, id="amx", marks=pytest.mark.skipif(
        "amx_bf16" not in cpu_flags() or "amx_tile" not in cpu_flags(),
        reason="this CPU has no AMX")),
]


def make_inputs(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    """A step of several prompts with two padding tokens in front and one behind (rows no
    prompt owns), and v a strided view, as the model hands it over (a slice of qkv)."""
    torch.manual_seed(seed)
    total = sum(LENGTHS) + 3
    q = torch.randn(total, heads, head_dim).to(dtype)
    k = torch.randn(total, kv_heads, head_dim).to(dtype)
    v = torch.randn(total, 2 * kv_heads, head_dim).to(dtype)[:, 1::2]
    starts = torch.tensor([2 + sum(LENGTHS[:i]) for i in range(len(LENGTHS))])
    return q, k, v, starts, torch.tensor(LENGTHS)


def sdpa(q, k, v, start: int, length: int, scale: float, dtype: torch.dtype | None = None):
    """PyTorch's causal SDPA on one prompt's rows, in ``dtype`` (default: the inputs')."""

    def view(x):
        x = x[start : start + length] if dtype is None else x[start : start + length].to(dtype)
        return x.transpose(0, 1).unsqueeze(0)

    out = F.scaled_dot_product_attention(
        view(q), view(k), view(v), is_causal=True, scale=scale, enable_gqa=True
    )
    return out[0].transpose(0, 1)


def reference(q, k, v, start: int, length: int, scale: float) -> torch.Tensor:
    return sdpa(q, k, v, start, length, scale, torch.float32)


@pytest.mark.parametrize("amx", AMX)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 128), (2, 2, 32)])
def test_bfloat16_prompts_match_float32_attention(heads, kv_heads, head_dim, amx):
    q, k, v, starts, lengths = make_inputs(heads, kv_heads, head_dim, torch.bfloat16)
    sentinel = torch.full_like(q, 7.0)
    out = sentinel.clone()
    cpu_kernels.prompt_attention(q, k, v, starts, lengths, 0.125, out, allow_amx=amx)
    assert torch.equal(out[:2], sentinel[:2]) and torch.equal(out[-1], sentinel[-1])
    for start, length in zip(starts.tolist(), lengths.tolist(), strict=True):
        got = out[start : start + length].float()
        expected = reference(q, k, v, start, length, 0.125)
        # bfloat16 output (8 mantissa bits) and bfloat16 probabilities: a few units in the
        # last place of values of order 1; a wrong mask or scale errs by ~0.1-1.
        torch.testing.assert_close(got, expected, atol=3e-2, rtol=2e-2)
        assert (got - expected).abs().mean() < 4e-3
    # the first query of every prompt sees only its own key: its output is its value row
    first = out[starts]
    group = heads // kv_heads
    assert torch.equal(first, v[starts].repeat_interleave(group, dim=1))


@pytest.mark.parametrize("amx", AMX)
def test_bfloat16_kernel_errs_no_more_than_pytorch_sdpa_in_bfloat16(amx):
    """The kernel's error against float32 is no larger than PyTorch's own bfloat16 SDPA's
    (its probabilities keep ~16 bits, where SDPA rounds them to bfloat16)."""
    q, k, v, starts, lengths = make_inputs(9, 3, 64, torch.bfloat16, seed=1)
    out = torch.empty_like(q)
    cpu_kernels.prompt_attention(q, k, v, starts, lengths, 0.125, out, allow_amx=amx)
    ours = theirs = 0.0
    for start, length in zip(starts.tolist(), lengths.tolist(), strict=True):
        expected = reference(q, k, v, start, length, 0.125)
        pytorch = sdpa(q, k, v, start, length, 0.125)
        ours += (out[start : start + length].float() - expected).abs().sum().item()
        theirs += (pytorch.float() - expected).abs().sum().item()
    assert ours <= theirs  # bfloat16-rounded probabilities measured 1.2x theirs


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 128), (2, 2, 32), (3, 1, 48), (4, 4, 96)]
)
def test_float32_prompts_match_the_float64_attention(heads, kv_heads, head_dim):
    """float32 prompts (the kernel's own float32 path on CPUs with AVX-512, else SDPA):
    within float32 rounding of the float64 attention, rows no prompt owns untouched, and a
    prompt's first query (which sees only its own key) exactly its value row."""
    q, k, v, starts, lengths = make_inputs(heads, kv_heads, head_dim, torch.float32)
    sentinel = torch.full_like(q, 7.0)
    out = sentinel.clone()
    cpu_kernels.prompt_attention(q, k, v, starts, lengths, 0.125, out)
    assert torch.equal(out[:2], sentinel[:2]) and torch.equal(out[-1], sentinel[-1])
    for start, length in zip(starts.tolist(), lengths.tolist(), strict=True):
        expected = sdpa(q, k, v, start, length, 0.125, torch.float64)
        # a wrong mask or scale errs by ~0.1-1
        torch.testing.assert_close(
            out[start : start + length].double(), expected, atol=1e-5, rtol=1e-5
        )
    group = heads // kv_heads
    assert torch.equal(out[starts], v[starts].repeat_interleave(group, dim=1))


def test_the_float32_kernel_is_built_where_the_cpu_has_avx512():
    """Guards the build flags: with AVX-512, float32 prompts must not fall back to SDPA
    (whose sums are ordered differently: a long prompt's output differs in some bits)."""
    if "avx512f" not in cpu_flags() or os.environ.get("INFLIGHT_PROMPT_ATTENTION") == "sdpa":
        pytest.skip("float32 prompts take SDPA here")
    q, k, v, starts, lengths = make_inputs(9, 3, 64, torch.float32, seed=2)
    out = torch.empty_like(q)
    cpu_kernels.prompt_attention(q, k, v, starts, lengths, 0.125, out)
    start, length = starts[-1].item(), lengths[-1].item()
    assert not torch.equal(out[start : start + length], sdpa(q, k, v, start, length, 0.125))


def test_the_bfloat16_dot_product_path_is_built_where_the_cpu_has_it():
    """Guards the build flags: with AVX512-BF16, bfloat16 prompts must not fall back to
    SDPA (whose probabilities are not rounded the same way: a one-token prompt is exact on
    both, so compare a long prompt's output against the kernel's own float32 path)."""
    if "avx512_bf16" not in cpu_flags():
        pytest.skip("this CPU has no AVX512-BF16")
    q, k, v, starts, lengths = make_inputs(9, 3, 64, torch.bfloat16, seed=2)
    out = torch.empty_like(q)
    cpu_kernels.prompt_attention(q, k, v, starts, lengths, 0.125, out, allow_amx=False)
    start, length = starts[-1].item(), lengths[-1].item()
    assert not torch.equal(out[start : start + length], sdpa(q, k, v, start, length, 0.125))


def test_the_amx_path_is_taken_where_the_cpu_has_it():
    """Guards the build flags and the OS permission: with AMX (and INFLIGHT_AMX not 0),
    bfloat16 prompts run on tiles, whose probabilities are rounded otherwise than the
    AVX512-BF16 path's (their outputs differ in a few last places)."""
    if "amx_bf16" not in cpu_flags() or "amx_tile" not in cpu_flags():
        pytest.skip("this CPU has no AMX")
    if os.environ.get("INFLIGHT_AMX") == "0":
        pytest.skip("INFLIGHT_AMX=0 keeps the AVX512-BF16 path")
    assert cpu_kernels.prompt_attention_amx_available()
    q, k, v, starts, lengths = make_inputs(9, 3, 64, torch.bfloat16, seed=2)
    tiles, dots = torch.empty_like(q), torch.empty_like(q)
    cpu_kernels.prompt_attention(q, k, v, starts, lengths, 0.125, tiles)
    cpu_kernels.prompt_attention(q, k, v, starts, lengths, 0.125, dots, allow_amx=False)
    assert not torch.equal(tiles, dots)


def float64_reference(q, k, v, start: int, length: int, scale: float) -> torch.Tensor:
    """Causal attention of one prompt's rows in float64 (GQA: query head h reads KV head
    h // group)."""
    group = q.shape[1] // k.shape[1]
    rows = slice(start, start + length)
    qh = q[rows].double().transpose(0, 1)
    kh = k[rows].double().repeat_interleave(group, dim=1).transpose(0, 1)
    vh = v[rows].double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (qh @ kh.transpose(1, 2)) * scale
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    weights = scores.masked_fill(future, float("-inf")).softmax(-1)
    return (weights @ vh).transpose(0, 1)


EXACT_LENGTHS = [1, 15, 16, 17, 31, 33, 100, 257]


@pytest.mark.parametrize("amx", AMX)
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim",
    [(9, 3, 64), (4, 1, 64), (2, 2, 64), (6, 2, 128), (8, 2, 128), (4, 4, 128)],
)
def test_bfloat16_prompts_round_the_float64_attention(heads, kv_heads, head_dim, amx):
    """Every prompt length around the 16-query tiles and 16/32-key blocks, group sizes 1,
    3 and 4, D 64 and 128, all in one call: the output is float64 attention rounded to
    bfloat16, up to the kernel's own error (AVX512-BF16 path: float32 throughout; without
    AVX512-BF16 the prompts widen to the float32 kernel, rounded once; AMX: each
    probability in two bfloat16 parts, relative error ~2^-16). Measured here: 0.02% (dot)
    and 0.2% (AMX) of outputs one bfloat16 step off the rounded reference, where a mask one
    key off errs on 70-93%, a dropped key block on 36% and probabilities rounded to one
    bfloat16 part on 34%."""
    torch.manual_seed(3)
    total = sum(EXACT_LENGTHS) + 3
    q = torch.randn(total, heads, head_dim).to(torch.bfloat16)
    k = torch.randn(total, kv_heads, head_dim).to(torch.bfloat16)
    v = torch.randn(total, 2 * kv_heads, head_dim).to(torch.bfloat16)[:, 1::2]
    starts = torch.tensor([2 + sum(EXACT_LENGTHS[:i]) for i in range(len(EXACT_LENGTHS))])
    scale = head_dim**-0.5
    out = torch.full_like(q, 7.0)
    cpu_kernels.prompt_attention(
        q, k, v, starts, torch.tensor(EXACT_LENGTHS), scale, out, allow_amx=amx
    )
    assert (out[:2] == 7).all() and (out[-1] == 7).all()
    off = count = 0
    for start, length in zip(starts.tolist(), EXACT_LENGTHS, strict=True):
        expected = float64_reference(q, k, v, start, length, scale)
        got = out[start : start + length].double()
        # at most one bfloat16 step (2^-8 relative at worst) beyond the exact value
        torch.testing.assert_close(got, expected, rtol=2**-7, atol=2**-12)
        off += (got != expected.to(torch.bfloat16).double()).sum().item()
        count += got.numel()
    assert off / count < 0.01


@pytest.mark.parametrize("amx", AMX)
def test_sharp_softmaxes_keep_their_accuracy(amx):
    """Queries 30x larger: scores spread over hundreds, most numerators far below their
    row's largest (the AMX path clamps the exponent at 2^-100): still the rounded float64
    attention, and nothing overflows or turns NaN."""
    torch.manual_seed(4)
    lengths = [300, 77]
    q = (torch.randn(sum(lengths), 9, 64) * 30).to(torch.bfloat16)
    k = torch.randn(sum(lengths), 3, 64).to(torch.bfloat16)
    v = torch.randn(sum(lengths), 3, 64).to(torch.bfloat16)
    out = torch.empty_like(q)
    starts = torch.tensor([0, lengths[0]])
    cpu_kernels.prompt_attention(q, k, v, starts, torch.tensor(lengths), 0.125, out, allow_amx=amx)
    assert torch.isfinite(out).all()
    for start, length in zip(starts.tolist(), lengths, strict=True):
        expected = float64_reference(q, k, v, start, length, 0.125)
        got = out[start : start + length].double()
        torch.testing.assert_close(got, expected, rtol=2**-7, atol=2**-12)
        assert (got != expected.to(torch.bfloat16).double()).double().mean() < 0.01
