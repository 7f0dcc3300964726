"""Disaggregated prefill / decode, worker sides (core/kv_transfer.py decides; these copy).

`KVSenderWorker` (producer): before the step's forward, gathers the blocks the step's
`KVSendMetadata` names on the device (one block of every layer tensor, in the pool's order, block
after block), copies them to a reusable host staging buffer (pinned on CUDA) and sends that buffer
as it is, behind a msgspec header, over ZMQ PUSH. A send that would block (no consumer, or one not
reading) is dropped and logged: the consumer then computes those prompts.

`KVReceiverWorker` (consumer): copies the claimed blocks' bytes (views into received frames) into
a reusable staging buffer, moves it to the device in one copy and scatters it into the blocks.

Staging buffers are reused only once nothing reads them any more: a send's buffer once ZMQ has
sent it (its tracker), a load's once its host-to-device copy has run (its event).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import zmq

from tokenmill.core.kv_connector_metadata import KVConnectorMetadata, KVReceiveMetadata, KVSendMetadata
from tokenmill.core.kv_transfer import KVBlocksHeader, KVLayout, blocks_message_frames
from tokenmill.worker.kv_connector.base import KVConnectorWorker

logger = logging.getLogger(__name__)

SEND_HIGH_WATER_MARK = 64  # messages queued towards a slow consumer before sends are dropped
# Pinned send buffers kept for reuse; a send finding them all still queued gets a one-off pageable
# buffer (a slow consumer must not pin up to SEND_HIGH_WATER_MARK prompts' worth of host memory).
MAX_PINNED_SEND_BUFFERS = 4


def kv_layout(model: str, block_size: int, kv_cache_tensors: list[torch.Tensor]) -> KVLayout:
    first = kv_cache_tensors[0]
    block_shape = (first.shape[0], *first.shape[2:])
    per_tensor = first[:, 0].numel() * first.element_size()
    return KVLayout(
        model=model,
        block_size=block_size,
        dtype=str(first.dtype).removeprefix("torch."),
        num_tensors=len(kv_cache_tensors),
        block_shape=tuple(int(d) for d in block_shape),
        bytes_per_block=per_tensor * len(kv_cache_tensors),
    )


def _byte_views(kv_cache_tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.view(torch.uint8) for t in kv_cache_tensors]


def _contiguous_runs(payloads: list[memoryview], block_bytes: int) -> list[tuple[int, np.ndarray]]:
    """(first row, bytes) for each run of payloads that follow each other in one buffer."""
    runs: list[tuple[int, np.ndarray]] = []
    row = 0
    while row < len(payloads):
        view = memoryview(payloads[row])
        base = np.frombuffer(view.obj, dtype=np.uint8)  # the whole frame (or bytes) the view is in
        start = np.frombuffer(view, dtype=np.uint8).ctypes.data - base.ctypes.data
        end = row + 1
        while end < len(payloads):
            nxt = memoryview(payloads[end])
            if nxt.obj is not view.obj or np.frombuffer(nxt, dtype=np.uint8).ctypes.data != (
                base.ctypes.data + start + (end - row) * block_bytes
            ):
                break
            end += 1
        runs.append((row, base[start : start + (end - row) * block_bytes]))
        row = end
    return runs


def _host_buffer(num_bytes: int, device: torch.device) -> torch.Tensor:
    # Pinned on CUDA so copies to and from the device run at full speed and asynchronously.
    return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


class KVSenderWorker(KVConnectorWorker):
    def __init__(self, kv_cache_tensors: list[torch.Tensor], layout: KVLayout, address: str) -> None:
        self.tensors = _byte_views(kv_cache_tensors)
        self.layout = layout
        self.address = address
        self._socket = zmq.Context.instance().socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, SEND_HIGH_WATER_MARK)
        # Queue only towards a connected consumer: with none (not started, or dead) a send is
        # dropped at once instead of piling up for a peer that may never come.
        self._socket.setsockopt(zmq.IMMEDIATE, 1)
        self._socket.connect(address)
        # Host buffers with the tracker of the send that still reads each (None: free).
        self._buffers: list[tuple[torch.Tensor, zmq.MessageTracker | None]] = []
        self.blocks_dropped = 0

    def _free_buffer(self, num_bytes: int) -> tuple[int | None, torch.Tensor]:
        """A host buffer no queued send reads any more, of at least `num_bytes`, and its index among
        the kept ones (None: a one-off buffer, which ZMQ's reference keeps alive until sent)."""
        device = self.tensors[0].device
        for index, (buffer, tracker) in enumerate(self._buffers):
            if tracker is None or tracker.done:
                if buffer.numel() < num_bytes:
                    buffer = _host_buffer(num_bytes, device)
                self._buffers[index] = (buffer, None)
                return index, buffer
        if len(self._buffers) >= MAX_PINNED_SEND_BUFFERS:
            return None, torch.empty(num_bytes, dtype=torch.uint8)
        self._buffers.append((_host_buffer(num_bytes, device), None))
        return len(self._buffers) - 1, self._buffers[-1][0]

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        if not isinstance(metadata, KVSendMetadata):
            raise TypeError(f"a KV producer got {type(metadata).__name__} metadata")
        header = KVBlocksHeader(self.layout, metadata.keys, metadata.token_ids, metadata.transfer_ids)
        num = len(metadata.device_blocks)
        index = None
        payload = memoryview(b"")
        if num:  # a batch may only announce transfer ids (requests with no full block)
            device = self.tensors[0].device
            blocks = torch.tensor(metadata.device_blocks, dtype=torch.long, device=device)
            # [tensors, 2, num, block bytes] -> [num, tensors, 2, block bytes]: block after block,
            # rearranged on the device (fast there) so the host receives one contiguous run.
            gathered = torch.stack([t.index_select(1, blocks).flatten(2) for t in self.tensors])
            rows = gathered.permute(2, 0, 1, 3).contiguous().view(-1)
            index, buffer = self._free_buffer(rows.numel())
            host = buffer[: rows.numel()]
            host.copy_(rows, non_blocking=device.type == "cuda" and buffer.is_pinned())
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()  # the bytes must be on the host to send
            payload = memoryview(host.numpy())
        try:
            tracker = self._socket.send_multipart(
                blocks_message_frames(header, payload), zmq.NOBLOCK, copy=False, track=True
            )
        except zmq.Again:
            self.blocks_dropped += num
            logger.warning(
                "KV consumer at %s is not taking blocks: dropped %d and transfers %s (it will compute those "
                "prompts)", self.address, num, metadata.transfer_ids,
            )  # fmt: skip
            return
        if index is not None:
            self._buffers[index] = (self._buffers[index][0], tracker)

    def wait_for_load(self) -> None:
        pass  # start_load_kv waited for the device-to-host copy before sending

    def release(self) -> None:
        self._socket.close(0)
        self.tensors = []
        self._buffers = []


class KVReceiverWorker(KVConnectorWorker):
    def __init__(self, kv_cache_tensors: list[torch.Tensor], layout: KVLayout) -> None:
        self.tensors = _byte_views(kv_cache_tensors)
        self.layout = layout
        self._staging: torch.Tensor | None = None
        self._staging_read: torch.cuda.Event | None = None  # the last host-to-device copy from it

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        if not isinstance(metadata, KVReceiveMetadata):
            raise TypeError(f"a KV consumer got {type(metadata).__name__} metadata")
        device = self.tensors[0].device
        num = len(metadata.device_blocks)
        block_bytes = self.layout.bytes_per_block
        if self._staging_read is not None:
            self._staging_read.synchronize()  # the previous load's copy may still read the buffer
        if self._staging is None or self._staging.numel() < num * block_bytes:
            self._staging = _host_buffer(num * block_bytes, device)
        staging = self._staging[: num * block_bytes].view(num, block_bytes)
        for first, region in _contiguous_runs(metadata.payloads, block_bytes):
            # One copy per run of blocks that sit side by side in one received frame (a claim takes
            # a prompt's blocks in order): torch splits a large copy over its threads. ZMQ's frames
            # are writable; a read-only buffer (bytes) goes through numpy, which torch cannot wrap.
            target = staging[first : first + len(region) // block_bytes].view(-1)
            if region.flags.writeable:
                target.copy_(torch.from_numpy(region))
            else:
                target.numpy()[:] = region
        on_device = device.type == "cuda"
        data = staging.to(device, non_blocking=True) if on_device else staging
        if on_device:
            self._staging_read = torch.cuda.Event()
            self._staging_read.record(torch.cuda.current_stream(device))
        blocks = torch.tensor(metadata.device_blocks, dtype=torch.long, device=device)
        offset = 0
        for tensor in self.tensors:
            size = tensor[:, 0].numel()
            rows = data[:, offset : offset + size].reshape(num, tensor.shape[0], *tensor.shape[2:]).transpose(0, 1)
            tensor.index_copy_(1, blocks, rows)
            offset += size

    def wait_for_load(self) -> None:
        pass  # the copies above were queued on the compute stream
