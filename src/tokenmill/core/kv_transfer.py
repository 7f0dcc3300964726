"""Disaggregated prefill / decode, scheduler sides: a producer engine ships the prompt blocks of its
finished requests to a consumer engine, which starts the same prompts from them.

Blocks travel keyed by their prefix-cache key (the chained token hash, with the LoRA adapter and
cache salt in it) and carry their token ids: a request whose prompt runs into received blocks
loads them (like a prefix hit) and computes only the rest (at least the last prompt token, whose
logits it needs). Greedy output is the same as colocated serving.

Transfer ids close the race between a request and its blocks: a producer request that names one
(`kv_transfer_params.transfer_id`, SamplingParams.kv_transfer_id) sends it with its blocks (or
alone, when it has none to send); a consumer request naming the same id waits, holding no block
and letting others pass, until the id has arrived or `wait_timeout_s` passed (a dead producer, a
dropped send), and then loads what came. A request without an id, or whose blocks were refused or
expired, is computed whole.

The wire (worker/kv_connector/transfer.py sends, `KVConsumer` receives): ZMQ PUSH -> PULL, one
two-frame message per batch of blocks, never pickle: a msgspec header (`KVBlocksHeader`: keys, token
ids, transfer ids and the KV layout it was cut from: model, block size, dtype, tensor shapes) and
the blocks' bytes as one raw frame, block after block. The bytes are never re-encoded or split into
per-block objects: the producer sends its host copy as it is and the consumer keeps views into the
received frame (a 4,096-token prompt of an 8B model is 512 MiB; each extra copy of it costs tens
of milliseconds of a step loop). A consumer refuses a message whose layout differs from its own,
whose payload does not match its header, or that does not decode, counting it. Received blocks
no request claims within the claim timeout are dropped, and so are the oldest past the byte bound.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import msgspec
import zmq

from tokenmill.core.block_hash import extend_block_hashes
from tokenmill.core.kv_connector import KVConnectorScheduler
from tokenmill.core.kv_connector_metadata import KVConnectorMetadata, KVReceiveMetadata, KVSendMetadata
from tokenmill.core.request import Request, RequestStatus

logger = logging.getLogger(__name__)

_SENT_STATUSES = (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
MAX_ARRIVED_TRANSFERS = 1 << 16  # transfer ids remembered (each for the claim timeout at most)


class KVLayout(msgspec.Struct, frozen=True, array_like=True):
    """What a block's bytes mean: both ends must agree on all of it."""

    model: str
    block_size: int
    dtype: str
    num_tensors: int  # layer tensors of the pool; a block's payload is one block of each, in order
    block_shape: tuple[int, ...]  # one tensor's block: (2, block_size, kv_heads, head_dim)
    bytes_per_block: int

    def differences(self, other: KVLayout) -> list[str]:
        return [
            f"{name} {getattr(other, name)!r} (ours {getattr(self, name)!r})"
            for name in self.__struct_fields__
            if getattr(self, name) != getattr(other, name)
        ]


class KVBlocksHeader(msgspec.Struct, array_like=True):
    """The first frame of a transfer; the second holds `len(keys)` blocks of `layout.bytes_per_block`."""

    layout: KVLayout
    keys: list[bytes]
    token_ids: list[list[int]]
    transfer_ids: list[str] = []  # requests whose blocks are all in this message (see KVSendMetadata)


_header_encoder = msgspec.msgpack.Encoder()


def blocks_message_frames(header: KVBlocksHeader, payload: bytes | memoryview) -> list[bytes | memoryview]:
    """The frames of one transfer: the encoded header, then the blocks' bytes (not copied)."""
    return [_header_encoder.encode(header), payload]


class KVProducer(KVConnectorScheduler):
    """Queues the full prompt blocks of each request that finished normally; the worker sends them
    before the next step's forward (which is what may overwrite them)."""

    accepts_transfer_ids = True

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._pending = KVSendMetadata()
        self.blocks_sent = 0

    def get_num_new_matched_tokens(self, request: Request, num_local_hit_tokens: int) -> int:
        return 0

    def update_state_after_alloc(self, request: Request, first_block_index: int, device_block_ids: Sequence[int]) -> None:
        raise AssertionError("a producer never offers external tokens")

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> None:
        transfer_id = request.sampling_params.kv_transfer_id
        if transfer_id is not None:
            # Announced whatever happened: a consumer waiting on it then starts at once (with what
            # came, maybe nothing) instead of waiting out its timeout.
            self._pending.transfer_ids.append(transfer_id)
        if request.status not in _SENT_STATUSES or not block_ids:
            return
        block_size = self.block_size
        # The consumer computes the prompt's last token itself (it needs its logits): a block
        # ending there is never claimed.
        num_full = min((len(request.prompt_token_ids) - 1) // block_size, len(block_ids))
        if num_full == 0:
            return
        hashes = extend_block_hashes(request, block_size)
        tokens = request.all_token_ids
        pending = self._pending
        for i in range(num_full):
            pending.device_blocks.append(block_ids[i])
            pending.keys.append(hashes[i])
            pending.token_ids.append(tokens[i * block_size : (i + 1) * block_size])

    def has_pending_work(self) -> bool:
        return not self._pending.is_empty

    def build_connector_meta(self) -> KVConnectorMetadata | None:
        if self._pending.is_empty:
            return None
        meta, self._pending = self._pending, KVSendMetadata()
        self.blocks_sent += len(meta.device_blocks)
        return meta

    def get_stats(self) -> dict[str, float]:
        return {"kv_transfer_blocks_sent": self.blocks_sent}


class KVConsumer(KVConnectorScheduler):
    """Receives blocks (ZMQ PULL, bound at `address`), offers them to requests whose prompt runs
    into them, and has the worker copy a claimed block's bytes into its device block."""

    accepts_transfer_ids = True

    def __init__(
        self,
        address: str,
        layout: KVLayout,
        claim_timeout_s: float,
        max_bytes: int,
        clock: Callable[[], float] = time.monotonic,
        wait_timeout_s: float = 5.0,
    ) -> None:
        self.wait_timeout_s = wait_timeout_s
        self.layout = layout
        self.block_size = layout.block_size
        self.claim_timeout_s = claim_timeout_s
        self.max_bytes = max_bytes
        self._clock = clock
        self._socket = zmq.Context.instance().socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(address)
        except zmq.ZMQError as exc:
            self._socket.close(0)
            raise ValueError(
                f"the KV consumer cannot bind kv_transfer_address {address!r} ({exc}); give a free "
                "tcp://HOST:PORT or an ipc:// path this process may create"
            ) from None
        self._decoder = msgspec.msgpack.Decoder(KVBlocksHeader)
        # key -> (token ids, a view of its bytes in the received frame, arrival time), oldest first.
        self._entries: OrderedDict[bytes, tuple[tuple[int, ...], memoryview, float]] = OrderedDict()
        self._loads = KVReceiveMetadata()
        # Transfer ids announced by the producer -> arrival time, oldest first (kept for the claim
        # timeout, at most MAX_ARRIVED_TRANSFERS).
        self._arrived: OrderedDict[str, float] = OrderedDict()
        # Waiting requests that named a transfer not arrived yet -> when they stop waiting.
        self._wait_deadlines: dict[str, float] = {}
        self._gave_up: set[str] = set()  # those that waited out their deadline (counted once)
        self.transfers_timed_out = 0
        self.blocks_received = 0
        self.blocks_claimed = 0
        self.blocks_expired = 0
        self.messages_refused = 0
        self.hit_tokens = 0

    def close(self) -> None:
        self._socket.close(0)

    # -- receiving ----------------------------------------------------------------------------

    def poll(self) -> None:
        """Take every message waiting on the socket, then drop what expired or overflows."""
        while True:
            try:
                # Not copied: the blocks stay in ZMQ's frame, which lives as long as a view of it.
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self._accept([frame.buffer for frame in frames])
        self._expire()

    def _accept(self, frames: list[memoryview]) -> None:
        if len(frames) != 2:
            self.messages_refused += 1
            logger.warning("refused a KV transfer of %d frames (a header and the blocks' bytes: 2)", len(frames))
            return
        try:
            header = self._decoder.decode(frames[0])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.messages_refused += 1
            logger.warning("refused a KV transfer that does not decode (%s)", exc)
            return
        self._accept_blocks(header, frames[1])
        # After the blocks: a request released by its id finds them. Refused blocks release it too
        # (it computes its prompt now rather than wait for blocks that will never come).
        now = self._clock()
        for transfer_id in header.transfer_ids:
            self._arrived.pop(transfer_id, None)
            self._arrived[transfer_id] = now
        while len(self._arrived) > MAX_ARRIVED_TRANSFERS:
            self._arrived.popitem(last=False)

    def _accept_blocks(self, header: KVBlocksHeader, payload: memoryview) -> None:
        differences = self.layout.differences(header.layout)
        if differences:
            self.messages_refused += 1
            logger.warning("refused a KV transfer cut from another KV layout: %s", "; ".join(differences))
            return
        block_bytes = self.layout.bytes_per_block
        payload = payload.cast("B")
        if (
            len(header.keys) != len(header.token_ids)
            or payload.nbytes != len(header.keys) * block_bytes
            or any(len(t) != self.block_size for t in header.token_ids)
        ):
            self.messages_refused += 1
            logger.warning(
                "refused a corrupt KV transfer (%d keys, %d token lists, %d payload bytes; each block is %d bytes)",
                len(header.keys), len(header.token_ids), payload.nbytes, block_bytes,
            )  # fmt: skip
            return
        now = self._clock()
        for index, (key, token_ids) in enumerate(zip(header.keys, header.token_ids, strict=True)):
            self._entries.pop(key, None)
            self._entries[key] = (tuple(token_ids), payload[index * block_bytes : (index + 1) * block_bytes], now)
        self.blocks_received += len(header.keys)

    def _expire(self) -> None:
        deadline = self._clock() - self.claim_timeout_s
        entries = self._entries
        while entries:
            key, (_, _, arrived) = next(iter(entries.items()))
            if arrived > deadline and len(entries) * self.layout.bytes_per_block <= self.max_bytes:
                break
            del entries[key]
            self.blocks_expired += 1
        arrived = self._arrived
        while arrived and next(iter(arrived.values())) <= deadline:
            arrived.popitem(last=False)

    # -- waiting for a transfer ---------------------------------------------------------------

    def waits_for_transfer(self, request: Request) -> bool:
        transfer_id = request.sampling_params.kv_transfer_id
        request_id = request.request_id
        # Only before its first start: a preempted request recomputes, it does not wait again.
        if transfer_id is None or request_id in self._gave_up or request.num_cached_tokens >= 0:
            return False
        self.poll()
        if transfer_id in self._arrived:
            self._wait_deadlines.pop(request_id, None)
            return False
        now = self._clock()
        deadline = self._wait_deadlines.setdefault(request_id, now + self.wait_timeout_s)
        if now < deadline:
            return True
        del self._wait_deadlines[request_id]
        self._gave_up.add(request_id)
        self.transfers_timed_out += 1
        logger.warning(
            "KV transfer %r for request %s did not arrive within %g s (producer gone, or its send dropped); "
            "computing the prompt here", transfer_id, request_id, self.wait_timeout_s,
        )  # fmt: skip
        return False

    def wait_for_arrivals(self, timeout_s: float) -> None:
        if self._wait_deadlines:
            self._socket.poll(int(timeout_s * 1000), zmq.POLLIN)

    def request_finished(self, request: Request, block_ids: Sequence[int]) -> None:
        self._wait_deadlines.pop(request.request_id, None)
        self._gave_up.discard(request.request_id)

    @property
    def num_waiting_requests(self) -> int:
        """Requests this connector tracks (waiting, or gave up waiting): 0 once all have ended."""
        return len(self._wait_deadlines) + len(self._gave_up)

    # -- admission ----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_local_hit_tokens: int) -> int:
        self.poll()
        if not self._entries:
            return 0
        block_size = self.block_size
        hashes = extend_block_hashes(request, block_size)
        tokens = request.all_token_ids
        first = num_local_hit_tokens // block_size
        index = first
        while index < (request.num_tokens - 1) // block_size:
            entry = self._entries.get(hashes[index])
            if entry is None or entry[0] != tuple(tokens[index * block_size : (index + 1) * block_size]):
                break
            index += 1
        return (index - first) * block_size

    def update_state_after_alloc(self, request: Request, first_block_index: int, device_block_ids: Sequence[int]) -> None:
        hashes = request.block_hashes
        for offset, device_block in enumerate(device_block_ids):
            _, payload, _ = self._entries.pop(hashes[first_block_index + offset])
            self._loads.device_blocks.append(device_block)
            self._loads.payloads.append(payload)
        self.blocks_claimed += len(device_block_ids)
        self.hit_tokens += len(device_block_ids) * self.block_size

    def build_connector_meta(self) -> KVConnectorMetadata | None:
        if self._loads.is_empty:
            return None
        meta, self._loads = self._loads, KVReceiveMetadata()
        return meta

    def reset(self) -> None:
        self._entries.clear()

    @property
    def num_unclaimed_blocks(self) -> int:
        return len(self._entries)

    def get_stats(self) -> dict[str, float]:
        return {
            "kv_transfer_hits": self.hit_tokens,
            "kv_transfer_blocks_received": self.blocks_received,
            "kv_transfer_blocks_claimed": self.blocks_claimed,
            "kv_transfer_blocks_expired": self.blocks_expired,
            "kv_transfer_messages_refused": self.messages_refused,
            "kv_transfer_wait_timeouts": self.transfers_timed_out,
        }

    def check_invariants(self) -> None:
        assert len(self._entries) * self.layout.bytes_per_block <= self.max_bytes, "unclaimed blocks past the bound"
        assert self._loads.is_empty, "consumer loads outlived their step (build_connector_meta not called)"
