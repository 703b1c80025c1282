"""Content hashes of full KV blocks, chained so that a hash names a whole prefix.

``hash(block i) = sha256(hash(block i-1) || extra keys || token ids of block i)``: two
requests share block ``i``'s hash only if their first ``(i + 1) * block_size`` tokens (and
extra keys) are equal, so a cache lookup can walk a prompt block by block and stop at the
first miss. Extra keys are anything besides the tokens that changes the KV: today the
per-request ``cache_salt`` (as in vLLM, mixed into the first block only; the chain carries
it to every later one), so tenants can keep their prefixes from being shared.

sha256 rather than Python's ``hash()``: stable across processes and restarts, and
collision resistant; the block pool still compares the tokens on a hit.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes

_NO_PARENT = b""


def hash_block(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: bytes = b""
) -> BlockHash:
    """The 32-byte chained hash of one full block."""
    digest = hashlib.sha256(parent or _NO_PARENT)
    # Length-prefixed, so extra keys and token bytes can never run into each other.
    digest.update(len(extra_keys).to_bytes(4, "little"))
    digest.update(extra_keys)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
    cache_salt: str | None = None,
) -> list[BlockHash]:
    """Append the hashes of the full blocks of ``token_ids`` not yet in ``hashes``
    (incremental: earlier blocks are never rehashed). Returns ``hashes``."""
    num_full = len(token_ids) // block_size
    for index in range(len(hashes), num_full):
        parent = hashes[index - 1] if index else None
        extra = cache_salt.encode() if index == 0 and cache_salt else b""
        block = token_ids[index * block_size : (index + 1) * block_size]
        hashes.append(hash_block(parent, block, extra))
    return hashes
