"""Starts `tokenmill serve` in a subprocess on a free loopback port and waits until it is healthy."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def cmdline(pid: int) -> str:
    """The process's command line, spaces between its arguments ("" once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@dataclass
class ServerProcess:
    process: subprocess.Popen
    port: int
    log_path: str

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        # The whole log: with uvicorn's access log on, a slow start-up's /health polls can push the
        # start-up lines out of any fixed-size tail.
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def child_pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.process.pid)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode


def start_server(
    tmp_dir: str,
    *extra: str,
    timeout: float = 240.0,
    env: dict[str, str] | None = None,
    new_session: bool = False,
) -> ServerProcess:
    """`new_session`: the server leads its own process group, so a test can signal the whole group
    (as Ctrl-C in a terminal does) without signalling itself."""
    port = free_port()
    log_path = os.path.join(tmp_dir, f"server-{port}.log")
    log = open(log_path, "w")  # noqa: SIM115 - lives as long as the server
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port), *extra],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        start_new_session=new_session,
    )
    server = ServerProcess(process, port, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"server not healthy after {timeout} s:\n{server.log()}")
