"""Disaggregated prefill / decode, worker sides (core/kv_transfer.py decides; these copy).

`KVSenderWorker` (producer): before the step's forward, gathers the bytes of the blocks the step's
`KVSendMetadata` names (one block of every layer tensor, in the pool's order) and sends them with
their keys and token ids as one `KVBlocksMessage` over ZMQ PUSH. A send that would block (no
consumer, or one not reading) is dropped and logged: the consumer then computes those prompts.

`KVReceiverWorker` (consumer): copies the payloads of `KVReceiveMetadata` into device blocks.
"""

from __future__ import annotations

import logging

import msgspec
import torch
import zmq

from tokenmill.core.kv_connector_metadata import KVConnectorMetadata, KVReceiveMetadata, KVSendMetadata
from tokenmill.core.kv_transfer import KVBlocksMessage, KVLayout
from tokenmill.worker.kv_connector.base import KVConnectorWorker

logger = logging.getLogger(__name__)

SEND_HIGH_WATER_MARK = 64  # messages queued towards a slow consumer before sends are dropped


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
        self._encoder = msgspec.msgpack.Encoder()
        self.blocks_dropped = 0

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        if not isinstance(metadata, KVSendMetadata):
            raise TypeError(f"a KV producer got {type(metadata).__name__} metadata")
        blocks = torch.tensor(metadata.device_blocks, dtype=torch.long, device=self.tensors[0].device)
        payloads: list[bytes] = []
        if len(blocks):  # a batch may only announce transfer ids (requests with no full block)
            # [num_blocks, bytes of one block of every tensor], on the host.
            rows = torch.cat(
                [t.index_select(1, blocks).transpose(0, 1).reshape(len(blocks), -1) for t in self.tensors], dim=1
            ).cpu()
            payloads = [row.numpy().tobytes() for row in rows]
        message = KVBlocksMessage(self.layout, metadata.keys, metadata.token_ids, payloads, metadata.transfer_ids)
        try:
            self._socket.send(self._encoder.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            self.blocks_dropped += len(blocks)
            logger.warning(
                "KV consumer at %s is not taking blocks: dropped %d and transfers %s (it will compute those "
                "prompts)", self.address, len(blocks), metadata.transfer_ids,
            )  # fmt: skip

    def wait_for_load(self) -> None:
        pass  # the gather above already read the blocks (its .cpu() waited for the device)

    def release(self) -> None:
        self._socket.close(0)
        self.tensors = []


class KVReceiverWorker(KVConnectorWorker):
    def __init__(self, kv_cache_tensors: list[torch.Tensor], layout: KVLayout) -> None:
        self.tensors = _byte_views(kv_cache_tensors)
        self.layout = layout

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        if not isinstance(metadata, KVReceiveMetadata):
            raise TypeError(f"a KV consumer got {type(metadata).__name__} metadata")
        device = self.tensors[0].device
        num = len(metadata.device_blocks)
        data = torch.frombuffer(bytearray(b"".join(metadata.payloads)), dtype=torch.uint8).view(num, -1)
        blocks = torch.tensor(metadata.device_blocks, dtype=torch.long, device=device)
        offset = 0
        for tensor in self.tensors:
            block_shape = (tensor.shape[0], *tensor.shape[2:])
            size = tensor[:, 0].numel()
            rows = data[:, offset : offset + size].reshape(num, *block_shape).transpose(0, 1)
            tensor.index_copy_(1, blocks, rows.to(device, non_blocking=False))
            offset += size

    def wait_for_load(self) -> None:
        pass  # the copies above were queued on the compute stream
