"""Health checks and load reports: drops replicas that stop answering, re-admits those that recover.

Every `interval_s` each replica's GET /health is asked (200: up) and its GET /metrics read for
`num_requests_running` / `num_requests_waiting` (tokenmill's `tokenmill:` names, vLLM's `vllm:`
ones, or SGLang's `sglang:` ones, summed over labels). `failure_threshold` failed checks in a row
drop a replica; `success_threshold` good ones re-admit it. A connection refused while forwarding a
request drops it at once (`report_unreachable`): no need to wait for the next check.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from tokenmill.router.balancer import LoadBalancer
from tokenmill.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)

_LOAD_PREFIXES = ("tokenmill:", "vllm:", "sglang:")


def parse_load(metrics_text: str) -> tuple[int, int] | None:
    """(running, waiting) from a Prometheus text page; None when it reports neither."""
    wanted = {f"{prefix}num_requests_{what}": what for prefix in _LOAD_PREFIXES for what in ("running", "waiting")}
    found: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=len(line))
        what = wanted.get(line[:name_end])
        if what is None:
            continue
        after = line[line.rfind("}") + 1 :] if line[name_end] == "{" else line[name_end:]
        try:
            found[what] = found.get(what, 0.0) + float(after.split()[0])
        except (IndexError, ValueError):
            continue  # a malformed sample: the replica's other lines still count
    if not found:
        return None
    return int(found.get("running", 0)), int(found.get("waiting", 0))


_KV_TRANSFER_INFO = re.compile(
    r'^(?:tokenmill|vllm):kv_transfer_info\{[^}]*kv_role="(producer|consumer)"[^}]*kv_transfer_address="([^"]*)"'
)


def parse_kv_transfer(metrics_text: str) -> tuple[str, str] | None:
    """(kv role, transfer address) a tokenmill `--kv-role` server exports; None: none."""
    for line in metrics_text.splitlines():
        if "kv_transfer_info{" in line:
            match = _KV_TRANSFER_INFO.match(line)
            if match is not None:
                return match.group(1), match.group(2)
    return None


@dataclass(slots=True)
class HealthSettings:
    interval_s: float = 2.0
    timeout_s: float = 2.0
    failure_threshold: int = 2
    success_threshold: int = 1


@dataclass(slots=True)
class _Streak:
    failures: int = 0
    successes: int = 0
    last_error: str | None = None


class HealthChecker:
    def __init__(
        self, balancer: LoadBalancer, metrics: RouterMetrics, client: httpx.AsyncClient, settings: HealthSettings
    ) -> None:
        self.balancer = balancer
        self.metrics = metrics
        self.client = client
        self.settings = settings
        self._streaks = {name: _Streak() for name in balancer.names}
        # Each replica's last /metrics page: its load, and the router dashboard's sum over replicas.
        self.metrics_texts: dict[str, str] = {}
        # Each --kv-role server's (role, --kv-transfer-address): which consumers a producer feeds.
        self.kv_transfer: dict[str, tuple[str, str]] = {}

    def last_error(self, name: str) -> str | None:
        return self._streaks[name].last_error

    async def check_all(self, *, at_once: bool = False) -> None:
        """One check of every replica; `at_once` (start-up): one failure drops a replica."""
        await asyncio.gather(*(self._check(name, at_once) for name in self.balancer.names))

    async def run(self, on_round: Callable[[], object] | None = None) -> None:
        while True:
            await asyncio.sleep(self.settings.interval_s)
            await self.check_all()
            if on_round is not None:
                on_round()

    async def _check(self, name: str, at_once: bool = False) -> None:
        timeout = self.settings.timeout_s
        try:
            health = await self.client.get(f"{name}/health", timeout=timeout)
            if health.status_code != 200:
                raise RuntimeError(f"/health answered {health.status_code}: {health.text[:200]}")
            self._report_ok(name)
            metrics = await self.client.get(f"{name}/metrics", timeout=timeout)
            load = parse_load(metrics.text) if metrics.status_code == 200 else None
            if metrics.status_code == 200:
                self.metrics_texts[name] = metrics.text
                kv_transfer = parse_kv_transfer(metrics.text)
                if kv_transfer is not None:
                    self.kv_transfer[name] = kv_transfer
            if load is not None:
                self.balancer.set_reported_load(name, *load)
        except (httpx.HTTPError, RuntimeError) as exc:
            error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            self._report_failure(name, error, at_once=at_once)
            self.metrics_texts.pop(name, None)  # a replica that is down counts for nothing on the dashboard

    def _report_ok(self, name: str) -> None:
        streak = self._streaks[name]
        streak.failures = 0
        streak.successes += 1
        if not self.balancer.is_healthy(name) and streak.successes >= self.settings.success_threshold:
            logger.warning("replica %s is healthy again; re-admitting it", name)
            streak.last_error = None
            self.balancer.set_healthy(name, True)
            self.metrics.health_transitions.labels(name, "up").inc()

    def _report_failure(self, name: str, error: str, *, at_once: bool = False) -> None:
        streak = self._streaks[name]
        streak.successes = 0
        streak.failures += 1
        streak.last_error = error
        threshold = 1 if at_once else self.settings.failure_threshold
        if self.balancer.is_healthy(name) and streak.failures >= threshold:
            logger.warning("dropping replica %s: %s", name, error)
            self.balancer.set_healthy(name, False)
            self.metrics.health_transitions.labels(name, "down").inc()

    def report_unreachable(self, name: str, error: str) -> None:
        """A forwarded request could not connect: the replica is dropped now."""
        self._report_failure(name, error, at_once=True)
