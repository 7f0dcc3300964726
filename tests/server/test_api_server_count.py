"""`serve --api-server-count 2`: two API server processes on one port in front of one engine.

Requests answered by either process give the same greedy text as one process would (the engine
is one), /metrics from either covers both (API-side counts summed, engine counts not doubled),
a client that goes away mid-stream on any process leaks nothing, SIGTERM drains both, and a
worker that dies stops the server (exit 1) rather than leaving it half up.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.server.server_process import alive as _alive
from tests.server.server_process import cmdline as _cmdline
from tests.server.server_process import start_server

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"
MAX_TOKENS = 12


def metric(base_url: str, name: str, labels: str = "") -> float:
    """The sum of a metric's samples (those whose labels contain `labels`); fails when absent."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    total, found = 0.0, False
    for line in text.splitlines():
        m = re.match(rf"tokenmill:{name}(\{{[^}}]*\}})? (\S+)$", line)
        if m and labels in (m.group(1) or ""):
            total += float(m.group(2))
            found = True
    assert found, f"tokenmill:{name} {labels} not exported"
    return total


def complete(
    base_url: str, *, stream: bool, chat: bool = False, prompt: str = PROMPT, max_tokens: int = MAX_TOKENS
) -> str:
    """One greedy request on a connection of its own (so the kernel picks a process for it)."""
    body: dict = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    url = f"{base_url}/v1/{'chat/completions' if chat else 'completions'}"
    with httpx.Client(timeout=120) as client:
        if not stream:
            r = client.post(url, json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return choice["message"]["content"] if chat else choice["text"]
        text = ""
        with client.stream("POST", url, json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                text += (choice["delta"].get("content") or "") if chat else choice["text"]
        return text


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_path):
    proc = start_two(
        tmp_path_factory.mktemp("server"),
        "--max-model-len",
        "1024",
        "--enable-log-requests",
        "--enable-debug-endpoints",
    )
    yield proc
    proc.stop()


def start_two(tmp_path, *flags: str, env: dict[str, str] | None = None):
    """`serve --api-server-count 2` on the CPU, once it says all its processes are ready."""
    proc = start_server(str(tmp_path), "--api-server-count", "2", "--device", "cpu", *flags, env=env)
    deadline = time.monotonic() + 120
    while "2 API server processes)" not in proc.log():
        assert proc.process.poll() is None and time.monotonic() < deadline, proc.log()
        time.sleep(0.2)
    return proc


def processes(proc, module: str) -> list[int]:
    """The server's child processes running `python -m <module>`."""
    return [p for p in _children(proc.process.pid) if f"-m {module}" in _cmdline(p)]


def served_by_worker(proc) -> int:
    return len(re.findall(r"\[api 1\] tokenmill\S*: Received request", proc.log()))


def test_both_processes_serve_the_same_greedy_text_and_metrics_count_each_request_once(server) -> None:
    url = server.base_url
    reference = {False: complete(url, stream=False), True: complete(url, stream=False, chat=True)}
    sent = 2
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        for _ in range(6):  # until the second process has answered some (the kernel spreads connections)
            jobs = [(i % 2 == 0, i % 3 == 0) for i in range(12)]
            texts = list(pool.map(lambda job: complete(url, stream=job[0], chat=job[1]), jobs))
            sent += len(jobs)
            for (_, chat), text in zip(jobs, texts, strict=True):
                assert text == reference[chat]
            if served_by_worker(server) >= 2:
                break
    assert served_by_worker(server) >= 2, "the second API server process never answered a request"
    assert len(re.findall(r"Received request", server.log())) == sent
    # On the CPU device the processes share the engine's cores: the server says so at start.
    assert "--api-server-count 2 on the CPU: the API server processes take cores" in server.log()
    time.sleep(1.2)  # the engine's stats reach every process at least every 0.5 s
    # Whichever process answers the scrape, each request counts once.
    for _ in range(6):
        assert metric(url, "request_success_total", 'finished_reason="length"') == sent
        assert metric(url, "generation_tokens_total") == sent * MAX_TOKENS
        assert metric(url, "time_to_first_token_seconds_count") == sent
        assert metric(url, "inter_token_latency_seconds_count") == sent * (MAX_TOKENS - 1)
        assert metric(url, "num_requests_running") == 0
    assert httpx.get(f"{url}/debug/invariants", timeout=30).status_code == 200


def test_the_other_api_server_process_never_loads_torch(server) -> None:
    """Like the first (tests/server/test_api_server_imports.py): only the engine process does."""
    workers = processes(server, "tokenmill.server.api_worker")
    assert len(workers) == 1
    for pid in (server.process.pid, workers[0]):
        with open(f"/proc/{pid}/maps") as f:
            assert "libtorch" not in f.read(), f"process {pid} mapped libtorch"


def test_with_data_parallel_cores_each_process_reaches_every_core(tmp_path, default_model_path) -> None:
    """--data-parallel-size 2 --api-server-count 2: each API server process attaches to both
    cores (its own slot on each); greedy answers agree whichever process and core serve them."""
    proc = start_two(tmp_path, "--data-parallel-size", "2", "--max-model-len", "512", "--enable-log-requests")
    try:
        assert len(processes(proc, "tokenmill.engine.core_process")) == 2
        reference = complete(proc.base_url, stream=False)
        sent = 1
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            for _ in range(6):
                texts = list(pool.map(lambda i: complete(proc.base_url, stream=i % 2 == 0), range(8)))
                sent += len(texts)
                assert texts == [reference] * len(texts)
                if served_by_worker(proc) >= 2:
                    break
        assert served_by_worker(proc) >= 2
        time.sleep(1.2)
        assert metric(proc.base_url, "request_success_total", 'finished_reason="length"') == sent
    finally:
        assert proc.stop() == 0, proc.log()


def test_engine_counters_are_not_multiplied_by_the_processes(server) -> None:
    url = server.base_url
    time.sleep(1.2)
    before = metric(url, "prefix_cache_queries_total")
    prompt = "A fresh prompt nobody sent before: " + " ".join(str(i) for i in range(40))
    with httpx.Client(timeout=120) as client:
        r = client.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    time.sleep(1.2)
    queried = metric(url, "prefix_cache_queries_total") - before
    assert prompt_tokens <= queried < 2 * prompt_tokens


def test_a_client_leaving_mid_stream_on_any_process_leaks_nothing(server) -> None:
    url = server.base_url
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}

    def leave_early() -> None:
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", f"{url}/v1/completions", json=body) as r,
        ):
            for i, _ in enumerate(r.iter_lines()):
                if i >= 3:
                    return  # closes the connection mid-stream

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: leave_early(), range(8)))
    deadline = time.monotonic() + 30
    while metric(url, "num_requests_running") or metric(url, "kv_cache_usage_perc"):
        assert time.monotonic() < deadline, "aborted streams kept running or kept their KV blocks"
        time.sleep(0.2)
    assert httpx.get(f"{url}/debug/invariants", timeout=30).status_code == 200
    assert complete(url, stream=True) == complete(url, stream=False)  # others undisturbed


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _mapped_dirs(pid: int, prefix: str) -> set[str]:
    """Directories named `prefix`... holding files the process has mapped (Prometheus's files)."""
    with open(f"/proc/{pid}/maps") as f:
        paths = [line.split()[-1] for line in f if "/" in line]
    return {os.path.dirname(p) for p in paths if os.path.basename(os.path.dirname(p)).startswith(prefix)}


def _wait_gone(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), f"left running: {[p for p in pids if _alive(p)]}"


def test_sigterm_drains_every_process_and_leaves_nothing_behind(tmp_path, default_model_path) -> None:
    proc = start_two(tmp_path, "--shutdown-timeout", "20")
    workers = processes(proc, "tokenmill.server.api_worker")
    engines = processes(proc, "tokenmill.engine.core_process")
    assert len(workers) == 1 and len(engines) == 1
    engine_cmd = _cmdline(engines[0]).split()
    ipc_dir = os.path.dirname(engine_cmd[engine_cmd.index("--input-addr") + 1].removeprefix("ipc://"))
    metrics_dirs = _mapped_dirs(workers[0], "tokenmill-metrics-")
    assert len(metrics_dirs) == 1 and os.path.isdir(ipc_dir)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        streams = [pool.submit(complete, proc.base_url, stream=True, max_tokens=48) for _ in range(6)]
        deadline = time.monotonic() + 60
        while metric(proc.base_url, "num_requests_running") < 6:
            assert time.monotonic() < deadline, "the requests never all started"
            time.sleep(0.05)
        proc.process.send_signal(signal.SIGTERM)
        texts = [s.result(timeout=120) for s in streams]
    assert proc.process.wait(60) == 0, proc.log()
    # Every stream finished whole (48 tokens of the same greedy text), whichever process had it.
    assert len(set(texts)) == 1 and texts[0]
    _wait_gone(workers + engines, 10)
    assert "[api 1]" in proc.log()
    left = [d for d in [ipc_dir, *metrics_dirs] if os.path.exists(d)]
    assert not left, f"socket or metrics directories left behind: {left}"


def test_a_worker_that_dies_is_restarted_and_its_requests_freed(tmp_path, default_model_path) -> None:
    """Killed with streams in flight: its clients lose their connections, the others' streams finish
    whole, a new process takes its slot and serves, and the engine aborts the dead one's requests
    (nothing left running, no KV block held, invariants ok)."""
    proc = start_two(tmp_path, "--enable-debug-endpoints", "--enable-log-requests")
    try:
        (worker,) = processes(proc, "tokenmill.server.api_worker")

        def stream() -> str | None:
            try:
                return complete(proc.base_url, stream=True, max_tokens=600)
            except (httpx.HTTPError, json.JSONDecodeError):
                return None  # its process was killed

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            streams = [pool.submit(stream) for _ in range(12)]  # all on one process: 1 in 4,096
            deadline = time.monotonic() + 60
            while metric(proc.base_url, "num_requests_running") < 12:
                assert time.monotonic() < deadline, "the streams never all started"
                time.sleep(0.05)
            assert served_by_worker(proc) > 0
            os.kill(worker, signal.SIGKILL)
            texts = [s.result(timeout=180) for s in streams]
        finished = [t for t in texts if t is not None]
        assert None in texts, "no stream lost its connection with the killed process"
        assert finished and len(set(finished)) == 1, "the first process's streams did not finish whole"
        deadline = time.monotonic() + 120
        while True:  # the new process attaches and serves
            restarted = processes(proc, "tokenmill.server.api_worker")
            if restarted and restarted != [worker] and "API server process 1 restarted" in proc.log():
                break
            assert proc.process.poll() is None and time.monotonic() < deadline, proc.log()
            time.sleep(0.2)
        assert re.search(
            rf"API server process 1 \(pid {worker}\) exited with code -9; restarting it", proc.log()
        )
        # The first process told the engine at once: it aborted the dead process's streams before
        # the new one attached, not when that one said Hello.
        log = proc.log()
        aborted = re.search(rf"API server slot 1 \(pid {worker}\) exited: aborting its (\d+) requests", log)
        assert aborted and int(aborted.group(1)) == texts.count(None), log
        assert aborted.start() < log.index("API server process 1 restarted"), log
        assert "slot 1 restarted: aborting" not in log, log
        served_before = served_by_worker(proc)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            for _ in range(6):
                assert set(pool.map(lambda _: complete(proc.base_url, stream=False), range(8))) == {
                    complete(proc.base_url, stream=False)
                }
                if served_by_worker(proc) > served_before:
                    break
        assert served_by_worker(proc) > served_before, "the restarted process never answered"
        deadline = time.monotonic() + 30
        while metric(proc.base_url, "num_requests_running") or metric(proc.base_url, "kv_cache_usage_perc"):
            assert time.monotonic() < deadline, "the dead process's requests kept running"
            time.sleep(0.2)
        assert httpx.get(f"{proc.base_url}/debug/invariants", timeout=30).status_code == 200
    finally:
        assert proc.stop() == 0, proc.log()


def test_a_worker_that_may_not_be_restarted_stops_the_server(tmp_path, default_model_path) -> None:
    proc = start_two(tmp_path, env={"TOKENMILL_API_SERVER_RESTARTS": "0"})
    children = _children(proc.process.pid)
    (worker,) = processes(proc, "tokenmill.server.api_worker")
    os.kill(worker, signal.SIGKILL)
    assert proc.process.wait(60) == 1, proc.log()
    assert re.search(
        rf"API server process 1 \(pid {worker}\) exited with code -9; 1 exits within 300 s, more than "
        r"TOKENMILL_API_SERVER_RESTARTS=0 allows; stopping the server",
        proc.log(),
    )
    _wait_gone(children, 10)


@pytest.mark.parametrize(
    "flags, env, message",
    [
        (["--enable-lora", "--allow-runtime-lora-updating"], {}, "needs --api-server-count 1"),
        (["--api-server-count", "0"], {}, "--api-server-count"),
        # Refused by the launcher, by name, before an engine starts (the engine reads it too).
        ([], {"TOKENMILL_API_SERVER_STALL_TIMEOUT": "0"}, "TOKENMILL_API_SERVER_STALL_TIMEOUT='0' is not a valid"),
        ([], {"TOKENMILL_API_SERVER_STALL_TIMEOUT": "-5"}, "expected a number above 0"),
    ],
)
def test_refused_flag_combinations(flags, env, message) -> None:
    base = ["--api-server-count", "2"] if "--api-server-count" not in flags else []
    run = subprocess.run(
        [sys.executable, "-m", "tokenmill.cli", "serve", *base, *flags],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert run.returncode == 2 and message in run.stderr, run.stderr


def test_a_port_in_use_is_refused_not_shared() -> None:
    """SO_REUSEPORT lets sockets of one user share a port; a server must not join another one's."""
    import socket

    from tests.server.server_process import free_port

    port = free_port()
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # even one that allows sharing
        other.bind(("127.0.0.1", port))
        other.listen()
        run = subprocess.run(
            [sys.executable, "-m", "tokenmill.cli", "serve", "--api-server-count", "2", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert run.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in run.stderr, run.stderr


def test_when_the_engine_dies_every_process_answers_503(tmp_path, default_model_path) -> None:
    """As with one process: requests fail fast with 503 and /health says so, whichever process a
    connection lands on; the server stays up for its supervisor and still stops cleanly."""
    proc = start_two(tmp_path)
    try:
        (engine,) = processes(proc, "tokenmill.engine.core_process")
        os.kill(engine, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while True:  # both processes notice within their watchdog's interval
            codes = {httpx.get(f"{proc.base_url}/health", timeout=5).status_code for _ in range(16)}
            if codes == {503}:
                break
            assert time.monotonic() < deadline, f"/health still answers {codes}"
            time.sleep(0.2)
        for _ in range(8):  # new connections: hashed to either process
            started = time.monotonic()
            with httpx.Client(timeout=10) as client:
                r = client.post(f"{proc.base_url}/v1/completions", json={"model": MODEL, "prompt": "hi"})
            assert r.status_code == 503 and time.monotonic() - started < 2, r.text
            assert "the engine is not available" in r.json()["error"]["message"]
    finally:
        assert proc.stop() == 0, proc.log()
