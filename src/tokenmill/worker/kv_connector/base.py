"""The worker side of a KV connector: moves KV between the device pool and somewhere else.

It owns nothing the scheduler must know: each step's `SchedulerOutput.kv_connector_metadata`
says what to copy. The model runner calls `start_load_kv` before the step's forward and
`wait_for_load` before the first layer reads the cache; after the step's forward,
`save_kv_layer` per layer and `wait_for_save` (connectors that ship a request's fresh KV
elsewhere, e.g. a disaggregated producer). The host tier copies whole blocks of every layer
before the forward, so it needs only the first two. A connector that overlaps its loads with
the forward layer by layer (`wait_for_layer_load(i)` inside the model) is the next step; the
runner does not call that hook yet.
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
        """Return once the forward may read the loaded blocks and overwrite the saved ones (on CUDA:
        once the compute stream is ordered after the copies; the host need not wait)."""

    def save_kv_layer(self, layer_index: int) -> None:  # noqa: B027 - optional hook
        """The forward wrote layer `layer_index`'s KV for this step."""

    def wait_for_save(self) -> None:  # noqa: B027 - optional hook
        """Block until this step's saves are complete."""

    def release(self) -> None:  # noqa: B027 - optional hook
        """Free the connector's memory (the runner's KV pool is being released)."""
