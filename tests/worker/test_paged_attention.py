"""Paged attention backends against a dense causal reference, on mixed varlen batches."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from inflight.attention.torch_paged import paged_attention, quantize_kv, write_kv
from inflight.core.interface import ScheduledRequest, SchedulerOutput
from inflight.cpu_info import cpu_flags
from inflight.kernels import cpu as cpu_kernels
from inflight.sampling_params import SamplingParams
from inflight.worker.input_batch import build_model_inputs
from inflight.worker.kv_cache import key_token_view, scale_token_view

# head_dim 64 takes the vectorised value path; the tiny parity model (16) the generic one
HEADS, KV_HEADS, HEAD_DIM, NUM_BLOCKS = 6, 2, 64, 64


def dense_reference(q_all, k_all, v_all, context_len, scale):
    """Causal attention for one sequence's last q_len tokens over its whole context."""
    q_len = q_all.shape[0]
    q = q_all.transpose(0, 1)  # [H, q_len, D]
    k = k_all[:context_len].transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, dim=0)
    v = v_all[:context_len].transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, dim=0)
    positions = torch.arange(context_len - q_len, context_len)
    mask = torch.arange(context_len)[None, :] <= positions[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(0, 1)


def make_step(
    seed: int, kv_dtype: torch.dtype, block_size: int,
    shapes: list[tuple[int, int]] | None = None,
):
    """A random mixed step: (cached prefix, new chunk) per sequence, blocks shuffled."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    # decode tokens, a fresh prompt (nothing cached) and two continued prompt chunks
    shapes = shapes or [(rng.randrange(0, 40), 1) for _ in range(4)] + [
        (0, rng.randrange(2, 37))
    ] + [(rng.randrange(1, 30), rng.randrange(2, 37)) for _ in range(2)]
    rng.shuffle(shapes)
    free_blocks = list(range(NUM_BLOCKS))
    rng.shuffle(free_blocks)
    k_cache = torch.zeros(NUM_BLOCKS, KV_HEADS, HEAD_DIM, block_size, dtype=kv_dtype)
    v_cache = torch.zeros(NUM_BLOCKS, block_size, KV_HEADS, HEAD_DIM, dtype=kv_dtype)
    scales = None
    if kv_dtype == torch.int8:
        scales = (torch.zeros(NUM_BLOCKS, KV_HEADS, block_size),
                  torch.zeros(NUM_BLOCKS, KV_HEADS, block_size))
    keys = key_token_view(k_cache)
    scheduled, per_seq = [], []
    params = SamplingParams()
    for i, (cached, new) in enumerate(shapes):
        total = cached + new
        blocks = [free_blocks.pop() for _ in range(-(-total // block_size))]
        k_all = torch.randn(total, KV_HEADS, HEAD_DIM)
        v_all = torch.randn(total, KV_HEADS, HEAD_DIM)
        for pos in range(cached):  # the prefix is already in the cache
            where = (blocks[pos // block_size], pos % block_size)
            if scales is None:
                keys[where] = k_all[pos]
                v_cache[where] = v_all[pos]
                continue
            (k8, k_scale), (v8, v_scale) = quantize_kv(k_all[pos]), quantize_kv(v_all[pos])
            keys[where], v_cache[where] = k8, v8
            scale_token_view(scales[0])[where] = k_scale
            scale_token_view(scales[1])[where] = v_scale
        scheduled.append(ScheduledRequest(
            request_id=str(i), token_ids=[0] * new, start_position=cached, block_ids=blocks,
            sample=True, is_prefill=new > 1, sampling_params=params, slot=i,
        ))
        per_seq.append((k_all, v_all, total, new))
    q = torch.randn(sum(n for _, n in shapes), HEADS, HEAD_DIM)
    k_new = torch.cat([k[-n:] for k, _, _, n in per_seq])
    v_new = torch.cat([v[-n:] for _, v, _, n in per_seq])
    return (SchedulerOutput(step_id=0, scheduled=scheduled), q, k_new, v_new, k_cache, v_cache,
            scales, per_seq)


def as_stored(x: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
    """What a cache of kv_dtype gives back for x, in float32."""
    if kv_dtype == torch.int8:
        quantized, scale = quantize_kv(x)
        return quantized.float() * scale[..., None]
    return x.to(kv_dtype).float()


BACKENDS = {
    "torch": dict(varlen_decode=False, varlen_prefill=False),
    "cpp-decode": dict(varlen_decode=True, varlen_prefill=False),
    "cpp-all": dict(varlen_decode=True, varlen_prefill=True),
}


# 64: the kernel scores a block of 16 * m keys as m tiles of 16
@pytest.mark.parametrize("block_size", [4, 16, 64])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("seed", range(4))
def test_paged_attention_matches_dense(backend, kv_dtype, block_size, seed):
    if backend != "torch" and not cpu_kernels.available():
        pytest.skip("the C++ kernel could not be built here")
    step, q, k_new, v_new, k_cache, v_cache, scales, per_seq = make_step(
        seed, kv_dtype, block_size
    )
    k_scale, v_scale = scales if scales is not None else (None, None)
    inputs = build_model_inputs(step, block_size, torch.device("cpu"), **BACKENDS[backend])
    scale = HEAD_DIM**-0.5
    write_kv(k_cache, v_cache, k_new, v_new, inputs.attention, k_scale, v_scale)
    out = paged_attention(
        q, k_new, v_new, k_cache, v_cache, inputs.attention, scale, k_scale, v_scale
    )

    # int8: the torch backend attends a fresh prompt's own K/V before quantisation, the
    # kernel reads them back from the cache, so both are within int8's rounding.
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.int8: 3e-2}[kv_dtype]
    offset = 0
    for k_all, v_all, total, new in per_seq:
        # the reference sees the same (possibly rounded) K/V the cache holds
        k_ref = as_stored(k_all, kv_dtype)
        v_ref = as_stored(v_all, kv_dtype)
        expected = dense_reference(q[offset : offset + new], k_ref, v_ref, total, scale)
        torch.testing.assert_close(out[offset : offset + new], expected, atol=tolerance, rtol=tolerance)
        offset += new


@pytest.fixture
def kernel_on_two_threads(two_threads):
    """The C++ kernel on 2 threads (a lone sequence is then split between them)."""
    if not cpu_kernels.available():
        pytest.skip("the C++ kernel could not be built here")


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_lone_decode_token_split_over_threads(kv_dtype, kernel_on_two_threads):
    """One sequence decoding alone (fewer sequences than threads): the kernel splits the
    token's KV heads between threads; the result must not change."""
    step, q, k_new, v_new, k_cache, v_cache, scales, per_seq = make_step(
        7, kv_dtype, 16, shapes=[(70, 1)]
    )
    k_scale, v_scale = scales if scales is not None else (None, None)
    inputs = build_model_inputs(step, 16, torch.device("cpu"), **BACKENDS["cpp-decode"])
    write_kv(k_cache, v_cache, k_new, v_new, inputs.attention, k_scale, v_scale)
    out = paged_attention(
        q, k_new, v_new, k_cache, v_cache, inputs.attention, HEAD_DIM**-0.5, k_scale, v_scale
    )
    k_all, v_all, total, _ = per_seq[0]
    expected = dense_reference(
        q, as_stored(k_all, kv_dtype), as_stored(v_all, kv_dtype), total, HEAD_DIM**-0.5
    )
    torch.testing.assert_close(out, expected, atol=1e-5 if kv_dtype == torch.float32 else 3e-2,
                               rtol=1e-5 if kv_dtype == torch.float32 else 3e-2)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_lone_decode_token_is_bit_identical_to_its_row_in_a_batch(kv_dtype, q_dtype, kernel_on_two_threads):
    """A sequence decoding alone is split over threads by KV head, in a batch each token
    is one work item: its output must be the same bits either way (batch invariance:
    greedy output cannot depend on what else runs in the step)."""
    step, q, k_new, v_new, k_cache, v_cache, scales, _ = make_step(
        11, kv_dtype, 16, shapes=[(70, 1), (45, 1), (90, 1)]
    )
    k_scale, v_scale = scales if scales is not None else (None, None)
    inputs = build_model_inputs(step, 16, torch.device("cpu"), **BACKENDS["cpp-decode"])
    write_kv(k_cache, v_cache, k_new, v_new, inputs.attention, k_scale, v_scale)
    decode = inputs.attention.decode
    q = q.to(q_dtype)
    batch = cpu_kernels.paged_attention(
        q, k_cache, v_cache, decode.block_tables, decode.query_start, decode.seq_lens,
        HEAD_DIM**-0.5, k_scale, v_scale,
    )
    for s in range(3):
        alone = cpu_kernels.paged_attention(
            q[s : s + 1], k_cache, v_cache, decode.block_tables[s : s + 1],
            torch.tensor([0, 1], dtype=torch.int32), decode.seq_lens[s : s + 1],
            HEAD_DIM**-0.5, k_scale, v_scale,
        )
        assert torch.equal(alone, batch[s : s + 1]), f"sequence {s}"


def test_prompt_chunks_are_routed_by_start_and_length():
    from inflight.attention.metadata import PaddedGroup, VarlenGroup
    from inflight.worker.input_batch import VARLEN_PREFILL_MAX_CHUNK

    def attention(chunks):  # (start_position, length) per sequence
        scheduled = [
            ScheduledRequest(
                request_id=str(i), token_ids=[0] * n, start_position=start,
                block_ids=list(range(100 * i, 100 * i + -(-(start + n) // 16))), sample=True,
                is_prefill=True, sampling_params=SamplingParams(), slot=i,
            )
            for i, (start, n) in enumerate(chunks)
        ]
        inputs = build_model_inputs(
            SchedulerOutput(step_id=0, scheduled=scheduled), 16, torch.device("cpu"),
            varlen_decode=True,
        )
        return inputs.attention

    # fresh prompts: the per-prompt SDPA group, whatever their length
    fresh = attention([(0, 5), (0, VARLEN_PREFILL_MAX_CHUNK + 1), (0, 40)])
    assert fresh.prefill is None and fresh.prompts is not None
    assert fresh.prompts.starts.tolist() == [0, 5, VARLEN_PREFILL_MAX_CHUNK + 6]
    assert fresh.prompts.lengths.tolist() == [5, VARLEN_PREFILL_MAX_CHUNK + 1, 40]
    # continued chunks: the varlen kernel when all are short, padded SDPA otherwise
    mixed = attention([(0, 5), (64, 300), (16, 40)])
    assert mixed.prompts.starts.tolist() == [0]
    assert isinstance(mixed.prefill, VarlenGroup)
    assert isinstance(attention([(32, VARLEN_PREFILL_MAX_CHUNK + 1), (16, 40)]).prefill, PaddedGroup)


def test_prompt_attention_matches_dense_in_a_mixed_step():
    """Fresh prompts through the per-prompt SDPA call, next to decode tokens and a continued
    chunk in the same step, all against the dense reference."""
    if not cpu_kernels.available():
        pytest.skip("the C++ kernel could not be built here")
    step, q, k_new, v_new, k_cache, v_cache, _, per_seq = make_step(1, torch.float32, 16)
    inputs = build_model_inputs(step, 16, torch.device("cpu"), varlen_decode=True)
    assert inputs.attention.prompts is not None  # make_step has a fresh prompt
    write_kv(k_cache, v_cache, k_new, v_new, inputs.attention)
    out = paged_attention(q, k_new, v_new, k_cache, v_cache, inputs.attention, 0.125)
    offset = 0
    for k_all, v_all, total, new in per_seq:
        expected = dense_reference(q[offset : offset + new], k_all, v_all, total, 0.125)
        torch.testing.assert_close(out[offset : offset + new], expected, atol=1e-5, rtol=1e-5)
        offset += new


def test_kernel_takes_bfloat16_queries_as_their_float32_values():
    if not cpu_kernels.available():
        pytest.skip("the C++ kernel could not be built here")
    step, q, k_new, v_new, k_cache, v_cache, _, _ = make_step(0, torch.bfloat16, 16)
    inputs = build_model_inputs(step, 16, torch.device("cpu"), varlen_decode=True,
                                varlen_prefill=True)
    write_kv(k_cache, v_cache, k_new, v_new, inputs.attention)
    group = inputs.attention.decode if inputs.attention.prefill is None else None
    assert group is None  # a mixed step: decode and prefill groups, one kernel call each
    q16 = q.to(torch.bfloat16)
    out16 = paged_attention(q16, k_new, v_new, k_cache, v_cache, inputs.attention, 0.125)
    out32 = paged_attention(q16.float(), k_new, v_new, k_cache, v_cache, inputs.attention, 0.125)
    assert out16.dtype == torch.bfloat16
    if "avx512_bf16" not in cpu_flags():
        assert torch.equal(out16, out32.to(torch.bfloat16))
        return
    # With AVX512-BF16, bfloat16 queries against a bfloat16 cache are scored with bfloat16
    # dot products (the same exact products, summed in another order) and weigh the values
    # with the probabilities rounded to bfloat16 (relative error 2^-9 each): an output
    # moves by at most 2^-9 of the largest value plus its own rounding to bfloat16.
    v_max = max(v_new.abs().max().item(), v_cache.float().abs().max().item())
    torch.testing.assert_close(out16.float(), out32, rtol=2 ** -8, atol=2 ** -9 * v_max)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8, torch.float32])
def test_bfloat16_queries_without_bf16_dots_are_their_widened_values(kv_dtype):
    """bf16_dots=False (where bfloat16 dot products do not pay): bfloat16 queries give,
    bit for bit, what their float32 values give rounded once to bfloat16, the way the
    engine passed them before (widened, and the float32 result rounded)."""
    if not cpu_kernels.available():
        pytest.skip("the C++ kernel could not be built here")
    context = [1, 40, 130]
    k_cache, v_cache, k_scale, v_scale, tables, starts, lens = int8_step(
        16, context, [1, 1, 1], seed=5
    )
    if kv_dtype != torch.int8:
        k_cache = torch.randn(k_cache.shape).to(kv_dtype)
        v_cache = torch.randn(v_cache.shape).to(kv_dtype)
        k_scale = v_scale = None
    q = torch.randn(len(context), HEADS, HEAD_DIM).bfloat16()
    args = (k_cache, v_cache, tables, starts, lens, HEAD_DIM**-0.5, k_scale, v_scale)
    narrow = cpu_kernels.paged_attention(q, *args, bf16_dots=False)
    widened = cpu_kernels.paged_attention(q.float(), *args, bf16_dots=False)
    assert narrow.dtype == torch.bfloat16
    assert torch.equal(narrow, widened.bfloat16())


@pytest.fixture(params=["bf16", "fp32"])
def attention_dots(request, monkeypatch):
    """Both choices of ``cpu.bf16_dots_pay`` (bfloat16 dot products, or the queries
    widened to float32 for float32 FMAs), whichever this CPU would take."""
    monkeypatch.setenv("INFLIGHT_BF16_DOTS", request.param)
    cpu_kernels.bf16_dots_pay.cache_clear()
    yield request.param
    cpu_kernels.bf16_dots_pay.cache_clear()


def test_attention_dots_choice_is_named_and_checked(monkeypatch):
    for value, expected in (("bf16", True), ("fp32", False)):
        monkeypatch.setenv("INFLIGHT_BF16_DOTS", value)
        cpu_kernels.bf16_dots_pay.cache_clear()
        assert cpu_kernels.bf16_dots_pay() is expected
    monkeypatch.setenv("INFLIGHT_BF16_DOTS", "fast")
    cpu_kernels.bf16_dots_pay.cache_clear()
    with pytest.raises(ValueError, match="INFLIGHT_BF16_DOTS"):
        cpu_kernels.bf16_dots_pay()
    cpu_kernels.bf16_dots_pay.cache_clear()


@pytest.mark.parametrize(
    ("fp32_probes", "bf16_probes", "expected"),
    [
        ([424, 424, 424], [213, 214, 212], False),  # Intel Xeon: bf16 dots at half the rate
        ([230, 231, 229], [460, 455, 462], True),   # AMD EPYC (Zen 4): twice the rate
        ([424, 150, 424], [213, 214, 212], False),  # one disturbed probe does not flip it
        ([424, 424, 424], [470, 480, 460], False),  # 1.1x: not the 1.25x lead it needs
    ],
)
def test_attention_dots_probe_is_stable(monkeypatch, fp32_probes, bf16_probes, expected):
    """The automatic choice (it changes a bfloat16 model's rounding, so it must be the same
    in every process on one machine): the best of three interleaved probes of each rate,
    bfloat16 chosen only with a 1.25x lead."""
    if not cpu_kernels.available():
        pytest.skip("the C++ kernel could not be built here")
    probes = {"fp32_fma": list(fp32_probes), "bf16_dot": list(bf16_probes)}
    monkeypatch.setattr(cpu_kernels, "peak_gflops", lambda kind, seconds: probes[kind].pop(0))
    monkeypatch.delenv("INFLIGHT_BF16_DOTS", raising=False)
    cpu_kernels.bf16_dots_pay.cache_clear()
    try:
        assert cpu_kernels.bf16_dots_pay() is expected
        assert probes == {"fp32_fma": [], "bf16_dot": []}  # three of each
    finally:
        cpu_kernels.bf16_dots_pay.cache_clear()


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("seed", range(2))
def test_bfloat16_queries_on_a_bfloat16_cache_match_dense(block_size, seed, attention_dots):
    """The bf16 model's own case: bfloat16 queries and cache (scored with bfloat16 dot
    products where the CPU has them and they pay, else in float32), blocks of one or
    several 16-key tiles."""
    if not cpu_kernels.available():
        pytest.skip("the C++ kernel could not be built here")
    step, q, k_new, v_new, k_cache, v_cache, _, per_seq = make_step(seed, torch.bfloat16, block_size)
    inputs = build_model_inputs(step, block_size, torch.device("cpu"), varlen_decode=True,
                                varlen_prefill=True)
    write_kv(k_cache, v_cache, k_new, v_new, inputs.attention)
    q16 = q.to(torch.bfloat16)
    out = paged_attention(q16, k_new, v_new, k_cache, v_cache, inputs.attention, 0.125)
    offset = 0
    for k_all, v_all, total, new in per_seq:
        expected = dense_reference(
            q16[offset : offset + new].float(), as_stored(k_all, torch.bfloat16),
            as_stored(v_all, torch.bfloat16), total, 0.125,
        )
        torch.testing.assert_close(out[offset : offset + new].float(), expected, atol=2e-2, rtol=2e-2)
        offset += new


def scattered_tables(per_seq: list[int], num_blocks: int) -> torch.Tensor:
    """Block tables [S, max(per_seq)] int32 giving sequence s per_seq[s] distinct blocks
    of the cache in a random order (unused entries 0)."""
    order = torch.randperm(num_blocks)
    tables = torch.zeros(len(per_seq), max(per_seq), dtype=torch.int32)
    used = 0
    for s, count in enumerate(per_seq):
        tables[s, :count] = order[used : used + count].int()
        used += count
    return tables


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 128), (2, 2, 128), (12, 3, 64), (3, 3, 64)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_decode_tokens_match_dense_tightly(heads, kv_heads, head_dim, block_size, kv_dtype):
    """Decode tokens, group sizes 1-4, head_dim 64 and 128, contexts from one key to
    several blocks with a partial last one, against the dense reference on the cache's own
    (rounded) values at float32's tolerance: a bfloat16 cache's values are widened exactly
    (as even/odd halves of one load), so a lane put back in the wrong place shows."""
    if not cpu_kernels.available():
        pytest.skip("the C++ kernel could not be built here")
    torch.manual_seed(block_size + head_dim + heads)
    context = [1, 15, 48, 49, 97, 300]
    per_seq = [-(-n // block_size) for n in context]
    num_blocks = sum(per_seq) + 3
    k_cache = torch.randn(num_blocks, kv_heads, head_dim, block_size).to(kv_dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim).to(kv_dtype)
    tables = scattered_tables(per_seq, num_blocks)
    q = torch.randn(len(context), heads, head_dim) * 2
    out = cpu_kernels.paged_attention(
        q, k_cache, v_cache, tables, torch.arange(len(context) + 1, dtype=torch.int32),
        torch.tensor(context, dtype=torch.int32), head_dim**-0.5,
    )
    group = heads // kv_heads
    for s, n in enumerate(context):
        blocks = tables[s, : per_seq[s]].long()
        keys = k_cache[blocks].float().permute(0, 3, 1, 2).reshape(-1, kv_heads, head_dim)[:n]
        values = v_cache[blocks].float().reshape(-1, kv_heads, head_dim)[:n]
        expected = F.scaled_dot_product_attention(
            q[s][:, None], keys.transpose(0, 1).repeat_interleave(group, 0),
            values.transpose(0, 1).repeat_interleave(group, 0), scale=head_dim**-0.5,
        )[:, 0]
        torch.testing.assert_close(out[s], expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("group", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    "kv_dtype,q_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
     (torch.bfloat16, torch.bfloat16), (torch.int8, torch.float32)],
)
def test_decode_heads_by_block_are_bit_identical_to_head_after_head(
    group, block_size, kv_dtype, q_dtype, kernel_on_two_threads
):
    """In a batch, a decode token's keys are scored block by block across its KV heads
    (score_heads_by_block, group sizes 1-4; 5 keeps compute_scores); a token decoding alone
    is split over threads one KV head each and scored head after head. The two orders
    must give the same bits, for every cache dtype and both query dtypes."""
    kv_heads, head_dim = 3, 64
    context = [1, 17, 64, 200]
    torch.manual_seed(group * 100 + block_size)
    per_seq = [-(-n // block_size) for n in context]
    num_blocks = sum(per_seq) + 3
    shape_k = (num_blocks, kv_heads, head_dim, block_size)
    shape_v = (num_blocks, block_size, kv_heads, head_dim)
    scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    if kv_dtype == torch.int8:
        k_cache = torch.randint(-127, 128, shape_k, dtype=torch.int8)
        v_cache = torch.randint(-127, 128, shape_v, dtype=torch.int8)
        scales = (torch.rand(num_blocks, kv_heads, block_size) * 0.02 + 1e-3,
                  torch.rand(num_blocks, kv_heads, block_size) * 0.02 + 1e-3)
    else:
        k_cache = torch.randn(shape_k).to(kv_dtype)
        v_cache = torch.randn(shape_v).to(kv_dtype)
    tables = scattered_tables(per_seq, num_blocks)
    q = (torch.randn(len(context), group * kv_heads, head_dim) * 2).to(q_dtype)
    lens = torch.tensor(context, dtype=torch.int32)
    batch = cpu_kernels.paged_attention(
        q, k_cache, v_cache, tables, torch.arange(len(context) + 1, dtype=torch.int32), lens,
        head_dim**-0.5, *scales,
    )
    for s in range(len(context)):
        alone = cpu_kernels.paged_attention(
            q[s : s + 1], k_cache, v_cache, tables[s : s + 1],
            torch.tensor([0, 1], dtype=torch.int32), lens[s : s + 1], head_dim**-0.5, *scales,
        )
        assert torch.equal(alone, batch[s : s + 1]), f"sequence {s} ({context[s]} keys)"


def int8_step(block_size: int, context: list[int], q_len: list[int], seed: int,
              head_dim: int = HEAD_DIM):
    """A random int8 cache (values -127..127, positive scales), blocks shuffled, and the
    block tables, query starts and lengths of sequences with `context` keys after this
    step's `q_len` query tokens each."""
    torch.manual_seed(seed)
    per_seq = [-(-n // block_size) for n in context]
    num_blocks = sum(per_seq) + 3
    k_cache = torch.randint(-127, 128, (num_blocks, KV_HEADS, head_dim, block_size), dtype=torch.int8)
    v_cache = torch.randint(-127, 128, (num_blocks, block_size, KV_HEADS, head_dim), dtype=torch.int8)
    k_scale = torch.rand(num_blocks, KV_HEADS, block_size) * 0.02 + 1e-3
    v_scale = torch.rand(num_blocks, KV_HEADS, block_size) * 0.02 + 1e-3
    tables = scattered_tables(per_seq, num_blocks)
    starts = torch.tensor([0, *torch.tensor(q_len).cumsum(0).tolist()], dtype=torch.int32)
    return k_cache, v_cache, k_scale, v_scale, tables, starts, torch.tensor(context, dtype=torch.int32)


# decode tokens (1 query row group), a lone long context, and prompt chunks (many rows)
INT8_SHAPES = ([1, 15, 48, 97, 300, 40, 70], [1, 1, 1, 1, 1, 9, 23])


@pytest.mark.parametrize("block_size", [16, 32])
def test_int8_key_dots_are_exact_on_queries_that_are_their_own_int8_steps(block_size):
    """Query rows of whole numbers whose largest magnitude is 127 are their own int8 steps
    (step 1), and every sum of their products with int8 keys is a whole number below 2^24,
    exact in float32 too: the int8 dot products (vpdpbusd on biased bytes, keys permuted
    to four dimensions a lane, the bias taken back with each key's sum) must give the
    float32 FMA path's output bit for bit. A wrong byte order, bias or step would not.
    (head_dim 128: the values' int16 dot products, which round the probabilities, take
    head_dim 64 only, so here the outputs show the keys' dot products alone.)"""
    if not cpu_kernels.available():
        pytest.skip("the C++ kernel could not be built here")
    context, q_len = INT8_SHAPES
    k_cache, v_cache, k_scale, v_scale, tables, starts, lens = int8_step(
        block_size, context, q_len, 5, head_dim=128)
    q = torch.randint(-126, 127, (sum(q_len), HEADS, 128)).float()
    q[..., 7] = torch.where(torch.rand(sum(q_len), HEADS) < 0.5, -127.0, 127.0)  # each row's max
    args = (q, k_cache, v_cache, tables, starts, lens, 1.0, k_scale, v_scale)
    int8 = cpu_kernels.paged_attention(*args, int8_dots=True)
    fp32 = cpu_kernels.paged_attention(*args, int8_dots=False)
    assert torch.equal(int8, fp32)


@pytest.mark.parametrize("block_size", [16, 32])
def test_int8_key_dots_round_only_the_queries(block_size):
    """On ordinary queries the int8 path differs from the float32 one only by the queries'
    rounding to int8 steps: against the float32 path on the queries rounded the same way
    (in Python) it agrees to float32 rounding, and against the exact queries it is close
    but, on a CPU with the instructions, not equal (the path was taken). head_dim 128,
    where the values keep float32 FMAs (see the int16 value tests below)."""
    if not cpu_kernels.available():
        pytest.skip("the C++ kernel could not be built here")
    context, q_len = INT8_SHAPES
    k_cache, v_cache, k_scale, v_scale, tables, starts, lens = int8_step(
        block_size, context, q_len, 6, head_dim=128)
    scale = 128**-0.5
    q = torch.randn(sum(q_len), HEADS, 128) * 3
    step = (q * scale).abs().amax(dim=-1, keepdim=True) / 127
    rounded = torch.round(q * scale / step) * step / scale
    tables_args = (k_cache, v_cache, tables, starts, lens, scale, k_scale, v_scale)
    int8 = cpu_kernels.paged_attention(q, *tables_args, int8_dots=True)
    on_rounded = cpu_kernels.paged_attention(rounded, *tables_args, int8_dots=False)
    exact = cpu_kernels.paged_attention(q, *tables_args, int8_dots=False)
    torch.testing.assert_close(int8, on_rounded, atol=1e-5, rtol=1e-5)
    # These queries' rounding moves the outputs by 0.7-0.8% of their mean size on average
    # (at most 0.04), measured on both block sizes.
    error = (int8 - exact).abs()
    assert error.mean() < 0.02 * exact.abs().mean() and error.max() < 0.1
    if {"avx512_vnni", "avx512vbmi"} <= cpu_flags():
        assert not torch.equal(int8, exact)


INT16_VALUES = {"avx512_vnni", "avx512vbmi"}


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("context", [1, 7, 450, 1500])
def test_int8_value_dots_are_exact_where_the_probabilities_are_their_own_steps(
    block_size, context
):
    """Zero queries give every key the same probability and equal value scales give every
    p * scale the same size: each is then the row's largest, exactly 32767 steps, so the
    int16 dot products (values interleaved by key pairs, widened, summed in int32) must
    give the float32 path's output to float32 rounding. Every value is +127 or -127 by
    dimension, so 1500 keys would overflow int32 sums that were never moved to float32;
    an odd count checks the last key's pairing with zero."""
    if not cpu_kernels.available():
        pytest.skip("the C++ kernel could not be built here")
    k_cache, v_cache, k_scale, v_scale, tables, starts, lens = int8_step(
        block_size, [context, 3], [1, 1], 8)
    sign = torch.where(torch.arange(HEAD_DIM) % 3 == 0, -127, 127).to(torch.int8)
    v_cache[:] = sign
    v_scale.fill_(0.01)
    q = torch.zeros(2, HEADS, HEAD_DIM)
    args = (q, k_cache, v_cache, tables, starts, lens, HEAD_DIM**-0.5, k_scale, v_scale)
    int16 = cpu_kernels.paged_attention(*args, int8_dots=True)
    fp32 = cpu_kernels.paged_attention(*args, int8_dots=False)
    expected = (sign.float() * 0.01).expand_as(fp32)
    torch.testing.assert_close(fp32, expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(int16, expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("block_size", [16, 32])
def test_int8_value_dots_round_each_probability_by_at_most_half_a_step(block_size):
    """On ordinary queries the int8 path differs from the float32 path on the same rounded
    queries only by each row's probabilities (times their values' scales) rounded to
    steps of the row's largest / 32767: |error| <= sum over keys of step / 2 * |value|,
    bounded here with each row's largest scale. A wrong pairing of keys or order of
    dimensions moves outputs by a hundred times that; on a CPU with the instructions the
    outputs are not equal (the path was taken)."""
    if not cpu_kernels.available():
        pytest.skip("the C++ kernel could not be built here")
    context, q_len = INT8_SHAPES
    k_cache, v_cache, k_scale, v_scale, tables, starts, lens = int8_step(block_size, context, q_len, 9)
    scale = HEAD_DIM**-0.5
    q = torch.randn(sum(q_len), HEADS, HEAD_DIM) * 3
    step = (q * scale).abs().amax(dim=-1, keepdim=True) / 127
    rounded = torch.round(q * scale / step) * step / scale
    tables_args = (k_cache, v_cache, tables, starts, lens, scale, k_scale, v_scale)
    int8 = cpu_kernels.paged_attention(q, *tables_args, int8_dots=True)
    on_rounded = cpu_kernels.paged_attention(rounded, *tables_args, int8_dots=False)
    largest_scale = v_scale.max().item()
    bound = torch.cat([
        torch.full((n, HEADS, HEAD_DIM), largest_scale / 32767 / 2 * 127 * keys)
        for n, keys in zip(q_len, context, strict=True)
    ])
    assert ((int8 - on_rounded).abs() <= bound + 1e-6).all()
    if INT16_VALUES <= cpu_flags():
        assert not torch.equal(int8, on_rounded)


@pytest.mark.parametrize("head_dim", [64, 72])  # the vector and the scalar rounding loop
def test_int8_key_dots_keep_a_nan_query_nan(head_dim):
    """Rounding to int8 steps clamps every value to a byte, a NaN included: the row's step
    must be NaN instead, so a NaN query gives NaN outputs for its head as on the float32
    path, not finite ones that hide it."""
    if not cpu_kernels.available():
        pytest.skip("the C++ kernel could not be built here")
    torch.manual_seed(3)
    k_cache = torch.randint(-127, 128, (4, 2, head_dim, 16), dtype=torch.int8)
    v_cache = torch.randint(-127, 128, (4, 16, 2, head_dim), dtype=torch.int8)
    scales = torch.full((4, 2, 16), 0.01)
    q = torch.randn(1, 4, head_dim)
    q[0, 0, 5] = float("nan")
    args = (q, k_cache, v_cache, torch.tensor([[0, 1, 2]], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32), torch.tensor([40], dtype=torch.int32),
            head_dim**-0.5, scales, scales)
    int8 = cpu_kernels.paged_attention(*args, int8_dots=True)
    fp32 = cpu_kernels.paged_attention(*args, int8_dots=False)
    assert torch.equal(int8.isnan(), fp32.isnan())
    assert int8[0, 0].isnan().all() and not int8[0, 1:].isnan().any()
