"""`tokenmill serve | generate | chat | bench throughput | bench serve`."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any


def _bytes(value: str) -> int:
    """'4GiB', '512MiB', '1e9' or a plain byte count."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    text = value.strip().lower()
    for suffix, scale in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * scale)
    return int(float(text))


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens per scheduler step, prefill chunks and decodes together "
        "(default: 512 on the CPU, 8192 on a GPU)",
    )
    parser.add_argument(
        "--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (overrides sizing)"
    )
    parser.add_argument(
        "--kv-cache-memory", type=_bytes, default=None, help="CPU: KV pool size in bytes, e.g. 2GiB"
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--load-format", choices=["auto", "safetensors", "gguf", "dummy"], default="auto")
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--enforce-eager", action="store_true", help="GPU: no CUDA graphs")
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prepare and launch the next step while the device runs this one (default: on for CUDA)",
    )
    parser.add_argument(
        "--cpu-weight-packing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CPU, float32: prepack matmul weights for oneDNN (faster at batch sizes above 1)",
    )
    parser.add_argument(
        "--cpu-quantized-gemv",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CPU, float32, GGUF models: matmuls of up to 4 rows (a few requests decoding) read the file's "
        "Q4_1 / Q8_0 weights directly instead of their float32 copies (several times fewer bytes)",
    )
    parser.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
    parser.add_argument(
        "--attention-backend",
        choices=["auto", "torch", "cpu", "triton"],
        default="auto",
        help="auto: triton on CUDA, the C++ paged kernels (cpu) on CPU; torch: the reference (gather + SDPA)",
    )
    parser.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one")


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    from tokenmill.chat_template import load_chat_template

    return {
        "tokenizer": args.tokenizer,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "num_kv_blocks": args.num_kv_blocks,
        "kv_cache_memory": args.kv_cache_memory,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "enable_prefix_caching": args.enable_prefix_caching,
        "block_size": args.block_size,
        "load_format": args.load_format,
        "dtype": args.dtype,
        "seed": args.seed,
        "device": args.device,
        "enforce_eager": args.enforce_eager,
        "async_scheduling": args.async_scheduling,
        "cpu_weight_packing": args.cpu_weight_packing,
        "cpu_quantized_gemv": args.cpu_quantized_gemv,
        "scheduling_policy": args.scheduling_policy,
        "attention_backend": args.attention_backend,
        "chat_template": load_chat_template(args.chat_template),
    }


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sampling-seed", type=int, default=None)


def _cmd_generate(args: argparse.Namespace) -> int:
    from tokenmill.engine.llm import LLM, stream_generate
    from tokenmill.sampling_params import SamplingParams

    llm = LLM(args.model, **engine_kwargs_from_args(args))
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
    )
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
    from tokenmill.sampling_params import SamplingParams

    llm = LLM(args.model, **engine_kwargs_from_args(args))
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens
    )
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM inference and serving engine")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("model_tag", nargs="?", default=None, help="model (same as --model)")
    add_engine_args(serve)
    from tokenmill.server.args import add_server_args

    add_server_args(serve)

    gen = sub.add_parser("generate", help="generate from one prompt, streaming to the terminal")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    add_engine_args(gen)
    _add_sampling_args(gen)

    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    chat.add_argument("--system", default=None)
    add_engine_args(chat)
    _add_sampling_args(chat)

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


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command == "serve":
        from tokenmill.server.api_server import run_server

        return run_server(args) or 0
    if args.command == "generate":
        return _cmd_generate(args)
    if args.command == "chat":
        return _cmd_chat(args)
    if args.command == "bench":
        if args.bench_command == "throughput":
            from tokenmill.bench import throughput

            throughput.main(args)
            return 0
        if args.bench_command == "latency":
            from tokenmill.bench import latency

            latency.main(args)
            return 0
        from tokenmill.bench import serve as bench_serve

        return bench_serve.main(args) or 0
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
