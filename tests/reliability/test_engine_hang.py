"""An engine process that hangs but stays alive (deadlock, stuck kernel, SIGSTOP) is handled like a
dead one once it has been silent for --engine-hang-timeout while requests wait on it: an error
log naming the timeout, the process killed, pending requests failed fast with 503, /health 503.
Silence with nothing pending, and long generations that keep reporting, are not hangs.

The scripted FakeEngine (a paused core says nothing, like a hung one) covers the rules in a second
each; the real engine process, SIGSTOPped mid-stream, covers the kill and that nothing is left.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time

import httpx
import msgspec
import psutil
import pytest
import zmq

from tests.reliability.fake_server import FakeServer, assert_openai_error, run
from tests.reliability.server_tools import (
    engine_pid,
    is_alive,
    openai_error_problem,
    process_tree,
    start_clients,
    start_tiny_server,
    survivors,
)
from tests.server.fake_engine import FakeEngine, wait_until
from tokenmill.engine.async_engine import _Stream
from tokenmill.engine.messages import StepOutputs

COMPLETIONS = "/v1/completions"
FAKE_HANG_S = 0.8  # above the 0.5 s between the idle engine's stats, as any real timeout is
ENGINE_LOG = "tokenmill.engine.core_process_client"


def hang_logged(caplog: pytest.LogCaptureFixture, timeout_s: float) -> bool:
    return any(
        r.levelno == logging.ERROR and f"--engine-hang-timeout {timeout_s:g} s" in r.getMessage()
        for r in caplog.records
        if r.name == ENGINE_LOG
    )


# --------------------------------------------------------------------------- fake engine: the rules


def test_a_silent_engine_with_requests_waiting_is_declared_dead(caplog):
    async def scenario(fs: FakeServer) -> None:
        loop = asyncio.get_running_loop()
        body = {"prompt": "hi", "max_tokens": 100, "ignore_eos": True, "stream": True}
        async with fs.client.stream("POST", COMPLETIONS, json=body) as stream:
            lines = stream.aiter_lines()
            assert (await anext(lines)).startswith("data: {")  # generating
            fs.engine.core.paused = True  # from here on the engine says nothing
            silent_since = loop.time()
            waiting = asyncio.create_task(fs.client.post(COMPLETIONS, json={"prompt": "queued"}))
            rest = [line async for line in lines if line]
        failed_after = loop.time() - silent_since
        assert FAKE_HANG_S - 0.1 < failed_after < FAKE_HANG_S + 1.5, failed_after
        assert rest[-1] == "data: [DONE]" and rest.count("data: [DONE]") == 1, rest[-3:]
        errors = [e for e in map(json.loads, (r.removeprefix("data: ") for r in rest[:-1])) if "error" in e]
        assert len(errors) == 1 and openai_error_problem(errors[0], 503) is None, errors
        assert "--engine-hang-timeout" in errors[0]["error"]["message"]
        assert_openai_error(await waiting, 503)

        health = await fs.client.get("/health")
        assert health.status_code == 503 and "hung" in health.json()["reason"], health.text
        started = loop.time()
        assert_openai_error(await fs.client.post(COMPLETIONS, json={"prompt": "late"}), 503)
        assert loop.time() - started < 0.5
        assert fs.engine.num_unfinished == 0
        assert hang_logged(caplog, FAKE_HANG_S)

    with caplog.at_level(logging.ERROR, logger=ENGINE_LOG):
        run(scenario, serve_http=True, step_s=0.05, hang_timeout_s=FAKE_HANG_S)  # streams as they go


def test_a_request_to_an_engine_already_silent_fails_at_once():
    """Hung while idle: nothing waited, so nothing happened; the first request finds it."""

    async def scenario(fs: FakeServer) -> None:
        fs.engine.core.paused = True
        await asyncio.sleep(FAKE_HANG_S * 2)
        assert (await fs.client.get("/health")).status_code == 200  # idle: not checked
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert_openai_error(await fs.client.post(COMPLETIONS, json={"prompt": "hi"}), 503)
        assert loop.time() - started < FAKE_HANG_S, "it waited for a new timeout"

    run(scenario, hang_timeout_s=FAKE_HANG_S)


def test_idle_silence_and_long_generations_are_not_hangs():
    async def scenario(fs: FakeServer) -> None:
        # Long idle stretches (stats every 0.5 s, as the engine process sends them).
        await asyncio.sleep(2 * FAKE_HANG_S)
        assert (await fs.client.get("/health")).status_code == 200
        # A generation several hang timeouts long that reports after every step.
        started = asyncio.get_running_loop().time()
        r = await fs.client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 80, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
        assert asyncio.get_running_loop().time() - started > 2 * FAKE_HANG_S
        assert (await fs.client.get("/health")).status_code == 200
        assert fs.engine.dead is None

    run(scenario, step_s=0.025, hang_timeout_s=FAKE_HANG_S)


def test_zero_disables_the_check():
    async def scenario(fs: FakeServer) -> None:
        fs.engine.core.paused = True
        waiting = asyncio.create_task(fs.client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 3}))
        await wait_until(lambda: len(fs.engine.core.added) == 1)
        await asyncio.sleep(1.0)
        assert not waiting.done() and fs.engine.dead is None
        fs.engine.core.paused = False
        assert (await waiting).status_code == 200

    run(scenario, hang_timeout_s=0)


def test_a_stalled_event_loop_is_not_an_engine_hang():
    """When this process's own loop stalled past the timeout, the engine's messages wait unread in
    the socket: the engine spoke, so it is not declared hung."""

    async def scenario() -> None:
        engine = FakeEngine(hang_timeout_s=1.0)
        address = f"ipc://{engine.client.ipc_dir}/output"
        engine.client._from_engine.bind(address)
        context = zmq.Context()
        sender = context.socket(zmq.PUSH)
        sender.connect(address)
        try:
            engine._streams["waiting"] = _Stream(queue=asyncio.Queue(), child_ids=["waiting"])
            engine.client.last_heard = time.monotonic() - 10
            assert engine.client._is_hung()
            sender.send(msgspec.msgpack.encode(StepOutputs(stats={"num_running": 1})))
            await wait_until(lambda: bool(engine.client._from_engine.getsockopt(zmq.EVENTS) & zmq.POLLIN))
            assert not engine.client._is_hung()
        finally:
            sender.close(linger=0)
            context.term()
            engine._streams.clear()
            await engine.shutdown()

    asyncio.run(scenario())


# --------------------------------------------------------------------------- the real engine process

HANG_S = 3.0
LONG = 240  # tokens: seconds of work on the paced model, so the stream is mid-flight when stopped


def test_a_stopped_engine_process_is_killed_and_its_requests_fail(tmp_path, paced_llama_dir):
    server = start_tiny_server(
        str(tmp_path), str(paced_llama_dir), "--max-model-len", "512", "--engine-hang-timeout", str(HANG_S)
    )
    tree = process_tree(server.process.pid)
    try:
        engine = psutil.Process(engine_pid(server))
        body = {"prompt": "tell me a long story", "max_tokens": LONG, "ignore_eos": True}
        (streaming,), threads = start_clients(server.base_url, [("stream", body)])
        assert streaming.started.wait(60), "the stream never started"
        assert streaming.ended_at is None, f"the stream ended before the engine was stopped: {streaming}"

        os.kill(engine.pid, signal.SIGSTOP)  # alive, silent: a hang
        stopped_at = time.monotonic()
        (plain,), plain_threads = start_clients(server.base_url, [("plain", body)])
        threads += plain_threads
        for thread in threads:
            thread.join(HANG_S + 20)
        assert not any(t.is_alive() for t in threads), "a client still waits on the stopped engine"
        took = max(s.ended_at for s in (streaming, plain)) - stopped_at  # type: ignore[type-var]
        print(f"engine SIGSTOPped: both clients failed {took:.2f} s later (--engine-hang-timeout {HANG_S:g})")
        assert HANG_S - 0.5 < took < HANG_S + 5, f"failed {took:.1f} s after the stop"

        assert streaming.error is None and streaming.status == 200, streaming
        errors = [e for e in streaming.events if "error" in e]
        assert len(errors) == 1 and openai_error_problem(errors[0], 503) is None, streaming.events[-3:]
        assert streaming.done_lines == 1
        assert plain.error is None and plain.status == 503, plain
        assert openai_error_problem(plain.body, 503) is None, plain.body

        health = httpx.get(f"{server.base_url}/health", timeout=5)
        assert health.status_code == 503 and "--engine-hang-timeout" in health.json()["reason"], health.text
        late = httpx.post(f"{server.base_url}{COMPLETIONS}", json={"prompt": "hi"}, timeout=5)
        assert late.status_code == 503, late.text
        deadline = time.monotonic() + 10
        while is_alive(engine):  # killed and reaped by the server
            assert time.monotonic() < deadline, "the stopped engine process was not killed"
            time.sleep(0.1)
        assert f"--engine-hang-timeout {HANG_S:g} s; killing it" in server.log()
    finally:
        server.stop(signal.SIGTERM, timeout=30)
        leaked = survivors(tree)
        for process in tree:  # never leave a (stopped) process behind, even when the test failed
            if is_alive(process):
                process.kill()
    assert server.process.returncode == 0, server.log()
    assert not leaked, f"processes outlived the server: {leaked}"
