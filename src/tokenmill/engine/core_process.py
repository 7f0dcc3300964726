"""The engine core's own process: a busy loop of ZMQ input -> EngineCore.step() -> ZMQ output.

Only msgspec msgpack crosses the sockets (no pickle), and only over ipc:// paths the parent made.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback

import msgspec
import zmq

from tokenmill.config import EngineConfig
from tokenmill.engine.messages import (
    AbortRequests,
    AddRequests,
    ClientMessage,
    EngineReady,
    Shutdown,
    StepOutputs,
    UtilityCall,
    UtilityResult,
)

logger = logging.getLogger("tokenmill.engine")

IDLE_POLL_MS = 500
STATS_INTERVAL_S = 0.5


def run_engine_core(config_bytes: bytes, input_addr: str, output_addr: str, parent_pid: int) -> None:
    """Entry point of the spawned engine process. `config_bytes` is the msgpack of EngineConfig."""
    # The API server owns signals: it drains and then tells us to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)

    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(input_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(output_addr)
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(ClientMessage)

    try:
        from tokenmill.engine.engine_core import EngineCore

        core = EngineCore(config)
    except Exception as exc:
        logger.exception("engine start-up failed")
        outbox.send(encoder.encode(EngineReady(error=f"{type(exc).__name__}: {exc}")))
        outbox.close(linger=2000)
        ctx.term()
        raise SystemExit(1) from exc
    outbox.send(encoder.encode(EngineReady(info=core.info)))

    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    last_stats = 0.0
    running = True
    while running:
        timeout = 0 if core.has_work() else IDLE_POLL_MS
        events = dict(poller.poll(timeout))
        if inbox in events:
            while True:
                try:
                    raw = inbox.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                message = decoder.decode(raw)
                if isinstance(message, AddRequests):
                    for req in message.requests:
                        core.add_request(req)
                elif isinstance(message, AbortRequests):
                    core.abort_requests(message.request_ids)
                elif isinstance(message, UtilityCall):
                    outbox.send(encoder.encode(_utility(core, message)))
                elif isinstance(message, Shutdown):
                    running = False
                    break
        elif os.getppid() != parent_pid:
            logger.warning("the API server process is gone; engine exiting")
            break
        if running and core.has_work():
            outputs = core.step()
            now = time.monotonic()
            if outputs or now - last_stats > STATS_INTERVAL_S:
                outbox.send(encoder.encode(StepOutputs(outputs=outputs, stats=core.get_stats())))
                last_stats = now
        elif running and time.monotonic() - last_stats > STATS_INTERVAL_S:
            outbox.send(encoder.encode(StepOutputs(stats=core.get_stats())))
            last_stats = time.monotonic()
    inbox.close(linger=0)
    outbox.close(linger=1000)
    ctx.term()


def _utility(core, call: UtilityCall) -> UtilityResult:
    try:
        if call.method == "get_stats":
            return UtilityResult(call.call_id, result=core.get_stats())
        if call.method == "check_invariants":
            core.check_invariants()
            return UtilityResult(call.call_id, result=core.get_stats())
        return UtilityResult(call.call_id, error=f"unknown utility method {call.method!r}")
    except Exception as exc:
        return UtilityResult(call.call_id, error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
