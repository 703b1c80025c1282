"""A pool of fixed-size KV blocks with reference counts and a prefix-cache index.

Blocks are identified by integer ids ``0 .. num_blocks-1``. Each block is in exactly one
of three states:

* **used**: held by one or more block tables (``ref_cnt >= 1``), never evicted;
* **cached-free**: ``ref_cnt == 0`` but it still holds the KV of a full block whose
  hash is in the index, so a later prompt with the same prefix can take it back;
* **free**: ``ref_cnt == 0`` and no hash.

Free and cached-free blocks share one queue whose order is the eviction order
(least recently released first, as in vLLM V1): allocation takes from the front, and when
the block it takes holds a cached hash, that hash leaves the index (lazy eviction).
Releasing appends at the back; taking back a cached-free block removes it from the middle
(O(1) with an ordered dict). Blocks never taken yet are the queue's front, in id order
(releases only ever join the back), so they are kept as a counter and get their state
when first taken: a pool's memory follows its use, not its size (the planner may
simulate a cache of millions of blocks).

::

    free queue (front = evicted first):  [ 4 | 9* | 2 | 7* ]     * = cached-free
    index:  hash(a) -> 9, hash(b) -> 7, hash(c) -> 5 (5 is used, ref_cnt 2)

Invariants (``check_invariants``): ``free + used == num_blocks``; a block in the queue has
``ref_cnt == 0``; every hash in the index points at a block that carries that hash.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

BlockHash = bytes


@dataclass(slots=True)
class _BlockMeta:
    ref_cnt: int = 0
    # Set once the block is full and registered in the prefix-cache index.
    block_hash: BlockHash | None = None
    # The block's token ids, kept to rule out a hash collision on lookup.
    token_ids: tuple[int, ...] = ()


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._meta: list[_BlockMeta] = []  # blocks 0 .. _num_taken-1, ever taken
        # Released blocks, in release order: the queue after the never-taken ones.
        self._free: OrderedDict[int, None] = OrderedDict()
        self._index: dict[BlockHash, int] = {}

    @property
    def _num_taken(self) -> int:
        """Blocks ever allocated; ids from here on are free and have never held KV."""
        return len(self._meta)

    # ------------------------------------------------------------------ counts

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: free ones and cached-free ones (evictable)."""
        return self.num_blocks - self._num_taken + len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self._num_taken - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by hash, used or not."""
        return len(self._index)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def ref_cnt(self, block_id: int) -> int:
        return self._meta[block_id].ref_cnt if block_id < self._num_taken else 0

    # ------------------------------------------------------------------ allocation

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks from the front of the queue, evicting their cached hashes;
        the caller checks ``num_free_blocks`` first."""
        assert count <= self.num_free_blocks, "allocate() beyond the free blocks"
        blocks = []
        for _ in range(count):
            if self._num_taken < self.num_blocks:  # the queue's front: never taken yet
                blocks.append(self._num_taken)
                self._meta.append(_BlockMeta(ref_cnt=1))
                continue
            block_id, _ = self._free.popitem(last=False)
            meta = self._meta[block_id]
            if meta.block_hash is not None:
                self._evict(block_id)
            meta.ref_cnt = 1
            blocks.append(block_id)
        return blocks

    def touch(self, block_ids: list[int]) -> None:
        """Add one reference to each block (a prefix-cache hit), taking cached-free
        blocks back out of the queue."""
        for block_id in block_ids:
            meta = self._meta[block_id]
            if meta.ref_cnt == 0:
                del self._free[block_id]
            meta.ref_cnt += 1

    def num_free_if_touched(self, block_ids: list[int]) -> int:
        """Free blocks left after :meth:`touch` of ``block_ids`` (which it does not do)."""
        reclaimed = sum(1 for b in block_ids if self._meta[b].ref_cnt == 0)
        return self.num_free_blocks - reclaimed

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks nobody holds join the back of the
        queue in the given order (cached ones stay findable until evicted)."""
        for block_id in block_ids:
            meta = self._meta[block_id]
            assert meta.ref_cnt > 0, f"block {block_id} freed twice"
            meta.ref_cnt -= 1
            if meta.ref_cnt == 0:
                self._free[block_id] = None

    # ------------------------------------------------------------------ prefix-cache index

    def lookup(self, block_hash: BlockHash, token_ids: tuple[int, ...]) -> int | None:
        """The block holding exactly this hash and these tokens, or None."""
        block_id = self._index.get(block_hash)
        if block_id is None or self._meta[block_id].token_ids != token_ids:
            return None  # a miss, or (astronomically unlikely) a hash collision
        return block_id

    def register(self, block_id: int, block_hash: BlockHash, token_ids: tuple[int, ...]) -> None:
        """Make a full, computed block findable by hash. A block with the same contents
        already in the index wins (the new one stays private and is freed normally)."""
        meta = self._meta[block_id]
        if meta.block_hash is not None or block_hash in self._index:
            return
        meta.block_hash = block_hash
        meta.token_ids = token_ids
        self._index[block_hash] = block_id

    def is_registered(self, block_id: int) -> bool:
        return block_id < self._num_taken and self._meta[block_id].block_hash is not None

    def reset_index(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use, since a
        running request may be about to register or share blocks."""
        if self.num_used_blocks:
            return False
        for block_id in list(self._index.values()):
            self._evict(block_id)
        return True

    def _evict(self, block_id: int) -> None:
        meta = self._meta[block_id]
        assert meta.block_hash is not None
        del self._index[meta.block_hash]
        meta.block_hash = None
        meta.token_ids = ()

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        in_queue = set(self._free)
        assert len(in_queue) == len(self._free), "a block is on the free list twice"
        assert all(b < self._num_taken for b in in_queue), "a never-taken block was released"
        for block_id, meta in enumerate(self._meta):
            assert meta.ref_cnt >= 0
            assert (meta.ref_cnt == 0) == (block_id in in_queue), (
                f"block {block_id}: ref_cnt {meta.ref_cnt} but "
                f"{'in' if block_id in in_queue else 'not in'} the free queue"
            )
        for block_hash, block_id in self._index.items():
            assert self._meta[block_id].block_hash == block_hash, "index and blocks disagree"
        assert sum(m.block_hash is not None for m in self._meta) == len(self._index)
