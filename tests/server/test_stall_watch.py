"""StallWatch: a streamed write pending for the stall timeout ends the stream; writes that
finish, idle gaps between writes, and other cancellations do not turn into stalls."""

from __future__ import annotations

import asyncio
import time

import pytest

from tokenmill.server.stall_watch import ClientStalled, StallWatch


def _sender(delays: list[float]):
    """A send that takes the next delay of `delays` each call (a blocked socket: a long one)."""

    async def send(message: object) -> None:
        await asyncio.sleep(delays.pop(0))

    return send


def test_writes_that_finish_and_idle_gaps_longer_than_the_timeout_are_fine() -> None:
    async def scenario() -> None:
        watch = StallWatch(0.1)
        send = _sender([0.0, 0.06, 0.0, 0.06])
        await watch.send(send, "a")
        await asyncio.sleep(0.25)  # idle for more than the timeout: the timer re-arms, nothing ends
        await watch.send(send, "b")  # each write shorter than the timeout, one right after a re-arm
        await asyncio.sleep(0.07)
        await watch.send(send, "c")
        await watch.send(send, "d")
        assert not watch.stalled
        watch.close()
        assert watch._timer is None

    asyncio.run(scenario())


def test_a_write_pending_for_the_timeout_raises_client_stalled_when_the_timeout_ends() -> None:
    async def scenario() -> None:
        watch = StallWatch(0.2)
        send = _sender([0.0, 10.0])
        await watch.send(send, "a")
        await asyncio.sleep(0.15)  # the write below starts late in the first timer period
        started = time.monotonic()
        with pytest.raises(ClientStalled):
            await watch.send(send, "b")
        waited = time.monotonic() - started
        assert 0.19 <= waited < 1.0, waited  # its own full timeout, not the period's remainder
        assert watch.stalled and asyncio.current_task().cancelling() == 0
        watch.close()

    asyncio.run(scenario())


def test_another_cancellation_of_the_writer_stays_a_cancellation() -> None:
    async def scenario() -> None:
        watch = StallWatch(0.1)

        async def writer() -> None:
            await watch.send(_sender([10.0]), "a")

        task = asyncio.create_task(writer())
        await asyncio.sleep(0.05)
        task.cancel()  # a server shutdown, before the stall timeout
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not watch.stalled
        watch.close()

    asyncio.run(scenario())


def test_the_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        StallWatch(0)
