"""One ModelRunner in the engine core's own process: the executor of every engine today."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.config import EngineConfig
from tokenmill.core.outputs import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from tokenmill.engine.executor.abstract import Executor, PendingOutput

if TYPE_CHECKING:
    from tokenmill.core.runner_facts import RunnerFacts
    from tokenmill.lora.request import LoRARequest
    from tokenmill.model.resolve import ResolvedModel
    from tokenmill.worker.model_runner import ModelRunner


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, resolved: ResolvedModel, max_model_len: int) -> None:
        from tokenmill.worker.model_runner import ModelRunner  # torch stays out of light imports

        super().__init__(config, resolved, max_model_len)
        self.driver_runner: ModelRunner = ModelRunner(config, resolved, max_model_len)
        self._shut_down = False

    @property
    def device(self) -> str:
        return str(self.driver_runner.device)

    @property
    def dtype(self) -> str:
        return str(self.driver_runner.dtype).removeprefix("torch.")

    @property
    def device_type(self) -> str:
        return self.driver_runner.device.type

    @property
    def num_lookahead_tokens(self) -> int:
        speculator = self.driver_runner.speculator
        return speculator.num_lookahead_tokens if speculator is not None else 0

    @property
    def kv_bytes_per_block(self) -> int:
        return self.driver_runner.kv_bytes_per_block

    @property
    def kv_layout(self):  # noqa: ANN201 - core.kv_transfer.KVLayout | None
        return getattr(self.driver_runner.kv_connector, "layout", None)

    @property
    def lora_hooks(self):  # noqa: ANN201 - the runner's LoRAManager, or None
        return self.driver_runner.lora

    def describe_runners(self, measure_bandwidth: bool = False) -> list[RunnerFacts]:
        from tokenmill.worker.runner_facts import describe_runner

        return [describe_runner(self.driver_runner, 0, measure_bandwidth)]

    def add_lora(self, lora: LoRARequest) -> None:
        if self.driver_runner.lora is None:
            super().add_lora(lora)
        self.driver_runner.lora.add_lora(lora)  # type: ignore[union-attr]

    def remove_lora(self, lora_int_id: int) -> bool:
        lora = self.driver_runner.lora
        return lora is not None and lora.remove_lora(lora_int_id)

    def initialize_kv_cache(self) -> int:
        return self.driver_runner.initialize_kv_cache()

    def check_health(self) -> None:
        pass  # the runner lives in this process: if it were gone, so would be the caller

    def release(self) -> None:
        self.driver_runner.release()

    def shutdown(self) -> None:
        if not self._shut_down:
            self._shut_down = True
            self.driver_runner.release()

    # The runner's methods are looked up at each call (not bound once), so a test that wraps
    # `engine.runner.execute` to inject a fault still sees its wrapper called.
    def run_kv_connector(self, metadata) -> None:  # noqa: ANN001 - KVConnectorMetadata
        self.driver_runner.run_kv_connector(metadata)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver_runner.execute(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingOutput | None:
        return self.driver_runner.execute_async(scheduler_output)

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> PendingOutput:
        return self.driver_runner.sample_tokens(grammar_output)
