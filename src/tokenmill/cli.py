"""`tokenmill serve | router | generate | chat | envs | quality-gate | bench throughput | bench latency |
bench serve`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import Any

from tokenmill import __version__
from tokenmill.arg_parser import ArgumentParser
from tokenmill.args import EngineArgs
from tokenmill.errors import TokenmillError

# What a sampling flag the user leaves out takes when the model has no default for it either
# (--generation-config): greedy replies of up to 256 tokens.
_CLI_SAMPLING_FALLBACKS: dict[str, Any] = {"max_tokens": 256, "temperature": 0.0, "top_p": 1.0, "top_k": 0}
_FROM_MODEL = "(default: the model's generation config, else %s)"


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    # Defaults are None so that the model's generation-config defaults can fill what is not given.
    fallback = _CLI_SAMPLING_FALLBACKS
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="most tokens to generate per reply " + _FROM_MODEL % fallback["max_tokens"],
    )
    parser.add_argument("--temperature", type=float, default=None, help="0: greedy " + _FROM_MODEL % "0")
    parser.add_argument(
        "--top-p", type=float, default=None, help="nucleus sampling mass, 1: off " + _FROM_MODEL % "1"
    )
    parser.add_argument(
        "--top-k", type=int, default=None, help="sample among the k likeliest tokens, 0: off " + _FROM_MODEL % "0"
    )
    parser.add_argument(
        "--sampling-seed", type=int, default=None, help="seed of this request's sampling (default: none)"
    )


def _sampling_params(args: argparse.Namespace, llm: Any) -> Any:
    """The flags given, else the model's defaults (--generation-config), else the CLI's fallbacks."""
    from tokenmill.sampling_params import SamplingParams

    fields = {**_CLI_SAMPLING_FALLBACKS, **llm.default_sampling_fields}
    for name in _CLI_SAMPLING_FALLBACKS:
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    return SamplingParams(**fields, seed=args.sampling_seed)


def _cmd_generate(args: argparse.Namespace) -> int:
    from tokenmill.engine.llm import LLM, stream_generate

    llm = LLM(**EngineArgs.from_cli_args(args).as_kwargs())
    params = _sampling_params(args, llm)
    prompt: Any = args.prompt
    if args.chat:
        prompt = {"prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": args.prompt}])}
    for delta in stream_generate(llm, prompt, params):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from tokenmill.engine.llm import LLM, stream_generate

    llm = LLM(**EngineArgs.from_cli_args(args).as_kwargs())
    params = _sampling_params(args, llm)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("Chatting with the model; an empty line or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        reply = []
        for delta in stream_generate(llm, {"prompt_token_ids": llm.apply_chat_template(messages)}, params):
            reply.append(delta)
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def _serve_quality_gate(args: argparse.Namespace) -> int | None:
    """`serve --quality-gate`: the exit status when the model is refused, None when it may be served."""
    from tokenmill.errors import TokenmillError
    from tokenmill.quality.serve_gate import serve_refusal

    try:
        refusal = serve_refusal(args)
    except (ValueError, OSError, RuntimeError, TokenmillError) as exc:
        print(f"tokenmill serve: error: {exc}", file=sys.stderr)
        return 2
    if refusal is None:
        return None
    print(f"tokenmill serve: refusing to start: {refusal}", file=sys.stderr)
    return 1


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="tokenmill", description="LLM inference and serving engine")
    parser.add_argument("--log-level", default="INFO", help="DEBUG | INFO | WARNING | ERROR")
    parser.add_argument("--version", action="version", version=f"tokenmill {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model_tag", nargs="?", default=None, help="model (same as --model)")
    EngineArgs.add_cli_args(serve)
    from tokenmill.server.args import add_server_args

    add_server_args(serve)
    from tokenmill.quality import serve_gate

    serve_gate.add_serve_args(serve)

    from tokenmill.router.launch import add_router_args

    add_router_args(sub.add_parser("router", help="cache-aware router over OpenAI-compatible replicas"))

    gen = sub.add_parser("generate", help="generate from one prompt, streaming to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    EngineArgs.add_cli_args(gen)
    _add_sampling_args(gen)

    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    chat.add_argument("--system", default=None, help="a system message opening the conversation")
    EngineArgs.add_cli_args(chat)
    _add_sampling_args(chat)

    sub.add_parser("envs", help="list the TOKENMILL_* environment variables (* marks those set)")

    from tokenmill.quality import cli as quality_cli

    quality_cli.add_cli_args(
        sub.add_parser(
            "quality-gate",
            help="measure a quantized model against its base (perplexity, KL, agreement); "
            "exit 1 past thresholds",
        )
    )

    from tokenmill.plan import cli as plan_cli

    plan_cli.add_cli_args(
        sub.add_parser(
            "plan",
            help="capacity and cost of a model on a GPU for a workload (no weights loaded)",
            description=plan_cli.DESCRIPTION,
        )
    )

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from tokenmill.bench import latency as bench_latency
    from tokenmill.bench import serve as bench_serve
    from tokenmill.bench import throughput as bench_throughput

    bench_throughput.add_cli_args(bench_sub.add_parser("throughput", help="offline in-process throughput"))
    bench_latency.add_cli_args(
        bench_sub.add_parser("latency", help="single-stream decode speed against the roofline")
    )
    bench_serve.add_cli_args(
        bench_sub.add_parser("serve", help="load generator for an OpenAI-compatible server")
    )
    return parser


def _ran(bench_main: Callable[[argparse.Namespace], Any], args: argparse.Namespace) -> int:
    bench_main(args)  # returns the result it wrote, not an exit code
    return 0


def _reporting_user_errors(
    command: str, run: Callable[[argparse.Namespace], int], args: argparse.Namespace
) -> int:
    """Run a command that loads a model in this process; what the user can fix (a model that is not
    there or not supported, a bad option value, a missing file) is one line naming the command and
    exit code 2, as `serve`, `plan` and `quality-gate` do, not a traceback. `--log-level debug`
    still logs the traceback."""
    try:
        return run(args)
    except (ValueError, OSError, TokenmillError) as exc:
        logging.getLogger("tokenmill").debug("tokenmill %s failed", command, exc_info=True)
        print(f"tokenmill {command}: error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command == "serve":
        from tokenmill.server.launch import run_server

        if args.quality_gate:
            refused = _serve_quality_gate(args)
            if refused is not None:
                return refused
        return run_server(args) or 0
    if args.command == "router":
        from tokenmill.router.launch import run_router

        return run_router(args)
    if args.command == "quality-gate":
        from tokenmill.quality import cli as quality_cli

        return quality_cli.main(args)
    if args.command == "plan":
        from tokenmill.plan import cli as plan_cli

        try:
            return plan_cli.main(args)
        except (ValueError, OSError, TokenmillError) as exc:
            print(f"tokenmill plan: error: {exc}", file=sys.stderr)
            return 2
    if args.command == "generate":
        return _reporting_user_errors("generate", _cmd_generate, args)
    if args.command == "chat":
        return _reporting_user_errors("chat", _cmd_chat, args)
    if args.command == "envs":
        from tokenmill import envs

        print(envs.describe())
        return 0
    if args.command == "bench":
        if args.bench_command == "throughput":
            from tokenmill.bench import throughput

            return _reporting_user_errors("bench throughput", lambda a: _ran(throughput.main, a), args)
        if args.bench_command == "latency":
            from tokenmill.bench import latency

            return _reporting_user_errors("bench latency", lambda a: _ran(latency.main, a), args)
        from tokenmill.bench import serve as bench_serve

        return bench_serve.main(args) or 0
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
