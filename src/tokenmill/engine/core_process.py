"""The engine core's own process: a busy loop of ZMQ input -> EngineCore.step() -> ZMQ output.

Started by the API server's CoreProcessClient (core_process_client.py) as `python -m
tokenmill.engine.core_process --input-addr ipc://... ...` with the msgpack of its EngineConfig on
stdin: no multiprocessing, so nothing is ever unpickled, neither the start-up arguments nor anything
on the sockets (msgspec msgpack only, over ipc:// paths in a directory only this user can enter).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import os
import signal
import sys
import time
import traceback

import msgspec
import zmq

from tokenmill.config import EngineConfig
from tokenmill.cpu_cores import usable_cores
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
from tokenmill.lora.request import LoRARequest

logger = logging.getLogger("tokenmill.engine")

IDLE_POLL_MS = 200
STATS_INTERVAL_S = 0.5
SEND_RETRY_S = 0.005
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when the API server dies, however it dies."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        logger.warning("prctl(PR_SET_PDEATHSIG) unavailable; relying on polling the parent pid")


def _init_torch(config: EngineConfig) -> None:
    """What the offline LLM does before building its engine, so both run the same model (dummy
    weights come from the global generator), and the CPU thread count.

    On CPU the API server shares the cores with this process (HTTP, tokenization, SSE,
    detokenization), and so does a load generator on the same machine. Serving measured on
    2 cores (64 in-flight tokens x 32 streams, passive OpenMP waits, machine otherwise loaded):
    1 torch thread 60-64 output tok/s, 2 threads 51 tok/s; one stream: equal. So the engine
    leaves one core to the rest unless OMP_NUM_THREADS says otherwise. OpenMP's wait policy is
    set when tokenmill is imported, before torch loads (tokenmill/__init__.py). The CPU kernels
    then start a helper thread that takes part of the products and attention only while the other
    core is free (kernels/cpu/build.py, csrc/helper_pool.h).
    """
    import torch

    torch.manual_seed(config.model.seed)
    if config.device.startswith("cpu") and "OMP_NUM_THREADS" not in os.environ:
        cores = usable_cores()
        threads = max(1, cores - 1)
        torch.set_num_threads(threads)
        logger.info(
            "engine on CPU: %d torch threads of %d cores (one left to the API server)", threads, cores
        )


class _ParentGone(Exception):
    pass


def run_engine_core(
    config_bytes: bytes, input_addr: str, output_addr: str, parent_pid: int, log_level: str = "INFO"
) -> None:
    """Entry point of the spawned engine process. `config_bytes` is the msgpack of EngineConfig."""
    # The API server owns shutdown: on SIGINT / SIGTERM it drains, then sends Shutdown. Those
    # signals often reach the whole process group (Ctrl-C, `timeout`, systemd), and dying on them
    # here would fail the requests being drained. Without the parent this process cannot outlive
    # it: PDEATHSIG and the parent-pid check end it. SIGKILL still works, as always.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    if os.getppid() != parent_pid:
        return  # the parent died before prctl took effect
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = msgspec.msgpack.decode(config_bytes, type=EngineConfig)

    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(input_addr)
    outbox = ctx.socket(zmq.PUSH)
    outbox.connect(output_addr)
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(ClientMessage)

    def send(message: object) -> None:
        # A full outbox means the API server is not reading: wait for it while it lives, never forever.
        data = encoder.encode(message)
        while True:
            try:
                outbox.send(data, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                if os.getppid() != parent_pid:
                    raise _ParentGone from None
                time.sleep(SEND_RETRY_S)

    try:
        try:
            from tokenmill.args import resolve_device_defaults
            from tokenmill.engine.engine_core import EngineCore

            # The API server leaves device "auto" to this process; the thread count depends on it.
            config = resolve_device_defaults(config)
            _init_torch(config)

            core = EngineCore(config)
        except Exception as exc:
            logger.exception("engine start-up failed")
            send(EngineReady(error=f"{type(exc).__name__}: {exc}"))
            raise SystemExit(1) from exc
        # The model, torch's modules and the engine's own objects live as long as the process: out
        # of the collector's reach, a full collection walks only what requests made since.
        gc.collect()
        gc.freeze()
        core.start_serving()
        # The grammar compiler (tokenizer, xgrammar's vocabulary) builds on a compile thread while
        # the server comes up, not when the first constrained requests arrive and wait for it.
        core.structured_output.warm_up()
        send(EngineReady(info=core.info))
        _busy_loop(core, inbox, decoder, send, parent_pid)
    except _ParentGone:
        logger.warning("the API server process is gone; engine exiting")
    finally:
        inbox.close(linger=0)
        outbox.close(linger=1000)
        ctx.term()


def _busy_loop(core, inbox, decoder, send, parent_pid: int) -> None:
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)
    last_stats = 0.0
    while True:
        timeout = 0 if core.has_work() else IDLE_POLL_MS
        if poller.poll(timeout):
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
                    send(_utility(core, message))
                elif isinstance(message, Shutdown):
                    return
        # getppid is a cheap syscall; checking every iteration means a busy engine whose parent
        # was killed stops within one step even without PDEATHSIG.
        if os.getppid() != parent_pid:
            raise _ParentGone
        now = time.monotonic()
        if core.has_work():
            outputs = core.step()
            now = time.monotonic()
            if outputs or now - last_stats > STATS_INTERVAL_S:
                send(StepOutputs(outputs=outputs, stats=core.get_stats()))
                last_stats = now
        elif now - last_stats > STATS_INTERVAL_S:
            send(StepOutputs(stats=core.get_stats()))
            core.flush_trace()  # idle: what a finished benchmark reads is on disk
            last_stats = now


def run_utility(core, method: str, args: dict[str, str | int | None]) -> dict[str, float]:
    """One out-of-band call: get_stats, check_invariants, add_lora (lora_name, lora_int_id,
    lora_path: start loading it), remove_lora (lora_int_id). Raises ValueError for an unknown one."""
    if method == "check_invariants":
        core.check_invariants()
    elif method == "add_lora":
        core.add_lora(LoRARequest(str(args["lora_name"]), int(args["lora_int_id"]), str(args["lora_path"])))  # type: ignore[arg-type]
    elif method == "remove_lora":
        core.remove_lora(int(args["lora_int_id"]))  # type: ignore[arg-type]
    elif method != "get_stats":
        raise ValueError(f"unknown utility method {method!r}")
    return core.get_stats()


def _utility(core, call: UtilityCall) -> UtilityResult:
    try:
        return UtilityResult(call.call_id, result=run_utility(core, call.method, call.args))
    except ValueError as exc:  # a bad call: its message is the answer
        return UtilityResult(call.call_id, error=str(exc))
    except Exception as exc:
        return UtilityResult(call.call_id, error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")


def main(argv: list[str] | None = None) -> int:
    """`python -m tokenmill.engine.core_process`: reads the EngineConfig (msgpack) from stdin."""
    parser = argparse.ArgumentParser(prog="tokenmill.engine.core_process")
    parser.add_argument("--input-addr", required=True, help="ipc:// address the API server sends on")
    parser.add_argument("--output-addr", required=True, help="ipc:// address the API server receives on")
    parser.add_argument("--parent-pid", type=int, required=True, help="exit when this process is gone")
    parser.add_argument("--log-level", default="INFO", help="the API server's log level (tokenmill --log-level)")
    args = parser.parse_args(argv)
    for addr in (args.input_addr, args.output_addr):
        if not addr.startswith("ipc://"):
            parser.error(f"engine addresses must be ipc:// paths, got {addr!r}")
    config_bytes = sys.stdin.buffer.read()
    sys.stdin.close()
    run_engine_core(config_bytes, args.input_addr, args.output_addr, args.parent_pid, args.log_level)
    # Stopped and its sockets closed: skip the interpreter's final garbage-collection passes over
    # every object torch made (~0.3 s of an idle server's shutdown; see api_server.run_server).
    gc.freeze()
    return 0


if __name__ == "__main__":
    sys.exit(main())
