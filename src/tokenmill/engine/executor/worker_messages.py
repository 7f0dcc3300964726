"""What the engine core and its tensor-parallel workers say to each other: msgspec msgpack over ZMQ.

The executor sends every worker the same command (one PUSH socket per worker, the bytes encoded
once); every worker answers on one shared PULL socket. Only rank 0 returns a step's output; any
rank reports its own failure. Nothing is pickled: the step is the scheduler's msgspec
`SchedulerOutput`, the result the runner's `ModelRunnerOutput` (a dataclass msgspec encodes).
"""

from __future__ import annotations

import msgspec

from tokenmill.config import EngineConfig
from tokenmill.core.outputs import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from tokenmill.core.runner_facts import RunnerFacts
from tokenmill.lora.request import LoRARequest


class WorkerSpec(msgspec.Struct):
    """A worker's start-up: its rank, where the group meets, and where to listen and answer."""

    config: EngineConfig
    rank: int
    size: int
    max_model_len: int
    dist_init_method: str  # tcp://host:port of rank 0's rendezvous (torch.distributed)
    command_addr: str  # ZMQ address this worker's commands come from (it connects)
    reply_addr: str  # ZMQ address its answers go to (it connects)
    parent_pid: int = 0  # mp workers: exit when this process is gone (0: not checked)
    torch_threads: int = 1
    log_level: str = "INFO"


# -- commands (executor -> every worker) ------------------------------------------------------------


class InitKVCache(msgspec.Struct, tag=True):
    pass


class RunStep(msgspec.Struct, tag=True):
    """`execute_async` on every runner; rank 0 answers with the sampled tokens, unless the step
    waits for its grammar bitmask (then `SampleStep` follows)."""

    step_id: int
    scheduler_output: SchedulerOutput


class SampleStep(msgspec.Struct, tag=True):
    step_id: int
    grammar_output: GrammarOutput | None = None


class ReleaseMemory(msgspec.Struct, tag=True):
    pass


class StopWorker(msgspec.Struct, tag=True):
    pass


class DescribeRunner(msgspec.Struct, tag=True):
    """Every rank answers with its RunnerFacts (benchmarks' rooflines)."""

    measure_bandwidth: bool = False


class LoadLoRA(msgspec.Struct, tag=True):
    """Start loading an adapter into every rank's host cache (each rank cuts its own shard of A / B,
    on its loader thread); each rank answers `LoRALoaded` once it is there, between steps, and the
    scheduler admits the adapter's requests only when every rank has."""

    lora: LoRARequest


class RemoveLoRA(msgspec.Struct, tag=True):
    lora_int_id: int


WorkerCommand = (
    InitKVCache | RunStep | SampleStep | ReleaseMemory | StopWorker | DescribeRunner | LoadLoRA | RemoveLoRA
)


# -- replies (any worker -> executor) ---------------------------------------------------------------


class WorkerReady(msgspec.Struct, tag=True):
    rank: int
    pid: int
    device: str
    dtype: str


class KVCacheReady(msgspec.Struct, tag=True):
    rank: int
    num_blocks: int


class StepDone(msgspec.Struct, tag=True):
    step_id: int
    output: ModelRunnerOutput


class StepDeferred(msgspec.Struct, tag=True):
    """A constrained step's forward ran; its sampling waits for `SampleStep` (rank 0's answer to
    a `RunStep` whose runner returned no pending step)."""

    step_id: int


class Released(msgspec.Struct, tag=True):
    rank: int


class LoRALoaded(msgspec.Struct, tag=True):
    rank: int
    lora_int_id: int
    error: str | None = None  # why the load failed (the adapter's requests end with it)


class LoRARemoved(msgspec.Struct, tag=True):
    rank: int
    known: bool  # the rank had the adapter


class WorkerFailed(msgspec.Struct, tag=True):
    rank: int
    error: str


WorkerReply = (
    WorkerReady | KVCacheReady | StepDone | StepDeferred | Released | WorkerFailed | RunnerFacts | LoRALoaded
    | LoRARemoved
)
