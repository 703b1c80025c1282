"""Per-request block tables over a :class:`BlockPool`.

A request's block table maps its token positions to KV slots: position ``p`` lives in
block ``block_ids[p // block_size]`` at offset ``p % block_size``. Tables grow on demand
each step and are released whole when the request finishes, is aborted or preempted.

::

    request tokens:  | 0 .. 15 | 16 .. 31 | 32 .. 40 |
    block_ids:       [   7    ,    2     ,    9     ]   (any free blocks, any order)
    slot of token p: block_ids[p // 16] * 16 + p % 16
"""

from __future__ import annotations

from inflight.core.block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._block_tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        return self._block_tables.get(request_id, [])

    def allocate_slots(self, request_id: str, num_total_tokens: int) -> list[int] | None:
        """Grow the request's table to cover ``num_total_tokens`` positions.

        Returns the newly added block ids (possibly empty), or None, changing nothing,
        when the pool has too few free blocks.
        """
        table = self._block_tables.setdefault(request_id, [])
        missing = self.blocks_needed(num_total_tokens) - len(table)
        if missing <= 0:
            return []
        if missing > self.pool.num_free_blocks:
            if not table:
                del self._block_tables[request_id]
            return None
        new_blocks = self.pool.allocate(missing)
        table.extend(new_blocks)
        return new_blocks

    def free(self, request_id: str) -> None:
        """Return every block of the request to the pool (no-op if it holds none)."""
        table = self._block_tables.pop(request_id, None)
        if table:
            # Reversed, so a request's tail blocks are reused last.
            self.pool.free(list(reversed(table)))

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        held = [b for table in self._block_tables.values() for b in table]
        assert len(held) == len(set(held)), "a block is in two block tables"
        assert len(held) == self.pool.num_used_blocks, (
            f"{len(held)} blocks in tables but {self.pool.num_used_blocks} used in the pool"
        )
