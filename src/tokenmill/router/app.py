"""The router's HTTP side: OpenAI routes forwarded by the policy, everything else to the idlest
replica, its own /health and /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from tokenmill.dashboard import MetricsHistory, dashboard_router, text_source
from tokenmill.router.balancer import LoadBalancer, NoReplicaError
from tokenmill.router.disaggregation import decode_body, new_transfer_id, prefill_body
from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.policy import CacheAwareSettings, make_policy
from tokenmill.router.proxy import (
    REPLICA_HEADER,
    UpstreamRelease,
    error_body,
    relay,
    request_headers,
    response_headers,
)
from tokenmill.router.replicas import HealthChecker, HealthSettings
from tokenmill.router.request_key import prefix_hashes, session_of

logger = logging.getLogger("tokenmill.router")

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions")
# Loading an adapter must reach every replica, which a forward to one cannot do: refused, naming why.
FAN_OUT_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class RouterSettings:
    # Colocated mode: the replicas. Disaggregated mode (`prefill` and `decode` given, `replicas`
    # empty): each request prefills on a prefill server, then a decode server answers it.
    replicas: list[str] = field(default_factory=list)
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    policy: str = "cache_aware"
    cache_aware: CacheAwareSettings = field(default_factory=CacheAwareSettings)
    health: HealthSettings = field(default_factory=HealthSettings)
    session_header: str = "x-session-id"
    prefix_chunk_chars: int = 64
    connect_timeout_s: float = 5.0
    request_timeout_s: float | None = None  # a replica's silence before 504; None: no limit
    cost_per_hour: float | None = None  # --cost-per-hour of all replicas together: the dashboard's $ / M tokens

    def __post_init__(self) -> None:
        self.prefill = [normalize_url(url) for url in self.prefill]
        self.decode = [normalize_url(url) for url in self.decode]
        if self.prefill or self.decode:
            if self.replicas:
                raise ValueError("give either --replica URLs or --prefill and --decode URLs, not both")
            if not self.prefill or not self.decode:
                raise ValueError("disaggregated mode needs at least one --prefill URL and one --decode URL")
            self.replicas = self.prefill + self.decode
        self.replicas = [normalize_url(url) for url in self.replicas]
        if not self.replicas:
            raise ValueError("give at least one --replica URL (or --prefill and --decode URLs)")
        if len(set(self.replicas)) != len(self.replicas):
            raise ValueError(f"--replica / --prefill / --decode repeats a URL: {self.replicas}")
        if self.cost_per_hour is not None and not self.cost_per_hour > 0:
            raise ValueError(f"--cost-per-hour must be above 0, got {self.cost_per_hour}")
        if self.prefix_chunk_chars < 1:
            raise ValueError(f"--prefix-chunk-chars must be at least 1, got {self.prefix_chunk_chars}")


    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill)


def normalize_url(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"a replica URL must start with http:// or https://, got {url!r}")
    return url.rstrip("/")


class _Unavailable(Exception):
    """The request could not be placed on any replica: what the client gets instead."""

    def __init__(self, status_code: int, message: str, error_type: str) -> None:
        super().__init__(message)
        self.status_code, self.message, self.error_type = status_code, message, error_type

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.status_code, self.error_type), status_code=self.status_code)


class Router:
    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.balancer = LoadBalancer(settings.replicas, make_policy(settings.policy, settings.cache_aware))
        self.metrics = RouterMetrics(self.balancer)
        self.client: httpx.AsyncClient | None = None
        self.health: HealthChecker | None = None
        self._health_task: asyncio.Task | None = None
        # The dashboard sums the replicas' last /metrics pages (tokenmill's names), sampled after
        # each round of health checks.
        self.dashboard = MetricsHistory(
            text_source(self._replica_metrics_text),
            "tokenmill:",
            interval_s=max(1.0, settings.health.interval_s),
            window_s=max(10.0, 2 * settings.health.interval_s),
            cost_per_hour=settings.cost_per_hour,
        )

    def _replica_metrics_text(self) -> str:
        return "\n".join(self.health.metrics_texts.values()) if self.health is not None else ""

    async def start(self) -> None:
        timeout = httpx.Timeout(self.settings.request_timeout_s, connect=self.settings.connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits)
        self.health = HealthChecker(self.balancer, self.metrics, self.client, self.settings.health)
        await self.health.check_all(at_once=True)  # replicas still starting join once they answer
        self.dashboard.sample()
        self._health_task = asyncio.create_task(self.health.run(on_round=self.dashboard.maybe_sample))

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self.client is not None:
            await self.client.aclose()

    # -- generation routes --------------------------------------------------------------------

    async def forward_generation(self, request: Request, path: str) -> Response:
        body = await request.body()
        try:
            payload = json.loads(body)
        except ValueError as exc:
            return _Unavailable(400, f"the request body is not valid JSON: {exc}", "invalid_request_error").response()
        if not isinstance(payload, dict):
            return _Unavailable(400, "the request body must be a JSON object", "invalid_request_error").response()
        hashes = prefix_hashes(path, payload, self.settings.prefix_chunk_chars)
        session = session_of(request.headers.get(self.settings.session_header), payload)
        headers = request_headers(request.headers)
        if not self.settings.disaggregated:
            stream = payload.get("stream") is True
            return await self._forward(path, body, headers, hashes, session, stream=stream, pool=None)
        if "kv_transfer_params" in payload:
            return _Unavailable(
                400, "kv_transfer_params is set by the router in disaggregated mode; leave it out",
                "invalid_request_error",
            ).response()  # fmt: skip
        # Prefill on a producer; its blocks travel to the consumers under the transfer id.
        transfer_id: str | None = new_transfer_id()
        # A session sticks to one server of each pool: its keys are kept apart per pool.
        prefill_session, decode_session = (None, None) if session is None else (f"prefill|{session}", f"decode|{session}")
        prefill = await self._forward(
            path, json.dumps(prefill_body(payload, transfer_id)).encode(), headers, hashes, prefill_session,
            stream=False, pool=self._prefill_pool,
        )  # fmt: skip
        if prefill.status_code == 200:
            self.metrics.pd_prefills.labels("ok").inc()
        elif 400 <= prefill.status_code < 500 and prefill.status_code != 429:
            # The request itself is bad (a consumer would refuse it too): the client gets why.
            self.metrics.pd_prefills.labels("refused").inc()
            return prefill
        else:
            # No producer could prefill it: the consumer computes the prompt, without waiting.
            self.metrics.pd_prefills.labels("failed").inc()
            logger.warning("prefill failed (%d); the decode server computes the prompt", prefill.status_code)
            transfer_id = None
        decode_pool = self._decode_pool
        if transfer_id is not None:
            producer = prefill.headers.get(REPLICA_HEADER, "")
            fed = self._consumers_fed_by(producer)
            if fed is not None and fed & set(self.balancer.healthy_names()):
                decode_pool = fed
            elif fed is not None:
                # Its blocks went to a consumer that is down: any decode server computes the prompt.
                logger.warning("no healthy decode server receives %s's KV blocks; the prompt is recomputed", producer)
                transfer_id = None
        stream = payload.get("stream") is True
        decode = json.dumps(decode_body(payload, transfer_id)).encode()
        return await self._forward(path, decode, headers, hashes, decode_session, stream=stream, pool=decode_pool)

    def _consumers_fed_by(self, producer: str) -> frozenset[str] | None:
        """The decode servers at the --kv-transfer-address the producer sends to (they report it on
        /metrics); None when the producer's is unknown (not reported yet, or not tokenmill)."""
        assert self.health is not None
        known = self.health.kv_transfer
        if producer not in known:
            return None
        address = known[producer][1]
        return frozenset(name for name in self.settings.decode if known.get(name) == ("consumer", address))

    @property
    def _prefill_pool(self) -> frozenset[str]:
        return frozenset(self.settings.prefill)

    @property
    def _decode_pool(self) -> frozenset[str]:
        return frozenset(self.settings.decode)

    def _outside(self, pool: frozenset[str] | None) -> set[str]:
        """Replicas a request for `pool` must not go to (None: every replica may take it)."""
        return set() if pool is None else set(self.balancer.names) - pool

    async def _forward(
        self, path: str, body: bytes, headers: dict[str, str], hashes: list, session: str | None, *,
        stream: bool, pool: frozenset[str] | None,
    ) -> Response:  # fmt: skip
        """Route one request within `pool`, retrying elsewhere in it while no byte reached the client."""
        tried = self._outside(pool)
        last_failure: Response | None = None
        while True:
            try:
                decision = self.balancer.pick(hashes, session, exclude=tried)
            except NoReplicaError as exc:
                if last_failure is not None:
                    return last_failure
                self.metrics.no_replica.inc()
                return _Unavailable(503, str(exc), "service_unavailable").response()
            replica = decision.replica
            tried.add(replica)
            self.metrics.on_routed(decision)
            try:
                return await self._send(replica, "POST", path, body, headers, stream=stream)
            except _Retry as retry:
                last_failure = retry.response
                self.metrics.retries.labels(replica, retry.reason).inc()
                logger.warning("request to %s failed before any byte reached the client (%s); retrying elsewhere",
                               replica, retry.detail)  # fmt: skip
            except _Unavailable as exc:
                return exc.response()

    async def _send(
        self, replica: str, method: str, path: str, body: bytes, headers: dict[str, str], *, stream: bool
    ) -> Response:
        """One attempt. Raises _Retry when nothing reached the client yet and another replica may
        serve it: the connection failed, the replica closed it before answering, or it answered 5xx
        or 429."""
        assert self.client is not None and self.health is not None
        self.balancer.begin(replica)
        handed_over = False
        try:
            upstream = await self.client.send(
                self.client.build_request(method, f"{replica}{path}", content=body, headers=headers), stream=True
            )
            retryable = upstream.status_code >= 500 or upstream.status_code == 429  # overloaded: try another
            if retryable or not stream:
                # A failure answer, or a whole JSON answer: read it all before the client sees
                # anything, so a replica dying meanwhile is still a retry.
                await upstream.aread()
                await upstream.aclose()
                out = Response(upstream.content, upstream.status_code, response_headers(upstream.headers, replica))
                if retryable:
                    raise _Retry(f"status_{upstream.status_code}", f"{replica} answered {upstream.status_code}", out)
                self.metrics.responses.labels(replica, str(upstream.status_code)).inc()
                return out
            self.metrics.responses.labels(replica, str(upstream.status_code)).inc()
            is_sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
            handed_over = True
            release = UpstreamRelease(upstream, lambda: self.balancer.end(replica))
            return StreamingResponse(
                relay(upstream, replica, is_sse=is_sse, on_cut=lambda reason: self._on_cut(replica, reason),
                      release=release),
                status_code=upstream.status_code,
                headers=response_headers(upstream.headers, replica),
                background=BackgroundTask(release),
            )  # fmt: skip
        except httpx.TimeoutException as exc:
            if isinstance(exc, (httpx.ConnectTimeout, httpx.PoolTimeout)):
                self.health.report_unreachable(replica, f"{type(exc).__name__}: {exc}")
                raise _Retry("connect", f"{type(exc).__name__}: {exc}", None) from exc
            raise _Unavailable(
                504, f"the replica {replica} sent nothing for --request-timeout "
                f"{self.settings.request_timeout_s:g} s", "timeout_error",
            ) from exc  # fmt: skip
        except httpx.TransportError as exc:
            self.health.report_unreachable(replica, f"{type(exc).__name__}: {exc}")
            raise _Retry("connect" if isinstance(exc, httpx.ConnectError) else "disconnect",
                         f"{type(exc).__name__}: {exc}", None) from exc  # fmt: skip
        finally:
            if not handed_over:
                self.balancer.end(replica)

    def _on_cut(self, replica: str, reason: str) -> None:
        assert self.health is not None
        logger.warning("%s", reason)
        self.metrics.stream_errors.labels(replica).inc()
        self.health.report_unreachable(replica, reason)

    # -- everything else ----------------------------------------------------------------------

    async def forward_other(self, request: Request, path: str) -> Response:
        """Model lists, tokenization, version: the idlest healthy replica answers (all serve the
        same model); retried elsewhere on connection failures like the generation routes."""
        body = await request.body()
        headers = request_headers(request.headers)
        if request.url.query:
            path = f"{path}?{request.url.query}"
        # Disaggregated: the decode servers answer (they serve the clients' streams).
        tried = self._outside(self._decode_pool if self.settings.disaggregated else None)
        last_failure: Response | None = None
        while True:
            try:
                replica = self.balancer.least_loaded(exclude=tried)
            except NoReplicaError as exc:
                if last_failure is not None:
                    return last_failure
                self.metrics.no_replica.inc()
                return _Unavailable(503, str(exc), "service_unavailable").response()
            tried.add(replica)
            try:
                return await self._send(replica, request.method, path, body, headers, stream=False)
            except _Retry as retry:
                last_failure = retry.response
                self.metrics.retries.labels(replica, retry.reason).inc()
            except _Unavailable as exc:
                return exc.response()

    def health_report(self) -> tuple[bool, dict]:
        assert self.health is not None
        roles = {name: "prefill" for name in self.settings.prefill} | {name: "decode" for name in self.settings.decode}
        replicas = {
            name: {
                "role": roles.get(name, "replica"),
                "healthy": self.balancer.is_healthy(name),
                "in_flight": self.balancer.load_of(name).in_flight,
                "running": self.balancer.load_of(name).running,
                "waiting": self.balancer.load_of(name).waiting,
                "last_error": self.health.last_error(name),
            }
            for name in self.balancer.names
        }
        healthy = self.balancer.healthy_names()
        if self.settings.disaggregated:
            # Without a prefill server the decode servers still answer (computing the prompts);
            # without a decode server nothing does.
            ok = any(name in healthy for name in self.settings.decode)
            return ok, {"policy": self.settings.policy, "mode": "disaggregated", "replicas": replicas}
        return bool(healthy), {"policy": self.settings.policy, "mode": "colocated", "replicas": replicas}


class _Retry(Exception):
    def __init__(self, reason: str, detail: str, response: Response | None) -> None:
        super().__init__(detail)
        self.reason, self.detail, self.response = reason, detail, response


def create_router_app(router: Router) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="tokenmill router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    async def health() -> Response:
        """200 while at least one replica is admitted; the body lists each replica either way."""
        ok, report = router.health_report()
        report["status"] = "ok" if ok else "unavailable"
        return JSONResponse(report, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    app.include_router(dashboard_router(router.dashboard, None, title="tokenmill router"))

    for path in GENERATION_PATHS:

        async def generate(request: Request, path: str = path) -> Response:
            return await router.forward_generation(request, path)

        app.add_api_route(path, generate, methods=["POST"])

    for path in FAN_OUT_PATHS:

        async def refuse(path: str = path) -> Response:
            return _Unavailable(
                501, f"the router does not fan {path} out to its replicas; call it on each replica",
                "not_implemented",
            ).response()  # fmt: skip

        app.add_api_route(path, refuse, methods=["POST"])

    @app.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def other(request: Request, rest: str) -> Response:
        return await router.forward_other(request, "/" + rest)

    return app
