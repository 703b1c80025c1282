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
from inflight.model.loader import default_model_path, load_checkpoint


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
    quantized = checkpoint.quantized
    layers = []  # (out features, in features, dense tiles, 4-bit tiles)
    for i in range(checkpoint.arch.num_hidden_layers):
        p = f"model.layers.{i}."
        for names in ([p + f"self_attn.{x}_proj.weight" for x in "qkv"],
                      [p + "self_attn.o_proj.weight"],
                      [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                      [p + "mlp.down_proj.weight"]):
            parts = [quantized.get(name) for name in names]
            if any(part is None or part.ggml_type not in (2, 3) for part in parts):
                parser.error(f"{names[0]}: the 4-bit AMX linear takes Q4_0 / Q4_1 blocks only")
            blocks = torch.cat([part.blocks for part in parts])  # type: ignore[union-attr]
            qtype = parts[0].ggml_type  # type: ignore[union-attr]
            dense = cpu.gguf_dequantize(blocks, qtype).bfloat16()
            layers.append((dense.shape[0], dense.shape[1], cpu.amx_pack(dense),
                           cpu.gguf_amx_pack(blocks, qtype)))
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
