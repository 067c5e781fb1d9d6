"""Fault injection at the seams: wrappers around a real :class:`DataPlane` and a real
:class:`~pdactors.transport.Transport` (in the spirit of tractor's IPC fault injector)."""

from __future__ import annotations

import contextlib
import random
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass

import trio

from pdactors.config import Liveness
from pdactors.dataplane.base import Addrs, DataPlane
from pdactors.errors import TransferError
from pdactors.transport import Dealer, PeerUnreachable, Router, Transport

__all__ = ["FaultyDataPlane", "FaultyTransport", "MessageFaults"]


class FaultyDataPlane:
    """Wraps a real data plane; can hold writes at a gate and fail the next ``fail_writes``.

    Everything it does not break is passed to the real engine unchanged.
    """

    def __init__(self, inner: DataPlane, *, fail_writes: int = 0) -> None:
        self.inner = inner
        self.fail_writes = fail_writes
        self.gate: trio.Event | None = None
        self.writes_started = 0

    @property
    def session(self) -> str:
        return self.inner.session

    def register(self, regions: list[tuple[int, int]]) -> None:
        self.inner.register(regions)

    async def write(
        self,
        peer: str,
        src: Addrs,
        dst: Addrs,
        lengths: Addrs,
        *,
        before: Callable[[], object] | None = None,
        after: Callable[[], object] | None = None,
    ) -> None:
        self.writes_started += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_writes > 0:
            self.fail_writes -= 1
            raise TransferError(peer, int(lengths.sum()), -1, "injected fault")
        await self.inner.write(peer, src, dst, lengths, before=before, after=after)


@dataclass
class MessageFaults:
    """What :class:`FaultyTransport` does to each message sent, by probability (seeded)."""

    drop: float = 0.0
    duplicate: float = 0.0
    delay: float = 0.0
    delay_seconds: float = 0.05


class FaultyTransport:
    """Wraps a real :class:`~pdactors.transport.Transport`: every router and dealer opened
    through it drops, duplicates or delays the messages it sends (``faults``, drawn from a
    ``random.Random(seed)``), and :meth:`cut` makes every dealer's connection count as lost now,
    as a cut link would (the receiver then closes it, which its peer sees as a disconnect).
    Counts what it did in :attr:`stats`."""

    def __init__(self, inner: Transport, faults: MessageFaults | None = None, seed: int = 0):
        self.inner = inner
        self.faults = faults or MessageFaults()
        self.random = random.Random(seed)
        self.stats = {"sent": 0, "dropped": 0, "duplicated": 0, "delayed": 0, "cut": 0}
        self._dealers: set[_FaultyDealer] = set()

    def open_router(
        self, host: str, port: int = 0, *, liveness: Liveness | None = None
    ) -> AbstractAsyncContextManager[Router]:
        return self._wrap_router(host, port, liveness)

    @asynccontextmanager
    async def _wrap_router(
        self, host: str, port: int, liveness: Liveness | None
    ) -> AsyncIterator[Router]:
        async with (
            self.inner.open_router(host, port, liveness=liveness) as router,
            trio.open_nursery() as nursery,
        ):
            try:
                yield _FaultyRouter(router, self, nursery)
            finally:
                nursery.cancel_scope.cancel()  # messages still delayed are lost with the router

    def open_dealer(
        self, address: str, *, liveness: Liveness | None = None, server_key: str = ""
    ) -> AbstractAsyncContextManager[Dealer]:
        return self._wrap_dealer(address, liveness, server_key)

    @asynccontextmanager
    async def _wrap_dealer(
        self, address: str, liveness: Liveness | None, server_key: str
    ) -> AsyncIterator[Dealer]:
        inner = self.inner.open_dealer(address, liveness=liveness, server_key=server_key)
        async with inner as dealer:
            wrapped = _FaultyDealer(dealer, self)
            self._dealers.add(wrapped)
            try:
                yield wrapped
            finally:
                self._dealers.discard(wrapped)

    @property
    def open_dealers(self) -> int:
        """How many dealers (D's connections to P workers) are open through this transport."""
        return len(self._dealers)

    def cut(self, reason: str = "link cut by the fault injector") -> int:
        """Every open dealer's connection is lost now; returns how many."""
        for dealer in self._dealers:
            dealer.cut.set()
            dealer.cut_reason = reason
        self.stats["cut"] += len(self._dealers)
        return len(self._dealers)

    async def _deliver(self, send: Callable[[], Awaitable[None]]) -> None:
        f, rnd, stats = self.faults, self.random, self.stats
        stats["sent"] += 1
        if rnd.random() < f.drop:
            stats["dropped"] += 1
            await trio.lowlevel.checkpoint()
            return
        if rnd.random() < f.delay:
            stats["delayed"] += 1
            await trio.sleep(f.delay_seconds)
        await send()
        if rnd.random() < f.duplicate:
            stats["duplicated"] += 1
            await send()


#: A message sent later: its delay, how many copies, its frames.
_Later = tuple[float, int, Sequence[bytes]]


class _FaultyRouter:
    def __init__(self, inner: Router, owner: FaultyTransport, nursery: trio.Nursery) -> None:
        self._inner, self._owner, self._nursery = inner, owner, nursery
        self._later: dict[bytes, deque[_Later]] = {}  # per peer: messages sent by a task
        self.lost_peers = inner.lost_peers
        self.curve_key = inner.curve_key

    @property
    def address(self) -> str:
        return self._inner.address

    async def receive(self) -> tuple[bytes, list[bytes]]:
        return await self._inner.receive()

    async def send(self, identity: bytes, frames: Sequence[bytes]) -> None:
        await self._owner._deliver(lambda: self._inner.send(identity, frames))

    def send_nowait(self, identity: bytes, frames: Sequence[bytes]) -> bool:
        """Drops, delays and duplicates as :meth:`send` does, in order per peer: a delayed
        message, and every later one to that peer, is sent by a task of the peer's own."""
        f, rnd, stats = self._owner.faults, self._owner.random, self._owner.stats
        stats["sent"] += 1
        if rnd.random() < f.drop:
            stats["dropped"] += 1
            return True
        delay = f.delay_seconds if rnd.random() < f.delay else 0.0
        copies = 2 if rnd.random() < f.duplicate else 1
        stats["delayed"] += delay > 0
        stats["duplicated"] += copies - 1
        later = self._later.get(identity)
        if delay or later is not None:
            if later is None:
                later = self._later[identity] = deque()
                self._nursery.start_soon(self._send_later, identity, later)
            later.append((delay, copies, frames))
            return True
        sent = self._inner.send_nowait(identity, frames)
        if sent and copies > 1:
            self._inner.send_nowait(identity, frames)
        return sent

    async def _send_later(self, identity: bytes, later: deque[_Later]) -> None:
        try:
            while later:
                delay, copies, frames = later.popleft()
                await trio.sleep(delay)
                for _ in range(copies):
                    with contextlib.suppress(PeerUnreachable, trio.ClosedResourceError):
                        await self._inner.send(identity, frames)
        finally:
            del self._later[identity]


class _FaultyDealer:
    def __init__(self, inner: Dealer, owner: FaultyTransport) -> None:
        self._inner, self._owner = inner, owner
        self.cut = trio.Event()
        self.cut_reason = ""

    @property
    def address(self) -> str:
        return self._inner.address

    async def receive(self) -> list[bytes]:
        return await self._inner.receive()

    async def send(self, frames: Sequence[bytes]) -> None:
        await self._owner._deliver(lambda: self._inner.send(frames))

    async def wait_dead(self) -> str:  # a cut link is no dead peer
        return await self._inner.wait_dead()

    async def wait_lost(self, connect_timeout: float) -> str:
        async with trio.open_nursery() as nursery:
            reason = ""

            async def lost() -> None:
                nonlocal reason
                reason = await self._inner.wait_lost(connect_timeout)
                nursery.cancel_scope.cancel()

            nursery.start_soon(lost)
            await self.cut.wait()
            reason = self.cut_reason
            nursery.cancel_scope.cancel()
        return reason
