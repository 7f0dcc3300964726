"""What the reliability tests and the soak script share: a tiny-model server, /metrics, the server's
process tree, and OpenAI's error body."""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil

from tests.server.server_process import ServerProcess, start_server


def start_tiny_server(tmp_dir: str, model_dir: str, *extra: str, new_session: bool = False) -> ServerProcess:
    """`tokenmill serve` on a tiny random checkpoint, on CPU: starts in seconds, ~300 tokens/s."""
    return start_server(
        tmp_dir, "--model", str(model_dir), "--device", "cpu", *extra, new_session=new_session
    )


# --------------------------------------------------------------------------- /metrics

_SAMPLE = re.compile(r"^(tokenmill:[A-Za-z0-9_:]+)(\{[^}]*\})? (\S+)$")


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text -> {name: [(labels, value), ...]} for the tokenmill: series."""
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        samples.setdefault(m.group(1), []).append((labels, float(m.group(3))))
    return samples


def metric(base_url: str, name: str, **labels: str) -> float:
    """The sum of `tokenmill:<name>` over the series whose labels include `labels`."""
    samples = parse_metrics(httpx.get(f"{base_url}/metrics", timeout=10).text)
    series = samples.get(f"tokenmill:{name}")
    assert series is not None, f"metric tokenmill:{name} is not exported"
    return sum(v for lbl, v in series if all(lbl.get(k) == want for k, want in labels.items()))


def finished_by_reason(base_url: str) -> dict[str, float]:
    samples = parse_metrics(httpx.get(f"{base_url}/metrics", timeout=10).text)
    totals: dict[str, float] = {}
    for labels, value in samples.get("tokenmill:request_success_total", []):
        reason = labels.get("finished_reason", "?")
        totals[reason] = totals.get(reason, 0.0) + value
    return totals


def idle_gauges(base_url: str) -> dict[str, float]:
    return {
        "running": metric(base_url, "num_requests_running"),
        "waiting": metric(base_url, "num_requests_waiting"),
        "kv_cache_usage_perc": metric(base_url, "kv_cache_usage_perc"),
    }


def engine_invariants(base_url: str) -> str:
    """ "ok" when the engine's own check passes (GET /debug/invariants: queues, KV block ref counts,
    free list), else what went wrong; servers started without --enable-debug-endpoints say so."""
    response = httpx.get(f"{base_url}/debug/invariants", timeout=30)
    if response.status_code == 404:
        return "not checked: the server does not serve /debug/invariants (--enable-debug-endpoints)"
    if response.status_code == 200 and response.json().get("ok") is True:
        return "ok"
    return f"HTTP {response.status_code}: {response.text[:1000]}"


def wait_idle(base_url: str, timeout_s: float = 20.0) -> dict[str, float]:
    """Waits until nothing runs or waits and no KV block is held by a request (cached blocks with
    ref count 0 count as free). The gauges come from engine stats sent every ~0.5 s."""
    deadline = time.monotonic() + timeout_s
    while True:
        gauges = idle_gauges(base_url)
        if not any(gauges.values()):
            return gauges
        if time.monotonic() > deadline:
            raise AssertionError(f"the server is not idle {timeout_s:.0f} s after the load ended: {gauges}")
        time.sleep(0.2)


# --------------------------------------------------------------------------- processes


def process_tree(pid: int) -> list[psutil.Process]:
    """The process and all its descendants (captured while it runs, to check for orphans later)."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def engine_pid(server: ServerProcess) -> int:
    """The engine-core process: the server's one child that is not multiprocessing's resource
    tracker (present while the engine is started with multiprocessing spawn)."""
    children = [
        p for p in psutil.Process(server.process.pid).children() if "resource_tracker" not in _cmdline(p)
    ]
    assert len(children) == 1, (
        f"expected one engine process, found {[(p.pid, _cmdline(p)) for p in children]}"
    )
    return children[0].pid


def _cmdline(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def is_alive(process: psutil.Process) -> bool:
    """Alive and not a zombie; `is_running` also checks the create time, so a reused pid is not it."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def survivors(processes: list[psutil.Process], timeout_s: float = 10.0) -> list[str]:
    """Waits up to `timeout_s` for `processes` to be gone; describes the ones still alive."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in processes if is_alive(p)]
        if not alive or time.monotonic() > deadline:
            return [f"{p.pid} {_cmdline(p)}" for p in alive]
        time.sleep(0.1)


# --------------------------------------------------------------------------- OpenAI's error body


def openai_error_problem(body: Any, status: int) -> str | None:
    """None if `body` is OpenAI's error shape {"error": {"message", "type", "param", "code"}}, else
    what is wrong with it."""
    if not isinstance(body, dict) or set(body) != {"error"}:
        return f"status {status}: the body is not {{'error': {{...}}}}: {str(body)[:300]}"
    error = body["error"]
    if not isinstance(error, dict):
        return f"status {status}: 'error' is not an object: {str(error)[:300]}"
    if not isinstance(error.get("message"), str) or not error["message"]:
        return f"status {status}: error.message is missing or empty: {error}"
    if not isinstance(error.get("type"), str) or not error["type"]:
        return f"status {status}: error.type is missing or empty: {error}"
    if "param" not in error or not (error["param"] is None or isinstance(error["param"], str)):
        return f"status {status}: error.param must be present, a string or null: {error}"
    if "code" not in error or not (error["code"] is None or isinstance(error["code"], int | str)):
        return f"status {status}: error.code must be present, a string, an integer or null: {error}"
    if isinstance(error["code"], int) and error["code"] != status:
        return f"status {status}: error.code {error['code']} disagrees with the HTTP status"
    return None


def response_error_problem(response: httpx.Response) -> str | None:
    """For an error response: None when its body has OpenAI's error shape."""
    try:
        body = response.json()
    except ValueError:
        return f"status {response.status_code}: the body is not JSON: {response.text[:300]!r}"
    return openai_error_problem(body, response.status_code)


# -- clients in threads, recording what they saw -------------------------------------------------


@dataclass
class ClientResult:
    """What one client saw, in order."""

    status: int | None = None
    events: list[dict] = field(default_factory=list)
    done_lines: int = 0
    body: dict | None = None
    error: str | None = None  # a client-side exception
    ended_at: float | None = None
    started: threading.Event = field(default_factory=threading.Event)  # first event or the response


def stream_client(base_url: str, body: dict, result: ClientResult, timeout: float = 60.0) -> None:
    try:
        with httpx.stream(
            "POST", f"{base_url}/v1/completions", json={**body, "stream": True}, timeout=timeout
        ) as r:
            result.status = r.status_code
            if r.status_code != 200:
                r.read()
                result.body = r.json()
                return
            for line in r.iter_lines():
                if not line:
                    continue
                if line == "data: [DONE]":
                    result.done_lines += 1
                    continue
                result.events.append(json.loads(line.removeprefix("data: ")))
                result.started.set()
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.ended_at = time.monotonic()
        result.started.set()


def plain_client(base_url: str, body: dict, result: ClientResult, timeout: float = 60.0) -> None:
    try:
        r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=timeout)
        result.status = r.status_code
        result.body = r.json()
    except (httpx.HTTPError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        result.ended_at = time.monotonic()
        result.started.set()


def start_clients(
    base_url: str, specs: list[tuple[str, dict]]
) -> tuple[list[ClientResult], list[threading.Thread]]:
    results, threads = [], []
    for kind, body in specs:
        result = ClientResult()
        target = stream_client if kind == "stream" else plain_client
        thread = threading.Thread(target=target, args=(base_url, body, result), daemon=True)
        thread.start()
        results.append(result)
        threads.append(thread)
    return results, threads
