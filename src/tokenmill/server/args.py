"""Flags of `tokenmill serve` beyond the engine's."""

from __future__ import annotations

import argparse

from tokenmill.engine.async_engine import DEFAULT_HANG_TIMEOUT_S

# The engine reports at least every 0.5 s while idle; a shorter hang timeout would kill a healthy one.
MIN_HANG_TIMEOUT_S = 1.0


def _hang_timeout(text: str) -> float:
    value = float(text)
    if not (value == 0 or value >= MIN_HANG_TIMEOUT_S):  # also refuses NaN
        raise argparse.ArgumentTypeError(
            f"must be 0 (off) or at least {MIN_HANG_TIMEOUT_S:g} seconds, got {text!r}"
        )
    return value


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer <key>' (or $TOKENMILL_API_KEY)"
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests may finish after SIGTERM",
    )
    parser.add_argument(
        "--max-num-waiting-seqs",
        type=int,
        default=1024,
        help="sequences (prompts x n) admitted but without a first token yet; beyond: 429 + Retry-After",
    )
    parser.add_argument(
        "--max-num-waiting-tokens",
        type=int,
        default=1_000_000,
        help="prompt tokens of those waiting sequences; beyond: 429 + Retry-After",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="abort requests running longer than this many seconds (finish_reason 'abort'); "
        "a request's own request_timeout may only shorten it",
    )
    parser.add_argument(
        "--max-queue-time",
        type=float,
        default=None,
        help="abort requests that wait longer than this many seconds for their first token "
        "(503 if nothing was generated)",
    )
    parser.add_argument("--max-n", type=int, default=16, help="largest n a request may ask for")
    parser.add_argument("--max-body-bytes", type=int, default=8 * 2**20, help="larger bodies: 413")
    parser.add_argument(
        "--max-header-bytes",
        type=int,
        default=64 * 2**10,
        help="larger request line + headers: 431 (400 if still arriving) and the connection closes",
    )
    parser.add_argument(
        "--client-read-timeout",
        type=float,
        default=30.0,
        help="seconds a client may take to send a request's headers (else the connection closes) "
        "and its body (else 408)",
    )
    parser.add_argument(
        "--engine-hang-timeout",
        type=_hang_timeout,
        default=DEFAULT_HANG_TIMEOUT_S,
        help="seconds the engine process may stay silent while requests wait on it (it reports after "
        "every step and twice a second when idle); beyond, it is treated as dead: killed, its requests "
        "failed with 503, /health 503. Raise it if one step can take longer; 0 disables the check",
    )
    parser.add_argument(
        "--enable-debug-endpoints",
        action="store_true",
        help="serve GET /debug/invariants: the engine checks its queues and KV block ref counts "
        "(for soak tests; it walks every block, so not for production traffic)",
    )
    parser.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=5.0,
        help="seconds an idle kept-alive connection stays open",
    )
