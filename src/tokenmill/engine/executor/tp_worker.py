"""One tensor-parallel rank: a ModelRunner holding its shard, driven by the executor's commands.

The same loop runs in a local process (`python -m tokenmill.engine.executor.tp_worker`, the
WorkerSpec's msgpack on stdin: no multiprocessing, so nothing is unpickled) and inside a Ray actor
(ray_executor.py). Every rank runs every step on the same SchedulerOutput, so the collectives inside
the model line up; rank 0 answers with the sampled tokens. A failure is reported (any rank) and
ends the worker: the group cannot go on without it, and the executor then declares the engine dead.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback

import msgspec
import zmq

from tokenmill.engine.executor.worker_messages import (
    DescribeRunner,
    InitKVCache,
    KVCacheReady,
    LoadLoRA,
    LoRALoaded,
    LoRARemoved,
    Released,
    ReleaseMemory,
    RemoveLoRA,
    RunStep,
    SampleStep,
    StepDeferred,
    StepDone,
    StopWorker,
    WorkerCommand,
    WorkerFailed,
    WorkerReady,
    WorkerSpec,
)
from tokenmill.lora.request import LoRARequest

logger = logging.getLogger("tokenmill.tp_worker")

POLL_MS = 200  # how often an idle worker checks that its parent still lives
LOAD_POLL_MS = 5  # how often it checks its adapter loads while some are in progress


class _ParentGone(Exception):
    pass


def run_worker(spec: WorkerSpec) -> None:
    """Serve commands until StopWorker, the parent's death, or a failure (reported, then raised)."""
    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)
    commands.connect(spec.command_addr)
    replies = ctx.socket(zmq.PUSH)
    replies.connect(spec.reply_addr)
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(WorkerCommand)
    rank = spec.rank
    try:
        runner = _start(spec)
        replies.send(encoder.encode(WorkerReady(rank, os.getpid(), str(runner.device), _dtype_name(runner))))
        poller = zmq.Poller()
        poller.register(commands, zmq.POLLIN)
        loading: dict[int, LoRARequest] = {}  # adapters loading on the runner's loader thread
        while True:
            for reply in _finished_loads(runner, rank, loading):
                replies.send(encoder.encode(reply))
            if not poller.poll(LOAD_POLL_MS if loading else POLL_MS):
                if spec.parent_pid and os.getppid() != spec.parent_pid:
                    raise _ParentGone
                continue
            command = decoder.decode(commands.recv())
            if isinstance(command, StopWorker):
                return
            if isinstance(command, LoadLoRA):
                runner.lora.add_lora(command.lora)  # answered by _finished_loads once loaded
                loading[command.lora.lora_int_id] = command.lora
                continue
            if isinstance(command, RemoveLoRA):
                loading.pop(command.lora_int_id, None)  # its load, if any, is answered no more
            reply = _handle(runner, rank, command)
            if reply is not None:
                replies.send(encoder.encode(reply))
    except _ParentGone:
        logger.warning("tensor-parallel rank %d: the engine process is gone; exiting", rank)
    except Exception as exc:
        logger.exception("tensor-parallel rank %d failed", rank)
        replies.send(
            encoder.encode(WorkerFailed(rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        )
        raise
    finally:
        from tokenmill.distributed.parallel_state import destroy_tensor_parallel

        destroy_tensor_parallel()
        commands.close(linger=0)
        replies.close(linger=2000)
        ctx.term()


def _start(spec: WorkerSpec):  # noqa: ANN202 - a ModelRunner (torch imported here, not at module level)
    import dataclasses

    import torch

    from tokenmill.args import resolve_device_defaults
    from tokenmill.distributed.parallel_state import init_tensor_parallel
    from tokenmill.model.resolve import resolve_model
    from tokenmill.worker.model_runner import ModelRunner

    torch.set_num_threads(spec.torch_threads)
    torch.manual_seed(spec.config.model.seed)  # what the one-process engine does (dummy weights)
    config = resolve_device_defaults(spec.config)
    on_gpu = config.device.startswith("cuda")
    if on_gpu and spec.size > 1 and torch.cuda.device_count() >= spec.size:
        config = dataclasses.replace(config, device=f"cuda:{spec.rank}")  # one GPU per local rank
    if on_gpu and torch.device(config.device).index is not None:
        torch.cuda.set_device(torch.device(config.device))  # NCCL's communicator binds the current device
    # The collectives run on the tensors' device: gloo for the CPU (even on a machine with GPUs).
    init_tensor_parallel(
        spec.rank,
        spec.size,
        spec.dist_init_method,
        backend="nccl" if on_gpu else "gloo",
        custom_all_reduce=config.parallel.custom_all_reduce,
    )
    logger.info(
        "tensor-parallel rank %d of %d: pid %d, %d torch threads",
        spec.rank,
        spec.size,
        os.getpid(),
        spec.torch_threads,
    )
    return ModelRunner(config, resolve_model(config.model), spec.max_model_len)


def _dtype_name(runner) -> str:  # noqa: ANN001
    return str(runner.dtype).removeprefix("torch.")


def _handle(runner, rank: int, command: WorkerCommand):  # noqa: ANN001, ANN202
    """Run one command; the reply this rank sends, if any (steps: rank 0 only)."""
    if isinstance(command, RunStep):
        pending = runner.execute_async(command.scheduler_output)
        if pending is None:  # a constrained step waits for its bitmask
            return StepDeferred(command.step_id) if rank == 0 else None
        output = pending.result()  # every rank: its token history follows the step
        return StepDone(command.step_id, output) if rank == 0 else None
    if isinstance(command, SampleStep):
        output = runner.sample_tokens(command.grammar_output).result()
        return StepDone(command.step_id, output) if rank == 0 else None
    if isinstance(command, InitKVCache):
        return KVCacheReady(rank, runner.initialize_kv_cache())
    if isinstance(command, DescribeRunner):
        from tokenmill.worker.runner_facts import describe_runner

        return describe_runner(runner, rank, command.measure_bandwidth)
    if isinstance(command, RemoveLoRA):
        return LoRARemoved(rank, runner.lora.remove_lora(command.lora_int_id))
    if isinstance(command, ReleaseMemory):
        runner.release()
        return Released(rank)
    raise ValueError(f"unknown worker command {type(command).__name__}")


def _finished_loads(runner, rank: int, loading: dict[int, LoRARequest]) -> list[LoRALoaded]:  # noqa: ANN001
    """The answers to the adapter loads that finished (or failed) since the last look."""
    done = []
    for lora_id, lora in list(loading.items()):
        state = runner.lora.ready(lora)
        if state is not False:
            del loading[lora_id]
            done.append(LoRALoaded(rank, lora_id, None if state is True else state))
    return done


def main() -> int:
    """`python -m tokenmill.engine.executor.tp_worker` with the WorkerSpec's msgpack on stdin."""
    from tokenmill.engine.core_process import _die_with_parent

    spec = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=WorkerSpec)
    sys.stdin.close()
    _die_with_parent()  # the kernel SIGKILLs this worker when the engine process dies, however it dies
    if spec.parent_pid and os.getppid() != spec.parent_pid:
        return 1  # the parent died before prctl took effect
    # As the engine process: SIGINT / SIGTERM sent to the whole process group are the API server's
    # to handle (it drains, then the engine stops this worker); the parent's death still ends it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=spec.log_level.upper(),
        format=f"%(asctime)s %(levelname)s rank{spec.rank} %(name)s: %(message)s",
    )
    try:
        run_worker(spec)
    except Exception:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
