"""Where GGUF block matmuls stop paying: all of a model's linear layers, one pass per step.

    python -m inflight.bench.block_matmul [--model PATH] [--rows 1 2 4 8 16 32 64]

For each batch size M (tokens in a step) it times one pass over every linear layer of the
model (the weights streamed once, as in a real step) five ways: the GGUF block kernel,
dense float32 and dense bfloat16 matmuls, bfloat16 through oneDNN's pre-packed weights
(what the engine runs for bfloat16 steps on the CPU), and float32 through this project's
tile kernel (``tiles32``: ``csrc/bf16_linear.cpp``'s ``f32_linear``, on CPUs with AVX-512;
``worker/device.py``'s ``F32_TILE_MATMUL_MAX_ROWS`` is where it stops beating ``fp32``).
``worker/device.py``'s ``BLOCK_MATMUL_MAX_ROWS`` is the largest M at which the block kernel
is still the faster choice for each dtype.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from inflight.kernels import cpu
from inflight.model.linear import Linear
from inflight.model.loader import default_model_path, load_checkpoint
from inflight.worker.device import build_model


def _time_ms(run: Callable[[], object], repeats: int) -> float:
    run()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - start) / repeats * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2-135M)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if not cpu.gguf_matmul_available():
        parser.error("the GGUF block kernel is not available on this machine")
    checkpoint = load_checkpoint(args.model or default_model_path())
    model = build_model(
        checkpoint.arch, checkpoint.weights, torch.device("cpu"), torch.float32, 16,
        quantized=checkpoint.quantized, block_max_rows=1 << 30,
    )
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.blocks is not None]
    dense32 = [m.weight for m in layers]
    dense16 = [w.bfloat16() for w in dense32]
    packed16 = [torch.ops.mkldnn._reorder_linear_weight(w) for w in dense16]
    tiles = cpu.f32_linear_available() and all(w.shape[0] % 16 == 0 for w in dense32)
    tiles32 = [cpu.f32_pack_tiles(w) for w in dense32] if tiles else []
    print(f"{len(layers)} linear layers; times in ms per pass over all of them")
    print(f"{'rows':>5} {'blocks':>8} {'fp32':>8} {'bf16':>8} {'packed':>8} {'tiles32':>8}")
    with torch.inference_mode():
        for rows in args.rows:
            inputs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in dense32}}
            inputs16 = {k: x.bfloat16() for k, x in inputs.items()}
            blocks = _time_ms(
                lambda x=inputs: [layer(x[layer.weight.shape[1]]) for layer in layers], args.repeats
            )
            fp32 = _time_ms(lambda x=inputs: [x[w.shape[1]] @ w.T for w in dense32], args.repeats)
            bf16 = _time_ms(lambda x=inputs16: [x[w.shape[1]] @ w.T for w in dense16], args.repeats)
            packed = _time_ms(
                lambda x=inputs16: [
                    torch.ops.mkldnn._linear_pointwise(x[w.shape[1]], p, None, "none", [], "")
                    for w, p in zip(dense16, packed16, strict=True)
                ],
                args.repeats,
            )
            tiled = float("nan")
            if tiles:
                tiled = _time_ms(
                    lambda x=inputs: [
                        cpu.f32_linear(x[w.shape[1]], t, w.shape[0])
                        for w, t in zip(dense32, tiles32, strict=True)
                    ],
                    args.repeats,
                )
            print(
                f"{rows:>5} {blocks:>8.1f} {fp32:>8.1f} {bf16:>8.1f} {packed:>8.1f} {tiled:>8.1f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
