"""The C++ CPU kernels: built on first use, cached by torch.

``csrc/*.cpp`` (paged attention, prompt attention, GGUF block matmul, int8 W8A8 linear,
fused layer ops) are compiled together with
``torch.utils.cpp_extension`` (g++ and ninja) into torch's extension cache, once per
source version; ``scripts/bootstrap.sh`` builds them at install time so the first engine
start does not pay for it. If the build fails (no compiler), :func:`available` says so and
the engine uses PyTorch ops instead. ``INFLIGHT_AMX=0`` keeps the prompt attention kernel
off AMX tiles on CPUs that have them (its AVX512-BF16 path instead).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
from functools import cache
from pathlib import Path

import torch

from inflight.cpu_info import cpu_flags

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = sorted(str(p) for p in _CSRC.glob("*.cpp"))
logger = logging.getLogger(__name__)


def _build_name() -> str:
    """Extension name with a digest of every source and header (torch's cache only watches
    the .cpp files, so a changed header must change the name to force a rebuild), of this
    CPU's feature flags (the build is ``-march=native``: code built for one CPU kind may
    not run on another that shares the cache), and of the sources' folder (torch's build
    files hold absolute paths: two checkouts sharing a name rebuild each other's)."""
    digest = hashlib.sha256()
    for path in sorted(_CSRC.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(" ".join(sorted(cpu_flags())).encode() or platform.machine().encode())
    digest.update(str(_CSRC.resolve()).encode())
    return f"inflight_cpu_kernels_{digest.hexdigest()[:12]}"


def clear_stale_build_lock(build_dir: str) -> bool:
    """Remove torch's build lock file from ``build_dir`` if it is there; True if it was.
    Call only while holding :func:`available`'s own lock: every build of these kernels
    holds that lock (the OS releases it when its process dies), so a torch lock file seen
    under it was left by a build that was killed, and torch would wait for it forever."""
    stale = os.path.join(build_dir, "lock")
    if not os.path.exists(stale):
        return False
    os.remove(stale)
    logger.warning("removed %s, left by a kernel build that did not finish", stale)
    return True


@cache
def available() -> bool:
    """Build (or load the cached build of) the kernels; False if that is impossible."""
    if os.environ.get("INFLIGHT_ATTENTION_BACKEND", "auto") == "torch":
        return False
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        name = _build_name()
        build_dir = _get_build_directory(name, verbose=False)
        # One build at a time through an OS lock (freed if its holder dies), so that a
        # killed build's lock file cannot hang the next start (see clear_stale_build_lock).
        with open(build_dir.rstrip(os.sep) + ".inflight-lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            clear_stale_build_lock(build_dir)
            load(
                name=name,
                sources=_SOURCES,
                # No FMA contraction: scalar code rounds like PyTorch's separate mul and add.
                extra_cflags=[
                    "-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off",
                ],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
    except Exception as error:  # a missing compiler must not stop the engine
        logger.warning("C++ CPU kernels unavailable (%s); using PyTorch ops", error)
        return False
    return True


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    query_start: torch.Tensor, seq_lens: torch.Tensor, scale: float,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    int8_dots: bool | None = None, bf16_dots: bool | None = None,
) -> torch.Tensor:
    """See csrc/paged_attention.cpp for shapes; q and the result are float32 or bfloat16
    (computed in float32). ``k_scale`` and ``v_scale`` come with (and only with) an int8
    cache; ``int8_dots`` (default :func:`int8_query_dots`) lets an int8 cache's keys be
    scored with int8 dot products, and its values weighed with int16 ones, where the CPU
    has them; ``bf16_dots`` (default
    :func:`bf16_dots_pay`) lets bfloat16 queries on a bfloat16 cache use bfloat16 dot
    products (else float32 FMAs on their values, the result still bfloat16)."""
    if int8_dots is None:
        int8_dots = int8_query_dots()
    if bf16_dots is None:
        bf16_dots = bf16_dots_pay()
    return torch.ops.inflight.paged_attention(
        q, k_cache, v_cache, block_tables, query_start, seq_lens, scale, k_scale, v_scale,
        int8_dots, bf16_dots,
    )


@cache
def int8_query_dots() -> bool:
    """Whether paged attention scores an int8 KV cache's keys with int8 dot products
    (AVX512-VNNI ``vpdpbusd``, on CPUs that also have AVX512-VBMI) on the queries rounded
    per row to int8 steps of max|q| / 127, instead of widening every key to float32
    (``csrc/paged_attention.cpp``, ``score_blocks_int8``), and, at head_dim 64, weighs its
    values with int16 dot products (``vpdpwssd``) on each row's probabilities rounded to
    15-bit steps of the row's largest (``weigh_values_int16``). Both roundings are smaller
    than the cache's own int8 rounding. ``INFLIGHT_INT8_DOTS`` = ``int8`` (default) or
    ``fp32`` (float32 FMAs on the exact queries and probabilities)."""
    chosen = os.environ.get("INFLIGHT_INT8_DOTS", "int8")
    if chosen not in ("int8", "fp32"):
        raise ValueError(f"INFLIGHT_INT8_DOTS must be int8 or fp32, got {chosen!r}")
    return chosen == "int8"


def prompt_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor,
    lengths: torch.Tensor, scale: float, out: torch.Tensor, allow_amx: bool = True,
) -> None:
    """Causal self-attention of fresh prompt chunks (see csrc/prompt_attention.cpp): rows
    ``starts[s] : starts[s] + lengths[s]`` of ``out`` get prompt s's attention output.
    ``allow_amx=False`` keeps bfloat16 prompts off the AMX tiles (the AVX512-BF16 path),
    for tests and benchmarks that compare the two."""
    torch.ops.inflight.prompt_attention(q, k, v, starts, lengths, scale, out, allow_amx)


@cache
def prompt_attention_amx_available() -> bool:
    """Whether bfloat16 prompts take AMX tiles: built with AMX, the OS grants tile data, and
    ``INFLIGHT_AMX`` is not ``0`` (read once, at the first call)."""
    return available() and bool(torch.ops.inflight.prompt_attention_amx_available())


@cache
def gguf_matmul_available() -> bool:
    """Whether this build has the GGUF block matmul (it needs AVX-512)."""
    return available() and bool(torch.ops.inflight.gguf_matmul_available())


def gguf_dequantize(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """GGUF blocks ``[N, row_bytes]`` uint8 (Q4_0, Q4_1, Q8_0) -> float32 ``[N, K]``."""
    return torch.ops.inflight.gguf_dequantize(blocks, ggml_type)


def gguf_pack(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """GGUF blocks ``[N, row_bytes]`` uint8 -> the layout :func:`gguf_matmul` reads."""
    return torch.ops.inflight.gguf_pack(blocks, ggml_type)


def gguf_matmul(x: torch.Tensor, packed: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """``x [M, K] float32 @ W.T -> [M, N] float32`` with W given as :func:`gguf_pack`'s
    output, or as :func:`gguf_pack_bf16_dot`'s with ``ggml_type | GGUF_BF16_DOT``."""
    return torch.ops.inflight.gguf_matmul(x, packed, ggml_type)


# Added to a 4-bit ggml type id (Q4_0, Q4_1) for blocks packed by gguf_pack_bf16_dot.
GGUF_BF16_DOT = 256


@cache
def gguf_bf16_dot_available() -> bool:
    """Whether this build has the bfloat16-dot GGUF kernel (it needs AVX512-BF16)."""
    return gguf_matmul_available() and bool(torch.ops.inflight.gguf_bf16_dot_available())


def gguf_pack_bf16_dot(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """Q4_0 / Q4_1 blocks ``[N, row_bytes]`` uint8 -> the layout that
    :func:`gguf_matmul` reads with ``ggml_type | GGUF_BF16_DOT``: each block's 4-bit
    weights exact, the activations rounded to bfloat16 (csrc/gguf_bf16_dot.cpp)."""
    return torch.ops.inflight.gguf_pack_bf16_dot(blocks, ggml_type)


@cache
def bf16_linear_available() -> bool:
    """Whether this build has the bfloat16 dot-product linear (it needs AVX512-BF16)."""
    return available() and bool(torch.ops.inflight.bf16_linear_available())


def bf16_pack_pairs(weight: torch.Tensor) -> torch.Tensor:
    """bfloat16 ``weight [N, K]`` (N a multiple of 16, K even) -> the int32 pair tiles
    :func:`bf16_linear` reads (see csrc/bf16_linear.cpp)."""
    return torch.ops.inflight.bf16_pack_pairs(weight)


def bf16_linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, float32_out: bool = False
) -> torch.Tensor:
    """``x [M, K] bfloat16 @ W.T -> [M, N]`` with W given as :func:`bf16_pack_pairs`'s
    output: bfloat16, or with ``float32_out`` the float32 sums unrounded."""
    return torch.ops.inflight.bf16_linear(x, packed, out_features, float32_out)


def bf16_linear_argmax(
    x: torch.Tensor, packed: torch.Tensor, out_features: int
) -> torch.Tensor:
    """Greedy token ids ``[M] int64`` for ``x [M, K] bfloat16``: each row's lowest index of
    its largest float32 sum, as :func:`bf16_linear` with ``float32_out`` followed by
    ``max(dim=-1).indices``, without the ``[M, N]`` logits; -1 for a row holding a NaN
    or only -inf (take those from the logits)."""
    return torch.ops.inflight.bf16_linear_argmax(x, packed, out_features)


@cache
def f32_linear_available() -> bool:
    """Whether this build has the float32 tile linear (it needs AVX-512)."""
    return available() and bool(torch.ops.inflight.f32_linear_available())


def f32_pack_tiles(weight: torch.Tensor) -> torch.Tensor:
    """float32 ``weight [N, K]`` (N a multiple of 16) -> the tiles :func:`f32_linear` reads
    (``[N * K]`` float32: tiles of up to 64 columns, each ``[K][width]``; see
    csrc/bf16_linear.cpp)."""
    return torch.ops.inflight.f32_pack_tiles(weight)


def f32_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x [M, K] float32 @ W.T -> [M, N] float32`` with W given as :func:`f32_pack_tiles`'
    output (the bfloat16 pair kernel's blocking with float32 FMAs)."""
    return torch.ops.inflight.f32_linear(x, packed, out_features)


def f32_linear_argmax(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """Greedy token ids ``[M] int64`` for ``x [M, K] float32``: as :func:`f32_linear`
    followed by ``max(dim=-1).indices`` (lowest index of a tie), without the ``[M, N]``
    logits; -1 for a row holding a NaN or only -inf (take those from the logits)."""
    return torch.ops.inflight.f32_linear_argmax(x, packed, out_features)


@cache
def amx_linear_available() -> bool:
    """Whether this build has the AMX linear (the CPU has AMX tiles and the OS grants them)."""
    return available() and bool(torch.ops.inflight.amx_linear_available())


def amx_pack(weight: torch.Tensor) -> torch.Tensor:
    """bfloat16 ``[N, K]`` weight (N and K multiples of 32) -> the AMX B tiles that
    :func:`amx_linear` reads (see csrc/amx_linear.cpp)."""
    return torch.ops.inflight.amx_pack(weight)


def amx_linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, float32_out: bool = False
) -> torch.Tensor:
    """``x [M, K] bfloat16 @ W.T -> [M, N]`` with AMX tiles, W given as :func:`amx_pack`'s
    output; bfloat16 out (float32 sums rounded once), or float32 with ``float32_out``."""
    return torch.ops.inflight.amx_linear(x, packed, out_features, float32_out)


def amx_linear_argmax(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """Greedy token ids ``[M] int64`` for ``x [M, K] bfloat16``: each row's lowest index of
    its largest float32 sum, as :func:`amx_linear` with ``float32_out`` followed by
    ``max(dim=-1).indices``, without the ``[M, N]`` logits; -1 for a row holding a NaN
    or only -inf (take those from the logits)."""
    return torch.ops.inflight.amx_linear_argmax(x, packed, out_features)


def decode_stack_tiles(
    layer_tensors: list[torch.Tensor], out_features: list[int], eps: float,
    k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
    k_scales: list[torch.Tensor], v_scales: list[torch.Tensor],
    num_heads: int, num_kv_heads: int, scale: float, pair_tiles: bool = False,
) -> torch.ScriptObject:
    """:func:`decode_stack` for bfloat16 steps whose decoder linears read 4-bit blocks with
    AMX tiles: ``layer_tensors`` holds :func:`gguf_amx_pack`'s blocks in place of the GGUF
    blocks, ``out_features`` the projections' output sizes (4 a layer); with
    ``pair_tiles``, :func:`bf16_pack_pairs`' tiles instead (:func:`bf16_linear`). The
    attention takes the queries as ``torch_paged._varlen`` does (bfloat16 where bfloat16
    dot products pay, else widened to float32)."""
    return torch.classes.inflight.DecodeStackTiles(
        layer_tensors, out_features, eps, k_caches, v_caches, k_scales, v_scales,
        num_heads, num_kv_heads, scale, int8_query_dots(), bf16_dots_pay(), pair_tiles,
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype,
    add: torch.Tensor | None = None,
) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)`` for float32 ``x [T, hidden]``;
    with ``add``, ``x += add`` first, in place."""
    return torch.ops.inflight.rms_norm(x, weight, eps, dtype, add)


def rope_write_kv(
    qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    num_heads: int, num_kv_heads: int,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k of ``qkv [T, (H + 2 KVH) * D]``, write K/V at ``slot_mapping`` (an
    int8 cache: quantised, scales into ``k_scale``/``v_scale``); returns rotated
    ``q [T, H, D]`` and ``k [T, KVH, D]`` in ``qkv``'s dtype."""
    return torch.ops.inflight.rope_write_kv(
        qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads,
        k_scale, v_scale,
    )


def decode_stack(
    layer_tensors: list[torch.Tensor], layer_types: list[int], eps: float,
    k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
    k_scales: list[torch.Tensor], v_scales: list[torch.Tensor],
    num_heads: int, num_kv_heads: int, scale: float, int8_dots: bool | None = None,
) -> torch.ScriptObject:
    """Every decoder layer of a decode step whose linears all read GGUF blocks, as one C++
    object (see csrc/decode_layer.cpp): ``layer_tensors`` holds 6 per layer (input norm
    weight, post-attention norm weight, then the blocks of qkv, o, gate_up, down),
    ``layer_types`` their 4 ggml types; one K and V cache per layer, and one K and V scale
    per layer with an int8 cache (else empty lists). Its ``run(x, positions, cos, sin,
    slot_mapping, block_tables, query_start, seq_lens)`` updates ``x [T, hidden]``
    (float32) in place and returns the last layer's MLP output. ``int8_dots`` as for
    :func:`paged_attention`."""
    if int8_dots is None:
        int8_dots = int8_query_dots()
    return torch.classes.inflight.DecodeStack(
        layer_tensors, layer_types, eps, k_caches, v_caches, k_scales, v_scales,
        num_heads, num_kv_heads, scale, int8_dots,
    )


def int8_quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` -> (int8 ``[N, K]``, float32 scale ``[N]``): symmetric, per output
    channel, scale = max |row| / 127 (see csrc/int8_linear.cpp)."""
    wq, scale = torch.ops.inflight.int8_quantize_weight(weight)
    return wq, scale


def int8_linear(
    x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
    smooth_inv: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(x * smooth_inv) [M, K] float32 @ W.T`` -> ``[M, N]`` float32, with W given by
    :func:`int8_quantize_weight` and x quantised per row (dynamic W8A8)."""
    return torch.ops.inflight.int8_linear(x, wq, w_scale, smooth_inv)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits [N, V]`` float32 -> ``[N]`` int64: each row's first index of its maximum, as
    ``logits.max(dim=-1).indices``; -1 for a row holding a NaN (see csrc/greedy_argmax.cpp)."""
    return torch.ops.inflight.greedy_argmax(logits)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [T, 2 * I]`` (gate first)."""
    return torch.ops.inflight.silu_mul(gate_up)


BF16_DOTS_LEAD = 1.25  # how much faster bfloat16 dot products must be to be chosen


@cache
def bf16_dots_pay() -> bool:
    """Whether bfloat16 dot products (vdpbf16ps) outrun float32 FMAs on this CPU, so that
    paged attention scores bfloat16 queries against a bfloat16 cache with them and a
    bfloat16 model's GGUF 4-bit blocks take them (else both widen to float32).
    Measured once (two 20 ms register-only probes): on the AMD EPYC (Zen 4, Zen 5) they
    run at twice the float32 FMA rate; on the Intel Xeons this project measured (with and
    without AMX) at half of it, where the float32 path on the same cache was 1.1x faster
    (``python -m inflight.bench.decode_attention``). ``INFLIGHT_BF16_DOTS`` =
    ``bf16`` or ``fp32`` overrides.

    The choice changes a bfloat16 model's rounding, so it must not flip between processes
    on one machine: each rate is the best of three 10 ms probes, interleaved, and bfloat16
    needs a 1.25x lead (the kinds measured differ by 2x either way). A single 20 ms probe
    of each flipped once in seven runs beside a busy process on the Intel Xeon with AMX."""
    forced = os.environ.get("INFLIGHT_BF16_DOTS", "auto")
    if forced not in ("auto", "bf16", "fp32"):
        raise ValueError(f"INFLIGHT_BF16_DOTS must be auto, bf16 or fp32, got {forced!r}")
    if forced != "auto":
        return forced == "bf16"
    if not available():
        return False
    fp32 = bf16 = 0.0
    for _ in range(3):
        fp32 = max(fp32, peak_gflops("fp32_fma", 0.01))
        bf16 = max(bf16, peak_gflops("bf16_dot", 0.01))
    return bf16 > BF16_DOTS_LEAD * fp32


def peak_gflops(kind: str, seconds: float) -> float:
    """GFLOP/s this CPU's threads reach in a register-only loop of ``kind`` ("fp32_fma" or
    "bf16_dot") for ``seconds`` (see csrc/peak_probe.cpp); 0 when the CPU lacks it."""
    return float(torch.ops.inflight.peak_gflops(kind, seconds))


@cache
def gguf_amx_linear_available() -> bool:
    """Whether this build has the 4-bit GGUF AMX linear (AMX tiles, AVX512-BF16, granted)."""
    return available() and bool(torch.ops.inflight.gguf_amx_linear_available())


def gguf_amx_pack(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """GGUF Q4_0 / Q4_1 blocks ``[N, row_bytes]`` (N a multiple of 32, K of 64) -> the
    layout :func:`gguf_amx_linear` streams (see csrc/gguf_amx_linear.cpp)."""
    return torch.ops.inflight.gguf_amx_pack(blocks, ggml_type)


def gguf_amx_linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, float32_out: bool = False
) -> torch.Tensor:
    """``x [M, K] bfloat16 @ W.T -> [M, N]`` with AMX tiles, W as :func:`gguf_amx_pack`'s
    4-bit blocks rounded to bfloat16: bit-identical to :func:`amx_linear` on the dense
    bfloat16 weight, from 6 bits a weight instead of 16."""
    return torch.ops.inflight.gguf_amx_linear(x, packed, out_features, float32_out)
