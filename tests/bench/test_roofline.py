"""The roofline report of ``bench throughput --profile``: the work ledger's arithmetic on
hand-made steps, the measured machine peaks, and the table end to end on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from inflight.attention.metadata import (
    AttentionMetadata,
    PaddedGroup,
    PromptGroup,
    VarlenGroup,
)
from inflight.bench.machine_peaks import MachinePeaks, measure_peaks
from inflight.bench.work_ledger import KernelWork, LinearShape, attended_sequences
from inflight.entrypoints.cli import main
from inflight.model.arch import LlamaArchConfig
from inflight.model.llama import LlamaForCausalLM

ARCH = LlamaArchConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
    rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=True,
)
PEAKS = MachinePeaks(
    cpu_model="test", threads=1, memory_gbps=10.0, fp32_gflops=100.0, bf16_gflops=0.0,
    library_fp32_gemm_gflops=50.0, avx512_bf16=False, amx=False,
)
BLOCK_SIZE = 16


def _ledger(kv_dtype: torch.dtype = torch.float32) -> KernelWork:
    return KernelWork.for_model(LlamaForCausalLM(ARCH), kv_dtype, PEAKS)


def _metadata(
    decode: VarlenGroup | PaddedGroup | None = None,
    prefill: VarlenGroup | PaddedGroup | None = None,
    prompts: PromptGroup | None = None,
) -> AttentionMetadata:
    empty = torch.zeros(0, dtype=torch.int64)  # the ledger never reads the slots
    return AttentionMetadata(empty, empty, empty, decode, prefill, prompts)


def _varlen(query_lens: list[int], context_lens: list[int]) -> VarlenGroup:
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    blocks = max(context_lens) // BLOCK_SIZE + 1
    return VarlenGroup(
        token_index=None,
        block_tables=torch.zeros(len(query_lens), blocks, dtype=torch.int32),
        query_start=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(context_lens, dtype=torch.int32),
    )


def _causal_pairs(query_len: int, context_len: int) -> int:
    """Counted from the definition: query at position p sees keys 0..p."""
    first = context_len - query_len
    return sum(1 for p in range(first, context_len) for key in range(context_len) if key <= p)


def _roofline_s(flops: float, num_bytes: float) -> float:
    return max(flops / (PEAKS.fp32_gflops * 1e9), num_bytes / (PEAKS.memory_gbps * 1e9))


@pytest.mark.parametrize(
    ("kv_dtype", "bytes_per_token_head"),
    [(torch.float32, 8 * 4), (torch.bfloat16, 8 * 2), (torch.int8, 8 * 1 + 4)],
)
def test_one_decode_token_reads_its_whole_context(
    kv_dtype: torch.dtype, bytes_per_token_head: int
) -> None:
    ledger = _ledger(kv_dtype)
    ledger.add_step(_metadata(decode=_varlen([1], [100])), torch.tensor([99]), num_sampled=1)
    tally = ledger.tallies["paged_attention"]
    layers, heads, kv_heads, head_dim = 2, 4, 2, 8
    # context tokens x layers x (K and V) x kv heads x (head_dim x element [+ int8 scale])
    expected_bytes = 100 * layers * 2 * kv_heads * bytes_per_token_head
    expected_flops = 4 * heads * head_dim * 100 * layers  # one query sees 100 keys
    assert tally.calls == layers
    assert tally.bytes == expected_bytes
    assert tally.flops == expected_flops
    assert tally.roofline_s == pytest.approx(_roofline_s(expected_flops, expected_bytes))
    assert tally.bound == "memory"


def test_a_fresh_prompt_attends_to_n_n_plus_1_over_2_pairs() -> None:
    n = 7
    ledger = _ledger()
    prompts = PromptGroup(starts=torch.tensor([0]), lengths=torch.tensor([n]))
    ledger.add_step(_metadata(prompts=prompts), torch.arange(n), num_sampled=1)
    tally = ledger.tallies["prompt_attention"]
    assert n * (n + 1) // 2 == _causal_pairs(n, n)
    assert tally.flops == 4 * 4 * 8 * (n * (n + 1) // 2) * 2
    assert "paged_attention" not in ledger.tallies


def test_a_continued_chunk_counts_its_earlier_context_and_its_causal_part() -> None:
    # a chunk of 5 tokens at positions 7..11: varlen and padded routes count the same
    ledger = _ledger()
    ledger.add_step(_metadata(prefill=_varlen([5], [12])), torch.arange(7, 12), num_sampled=1)
    expected_flops = 4 * 4 * 8 * _causal_pairs(5, 12) * 2
    assert ledger.tallies["paged_attention"].flops == expected_flops
    assert ledger.tallies["paged_attention"].bytes == 12 * 2 * 2 * 2 * 8 * 4

    padded = PaddedGroup(
        token_index=torch.tensor([[1, 2, 3, 4, 5, 0], [0, 0, 0, 0, 0, 0]]),
        valid=torch.tensor([[True] * 5 + [False], [True] + [False] * 5]),
        block_tables=torch.zeros(2, 1, dtype=torch.int64),
        mask=None,
    )
    # token 0: a decode token at position 30; tokens 1..5: the chunk at 7..11
    positions = torch.tensor([30, 7, 8, 9, 10, 11])
    groups = attended_sequences(_metadata(prefill=padded), positions)
    assert [(g.query_lens, g.context_lens) for g in groups] == [([5, 1], [12, 31])]
    assert groups[0].pairs() == _causal_pairs(5, 12) + _causal_pairs(1, 31)


def test_dense_linears_cost_2tnk_and_the_output_layer_only_sampled_rows() -> None:
    tokens, sampled = 40, 3
    ledger = _ledger()
    positions = torch.arange(tokens)
    prompts = PromptGroup(starts=torch.tensor([0]), lengths=torch.tensor([tokens]))
    ledger.add_step(_metadata(prompts=prompts), positions, num_sampled=sampled)
    hidden, inter, q, kv = 32, 48, 4 * 8, 2 * 8
    per_layer_nk = hidden * (q + 2 * kv) + q * hidden + hidden * 2 * inter + inter * hidden
    tally = ledger.tallies["linear (dense)"]
    assert tally.calls == 2 * 4 + 1
    assert tally.flops == 2 * tokens * per_layer_nk * 2 + 2 * sampled * 64 * hidden


def test_small_steps_read_gguf_blocks_and_large_ones_dense_weights() -> None:
    blocks = LinearShape(64, 32, torch.float32, False, block_bytes=1000, block_max_rows=8)
    assert blocks.reads_blocks(8, torch.float32) and not blocks.reads_blocks(9, torch.float32)
    packed = LinearShape(64, 32, torch.bfloat16, True, block_bytes=1000, block_max_rows=8)
    assert packed.reads_blocks(4, torch.float32)  # float32 input: Linear skips the packed copy
    assert not packed.reads_blocks(4, torch.bfloat16)

    ledger = _ledger()
    ledger.layer_linears = [
        LinearShape(s.out_features, s.in_features, s.weight_dtype, False, 500, 8)
        for s in ledger.layer_linears
    ]
    ledger.add_step(_metadata(decode=_varlen([1] * 4, [10] * 4)), torch.full((4,), 9), 4)
    gguf = ledger.tallies["linear (GGUF blocks)"]
    assert gguf.calls == 8
    assert gguf.bytes == sum(500 + 4 * 4 * (s.out_features + s.in_features)
                             for s in ledger.layer_linears)
    assert ledger.tallies["linear (dense)"].calls == 1  # the output layer has no blocks


@pytest.fixture(scope="module")
def peaks() -> MachinePeaks:
    return measure_peaks()


def test_measured_peaks_are_physically_possible(peaks: MachinePeaks) -> None:
    """No clock or core count is known, but no x86 core retires more than two 16-lane FMAs
    (64 FLOP) or one 32-pair bf16 dot product per FMA unit a cycle at 6 GHz: a probe that
    miscounts its FLOPs (or times nothing) lands outside. Not a speed test: the bounds are
    loose by design so a busy machine cannot fail it."""
    assert peaks.threads == torch.get_num_threads()
    ceiling = peaks.threads * 6.0 * 64  # GFLOP/s
    assert 0 < peaks.fp32_gflops <= ceiling
    assert 0 < peaks.library_fp32_gemm_gflops <= ceiling
    if peaks.avx512_bf16:
        assert 0 < peaks.bf16_gflops <= 2 * ceiling
    if peaks.amx:  # one 16 x 16 x 32 tile product (16 384 FLOP) per 16 cycles a core
        assert 0 <= peaks.amx_gflops <= peaks.threads * 6.0 * 1024  # 0: the OS refused tiles
    else:
        assert peaks.amx_gflops == 0
    assert 0.1 < peaks.memory_gbps < 2000.0


def test_bfloat16_roof_is_the_fastest_unit_the_cpu_has() -> None:
    """bfloat16 kernels may run on AMX tiles, vdpbf16ps or float32 FMAs: the roof is the
    fastest, so no kernel's fraction of it can pass 1 by picking another unit."""
    from dataclasses import replace

    with_amx = replace(PEAKS, bf16_gflops=80.0, amx=True, amx_gflops=900.0)
    assert with_amx.compute_gflops(torch.bfloat16) == 900.0
    assert with_amx.compute_gflops(torch.float32) == 100.0
    assert replace(PEAKS, bf16_gflops=80.0).compute_gflops(torch.bfloat16) == 100.0


def test_bench_profile_lists_each_kernel_against_its_bound(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    code = main([
        "bench", "throughput", "--model", str(tiny_llama_dir), "--dtype", "float32",
        "--input-len", "16", "--output-len", "6", "--num-prompts", "4",
        "--max-num-seqs", "4", "--profile", "--no-isolate", "--no-bench-lock", "--no-plots",
        "--output-json", str(tmp_path / "results.json"),
    ])
    assert code == 0
    (run,) = json.loads((tmp_path / "results.json").read_text())["runs"]
    bounds = run["kernel_bounds"]
    assert bounds["peaks"]["memory_gbps"] > 0 and bounds["peaks"]["fp32_gflops"] > 0
    rows = {row["kernel"]: row for row in bounds["kernels"]}
    assert {"paged_attention", "linear (dense)", "rms_norm"} <= set(rows)
    for name in ("paged_attention", "linear (dense)"):
        assert 0 < rows[name]["fraction"] <= 1.5
    layers = json.loads((tiny_llama_dir / "config.json").read_text())["num_hidden_layers"]
    # the profiler's calls, grouped, against the model's structure: every step runs
    # 2 norms per layer and the final one, 4 linears per layer and the output layer
    assert rows["rms_norm"]["calls"] == run["num_steps"] * (2 * layers + 1)
    assert rows["linear (dense)"]["calls"] == run["num_steps"] * (4 * layers + 1)
    assert rows["paged_attention"]["calls"] == (run["num_steps"] - 1) * layers
    # the ledger's analytic calls (paths, groups) agree with what the profiler saw run
    for row in rows.values():
        assert row["calls"] == row["ledger_calls"], row["kernel"]
    table = (tmp_path / "profile_inflight_continuous.txt").read_text()
    assert "peaks: memory read" in table and "fraction" in table and "paged_attention" in table
