"""An in-memory transport: routers and dealers of one trio run, joined by memory channels.

Behaves like the ZMQ side channel where the actors can tell: messages arrive whole and in order
per connection, a send to an identity that is not connected raises
:class:`~pdactors.transport.PeerUnreachable`, a closed router is a lost peer to its dealers
(``wait_lost`` returns) and a dead one (``wait_dead``; a cut link is not), a closed dealer is
a lost peer to its router (``lost_peers``), and an address nobody binds is refused (dead).
There are no sockets and no threads, so actor tests run under trio's autojump clock. Addresses
look like ZMQ's (``tcp://host:port``, so the bootstrap takes them) but name no socket: ports
are counted from 1 and only this transport can dial them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import trio

from pdactors._pulse import Pulse
from pdactors.config import Liveness
from pdactors.transport.zmq import PeerUnreachable, TransportError

__all__ = ["MemoryTransport"]


class _MemoryDealer:
    def __init__(self, address: str, identity: bytes) -> None:
        self.address = address
        self.identity = identity
        self.inbox_send, self._inbox = trio.open_memory_channel[list[bytes]](math.inf)
        self.router: _MemoryRouter | None = None
        self.unreachable = False  # dialled across a partition: no handshake will come
        self.lost: str | None = None
        self.dead: str | None = None  # no router at its address any more (closed, refused)
        self._changed = Pulse()

    def lose(self, reason: str, *, dead: bool = False) -> None:
        if dead and self.dead is None:
            self.dead = reason
            self._changed.fire()
        if self.lost is None:
            self.lost = reason
            self._changed.fire()

    async def receive(self) -> list[bytes]:
        return await self._inbox.receive()

    async def send(self, frames: Sequence[bytes]) -> None:
        await trio.lowlevel.checkpoint()
        if self.lost is None and self.router is not None:
            self.router.inbox_send.send_nowait((self.identity, list(frames)))
        # like ZMQ: a message to a peer that is gone is dropped, not an error

    async def wait_lost(self, connect_timeout: float) -> str:
        if self.unreachable and self.lost is None:
            await trio.sleep(connect_timeout)
            self.lose(f"no handshake from {self.address} within {connect_timeout:g} s")
        while self.lost is None:
            await self._changed.wait()
        return self.lost

    async def wait_dead(self) -> str:
        """Wait until the router is closed, or was not there (a cut is no death)."""
        while self.dead is None:
            await self._changed.wait()
        return self.dead


class _MemoryRouter:
    def __init__(self, address: str) -> None:
        self._address = address
        self.inbox_send, self._inbox = trio.open_memory_channel[tuple[bytes, list[bytes]]](math.inf)
        self._lost_send, self.lost_peers = trio.open_memory_channel[bytes](math.inf)
        self.dealers: dict[bytes, _MemoryDealer] = {}
        self.curve_key = ""  # no CURVE in memory

    @property
    def address(self) -> str:
        return self._address

    async def receive(self) -> tuple[bytes, list[bytes]]:
        return await self._inbox.receive()

    async def send(self, identity: bytes, frames: Sequence[bytes]) -> None:
        await trio.lowlevel.checkpoint()
        dealer = self.dealers.get(identity)
        if dealer is None:
            raise PeerUnreachable(identity)
        dealer.inbox_send.send_nowait(list(frames))

    def send_nowait(self, identity: bytes, frames: Sequence[bytes]) -> bool:
        dealer = self.dealers.get(identity)
        if dealer is None:
            raise PeerUnreachable(identity)
        dealer.inbox_send.send_nowait(list(frames))  # a dealer's inbox has no bound
        return True

    def drop(self, dealer: _MemoryDealer) -> None:
        if self.dealers.pop(dealer.identity, None) is not None:
            self._lost_send.send_nowait(dealer.identity)


class MemoryTransport:
    """One in-memory "network": every router and dealer opened through it can reach the others.

    :meth:`cut` drops every connection to a router now (as a dead or cut-off peer would);
    :meth:`partition` also keeps every new one from reaching it (a dealer opened across it
    hears nothing, and is lost once its ``connect_timeout`` passes) until :meth:`heal`.
    """

    def __init__(self) -> None:
        self._routers: dict[str, _MemoryRouter] = {}
        self._partitioned: set[str] = set()
        self._ports = itertools.count(1)
        self._identities = itertools.count(1)

    @asynccontextmanager
    async def open_router(
        self, host: str, port: int = 0, *, liveness: Liveness | None = None
    ) -> AsyncIterator[_MemoryRouter]:
        address = f"tcp://{host}:{port or next(self._ports)}"
        if address in self._routers:
            raise OSError(f"{address} is already bound")
        router = self._routers[address] = _MemoryRouter(address)
        try:
            yield router
        finally:
            del self._routers[address]
            for dealer in list(router.dealers.values()):
                dealer.lose(f"side channel to {address} lost (closed)", dead=True)
            router.dealers.clear()

    @asynccontextmanager
    async def open_dealer(
        self, address: str, *, liveness: Liveness | None = None, server_key: str = ""
    ) -> AsyncIterator[_MemoryDealer]:
        if not address.startswith("tcp://") or ":" not in address[6:]:
            raise TransportError(f"cannot connect to {address!r}: not a tcp://host:port address")
        dealer = _MemoryDealer(address, next(self._identities).to_bytes(4, "big"))
        router = self._routers.get(address)
        if address in self._partitioned:
            dealer.unreachable, router = True, None
        elif router is None:
            dealer.lose(f"connection to {address} refused or failed", dead=True)
        else:
            dealer.router = router
            router.dealers[dealer.identity] = dealer
        try:
            yield dealer
        finally:
            dealer.lose("closed")
            if router is not None:
                router.drop(dealer)

    def cut(self, address: str, reason: str = "connection cut") -> int:
        """Drop every dealer's connection to the router at ``address``; returns how many."""
        router = self._routers.get(address)
        if router is None:
            return 0
        dealers = list(router.dealers.values())
        for dealer in dealers:
            dealer.lose(f"side channel to {address} lost ({reason})")
            router.drop(dealer)
        return len(dealers)

    def partition(self, address: str) -> int:
        """Cut the router at ``address`` off until :meth:`heal`: its connections are dropped
        now (:meth:`cut`) and none made meanwhile reaches it; returns how many were dropped."""
        self._partitioned.add(address)
        return self.cut(address, "partitioned")

    def heal(self, address: str) -> None:
        """The router at ``address`` is reachable again (for connections made from now on)."""
        self._partitioned.discard(address)
