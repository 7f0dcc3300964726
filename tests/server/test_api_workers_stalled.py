"""The first API server process kills another that the engine gave up on (it stopped reading the
engine's messages; engine/client_links.py), and only that process: not one already replaced in
its slot, not a slot that does not exist. The engine's notice reaches it through the engine client
(`on_api_server_stalled`)."""

from __future__ import annotations

import subprocess
import sys

import msgspec

from tokenmill.engine.messages import ApiServerStalled, EngineMessage
from tokenmill.server.api_workers import ApiWorkers


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_only_the_named_process_is_killed() -> None:
    workers = ApiWorkers(2)
    workers.processes = [_sleeper(), _sleeper()]
    try:
        first, second = workers.processes
        workers.kill_stalled(2, second.pid + 100_000)  # another process than the one in slot 2
        workers.kill_stalled(3, second.pid)  # no such slot
        assert first.poll() is None and second.poll() is None
        workers.kill_stalled(2, second.pid)
        assert second.wait(10) == -9 and first.poll() is None
        workers.kill_stalled(2, second.pid)  # reported again (by another engine core): nothing to do
    finally:
        for process in workers.processes:
            process.kill()
            process.wait(10)


def test_the_engine_client_hands_the_notice_on() -> None:
    from tokenmill.config import EngineConfig
    from tokenmill.engine.core_process_client import CoreProcessClient

    client = CoreProcessClient(EngineConfig())
    heard: list[tuple[int, int]] = []
    client.on_api_server_stalled = lambda slot, pid: heard.append((slot, pid))
    wire = msgspec.msgpack.encode(ApiServerStalled(slot=1, pid=1234))
    client._handle_message(msgspec.msgpack.decode(wire, type=EngineMessage))
    assert heard == [(1, 1234)]
