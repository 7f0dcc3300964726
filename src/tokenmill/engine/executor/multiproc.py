"""Tensor-parallel workers as local processes, one per rank (`--distributed-executor-backend mp`).

Each is `python -m tokenmill.engine.executor.tp_worker` with its WorkerSpec's msgpack on stdin (as
the engine process itself is started: no multiprocessing, nothing unpickled). They talk to the
engine over ipc:// sockets in a directory only this user can enter, and meet each other through
torch.distributed's TCP rendezvous on 127.0.0.1. The kernel kills them when the engine process dies
(PR_SET_PDEATHSIG), and they also exit when they see their parent gone.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import msgspec
import zmq

from tokenmill.engine.executor.worker_group import WorkerGroupExecutor
from tokenmill.engine.executor.worker_messages import WorkerSpec

logger = logging.getLogger(__name__)

STOP_WAIT_S = 5.0


def free_tcp_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class MultiprocExecutor(WorkerGroupExecutor):
    _ipc_dir: Path | None = None
    _processes: list[subprocess.Popen] = []

    def _bind(self, sock: zmq.Socket) -> str:
        if self._ipc_dir is None:
            self._ipc_dir = Path(tempfile.mkdtemp(prefix="tokenmill-tp-"))  # mode 0700
            self._num_sockets = 0
        self._num_sockets += 1
        addr = f"ipc://{self._ipc_dir / f's{self._num_sockets}'}"
        sock.bind(addr)
        return addr

    def _dist_init_method(self) -> str:
        return f"tcp://127.0.0.1:{free_tcp_port()}"

    def _start_workers(self, specs: list[WorkerSpec]) -> None:
        self._processes = []
        for spec in specs:
            env = {**os.environ, "OMP_NUM_THREADS": str(spec.torch_threads)}
            process = subprocess.Popen(
                [sys.executable, "-m", "tokenmill.engine.executor.tp_worker"], stdin=subprocess.PIPE, env=env
            )
            self._processes.append(process)
            assert process.stdin is not None
            process.stdin.write(msgspec.msgpack.encode(spec))
            process.stdin.close()

    def _dead_worker(self, besides: int | None = None) -> str | None:
        for rank, process in enumerate(self._processes):
            code = None if rank == besides else process.poll()
            if code is not None:
                return f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {code}"
        return None

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._processes]

    def _stop_workers(self) -> None:
        # Stopped workers exit at once; after a death the others may sit in a collective: kill them.
        wait_s = STOP_WAIT_S if self._dead is None else 0.0
        for process in self._processes:
            try:
                process.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                if wait_s:
                    logger.warning("tensor-parallel worker %d did not stop; killing it", process.pid)
                process.kill()
                process.wait()
        for process in self._processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
