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

How a call waits
----------------
Every call first tries the operation with ``zmq.NOBLOCK``. Sending and receiving a multipart
message are all-or-nothing with NOBLOCK: ZMQ refuses a message only at its first frame (the high
water mark counts whole messages) and makes a message readable only once all its frames are in,
so a call that gives up has done nothing, and one that returns has done everything.

On ``zmq.Again`` the task must sleep until the socket's state changes. The only signal is
``zmq.FD``, which is edge-triggered: it is readable while ZMQ has unprocessed internal commands,
and *any* touch of the socket (send, recv, reading ``zmq.EVENTS``) may process them and clear it,
whichever task does it. So:

1. One watcher task per socket waits on ``zmq.FD`` (trio allows one waiter per fd); when it
   fires, the watcher reads ``zmq.EVENTS`` and wakes the sleepers whose flag is set. Sleepers
   park in a ParkingLot per direction: waking a parked task is cheap, while waking a task out
   of ``wait_readable`` takes cancelling its scope, which cost 30% of the throughput here.
2. A failed attempt may itself have consumed the signal the *other* direction's sleeper waits
   for, so before sleeping a task reads ``zmq.EVENTS`` too (waking the other sleeper if its flag
   is set), and retries at once if its own flag is set. A ROUTER with ROUTER_MANDATORY reports
   POLLOUT when *any* peer has room, so that retry can fail again; the second failure sleeps.
3. A touch by a running task can consume the fd signal a sleeper waits for; the watcher will not
   see it. So after each successful operation, while anyone sleeps, the task reads
   ``zmq.EVENTS`` and wakes the sleepers whose flag is set. Only a set flag wakes a sleeper, so
   two sleepers never wake each other in a loop.

Only one task per direction tries and sleeps at a time; others queue behind it in FIFO order
(a turn, like a :class:`trio.Lock` that the fast path never takes). An uncontended call thus
costs one NOBLOCK operation and one schedule point.

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

import itertools
import math
import struct
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, TypeVar, cast

import trio
import zmq

from pdactors._pulse import Pulse
from pdactors.config import Liveness
from pdactors.errors import PdError

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

_T = TypeVar("_T")

# pyzmq's constants are enum.Flag members, whose | and & cost microseconds on this hot path.
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_EVENTS = int(zmq.EVENTS)
_RCVMORE = int(zmq.RCVMORE)
_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
_SRCFD = int(zmq.SRCFD)
_EV_ACCEPTED = int(zmq.EVENT_ACCEPTED)
_EV_DISCONNECTED = int(zmq.EVENT_DISCONNECTED)
_EV_UP = int(zmq.EVENT_HANDSHAKE_SUCCEEDED)
_EV_RETRIED = int(zmq.EVENT_CONNECT_RETRIED)
_EV_HANDSHAKE_FAILED = int(
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_monitor_ids = itertools.count()


class TransportError(PdError):
    """The side channel could not be opened or used (bad address, socket error)."""


class PeerUnreachable(TransportError):
    """A ROUTER was asked to send to an identity that is not (or no longer) connected."""

    def __init__(self, identity: bytes) -> None:
        self.identity = identity
        super().__init__(f"no connected peer with identity {identity!r}")


class _Direction:
    """Sending or receiving on one socket: whose turn it is, and where the turn-holder sleeps."""

    __slots__ = ("busy", "flag", "turns", "wakeup")

    def __init__(self, flag: int) -> None:
        self.flag = flag  # the zmq.EVENTS bit that says the operation can go ahead
        self.busy = False  # a task holds the turn: it sleeps, or was just woken
        self.turns = trio.lowlevel.ParkingLot()  # tasks waiting for the turn, FIFO
        self.wakeup = trio.lowlevel.ParkingLot()  # the turn-holder, waiting for ``flag``

    def pass_turn(self) -> None:
        # Hand the turn straight to the next task, so that a newcomer cannot take it first.
        if self.turns:
            self.turns.unpark()
        else:
            self.busy = False


class _TrioSocket:
    """One ZMQ socket driven from trio tasks; the waiting rules are in the module docstring."""

    def __init__(self, socket: zmq.Socket[bytes]) -> None:
        self._socket = socket
        self._fd = cast(int, socket.getsockopt(zmq.FD))
        self._closed = False
        self._send = _Direction(_POLLOUT)
        self._receive = _Direction(_POLLIN)

    def close(self) -> None:
        """Close the socket at once (linger 0), dropping unsent messages. Idempotent.

        Tasks blocked in ``send`` or ``receive`` raise :class:`trio.ClosedResourceError`, as do
        later calls. Not a checkpoint.
        """
        if self._closed:
            return
        self._closed = True
        trio.lowlevel.notify_closing(self._fd)
        # Each woken task raises and passes its turn on, so the tasks queued for a turn follow.
        self._send.wakeup.unpark_all()
        self._receive.wakeup.unpark_all()
        self._socket.close(linger=0)

    async def _watch_fd(self) -> None:
        """Run by ``open_*`` for the socket's lifetime: rule 1 of the module docstring."""
        try:
            # Checked before every wait: after close the fd number may already belong to another
            # file (close only interrupts a wait in progress).
            while not self._closed:
                await trio.lowlevel.wait_readable(self._fd)
                if not self._closed:
                    self._poll_events()
        except trio.ClosedResourceError:
            return

    async def _io(self, direction: _Direction, attempt: Callable[[], _T]) -> _T:
        await trio.lowlevel.checkpoint_if_cancelled()
        has_turn = yielded = False
        if direction.busy:
            await direction.turns.park()
            has_turn = yielded = True
        try:
            retried = False
            while True:
                if self._closed:
                    raise trio.ClosedResourceError("the ZMQ socket was closed")
                try:
                    result = attempt()
                    break
                except zmq.Again:
                    if self._poll_events() & direction.flag and not retried:
                        retried = True
                        continue
                    has_turn = direction.busy = True
                    await direction.wakeup.park()
                    yielded = True
                    retried = False
        finally:
            if has_turn:
                direction.pass_turn()
        if self._send.wakeup or self._receive.wakeup:
            self._poll_events()
        if not yielded:
            # The operation is done and cannot be undone, so this schedule point ignores
            # cancellation (trio's rule for an operation that succeeded without blocking).
            await trio.lowlevel.cancel_shielded_checkpoint()
        return result

    def _receive_now(self) -> list[bytes]:
        # A message becomes readable only once all its frames are in, so only the first recv
        # can raise zmq.Again.
        frames = [self._socket.recv(_NOBLOCK)]
        while self._socket.getsockopt(_RCVMORE):
            frames.append(self._socket.recv(_NOBLOCK))
        return frames

    def _send_now(self, frames: Sequence[bytes]) -> None:
        # ZMQ refuses a message only at its first frame, so once that is accepted the rest are
        # too: a message goes whole or not at all.
        *head, last = frames
        for frame in head:
            self._socket.send(frame, _MORE_NOBLOCK)
        self._socket.send(last, _NOBLOCK)

    def _poll_events(self) -> int:
        events = cast(int, self._socket.getsockopt(_EVENTS))
        if events & _POLLIN and self._receive.wakeup:
            self._receive.wakeup.unpark_all()
        if events & _POLLOUT and self._send.wakeup:
            self._send.wakeup.unpark_all()
        return events


class _Monitor(_TrioSocket):
    """The PAIR end of a socket monitor: ``(event, value)`` pairs of ZMQ's connection events."""

    async def receive(self) -> tuple[int, int]:
        return _parse_event(await self._io(self._receive, self._receive_now))

    def receive_nowait(self) -> list[tuple[int, int]]:
        """Every event already queued, without waiting (not a checkpoint)."""
        events = []
        while True:
            try:
                events.append(_parse_event(self._receive_now()))
            except zmq.Again:
                break
        self._poll_events()  # this touch may have taken a sleeper's fd signal (rule 3)
        return events


def _parse_event(frames: list[bytes]) -> tuple[int, int]:
    event, value = struct.unpack("=hi", frames[0])
    return event & 0xFFFF, value


class RouterSocket(_TrioSocket):
    """A bound ROUTER socket (ROUTER_MANDATORY set). Make one with :func:`open_router`.

    With liveness on, :attr:`lost_peers` yields each identity whose connection ended (the peer
    closed it, died, or stopped answering heartbeats), once per connection.
    """

    def __init__(self, socket: zmq.Socket[bytes], address: str) -> None:
        super().__init__(socket)
        self._address = address
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
            frames.append(self._socket.recv(_NOBLOCK))
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

    @property
    def up(self) -> bool:
        """The handshake with the peer completed and the connection has not been lost since."""
        return self._up and self._lost is None

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


def _checked(frames: Sequence[bytes]) -> Sequence[bytes]:
    # Checked before the first frame goes out: a bad frame in the middle would leave half a
    # message in the socket, to be completed by the next one.
    if not frames:
        raise ValueError("a message needs at least one frame")
    for frame in frames:
        if not isinstance(frame, bytes | bytearray | memoryview):
            raise TypeError(f"frames must be bytes-like, not {type(frame).__name__}")
    return frames


def _new_socket(
    context: zmq.Context[Any] | None, kind: int, hwm: int, liveness: Liveness | None
) -> zmq.Socket[bytes]:
    socket: zmq.Socket[bytes] = (context or zmq.Context.instance()).socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, hwm)
    socket.setsockopt(zmq.RCVHWM, hwm)
    if liveness is not None:
        socket.setsockopt(zmq.HEARTBEAT_IVL, _ms(liveness.heartbeat_interval))
        socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, _ms(liveness.heartbeat_timeout))
        socket.setsockopt(zmq.HEARTBEAT_TTL, _ms(liveness.heartbeat_timeout))
    return socket


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


_S = TypeVar("_S", bound="RouterSocket | DealerSocket")

_MONITORED = _EV_ACCEPTED | _EV_DISCONNECTED | _EV_UP | _EV_RETRIED | _EV_HANDSHAKE_FAILED


def _monitor(socket: zmq.Socket[bytes]) -> _Monitor:
    """Attach a monitor to ``socket`` (before it binds or connects: earlier events are lost)."""
    address = f"inproc://pdactors-monitor-{next(_monitor_ids)}"
    socket.monitor(address, _MONITORED)
    pair: zmq.Socket[bytes] = socket.context.socket(zmq.PAIR)
    pair.setsockopt(zmq.LINGER, 0)
    pair.connect(address)
    return _Monitor(pair)


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
) -> AsyncIterator[RouterSocket]:
    """Bind a ROUTER socket on ``tcp://host:port`` (port 0: any free port) for the block.

    ``context`` defaults to the process-wide ``zmq.Context.instance()``; ``hwm`` is the queue
    bound per peer and direction (0: none); ``liveness`` turns on heartbeats and
    :attr:`RouterSocket.lost_peers`. Leaving the block closes the socket (linger 0).
    Raises ``zmq.ZMQError`` if the address cannot be bound.
    """
    socket = _new_socket(context, zmq.ROUTER, hwm, liveness)
    monitor = None
    try:
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        monitor = _monitor(socket) if liveness is not None else None
        socket.bind(f"tcp://{host}:{port}")
        address = socket.getsockopt_string(zmq.LAST_ENDPOINT)
    except BaseException:
        _close_now(socket, monitor)
        raise
    async with _watched(RouterSocket(socket, address), monitor) as router:
        yield router


@asynccontextmanager
async def open_dealer(
    address: str,
    *,
    context: zmq.Context[Any] | None = None,
    hwm: int = DEFAULT_HWM,
    liveness: Liveness | None = None,
) -> AsyncIterator[DealerSocket]:
    """Connect a DEALER socket to ``address`` (``"tcp://host:port"``) for the block.

    The connection is made (and remade) in the background; sends queue until it is up.
    ``context``, ``hwm`` and ``liveness`` are as for :func:`open_router` (with liveness,
    :meth:`DealerSocket.wait_lost` tells when the peer is gone). Leaving the block closes the
    socket (linger 0). Raises :class:`TransportError` if the address is malformed or cannot be
    resolved.
    """
    socket = _new_socket(context, zmq.DEALER, hwm, liveness)
    monitor = None
    try:
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


def _close_now(socket: zmq.Socket[bytes], monitor: _Monitor | None) -> None:
    if monitor is not None:
        socket.disable_monitor()
        monitor._socket.close(linger=0)
    socket.close(linger=0)
