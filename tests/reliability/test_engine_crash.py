"""Process faults under load: the engine process killed mid-stream, and SIGTERM while requests run.

The promise: no client hangs; every pending request gets an error (the engine died) or completes /
ends with finish_reason "abort" (the drain); /health tells the truth; nothing outlives the server;
and a new server starts cleanly afterwards.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import httpx

from tests.reliability.server_tools import (
    ClientResult,
    engine_pid,
    is_alive,
    metric,
    openai_error_problem,
    process_tree,
    response_error_problem,
    start_clients,
    start_tiny_server,
    survivors,
)

LONG = 240  # tokens: seconds of work for a batch on the paced model, so it is mid-flight when hit


def finish_reasons(result: ClientResult) -> list[str]:
    if result.body is not None and "choices" in result.body:
        return [c["finish_reason"] for c in result.body["choices"]]
    return [c["finish_reason"] for e in result.events for c in e.get("choices", []) if c.get("finish_reason")]


def test_engine_killed_mid_load_fails_every_request_fast(tmp_path, paced_llama_dir):
    server = start_tiny_server(
        str(tmp_path), str(paced_llama_dir), "--max-model-len", "512", "--max-num-seqs", "4"
    )
    tree = process_tree(server.process.pid)
    try:
        engine = engine_pid(server)
        body = {"prompt": "tell me a long story", "max_tokens": LONG, "ignore_eos": True}
        # 8 streams and 2 non-streaming requests: 4 streams run, the other 6 requests wait.
        results, threads = start_clients(server.base_url, [("stream", body)] * 8)
        deadline = time.monotonic() + 60
        while sum(r.started.is_set() for r in results) < 4:  # the 4 running slots hold streams
            assert time.monotonic() < deadline, "the streams never started"
            time.sleep(0.02)
        more_results, more_threads = start_clients(server.base_url, [("plain", body)] * 2)
        results, threads = results + more_results, threads + more_threads
        while metric(server.base_url, "num_requests_waiting") < 6:  # engine stats, every ~0.5 s
            assert time.monotonic() < deadline, "the queued requests never reached the engine"
            time.sleep(0.05)

        os.kill(engine, signal.SIGKILL)
        killed = time.monotonic()
        for thread in threads:
            thread.join(timeout=15)
        hung = [i for i, t in enumerate(threads) if t.is_alive()]
        assert not hung, f"clients {hung} still waiting 15 s after the engine died"
        slowest = max(r.ended_at for r in results) - killed  # type: ignore[operator]
        assert slowest < 5, f"a client took {slowest:.1f} s to learn that the engine died"
        print(f"engine killed: all {len(results)} clients answered within {slowest:.2f} s")

        in_flight = [i for i, r in enumerate(results) if r.ended_at >= killed]  # type: ignore[operator]
        # The queued requests at least were still in flight; a running stream may have finished
        # just before the kill on a fast machine, which is a legitimate completion.
        assert len(in_flight) >= 6, f"only clients {in_flight} were still in flight at the kill"
        for i, result in enumerate(results):
            assert result.error is None, f"client {i}: {result.error}"
            if i not in in_flight:
                continue
            assert "length" not in finish_reasons(result), (
                f"client {i} completed although the engine was killed"
            )
            if i < 8 and result.status == 200:  # a stream that had started: an error event, then [DONE]
                errors = [e for e in result.events if "error" in e]
                assert len(errors) == 1 and errors[0]["error"]["code"] == 503, (
                    f"stream {i}: {result.events[-3:]}"
                )
                assert openai_error_problem(errors[0], 503) is None
                assert result.done_lines == 1, f"stream {i} ended without exactly one [DONE]"
            else:
                assert result.status == 503, f"client {i}: {result.status} {result.body}"
                assert openai_error_problem(result.body, 503) is None, result.body

        health = httpx.get(f"{server.base_url}/health", timeout=5)
        assert health.status_code == 503, health.text
        started = time.monotonic()
        late = httpx.post(
            f"{server.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10
        )
        assert late.status_code == 503 and time.monotonic() - started < 2, late.text
        assert response_error_problem(late) is None
        late_chat = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "stream": True},
            timeout=10,
        )
        assert late_chat.status_code == 503, late_chat.text
    finally:
        server.stop(signal.SIGTERM, timeout=30)
    assert server.process.returncode is not None
    leaked = survivors(tree)
    assert not leaked, f"processes outlived the server: {leaked}"


def test_a_new_server_starts_after_the_crash_and_sigterm_drains_under_load(tmp_path, paced_llama_dir):
    """Runs after the test above (same model, fresh port): the restart works, then a drain."""
    shutdown_timeout = 1.0
    server = start_tiny_server(
        str(tmp_path), str(paced_llama_dir),
        "--max-model-len", "512", "--max-num-seqs", "16", "--shutdown-timeout", str(shutdown_timeout),
    )  # fmt: skip
    tree = process_tree(server.process.pid)
    short = {"prompt": "a short one", "max_tokens": 10, "ignore_eos": True}
    long = {"prompt": "a long one", "max_tokens": LONG, "ignore_eos": True}
    # The short ones go first and finish within the timeout (or before the signal). The twelve
    # long ones are sent last and the signal follows as soon as they run, so they are far from
    # done when the drain ends: 240 steps of a 14-request batch of the paced model take several
    # seconds on a 2-core CPU, while 10 steps of the short ones fit well inside the 1 s timeout.
    specs = [("stream", short), ("plain", short)] + [("stream", long)] * 8 + [("plain", long)] * 4
    deadline = time.monotonic() + 60

    def wait_admitted(count: int) -> None:
        # Running, or (a short one on a slow start) already finished.
        while (
            metric(server.base_url, "num_requests_running") + metric(server.base_url, "request_success_total")
            < count
        ):
            assert time.monotonic() < deadline, f"{count} requests never all started"
            time.sleep(0.02)

    results, threads = start_clients(server.base_url, specs[:2])
    wait_admitted(2)
    long_results, long_threads = start_clients(server.base_url, specs[2:])
    results, threads = results + long_results, threads + long_threads
    wait_admitted(len(specs))
    signalled = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    if server.process.poll() is None:  # still draining: closed to new work
        with contextlib.suppress(httpx.TransportError):
            assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 503
            late = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "late"}, timeout=5)
            assert late.status_code == 503 and response_error_problem(late) is None, late.text
    for thread in threads:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a client hung during the drain"
    exit_code = server.process.wait(30)
    took = time.monotonic() - signalled
    assert exit_code == 0, server.log()
    # The drain itself is bounded by --shutdown-timeout; the rest is delivering aborts and reaping.
    assert took < shutdown_timeout + 10, f"the server took {took:.1f} s to exit"
    print(f"SIGTERM under load: exited {took:.2f} s after the signal (--shutdown-timeout {shutdown_timeout})")

    for i, result in enumerate(results):
        assert result.error is None and result.status == 200, f"client {i}: {result.status} {result.error}"
        reasons = finish_reasons(result)
        assert len(reasons) == 1, f"client {i}: finish reasons {reasons}"
        if specs[i][0] == "stream":
            assert result.done_lines == 1, f"stream {i} ended without exactly one [DONE]"
        if i < 2:
            assert reasons == ["length"], f"short request {i} did not complete within the drain: {reasons}"
            if specs[i][0] == "plain":
                assert result.body["usage"]["completion_tokens"] == short["max_tokens"]  # type: ignore[index]
        else:
            assert reasons == ["abort"], (
                f"long request {i} was not aborted at the shutdown timeout: {reasons}"
            )
    leaked = survivors(tree)
    assert not leaked, f"processes outlived the server: {leaked}"


def test_an_idle_server_exits_within_about_a_second_of_sigterm(tmp_path, tiny_llama_dir):
    """With nothing to drain, SIGTERM to exit is: uvicorn's shutdown (~0.2 s: its 0.1 s tick and a
    fixed 0.1 s pause), the engine process stopping (Shutdown, its sockets closed, then its own
    interpreter's teardown: ~0.6 s, ~0.3 s since the engine freezes its collector too), and this
    process's teardown (~0.2 s): 0.5-1 s on the quiet 2-core machine. The bounds are 2.5x the
    upper end, for a loaded CI machine. The second one is the one that
    caught the cause of the extra seconds: the API process's interpreter teardown (its final garbage
    collections walking everything torch and transformers made) took ~1.2 s after the engine had
    been reaped, ~2 s in all, 3-4 s under load; run_server now freezes the collector first."""
    server = start_tiny_server(str(tmp_path), str(tiny_llama_dir), "--num-kv-blocks", "512")
    tree = process_tree(server.process.pid)
    engine_process = next(p for p in tree if p.pid == engine_pid(server))
    signalled = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    engine_gone = None
    while server.process.poll() is None:
        if engine_gone is None and not is_alive(engine_process):  # a zombie counts as gone here
            engine_gone = time.monotonic()
        assert time.monotonic() - signalled < 30, "the idle server did not exit 30 s after SIGTERM"
        time.sleep(0.005)
    exited = time.monotonic()
    assert server.process.returncode == 0, server.log()
    assert engine_gone is not None, "the server exited before its engine process"
    took, after_engine = exited - signalled, exited - engine_gone
    print(f"idle server: engine gone {engine_gone - signalled:.2f} s, exited {took:.2f} s after SIGTERM")
    assert after_engine < 1.0, f"the API process took {after_engine:.2f} s to exit after its engine"
    assert took < 2.5, f"the idle server took {took:.2f} s to exit after SIGTERM"
    leaked = survivors(tree)
    assert not leaked, f"processes outlived the server: {leaked}"


def test_ctrl_c_to_the_process_group_drains_like_sigterm(tmp_path, paced_llama_dir):
    """Ctrl-C in a terminal sends SIGINT to the whole foreground process group, the engine process
    included. The engine must not die of it: the API server drains (in-flight requests finish),
    then stops the engine and exits 0."""
    server = start_tiny_server(
        str(tmp_path), str(paced_llama_dir), "--max-model-len", "512", "--shutdown-timeout", "30",
        new_session=True,
    )  # fmt: skip
    tree = process_tree(server.process.pid)
    engine = engine_pid(server)
    engine_process = next(p for p in tree if p.pid == engine)
    assert os.getpgid(engine) == server.process.pid  # the engine shares the server's group
    body = {"prompt": "interrupted", "max_tokens": LONG, "ignore_eos": True}
    results, threads = start_clients(server.base_url, [("stream", body), ("plain", body)])
    deadline = time.monotonic() + 60
    while metric(server.base_url, "num_requests_running") < 2:
        assert time.monotonic() < deadline, "the requests never started running"
        time.sleep(0.02)
    os.killpg(server.process.pid, signal.SIGINT)
    signalled = time.monotonic()
    time.sleep(0.2)
    if server.process.poll() is None:  # draining: closed to new work, the engine still alive
        with contextlib.suppress(httpx.TransportError):
            assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 503
        assert is_alive(engine_process), "SIGINT killed the engine process"
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a client hung during the drain"
    assert server.process.wait(30) == 0, server.log()
    for i, result in enumerate(results):
        assert result.error is None and result.status == 200, f"client {i}: {result.status} {result.body}"
        assert finish_reasons(result) == ["length"], (
            f"client {i}: {finish_reasons(result)} {result.events[-2:]}"
        )
    assert all(r.ended_at is not None and r.ended_at > signalled for r in results)  # were in flight
    assert results[0].done_lines == 1
    assert results[1].body["usage"]["completion_tokens"] == LONG  # type: ignore[index]
    leaked = survivors(tree)
    assert not leaked, f"processes outlived the server: {leaked}"
