"""Per-request block tables over a :class:`BlockPool`, with automatic prefix caching.

A request's block table maps its token positions to KV slots: position ``p`` lives in
block ``block_ids[p // block_size]`` at offset ``p % block_size``. Tables grow on demand
each step and are released whole when the request finishes, is aborted or preempted.

::

    request tokens:  | 0 .. 15 | 16 .. 31 | 32 .. 40 |
    block_ids:       [   7    ,    2     ,    9     ]   (any free blocks, any order)
    slot of token p: block_ids[p // 16] * 16 + p % 16

Prefix caching (``enable_prefix_caching``): once a block is full *and computed* it is
registered under the chained hash of its tokens (``block_hash.py``). A newly admitted
request first asks :meth:`find_cached_prefix` for the longest run of registered blocks
matching its tokens, then :meth:`allocate_slots` puts those blocks at the head of its
table (one more reference each) and allocates only the rest, so the scheduler starts it
``num_cached_tokens`` in and charges only the remainder to the token budget::

    request B tokens:  | system prompt (cached) | system prompt | B's question ... |
    B's block_ids:     [  7 (shared with A)    ,  2 (shared)   ,  11 (B's own)     ]

Shared blocks are only ever read: a hit covers full blocks strictly before the last
prompt token, and every write goes to positions at or after ``num_computed_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from inflight.core.block_hash import extend_block_hashes
from inflight.core.block_pool import BlockPool
from inflight.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """The result of a prefix-cache lookup for one request."""

    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0  # tokens covered by ``block_ids`` (a multiple of block_size)
    num_query_tokens: int = 0  # tokens the lookup was asked about (0: no lookup made)


NO_PREFIX = CachedPrefix()


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative counts, in tokens, as vLLM's ``prefix_cache_queries``/``hits``."""

    queries: int = 0
    hits: int = 0
    requests: int = 0


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.prefix_stats = PrefixCacheStats()
        self._block_tables: dict[str, list[int]] = {}
        # request id -> how many of its leading blocks are registered in the index.
        self._num_registered: dict[str, int] = {}

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

    # ------------------------------------------------------------------ prefix cache

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """The longest run of cached full blocks that starts the request's tokens.

        At most ``(num_tokens - 1) // block_size`` blocks, so the last token is always
        computed (its logits are needed to sample); none for a request that skips the
        cache (``Request.skip_prefix_cache``). Changes nothing: the blocks are only
        taken by :meth:`allocate_slots`.
        """
        if not self.enable_prefix_caching or request.skip_prefix_cache:
            return NO_PREFIX
        size = self.block_size
        tokens = request.all_token_ids
        hashes = extend_block_hashes(request.block_hashes, tokens, size, request.cache_salt)
        block_ids: list[int] = []
        for index in range(min(len(hashes), (len(tokens) - 1) // size)):
            block_id = self.pool.lookup(
                hashes[index], tuple(tokens[index * size : (index + 1) * size])
            )
            if block_id is None:
                break
            block_ids.append(block_id)
        return CachedPrefix(block_ids, len(block_ids) * size, len(tokens))

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that are now full and computed (call after its
        ``num_computed_tokens`` advanced); cheap when no block has filled up."""
        if not self.enable_prefix_caching:
            return
        request_id = request.request_id
        num_full = request.num_computed_tokens // self.block_size
        done = self._num_registered.get(request_id, 0)
        if num_full <= done:
            return
        size = self.block_size
        tokens = request.all_token_ids
        hashes = extend_block_hashes(request.block_hashes, tokens, size, request.cache_salt)
        table = self._block_tables[request_id]
        for index in range(done, num_full):
            self.pool.register(
                table[index], hashes[index], tuple(tokens[index * size : (index + 1) * size])
            )
        self._num_registered[request_id] = num_full

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False (nothing changed) while any block is in use."""
        return self.pool.reset_index()

    # ------------------------------------------------------------------ allocation

    def allocate_slots(
        self, request_id: str, num_total_tokens: int, prefix: CachedPrefix = NO_PREFIX
    ) -> list[int] | None:
        """Grow the request's table to cover ``num_total_tokens`` positions.

        ``prefix`` (only for a request that holds no blocks yet) puts the hit blocks at
        the head of its table first. Returns the newly allocated block ids (possibly
        empty), or None, changing nothing, when the pool has too few free blocks.
        """
        table = self._block_tables.get(request_id)
        if prefix.num_query_tokens:
            assert not table, "a prefix is only applied to a request without blocks"
            return self._allocate_with_prefix(request_id, num_total_tokens, prefix)
        if table is None:
            table = []
        missing = self.blocks_needed(num_total_tokens) - len(table)
        if missing <= 0:
            self._block_tables[request_id] = table
            return []
        if missing > self.pool.num_free_blocks:
            return None
        new_blocks = self.pool.allocate(missing)
        table.extend(new_blocks)
        self._block_tables[request_id] = table
        return new_blocks

    def _allocate_with_prefix(
        self, request_id: str, num_total_tokens: int, prefix: CachedPrefix
    ) -> list[int] | None:
        hit = prefix.block_ids
        missing = max(0, self.blocks_needed(num_total_tokens) - len(hit))
        # Hit blocks that nobody holds leave the free queue when taken: count them first.
        if missing > self.pool.num_free_if_touched(hit):
            return None
        self.pool.touch(hit)
        new_blocks = self.pool.allocate(missing)
        self._block_tables[request_id] = [*hit, *new_blocks]
        self._num_registered[request_id] = len(hit)
        stats = self.prefix_stats
        stats.requests += 1
        stats.queries += prefix.num_query_tokens
        stats.hits += prefix.num_tokens
        return new_blocks

    def free(self, request_id: str) -> None:
        """Drop the request's hold on every block of its table (no-op if it holds none).
        Blocks nobody else holds become free; cached ones stay findable until evicted."""
        self._num_registered.pop(request_id, None)
        table = self._block_tables.pop(request_id, None)
        if table:
            # Tail first, so a request's last blocks (least likely shared) are evicted first.
            self.pool.free(list(reversed(table)))

    def check_invariants(self) -> None:
        """Every block's reference count equals the number of tables holding it, and
        free + used == total (the pool checks the rest)."""
        self.pool.check_invariants()
        holders: dict[int, int] = {}
        for table in self._block_tables.values():
            assert len(set(table)) == len(table), "a block is twice in one block table"
            for block_id in table:
                holders[block_id] = holders.get(block_id, 0) + 1
        for block_id in range(self.pool.num_blocks):
            assert self.pool.ref_cnt(block_id) == holders.get(block_id, 0), (
                f"block {block_id}: ref_cnt {self.pool.ref_cnt(block_id)} but held by "
                f"{holders.get(block_id, 0)} tables"
            )
        assert len(holders) == self.pool.num_used_blocks, (
            f"{len(holders)} blocks in tables but {self.pool.num_used_blocks} used in the pool"
        )
