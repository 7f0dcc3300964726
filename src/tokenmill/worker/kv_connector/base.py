"""The worker side of a KV connector: moves KV between the device pool and somewhere else.

It owns nothing the scheduler must know: each step's `SchedulerOutput.kv_connector_metadata`
says what to copy. For a step with a forward, the model runner calls `start_load_kv` before it,
puts the connector into the step's attention metadata (`AttentionMetadata.kv_layer_hooks`), and
each attention layer calls `wait_for_layer_load(i)` before it touches its cache and
`save_kv_layer(i)` after its attention; `wait_for_load` closes the step (whatever no layer waited
for: a whole-step CUDA graph replay calls it before the replay instead, and a step without a
forward, or a failed one, at the end). Between steps (a producer's sends) only `start_load_kv`
and `wait_for_load` run. A connector that copies everything in `start_load_kv` needs neither
per-layer hook.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from tokenmill.core.kv_connector_metadata import KVConnectorMetadata


class KVConnectorWorker(ABC):
    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Start this step's copies (asynchronously where the device allows)."""

    @abstractmethod
    def wait_for_load(self) -> None:
        """Return once the rest of the step may read every loaded block and overwrite every saved
        one (on CUDA: once the compute stream is ordered after the copies; the host need not wait)."""

    def wait_for_layer_load(self, layer_index: int) -> None:  # noqa: B027 - optional hook
        """Return once layer `layer_index` may read its loaded blocks and overwrite its saved ones
        (called by the attention layer, before its KV store)."""

    def save_kv_layer(self, layer_index: int) -> None:  # noqa: B027 - optional hook
        """The forward wrote layer `layer_index`'s KV for this step (called after its attention)."""

    def wait_for_save(self) -> None:  # noqa: B027 - optional hook
        """Block until this step's saves are complete."""

    def release(self) -> None:  # noqa: B027 - optional hook
        """Free the connector's memory (the runner's KV pool is being released)."""
