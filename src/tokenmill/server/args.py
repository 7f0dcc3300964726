"""Flags of `tokenmill serve` beyond the engine's (those, --served-model-name among them, are EngineArgs')."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from tokenmill.engine.async_engine import DEFAULT_HANG_TIMEOUT_S
from tokenmill.metrics import METRICS_PREFIXES
from tokenmill.server.operator_options import add_operator_args
from tokenmill.server.protocol import MAX_N

# The engine reports at least every 0.5 s while idle; a shorter hang timeout would kill a healthy one.
MIN_HANG_TIMEOUT_S = 1.0


def _hang_timeout(text: str) -> float:
    value = float(text)
    if not (value == 0 or value >= MIN_HANG_TIMEOUT_S):  # also refuses NaN
        raise argparse.ArgumentTypeError(
            f"must be 0 (off) or at least {MIN_HANG_TIMEOUT_S:g} seconds, got {text!r}"
        )
    return value


def _int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high]; argparse names the flag in the error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f"at least {low}" if high is None else f"between {low} and {high}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text!r}")
        return value

    return parse


def _seconds(*, allow_zero: bool) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds, > 0 (or >= 0 when `allow_zero`)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            bound = "0 or more" if allow_zero else "more than 0"
            raise argparse.ArgumentTypeError(f"must be a finite number of seconds, {bound}; got {text!r}")
        return value

    return parse


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=_int_in(1, 65535), default=8000, help="port to listen on")
    add_operator_args(parser)
    parser.add_argument(
        "--shutdown-timeout",
        type=_seconds(allow_zero=True),
        default=30.0,
        help="seconds in-flight requests may finish after SIGTERM",
    )
    parser.add_argument(
        "--max-num-waiting-seqs",
        type=_int_in(1),
        default=1024,
        help="sequences (prompts x n) admitted but without a first token yet; beyond: 429 + Retry-After",
    )
    parser.add_argument(
        "--max-num-waiting-tokens",
        type=_int_in(1),
        default=1_000_000,
        help="prompt tokens of those waiting sequences; beyond: 429 + Retry-After",
    )
    parser.add_argument(
        "--request-timeout",
        type=_seconds(allow_zero=False),
        default=None,
        help="abort requests running longer than this many seconds (finish_reason 'abort'); "
        "a request's own request_timeout may only shorten it",
    )
    parser.add_argument(
        "--max-queue-time",
        type=_seconds(allow_zero=False),
        default=None,
        help="abort requests that wait longer than this many seconds for their first token "
        "(503 if nothing was generated)",
    )
    parser.add_argument(
        "--max-n",
        type=_int_in(1, MAX_N),
        default=16,
        help=f"largest n a request may ask for (at most {MAX_N})",
    )
    parser.add_argument("--max-body-bytes", type=_int_in(1), default=8 * 2**20, help="larger bodies: 413")
    parser.add_argument(
        "--max-header-bytes",
        type=_int_in(1),
        default=64 * 2**10,
        help="larger request line + headers: 431 (400 if still arriving) and the connection closes",
    )
    parser.add_argument(
        "--client-read-timeout",
        type=_seconds(allow_zero=False),
        default=30.0,
        help="seconds a client may take to send a request's headers (else the connection closes) "
        "and its body (else 408)",
    )
    parser.add_argument(
        "--stream-write-timeout",
        type=_seconds(allow_zero=True),
        default=120.0,
        help="seconds a streamed response may wait on a client that stopped reading (socket buffers "
        "full) before the stream is closed and its request aborted; 0: wait forever",
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
        "--data-parallel-size",
        type=_int_in(1, 64),
        default=1,
        help="engine cores behind this server, each a whole engine (own process, model copy and KV "
        "pool; on GPUs, core r gets the r-th visible device); each request goes to one by prefix "
        "affinity balanced against load (docs/ROUTER.md). If any core dies the server is unavailable",
    )
    parser.add_argument(
        "--api-server-count",
        type=_int_in(1, 64),
        default=1,
        help="API server processes (HTTP, tokenization, detokenization, streaming) sharing the port in "
        "front of the engine: more than one when one process's CPU limits a loaded server. /metrics "
        "from any of them covers all; --max-num-waiting-seqs / -tokens are split evenly between them; "
        "needs runtime LoRA updating off",
    )
    parser.add_argument(
        "--enable-debug-endpoints",
        action="store_true",
        help="serve GET /debug/invariants: the engine checks its queues and KV block ref counts "
        "(for soak tests; it walks every block, so not for production traffic)",
    )
    parser.add_argument(
        "--keep-alive-timeout",
        type=_seconds(allow_zero=False),
        default=20.0,
        help="seconds an idle kept-alive connection stays open (longer than clients keep theirs: aiohttp "
        "15 s, httpx 5 s, so the server never closes one as a client reuses it: that race resets requests)",
    )
    add_logging_args(parser)
    add_tool_and_reasoning_args(parser)
    add_lora_serving_args(parser)
    add_observability_args(parser)


def add_observability_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-prefix", choices=sorted(METRICS_PREFIXES), default="tokenmill",
        help="the prefix of every /metrics name: tokenmill (tokenmill:time_to_first_token_seconds...) or vllm "
        "(vLLM's exact names, for dashboards and alerts written for vLLM)",
    )  # fmt: skip
    parser.add_argument(
        "--cost-per-hour", type=_price, default=None, metavar="DOLLARS",
        help="what the hardware serving this costs per hour: /dashboard shows $ per million output tokens",
    )  # fmt: skip


def _price(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a price in dollars per hour, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite price above 0 dollars per hour, got {text!r}")
    return value


def add_logging_args(parser: argparse.ArgumentParser) -> None:
    """What the server logs beyond uvicorn's access log (docs/TRACING.md, "Logs")."""
    parser.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log each request as it arrives (id, sampling params, prompt length, the prompt and its "
        "token ids cut to --max-log-len) and each of its sequences as it finishes",
    )
    parser.add_argument(
        "--max-log-len",
        type=_int_in(0),
        default=None,
        help="--enable-log-requests: characters of prompt and prompt token ids logged (default: all)",
    )
    parser.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no periodic stats line (prompt / generation tokens/s, running / waiting, KV cache %%, prefix "
        "hit %%; every $TOKENMILL_LOG_STATS_INTERVAL s, default 10)",
    )


def add_lora_serving_args(parser: argparse.ArgumentParser) -> None:
    """Which LoRA adapters the server serves (the engine's --enable-lora, --max-loras, --max-lora-rank
    and --max-cpu-loras are EngineArgs')."""
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) served from start-up, each as name=path or as JSON "
        '{"name": ..., "path": ..., "base_model_name": ...}; a request picks one with "model": name. '
        "Needs --enable-lora",
    )
    parser.add_argument(
        "--lora-allowed-dirs",
        nargs="+",
        default=None,
        metavar="DIR",
        help="POST /v1/load_lora_adapter loads only adapters inside one of these directories (symlinks "
        "resolved); a path elsewhere is refused with 403. Unset: any path the server can read",
    )
    parser.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind --api-key like every "
        "/v1 route); also TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING=true. Needs --enable-lora",
    )


def add_tool_and_reasoning_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="let requests with tools and tool_choice 'auto' (the default with tools) have the model "
        "decide whether to call one; needs --tool-call-parser to read the calls from its output",
    )
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        help="how this model writes tool calls: hermes, llama3_json, mistral or pythonic",
    )
    parser.add_argument(
        "--reasoning-parser",
        default=None,
        help="how this model marks its reasoning (deepseek_r1, qwen3): moved into reasoning_content, "
        "and output constraints apply after it",
    )
    parser.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat_template in requests (else such a request is refused with 400)",
    )
