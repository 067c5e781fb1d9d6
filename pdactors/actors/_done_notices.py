"""P's half of D's fast completion path (issue 28 item 1, "A" in docs/architecture.md).

A pull whose :class:`~pdactors.wire.PullRequest` names ``done_to`` (a ZMQ PULL socket that a
thread of D owns) and ``done_token`` gets, besides the side channel's ``PullDone``, an early
notice that its KV landed: the data plane's worker thread whose engine call landed the pull's
last bytes sends the 8 bytes of the token (little-endian) to ``done_to`` itself, with no Trio
hop. The notice may be lost freely: ``PullDone`` still follows exactly as before and stays
the authority for every failure path, so every error here is counted and dropped.

:class:`DoneNotices` holds one PUSH socket per address, in a ZMQ context of its own (a slow
name lookup for a peer's address stalls its I/O thread, never the side channel's). Its sockets
are used from worker threads only, each use under one lock.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import zmq

from pdactors.wire import PullRequest

__all__ = ["DoneNoticeStats", "DoneNotices", "notice_address", "open_done_notices"]

log = logging.getLogger("pdactors.sender")

#: Addresses whose socket is kept; the least recently used one is closed beyond that.
MAX_SOCKETS = 64
#: Notices queued per address while its connection is not up (or D reads slowly).
SEND_HWM = 64

# ``tcp://`` + a host name, an IPv4 address or a bracketed IPv6 one + ``:port``.
_ADDRESS = re.compile(
    r"tcp://(?:[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?|\[[0-9A-Fa-f:.]{2,45}\])"
    r":([1-9][0-9]{0,4})"
)


def notice_address(done_to: str) -> bool:
    """Whether ``done_to`` is an address a notice may go to: ``tcp://host:port``."""
    match = _ADDRESS.fullmatch(done_to)
    return match is not None and int(match.group(1)) <= 65535


@dataclass(frozen=True, slots=True)
class DoneNoticeStats:
    """``sent``: notices handed to ZMQ; ``dropped``: notices lost to a full queue or a socket
    error; ``refused``: pulls whose ``done_to`` was no valid address (no notice);
    ``sockets``: PUSH sockets open now."""

    sent: int = 0
    dropped: int = 0
    refused: int = 0
    sockets: int = 0


class DoneNotices:
    """The PUSH sockets that send D's fast completion notices (the module's docstring).

    ``capacity``: addresses whose socket is kept (LRU); ``hwm``: notices queued per address.
    Sockets are made when first needed; :meth:`close` closes them all.
    """

    def __init__(self, capacity: int = MAX_SOCKETS, hwm: int = SEND_HWM) -> None:
        self._capacity, self._hwm = capacity, hwm
        self._lock = threading.Lock()
        self._context: zmq.Context[Any] | None = None
        self._sockets: OrderedDict[str, zmq.Socket[bytes]] = OrderedDict()
        self._closed = False
        self.sent = self.dropped = self.refused = 0

    def after(self, pull: PullRequest) -> Callable[[], None] | None:
        """The data plane's ``after`` for the write that completes ``pull`` (None: the pull
        asks for no notice, or names no valid address: logged at debug, counted)."""
        if not pull.done_to:
            return None
        if not notice_address(pull.done_to):
            self.refused += 1
            log.debug("transfer %r: done_to %.80r is no tcp://host:port; no fast notice",
                      pull.transfer_id, pull.done_to)  # fmt: skip
            return None
        return partial(self.send, pull.done_to, pull.done_token)

    def send(self, address: str, token: int) -> None:
        """Send ``token`` to ``address`` without blocking. Never raises: a notice that cannot
        be sent now is counted in ``dropped``. A no-op once closed."""
        with self._lock:
            if self._closed:
                return
            try:
                self._socket(address).send(token.to_bytes(8, "little"), zmq.NOBLOCK)
            except (zmq.ZMQError, OverflowError):  # Again at the high-water mark, or worse
                self.dropped += 1
                return
            self.sent += 1

    def _socket(self, address: str) -> zmq.Socket[bytes]:
        socket = self._sockets.get(address)
        if socket is not None:
            self._sockets.move_to_end(address)
            return socket
        if self._context is None:
            self._context = zmq.Context(io_threads=1)
        socket = self._context.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, self._hwm)
        socket.setsockopt(zmq.IMMEDIATE, 0)  # queue while the connection is being made
        try:
            socket.connect(address)
        except zmq.ZMQError:
            socket.close()
            raise
        self._sockets[address] = socket
        if len(self._sockets) > self._capacity:
            _, evicted = self._sockets.popitem(last=False)
            evicted.close()
        return socket

    def statistics(self) -> DoneNoticeStats:
        """A snapshot of the counters."""
        with self._lock:
            return DoneNoticeStats(self.sent, self.dropped, self.refused, len(self._sockets))

    def close(self) -> None:
        """Close every socket and the context; later sends do nothing. Blocking only while a
        worker thread is inside :meth:`send` (a non-blocking send)."""
        with self._lock:
            self._closed = True
            for socket in self._sockets.values():
                socket.close()
            self._sockets.clear()
            context, self._context = self._context, None
        if context is not None:
            context.term()


@asynccontextmanager
async def open_done_notices() -> AsyncIterator[DoneNotices]:
    """A :class:`DoneNotices` closed when the block exits (after the writes in it ended: the
    sender's nursery sits inside this block). Not a checkpoint beyond the block's own."""
    notices = DoneNotices()
    try:
        yield notices
    finally:
        notices.close()
