"""LoRA admission for a tensor-parallel engine: the scheduler's LoRA hooks, on the engine's side.

With one process the runner's LoRAManager is the hook: it loads adapters on a thread while the step
loop goes on. Here the adapters live in the workers (each rank cuts its own shard of every A / B,
worker/lora/), so an adapter's load starts on every rank through the worker protocol (`LoadLoRA`,
each rank loading on its own loader thread between steps) and each rank answers `LoRALoaded` when
its copy is in host memory; the scheduler admits the adapter's requests once every rank has, so a
load never holds up the step loop here either. Removal goes to every rank the same way. Torch-free.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from tokenmill.config import LoRAConfig
from tokenmill.lora.request import LoRARequest

if TYPE_CHECKING:
    from tokenmill.engine.executor.worker_group import WorkerGroupExecutor
    from tokenmill.engine.executor.worker_messages import LoRALoaded


class WorkerGroupLoRA:
    """What the scheduler asks (core/lora_admission.py LoRAHooks), answered from every rank."""

    def __init__(self, config: LoRAConfig, executor: WorkerGroupExecutor) -> None:
        self.max_loras = config.max_loras
        # Weak (a proxy: ReferenceError once it is gone): the executor owns these hooks, and a
        # reference back would be a cycle that keeps a dropped engine (and its workers) until a
        # full garbage collection.
        self._executor: WorkerGroupExecutor = weakref.proxy(executor)
        self._size = executor.size
        self._known: dict[int, LoRARequest] = {}  # adapters asked for, by id (loading, loaded or failed)
        self._answers: dict[int, dict[int, str | None]] = {}  # lora id -> rank -> None or its error

    def ready(self, lora: LoRARequest) -> bool | str:
        lora_id = lora.lora_int_id
        known = self._known.get(lora_id)
        if known is None:
            self.add_lora(lora)
            return False
        if known.lora_path != lora.lora_path or known.lora_name != lora.lora_name:
            return (
                f"LoRA id {lora_id} is {known.lora_name!r} at {known.lora_path}; "
                f"{lora.lora_name!r} at {lora.lora_path} needs an id of its own"
            )
        answers = self._answers[lora_id]
        if len(answers) < self._size:
            self._executor.poll_replies(0)  # answers that came since
        if len(answers) < self._size:
            return False
        errors = [answers[rank] for rank in sorted(answers) if answers[rank] is not None]
        return errors[0] if errors else True  # type: ignore[return-value]

    def add_lora(self, lora: LoRARequest) -> None:
        """Start loading it on every rank (a failure is the answer of `ready`, as with one process)."""
        if lora.lora_int_id in self._known:
            return
        self._known[lora.lora_int_id] = lora
        self._answers[lora.lora_int_id] = {}
        self._executor.start_lora_load(lora)

    def on_loaded(self, reply: LoRALoaded) -> None:
        """A rank's answer (the executor hands each one over as it arrives)."""
        answers = self._answers.get(reply.lora_int_id)
        if answers is not None:  # else: an adapter removed since
            answers[reply.rank] = reply.error

    def remove_lora(self, lora_int_id: int) -> bool:
        self._known.pop(lora_int_id, None)
        self._answers.pop(lora_int_id, None)
        known = any(self._executor.remove_lora_on_ranks(lora_int_id))
        # Answers to the removed load that came while the ranks answered the removal were dropped
        # above (no entry); a rank sends none after it (tp_worker forgets the load).
        return known

    def wait_for_loads(self, timeout: float) -> None:
        """Block until a rank answers (or `timeout` passes): the engine calls it when nothing can run
        until an adapter is loaded."""
        if any(len(answers) < self._size for answers in self._answers.values()):
            self._executor.poll_replies(timeout)
