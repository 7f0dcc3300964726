"""What the scheduler asks about LoRA adapters before it admits a request (torch-free).

One step serves at most `max_loras` distinct adapters (the device has that many slots), and a
request runs only once its adapter's weights are in host memory: loading happens off the step loop,
so a request whose adapter is still loading waits without holding anyone else up.
"""

from __future__ import annotations

from typing import Protocol

from tokenmill.lora.request import LoRARequest


class LoRAHooks(Protocol):
    max_loras: int

    def ready(self, lora: LoRARequest) -> bool | str:
        """True: its weights are loaded; False: loading (started now if needed); a string: the load
        failed, and why (the request ends with that error)."""
        ...

    def wait_for_loads(self, timeout: float) -> None:
        """Block until an adapter load finishes or `timeout` seconds pass."""
        ...


class LoRAAdmission:
    """Per schedule(): the adapters of the running requests, and whether one more may join."""

    __slots__ = ("hooks", "active")

    def __init__(self, hooks: LoRAHooks, running_loras: set[int]) -> None:
        self.hooks = hooks
        self.active = running_loras

    def admit(self, lora: LoRARequest) -> bool | str:
        """True: schedule it now (its adapter is counted as active); False: skip it this step;
        a string: end it with that error."""
        lora_id = lora.lora_int_id
        if lora_id not in self.active and len(self.active) >= self.hooks.max_loras:
            return False
        state = self.hooks.ready(lora)
        if state is True:
            self.active.add(lora_id)
        return state
