"""The sender's tick loop sleeps until its send table's next deadline (issue 25, item 6).

P alone, over the in-memory side channel, under trio's autojump clock: a D worker is a memory
dealer that sends a pull and waits for the answer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial

import trio
import trio.testing

from pdactors.actors.sender import Sender, serve_sender
from pdactors.config import SenderConfig
from pdactors.core.plan import packed_layout
from pdactors.core.send_table import Effect
from pdactors.transport import MemoryTransport
from pdactors.wire import PullFailed, PullRequest, decode_frames, encode_frames

LAYOUT = packed_layout(1 << 20, 2, 64, 1024)


class _NoWrites:
    """A data plane these tests never write through."""

    session = "nowhere:1"

    def register(self, regions: list[tuple[int, int]]) -> None:
        raise AssertionError("not used")

    async def write(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("not used")


@asynccontextmanager
async def open_sender(transport: MemoryTransport, **settings: float) -> AsyncIterator[Sender]:
    config = SenderConfig(engine_id="p", lease_interval=0, **settings)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        serve = partial(serve_sender, transport=transport)
        sender = await nursery.start(serve, config, _NoWrites(), LAYOUT)
        yield sender
        nursery.cancel_scope.cancel()


def count_ticks(sender: Sender) -> list[float]:
    """The times the sender ticked its table from now on."""
    ticks: list[float] = []
    tick: Callable[[float], list[Effect]] = sender._table.tick

    def counted(now: float) -> list[Effect]:
        ticks.append(now)
        return tick(now)

    sender._table.tick = counted  # type: ignore[method-assign]
    return ticks


def pull(tid: str) -> PullRequest:
    return PullRequest(tid, "d:1", 0, 1, 0, 1, ((5, 6),), "layout", layout=LAYOUT)


async def test_an_idle_sender_never_wakes(autojump_clock: trio.testing.MockClock) -> None:
    async with open_sender(MemoryTransport()) as sender:
        ticks = count_ticks(sender)
        await trio.sleep(3600)  # an idle hour: nothing is due, so nothing ticks
        assert ticks == []


async def test_a_deadline_is_met_to_the_moment_and_ticks_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_sender(MemoryTransport(), unclaimed_ttl=30, tombstone_ttl=1e6) as sender:
        ticks = count_ticks(sender)
        start = trio.current_time()
        sender.transfer_ready("t1", [1, 2])
        assert await sender.wait_finished() == {"t1"}  # expired, unclaimed
        assert ticks == [start + 30]


async def test_an_earlier_deadline_rearms_the_sleeping_loop(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The loop sleeps until a ready transfer expires in 1000 s; a pull that waits for
    another transfer must still time out after ready_timeout (5 s), not then."""
    memory = MemoryTransport()
    settings = {"unclaimed_ttl": 1000, "ready_timeout": 5, "tombstone_ttl": 1e6}
    async with (
        open_sender(memory, **settings) as sender,
        memory.open_dealer(sender.address) as d,
    ):
        sender.transfer_ready("far", [1])
        await trio.testing.wait_all_tasks_blocked()
        start = trio.current_time()
        sender.transfer_pending("near")
        await d.send(encode_frames(pull("near")))
        reply = decode_frames(await d.receive())
        assert isinstance(reply, PullFailed) and "not ready within 5 s" in reply.reason
        assert trio.current_time() - start == 5
