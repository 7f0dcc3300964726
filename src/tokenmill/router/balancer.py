"""The dispatcher's state: which replicas serve, how loaded each is, which session went where.

`LoadBalancer.pick` answers "where does this request go" from the policy, the replicas' health and
load, and session affinity; `begin` / `end` keep the dispatcher's own in-flight counts. Shared by
the HTTP router (replicas are URLs) and data parallelism (replicas are engine cores).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from tokenmill.router.policy import Decision, ReplicaLoad, RoutingPolicy


class NoReplicaError(Exception):
    """No healthy replica is left to take the request."""


@dataclass(slots=True)
class _Replica:
    load: ReplicaLoad
    healthy: bool = True


class LoadBalancer:
    def __init__(
        self, names: Sequence[str], policy: RoutingPolicy, *, max_sessions: int = 100_000
    ) -> None:
        if not names:
            raise ValueError("a balancer needs at least one replica")
        if len(set(names)) != len(names):
            raise ValueError(f"replica names must be distinct, got {list(names)}")
        self.policy = policy
        self.max_sessions = max_sessions
        self._replicas = {name: _Replica(ReplicaLoad(name)) for name in names}
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session id -> replica, LRU order

    @property
    def names(self) -> list[str]:
        return list(self._replicas)

    def healthy_names(self) -> list[str]:
        return [name for name, r in self._replicas.items() if r.healthy]

    def is_healthy(self, name: str) -> bool:
        return self._replicas[name].healthy

    def load_of(self, name: str) -> ReplicaLoad:
        return self._replicas[name].load

    # -- what the replicas report --------------------------------------------------------------

    def set_reported_load(self, name: str, running: int, waiting: int) -> None:
        load = self._replicas[name].load
        load.running, load.waiting = running, waiting

    def set_healthy(self, name: str, healthy: bool) -> None:
        """A replica dropped forgets its prefixes and sessions: a restarted one caches nothing."""
        replica = self._replicas[name]
        if replica.healthy and not healthy:
            self.policy.forget(name)
            for session in [s for s, owner in self._sessions.items() if owner == name]:
                del self._sessions[session]
            replica.load.running = replica.load.waiting = 0
        replica.healthy = healthy

    # -- dispatching ---------------------------------------------------------------------------

    def pick(
        self, prefix_hashes: Sequence[int], session: str | None = None, exclude: Collection[str] = ()
    ) -> Decision:
        """The replica for a request. A session sticks to its replica while that one is healthy and
        not excluded; otherwise the policy chooses, and the session follows the choice."""
        candidates = [r.load for name, r in self._replicas.items() if r.healthy and name not in exclude]
        if not candidates:
            raise NoReplicaError(self._no_replica_reason(exclude))
        decision = None
        if session is not None:
            owner = self._sessions.get(session)
            if owner is not None and any(c.name == owner for c in candidates):
                self._sessions.move_to_end(session)
                self.policy.record(prefix_hashes, owner)
                decision = Decision(owner, "session", 0, len(prefix_hashes))
        if decision is None:
            decision = self.policy.choose(prefix_hashes, candidates)
            if session is not None:
                self._remember_session(session, decision.replica)
        return decision

    def _remember_session(self, session: str, replica: str) -> None:
        self._sessions[session] = replica
        self._sessions.move_to_end(session)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)

    def _no_replica_reason(self, exclude: Collection[str]) -> str:
        down = [name for name, r in self._replicas.items() if not r.healthy]
        parts = []
        if down:
            parts.append(f"unhealthy: {', '.join(down)}")
        if exclude:
            parts.append(f"already tried: {', '.join(sorted(exclude))}")
        return f"no replica can take the request ({'; '.join(parts) or 'none configured'})"

    def begin(self, name: str) -> None:
        self._replicas[name].load.in_flight += 1

    def end(self, name: str) -> None:
        load = self._replicas[name].load
        load.in_flight = max(0, load.in_flight - 1)

    def least_loaded(self, exclude: Collection[str] = ()) -> str:
        """For requests with nothing to key on (model lists, tokenization): the idlest healthy one."""
        candidates = [r.load for name, r in self._replicas.items() if r.healthy and name not in exclude]
        if not candidates:
            raise NoReplicaError(self._no_replica_reason(exclude))
        return min(candidates, key=lambda c: c.load).name
