"""The side channel's ZMQ sockets: a ROUTER (P) that learns which identities each connection
carries, and a DEALER (D) that knows when its peer is up and when it is lost; and a SUB for
what engines publish (the proxy's KV event feeds). Opened by
:func:`~pdactors.transport.zmq.open_router` / :func:`~pdactors.transport.zmq.open_dealer` /
:func:`~pdactors.transport.zmq.open_subscriber`, which also explain liveness."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial

import trio
import zmq

from pdactors._pulse import Pulse
from pdactors.errors import PdError
from pdactors.transport._socket import (
    _EV_ACCEPTED,
    _EV_CONNECTED,
    _EV_DELAYED,
    _EV_DISCONNECTED,
    _EV_HANDSHAKE_FAILED,
    _EV_RETRIED,
    _EV_UP,
    _NOBLOCK,
    _RCVMORE,
    _SRCFD,
    _checked,
    _Monitor,
    _TrioSocket,
)

__all__ = ["DealerSocket", "PeerUnreachable", "RouterSocket", "SubSocket", "TransportError"]

_MAX_FRAMES = 8  #: frames kept of a received message (beyond the identity); more are dropped
#: A connection attempt that fails without a TCP connection within this many seconds was
#: refused (nothing listens there); a host that does not answer at all fails only at the
#: system's connect timeout (minutes), and is not taken for dead.
REFUSED_WITHIN = 1.0


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
        self._dead: str | None = None
        self._tcp = False  # the current connection attempt got a TCP connection
        self._attempt = trio.current_time()  # when the current connection attempt began
        self._changed = Pulse()

    async def _follow(self, monitor: _Monitor) -> None:
        """Run by :func:`open_dealer` with liveness on: connection events → up / lost / dead.
        Followed as long as the socket is open (ZMQ reconnects after a loss), or until dead."""
        while self._dead is None:
            event, _ = await monitor.receive()
            if event == _EV_DELAYED:
                self._attempt = trio.current_time()
            elif event == _EV_CONNECTED:
                self._tcp = True
            elif event == _EV_RETRIED:
                if not self._tcp and trio.current_time() - self._attempt < REFUSED_WITHIN:
                    self._dead = f"{self.address} refuses connections: nothing listens there"
                    self._changed.fire()
                self._tcp, self._attempt = False, trio.current_time()
            if self._lost is not None:
                continue
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

    async def wait_dead(self) -> str:
        """Wait until a connection attempt is refused at once (no TCP connection: nothing
        listens at the address, so the peer's process, or at least its socket, is gone), and
        say so. A peer that is stopped, hung, or behind a network that drops packets keeps or
        seems to keep its listening socket: this waits on while ZMQ reconnects (a host that
        does not answer at all is not taken for dead). Needs liveness on
        (:func:`open_dealer`); without it, waits forever. Checkpoint."""
        while self._dead is None:
            await self._changed.wait()
        await trio.lowlevel.checkpoint()
        return self._dead

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


class SubSocket(_TrioSocket):
    """A connected SUB socket (someone else's PUB: vLLM's KV events). Make one with
    :func:`~pdactors.transport.zmq.open_subscriber`."""

    def __init__(self, socket: zmq.Socket[bytes], address: str) -> None:
        super().__init__(socket)
        self.address = address

    async def receive(self) -> list[bytes]:
        """Wait for the next published message and return its frames. A checkpoint;
        cancelled, it has received nothing."""
        return await self._io(self._receive, self._receive_now)
