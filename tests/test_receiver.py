"""The receiver actor alone, under trio's autojump clock: a stub bootstrap, the in-memory
transport, and P workers played by the test (or absent)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any, cast

import pytest
import trio
import trio.testing

from pdactors import Liveness, PullFailedError, ReceiverConfig
from pdactors.actors._p_connections import DOWN_MEMORY, PARTING_MEMORY
from pdactors.actors.receiver import Receiver
from pdactors.bootstrap_client import BootstrapClient
from pdactors.dataplane import DataPlane
from pdactors.transport import MemoryTransport
from pdactors.wire import BlockLayout, BootstrapAnswer, BootstrapEntry, Layout

LAYOUT = Layout((BlockLayout(1 << 20, 16, 1024, 1024),))


class _Bootstrap:
    """``http://b{n}`` registers engine ``p{n}``, one worker at ``tcp://p:{n}``."""

    async def query(self, url: str, *, timeout: float, retry: bool) -> BootstrapAnswer:  # noqa: ASYNC109 (the client's signature)
        await trio.lowlevel.checkpoint()
        n = url.rsplit("b", 1)[1]
        return {0: BootstrapEntry(f"p{n}", {0: {0: f"tcp://p:{n}"}})}


@asynccontextmanager
async def open_receiver(
    transport: MemoryTransport, config: ReceiverConfig | None = None
) -> AsyncIterator[Receiver]:
    config = config or ReceiverConfig(liveness=Liveness(connect_timeout=1e6))
    plane = cast(DataPlane, SimpleNamespace(session="d:1"))
    client = cast(BootstrapClient, _Bootstrap())
    async with trio.open_nursery() as nursery:
        receiver = Receiver(config, plane, LAYOUT, client, nursery, transport)
        nursery.start_soon(receiver._serve_deadlines)
        yield receiver
        nursery.cancel_scope.cancel()


def sizes(receiver: Receiver) -> dict[str, int]:
    """How many entries each map and set of ``receiver`` and its look-ups holds (the answers'
    cache aside: it is bounded by the bootstraps D trusts)."""
    owners = {
        "": vars(receiver),
        "lookups.": vars(receiver._lookups),
        "links.": vars(receiver._links),
    }
    return {
        prefix + name: len(value)
        for prefix, attributes in owners.items()
        for name, value in attributes.items()
        if isinstance(value, dict | set) and name != "_answers"
    }


async def pull_fails(receiver: Receiver, n: int, tid: str = "") -> str:
    """Pull ``tid`` from P ``p{n}``, which must fail; why it did."""
    with pytest.raises(PullFailedError) as info:
        await receiver.pull(
            tid or f"t{n}", bootstrap_url=f"http://b{n}", engine_id=f"p{n}", block_ids=[0]
        )
    return info.value.reason


async def test_maps_return_to_their_size_after_p_workers_come_and_go(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_receiver(MemoryTransport()) as receiver:
        before = sizes(receiver)
        async with trio.open_nursery() as nursery:  # P workers that died (nothing listens)
            for n in range(20):
                nursery.start_soon(pull_fails, receiver, n)
        await trio.testing.wait_all_tasks_blocked()
        assert len(receiver._links._down) == 20  # remembered as down a while (INFO next time)
        await trio.sleep(max(DOWN_MEMORY, PARTING_MEMORY))  # the parting cancels tried too
        assert "P gone" in await pull_fails(receiver, 99)
        await trio.testing.wait_all_tasks_blocked()
        # ...and forgotten after it: only the one just lost is left (and its cancel owed).
        assert sizes(receiver) == {**before, "links._down": 1, "links._owed": 1}


class _CountingTicks:
    """Counts how often the receiver's loop asks its pull table for expired pulls."""

    def __init__(self, receiver: Receiver) -> None:
        self.calls = 0
        table = receiver._table
        tick = table.tick

        def counted(now: float) -> Any:
            self.calls += 1
            return tick(now)

        table.tick = counted  # type: ignore[method-assign]


async def silent_p_fails_after(receiver: Receiver, tid: str) -> float:
    """Pull ``tid`` from P ``p1`` (which never answers); how long the pull took to fail."""
    start = trio.current_time()
    assert "within the pull deadline" in await pull_fails(receiver, 1, tid)
    return trio.current_time() - start


async def test_the_receiver_sleeps_until_the_next_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """No wake-up every tick: the loop runs when a pull's deadline comes, exactly then. An idle
    receiver's first pull re-arms the sleep at once; later pulls keep their own deadlines."""
    memory = MemoryTransport()
    config = ReceiverConfig(pull_timeout=480, liveness=Liveness(connect_timeout=1e6))
    async with (
        memory.open_router("p", 1),  # a P worker that never answers
        open_receiver(memory, config) as receiver,
    ):
        ticks = _CountingTicks(receiver)
        await trio.sleep(1000)  # idle: no pull, no deadline
        assert ticks.calls == 0
        assert await silent_p_fails_after(receiver, "a") == 480
        assert ticks.calls == 1
        took: list[float] = []

        async def timed(tid: str) -> None:
            took.append(await silent_p_fails_after(receiver, tid))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(timed, "b")
            await trio.sleep(100)
            nursery.start_soon(timed, "c")
        assert took == [480, 480]  # ended at t+480 and t+580
        assert ticks.calls == 3
