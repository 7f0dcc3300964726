"""A tensor-parallel rank that dies or hangs turns the engine dead: every client gets an error (not
a hang), /health says 503, and no process outlives the server.

A killed rank is seen by the executor (the worker's exit) within a step; a stopped one keeps rank 0
inside an all-reduce, so the engine goes silent and --engine-hang-timeout kills the engine process,
whose workers die with it (the kernel's parent-death signal reaches stopped processes too).
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest

from tests.reliability.server_tools import (
    engine_pid,
    openai_error_problem,
    process_tree,
    start_clients,
    start_tiny_server,
    survivors,
)

HANG_TIMEOUT_S = 3.0


def _tp_workers(engine: int) -> list[psutil.Process]:
    workers = [p for p in psutil.Process(engine).children() if "tp_worker" in " ".join(p.cmdline())]
    assert len(workers) == 2, f"expected 2 tensor-parallel workers, found {workers}"
    return workers


@pytest.mark.parametrize("fault", ["killed", "stopped"])
def test_a_lost_rank_fails_every_request_and_leaves_no_process(tmp_path, paced_llama_dir, fault):
    server = start_tiny_server(
        str(tmp_path), str(paced_llama_dir), "--tensor-parallel-size", "2", "--max-model-len", "512",
        "--num-kv-blocks", "256", "--engine-hang-timeout", str(HANG_TIMEOUT_S),
    )  # fmt: skip
    try:
        engine = engine_pid(server)
        workers = _tp_workers(engine)
        tree = process_tree(server.process.pid)
        body = {"prompt": "tell me a long story", "max_tokens": 400, "ignore_eos": True}
        results, threads = start_clients(server.base_url, [("stream", body)] * 2 + [("plain", body)])
        deadline = time.monotonic() + 60
        while not all(r.started.is_set() for r in results[:2]):
            assert time.monotonic() < deadline, "the streams never started"
            time.sleep(0.02)
        os.kill(workers[1].pid, signal.SIGKILL if fault == "killed" else signal.SIGSTOP)
        hit = time.monotonic()
        for thread in threads:
            thread.join(timeout=HANG_TIMEOUT_S + 15)
        assert not any(t.is_alive() for t in threads), "a client still waits after the rank was lost"
        slowest = max(r.ended_at for r in results) - hit  # type: ignore[operator]
        limit = 5.0 if fault == "killed" else HANG_TIMEOUT_S + 5.0
        assert slowest < limit, f"a client took {slowest:.1f} s to learn that the engine died"
        for i, result in enumerate(results):
            assert result.error is None, f"client {i}: {result.error}"
            if i < 2:  # started streams: one error event, then [DONE]
                errors = [e for e in result.events if "error" in e]
                assert len(errors) == 1 and openai_error_problem(errors[0], 503) is None, result.events[-3:]
            else:
                assert result.status == 503 and openai_error_problem(result.body, 503) is None, result.body
        health = httpx.get(f"{server.base_url}/health", timeout=5)
        assert health.status_code == 503, health.text
    finally:
        server.stop(signal.SIGTERM, timeout=30)
    leaked = survivors(tree)
    assert not leaked, f"processes outlived the server: {leaked}"
