"""The engine process's links to its API server processes: one pair of sockets per API server.

`serve --api-server-count N` puts N API server processes in front of one engine core. Each has
its own pair of ipc:// sockets (it binds them, the engine connects): requests come in on its
inbox, its requests' outputs go out on its outbox. The engine remembers which API server sent
each request and returns that request's outputs there alone; step stats reach every API server
(each exports the engine's gauges) at least every STATS_INTERVAL_S.

Client 0 spawned the engine and waits for EngineReady from the start. The others start later
(once the engine is ready) and say Hello first: nothing is sent to an API server before that,
because messages to a peer that is not there yet would fill its queue and then block the engine.
Sends to the first process wait while its queue is full (it spawned the engine; the engine has
no reason to run without it). Sends to the others never wait: once one's socket queue is full its
messages wait in a backlog here while the engine serves the rest; a backlog not drained within
TOKENMILL_API_SERVER_STALL_TIMEOUT means that process stalled (SIGSTOP, a debugger, a machine
swapping): `flush_backlogs` names it, the engine aborts its requests and tells the first process,
which kills it (api_workers.py restarts it).

When one of those processes dies, the first process (its supervisor) says so (ApiServerGone): the
engine aborts the dead one's requests at once (nobody reads them any more), drops their last
outputs and sends that slot nothing until a restarted process says Hello there; a full queue to a
dead reader would otherwise block the engine. A Hello from a slot still registered (the notice
lost or late) also counts as a restart and aborts what the slot owned.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterator

import msgspec
import zmq

from tokenmill.core.outputs import EngineCoreOutput
from tokenmill.engine.messages import AddRequests, ClientMessage, StepOutputs

SEND_RETRY_S = 0.005


class ParentGone(Exception):
    """The API server process that spawned the engine is gone."""


def slot_addresses(ipc_dir: str, slot: int) -> tuple[str, str]:
    """API server `slot`'s (input, output) addresses: it sends on the first, receives on the second."""
    return f"ipc://{ipc_dir}/input{slot}", f"ipc://{ipc_dir}/output{slot}"


class ClientLinks:
    def __init__(
        self,
        ctx: zmq.Context,
        input_addrs: list[str],
        output_addrs: list[str],
        parent_alive: Callable[[], bool],
        stall_timeout_s: float = 30.0,
    ) -> None:
        if stall_timeout_s <= 0:
            raise ValueError(
                f"TOKENMILL_API_SERVER_STALL_TIMEOUT must be a positive number of seconds, got {stall_timeout_s}"
            )
        if len(input_addrs) != len(output_addrs) or not input_addrs:
            raise ValueError(
                f"each API server needs one input and one output address; got {len(input_addrs)} inputs "
                f"and {len(output_addrs)} outputs"
            )
        self._inboxes = []
        self._outboxes = []
        for input_addr, output_addr in zip(input_addrs, output_addrs, strict=True):
            inbox = ctx.socket(zmq.PULL)
            inbox.connect(input_addr)
            outbox = ctx.socket(zmq.PUSH)
            outbox.connect(output_addr)
            self._inboxes.append(inbox)
            self._outboxes.append(outbox)
        self._parent_alive = parent_alive
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ClientMessage)
        self._poller = zmq.Poller()
        for inbox in self._inboxes:
            self._poller.register(inbox, zmq.POLLIN)
        # Client 0 spawned the engine and waits for it; the others announce themselves.
        self._registered = [slot == 0 for slot in range(len(self._inboxes))]
        self._pids: list[int] = [0] * len(self._inboxes)  # each slot's process, as its Hello said
        self._owner: dict[str, int] = {}  # live request id -> the API server that sent it
        self._orphans: set[str] = set()  # requests of a process that died: outputs dropped
        self.stall_timeout_s = stall_timeout_s
        # Per API server other than the first: encoded messages its full queue could not take yet,
        # and since when (None: nothing waits).
        self._backlogs: list[deque[bytes]] = [deque() for _ in self._inboxes]
        self._stalled_since: list[float | None] = [None] * len(self._inboxes)

    @property
    def count(self) -> int:
        return len(self._inboxes)

    def register(self, client: int, pid: int = 0) -> list[str]:
        """`client` (process `pid`) said Hello: it is bound and reading; from now on it gets stats
        and answers. Returns the requests of the process it replaces (if that one was not dropped
        yet), for the engine to abort; their outputs are dropped."""
        replaced = self._orphan(client) if self._registered[client] and client != 0 else []
        self._clear_backlog(client)  # anything still waiting was the dead process's
        self._registered[client] = True
        self._pids[client] = pid
        return replaced

    def drop(self, client: int, pid: int) -> list[str]:
        """Process `pid` of slot `client` is gone (ApiServerGone): returns its requests, for the
        engine to abort; the slot gets nothing until the next Hello. A notice about another process
        than the one registered there (a restarted one already said Hello) changes nothing."""
        if not 0 < client < self.count or not self._registered[client] or self._pids[client] != pid:
            return []
        self._registered[client] = False
        self._clear_backlog(client)
        return self._orphan(client)

    def _clear_backlog(self, client: int) -> None:
        self._backlogs[client].clear()
        self._stalled_since[client] = None

    def _orphan(self, client: int) -> list[str]:
        owned = [rid for rid, owner in self._owner.items() if owner == client]
        for rid in owned:
            del self._owner[rid]
        self._orphans.update(owned)
        return owned

    def receive(self, timeout_ms: int) -> Iterator[tuple[int, object]]:
        """Every message waiting (after up to `timeout_ms` for the first), with its sender's index.
        The sender of each AddRequests is remembered as its requests' owner."""
        if not self._poller.poll(timeout_ms):
            return
        for client, inbox in enumerate(self._inboxes):
            while True:
                try:
                    raw = inbox.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                message = self._decoder.decode(raw)
                if isinstance(message, AddRequests) and self.count > 1:
                    for request in message.requests:
                        self._owner[request.request_id] = client
                yield client, message

    def send(self, client: int, message: object) -> None:
        """To the first API server: waits while its queue is full (it is not reading), as long as
        the parent lives. To another: never waits; what its full queue cannot take waits in its
        backlog (module docstring)."""
        data = self._encoder.encode(message)
        if client != 0:
            backlog = self._backlogs[client]
            if backlog or not self._try_send(client, data):
                backlog.append(data)
                if self._stalled_since[client] is None:
                    self._stalled_since[client] = time.monotonic()
            return
        outbox = self._outboxes[client]
        while True:
            try:
                outbox.send(data, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                if not self._parent_alive():
                    raise ParentGone from None
                time.sleep(SEND_RETRY_S)

    def _try_send(self, client: int, data: bytes) -> bool:
        try:
            self._outboxes[client].send(data, flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def flush_backlogs(self) -> list[tuple[int, int]]:
        """Sends what waits in the backlogs as far as the queues take it; returns (slot, pid) of
        each API server whose backlog has waited longer than the stall timeout (the engine drops
        it: `drop`)."""
        stalled = []
        now = time.monotonic()
        for client, backlog in enumerate(self._backlogs):
            while backlog and self._try_send(client, backlog[0]):
                backlog.popleft()
            since = self._stalled_since[client]
            if not backlog:
                self._stalled_since[client] = None
            elif since is not None and now - since > self.stall_timeout_s:
                stalled.append((client, self._pids[client]))
        return stalled

    def send_step(self, outputs: list[EngineCoreOutput], stats: dict[str, float], *, stats_due: bool) -> None:
        """A step's outputs to the API servers that own them, with the stats; every registered API
        server gets the stats when `stats_due`, outputs or not."""
        if self.count == 1:
            self.send(0, StepOutputs(outputs=outputs, stats=stats))
            return
        by_client: dict[int, list[EngineCoreOutput]] = {}
        for output in outputs:
            if self._orphans and output.request_id in self._orphans:
                if output.finished:
                    self._orphans.discard(output.request_id)
                continue
            # An id the engine never saw from a client (none today) goes to the one that spawned it.
            owner = (
                self._owner.pop(output.request_id, 0)
                if output.finished
                else self._owner.get(output.request_id, 0)
            )
            by_client.setdefault(owner, []).append(output)
        for client, registered in enumerate(self._registered):
            mine = by_client.get(client)
            if registered and (mine or stats_due):
                self.send(client, StepOutputs(outputs=mine or [], stats=stats))

    def close(self) -> None:
        for inbox in self._inboxes:
            inbox.close(linger=0)
        for outbox in self._outboxes:
            outbox.close(linger=1000)


def parent_alive_check(parent_pid: int) -> Callable[[], bool]:
    return lambda: os.getppid() == parent_pid
