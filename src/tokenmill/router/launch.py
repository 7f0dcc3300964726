"""`tokenmill router --replica URL [--replica URL ...]` (colocated replicas) or
`tokenmill router --pd-disaggregation --prefill URL [...] --decode URL [...]` (prefill / decode
disaggregation, SGLang's flags): the flags and the server."""

from __future__ import annotations

import argparse
import sys

from tokenmill.router.policy import POLICIES, CacheAwareSettings
from tokenmill.router.replicas import HealthSettings


def add_router_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--replica", action="append", default=[], metavar="URL",
        help="an OpenAI-compatible server to route to (http://host:port); repeat for each replica",
    )  # fmt: skip
    parser.add_argument(
        "--pd-disaggregation", action="store_true",
        help="prefill / decode disaggregation (also implied by --prefill / --decode): each request prefills on a "
        "--prefill server, then a --decode server answers it from the transferred KV (docs/ROUTER.md)",
    )  # fmt: skip
    parser.add_argument(
        "--prefill", action="append", default=[], metavar="URL",
        help="a `tokenmill serve --kv-role producer` server; repeat for each",
    )  # fmt: skip
    parser.add_argument(
        "--decode", action="append", default=[], metavar="URL",
        help="a `tokenmill serve --kv-role consumer` server; repeat for each",
    )  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on")
    parser.add_argument(
        "--policy", choices=list(POLICIES), default="cache_aware",
        help="cache_aware: prefix affinity balanced against load (default); round_robin; least_load",
    )  # fmt: skip
    parser.add_argument(
        "--session-header", default="X-Session-Id",
        help="requests with the same value of this header (else the same body `user`) stay on one replica",
    )  # fmt: skip
    defaults = CacheAwareSettings()
    parser.add_argument(
        "--cache-threshold", type=float, default=defaults.cache_threshold,
        help="cache_aware: follow a replica's prefix when it covers at least this share of the prompt",
    )  # fmt: skip
    parser.add_argument(
        "--balance-abs-threshold", type=int, default=defaults.balance_abs_threshold,
        help="cache_aware: load wins over affinity past this many requests between busiest and idlest...",
    )  # fmt: skip
    parser.add_argument(
        "--balance-rel-threshold", type=float, default=defaults.balance_rel_threshold,
        help="... and when the busiest has more than this many times the idlest's load",
    )  # fmt: skip
    parser.add_argument(
        "--prefix-chunk-chars", type=int, default=64,
        help="the prompt text is keyed in chunks of this many characters (the prefix index's granularity)",
    )  # fmt: skip
    parser.add_argument(
        "--max-prefix-entries", type=int, default=defaults.max_prefix_entries,
        help="the prefix index forgets its least recently used chunks past this many",
    )  # fmt: skip
    health = HealthSettings()
    parser.add_argument("--health-interval", type=float, default=health.interval_s, help="seconds between health checks")
    parser.add_argument("--health-timeout", type=float, default=health.timeout_s, help="seconds a check may take")
    parser.add_argument(
        "--health-failure-threshold", type=int, default=health.failure_threshold,
        help="failed checks in a row that drop a replica (a refused connection drops it at once)",
    )  # fmt: skip
    parser.add_argument(
        "--health-success-threshold", type=int, default=health.success_threshold,
        help="good checks in a row that re-admit a dropped replica",
    )  # fmt: skip
    parser.add_argument(
        "--cost-per-hour", type=float, default=None,
        help="what all replicas together cost per hour: the dashboard shows $ per million output tokens",
    )  # fmt: skip
    parser.add_argument(
        "--request-timeout", type=float, default=None,
        help="seconds a replica may stay silent on a request before the client gets 504 (default: no limit)",
    )  # fmt: skip


def settings_from_args(args: argparse.Namespace):  # -> RouterSettings (app imports httpx, FastAPI)
    from tokenmill.router.app import RouterSettings

    if args.pd_disaggregation and not (args.prefill and args.decode):
        raise ValueError("--pd-disaggregation needs at least one --prefill URL and one --decode URL")
    return RouterSettings(
        replicas=args.replica,
        prefill=args.prefill,
        decode=args.decode,
        policy=args.policy,
        cache_aware=CacheAwareSettings(
            cache_threshold=args.cache_threshold,
            balance_abs_threshold=args.balance_abs_threshold,
            balance_rel_threshold=args.balance_rel_threshold,
            max_prefix_entries=args.max_prefix_entries,
        ),
        health=HealthSettings(
            interval_s=args.health_interval,
            timeout_s=args.health_timeout,
            failure_threshold=max(1, args.health_failure_threshold),
            success_threshold=max(1, args.health_success_threshold),
        ),
        session_header=args.session_header.lower(),
        prefix_chunk_chars=args.prefix_chunk_chars,
        request_timeout_s=args.request_timeout,
        cost_per_hour=args.cost_per_hour,
    )


def run_router(args: argparse.Namespace) -> int:
    import uvicorn

    from tokenmill.router.app import Router, create_router_app

    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"tokenmill router: error: {exc}", file=sys.stderr)
        return 2
    app = create_router_app(Router(settings))
    print(
        f"tokenmill router ({settings.policy}) on http://{args.host}:{args.port} over "
        + (f"prefill {', '.join(settings.prefill)} / decode {', '.join(settings.decode)}" if settings.disaggregated
           else ", ".join(settings.replicas)),
        file=sys.stderr, flush=True,
    )  # fmt: skip
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=10)
    return 0
