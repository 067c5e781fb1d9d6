"""The transport seam: what the sender and receiver actors need of their side channel.

:data:`ZMQ` (real ROUTER/DEALER sockets, :mod:`pdactors.transport.zmq`) is the default;
:class:`~pdactors.transport.memory.MemoryTransport` runs actors in one trio run with no sockets
(tests under the autojump clock); :class:`~pdactors.testing.faults.FaultyTransport` wraps either
to drop, delay, duplicate messages and cut connections.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import Protocol

import trio

from pdactors.config import Liveness
from pdactors.transport.curve import Curve, CurveError
from pdactors.wire import MAX_FRAME_BYTES

__all__ = ["ZMQ", "Dealer", "Router", "Transport", "ZmqTransport"]


class Router(Protocol):
    """P's side channel: messages from many D workers, each known by an identity."""

    @property
    def address(self) -> str: ...

    #: The router's CURVE public key, registered with P's bootstrap entry ("" without CURVE).
    curve_key: str

    #: Identities whose connection ended (closed, died, silent past the heartbeat timeout).
    lost_peers: trio.MemoryReceiveChannel[bytes]

    async def receive(self) -> tuple[bytes, list[bytes]]: ...

    async def send(self, identity: bytes, frames: Sequence[bytes]) -> None:
        """Raises :class:`~pdactors.transport.PeerUnreachable` for an identity not connected."""
        ...

    def send_nowait(self, identity: bytes, frames: Sequence[bytes]) -> bool:
        """Send if that peer's queue has room; whether it did. Raises as :meth:`send`."""
        ...


class Dealer(Protocol):
    """D's connection to one P worker."""

    @property
    def address(self) -> str: ...

    async def receive(self) -> list[bytes]: ...

    async def send(self, frames: Sequence[bytes]) -> None: ...

    async def wait_lost(self, connect_timeout: float) -> str:
        """Wait until the peer is known to be gone; say why."""
        ...

    async def wait_dead(self) -> str:
        """Wait until the peer is known to be dead, not merely silent, stopped or cut off:
        a reconnect is refused at once (nothing listens at its address any more); say why."""
        ...


class Transport(Protocol):
    def open_router(
        self, host: str, port: int = 0, *, liveness: Liveness | None = None
    ) -> AbstractAsyncContextManager[Router]:
        """Bind a router for the block. Raises ``OSError``-like errors if it cannot bind."""
        ...

    def open_dealer(
        self, address: str, *, liveness: Liveness | None = None, server_key: str = ""
    ) -> AbstractAsyncContextManager[Dealer]:
        """Connect a dealer for the block; ``server_key`` is the CURVE key the P worker there
        registered (""; none). Raises :class:`~pdactors.transport.TransportError` for a
        malformed address or a key this transport does not trust."""
        ...


#: Replies queued in ZMQ per D worker, and the kernel's send buffer per connection: a D reads
#: its side channel in ZMQ's I/O thread (busy Python or not), so only a peer that stops
#: reading fills them; P's outbox then cuts it off (:mod:`pdactors.actors._outbox`).
SEND_HWM = 1024
SEND_BUFFER = 1 << 20


class ZmqTransport:
    """The real side channel: :func:`~pdactors.transport.zmq.open_router` /
    :func:`~pdactors.transport.zmq.open_dealer` on the process-wide ZMQ context.

    With ``server`` / ``client`` CURVE keys (:mod:`pdactors.transport.curve`), routers are
    CURVE servers and dealers CURVE clients: ``ZmqTransport(*curve_from_secret(secret))``
    secures both roles of a process that knows the deployment secret. A peer that sends a
    frame longer than :data:`~pdactors.wire.MAX_FRAME_BYTES` is disconnected; a router
    queues at most :data:`SEND_HWM` messages and :data:`SEND_BUFFER` bytes per peer.
    """

    def __init__(self, server: Curve | None = None, client: Curve | None = None) -> None:
        self.server, self.client = server, client

    def open_router(
        self, host: str, port: int = 0, *, liveness: Liveness | None = None
    ) -> AbstractAsyncContextManager[Router]:
        from pdactors.transport.zmq import open_router

        if self.client is not None and self.server is None:
            raise CurveError("this transport has CURVE keys for D only; P needs server keys")
        return open_router(
            host,
            port,
            liveness=liveness,
            curve=self.server,
            max_message=MAX_FRAME_BYTES,
            send_hwm=SEND_HWM,
            send_buffer=SEND_BUFFER,
        )

    def open_dealer(
        self, address: str, *, liveness: Liveness | None = None, server_key: str = ""
    ) -> AbstractAsyncContextManager[Dealer]:
        from pdactors.transport.zmq import open_dealer

        if self.server is not None and self.client is None:
            raise CurveError("this transport has CURVE keys for P only; D needs client keys")
        return open_dealer(
            address,
            liveness=liveness,
            curve=self.client,
            server_key=server_key,
            max_message=MAX_FRAME_BYTES,
        )


#: The default transport of the actors.
ZMQ: Transport = ZmqTransport()
