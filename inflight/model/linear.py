"""The linear layer and the weight forms it computes from, chosen per step by row count.

A ``Linear`` always has its dense weight; on the CPU it may also hold oneDNN's blocked copy
(bfloat16), float32 tiles for ``csrc/bf16_linear.cpp``'s float32 kernel (CPUs with
AVX-512, float32 compute), bfloat16 pair tiles for ``csrc/bf16_linear.cpp`` (mid-sized
steps, no AMX) or AMX tiles for ``csrc/amx_linear.cpp`` (mid-sized steps, AMX) with 4-bit
GGUF blocks for ``csrc/gguf_amx_linear.cpp`` (their decode-sized steps), the GGUF blocks of
a quantised checkpoint (small steps) or an int8 copy (``quantization="w8a8"``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from inflight.kernels import cpu as cpu_kernels
from inflight.model.loader import QuantizedWeight

_FOUR_BIT_TYPES = (2, 3)  # ggml's Q4_0 and Q4_1


class Linear(nn.Module):
    """``nn.Linear`` without random initialisation: weights always come from a checkpoint.

    Optionally also holds the weight as GGUF blocks (:meth:`use_blocks`): batches of up to
    ``block_max_rows`` rows then read those (4-8 bits per weight) instead of the dense
    weight, which is what bounds a step with one or a few sequences.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        )
        self.blocks: QuantizedWeight | None = None
        self.block_max_rows = 0
        # oneDNN's blocked copy of a bfloat16 weight (see use_packed_weight).
        self.packed: torch.Tensor | None = None
        # The weight as bfloat16 pair tiles for steps of up to pair_max_rows rows (see
        # use_pair_weight).
        self.pairs: torch.Tensor | None = None
        self.pair_max_rows = 0
        # The float32 weight as tiles for steps of up to tiles32_max_rows rows (see
        # use_f32_tiles).
        self.tiles32: torch.Tensor | None = None
        self.tiles32_max_rows = 0
        # The weight as AMX B tiles for steps of up to amx_max_rows rows (see use_amx_weight).
        self.amx: torch.Tensor | None = None
        self.amx_max_rows = 0
        # The GGUF 4-bit blocks laid out for AMX tiles, for bfloat16 steps of up to
        # gguf_amx_max_rows rows (see use_gguf_amx).
        self.gguf_amx: torch.Tensor | None = None
        self.gguf_amx_max_rows = 0
        # (int8 weight [out, in], float32 scale [out], input column multipliers [in] or
        # None) for dynamic W8A8 (see use_int8).
        self.int8: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None

    def use_blocks(
        self, blocks: QuantizedWeight | None, max_rows: int, bf16_dot: bool = False
    ) -> None:
        """Read ``blocks`` for steps of up to ``max_rows`` rows. With ``bf16_dot``, 4-bit
        blocks (Q4_0, Q4_1) are packed for bfloat16 dot products (exact weights,
        activations rounded to bfloat16: ``csrc/gguf_bf16_dot.cpp``); Q8_0 blocks and
        the float32 kernel otherwise."""
        if blocks is not None and tuple(blocks.blocks.shape[:1]) != self.weight.shape[:1]:
            raise ValueError(
                f"quantised weight has {blocks.blocks.shape[0]} rows, expected "
                f"{self.weight.shape[0]}"
            )
        if blocks is not None and bf16_dot and blocks.ggml_type in _FOUR_BIT_TYPES:
            blocks = QuantizedWeight(
                blocks.ggml_type | cpu_kernels.GGUF_BF16_DOT,
                cpu_kernels.gguf_pack_bf16_dot(blocks.blocks, blocks.ggml_type),
            )
        elif blocks is not None:
            blocks = QuantizedWeight(
                blocks.ggml_type, cpu_kernels.gguf_pack(blocks.blocks, blocks.ggml_type)
            )
        self.blocks = blocks  # packed for the kernel
        self.block_max_rows = max_rows if blocks is not None else 0

    def use_packed_weight(self) -> None:
        """Also keep the weight in oneDNN's blocked layout for AMX (CPU, bfloat16).

        ``F.linear`` reorders the weight into that layout on every call, which a step of a
        few dozen tokens feels: one pass over SmolLM2's layers at 64 rows took 28 ms
        instead of 39 (weights read from memory), and ``mixed`` 3% less time."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())

    def use_pair_weight(self, max_rows: int) -> None:
        """Also keep a bfloat16 weight as pair tiles for ``csrc/bf16_linear.cpp``: steps of
        up to ``max_rows`` rows (and more than the GGUF blocks take) then run that kernel
        instead of oneDNN. A no-op for shapes it does not take (out_features not a multiple
        of 16, odd in_features) and for layers with a bias."""
        out_features, in_features = self.weight.shape
        if self.bias is not None or out_features % 16 or in_features % 2:
            return
        self.pairs = cpu_kernels.bf16_pack_pairs(self.weight.detach())
        self.pair_max_rows = max_rows

    def use_f32_tiles(self, max_rows: int) -> None:
        """Also keep a float32 weight as tiles for ``csrc/bf16_linear.cpp``'s float32
        kernel (``f32_linear``): steps of up to ``max_rows`` rows, and more than the GGUF
        blocks take, then run it instead of PyTorch's GEMM. A no-op for shapes it does not
        take (out_features not a multiple of 16) and for layers with a bias."""
        out_features = self.weight.shape[0]
        if self.bias is not None or out_features % 16 or self.weight.dtype != torch.float32:
            return
        self.tiles32 = cpu_kernels.f32_pack_tiles(self.weight.detach())
        self.tiles32_max_rows = max_rows

    def use_amx_weight(self, max_rows: int) -> None:
        """Also keep a bfloat16 weight as AMX tiles for ``csrc/amx_linear.cpp``: steps of up
        to ``max_rows`` rows (and more than the GGUF blocks take) then run that kernel
        instead of oneDNN. A no-op for shapes it does not take (out or in features not a
        multiple of 32) and for layers with a bias."""
        out_features, in_features = self.weight.shape
        if self.bias is not None or out_features % 32 or in_features % 32:
            return
        self.amx = cpu_kernels.amx_pack(self.weight.detach())
        self.amx_max_rows = max_rows

    def use_gguf_amx(self, blocks: QuantizedWeight, max_rows: int) -> None:
        """Also keep 4-bit GGUF blocks (Q4_0, Q4_1; the checkpoint's own, not repacked for
        another kernel) for ``csrc/gguf_amx_linear.cpp``: bfloat16 steps of up to
        ``max_rows`` rows then read them, rounded to bfloat16 in registers, instead of the
        dense bfloat16 weight: the same outputs bit for bit, from 6 bits a weight instead
        of 16. A no-op for other types, shapes it does not take (out_features not a
        multiple of 32, in_features not of 64) and layers with a bias."""
        out_features, in_features = self.weight.shape
        if (blocks.ggml_type not in _FOUR_BIT_TYPES or self.bias is not None
                or out_features % 32 or in_features % 64):
            return
        self.gguf_amx = cpu_kernels.gguf_amx_pack(blocks.blocks, blocks.ggml_type)
        self.gguf_amx_max_rows = max_rows

    def _own_choice(self, x: torch.Tensor) -> str | None:
        """Which of this project's kernels takes this step ("tiles32", "pairs", "gguf_amx",
        "amx"), where the layer holds its weight form and the step is within its rows; else
        None."""
        if x.dim() != 2:
            return None
        rows = x.shape[0]
        if x.dtype == torch.float32:
            small = self.blocks is not None and rows <= self.block_max_rows
            if self.tiles32 is not None and rows <= self.tiles32_max_rows and not small:
                return "tiles32"
            return None
        if x.dtype != torch.bfloat16:
            return None
        if self.pairs is not None and rows <= self.pair_max_rows:
            return "pairs"
        if self.gguf_amx is not None and rows <= self.gguf_amx_max_rows:
            return "gguf_amx"
        if self.amx is not None and rows <= self.amx_max_rows:
            return "amx"
        return None

    def _own_kernel(self, x: torch.Tensor, float32_out: bool) -> torch.Tensor | None:
        """This step through csrc/bf16_linear.cpp, csrc/gguf_amx_linear.cpp or
        csrc/amx_linear.cpp (see _own_choice); else None."""
        choice = self._own_choice(x)
        out_features = self.weight.shape[0]
        if choice == "tiles32":
            return cpu_kernels.f32_linear(x.contiguous(), self.tiles32, out_features)
        if choice == "pairs":
            return cpu_kernels.bf16_linear(
                x.contiguous(), self.pairs, out_features, float32_out=float32_out
            )
        if choice == "gguf_amx":
            return cpu_kernels.gguf_amx_linear(
                x.contiguous(), self.gguf_amx, out_features, float32_out=float32_out
            )
        if choice == "amx":
            return cpu_kernels.amx_linear(
                x.contiguous(), self.amx, out_features, float32_out=float32_out
            )
        return None

    def greedy_argmax(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each row's lowest index of its largest float32 output, ``[M] int64``, exactly
        ``forward_float32(x).max(dim=-1).indices``, without materialising the outputs: for
        the output layer under greedy sampling, where the step runs csrc/amx_linear.cpp
        (``amx_linear_argmax``) or csrc/bf16_linear.cpp (``bf16_linear_argmax``,
        ``f32_linear_argmax``). -1 for a row holding a NaN or only -inf. None where another
        kernel would take the step."""
        choice = self._own_choice(x)
        if choice == "tiles32" and self.tiles32 is not None:
            return cpu_kernels.f32_linear_argmax(
                x.contiguous(), self.tiles32, self.weight.shape[0]
            )
        if choice == "amx":
            return cpu_kernels.amx_linear_argmax(x.contiguous(), self.amx, self.weight.shape[0])
        if choice == "pairs" and self.pairs is not None:
            return cpu_kernels.bf16_linear_argmax(
                x.contiguous(), self.pairs, self.weight.shape[0]
            )
        return None

    def use_int8(self, smooth: torch.Tensor | None = None) -> None:
        """Quantise the weight to int8 per output channel (``quantization="w8a8"``, see
        model/w8a8.py): steps that do not read GGUF blocks then run the dynamic W8A8
        kernel, activations quantised per token (csrc/int8_linear.cpp). ``smooth [in]``
        (positive): SmoothQuant's factors, the weight's columns are multiplied by them
        and the inputs' columns divided. CPU only."""
        if self.int8 is not None:
            raise RuntimeError("use_int8() once: the dense weight is gone after the first call")
        weight = self.weight.detach().float()
        smooth_inv = None
        if smooth is not None:
            weight = weight * smooth
            smooth_inv = (1.0 / smooth).float().contiguous()
        self.int8 = (*cpu_kernels.int8_quantize_weight(weight), smooth_inv)
        self.packed = self.pairs = self.amx = self.gguf_amx = self.tiles32 = None
        # The dense weight is not read again: keep its shape and dtype (FLOP counts, the
        # activation dtype) without its memory (the decoder linears are 4/5 of the model).
        shape, dtype = self.weight.shape, self.weight.dtype
        self.weight = nn.Parameter(
            torch.zeros(1, dtype=dtype, device=self.weight.device).expand(shape),
            requires_grad=False,
        )

    def forward_float32(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` with float32 outputs: for the output layer, whose logits rounded to
        bfloat16 (8 bits of mantissa: steps of 1/16 at a logit of 10) often tie, and greedy
        argmax then takes the lowest tied id. Unrounded where the bf16 pair kernel or the
        AMX kernel takes the step; other paths' outputs are widened (the GGUF blocks' are
        float32 already). Through ``self(...)``, so forward hooks see every path."""
        return self(x, float32_out=True)

    def forward(self, x: torch.Tensor, float32_out: bool = False) -> torch.Tensor:
        own = self._own_kernel(x, float32_out=float32_out)
        if own is not None:
            return own
        y = self._forward_other(x)
        return y.float() if float32_out else y

    def _forward_other(self, x: torch.Tensor) -> torch.Tensor:
        """oneDNN's packed weight, the GGUF blocks, the int8 weight or PyTorch's GEMM."""
        if self.packed is not None and x.dtype == self.weight.dtype:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.blocks is not None and x.shape[0] <= self.block_max_rows:
            y = cpu_kernels.gguf_matmul(
                x.float().contiguous(), self.blocks.blocks, self.blocks.ggml_type
            )
        elif self.int8 is not None:
            y = cpu_kernels.int8_linear(x.float().contiguous(), *self.int8)
        else:
            if x.dtype != self.weight.dtype:  # a float32 small step on a layer without blocks
                return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)
            return F.linear(x, self.weight, self.bias)
        if self.bias is not None:
            y += self.bias
        return y.to(x.dtype)
