"""Flags of `tokenmill serve` beyond the engine's."""

from __future__ import annotations

import argparse


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
        "--max-num-waiting-seqs", type=int, default=1024, help="beyond this many queued requests: 429"
    )
    parser.add_argument(
        "--max-num-waiting-tokens",
        type=int,
        default=1_000_000,
        help="beyond this many queued prompt tokens: 429",
    )
    parser.add_argument(
        "--request-timeout", type=float, default=None, help="end requests running longer than this (s)"
    )
    parser.add_argument("--max-n", type=int, default=16, help="largest n a request may ask for")
    parser.add_argument("--max-body-bytes", type=int, default=8 * 2**20)
