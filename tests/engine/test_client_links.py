"""The engine process's links to several API server processes (engine/client_links.py): each
request's outputs go back to the API server that sent it, stats reach every API server that said
Hello, and nothing reaches one that has not (it may not be bound yet)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from tokenmill.core.outputs import EngineCoreOutput
from tokenmill.engine.client_links import ClientLinks, ParentGone, slot_addresses
from tokenmill.engine.messages import AddRequests, EngineCoreRequest, EngineMessage, Hello, StepOutputs
from tokenmill.sampling_params import SamplingParams

TIMEOUT_MS = 2000


class ApiSide:
    """One API server's end: binds its slot, sends and receives like CoreProcessClient."""

    def __init__(self, ctx: zmq.Context, ipc_dir: str, slot: int) -> None:
        input_addr, output_addr = slot_addresses(ipc_dir, slot)
        self.to_engine = ctx.socket(zmq.PUSH)
        self.to_engine.bind(input_addr)
        self.from_engine = ctx.socket(zmq.PULL)
        self.from_engine.bind(output_addr)
        self.decoder = msgspec.msgpack.Decoder(EngineMessage)

    def send(self, message: object) -> None:
        self.to_engine.send(msgspec.msgpack.encode(message))

    def received(self) -> list[object]:
        messages = []
        while self.from_engine.poll(200):
            messages.append(self.decoder.decode(self.from_engine.recv()))
        return messages


def request(request_id: str) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=2), max_tokens=2)


def output(request_id: str, finished: bool = False) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, [7], finish_reason="length" if finished else None)


def drain(links: ClientLinks) -> list[tuple[int, object]]:
    got = list(links.receive(TIMEOUT_MS))
    while True:
        more = list(links.receive(100))
        if not more:
            return got
        got += more


@contextlib.contextmanager
def linked(ctx: zmq.Context, tmp_path, slots: int, **kwargs) -> Iterator[tuple[list[ApiSide], ClientLinks]]:
    """`slots` API server ends bound in tmp_path and the engine's links to them, closed after."""
    api = [ApiSide(ctx, str(tmp_path), slot) for slot in range(slots)]
    addresses = [slot_addresses(str(tmp_path), slot) for slot in range(slots)]
    links = ClientLinks(ctx, [a for a, _ in addresses], [b for _, b in addresses], lambda: True, **kwargs)
    try:
        yield api, links
    finally:
        links.close()
        for side in api:
            side.to_engine.close(linger=0)
            side.from_engine.close(linger=0)


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.term()


def test_outputs_go_to_the_api_server_that_sent_the_request(tmp_path, ctx) -> None:
    with linked(ctx, tmp_path, 3) as (api, links):
        api[1].send(Hello())
        api[0].send(AddRequests([request("a0")]))
        api[1].send(AddRequests([request("b1"), request("c1")]))
        got = drain(links)
        assert sorted((client, type(m).__name__) for client, m in got) == [
            (0, "AddRequests"), (1, "AddRequests"), (1, "Hello")
        ]  # fmt: skip
        for client, message in got:
            if isinstance(message, Hello):
                links.register(client)

        links.send_step(
            [output("a0"), output("b1"), output("c1", finished=True)], {"num_running": 3.0}, stats_due=False
        )
        first0, first1 = api[0].received(), api[1].received()
        assert [[o.request_id for o in m.outputs] for m in first0] == [["a0"]]
        assert [[o.request_id for o in m.outputs] for m in first1] == [["b1", "c1"]]
        assert all(m.stats == {"num_running": 3.0} for m in first0 + first1)
        assert api[2].received() == []  # never said Hello: nothing sent

        # A step without outputs of API server 1's: nothing for it unless stats are due.
        links.send_step([output("a0")], {"num_running": 2.0}, stats_due=False)
        assert len(api[0].received()) == 1 and api[1].received() == []
        links.send_step([], {"num_running": 2.0}, stats_due=True)
        assert [m.outputs for m in api[1].received()] == [[]]
        assert [m.outputs for m in api[0].received()] == [[]]
        assert api[2].received() == []

        # c1 finished: its owner is forgotten (a late output with its id goes to the first API server).
        links.send_step([output("c1", finished=True)], {}, stats_due=False)
        assert [[o.request_id for o in m.outputs] for m in api[0].received()] == [["c1"]]
        assert api[1].received() == []


def test_one_api_server_gets_every_output_and_step(tmp_path, ctx) -> None:
    api = ApiSide(ctx, str(tmp_path), 0)
    input_addr, output_addr = slot_addresses(str(tmp_path), 0)
    links = ClientLinks(ctx, [input_addr], [output_addr], lambda: True)
    try:
        links.send_step([output("x")], {"num_running": 1.0}, stats_due=False)
        links.send_step([], {"num_running": 0.0}, stats_due=False)  # sent as before: one API server
        messages = api.received()
        assert [type(m) for m in messages] == [StepOutputs, StepOutputs]
        assert [o.request_id for o in messages[0].outputs] == ["x"]
    finally:
        links.close()
        api.to_engine.close(linger=0)
        api.from_engine.close(linger=0)


def test_a_full_queue_waits_only_while_the_parent_lives(tmp_path, ctx) -> None:
    # Nobody binds the output address, so nobody reads: messages queue up to the high-water mark
    # (1,000), then with the parent gone the engine gives up instead of waiting forever.
    input_addr, output_addr = slot_addresses(str(tmp_path), 0)
    links = ClientLinks(ctx, [input_addr], [output_addr], lambda: False)
    sent = 0
    try:
        with pytest.raises(ParentGone):
            for sent in range(1, 5001):  # noqa: B007 - counted for the assertion below
                links.send(0, StepOutputs())
        assert 900 <= sent <= 1100
    finally:
        links.close()


def test_addresses_come_in_pairs(ctx) -> None:
    with pytest.raises(ValueError, match="one input and one output"):
        ClientLinks(ctx, ["ipc:///a", "ipc:///b"], ["ipc:///c"], lambda: True)


def test_a_stall_timeout_must_be_positive(ctx) -> None:
    with pytest.raises(ValueError, match="TOKENMILL_API_SERVER_STALL_TIMEOUT must be a positive"):
        ClientLinks(ctx, ["ipc:///a"], ["ipc:///b"], lambda: True, stall_timeout_s=0.0)


def test_a_second_hello_from_a_slot_hands_back_the_dead_processs_requests(tmp_path, ctx) -> None:
    """A restarted API server process says Hello in its slot again: the requests the dead one sent
    come back for the engine to abort, and their remaining outputs reach nobody."""
    with linked(ctx, tmp_path, 2) as (api, links):
        assert links.register(1) == []  # the first Hello: nothing to hand back
        api[1].send(AddRequests([request("dead1"), request("dead2")]))
        api[0].send(AddRequests([request("alive")]))
        drain(links)
        assert sorted(links.register(1)) == ["dead1", "dead2"]
        assert links.register(1) == []  # handed back once
        links.send_step(
            [output("dead1"), output("dead2", finished=True), output("alive")],
            {"num_running": 3.0},
            stats_due=False,
        )
        assert [[o.request_id for o in m.outputs] for m in api[0].received()] == [["alive"]]
        assert api[1].received() == []  # the new process gets none of the dead one's outputs
        links.send_step([output("dead1", finished=True)], {}, stats_due=True)  # its abort, dropped too
        assert [m.outputs for m in api[1].received()] == [[]] and [m.outputs for m in api[0].received()] == [
            []
        ]
        assert links._orphans == set()


def test_the_first_process_notice_of_a_death_hands_back_its_requests_at_once(tmp_path, ctx) -> None:
    """ApiServerGone (the first process saw a worker exit): the dead process's requests come back
    before any replacement attaches, its slot gets nothing meanwhile (a dead reader's queue would
    fill and block the engine), and a notice naming another process of the slot changes nothing."""
    with linked(ctx, tmp_path, 3) as (api, links):
        assert links.drop(1, 111) == []  # never said Hello
        links.register(1, pid=111)
        links.register(2, pid=222)
        api[1].send(AddRequests([request("dead1"), request("dead2")]))
        api[2].send(AddRequests([request("other")]))
        drain(links)
        assert links.drop(1, 999) == []  # not the process registered in slot 1
        assert links.drop(0, 0) == [] and links.drop(7, 111) == []  # the first process; no such slot
        assert sorted(links.drop(1, 111)) == ["dead1", "dead2"]
        assert links.drop(1, 111) == []  # handed back once
        for _ in range(3):  # stats due: the dropped slot still hears nothing
            links.send_step([output("dead1"), output("other")], {"num_running": 2.0}, stats_due=True)
        assert api[1].received() == []
        assert [[o.request_id for o in m.outputs] for m in api[2].received()] == [["other"]] * 3
        # The replacement says Hello: nothing left to hand back; it hears stats again.
        assert links.register(1, pid=333) == []
        links.send_step([output("dead2", finished=True)], {"num_running": 1.0}, stats_due=True)
        assert [m.outputs for m in api[1].received()] == [[]]
        assert links.drop(1, 111) == []  # a late notice about the dead one leaves the new one alone
        assert links._orphans == {"dead1"}  # dropped until its abort's final output passes


def test_a_process_that_stops_reading_never_blocks_the_engine_and_is_named_once_stalled(
    tmp_path, ctx
) -> None:
    """Past what another API server's socket queues hold, its messages wait in a backlog (the
    engine goes on serving the rest) and reach it in order once it reads again; a backlog older
    than the stall timeout names the process, and dropping it clears the backlog."""
    import time

    with linked(ctx, tmp_path, 2, stall_timeout_s=0.5) as (api, links):
        links.register(1, pid=42)
        started = time.monotonic()
        for seq in range(5000):  # more than the queues on both ends hold (1,000 each + the socket's)
            links.send(1, StepOutputs(stats={"seq": float(seq)}))
        assert time.monotonic() - started < 5.0  # never waited for the reader
        assert links._backlogs[1], "the queues took everything: the test sent too few"
        assert links.flush_backlogs() == []  # waiting, but not for long yet
        links.send(0, StepOutputs(stats={"seq": -1.0}))  # the first process is served meanwhile
        assert [m.stats["seq"] for m in api[0].received()] == [-1.0]

        seen: list[float] = []
        deadline = time.monotonic() + 20
        while len(seen) < 5000 and time.monotonic() < deadline:  # it reads again
            while api[1].from_engine.poll(0):
                seen.append(api[1].decoder.decode(api[1].from_engine.recv()).stats["seq"])
            assert links.flush_backlogs() == []
        assert seen == [float(seq) for seq in range(5000)]  # all of them, in order
        assert not links._backlogs[1] and links._stalled_since[1] is None

        for seq in range(5000):  # it stops reading for good
            links.send(1, StepOutputs(stats={"seq": float(seq)}))
        time.sleep(0.6)
        assert links.flush_backlogs() == [(1, 42)]
        assert links.drop(1, 42) == [] and not links._backlogs[1]
        assert links.flush_backlogs() == []
