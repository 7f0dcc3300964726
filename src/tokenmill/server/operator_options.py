"""Operator options of `tokenmill serve` beyond the API itself: API keys (several, from a file),
CORS, TLS and a root path behind a proxy (vLLM's flags)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from tokenmill import envs


def add_operator_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--api-key", nargs="+", default=None, metavar="KEY",
        help="require 'Authorization: Bearer <key>' with one of these keys (or $TOKENMILL_API_KEY)",
    )  # fmt: skip
    parser.add_argument(
        "--api-key-file", default=None, metavar="FILE",
        help="more accepted API keys, one per line (blank lines and lines starting with # skipped)",
    )  # fmt: skip
    parser.add_argument(
        "--allowed-origins", type=_json_list("--allowed-origins"), default=[],
        help='CORS: origins allowed to call the API from a browser, a JSON list such as \'["https://app.example"]\' '
        "or '[\"*\"]' (default: none, no CORS headers)",
    )  # fmt: skip
    parser.add_argument(
        "--allowed-methods", type=_json_list("--allowed-methods"), default=["*"], help="CORS: allowed methods (JSON list)"
    )
    parser.add_argument(
        "--allowed-headers", type=_json_list("--allowed-headers"), default=["*"], help="CORS: allowed headers (JSON list)"
    )
    parser.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    parser.add_argument("--ssl-keyfile", default=None, help="TLS: the private key file (with --ssl-certfile)")
    parser.add_argument("--ssl-certfile", default=None, help="TLS: the certificate file (with --ssl-keyfile)")
    parser.add_argument("--ssl-ca-certs", default=None, help="TLS: CA certificates to verify clients with")
    parser.add_argument(
        "--disable-uvicorn-access-log", action="store_true",
        help="no access log line per HTTP request (on by default, as in vLLM)",
    )  # fmt: skip
    parser.add_argument(
        "--root-path", default="",
        help="the path prefix a reverse proxy serves the API under (it strips the prefix before forwarding)",
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class CorsOptions:
    allowed_origins: tuple[str, ...]
    allowed_methods: tuple[str, ...]
    allowed_headers: tuple[str, ...]
    allow_credentials: bool


def api_keys_from_args(args: argparse.Namespace) -> tuple[str, ...]:
    """Every accepted API key: --api-key, --api-key-file, else $TOKENMILL_API_KEY. ValueError naming
    the file when it cannot be read or holds no key."""
    keys = list(args.api_key or ())
    if args.api_key_file:
        path = Path(args.api_key_file)
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"--api-key-file {path}: {exc.strerror or exc}") from None
        from_file = [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
        if not from_file:
            raise ValueError(f"--api-key-file {path} holds no key (one per line)")
        keys += from_file
    if not keys:
        env_key = envs.TOKENMILL_API_KEY.get()
        if env_key:
            keys.append(env_key)
    return tuple(dict.fromkeys(keys))


def cors_from_args(args: argparse.Namespace) -> CorsOptions | None:
    if not args.allowed_origins:
        if args.allow_credentials:
            raise ValueError("--allow-credentials needs --allowed-origins (CORS is off without origins)")
        return None
    if args.allow_credentials and "*" in args.allowed_origins:
        raise ValueError(
            "--allow-credentials with --allowed-origins '[\"*\"]': browsers refuse credentials for any origin; "
            "list the origins"
        )
    return CorsOptions(
        tuple(args.allowed_origins), tuple(args.allowed_methods), tuple(args.allowed_headers), args.allow_credentials
    )


def check_tls_args(args: argparse.Namespace) -> None:
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both (or neither)")
    for flag, value in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile), ("--ssl-ca-certs", args.ssl_ca_certs)):
        if value and not Path(value).is_file():
            raise ValueError(f"{flag} {value}: no such file")


def _json_list(flag: str):  # noqa: ANN202 - an argparse type
    def parse(text: str) -> list[str]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            raise argparse.ArgumentTypeError(f"{flag} must be a JSON list of strings, e.g. '[\"*\"]'; got {text!r}") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"{flag} must be a JSON list of strings, e.g. '[\"*\"]'; got {text!r}")
        return value

    return parse
