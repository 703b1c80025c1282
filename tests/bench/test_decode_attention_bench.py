"""The decode attention microbenchmark: its byte accounting and its run on the engine's caches."""

import pytest

from inflight.bench.decode_attention import DecodeAttentionShape, main, measure
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
