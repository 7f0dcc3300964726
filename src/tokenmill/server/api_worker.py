"""One of the other API server processes of `serve --api-server-count N` (api_workers.py).

`python -m tokenmill.server.api_worker`, its WorkerSpec as a line of JSON on stdin, started by the
first API server process once the engine is ready. It builds the same server from the same flags,
attaches to the running engine core(s) through its own socket slot, registers the adapters the
first process loaded and says "ready" on stdout; when "serve" comes on stdin it binds its
listening socket on the server's port (listen_socket.py) and serves. Never torch: like the first
process, it only talks to the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys

import msgspec

from tokenmill.engine.core_process import _die_with_parent
from tokenmill.lora.request import LoRARequest
from tokenmill.server.api_workers import WorkerSpec
from tokenmill.server.launch import _DrainingServer, build_server
from tokenmill.server.listen_socket import reuseport_socket

logger = logging.getLogger("tokenmill.server")


def _say(line: str) -> None:
    """The one line the first process waits for; stdout then goes to stderr, so nothing written
    later can fill a pipe nobody reads."""
    sys.stdout.write(line.replace("\n", " ") + "\n")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())


async def _serve(server: _DrainingServer, spec: WorkerSpec) -> int:
    state = server.tm_state
    try:
        await state.engine.start()
    except Exception as exc:
        _say(f"could not attach to the engine: {exc}")
        await state.engine.shutdown()
        return 1
    state.engine_started()
    if state.lora is not None:
        for adapter in spec.adapters:
            state.lora.adopt(
                LoRARequest(adapter.name, adapter.lora_int_id, adapter.path), adapter.base_model_name
            )
    gc.freeze()  # as the first process does once started (launch._serve)
    _say("ready")
    # Bound only now: a listening socket in the port's group gets its share of new connections
    # at once, accepted or not.
    if (await asyncio.to_thread(sys.stdin.buffer.readline)).strip() != b"serve":
        await state.engine.shutdown()  # the first process is gone or stopping
        return 1
    try:
        sock = reuseport_socket(server.config.host, server.config.port)
    except OSError as exc:  # the first process sees this one exit and stops the server
        logger.error("API server process %d: %s", spec.slot, exc.strerror)
        await state.engine.shutdown()
        return 1
    state.ready = True
    try:
        await server.serve([sock])
    finally:
        await state.engine.shutdown()
    return 0


def main() -> int:
    spec = msgspec.json.decode(sys.stdin.buffer.readline(), type=WorkerSpec)
    _die_with_parent()  # never outlives the first process, however that one ends
    args = argparse.Namespace(**spec.args)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s [api {spec.slot}] %(name)s: %(message)s",
    )
    # Until uvicorn installs its handlers: a signal before then just ends the process.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        server = build_server(args, worker=spec)
    except ValueError as exc:  # the first process accepted these flags: only a bug gets here
        _say(f"could not build the server: {exc}")
        return 2
    code = asyncio.run(_serve(server, spec))
    gc.freeze()  # skip the final collections over everything imported (see launch.run_server)
    return code


if __name__ == "__main__":
    sys.exit(main())
