"""Automatic prefix caching in the pure core: hashing, lookup, reference counts, LRU
eviction, and the scheduler starting a request after its cached prefix. No torch."""

from __future__ import annotations

import dataclasses

from fake_engine import Spec, assert_matches_reference, make_scheduler, run_specs

from inflight.core.block_hash import extend_block_hashes, hash_block
from inflight.core.kv_cache_manager import KVCacheManager
from inflight.core.request import Request
from inflight.sampling_params import SamplingParams

BS = 4


def req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), cache_salt=salt)


def computed(kv: KVCacheManager, request: Request, num_tokens: int | None = None) -> Request:
    """Admit ``request`` (with whatever the cache holds) and mark its tokens computed."""
    prefix = kv.find_cached_prefix(request)
    assert kv.allocate_slots(request.request_id, request.num_tokens, prefix) is not None
    request.num_computed_tokens = request.num_tokens if num_tokens is None else num_tokens
    kv.cache_full_blocks(request)
    return request


def test_hashes_chain_over_the_whole_prefix() -> None:
    a = extend_block_hashes([], [1, 2, 3, 4, 5, 6, 7, 8], BS)
    b = extend_block_hashes([], [9, 2, 3, 4, 5, 6, 7, 8], BS)
    assert len(a) == 2 and a[0] != b[0]
    # Same tokens in block 1, different block 0: block 1's hash differs too.
    assert a[1] != b[1]
    assert a[1] == hash_block(a[0], [5, 6, 7, 8])
    # Only full blocks are hashed; extending is incremental and stable.
    hashes = extend_block_hashes([], [1, 2, 3, 4, 5], BS)
    assert hashes == a[:1]
    assert extend_block_hashes(hashes, [1, 2, 3, 4, 5, 6, 7, 8], BS) == a
    assert extend_block_hashes([], [1, 2, 3, 4], BS, cache_salt="t1") != a[:1]


def test_identical_prefix_hits_and_one_differing_token_misses_from_there() -> None:
    kv = KVCacheManager(32, BS, enable_prefix_caching=True)
    tokens = list(range(100, 113))  # 13 tokens: 3 full blocks + 1
    first = computed(kv, req("a", tokens))
    same = kv.find_cached_prefix(req("b", tokens))
    assert same.num_tokens == 12 and same.block_ids == kv.get_block_ids("a")[:3]
    changed = list(tokens)
    changed[5] = 7  # inside block 1
    miss = kv.find_cached_prefix(req("c", changed))
    assert miss.num_tokens == 4 and miss.block_ids == kv.get_block_ids(first.request_id)[:1]


def test_partial_block_is_never_shared_and_last_token_always_recomputed() -> None:
    for length in range(1, 3 * BS + 2):
        kv = KVCacheManager(32, BS, enable_prefix_caching=True)
        tokens = list(range(length))
        computed(kv, req("a", tokens))
        hit = kv.find_cached_prefix(req("b", tokens))
        assert hit.num_tokens % BS == 0
        assert hit.num_tokens == BS * ((length - 1) // BS), length
        # A longer prompt extending this one still shares only a's full blocks.
        longer = kv.find_cached_prefix(req("c", tokens + [999] * BS))
        assert longer.num_tokens == BS * (length // BS)


def test_blocks_are_cached_only_once_computed() -> None:
    kv = KVCacheManager(32, BS, enable_prefix_caching=True)
    tokens = list(range(16))
    computed(kv, req("a", tokens), num_tokens=5)  # a prompt chunk of 5 tokens so far
    assert kv.find_cached_prefix(req("b", tokens)).num_tokens == 4


def test_different_cache_salt_never_hits() -> None:
    kv = KVCacheManager(32, BS, enable_prefix_caching=True)
    tokens = list(range(20))
    computed(kv, req("a", tokens, salt="tenant-1"))
    assert kv.find_cached_prefix(req("b", tokens, salt="tenant-2")).num_tokens == 0
    assert kv.find_cached_prefix(req("c", tokens)).num_tokens == 0
    assert kv.find_cached_prefix(req("d", tokens, salt="tenant-1")).num_tokens == 16


def test_reference_counts_free_a_shared_block_only_when_the_last_holder_goes() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    tokens = list(range(9))
    computed(kv, req("a", tokens))
    computed(kv, req("b", tokens))
    shared = kv.get_block_ids("a")[:2]
    assert kv.get_block_ids("b")[:2] == shared
    assert [kv.pool.ref_cnt(b) for b in shared] == [2, 2]
    kv.check_invariants()
    kv.free("a")
    assert [kv.pool.ref_cnt(b) for b in shared] == [1, 1]
    assert kv.pool.num_used_blocks == 3
    kv.free("b")
    assert kv.pool.num_used_blocks == 0
    kv.check_invariants()
    # Freed but still findable until the memory is needed.
    assert kv.find_cached_prefix(req("c", tokens)).block_ids == shared


def test_lru_eviction_keeps_the_recently_used_prefix() -> None:
    kv = KVCacheManager(6, BS, enable_prefix_caching=True)
    a_tokens, b_tokens = list(range(0, 9)), list(range(50, 59))  # 2 full blocks + 1 each
    for rid, tokens in (("a1", a_tokens), ("b1", b_tokens), ("a2", a_tokens)):
        computed(kv, req(rid, tokens))
        kv.free(rid)
    # Needs 4 of the 6 blocks: the least recently released go first (b's).
    computed(kv, req("big", list(range(200, 216))))
    assert kv.find_cached_prefix(req("a3", a_tokens)).num_tokens == 8
    assert kv.find_cached_prefix(req("b2", b_tokens)).num_tokens == 0
    kv.check_invariants()


def test_a_block_in_use_is_never_evicted() -> None:
    kv = KVCacheManager(4, BS, enable_prefix_caching=True)
    computed(kv, req("a", list(range(9))))  # 3 blocks held
    assert kv.allocate_slots("b", 2 * BS) is None  # one free block only
    assert kv.find_cached_prefix(req("c", list(range(9)))).num_tokens == 8


def test_failed_allocation_after_a_hit_changes_nothing() -> None:
    kv = KVCacheManager(5, BS, enable_prefix_caching=True)
    tokens = list(range(9))
    computed(kv, req("a", tokens))
    kv.free("a")  # 3 cached-free blocks, 2 of them full and registered
    filler = computed(kv, req("filler", list(range(500, 504))))  # 1 block in use
    before = (kv.pool.num_free_blocks, kv.pool.num_cached_blocks)
    stats_before = dataclasses.replace(kv.prefix_stats)
    longer = req("b", tokens + list(range(300, 316)))  # hits 2 blocks, needs 5 more
    prefix = kv.find_cached_prefix(longer)
    assert prefix.num_tokens == 8
    assert kv.allocate_slots("b", longer.num_tokens, prefix) is None
    assert (kv.pool.num_free_blocks, kv.pool.num_cached_blocks) == before
    assert kv.get_block_ids("b") == []
    assert [kv.pool.ref_cnt(b) for b in prefix.block_ids] == [0, 0]
    assert kv.prefix_stats == stats_before  # only admissions that happen are counted
    assert kv.find_cached_prefix(req("c", tokens)).block_ids == prefix.block_ids
    kv.check_invariants()
    kv.free(filler.request_id)


def test_reset_refuses_while_blocks_are_in_use() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    computed(kv, req("a", list(range(9))))
    assert kv.reset_prefix_cache() is False
    assert kv.find_cached_prefix(req("b", list(range(9)))).num_tokens == 8
    kv.free("a")
    assert kv.reset_prefix_cache() is True
    assert kv.find_cached_prefix(req("c", list(range(9)))).num_tokens == 0
    assert kv.pool.num_free_blocks == 8
    kv.check_invariants()


def test_caching_off_never_hits() -> None:
    kv = KVCacheManager(8, BS)
    computed(kv, req("a", list(range(9))))
    assert kv.find_cached_prefix(req("b", list(range(9)))).num_tokens == 0


# ---------------------------------------------------------------------- through the scheduler


SYSTEM = tuple(range(1000, 1040))  # 40 shared tokens = 10 blocks of 4


def test_scheduler_starts_after_the_cached_prefix_and_charges_only_the_rest() -> None:
    specs = [Spec("a", SYSTEM + (1, 2, 3), max_tokens=3), Spec("b", SYSTEM + (4, 5), max_tokens=3)]
    scheduler = make_scheduler(64, BS, enable_prefix_caching=True, max_num_batched_tokens=64)
    result = run_specs(scheduler, specs, arrive_at={"b": 5})
    assert_matches_reference(result, specs)
    admitted_b = next(
        s for r in result.steps for s in r.output.scheduled if s.request_id == "b"
    )
    assert admitted_b.num_cached_tokens == 40
    assert admitted_b.start_position == 40 and admitted_b.num_tokens == 2
    stats = scheduler.kv_cache.prefix_stats
    assert (stats.queries, stats.hits) == (43 + 42, 40)
    assert scheduler.kv_cache.pool.num_used_blocks == 0


def test_same_step_duplicates_and_preemption_with_caching_match_reference() -> None:
    # Ten requests sharing the system prompt in a cache too small for all: preemptions,
    # evictions, re-admissions that hit their own blocks, chunked prefill after a hit.
    specs = [
        Spec(f"r{i}", SYSTEM + tuple(range(i * 10, i * 10 + i + 1)), max_tokens=12 + i)
        for i in range(10)
    ]
    scheduler = make_scheduler(
        22, BS, enable_prefix_caching=True, max_num_batched_tokens=24, max_num_seqs=6
    )
    result = run_specs(scheduler, specs, arrive_at={f"r{i}": i // 3 for i in range(10)})
    assert_matches_reference(result, specs)
    assert sum(len(r.output.preempted_request_ids) for r in result.steps) > 0
    assert scheduler.kv_cache.prefix_stats.hits > 0
    assert scheduler.kv_cache.pool.num_used_blocks == 0
    scheduler.kv_cache.check_invariants()


def test_a_huge_pool_costs_what_it_holds_and_keeps_the_eviction_order() -> None:
    """A pool of 10**12 blocks (the planner may simulate any cache size) is built and used
    at once; never-taken blocks are the queue's front in id order, released ones join the
    back, so eviction takes fresh blocks before released (cached) ones."""
    from inflight.core.block_pool import BlockPool

    pool = BlockPool(10**12)
    assert pool.num_free_blocks == 10**12 and pool.num_used_blocks == 0
    assert pool.allocate(3) == [0, 1, 2]
    pool.register(1, b"h1", (7,))
    pool.free([1])
    assert pool.ref_cnt(1) == 0 and pool.ref_cnt(10**12 - 1) == 0
    assert pool.allocate(2) == [3, 4]  # fresh first: block 1 stays findable
    assert pool.lookup(b"h1", (7,)) == 1 and not pool.is_registered(10**11)
    assert pool.num_used_blocks == 4 and pool.num_free_blocks == 10**12 - 4
    pool.check_invariants()
    small = BlockPool(3)
    assert small.allocate(3) == [0, 1, 2]
    small.register(1, b"h1", (7,))
    small.free([2, 1])
    assert small.allocate(1) == [2] and small.lookup(b"h1", (7,)) == 1
    assert small.allocate(1) == [1] and small.lookup(b"h1", (7,)) is None  # evicted
    small.check_invariants()
