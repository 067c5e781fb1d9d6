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
:mod:`pdactors.transport._socket`.

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

import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, TypeVar

import trio
import zmq

from pdactors._pulse import Pulse
from pdactors.config import Liveness
from pdactors.errors import PdError
from pdactors.transport._socket import (
    _EV_ACCEPTED,
    _EV_DISCONNECTED,
    _EV_HANDSHAKE_FAILED,
    _EV_RETRIED,
    _EV_UP,
    _NOBLOCK,
    _RCVMORE,
    _SRCFD,
    _checked,
    _close_now,
    _Monitor,
    _monitor,
    _new_socket,
    _TrioSocket,
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
    "TransportError",
    "open_dealer",
    "open_router",
]

#: Messages queued per peer and direction before a send waits. The control plane has thousands of
#: small messages in flight at most; the bound only matters when a peer stops reading.
DEFAULT_HWM = 100_000
_MAX_FRAMES = 8  #: frames kept of a received message (beyond the identity); more are dropped


class TransportError(PdError):
    """The side channel could not be opened or used (bad address, socket error)."""


class PeerUnreachable(TransportError):
    """A ROUTER was asked to send to an identity that is not (or no longer) connected."""

    def __init__(self, identity: bytes) -> None:
        self.identity = identity
        super().__init__(f"no connected peer with identity {identity!r}")


class RouterSocket(_TrioSocket):
    """A bound ROUTER socket (ROUTER_MANDATORY set). Make one with :func:`open_router`.

    With liveness on, :attr:`lost_peers` yields each identity whose connection ended (the peer
    closed it, died, or stopped answering heartbeats), once per connection. :attr:`curve_key`
    is its CURVE public key ("" without CURVE), which P registers for D to check.
    """

    def __init__(self, socket: zmq.Socket[bytes], address: str, curve_key: str = "") -> None:
        super().__init__(socket)
        self._address = address
        self.curve_key = curve_key
        self._monitor: _Monitor | None = None
        self._fd_of: dict[bytes, int] = {}  # identity -> the connection it last spoke on
        self._on_fd: dict[int, set[bytes]] = {}
        self._live_fds: set[int] = set()
        self._lost_send, self.lost_peers = trio.open_memory_channel[bytes](math.inf)

    async def _follow(self, monitor: _Monitor) -> None:
        """Run by :func:`open_router` with liveness on: connection events → :attr:`lost_peers`."""
        self._monitor = monitor
        while True:
            self._on_event(*await monitor.receive())

    def _on_event(self, event: int, fd: int) -> None:
        if event == _EV_ACCEPTED:
            self._live_fds.add(fd)
        elif event == _EV_DISCONNECTED:
            self._live_fds.discard(fd)
            for identity in self._on_fd.pop(fd, ()):
                del self._fd_of[identity]
                self._lost_send.send_nowait(identity)

    def _note(self, identity: bytes, fd: int) -> None:
        if self._fd_of.get(identity) == fd:
            return
        if fd not in self._live_fds and self._monitor is not None:
            # Its ACCEPTED event (and the DISCONNECTED of an earlier connection on the same fd
            # number) came before this message: read them first, so they are not misapplied.
            for event in self._monitor.receive_nowait():
                self._on_event(*event)
        old = self._fd_of.get(identity)
        if old is not None:
            self._on_fd[old].discard(identity)
        self._fd_of[identity] = fd
        self._on_fd.setdefault(fd, set()).add(identity)

    def _receive_routed(self) -> list[bytes]:
        first = self._socket.recv(_NOBLOCK, copy=False)
        frames = [first.bytes]
        while self._socket.getsockopt(_RCVMORE):
            frame = self._socket.recv(_NOBLOCK)
            if len(frames) <= _MAX_FRAMES:  # a peer's thousand-part message is kept short
                frames.append(frame)
        if self._monitor is not None:
            self._note(frames[0], first.get(_SRCFD))
        return frames

    @property
    def address(self) -> str:
        """The endpoint peers connect to, with the real port: ``"tcp://127.0.0.1:5555"``."""
        return self._address

    async def receive(self) -> tuple[bytes, list[bytes]]:
        """Wait for the next message; return the sender's identity and the message's frames.

        A checkpoint. Cancelled, it has received nothing. Raises :class:`trio.ClosedResourceError`
        if the socket is or gets closed.
        """
        identity, *frames = await self._io(self._receive, self._receive_routed)
        return identity, frames

    async def send(self, identity: bytes, frames: Sequence[bytes]) -> None:
        """Send ``frames`` as one message to the peer ``identity``.

        A checkpoint. Waits while that peer's queue is full (at the high water mark); cancelled,
        it has sent nothing. Raises :class:`PeerUnreachable` if no peer with that identity is
        connected, :class:`ValueError` if ``frames`` is empty, :class:`TypeError` if a frame is
        not bytes-like, and :class:`trio.ClosedResourceError` if the socket is or gets closed.
        """
        if not frames:
            raise ValueError("a message needs at least one frame")
        message = _checked([identity, *frames])
        await self._io(self._send, partial(self._send_to, message))

    def send_nowait(self, identity: bytes, frames: Sequence[bytes]) -> bool:
        """Send ``frames`` to ``identity`` if that peer's queue has room; whether it did
        (False: nothing was sent). Not a checkpoint. Raises as :meth:`send` does."""
        if self._closed:
            raise trio.ClosedResourceError("the ZMQ socket was closed")
        message = _checked([identity, *frames])
        try:
            self._send_to(message)
        except zmq.Again:
            return False
        finally:
            if self._send.wakeup or self._receive.wakeup:
                self._poll_events()  # this touch may have taken a sleeper's fd signal
        return True

    def _send_to(self, message: Sequence[bytes]) -> None:
        try:
            self._send_now(message)
        except zmq.Again:
            raise
        except zmq.ZMQError as error:
            if error.errno == zmq.EHOSTUNREACH:
                raise PeerUnreachable(message[0]) from None
            raise


class DealerSocket(_TrioSocket):
    """A connected DEALER socket. Make one with :func:`open_dealer`."""

    def __init__(self, socket: zmq.Socket[bytes], address: str) -> None:
        super().__init__(socket)
        self.address = address
        self._up = False
        self._lost: str | None = None
        self._changed = Pulse()

    async def _follow(self, monitor: _Monitor) -> None:
        """Run by :func:`open_dealer` with liveness on: connection events → up / lost."""
        while self._lost is None:
            event, _ = await monitor.receive()
            if event == _EV_UP:
                self._up = True
            elif event == _EV_DISCONNECTED and self._up:
                self._lost = f"side channel to {self.address} lost (peer died or hung)"
            elif event == _EV_RETRIED and not self._up:
                self._lost = f"connection to {self.address} refused or failed"
            elif event & _EV_HANDSHAKE_FAILED:
                self._lost = f"handshake with {self.address} failed"
            else:
                continue
            self._changed.fire()

    async def wait_lost(self, connect_timeout: float) -> str:
        """Wait until the peer is known to be gone, and say why. Checkpoint.

        Gone means: the connection was up and then dropped (closed, reset, or silent past the
        heartbeat timeout), the first connection attempt failed (nothing listens there), a
        handshake failed, or no connection came up within ``connect_timeout`` seconds of
        opening (a peer that accepts TCP but never speaks: stopped, or not ZMQ). Needs
        liveness on (:func:`open_dealer`); without it, waits forever.
        """
        with trio.move_on_after(connect_timeout):
            while not self._up and self._lost is None:
                await self._changed.wait()
        if not self._up and self._lost is None:
            return f"no connection to {self.address} within {connect_timeout:g} s"
        while self._lost is None:
            await self._changed.wait()
        return self._lost

    async def receive(self) -> list[bytes]:
        """Wait for the next message and return its frames.

        A checkpoint. Cancelled, it has received nothing. Raises :class:`trio.ClosedResourceError`
        if the socket is or gets closed.
        """
        return await self._io(self._receive, self._receive_now)

    async def send(self, frames: Sequence[bytes]) -> None:
        """Send ``frames`` as one message.

        A checkpoint. Until the connection is up, messages queue (up to the high water mark);
        beyond it the call waits, and cancelled, it has sent nothing. Raises :class:`ValueError`
        if ``frames`` is empty, :class:`TypeError` if a frame is not bytes-like, and
        :class:`trio.ClosedResourceError` if the socket is or gets closed.
        """
        await self._io(self._send, partial(self._send_now, _checked(frames)))


_S = TypeVar("_S", bound="RouterSocket | DealerSocket")


@asynccontextmanager
async def _watched(socket: _S, monitor: _Monitor | None) -> AsyncIterator[_S]:
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(socket._watch_fd)
            if monitor is not None:
                nursery.start_soon(monitor._watch_fd)
                nursery.start_soon(_follow_until_closed, socket, monitor)
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


async def _follow_until_closed(socket: RouterSocket | DealerSocket, monitor: _Monitor) -> None:
    try:
        await socket._follow(monitor)
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
        async with _watched(router_socket, monitor) as router:
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
    async with _watched(DealerSocket(socket, address), monitor) as dealer:
        yield dealer
