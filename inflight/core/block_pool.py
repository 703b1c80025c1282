"""A pool of fixed-size KV blocks, identified by integer ids ``0 .. num_blocks-1``.

The free list is a deque: allocation pops from the left, freeing appends on the right,
both O(1). Its order is the order blocks were released in, which is the eviction order a
future prefix cache will want. Invariant: ``num_free + num_used == num_blocks``, and no
id is ever in the free list twice.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks; the caller checks ``num_free_blocks`` first."""
        assert count <= len(self._free), "allocate() beyond the free blocks"
        blocks = [self._free.popleft() for _ in range(count)]
        for block_id in blocks:
            self._is_free[block_id] = False
        return blocks

    def free(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            assert not self._is_free[block_id], f"block {block_id} freed twice"
            self._is_free[block_id] = True
            self._free.append(block_id)

    def check_invariants(self) -> None:
        assert len(self._free) == sum(self._is_free), "free list and flags disagree"
        assert len(set(self._free)) == len(self._free), "a block is on the free list twice"
