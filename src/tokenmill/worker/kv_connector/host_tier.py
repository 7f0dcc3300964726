"""The host-memory KV tier, worker side: a second pool of blocks in host memory, and the copies.

Each step's `HostTierMetadata` lists saves (device block -> host slot: blocks this step's
allocations evicted, about to be overwritten) and loads (host slot -> device block: prefix hits in
the host tier). Both are done layer by layer, saves first within a layer (a block evicted by this
step may also be the target of one of its loads), and a layer's copies are complete before that
layer stores or reads KV (`wait_for_layer_load`, called by the attention layer): the loads of
layer i+1 overlap the compute of layer i. The tier needs one KV cache group (the factory checks),
so layer i's cache is the pool's tensor i.

The host pool holds, per device layer tensor, `[num_host_blocks, 2, block_size, kv_heads,
head_dim]` bytes (the cache's own dtype copied as raw bytes, so an fp8 cache works unchanged):
one host slot of one layer is contiguous, so a run of consecutive slots is one copy. A layer's
saves gather the blocks into a device staging tensor and copy each run of slots out of it; its
loads copy each run into a staging tensor and scatter it into the device blocks. The scheduler
hands out slots in order, so blocks stored or loaded together mostly form long runs; the worst
case (scattered slots) is one copy per block and layer.

- CPU: both pools are host memory; a layer's copies run when the forward reaches it (there is
  nothing to overlap with: the forward uses the same cores and memory bandwidth). This is the
  path CI tests, with the same per-layer order and copy code as the device path.
- CUDA: the host pool is pinned and every layer's copies are queued at once on a side stream,
  after the work already queued on the compute stream (earlier writes of the evicted blocks,
  earlier reads of the blocks loaded into), each layer followed by an event; the compute stream
  waits for layer i's event just before layer i, so the host never blocks on a copy. Every copy of
  the host pool is done by the side stream, in order, so a load of a slot saved by an earlier step
  reads the saved bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.core.kv_connector_metadata import HostTierMetadata, KVConnectorMetadata
from tokenmill.worker.kv_connector.base import KVConnectorWorker

# (first row in the step's list, first host slot, number of slots): consecutive slots, one copy.
SlotRun = tuple[int, int, int]


def slot_runs(slots: list[int]) -> list[SlotRun]:
    """Split a list of host slots into runs of consecutive slots (in list order)."""
    runs: list[SlotRun] = []
    for row, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            first_row, first_slot, length = runs[-1]
            runs[-1] = (first_row, first_slot, length + 1)
        else:
            runs.append((row, slot, 1))
    return runs


@dataclass(slots=True)
class _StepCopies:
    """One step's copies, as every layer does them, and which layers the forward has waited for."""

    save_blocks: torch.Tensor | None  # device block ids (long, on the pool's device)
    save_runs: list[SlotRun]
    load_blocks: torch.Tensor | None
    load_runs: list[SlotRun]
    waited: list[bool]  # per layer


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The same memory as bytes: copies never depend on the element type (fp8 included)."""
    return tensor.view(torch.uint8)


class HostKVTierWorker(KVConnectorWorker):
    def __init__(self, kv_cache_tensors: list[torch.Tensor], num_host_blocks: int) -> None:
        if not kv_cache_tensors:
            raise ValueError("the host KV tier needs the KV pool's tensors; allocate the pool first")
        self.device_tensors = [_bytes(t) for t in kv_cache_tensors]
        self.device = kv_cache_tensors[0].device
        self.num_host_blocks = num_host_blocks
        self.is_cuda = self.device.type == "cuda"
        self.host_tensors = [
            torch.empty((num_host_blocks, t.shape[0], *t.shape[2:]), dtype=torch.uint8, pin_memory=self.is_cuda)
            for t in self.device_tensors
        ]
        self._stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        # CUDA: layer i's copies are done once its event fires (re-recorded every step).
        self._layer_events = [torch.cuda.Event() for _ in self.device_tensors] if self.is_cuda else []
        self._step: _StepCopies | None = None
        # Layers whose copies the forward waited for right before the layer (overlapped), and those
        # waited for all at once (a whole-step CUDA graph, a step without a forward): for tests
        # and the benchmark.
        self.layers_waited_in_forward = 0
        self.layers_waited_at_once = 0

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() for t in self.host_tensors)

    @property
    def num_layers(self) -> int:
        return len(self.device_tensors)

    # -- the hooks ----------------------------------------------------------------------------

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        if not isinstance(metadata, HostTierMetadata):
            raise TypeError(f"the host KV tier got {type(metadata).__name__} metadata")
        if self._step is not None:  # the last step was never closed: finish it before this one
            self.wait_for_load()
        if self._stream is None:
            self._step = self._plan(metadata)  # copies run as the forward reaches each layer
            return
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            # Set before queueing: should a copy fail to queue, wait_for_load still orders the
            # compute stream after the ones already queued.
            self._step = step = self._plan(metadata)
            for layer, event in enumerate(self._layer_events):
                self._copy_layer(layer, step)
                event.record(stream)

    def wait_for_layer_load(self, layer_index: int) -> None:
        step = self._step
        if step is None:
            return
        if not 0 <= layer_index < len(step.waited):
            raise IndexError(
                f"KV layer index {layer_index} out of range: the pool has {len(step.waited)} layer tensors "
                "(the model runner numbers the attention layers 0..n-1)"
            )
        if step.waited[layer_index]:
            return
        step.waited[layer_index] = True
        self.layers_waited_in_forward += 1
        if self._stream is None:
            self._copy_layer(layer_index, step)
        else:
            torch.cuda.current_stream(self.device).wait_event(self._layer_events[layer_index])

    def wait_for_load(self) -> None:
        step, self._step = self._step, None  # closed even if a copy below fails
        if step is None:
            return
        remaining = [layer for layer, waited in enumerate(step.waited) if not waited]
        self.layers_waited_at_once += len(remaining)
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
            return
        for layer in remaining:
            self._copy_layer(layer, step)

    # -- the copies ---------------------------------------------------------------------------

    def _plan(self, meta: HostTierMetadata) -> _StepCopies:
        def blocks(ids: list[int]) -> torch.Tensor | None:
            if not ids:
                return None
            return torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)

        return _StepCopies(
            save_blocks=blocks(meta.save_device_blocks),
            save_runs=slot_runs(meta.save_host_slots),
            load_blocks=blocks(meta.load_device_blocks),
            load_runs=slot_runs(meta.load_host_slots),
            waited=[False] * self.num_layers,
        )

    def _copy_layer(self, layer: int, step: _StepCopies) -> None:
        """Layer `layer`'s saves, then its loads (on CUDA: queued on the current, side, stream)."""
        device, host = self.device_tensors[layer], self.host_tensors[layer]
        if step.save_blocks is not None:
            staged = device.transpose(0, 1).index_select(0, step.save_blocks)  # [n, 2, ...], contiguous
            for row, slot, length in step.save_runs:
                host[slot : slot + length].copy_(staged[row : row + length], non_blocking=True)
        if step.load_blocks is not None:
            staged = torch.empty((len(step.load_blocks), *host.shape[1:]), dtype=torch.uint8, device=self.device)
            for row, slot, length in step.load_runs:
                staged[row : row + length].copy_(host[slot : slot + length], non_blocking=True)
            device.index_copy_(1, step.load_blocks, staged.transpose(0, 1))

    def release(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
        self._step = None
        self.host_tensors = []
        self.device_tensors = []
