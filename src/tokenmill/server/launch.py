"""Launching `tokenmill serve`: the engine config from the flags, the server state, uvicorn with a
drain on SIGINT / SIGTERM, and the engine start-up beside it."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import logging
import math
import shutil
import signal
import sys
import tempfile
from typing import Any

import uvicorn

from tokenmill import __version__, envs
from tokenmill.args import EngineArgs
from tokenmill.errors import TokenmillError
from tokenmill.metrics import METRICS_PREFIXES, ServerMetrics
from tokenmill.server.admission import AdmissionControl
from tokenmill.server.api_server import create_app
from tokenmill.server.api_workers import ApiWorkers, WorkerAdapter, WorkerEngine, WorkerSpec
from tokenmill.server.http_protocol import make_uvicorn_config
from tokenmill.server.lora_registry import RUNTIME_FLAG, LoRAModule, LoRARegistry, parse_lora_module
from tokenmill.server.operator_options import api_keys_from_args, check_tls_args, cors_from_args
from tokenmill.server.state import ServerState

logger = logging.getLogger("tokenmill.server")

# After the drain, uvicorn waits this long for responses still being written before cancelling them.
GRACEFUL_SHUTDOWN_S = 10
# After aborting what outlived --shutdown-timeout, how long the aborts may take to reach the clients.
ABORT_GRACE_S = 5.0
# How long --api-server-count's other processes may take to load their tokenizer and attach.
WORKER_READY_TIMEOUT_S = 600.0


async def drain(state: ServerState, timeout_s: float) -> None:
    """Stops admitting requests, lets in-flight ones finish for up to `timeout_s`, then aborts the
    rest (their clients get finish_reason "abort") and waits briefly for those to be delivered."""
    state.draining = True
    engine = state.engine
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while engine.num_unfinished and not engine.dead and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if engine.num_unfinished and not engine.dead:
        logger.warning("aborting %d requests still running after the shutdown timeout", engine.num_unfinished)
        await engine.abort_all()
        grace = loop.time() + ABORT_GRACE_S
        while engine.num_unfinished and not engine.dead and loop.time() < grace:
            await asyncio.sleep(0.02)


class _DrainingServer(uvicorn.Server):
    """uvicorn that drains on SIGINT / SIGTERM: stop admitting, let in-flight requests finish up to
    the shutdown timeout, abort the rest (finish_reason "abort"), then exit. A second signal exits now.

    handle_exit deliberately does not record the signal the way uvicorn's does: uvicorn re-raises
    recorded signals once serve() returns, which would kill this process before it reaps the engine.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.tm_state = state
        self.shutdown_timeout = shutdown_timeout
        self._drain_task: asyncio.Task | None = None
        self.lora_modules: list[LoRAModule] = []  # --lora-modules, loaded once the engine is up
        self._loop: asyncio.AbstractEventLoop | None = None
        # --api-server-count > 1, in the first process: the others (api_workers.py), the directory
        # of their shared Prometheus files, and why one of them stopped the server.
        self.api_workers: ApiWorkers | None = None
        self.metrics_dir: str | None = None
        self.worker_failure: str | None = None
        self.tm_args: dict[str, Any] = {}  # the parsed flags, handed to the other API server processes

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        state = self.tm_state
        if state.draining or self.should_exit or not state.ready or self._loop is None:
            # A second signal, or nothing to drain yet (still starting): stop now.
            self.force_exit = state.draining or self.should_exit
            self.should_exit = True
            if self.api_workers is not None and self.force_exit:
                self.api_workers.force()
            return
        logger.warning(
            "received %s: draining for up to %.0f s", signal.Signals(sig).name, self.shutdown_timeout
        )
        state.draining = True  # from here on /health is 503 and new requests get 503
        # A Python signal handler runs between bytecodes of the loop's thread; schedule through
        # call_soon_threadsafe so the loop wakes up for it at once.
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self.api_workers is not None:
            self.api_workers.drain()  # each drains its own requests meanwhile

        async def drain_then_exit() -> None:
            try:
                await drain(self.tm_state, self.shutdown_timeout)
            finally:
                self.should_exit = True

        self._drain_task = asyncio.get_running_loop().create_task(drain_then_exit())


def build_server(args: argparse.Namespace, worker: WorkerSpec | None = None) -> _DrainingServer:
    """The server `tokenmill serve` runs, every flag in place; nothing started yet. Raises
    ValueError naming the flag when an engine flag is invalid. `worker`: this is one of the other
    API server processes of --api-server-count (api_worker.py), attaching to running engines."""
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.engine.request_log import RequestLog
    from tokenmill.engine.stats_log import StatsLog
    from tokenmill.model.loader.default_model import DEFAULT_MODEL_NAME

    model = args.model
    model_tag = getattr(args, "model_tag", None)  # `tokenmill serve MODEL`
    if model_tag is not None:
        if model is not None and model != model_tag:
            raise ValueError(f"the model is given twice, {model_tag!r} and --model {model!r}; give it once")
        model = model_tag
    # The device and its defaults are resolved in the engine process: this one never imports torch.
    engine_args = dataclasses.replace(EngineArgs.from_cli_args(args), model=model)
    config = engine_args.create_engine_config(resolve_device=False)
    model_root = model or DEFAULT_MODEL_NAME
    names = [n.strip() for n in (engine_args.served_model_name or "").split(",") if n.strip()] or [model_root]
    api_keys = api_keys_from_args(args)
    cors = cors_from_args(args)
    check_tls_args(args)
    check_tool_and_reasoning_args(args)
    lora_modules = check_lora_args(args, lora_enabled=config.lora is not None)
    # Checked before the engine client exists (it owns sockets that a refusal would leave behind).
    if args.max_log_len is not None and not args.enable_log_requests:
        raise ValueError("--max-log-len is set but requests are not logged; add --enable-log-requests")
    request_log = RequestLog(args.max_log_len) if args.enable_log_requests else None
    # The engine's periodic stats line: once, from the first API server process.
    stats_log = None if args.disable_log_stats or worker is not None else StatsLog(envs.TOKENMILL_LOG_STATS_INTERVAL.get())
    api_servers = args.api_server_count
    if api_servers > 1 and not sys.platform.startswith("linux"):
        raise ValueError(
            "--api-server-count > 1 needs Linux (its processes share the port through SO_REUSEPORT and die "
            "with the first one through PR_SET_PDEATHSIG); use 1 here, or several servers behind `tokenmill router`"
        )
    if api_servers > 1:
        # Read in the engine process; read here too so that a bad value is refused by name before
        # anything starts (there it would surface only as "the engine exited").
        envs.TOKENMILL_API_SERVER_STALL_TIMEOUT.get()
    if api_servers > 1 and (args.allow_runtime_lora_updating or envs.TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING.get()):
        raise ValueError(
            f"{RUNTIME_FLAG} needs --api-server-count 1: a load or unload reaches one API server process "
            "and the others would not serve it; load adapters at start-up with --lora-modules instead"
        )
    if args.data_parallel_size > 1 and config.cache.kv_role is not None:
        raise ValueError(
            "--kv-role needs one engine core (--data-parallel-size 1): every core would bind or send to "
            "the same --kv-transfer-address; run one producer / consumer pair per replica behind the router"
        )
    if args.data_parallel_size > 1 and config.parallel.tensor_parallel_size > 1:
        raise ValueError(
            "--data-parallel-size > 1 with --tensor-parallel-size > 1 is not supported yet (each engine core "
            "would need its own group of devices); use one of them, or several servers behind `tokenmill router`"
        )
    client = _engine_client(config, args, worker)
    metrics_dir = None
    if api_servers > 1:
        from tokenmill.metrics_multiprocess import enable_multiprocess_metrics

        # Every API server process writes its metrics here and reads all of them on a scrape.
        metrics_dir = worker.metrics_dir if worker is not None else tempfile.mkdtemp(prefix="tokenmill-metrics-")
        enable_multiprocess_metrics(metrics_dir)
    metrics = ServerMetrics(
        names[0],
        prefix=METRICS_PREFIXES[args.metrics_prefix],
        multiprocess_dir=metrics_dir,
        engine_stats_owner=worker is None,
    )
    state = ServerState(
        engine=AsyncEngine(config, hang_timeout_s=args.engine_hang_timeout, client=client),
        model_names=names,
        model_root=model_root,
        metrics=metrics,
        cost_per_hour=args.cost_per_hour,
        api_keys=api_keys,
        cors=cors,
        root_path=args.root_path,
        max_n=args.max_n,
        max_body_bytes=args.max_body_bytes,
        request_timeout=args.request_timeout,
        max_queue_time=args.max_queue_time,
        client_read_timeout=args.client_read_timeout,
        stream_write_timeout=args.stream_write_timeout or None,
        max_header_bytes=args.max_header_bytes,
        # Each API server process admits its share (connections spread over them evenly).
        admission=AdmissionControl(
            math.ceil(args.max_num_waiting_seqs / api_servers), math.ceil(args.max_num_waiting_tokens / api_servers)
        ),
        enable_debug_endpoints=args.enable_debug_endpoints,
        scheduling_policy=config.scheduler.policy,
        kv_role=config.cache.kv_role,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        trust_request_chat_template=args.trust_request_chat_template,
    )
    if config.cache.kv_role is not None:
        state.metrics.set_kv_transfer(config.cache.kv_role, config.cache.kv_transfer_address or "")
    if config.lora is not None:
        state.lora = LoRARegistry(
            max_lora_rank=config.lora.max_lora_rank,
            base_names=names,
            allowed_dirs=args.lora_allowed_dirs or (),
            allow_runtime_updating=args.allow_runtime_lora_updating or envs.TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING.get(),
        )
    uv_config = make_uvicorn_config(
        create_app(state),
        host=args.host,
        port=args.port,
        max_header_bytes=state.max_header_bytes,
        client_read_timeout=args.client_read_timeout,
        keep_alive_timeout=args.keep_alive_timeout,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        access_log=not args.disable_uvicorn_access_log,
    )
    state.engine.request_log = request_log
    state.engine.stats_log = stats_log
    server = _DrainingServer(uv_config, state, args.shutdown_timeout)
    server.lora_modules = lora_modules
    server.tm_args = vars(args)
    if api_servers > 1 and worker is None:
        server.api_workers = ApiWorkers(api_servers - 1)
        server.metrics_dir = metrics_dir
    return server


def _engine_client(config: Any, args: argparse.Namespace, worker: WorkerSpec | None) -> Any:
    """The engine-core client: None (AsyncEngine's default, one core it spawns), data parallel
    cores it spawns, or — in another API server process — clients of the running cores."""
    hang = args.engine_hang_timeout
    if worker is not None:
        from tokenmill.engine.attached_core_client import AttachedCoreClient

        cores = [
            AttachedCoreClient(config, ipc_dir=e.ipc_dir, slot=worker.slot, engine_pid=e.pid, hang_timeout_s=hang)
            for e in worker.engines
        ]
        if args.data_parallel_size == 1:
            return cores[0]
        from tokenmill.engine.dp_client import DataParallelClient

        return DataParallelClient(config, args.data_parallel_size, hang_timeout_s=hang, cores=cores)
    if args.data_parallel_size > 1:
        from tokenmill.engine.dp_client import DataParallelClient

        return DataParallelClient(
            config, args.data_parallel_size, hang_timeout_s=hang, num_api_servers=args.api_server_count
        )
    if args.api_server_count > 1:
        from tokenmill.engine.core_process_client import CoreProcessClient

        return CoreProcessClient(config, hang_timeout_s=hang, num_api_servers=args.api_server_count)
    return None


def check_lora_args(args: argparse.Namespace, *, lora_enabled: bool) -> list[LoRAModule]:
    """The --lora-modules entries, parsed; ValueError naming the flag when a LoRA flag comes
    without --enable-lora or an entry is malformed or repeats a name."""
    if not lora_enabled:
        for flag, value in (
            ("--lora-modules", args.lora_modules),
            ("--lora-allowed-dirs", args.lora_allowed_dirs),
            (RUNTIME_FLAG, args.allow_runtime_lora_updating),
        ):
            if value:
                raise ValueError(f"{flag} needs --enable-lora (LoRA is off)")
        return []
    modules = [parse_lora_module(text) for text in args.lora_modules or ()]
    names = [m.name for m in modules]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"--lora-modules names {repeated} more than once; each adapter needs its own name")
    return modules


def check_tool_and_reasoning_args(args: argparse.Namespace) -> None:
    """Parser names checked before anything starts (ValueError naming the flag)."""
    from tokenmill.server.reasoning import REASONING_PARSERS
    from tokenmill.server.tools import TOOL_PARSERS

    if args.tool_call_parser is not None and args.tool_call_parser not in TOOL_PARSERS:
        raise ValueError(
            f"--tool-call-parser {args.tool_call_parser!r} is unknown; choose one of {', '.join(TOOL_PARSERS)}"
        )
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser to read the model's calls")
    if args.reasoning_parser is not None and args.reasoning_parser not in REASONING_PARSERS:
        raise ValueError(
            f"--reasoning-parser {args.reasoning_parser!r} is unknown; choose one of {', '.join(REASONING_PARSERS)}"
        )


def run_server(args: argparse.Namespace) -> int:
    try:
        server = build_server(args)
    except ValueError as exc:
        print(f"tokenmill serve: error: {exc}", file=sys.stderr)
        return 2
    exit_code = asyncio.run(_serve(server, server.tm_state))
    # Everything is stopped by now: the engine process asked to stop and reaped, sockets closed,
    # the IPC directory removed. What is left is the interpreter's own teardown, whose final
    # garbage-collection passes walk every object the imports of torch and transformers made:
    # ~1.2 s of CPU on the 2-core machine, more than the whole rest of an idle shutdown. Freezing
    # moves those objects out of the collector's reach; the OS frees the memory at exit anyway, and
    # atexit handlers, logging's flush and stream flushing still run.
    gc.freeze()
    return exit_code


async def _serve(server: _DrainingServer, state: ServerState) -> int:
    workers = server.api_workers
    sockets = None
    if workers is not None:  # a socket each, on one port (listen_socket.py)
        from tokenmill.server.listen_socket import check_port_free, reuseport_socket

        try:
            check_port_free(server.config.host, server.config.port)
            sockets = [reuseport_socket(server.config.host, server.config.port)]
        except OSError as exc:
            print(f"tokenmill serve: error: {exc.strerror}", file=sys.stderr)
            await state.engine.shutdown()
            if server.metrics_dir is not None:
                shutil.rmtree(server.metrics_dir, ignore_errors=True)
            return 1
    watch_task: asyncio.Task | None = None

    async def start_engine() -> None:
        nonlocal watch_task
        try:
            await state.engine.start()
        except Exception as exc:
            state.startup_error = f"the engine failed to start: {exc}"
            logger.error("engine start-up failed: %s", exc)
            server.should_exit = True
            return
        state.engine_started()
        if state.lora is not None:
            try:
                for module in server.lora_modules:
                    await state.lora.load(
                        state.engine, module.name, module.path, base_model_name=module.base_model_name, check_dirs=False
                    )
            except TokenmillError as exc:
                state.startup_error = f"--lora-modules: {exc.message}"
                logger.error("%s", state.startup_error)
                server.should_exit = True
                return
        if workers is not None and state.engine.info is not None and state.engine.info.device == "cpu":
            # Measured on a 2-core machine, default model, 16 streams: 83-86 output tok/s with two
            # API server processes against 170-178 with one (the engine's threads lose a core).
            logger.warning(
                "--api-server-count %d on the CPU: the API server processes take cores from the engine's "
                "threads; with few cores, decoding slows (2x on 2 cores): prefer 1 there",
                workers.count + 1,
            )
        if workers is not None:
            # Started and attached before this process turns ready, then all serve at once: a
            # client's first connections, which it may keep for its whole life, should not all
            # land here while the others start (api_workers.py).
            assert sockets is not None
            try:
                await workers.start(_worker_specs(server, state), WORKER_READY_TIMEOUT_S)
            except RuntimeError as exc:
                state.startup_error = str(exc)
                logger.error("%s", exc)
                server.should_exit = True
                return
            state.engine.client.on_api_server_stalled = workers.kill_stalled
            watch_task = asyncio.create_task(
                workers.watch(lambda reason: _worker_failed(server, reason), state.engine.client.api_server_gone)
            )
        # Everything loaded so far (transformers, the tokenizer, FastAPI) lives as long as the
        # server: out of the collector's reach, a full collection walks only what requests made.
        # Measured at 24 req/s (H100, --trace-dir): before this, 15 full collections stalled every
        # stream for up to 221 ms each (2.6 s in 40 s).
        gc.freeze()
        state.ready = True
        if workers is not None:
            workers.serve()
        processes = f", {workers.count + 1} API server processes" if workers is not None else ""
        print(
            f"tokenmill {__version__} ready on http://{server.config.host}:{server.config.port} "
            f"(model {state.model_names[0]}{processes})",
            file=sys.stderr,
            flush=True,
        )

    print("tokenmill: loading the model; /health answers 503 until it is ready", file=sys.stderr, flush=True)
    starter = asyncio.create_task(start_engine())
    stats_log = state.engine.stats_log
    stats_task = asyncio.create_task(stats_log.run(lambda: state.engine.stats)) if stats_log is not None else None
    try:
        await server.serve(sockets)
    finally:
        starter.cancel()
        tasks = [t for t in (stats_task, watch_task) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(starter, *tasks, return_exceptions=True)
        if workers is not None:
            # Each drains its own requests (as long as this process did) before the engine stops.
            await workers.stop(server.shutdown_timeout + ABORT_GRACE_S + GRACEFUL_SHUTDOWN_S + 5.0)
        await state.engine.shutdown()
        if sockets is not None:
            sockets[0].close()
        if server.metrics_dir is not None:
            shutil.rmtree(server.metrics_dir, ignore_errors=True)
    return 1 if state.startup_error or server.worker_failure else 0


def _worker_specs(server: _DrainingServer, state: ServerState) -> list[WorkerSpec]:
    """What each other API server process needs to attach: the flags, its slot, the engines."""
    assert server.api_workers is not None and server.metrics_dir is not None
    client = state.engine.client
    cores = getattr(client, "cores", [client])
    engines = [WorkerEngine(ipc_dir=core.ipc_dir, pid=core.engine_pid) for core in cores]
    adapters = [
        WorkerAdapter(a.request.lora_name, a.request.lora_int_id, a.request.lora_path, a.parent)
        for a in (state.lora.adapters if state.lora is not None else [])
    ]
    args = dict(server.tm_args)
    return [
        WorkerSpec(args=args, slot=slot, engines=engines, metrics_dir=server.metrics_dir, adapters=adapters)
        for slot in range(1, server.api_workers.count + 1)
    ]


def _worker_failed(server: _DrainingServer, reason: str) -> None:
    """Another API server process is gone for good (api_workers.py): this one drains and the
    server exits with code 1."""
    logger.error("%s; stopping the server", reason)
    server.worker_failure = reason
    server.handle_exit(signal.SIGTERM, None)
