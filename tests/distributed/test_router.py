"""The data-parallel router alone (no ray): balance, prefix affinity, busy fallback,
dead replicas."""

from __future__ import annotations

import pytest

from inflight.core.block_hash import extend_block_hashes
from inflight.distributed.router import NoReplicaAliveError, Router, RouterConfig

BLOCK = 4


def _router(num_replicas: int = 2, affinity: bool = True, slack: int = 100) -> Router:
    return Router(
        RouterConfig(
            num_replicas=num_replicas, block_size=BLOCK, enable_prefix_affinity=affinity,
            affinity_blocks=2, affinity_slack_tokens=slack,
        )
    )


def _route(router: Router, request_id: str, prompt: list[int], max_tokens: int = 10) -> int:
    replica = router.choose(prompt).replica
    router.begin(request_id, replica, len(prompt), max_tokens)
    return replica


def test_idle_replicas_take_turns_and_load_is_counted_in_tokens() -> None:
    router = _router(3, affinity=False)
    # Nothing outstanding anywhere: ties go round-robin, not always to replica 0.
    chosen = []
    for i in range(3):
        chosen.append(_route(router, f"r{i}", [1, 2, 3]))
        router.end(f"r{i}")
    assert chosen == [0, 1, 2]
    assert [router.load(r) for r in range(3)] == [0, 0, 0]


def test_least_outstanding_tokens_wins() -> None:
    router = _router(2, affinity=False)
    assert _route(router, "big", list(range(40)), max_tokens=100) == 0  # 140 tokens owed
    assert router.load(0) == 140
    # Two small ones both fit on replica 1 before it owes as much as replica 0.
    assert _route(router, "s1", [1, 2], max_tokens=10) == 1
    assert _route(router, "s2", [1, 2], max_tokens=10) == 1
    assert router.load(1) == 24
    # Prefill done and 90 tokens streamed: replica 0 now owes only 10.
    router.progress("big", 90)
    assert router.load(0) == 10
    assert _route(router, "s3", [1, 2], max_tokens=10) == 0
    router.end("big")
    router.end("s3")
    assert router.load(0) == 0


def test_progress_never_pays_more_than_owed() -> None:
    router = _router(1, affinity=False)
    _route(router, "r", [1, 2, 3], max_tokens=2)
    router.progress("r", 5)  # e.g. n > 1 deltas counted loosely: load stays >= 0
    assert router.load(0) == 0
    router.end("r")
    assert router.load(0) == 0


def test_shared_prefix_prefers_the_replica_that_holds_it() -> None:
    router = _router(2, slack=100)
    system = [7] * (2 * BLOCK)  # two full blocks shared by every prompt
    first = _route(router, "a", system + [1, 2])
    # The other replica is idle, yet the shared prefix keeps the request where it is.
    second = router.choose(system + [3, 4, 5])
    assert second.replica == first and second.affinity_hit
    # A different first block: no affinity, the least-loaded replica.
    other = router.choose([9] * (2 * BLOCK))
    assert other.replica != first and not other.affinity_hit


def test_prompts_shorter_than_a_block_route_by_load_only() -> None:
    router = _router(2)
    first = _route(router, "a", [1, 2, 3])
    assert router.choose([1, 2, 3]).replica != first


def test_cache_salt_separates_prefixes() -> None:
    router = _router(2)
    prompt = [5] * (2 * BLOCK)
    replica = router.choose(prompt, cache_salt="tenant-a").replica
    router.begin("a", replica, len(prompt), 10)
    salted = router.choose(prompt, cache_salt="tenant-b")
    assert not salted.affinity_hit and salted.replica != replica


def test_busy_affinity_replica_falls_back_to_load() -> None:
    router = _router(2, slack=50)
    prefix = [3] * (2 * BLOCK)
    home = _route(router, "a", prefix, max_tokens=40)  # 48 owed: within the slack
    assert router.choose(prefix + [1]).replica == home
    _route(router, "b", prefix + [2], max_tokens=40)  # home owes 96 now
    fallback = router.choose(prefix + [4])
    assert fallback.replica != home and not fallback.affinity_hit
    # The prefix moved with the request: the next one follows it there.
    router.begin("c", fallback.replica, len(prefix) + 1, 40)
    assert router.choose(prefix + [5]).replica == fallback.replica


def test_longest_known_prefix_wins() -> None:
    router = _router(2, slack=50)
    x, y, z = [1] * BLOCK, [2] * BLOCK, [3] * BLOCK
    home = _route(router, "a", x + y, max_tokens=200)  # busy: owes 208
    other = _route(router, "b", x + z)  # first block known, but home is busy: falls back
    assert other != home
    router.end("a")
    router.end("b")
    # Block x alone now points at `other`, blocks x+y still at `home`: the longer wins.
    decision = router.choose(x + y + [9])
    assert decision.replica == home and decision.affinity_hit


def test_dead_replica_leaves_rotation_and_returns() -> None:
    router = _router(2)
    prefix = [4] * (2 * BLOCK)
    home = _route(router, "a", prefix)
    lost = router.mark_dead(home)
    assert lost == ["a"] and router.load(home) == 0
    # Neither by load nor by affinity is a dead replica chosen.
    for i in range(4):
        assert _route(router, f"x{i}", prefix + [i]) != home
    router.mark_dead(1 - home)
    with pytest.raises(NoReplicaAliveError):
        router.choose([1])
    router.mark_alive(home)
    assert router.choose(prefix).replica == home
    assert router.alive_replicas == [home]


def test_exclude_skips_replicas_already_tried() -> None:
    router = _router(2, affinity=False)
    assert router.choose([1], exclude=frozenset({0})).replica == 1
    with pytest.raises(NoReplicaAliveError):
        router.choose([1], exclude=frozenset({0, 1}))


def test_affinity_keys_are_the_engines_block_hashes() -> None:
    # The router names a prefix exactly as the engine's prefix cache does.
    router = _router(2)
    prompt = list(range(3 * BLOCK + 1))
    assert router.prefix_keys(prompt, "s") == extend_block_hashes([], prompt[: 2 * BLOCK], BLOCK, "s")
