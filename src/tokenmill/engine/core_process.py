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

from tokenmill import envs
from tokenmill.config import EngineConfig
from tokenmill.cpu_cores import usable_cores
from tokenmill.engine.client_links import ClientLinks, ParentGone, parent_alive_check
from tokenmill.engine.messages import (
    AbortRequests,
    AddRequests,
    ApiServerGone,
    ApiServerStalled,
    EngineReady,
    Hello,
    Shutdown,
    UtilityCall,
    UtilityResult,
)
from tokenmill.lora.request import LoRARequest

logger = logging.getLogger("tokenmill.engine")

IDLE_POLL_MS = 200
STATS_INTERVAL_S = 0.5
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


def run_engine_core(
    config_bytes: bytes,
    input_addrs: list[str],
    output_addrs: list[str],
    parent_pid: int,
    log_level: str = "INFO",
) -> None:
    """Entry point of the spawned engine process. `config_bytes` is the msgpack of EngineConfig;
    one (input, output) address pair per API server process (client_links.py), the first the
    parent's."""
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
    # A full outbox to the first API server means it is not reading: the engine waits for it while
    # it lives, never forever. The others' messages wait in backlogs (client_links.py).
    links = ClientLinks(
        ctx, input_addrs, output_addrs, parent_alive_check(parent_pid),
        stall_timeout_s=envs.TOKENMILL_API_SERVER_STALL_TIMEOUT.get(),
    )  # fmt: skip
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
            links.send(0, EngineReady(error=f"{type(exc).__name__}: {exc}"))
            raise SystemExit(1) from exc
        # The model, torch's modules and the engine's own objects live as long as the process: out
        # of the collector's reach, a full collection walks only what requests made since.
        gc.collect()
        gc.freeze()
        core.start_serving()
        # The grammar compiler (tokenizer, xgrammar's vocabulary) builds on a compile thread while
        # the server comes up, not when the first constrained requests arrive and wait for it.
        core.structured_output.warm_up()
        links.send(0, EngineReady(info=core.info))
        _busy_loop(core, links, parent_pid)
    except ParentGone:
        logger.warning("the API server process is gone; engine exiting")
    finally:
        links.close()
        ctx.term()


def _busy_loop(core, links: ClientLinks, parent_pid: int) -> None:
    last_stats = 0.0
    while True:
        timeout = 0 if core.has_work() else IDLE_POLL_MS
        for client, message in links.receive(timeout):
            if isinstance(message, AddRequests):
                for req in message.requests:
                    core.add_request(req)
            elif isinstance(message, AbortRequests):
                core.abort_requests(message.request_ids)
            elif isinstance(message, UtilityCall):
                links.send(client, _utility(core, message))
            elif isinstance(message, Hello):  # another API server process is up (client_links.py)
                replaced = links.register(client, message.pid)
                if replaced:  # a restarted one: the dead one's requests have no reader
                    logger.warning("API server slot %d restarted: aborting its %d requests", client, len(replaced))
                    core.abort_requests(replaced)
                links.send(client, EngineReady(info=core.info))
            elif isinstance(message, ApiServerGone):
                orphaned = links.drop(message.slot, message.pid)
                if orphaned:
                    logger.warning(
                        "API server slot %d (pid %d) exited: aborting its %d requests",
                        message.slot, message.pid, len(orphaned),
                    )  # fmt: skip
                    core.abort_requests(orphaned)
            elif isinstance(message, Shutdown):
                return
        # getppid is a cheap syscall; checking every iteration means a busy engine whose parent
        # was killed stops within one step even without PDEATHSIG.
        if os.getppid() != parent_pid:
            raise ParentGone
        now = time.monotonic()
        if core.has_work():
            outputs = core.step()
            now = time.monotonic()
            stats_due = now - last_stats > STATS_INTERVAL_S
            if outputs or stats_due:
                links.send_step(outputs, core.get_stats(), stats_due=stats_due)
            # Timed from the last send to every API server, not from the last outputs: one whose
            # requests all wait in the queue hears the engine (and is not left to think it hangs).
            if stats_due:
                last_stats = now
        elif now - last_stats > STATS_INTERVAL_S:
            links.send_step([], core.get_stats(), stats_due=True)
            core.flush_trace()  # idle: what a finished benchmark reads is on disk
            last_stats = now
        if links.count > 1:
            _drop_stalled(core, links)


def _drop_stalled(core, links: ClientLinks) -> None:
    """Backlogs to other API server processes go out as their queues take them; one stalled past
    the timeout loses its requests and the first process is told to kill it (client_links.py)."""
    for slot, pid in links.flush_backlogs():
        orphaned = links.drop(slot, pid)
        logger.error(
            "API server slot %d (pid %d) left the engine's messages unread for over %g s: aborting its %d "
            "requests; the first process kills it",
            slot, pid, links.stall_timeout_s, len(orphaned),
        )  # fmt: skip
        core.abort_requests(orphaned)
        links.send(0, ApiServerStalled(slot=slot, pid=pid))


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
    parser.add_argument(
        "--input-addr", required=True, action="append", help="ipc:// address an API server sends on (one per server)"
    )
    parser.add_argument(
        "--output-addr", required=True, action="append", help="ipc:// address an API server receives on (one per server)"
    )
    parser.add_argument("--parent-pid", type=int, required=True, help="exit when this process is gone")
    parser.add_argument("--log-level", default="INFO", help="the API server's log level (tokenmill --log-level)")
    args = parser.parse_args(argv)
    if len(args.input_addr) != len(args.output_addr):
        parser.error("give one --output-addr per --input-addr (a pair per API server process)")
    for addr in (*args.input_addr, *args.output_addr):
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
