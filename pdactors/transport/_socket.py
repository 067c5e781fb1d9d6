"""The trio side of one ZMQ socket: non-blocking calls that wait on ``zmq.FD`` correctly.

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
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import trio
import zmq

from pdactors.config import Liveness

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
_EV_CONNECTED = int(zmq.EVENT_CONNECTED)
_EV_DELAYED = int(zmq.EVENT_CONNECT_DELAYED)
_EV_UP = int(zmq.EVENT_HANDSHAKE_SUCCEEDED)
_EV_RETRIED = int(zmq.EVENT_CONNECT_RETRIED)
_EV_HANDSHAKE_FAILED = int(
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_monitor_ids = itertools.count()


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


_MONITORED = (
    _EV_ACCEPTED
    | _EV_CONNECTED
    | _EV_DELAYED
    | _EV_DISCONNECTED
    | _EV_UP
    | _EV_RETRIED
    | _EV_HANDSHAKE_FAILED
)


def _monitor(socket: zmq.Socket[bytes]) -> _Monitor:
    """Attach a monitor to ``socket`` (before it binds or connects: earlier events are lost)."""
    address = f"inproc://pdactors-monitor-{next(_monitor_ids)}"
    socket.monitor(address, _MONITORED)
    pair: zmq.Socket[bytes] = socket.context.socket(zmq.PAIR)
    pair.setsockopt(zmq.LINGER, 0)
    pair.connect(address)
    return _Monitor(pair)


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
    context: zmq.Context[Any] | None,
    kind: int,
    hwm: int,
    liveness: Liveness | None,
    max_message: int = -1,
) -> zmq.Socket[bytes]:
    socket: zmq.Socket[bytes] = (context or zmq.Context.instance()).socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, max_message)
    socket.setsockopt(zmq.SNDHWM, hwm)
    socket.setsockopt(zmq.RCVHWM, hwm)
    if liveness is not None:
        socket.setsockopt(zmq.HEARTBEAT_IVL, _ms(liveness.heartbeat_interval))
        socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, _ms(liveness.heartbeat_timeout))
        socket.setsockopt(zmq.HEARTBEAT_TTL, _ms(liveness.heartbeat_timeout))
    return socket


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _close_now(socket: zmq.Socket[bytes], monitor: _Monitor | None) -> None:
    if monitor is not None:
        socket.disable_monitor()
        monitor._socket.close(linger=0)
    socket.close(linger=0)
