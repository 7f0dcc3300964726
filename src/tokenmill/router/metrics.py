"""The router's own Prometheus metrics (GET /metrics on the router), prefix `tokenmill_router:`.

The affinity hit rate is hits / queries: a query is a request the cache-aware policy keyed on a
prompt prefix, a hit one it sent to the replica already holding at least the threshold's share of
that prefix (session-routed requests count as hits when they were sent back to their replica).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tokenmill.router.balancer import LoadBalancer
from tokenmill.router.policy import Decision

PREFIX = "tokenmill_router:"


class RouterMetrics:
    def __init__(self, balancer: LoadBalancer) -> None:
        self.registry = CollectorRegistry()
        self._num_queries = self._num_hits = 0  # what the two affinity counters hold, for the rate
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}requests", "requests sent to each replica (retries included), by routing reason",
            ["replica", "reason"], registry=r,
        )  # fmt: skip
        self.responses = Counter(
            f"{PREFIX}responses", "responses relayed to clients, by replica and HTTP status", ["replica", "status"],
            registry=r,
        )  # fmt: skip
        self.affinity_queries = Counter(
            f"{PREFIX}affinity_queries", "requests routed with a prompt-prefix key", registry=r
        )
        self.affinity_hits = Counter(
            f"{PREFIX}affinity_hits", "keyed requests sent to the replica holding their prefix", registry=r
        )
        self._hit_rate = Gauge(
            f"{PREFIX}affinity_hit_rate", "affinity_hits_total / affinity_queries_total (0 before any query)",
            registry=r,
        )  # fmt: skip
        self._hit_rate.set_function(self._affinity_hit_rate)
        self.prefix_match_ratio = Histogram(
            f"{PREFIX}prefix_match_ratio", "share of the prompt's chunks the chosen replica was known to hold",
            buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0), registry=r,
        )  # fmt: skip
        self.retries = Counter(
            f"{PREFIX}retries", "requests retried on another replica, by what failed", ["replica", "reason"],
            registry=r,
        )  # fmt: skip
        self.stream_errors = Counter(
            f"{PREFIX}stream_errors", "responses cut off by their replica after the first byte", ["replica"],
            registry=r,
        )  # fmt: skip
        self.no_replica = Counter(
            f"{PREFIX}no_replica", "requests refused with 503: no healthy replica was left", registry=r
        )
        self.pd_prefills = Counter(
            f"{PREFIX}pd_prefills", "disaggregated mode: prefill requests by outcome (ok; refused: 4xx, relayed "
            "to the client; failed: no prefill server could take it, the decode server computed the prompt)",
            ["outcome"], registry=r,
        )  # fmt: skip
        self.health_transitions = Counter(
            f"{PREFIX}replica_health_transitions", "replicas dropped (to=down) and re-admitted (to=up)",
            ["replica", "to"], registry=r,
        )  # fmt: skip
        self._gauge("replica_healthy", "1 while the replica is admitted, 0 while dropped", balancer,
                    lambda name: float(balancer.is_healthy(name)))  # fmt: skip
        self._gauge("replica_in_flight", "requests the router has on the replica now", balancer,
                    lambda name: float(balancer.load_of(name).in_flight))  # fmt: skip
        self._gauge("replica_num_requests_running", "running requests the replica last reported", balancer,
                    lambda name: float(balancer.load_of(name).running))  # fmt: skip
        self._gauge("replica_num_requests_waiting", "waiting requests the replica last reported", balancer,
                    lambda name: float(balancer.load_of(name).waiting))  # fmt: skip

    def _gauge(self, name: str, doc: str, balancer: LoadBalancer, read: Callable[[str], float]) -> None:
        gauge = Gauge(f"{PREFIX}{name}", doc, ["replica"], registry=self.registry)
        for replica in balancer.names:
            gauge.labels(replica).set_function(lambda replica=replica: read(replica))

    def _affinity_hit_rate(self) -> float:
        return self._num_hits / self._num_queries if self._num_queries else 0.0

    def on_routed(self, decision: Decision) -> None:
        self.requests.labels(decision.replica, decision.reason).inc()
        if decision.total_chunks and decision.reason != "round_robin" and decision.reason != "least_load":
            self.affinity_queries.inc()
            self._num_queries += 1
            if decision.reason in ("prefix_hit", "session"):
                self.affinity_hits.inc()
                self._num_hits += 1
            if decision.reason != "session":
                self.prefix_match_ratio.observe(decision.matched_chunks / decision.total_chunks)

    def render(self) -> bytes:
        return generate_latest(self.registry)
