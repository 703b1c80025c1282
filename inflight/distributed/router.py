"""Which replica serves a request: least outstanding tokens, with prefix-cache affinity.

Pure Python (no ray, no torch), so the policy is unit-tested alone.

Load: a request adds ``len(prompt) + n * max_tokens`` outstanding tokens to its replica
when it is routed; the prompt part is paid off at its first delta (the prefill is done),
each streamed token pays one off, and whatever is left is dropped when it ends. The
least-loaded alive replica wins; ties go to the replica routed the fewest requests so
far, then the lowest index (so an idle service still spreads work round-robin).

Affinity (prefix caching on): a prompt's first ``affinity_blocks`` full KV blocks are
hashed with the engine's own chained block hashes (so a key names a whole prefix, salt
included). The longest key seen before points at the replica that served it, which keeps
the request unless its load exceeds the least-loaded replica's by more than
``affinity_slack_tokens`` (busy): then load decides, and the prefix moves with it.

Invariants: a dead replica is never chosen; ``load(r)`` is the sum of the outstanding
tokens of the requests routed to ``r`` that have not ended; a replica marked dead loses
its requests (their tokens are no longer counted) and its affinity keys.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from inflight.core.block_hash import BlockHash, extend_block_hashes

DEFAULT_AFFINITY_BLOCKS = 4
DEFAULT_AFFINITY_SLACK_TOKENS = 2048
DEFAULT_MAX_AFFINITY_KEYS = 65536


class NoReplicaAliveError(RuntimeError):
    """Every replica is out of rotation."""


@dataclass(frozen=True, slots=True)
class RouterConfig:
    num_replicas: int
    block_size: int = 16
    enable_prefix_affinity: bool = True
    affinity_blocks: int = DEFAULT_AFFINITY_BLOCKS
    affinity_slack_tokens: int = DEFAULT_AFFINITY_SLACK_TOKENS
    max_affinity_keys: int = DEFAULT_MAX_AFFINITY_KEYS

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")
        if self.block_size < 1 or self.affinity_blocks < 1:
            raise ValueError("block_size and affinity_blocks must be >= 1")


@dataclass(slots=True)
class _Routed:
    replica: int
    prompt_tokens: int  # still owed until the first delta
    output_tokens: int  # still owed, one per streamed token

    @property
    def outstanding(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class RouteDecision:
    replica: int
    affinity_hit: bool  # the replica was chosen because it served this prefix before


class Router:
    """Route requests over ``num_replicas`` replicas; see the module docstring."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._alive = [True] * config.num_replicas
        self._load = [0] * config.num_replicas
        self._routed: dict[str, _Routed] = {}
        self._affinity: OrderedDict[BlockHash, int] = OrderedDict()  # LRU: oldest first
        self.num_routed = [0] * config.num_replicas  # requests ever routed, per replica

    # ------------------------------------------------------------------ state

    def load(self, replica: int) -> int:
        return self._load[replica]

    def is_alive(self, replica: int) -> bool:
        return self._alive[replica]

    @property
    def alive_replicas(self) -> list[int]:
        return [r for r, alive in enumerate(self._alive) if alive]

    def mark_dead(self, replica: int) -> list[str]:
        """Take ``replica`` out of rotation; returns the ids of its requests (forgotten)."""
        self._alive[replica] = False
        lost = [rid for rid, routed in self._routed.items() if routed.replica == replica]
        for request_id in lost:
            del self._routed[request_id]
        self._load[replica] = 0
        for key in [k for k, r in self._affinity.items() if r == replica]:
            del self._affinity[key]
        return lost

    def mark_alive(self, replica: int) -> None:
        self._alive[replica] = True

    # ------------------------------------------------------------------ routing

    def prefix_keys(self, prompt_token_ids: Sequence[int], cache_salt: str | None) -> list[BlockHash]:
        """Hashes of the prompt's first ``affinity_blocks`` full blocks (shortest first)."""
        size = self.config.block_size
        head = prompt_token_ids[: self.config.affinity_blocks * size]
        return extend_block_hashes([], head, size, cache_salt)

    def choose(
        self,
        prompt_token_ids: Sequence[int],
        cache_salt: str | None = None,
        exclude: frozenset[int] = frozenset(),
    ) -> RouteDecision:
        """The replica for a new request (not yet counted: call :meth:`begin`)."""
        candidates = [r for r in self.alive_replicas if r not in exclude]
        if not candidates:
            raise NoReplicaAliveError("no engine replica is alive")
        least = min(candidates, key=lambda r: (self._load[r], self.num_routed[r], r))
        if not self.config.enable_prefix_affinity:
            return RouteDecision(least, affinity_hit=False)
        keys = self.prefix_keys(prompt_token_ids, cache_salt)
        preferred = self._preferred(keys, candidates)
        busy = preferred is not None and (
            self._load[preferred] - self._load[least] > self.config.affinity_slack_tokens
        )
        chosen = least if preferred is None or busy else preferred
        self._remember(keys, chosen)
        return RouteDecision(chosen, affinity_hit=chosen == preferred)

    def begin(self, request_id: str, replica: int, prompt_tokens: int, output_tokens: int) -> None:
        """Count a request routed to ``replica`` until :meth:`end`."""
        if request_id in self._routed:
            self.end(request_id)
        self._routed[request_id] = _Routed(replica, prompt_tokens, output_tokens)
        self._load[replica] += prompt_tokens + output_tokens
        self.num_routed[replica] += 1

    def progress(self, request_id: str, num_new_tokens: int) -> None:
        """A delta arrived: the prefill is paid off, and ``num_new_tokens`` outputs."""
        routed = self._routed.get(request_id)
        if routed is None:
            return
        paid = routed.prompt_tokens + min(num_new_tokens, routed.output_tokens)
        routed.prompt_tokens = 0
        routed.output_tokens -= min(num_new_tokens, routed.output_tokens)
        self._load[routed.replica] -= paid

    def end(self, request_id: str) -> None:
        routed = self._routed.pop(request_id, None)
        if routed is not None:
            self._load[routed.replica] -= routed.outstanding

    # ------------------------------------------------------------------ affinity

    def _preferred(self, keys: list[BlockHash], candidates: list[int]) -> int | None:
        for key in reversed(keys):  # the longest known prefix wins
            replica = self._affinity.get(key)
            if replica is not None and replica in candidates:
                return replica
        return None

    def _remember(self, keys: list[BlockHash], replica: int) -> None:
        for key in keys:
            self._affinity[key] = replica
            self._affinity.move_to_end(key)
        while len(self._affinity) > self.config.max_affinity_keys:
            self._affinity.popitem(last=False)
