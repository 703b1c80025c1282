"""The AMX linears by row count: the dense bfloat16 weight's tiles against the 4-bit blocks'.

    python -m inflight.bench.amx_linear [--model PATH] [--rows 1 16 64 128 256] [--repeats 8]

For each batch size M it times one pass over the model's fused decoder linears (qkv, o,
gate_up, down of every layer, as the engine holds them) with ``csrc/amx_linear.cpp`` on
the dense bfloat16 weight and with ``csrc/gguf_amx_linear.cpp`` on the checkpoint's 4-bit
blocks (the same outputs, bit for bit), the caches flushed before each pass (a 1 GiB read)
so the weights come from memory as in a decode step; best of ``--repeats``.
``worker/device.py``'s ``GGUF_AMX_MAX_ROWS`` is the largest M at which the blocks win.
Needs AMX tiles and a Q4_0 / Q4_1 checkpoint.
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


def _best_ms(run: Callable[[], object], repeats: int, flush: torch.Tensor) -> float:
    best = float("inf")
    for _ in range(repeats):
        flush.sum()  # evict the weights: a decode step reads them from memory
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a GGUF file (default: SmolLM2-135M)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128, 256])
    parser.add_argument("--repeats", type=int, default=8)
    args = parser.parse_args(argv)
    if not cpu.gguf_amx_linear_available():
        parser.error("the AMX linears need AMX tiles (amx_bf16) on this machine")
    checkpoint = load_checkpoint(args.model or default_model_path())
    # The engine's own weight forms (build_model picks them on this CPU): every decoder
    # linear with both the dense tiles and the 4-bit blocks' tiles.
    model = build_model(
        checkpoint.arch, checkpoint.weights, torch.device("cpu"), torch.bfloat16, 16,
        quantized=checkpoint.quantized, block_max_rows=1,
    )
    layers = [
        (m.weight.shape[0], m.weight.shape[1], m.amx, m.gguf_amx)
        for m in model.layers.modules()
        if isinstance(m, Linear) and m.amx is not None and m.gguf_amx is not None
    ]
    if not layers:
        parser.error("no decoder linear took the 4-bit AMX form (Q4_0 / Q4_1 checkpoints only)")
    flush = torch.ones(1 << 28)
    print(f"{len(layers)} fused decoder linears; ms per pass over all of them, weights from memory")
    print(f"{'rows':>5} {'dense':>8} {'4-bit':>8} {'speed-up':>9}")
    with torch.inference_mode():
        for rows in args.rows:
            x = {k: torch.randn(rows, k).bfloat16() for k in {layer[1] for layer in layers}}
            dense_ms = _best_ms(
                lambda x=x: [cpu.amx_linear(x[k], tiles, n) for n, k, tiles, _ in layers],
                args.repeats, flush,
            )
            blocks_ms = _best_ms(
                lambda x=x: [cpu.gguf_amx_linear(x[k], packed, n) for n, k, _, packed in layers],
                args.repeats, flush,
            )
            print(f"{rows:>5} {dense_ms:>8.2f} {blocks_ms:>8.2f} {dense_ms / blocks_ms:>8.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
