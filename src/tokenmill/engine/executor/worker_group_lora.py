"""LoRA admission for a tensor-parallel engine: the scheduler's LoRA hooks, on the engine's side.

With one process the runner's LoRAManager is the hook: it loads adapters on a thread while the step
loop goes on. Here the adapters live in the workers (each rank cuts its own shard of every A / B,
worker/lora/), so an adapter is loaded on every rank through the worker protocol (`LoadLoRA`, every
rank answering `LoRALoaded` once its copy is in host memory) and the scheduler admits its requests
only then. The load is waited for in the engine's step loop: one adapter file read per rank, once per
adapter (the ranks read theirs at the same time). Removal goes to every rank the same way. Torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tokenmill.config import LoRAConfig
from tokenmill.lora.request import LoRARequest

if TYPE_CHECKING:
    from tokenmill.engine.executor.worker_group import WorkerGroupExecutor


class WorkerGroupLoRA:
    """What the scheduler asks (core/lora_admission.py LoRAHooks), answered from every rank."""

    def __init__(self, config: LoRAConfig, executor: WorkerGroupExecutor) -> None:
        self.max_loras = config.max_loras
        self._executor = executor
        self._known: dict[int, LoRARequest] = {}  # adapters the ranks have, or failed to load
        self._errors: dict[int, str] = {}  # lora id -> why its load failed

    def ready(self, lora: LoRARequest) -> bool | str:
        known = self._known.get(lora.lora_int_id)
        if known is None:
            self._load(lora)
        elif known.lora_path != lora.lora_path or known.lora_name != lora.lora_name:
            return (
                f"LoRA id {lora.lora_int_id} is {known.lora_name!r} at {known.lora_path}; "
                f"{lora.lora_name!r} at {lora.lora_path} needs an id of its own"
            )
        return self._errors.get(lora.lora_int_id, True)

    def add_lora(self, lora: LoRARequest) -> None:
        """Load it on every rank now (a failure is the answer of `ready`, as with one process)."""
        self.ready(lora)

    def remove_lora(self, lora_int_id: int) -> bool:
        self._known.pop(lora_int_id, None)
        self._errors.pop(lora_int_id, None)
        return any(self._executor.remove_lora_on_ranks(lora_int_id))

    def wait_for_loads(self, timeout: float) -> None:
        """Nothing is ever loading: `ready` waits for the ranks."""

    def _load(self, lora: LoRARequest) -> None:
        errors = [e for e in self._executor.load_lora_on_ranks(lora) if e is not None]
        self._known[lora.lora_int_id] = lora
        if errors:
            self._errors[lora.lora_int_id] = errors[0]
