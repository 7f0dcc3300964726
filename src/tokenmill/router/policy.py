"""How a request picks its replica: cache-aware (prefix affinity balanced against load), round
robin, least load. One implementation for the HTTP router and for data parallelism's engine cores."""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.router.prefix_index import PrefixIndex


@dataclass(slots=True)
class ReplicaLoad:
    """One candidate replica as the balancer sees it now."""

    name: str
    in_flight: int = 0  # requests this dispatcher sent it that have not finished
    running: int = 0  # as the replica last reported (its /metrics or its step stats)
    waiting: int = 0

    @property
    def load(self) -> int:
        """The dispatcher's own count is current but misses other clients' traffic; the replica's
        report sees everything but lags: the larger of the two."""
        return max(self.in_flight, self.running + self.waiting)


@dataclass(frozen=True, slots=True)
class Decision:
    replica: str
    # Why: prefix_hit, prefix_miss, load_balance (cache-aware overridden by imbalance), session,
    # round_robin, least_load.
    reason: str
    matched_chunks: int = 0
    total_chunks: int = 0


class RoutingPolicy(ABC):
    name: str

    @abstractmethod
    def choose(self, prefix_hashes: Sequence[int], candidates: Sequence[ReplicaLoad]) -> Decision:
        """Picks one of `candidates` (never empty) for a prompt with these chained chunk hashes."""

    def record(self, prefix_hashes: Sequence[int], replica: str) -> None:
        """The prompt went to `replica` by another rule (a session): learn it as if chosen."""
        return None  # a policy without memory has nothing to learn

    def forget(self, replica: str) -> None:
        """The replica left (died or was dropped): what it cached is gone."""
        return None


def _least_loaded(candidates: Sequence[ReplicaLoad], tie_break: dict[str, int] | None = None) -> ReplicaLoad:
    ties = tie_break or {}
    return min(candidates, key=lambda c: (c.load, ties.get(c.name, 0)))


class RoundRobinPolicy(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, prefix_hashes: Sequence[int], candidates: Sequence[ReplicaLoad]) -> Decision:
        ordered = sorted(candidates, key=lambda c: c.name)  # a stable order whatever the caller's
        return Decision(ordered[next(self._turn) % len(ordered)].name, "round_robin", 0, len(prefix_hashes))


class LeastLoadPolicy(RoutingPolicy):
    name = "least_load"

    def choose(self, prefix_hashes: Sequence[int], candidates: Sequence[ReplicaLoad]) -> Decision:
        return Decision(_least_loaded(candidates).name, "least_load", 0, len(prefix_hashes))


@dataclass(frozen=True, slots=True)
class CacheAwareSettings:
    # A prompt goes to the replica holding its longest prefix when that prefix covers at least this
    # fraction of it; below, to the least loaded replica (the least cached among equals).
    cache_threshold: float = 0.5
    # Load wins over affinity when the busiest and idlest candidates differ by more than `abs`
    # requests and the busiest has more than `rel` times the idlest's (SGLang's two thresholds).
    balance_abs_threshold: int = 16
    balance_rel_threshold: float = 1.5
    max_prefix_entries: int = 1 << 20

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError(
                "balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1, got "
                f"{self.balance_abs_threshold} and {self.balance_rel_threshold}"
            )


class CacheAwarePolicy(RoutingPolicy):
    """SGLang's cache-aware routing over a hashed prefix index (prefix_index.PrefixIndex)."""

    name = "cache_aware"

    def __init__(self, settings: CacheAwareSettings | None = None) -> None:
        self.settings = settings or CacheAwareSettings()
        self.index = PrefixIndex(self.settings.max_prefix_entries)

    def _imbalanced(self, candidates: Sequence[ReplicaLoad]) -> bool:
        loads = [c.load for c in candidates]
        high, low = max(loads), min(loads)
        s = self.settings
        return high - low > s.balance_abs_threshold and high > low * s.balance_rel_threshold

    def choose(self, prefix_hashes: Sequence[int], candidates: Sequence[ReplicaLoad]) -> Decision:
        total = len(prefix_hashes)
        sizes = {c.name: self.index.size(c.name) for c in candidates}
        matched = self.index.match(prefix_hashes, sizes)
        best_match = max(matched.values())
        if len(candidates) > 1 and self._imbalanced(candidates):
            chosen = _least_loaded(candidates, sizes)
            decision = Decision(chosen.name, "load_balance", matched[chosen.name], total)
        elif total and best_match / total >= self.settings.cache_threshold:
            holders = [c for c in candidates if matched[c.name] == best_match]
            decision = Decision(_least_loaded(holders).name, "prefix_hit", best_match, total)
        else:
            chosen = _least_loaded(candidates, sizes)
            decision = Decision(chosen.name, "prefix_miss", matched[chosen.name], total)
        self.index.insert(prefix_hashes, decision.replica)
        return decision

    def record(self, prefix_hashes: Sequence[int], replica: str) -> None:
        self.index.insert(prefix_hashes, replica)

    def forget(self, replica: str) -> None:
        self.index.remove_replica(replica)


POLICIES: dict[str, type[RoutingPolicy]] = {
    CacheAwarePolicy.name: CacheAwarePolicy,
    RoundRobinPolicy.name: RoundRobinPolicy,
    LeastLoadPolicy.name: LeastLoadPolicy,
}


def make_policy(name: str, settings: CacheAwareSettings | None = None) -> RoutingPolicy:
    """The policy called `name`; ValueError naming the choices for an unknown one."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
    if name == CacheAwarePolicy.name:
        return CacheAwarePolicy(settings)
    return POLICIES[name]()
