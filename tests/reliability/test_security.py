"""Security: the API key on every route but /health, /metrics and /version (over real sockets, odd targets
included), no pickle anywhere, a private ipc:// socket directory, sandboxed chat templates,
SHA-256 block hashes and cache_salt reaching the engine; and, on the real server, a crashed engine
failing requests fast and a clean restart on the same port."""

from __future__ import annotations

import ast
import asyncio
import hashlib
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from array import array
from pathlib import Path

import httpx
import msgspec
import pytest

import tokenmill
from tests.reliability.fake_server import FakeServer, assert_openai_error, run
from tests.server.server_process import ServerProcess, free_port
from tokenmill.chat_template import render_chat
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig
from tokenmill.core.block_hash import hash_block_tokens
from tokenmill.engine import core_process_client
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.core_process import main as engine_main
from tokenmill.errors import InvalidRequestError

SRC = Path(tokenmill.__file__).parent
KEY = "s3cret-key"

# --------------------------------------------------------------------------- no pickle

# Modules that unpickle (or, for multiprocessing, pickle a process's target and arguments).
FORBIDDEN_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "shelve", "marshal", "joblib", "multiprocessing"}  # fmt: skip
# Calls that unpickle: pyzmq's *_pyobj, torch.load (pickle unless weights_only), numpy's allow_pickle.
FORBIDDEN_ATTRIBUTES = {"recv_pyobj", "send_pyobj", "recv_serialized", "send_serialized"}


def _imports_dynamically(node: ast.AST) -> bool:
    """`__import__("pickle")` or `importlib.import_module("pickle")`."""
    if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant):
        return False
    module = str(node.args[0].value).split(".")[0]
    return ast.unparse(node.func) in ("__import__", "importlib.import_module") and module in FORBIDDEN_MODULES


def test_no_pickle_or_multiprocessing_anywhere_in_the_package():
    problems = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        where = path.relative_to(SRC.parent)
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                if name.split(".")[0] in FORBIDDEN_MODULES:
                    problems.append(f"{where}:{node.lineno} imports {name}")
            if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_ATTRIBUTES:
                problems.append(f"{where}:{node.lineno} uses .{node.attr}")
            if isinstance(node, ast.Call):
                func = ast.unparse(node.func)
                keywords = {k.arg: ast.unparse(k.value) for k in node.keywords}
                if func.endswith("torch.load") and keywords.get("weights_only") != "True":
                    problems.append(f"{where}:{node.lineno} torch.load without weights_only=True")
                if keywords.get("allow_pickle") == "True":
                    problems.append(f"{where}:{node.lineno} allow_pickle=True")
            if _imports_dynamically(node):
                problems.append(f"{where}:{node.lineno} imports a forbidden module dynamically")
    assert not problems, "\n".join(problems)


def test_the_engine_process_gets_its_config_as_msgpack_on_stdin(monkeypatch):
    captured: dict = {}

    class FakeStdin:
        def write(self, data: bytes) -> None:
            captured["stdin"] = data

        def close(self) -> None:
            captured["closed"] = True

    class FakePopen:
        def __init__(self, command, **kwargs) -> None:
            captured["command"], captured["kwargs"] = command, kwargs
            self.stdin = FakeStdin()

    monkeypatch.setattr(core_process_client.subprocess, "Popen", FakePopen)
    config = EngineConfig(
        model=ModelConfig(model="/m", seed=7), cache=CacheConfig(num_kv_blocks=9), device="cpu"
    )
    core_process_client._spawn_engine_process(config, [("ipc:///d/input", "ipc:///d/output")])
    command = captured["command"]
    assert command[:3] == [sys.executable, "-m", "tokenmill.engine.core_process"]
    assert command[command.index("--input-addr") + 1] == "ipc:///d/input"
    assert command[command.index("--parent-pid") + 1] == str(os.getpid())
    assert captured["kwargs"]["close_fds"] and not captured["kwargs"]["start_new_session"]
    assert msgspec.msgpack.decode(captured["stdin"], type=EngineConfig) == config and captured["closed"]
    # The engine side takes ipc:// addresses only.
    with pytest.raises(SystemExit):
        engine_main(["--input-addr", "tcp://0.0.0.0:5555", "--output-addr", "ipc:///x", "--parent-pid", "1"])


def test_the_ipc_socket_directory_is_private():
    async def check() -> None:
        engine = AsyncEngine(EngineConfig())
        try:
            mode = os.stat(engine.client.ipc_dir).st_mode
            assert stat.S_IMODE(mode) == 0o700 and os.stat(engine.client.ipc_dir).st_uid == os.getuid()
        finally:
            await engine.shutdown()
        assert not os.path.exists(engine.client.ipc_dir)

    asyncio.run(check())


# --------------------------------------------------------------------------- chat templates

HOSTILE_TEMPLATES = [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.system('touch CANARY') }}",
    "{{ self.__init__.__globals__.__builtins__.open('CANARY', 'w') }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ lipsum.__globals__['os'].system('touch CANARY') }}",
    "{% for m in messages %}{{ m.__class__.__init__.__globals__ }}{% endfor %}",
]


def test_hostile_chat_templates_are_refused_not_run(tmp_path, monkeypatch):
    from tests.server.fake_engine import tiny_tokenizer

    monkeypatch.chdir(tmp_path)
    tokenizer = tiny_tokenizer()
    for template in HOSTILE_TEMPLATES:
        with pytest.raises(InvalidRequestError) as info:
            render_chat(tokenizer, [{"role": "user", "content": "hi"}], chat_template=template)
        assert info.value.param == "messages"
    assert not (tmp_path / "CANARY").exists()

    # Through the server: a model whose own template is hostile answers 400, for chat and /tokenize.
    async def scenario(fs: FakeServer) -> None:
        for template in HOSTILE_TEMPLATES:
            fs.engine.tokenizer.chat_template = template
            body = {"messages": [{"role": "user", "content": "hi"}]}
            assert_openai_error(await fs.client.post("/v1/chat/completions", json=body), 400, "messages")
            assert_openai_error(await fs.client.post("/tokenize", json=body), 400, "messages")
        assert fs.engine.core.added == []

    run(scenario)
    assert not (tmp_path / "CANARY").exists()


# --------------------------------------------------------------------------- API key


def _request(target: str, *, headers: dict[str, str] | None = None, method: str = "GET") -> bytes:
    lines = [f"{method} {target} HTTP/1.1", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {"Host": "127.0.0.1"}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _status(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def test_api_key_guards_every_route_but_health_and_metrics_over_raw_sockets(monkeypatch):
    from tokenmill.server import api_server

    compares = []
    real_compare = api_server.hmac.compare_digest

    def counting_compare(a, b):
        compares.append((a, b))
        return real_compare(a, b)

    monkeypatch.setattr(api_server.hmac, "compare_digest", counting_compare)

    async def scenario(fs: FakeServer) -> None:
        port = fs.port
        refused = [
            _request("/v1/models"),
            _request("//v1/models"),
            _request("/v1/../v1/models"),
            _request("/v1/%2e%2e/v1/models"),
            _request("/health/../v1/models"),
            _request("/health%2f..%2fv1/models"),
            _request("/metrics/../v1/models"),
            _request(f"http://127.0.0.1:{port}/v1/models"),  # absolute-form target
            _request("http://evil.example/health"),  # only the plain /health path is open
            _request("/v1/models", headers={"Host": f"127.0.0.1:{port}", "X-Forwarded-Host": "localhost"}),
            _request("/v1/models", headers={"Host": "localhost", "X-Original-URL": "/health"}),
            _request("/v1/models?api_key=" + KEY),
            _request("/v1/models", headers={"Host": "a", "Authorization": "Basic " + KEY}),
            _request("/v1/models", headers={"Host": "a", "Authorization": "Bearer " + KEY[:-1]}),
            _request("/v1/models", headers={"Host": "a", "Authorization": "Bearer " + KEY + "x"}),
            _request("/v1/models", headers={"Host": "a", "Cookie": "Authorization=Bearer " + KEY}),
            _request("/docs"),
            _request("/openapi.json"),
            _request("*", method="OPTIONS"),
            _request("/v1/completions", method="POST"),
            _request("/tokenize", method="POST"),
        ]
        for raw in refused:
            reply = await fs.raw(raw)
            assert _status(reply) == 401, (raw, reply[:200])
            assert b'"code":401' in reply and b"www-authenticate: bearer" in reply.lower()
        open_ = [
            _request("/health"),
            _request("/health", headers={"Host": "evil.example"}),
            _request("/metrics"),
            _request("/version"),  # open as in vLLM (issue 20): it names no model or user data
        ]
        for raw in open_:
            assert _status(await fs.raw(raw)) == 200, raw
        good = {"Host": "a", "Authorization": "Bearer " + KEY}
        assert _status(await fs.raw(_request("/v1/models", headers=good))) == 200
        assert _status(await fs.raw(_request("/v1/models", headers={**good, "Authorization": "bearer  " + KEY}))) == 200  # fmt: skip
        assert fs.engine.core.added == []
        # The key is compared with hmac.compare_digest for every guarded request, whatever the header.
        assert len(compares) >= len(refused) + 2

    run(scenario, serve_http=True, api_key=KEY)


# --------------------------------------------------------------------------- prefix-cache isolation


def test_block_hashes_are_sha256_and_the_cache_salt_changes_them():
    tokens = list(range(16))
    expected = hashlib.sha256(bytes(32))
    expected.update(array("q", tokens).tobytes())
    assert hash_block_tokens(None, tokens) == expected.digest()
    salted_a = hash_block_tokens(None, tokens, "tenant-a")
    assert salted_a not in (hash_block_tokens(None, tokens), hash_block_tokens(None, tokens, "tenant-b"))
    assert salted_a == hash_block_tokens(None, tokens, "tenant-a")
    # The chain carries the salt: the next block differs too though it has no salt of its own.
    assert hash_block_tokens(salted_a, tokens) != hash_block_tokens(hash_block_tokens(None, tokens), tokens)


def test_cache_salt_reaches_the_engine_with_every_sequence():
    async def scenario(fs: FakeServer) -> None:
        r = await fs.client.post(
            "/v1/completions", json={"prompt": ["a", "b"], "n": 2, "cache_salt": "tenant-a"}
        )
        assert r.status_code == 200
        body = {"messages": [{"role": "user", "content": "hi"}], "cache_salt": "tenant-b", "stream": True}
        assert (await fs.client.post("/v1/chat/completions", json=body)).status_code == 200
        assert (await fs.client.post("/v1/completions", json={"prompt": "c"})).status_code == 200
        salts = [req.cache_salt for req in fs.engine.core.requests]
        assert salts == ["tenant-a"] * 4 + ["tenant-b", None]

    run(scenario)


# --------------------------------------------------------------------------- the real server


def _serve(tmp_path: Path, port: int, model_dir: Path, *extra: str) -> ServerProcess:
    log_path = str(tmp_path / f"server-{port}-{time.monotonic_ns()}.log")
    log = open(log_path, "w")  # noqa: SIM115 - lives as long as the server
    command = [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port), "--model", str(model_dir),
               "--device", "cpu", "--num-kv-blocks", "64", "--max-model-len", "256", *extra]  # fmt: skip
    server = ServerProcess(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), port, log_path)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert server.process.poll() is None, server.log()
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    server.stop(signal.SIGKILL)
    raise AssertionError(f"server not healthy in time:\n{server.log()}")


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [part.decode() for part in f.read().split(b"\0") if part]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return not f.read().split(") ")[1].startswith("Z")  # a zombie is dead, just not reaped
    except (ProcessLookupError, FileNotFoundError):
        return False


def _kv_usage(base_url: str) -> float:
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if line.startswith("tokenmill:kv_cache_usage_perc"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("tokenmill:kv_cache_usage_perc not exported")


def test_engine_crash_fails_requests_fast_and_the_server_restarts_on_the_same_port(
    tmp_path, paced_llama_dir, tiny_llama_dir
):
    port = free_port()
    auth = {"Authorization": f"Bearer {KEY}"}
    limits = ("--max-queue-time", "20", "--max-num-waiting-seqs", "2", "--max-header-bytes", "8192")
    # The paced model: its 200-token requests below are still running when the deadline or the kill lands.
    server = _serve(tmp_path, port, paced_llama_dir, "--api-key", KEY, *limits)
    try:
        children = server.child_pids()
        assert len(children) == 1
        engine_pid = children[0]
        engine_cmd = _cmdline(engine_pid)
        assert engine_cmd[1:3] == ["-m", "tokenmill.engine.core_process"] and "multiprocessing" not in " ".join(engine_cmd)  # fmt: skip
        socket_path = engine_cmd[engine_cmd.index("--input-addr") + 1]
        assert socket_path.startswith("ipc://")
        assert stat.S_IMODE(os.stat(os.path.dirname(socket_path.removeprefix("ipc://"))).st_mode) == 0o700
        url = server.base_url
        assert httpx.get(f"{url}/v1/models").status_code == 401
        # The limit flags reach the server: more sequences than may ever wait, headers too large.
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "n": 3}, headers=auth)
        assert_openai_error(r, 400, "n")
        assert httpx.get(f"{url}/health", headers={"X-Pad": "x" * 9000}).status_code in (400, 431)

        # A deadline ends a request in the engine and frees its KV blocks.
        body = {"prompt": "hello", "max_tokens": 200, "ignore_eos": True, "request_timeout": 0.3}
        r = httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=30)
        assert r.json()["choices"][0]["finish_reason"] == "abort", r.text
        deadline = time.monotonic() + 5
        while _kv_usage(url) != 0:
            assert time.monotonic() < deadline, "KV blocks still held after the timeout's abort"
            time.sleep(0.1)

        # Kill the engine while a stream is running: the stream ends with a 503 event at once.
        events: list[str] = []
        started = threading.Event()

        def stream() -> None:
            body = {"prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
            with httpx.stream(
                "POST", f"{url}/v1/completions", json=body, headers=auth, timeout=30
            ) as response:
                for line in response.iter_lines():
                    if line:
                        events.append(line)
                        started.set()

        thread = threading.Thread(target=stream)
        thread.start()
        assert started.wait(30), server.log()
        os.kill(engine_pid, signal.SIGKILL)
        killed = time.monotonic()
        thread.join(5)
        assert not thread.is_alive() and time.monotonic() - killed < 1.0, (
            "the stream outlived the engine by > 1 s"
        )
        assert events[-1] == "data: [DONE]" and '"code":503' in events[-2], events[-3:]
        assert httpx.get(f"{url}/health").status_code == 503
        started_at = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, headers=auth, timeout=5)
        assert_openai_error(r, 503)
        assert time.monotonic() - started_at < 1.0

        assert server.stop(signal.SIGTERM, timeout=20) == 0, server.log()
        assert not _alive(engine_pid)
    finally:
        server.stop(signal.SIGKILL)

    # A new server binds the same port at once and serves; stopping it leaves no process behind.
    server = _serve(tmp_path, port, tiny_llama_dir)
    try:
        engine_pid = server.child_pids()[0]
        r = httpx.post(
            f"{server.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30
        )
        assert r.json()["usage"]["completion_tokens"] == 3
        assert server.stop(signal.SIGTERM, timeout=20) == 0, server.log()
        assert not _alive(engine_pid), "the engine outlived the server"
    finally:
        server.stop(signal.SIGKILL)
