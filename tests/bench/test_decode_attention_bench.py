"""The decode attention microbenchmark: its byte accounting and its run on the engine's caches."""

import pytest
import torch

from inflight.bench.decode_attention import DecodeAttentionShape, block_tables, main, measure
from inflight.kernels import cpu


@pytest.mark.parametrize("dtype,per_token_head", [("bfloat16", 2 * 64 * 2), ("float32", 2 * 64 * 4),
                                                  ("int8", 2 * 64 + 2 * 4)])
def test_bytes_read_are_every_context_key_and_value(dtype, per_token_head):
    shape = DecodeAttentionShape(seqs=57, context=450, kv_cache_dtype=dtype)
    assert shape.kv_bytes_per_layer() == 57 * 450 * 3 * per_token_head


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_measures_every_layer_of_the_engines_cache(dtype, capsys):
    if not cpu.available():
        pytest.skip("the C++ kernels could not be built here")
    shape = DecodeAttentionShape(seqs=3, context=40, layers=2, kv_cache_dtype=dtype)
    timing = measure(shape, "sequential", repeats=1)
    assert timing.ms_per_layer > 0
    assert timing.gbps == pytest.approx(shape.kv_bytes_per_layer() / timing.ms_per_layer / 1e6)
    assert main(["--seqs", "2", "--context", "17", "--layers", "1", "--repeats", "1",
                 "--kv-cache-dtype", dtype]) == 0
    assert "2 sequences x 17 tokens, 1 layers" in capsys.readouterr().out
    assert main(["--seqs", "2", "--context", "17", "--layers", "1", "--repeats", "1",
                 "--kv-cache-dtype", dtype, "--overlap"]) == 0
    assert "K/V in cache (arithmetic alone)" in capsys.readouterr().out


def test_engine_order_runs_each_prompt_and_interleaves_the_grown_blocks():
    """``--order engine``: sequence s's first two thirds of blocks in one run, then the
    blocks added while decoding taken in turn (s, s + seqs, ...); every id used once."""
    tables = block_tables("engine", 3, 6, 20, torch.Generator().manual_seed(0))
    assert tables.tolist() == [[0, 1, 2, 3, 12, 15], [4, 5, 6, 7, 13, 16],
                               [8, 9, 10, 11, 14, 17]]
    for order in ("random", "sequential", "engine"):
        ids = block_tables(order, 5, 7, 40, torch.Generator().manual_seed(1)).flatten()
        assert len(set(ids.tolist())) == 35 and int(ids.max()) < 40
    with pytest.raises(ValueError, match="order"):
        block_tables("shuffled", 1, 1, 1, torch.Generator())


def test_overlap_fraction_is_one_at_the_maximum_and_zero_at_the_sum():
    from inflight.bench.decode_attention import overlap_fraction

    assert overlap_fraction(0.5, 0.3, 0.5) == pytest.approx(1.0)  # reads hide the arithmetic
    assert overlap_fraction(0.8, 0.3, 0.5) == pytest.approx(0.0)  # they take turns
    assert overlap_fraction(0.65, 0.3, 0.5) == pytest.approx(0.5)
    assert overlap_fraction(0.9, 0.3, 0.5) == 0.0 and overlap_fraction(0.4, 0.3, 0.5) == 1.0


def test_in_cache_timing_scales_a_few_sequences_to_the_whole_batch(monkeypatch):
    """measure_in_cache times one layer of as many sequences as fit the cache budget (at
    least one per thread) and scales the time by the batch over them."""
    import inflight.bench.decode_attention as bench

    seen = []

    def fake_measure(shape, order, repeats):
        seen.append((shape.seqs, shape.layers, order, repeats))
        return bench.DecodeAttentionTiming(shape, 0.01)

    monkeypatch.setattr(bench, "measure", fake_measure)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    shape = DecodeAttentionShape(seqs=57, context=450)  # 345 600 bytes a sequence and layer
    timing = bench.measure_in_cache(shape, "engine", calls=7, cache_bytes=1 << 20)
    assert seen == [(6, 1, "engine", 7)]  # 2 threads x 1 MiB / 345 600 bytes
    assert timing.ms_per_layer == pytest.approx(0.01 * 57 / 6)
    assert timing.shape == shape
    seen.clear()
    bench.measure_in_cache(DecodeAttentionShape(seqs=57, context=20000), "engine", calls=1)
    assert seen[0][0] == 2  # one sequence per thread even when one overflows the budget
