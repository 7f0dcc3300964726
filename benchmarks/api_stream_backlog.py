"""The API server's streaming path when the engine steps faster than the server writes chunks
(CPU, no model): what issue 14's H200 runs hit (64 streams, a step every ~6 ms), reproduced on a
CPU where the real engine is too slow to push the API server that far.

    PYTHONPATH=src python benchmarks/api_stream_backlog.py --step-ms 6 --concurrency 64 --requests 512

A child process serves the real API app (FastAPI, uvicorn on a TCP port, SSE, output processing)
and its real engine client (ZMQ, msgpack) over a fake engine process: tests/server/fake_engine.py's
scripted core (one token per running request a step) behind the engine process's sockets, stepping
every --step-ms whether or not the server keeps up, its outputs waiting in the socket when it does
not, as a real engine's do. This process sends the load (aiohttp, tokenmill.bench.serve_client) and
reports TTFT, tokens per SSE chunk, ITL and the server process's CPU seconds. Run from the repo
root; the tree under test is the one PYTHONPATH names.

With `--api-servers N` the child runs `tokenmill serve --api-server-count N` itself (the default
model's tokenizer) over the same fake engine, which answers every API server process through the
engine's own ClientLinks; CPU is summed over the N processes and reported per process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SERVE_FLAG = "--serve-child"
ENGINE_FLAG = "--engine-child"


def fake_engine_process(addresses: list[list[str]], step_s: float, model: str | None) -> None:
    """The engine child: tests/server/fake_engine.py's scripted core behind the engine process's
    sockets and messages (engine/client_links.py: one pair per API server process); one step every
    `step_s` while it has requests, its outputs sent whether or not the servers keep up (they wait
    in the sockets), as the real engine does. `model` "default": reply in the default model's
    tokens (the real `serve` path), else the tests' tiny tokenizer's."""
    sys.path.insert(0, ".")
    import zmq
    from tests.server.fake_engine import REPLY, FakeCore, FakeEngine

    from tokenmill.engine.client_links import ClientLinks
    from tokenmill.engine.messages import EngineInfo, EngineReady, Hello, Shutdown

    shape = FakeEngine(max_model_len=4096, num_kv_blocks=10**6)  # its tokenizer and EngineInfo only
    tokenizer, info = shape.tokenizer, shape.info
    if model is not None:  # the default model's, as the API servers load it
        from tokenmill.config import ModelConfig
        from tokenmill.model.resolve import resolve_model
        from tokenmill.model.tokenizer import load_tokenizer_or_none

        tokenizer = load_tokenizer_or_none(resolve_model(ModelConfig()), None)
        info = EngineInfo(
            max_model_len=4096, num_kv_blocks=10**6, block_size=16, vocab_size=len(tokenizer),
            max_num_seqs=1024, max_num_batched_tokens=8192, device="fake", dtype="none",
        )  # fmt: skip
    parent = os.getppid()
    ctx = zmq.Context()
    links = ClientLinks(ctx, [a for a, _ in addresses], [b for _, b in addresses], lambda: os.getppid() == parent)

    class SocketCore(FakeCore):
        def _deliver(self, message: object) -> None:  # utility answers: only the first server asks
            links.send(0, message)

    reply_ids = tokenizer.encode(REPLY, add_special_tokens=False)
    core = SocketCore(None, reply_ids, tokenizer.eos_token_id)  # type: ignore[arg-type]
    links.send(0, EngineReady(info=info))
    due = last_stats = time.monotonic()
    while os.getppid() == parent:  # never outlives the server
        busy = bool(core.running or core.pending)
        wait_ms = math.ceil(max(0.0, due - time.monotonic()) * 1000) if busy else 200
        for client, message in links.receive(wait_ms):
            if isinstance(message, Shutdown):
                return
            if isinstance(message, Hello):
                links.register(client, message.pid)
                links.send(client, EngineReady(info=info))
            else:
                core.receive(message)
        now = time.monotonic()
        stats_due = now - last_stats > 0.5
        outputs = None
        if core.running or core.pending:
            if now >= due:
                outputs = core.step()
                due = now + step_s
        else:
            due = now  # idle: the next request's first step comes at once
        if outputs is not None or stats_due:
            links.send_step(outputs or [], core.stats(), stats_due=stats_due)
        if stats_due:
            last_stats = now
        links.flush_backlogs()  # as the engine does: what another API server's full queue held back


def serve_real(port: int, step_s: float, api_servers: int) -> None:
    """The server child for --api-servers: `tokenmill serve` itself (the default model's tokenizer,
    --api-server-count) with the fake engine process in place of the real one."""
    sys.path.insert(0, ".")
    from tokenmill.cli import main as cli_main
    from tokenmill.engine import core_process_client

    def spawn(config, addresses, env=None):  # noqa: ANN001, ANN202
        spec = json.dumps([list(pair) for pair in addresses])
        return subprocess.Popen([sys.executable, __file__, ENGINE_FLAG, spec, str(step_s), "default"])

    core_process_client._spawn_engine_process = spawn
    sys.exit(cli_main([
        "serve", "--port", str(port), "--device", "cpu", "--api-server-count", str(api_servers),
        "--max-model-len", "4096", "--disable-uvicorn-access-log", "--disable-log-stats",
    ]))  # fmt: skip


def serve(port: int, step_s: float) -> None:
    """The server child: the real app and engine client (ZMQ, msgpack) over the fake engine
    process, on uvicorn, until killed."""
    sys.path.insert(0, ".")
    from tests.server.fake_engine import FakeEngine, fake_server_state

    from tokenmill.config import EngineConfig
    from tokenmill.engine import core_process_client
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.engine.input_processor import InputProcessor
    from tokenmill.engine.output_processor import OutputProcessor
    from tokenmill.server.api_server import create_app
    from tokenmill.server.http_protocol import make_uvicorn_config

    def spawn(config, addresses, env=None):  # noqa: ANN001, ANN202
        spec = json.dumps([list(pair) for pair in addresses])
        return subprocess.Popen([sys.executable, __file__, ENGINE_FLAG, spec, str(step_s), ""])

    core_process_client._spawn_engine_process = spawn

    async def main() -> None:
        import uvicorn

        shape = FakeEngine(max_model_len=4096, num_kv_blocks=10**6)
        engine = AsyncEngine(EngineConfig())
        engine.tokenizer, engine.eos_token_ids = shape.tokenizer, shape.eos_token_ids
        engine.client.launch(engine.config)
        await engine.client.wait_until_ready(60)
        engine.info = engine.client.info
        engine.input_processor = InputProcessor(engine.tokenizer, engine.info, engine.eos_token_ids)
        engine.output_processor = OutputProcessor(engine.tokenizer)
        engine.client.start_loops()
        state = fake_server_state(engine)  # type: ignore[arg-type]
        server = uvicorn.Server(make_uvicorn_config(create_app(state), host="127.0.0.1", port=port))
        try:
            await server.serve()
        finally:
            await engine.shutdown()

    asyncio.run(main())


def server_pids(pid: int) -> list[int]:
    """The server child and the API server processes it started (not the fake engine)."""
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    workers = [int(p) for p in out.stdout.split() if "api_worker" in Path(f"/proc/{p}/cmdline").read_text()]
    return [pid, *workers]


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def load(
    port: int, concurrency: int, requests: int, max_tokens: int, chat: bool = False, model: str = "tiny"
) -> tuple[list, float]:
    import aiohttp

    from tokenmill.bench.serve_client import send_request

    url = f"http://127.0.0.1:{port}/v1/{'chat/completions' if chat else 'completions'}"
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    body = {"model": model, **prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    limit = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:

        async def one() -> object:
            async with limit:
                return await send_request(session, url, body, {}, prompt_len=2)

        await asyncio.gather(*(one() for _ in range(min(concurrency, 8))))  # warm-up
        start = time.perf_counter()
        results = await asyncio.gather(*(one() for _ in range(requests)))
        return list(results), time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == SERVE_FLAG:
        if int(sys.argv[4]):
            serve_real(int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
        else:
            serve(int(sys.argv[2]), float(sys.argv[3]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == ENGINE_FLAG:
        fake_engine_process(json.loads(sys.argv[2]), float(sys.argv[3]), sys.argv[4] or None)
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--step-ms", type=float, default=6.0, help="the fake engine's step period")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens of every reply (ignore_eos)")
    parser.add_argument("--port", type=int, default=8795)
    parser.add_argument("--chat", action="store_true", help="stream /v1/chat/completions instead of /v1/completions")
    parser.add_argument(
        "--api-servers", type=int, default=0,
        help="serve through `tokenmill serve --api-server-count N` (the default model's tokenizer) instead "
        "of the in-process app; its CPU is summed over the N processes",
    )  # fmt: skip
    parser.add_argument("--result-name", default=None, help="also write a result file to benchmarks/results/")
    args = parser.parse_args()
    sys.path.insert(0, ".")
    import urllib.request

    import tokenmill
    from tokenmill.bench.results import write_result
    from tokenmill.bench.structured_serve import tokens_per_text_chunk

    child = subprocess.Popen(
        [sys.executable, __file__, SERVE_FLAG, str(args.port), str(args.step_ms / 1000), str(args.api_servers)]
    )
    try:
        for _ in range(1200):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        model = "tiny"
        if args.api_servers:
            with urllib.request.urlopen(f"http://127.0.0.1:{args.port}/v1/models", timeout=10) as r:
                model = json.load(r)["data"][0]["id"]
        pids = server_pids(child.pid)
        per_process_before = [cpu_seconds(pid) for pid in pids]
        cpu_before, client_before = sum(per_process_before), cpu_seconds(os.getpid())
        results, duration = asyncio.run(
            load(args.port, args.concurrency, args.requests, args.max_tokens, args.chat, model)
        )
        # The warm-up's share is small and alike in every run.
        per_process = [round(cpu_seconds(pid) - before, 2) for pid, before in zip(pids, per_process_before, strict=True)]
        server_cpu = sum(map(cpu_seconds, pids)) - cpu_before
        client_cpu = cpu_seconds(os.getpid()) - client_before
    finally:
        child.terminate()
        child.wait(10)
    ok = [r for r in results if r.success]
    tokens = sum(r.output_tokens for r in ok)
    itls = [x for r in ok for x in r.itl]
    ttfts = [r.ttft for r in ok]
    metrics = {
        "completed": len(ok),
        "duration_s": round(duration, 3),
        "output_tok_s": round(tokens / duration, 1),
        "ttft_p50_ms": round(1000 * statistics.median(ttfts), 2),
        "ttft_p99_ms": round(1000 * percentile(ttfts, 99), 2),
        "itl_p50_ms": round(1000 * statistics.median(itls), 3),
        "tokens_per_chunk": round(tokens_per_text_chunk(results), 3),
        "server_cpu_s": round(server_cpu, 2),
        "server_cpu_ms_per_1k_tokens": round(1000 * server_cpu / tokens * 1000, 1),
        "server_cpu_s_by_process": per_process,  # how the connections spread over API server processes
        "client_cpu_s": round(client_cpu, 2),  # the load generator shares the host's cores
    }
    src = os.path.dirname(os.path.dirname(tokenmill.__file__))
    git = subprocess.run(["git", "-C", src, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    commit = os.environ.get("TOKENMILL_COMMIT") or git.stdout.strip() or None  # a copy of a tree: told
    config = {"step_ms": args.step_ms, "concurrency": args.concurrency, "requests": args.requests, "chat": args.chat,
              "api_servers": args.api_servers or "in-process app",
              "max_tokens": args.max_tokens, "tokenmill_src": src,
              "tokenmill_src_commit": commit}  # fmt: skip
    print(json.dumps(config | metrics))
    if args.result_name:
        print(write_result("api-stream-backlog", config, metrics, name=args.result_name))


if __name__ == "__main__":
    main()
