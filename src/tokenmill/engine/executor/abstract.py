"""The executor: what `EngineCore` calls to run a scheduled step on the model runner(s).

The engine core schedules and keeps the requests' bookkeeping; the executor owns the devices.
With one device it is one `ModelRunner` in this process (`UniProcExecutor`). With tensor
parallelism (worker_group.py) one worker per rank, local processes (`MultiprocExecutor`) or Ray
actors (`RayExecutor`), gets each step's `SchedulerOutput` (msgspec, like everything that crosses a
process boundary here) and rank 0's output comes back. `EngineCore` only sees the methods below.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Protocol

from tokenmill.config import EngineConfig
from tokenmill.core.outputs import GrammarOutput, ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from tokenmill.core.runner_facts import RunnerFacts
    from tokenmill.lora.request import LoRARequest
    from tokenmill.model.resolve import ResolvedModel


class PendingOutput(Protocol):
    """A launched step: `result()` waits for the device and returns its sampled tokens."""

    def result(self) -> ModelRunnerOutput: ...


class Executor(ABC):
    def __init__(self, config: EngineConfig, resolved: ResolvedModel, max_model_len: int) -> None:
        self.config = config
        self.resolved = resolved
        self.max_model_len = max_model_len

    @staticmethod
    def get_class(config: EngineConfig) -> type[Executor]:
        """The executor class for `config`: one device in this process, or tensor-parallel workers
        as local processes (mp) or Ray actors (ray)."""
        backend = config.parallel.distributed_executor_backend
        if backend == "ray":
            from tokenmill.engine.executor.ray_executor import RayExecutor

            return RayExecutor
        if backend == "mp" or config.parallel.tensor_parallel_size > 1:
            from tokenmill.engine.executor.multiproc import MultiprocExecutor

            return MultiprocExecutor
        from tokenmill.engine.executor.uniproc import UniProcExecutor

        return UniProcExecutor

    # -- what the engine core needs to know -----------------------------------------------------

    @property
    @abstractmethod
    def device(self) -> str:
        """The (driver) device, e.g. "cpu" or "cuda:0"."""

    @property
    def device_type(self) -> str:
        return self.device.split(":", 1)[0]

    @property
    @abstractmethod
    def dtype(self) -> str:
        """The model's dtype, e.g. "bfloat16"."""

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots the scheduler reserves after a decoding request's tokens (a draft model's
        proposals write KV there); 0 unless the speculative method runs a model."""
        return 0

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one KV block over one worker's layer tensors (the host KV tier's slot size);
        valid after initialize_kv_cache."""
        raise NotImplementedError(f"{type(self).__name__} does not report its KV block size")

    @property
    def kv_layout(self):  # noqa: ANN201 - core.kv_transfer.KVLayout | None
        """What one KV block's bytes mean (a disaggregated consumer checks transfers against it);
        None without a transfer connector."""
        return None

    @property
    def lora_hooks(self):  # noqa: ANN201 - core.lora_admission.LoRAHooks | None
        """What the scheduler asks before admitting a request with an adapter; None: LoRA off."""
        return None

    def describe_runners(self, measure_bandwidth: bool = False) -> list[RunnerFacts]:
        """Each rank's runner facts (weight bytes a decode step reads, KV bytes per token, device,
        CUDA graphs; its copy bandwidth if asked), in rank order; valid after initialize_kv_cache.
        Benchmarks build their roofline from these rather than reaching into a runner."""
        raise NotImplementedError(f"{type(self).__name__} does not describe its runners")

    def add_lora(self, lora: LoRARequest) -> None:
        """Start loading an adapter into host memory on every worker."""
        raise ValueError("LoRA is not enabled: start the engine with enable_lora (--enable-lora)")

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter on every worker; False if none had it."""
        return False

    # -- life cycle -----------------------------------------------------------------------------

    @abstractmethod
    def initialize_kv_cache(self) -> int:
        """Sizes and allocates the KV pool on every device (the same number of blocks on each);
        returns the number of blocks."""

    @abstractmethod
    def check_health(self) -> None:
        """Raises if a worker is gone or broken."""

    @abstractmethod
    def release(self) -> None:
        """Frees the devices' memory (KV pool, graphs, weights) but keeps the processes; the
        executor cannot run steps afterwards."""

    @abstractmethod
    def shutdown(self) -> None:
        """Releases everything and ends the workers; idempotent."""

    # -- the step -------------------------------------------------------------------------------

    def run_kv_connector(self, metadata) -> None:  # noqa: ANN001 - core.kv_connector_metadata.KVConnectorMetadata
        """Run a KV connector's work outside a step (a producer's sends) on every worker."""
        raise NotImplementedError(f"{type(self).__name__} has no KV connector")

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step and waits for its sampled tokens."""

    @abstractmethod
    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingOutput | None:
        """Launches one step and returns before the device is done (async scheduling).

        A step that lists structured-output requests (`structured_output_request_ids`) runs in
        two phases: this launches the forward and the logits and returns None; the engine core
        fills the grammar bitmask meanwhile and calls `sample_tokens` with it."""

    @abstractmethod
    def sample_tokens(self, grammar_output: GrammarOutput | None) -> PendingOutput:
        """The second phase of a constrained step: mask the logits (on every worker that samples)
        and sample."""
