"""trio ⇄ ZMQ: ROUTER and DEALER sockets whose ``send`` and ``receive`` are trio checkpoints.

Usage::

    async with open_router("127.0.0.1", port=0) as router:   # router.address: "tcp://127.0.0.1:<port>"
        identity, frames = await router.receive()
        await router.send(identity, [b"a", b"b"])
    async with open_dealer(router.address) as dealer:
        await dealer.send([b"a", b"b"])
        frames = await dealer.receive()

Why not zmq-anyio: measured here it is 2-3x slower per round trip, and a receive cancelled
while waiting leaves its future queued, which then swallows the next message. The numbers are in
docs/architecture.md ("trio ⇄ ZMQ transport").

How a call waits — the edge-triggered ``zmq.FD``, the watcher task, turns — is in
:mod:`pdactors.transport._socket`; the two socket classes are in
:mod:`pdactors.transport._zmq_sockets`; this module opens them.

Liveness
--------
With a :class:`~pdactors.config.Liveness`, both ends exchange ZMQ heartbeats (``HEARTBEAT_IVL``
/ ``HEARTBEAT_TIMEOUT`` / ``HEARTBEAT_TTL``), answered by libzmq's I/O thread, so a peer that is
merely busy (its Python thread holding the GIL) still answers, while a dead, stopped or cut-off
one is disconnected within about ``heartbeat_timeout``. A socket monitor (a PAIR socket over
inproc, driven like the others) turns ZMQ's connection events into knowledge:

* a DEALER is *up* after ``HANDSHAKE_SUCCEEDED`` and *lost* at the first ``DISCONNECTED`` or
  failed handshake, at a ``CONNECT_RETRIED`` before it was ever up (refused), or when it was
  never up within ``connect_timeout``
  (:meth:`DealerSocket.wait_lost`);
* a ROUTER learns each peer's connection (its fd, ``zmq.SRCFD`` of the message) from the
  messages it receives, and reports the identities of a connection that ends
  (``DISCONNECTED``, fd) on :attr:`RouterSocket.lost_peers`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import trio
import zmq

from pdactors.config import Liveness
from pdactors.transport._socket import (
    _close_now,
    _Monitor,
    _monitor,
    _new_socket,
    _TrioSocket,
)
from pdactors.transport._zmq_sockets import (
    DealerSocket,
    PeerUnreachable,
    RouterSocket,
    SubSocket,
    TransportError,
)
from pdactors.transport.curve import (
    Curve,
    UntrustedServer,
    connect_curve,
    serve_curve,
    stop_curve,
)

__all__ = [
    "DEFAULT_HWM",
    "DealerSocket",
    "PeerUnreachable",
    "RouterSocket",
    "SubSocket",
    "TransportError",
    "open_dealer",
    "open_router",
    "open_subscriber",
]

#: Messages queued per peer and direction before a send waits. The control plane has thousands of
#: small messages in flight at most; the bound only matters when a peer stops reading.
DEFAULT_HWM = 100_000

_S = TypeVar("_S", bound=_TrioSocket)
#: A socket's reading of its monitor's connection events (``RouterSocket._follow``...).
_Follow = Callable[[_Monitor], Awaitable[None]]


@asynccontextmanager
async def _watched(
    socket: _S, monitor: _Monitor | None = None, follow: _Follow | None = None
) -> AsyncIterator[_S]:
    """``socket`` driven for the block: its fd watched, and with a ``monitor`` its connection
    events read by ``follow``; closed (with the monitor) on leaving."""
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(socket._watch_fd)
            if monitor is not None and follow is not None:
                nursery.start_soon(monitor._watch_fd)
                nursery.start_soon(_follow_until_closed, follow, monitor)
            try:
                yield socket
            finally:
                if monitor is not None:
                    socket._socket.disable_monitor()
                    monitor.close()
                socket.close()  # also ends the watchers, so that the nursery can exit
    finally:
        if monitor is not None:
            monitor.close()


async def _follow_until_closed(follow: _Follow, monitor: _Monitor) -> None:
    try:
        await follow(monitor)
    except trio.ClosedResourceError:
        return


@asynccontextmanager
async def open_router(
    host: str,
    port: int = 0,
    *,
    context: zmq.Context[Any] | None = None,
    hwm: int = DEFAULT_HWM,
    liveness: Liveness | None = None,
    curve: Curve | None = None,
    max_message: int = -1,
    send_hwm: int | None = None,
    send_buffer: int = -1,
) -> AsyncIterator[RouterSocket]:
    """Bind a ROUTER socket on ``tcp://host:port`` (port 0: any free port) for the block.

    ``context`` defaults to the process-wide ``zmq.Context.instance()``; ``hwm`` is the queue
    bound per peer and direction (0: none); ``liveness`` turns on heartbeats and
    :attr:`RouterSocket.lost_peers`; ``curve`` makes it a CURVE server that lets in only the
    D keys it names (:mod:`pdactors.transport.curve`); ``max_message``: ZMQ's ``MAXMSGSIZE``,
    the longest frame a peer may send before its connection is dropped (-1: no bound);
    ``send_hwm`` / ``send_buffer``: the queue bound per peer towards it (default ``hwm``) and
    the kernel's send buffer per connection (-1: the system's), which together say how much a
    peer that stops reading can leave queued before :meth:`RouterSocket.send_nowait` refuses.
    Leaving the block closes the socket (linger 0). Raises ``zmq.ZMQError`` if the address
    cannot be bound.
    """
    socket = _new_socket(context, zmq.ROUTER, hwm, liveness, max_message)
    socket.setsockopt(zmq.SNDHWM, hwm if send_hwm is None else send_hwm)
    socket.setsockopt(zmq.SNDBUF, send_buffer)
    monitor = None
    domain: str | None = None
    try:
        if curve is not None:
            domain = serve_curve(socket, curve)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        monitor = _monitor(socket) if liveness is not None else None
        socket.bind(f"tcp://{host}:{port}")
        address = socket.getsockopt_string(zmq.LAST_ENDPOINT)
    except BaseException:
        _close_now(socket, monitor)
        if domain is not None:
            stop_curve(socket.context, domain)
        raise
    try:
        router_socket = RouterSocket(socket, address, curve.public if curve else "")
        async with _watched(router_socket, monitor, router_socket._follow) as router:
            yield router
    finally:
        if domain is not None:
            stop_curve(socket.context, domain)


@asynccontextmanager
async def open_dealer(
    address: str,
    *,
    context: zmq.Context[Any] | None = None,
    hwm: int = DEFAULT_HWM,
    liveness: Liveness | None = None,
    curve: Curve | None = None,
    server_key: str = "",
    max_message: int = -1,
) -> AsyncIterator[DealerSocket]:
    """Connect a DEALER socket to ``address`` (``"tcp://host:port"``) for the block.

    The connection is made (and remade) in the background; sends queue until it is up.
    ``context``, ``hwm``, ``liveness`` and ``max_message`` are as for :func:`open_router`
    (with liveness, :meth:`DealerSocket.wait_lost` tells when the peer is gone); ``curve``
    makes it a CURVE client that demands of P the key ``server_key`` (the key P registered;
    "": the one key ``curve`` trusts) — a P without that key fails the handshake: lost at
    once. Leaving the block closes the socket (linger 0). Raises :class:`TransportError` if
    the address is malformed or cannot be resolved, or if P registered a key ``curve`` does
    not trust.
    """
    if curve is None and server_key:
        raise TransportError(f"P worker {address} speaks CURVE (it registered a key) "
                             "and this D has no side-channel keys")  # fmt: skip
    try:
        demanded = curve.server_key(server_key, address) if curve is not None else ""
    except UntrustedServer as exc:
        raise TransportError(str(exc)) from None
    socket = _new_socket(context, zmq.DEALER, hwm, liveness, max_message)
    monitor = None
    try:
        if curve is not None:
            connect_curve(socket, curve, demanded)
        monitor = _monitor(socket) if liveness is not None else None
        socket.connect(address)
    except zmq.ZMQError as exc:
        _close_now(socket, monitor)
        raise TransportError(f"cannot connect to {address!r}: {exc}") from None
    except BaseException:
        _close_now(socket, monitor)
        raise
    dealer_socket = DealerSocket(socket, address)
    async with _watched(dealer_socket, monitor, dealer_socket._follow) as dealer:
        yield dealer


@asynccontextmanager
async def open_subscriber(
    address: str,
    *,
    topic: bytes = b"",
    context: zmq.Context[Any] | None = None,
    hwm: int = DEFAULT_HWM,
) -> AsyncIterator[SubSocket]:
    """Connect a SUB socket to a publisher at ``address``, subscribed to ``topic`` (b"":
    every message), for the block. ZMQ connects and reconnects in the background; what is
    published while no connection is up is lost (the publisher's replay, where it has one,
    fills the gap). Raises :class:`TransportError` if the address is malformed."""
    socket = _new_socket(context, zmq.SUB, hwm, None)
    try:
        socket.setsockopt(zmq.SUBSCRIBE, topic)
        socket.connect(address)
    except zmq.ZMQError as exc:
        _close_now(socket, None)
        raise TransportError(f"cannot connect to {address!r}: {exc}") from None
    except BaseException:
        _close_now(socket, None)
        raise
    async with _watched(SubSocket(socket, address)) as sub:
        yield sub
