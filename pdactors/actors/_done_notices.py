"""P's half of D's fast completion path (issue 28 item 1, "A" in docs/architecture.md).

A pull whose :class:`~pdactors.wire.PullRequest` names ``done_to`` (``udp://ip:port``: a UDP
socket that a thread of D owns) and ``done_token`` gets, besides the side channel's
``PullDone``, an early notice that its KV landed: the data plane's worker thread whose engine
call landed the pull's last bytes sends the 8 bytes of the token (little-endian) there itself,
as one datagram, with no Trio hop and no other thread woken on P. The notice may be lost
freely: ``PullDone`` still follows exactly as before and stays the authority for every failure
path, so every error here is counted and dropped.

The address is parsed once, in Trio, when the write is planned, and only numeric addresses are
taken: a worker thread never waits on a name lookup. :class:`DoneNotices` holds at most one
non-blocking, unconnected UDP socket per address family, made when first needed and used from
worker threads only, each send under one lock.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import re
import socket
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

from pdactors.wire import PullRequest

__all__ = [
    "DoneNoticeStats",
    "DoneNotices",
    "NoticeAddress",
    "notice_address",
    "open_done_notices",
]

log = logging.getLogger("pdactors.sender")

# ``udp://`` + an IPv4 address or a bracketed IPv6 one + ``:port`` (checked by ``ipaddress``).
_ADDRESS = re.compile(r"udp://(?:([0-9.]{7,15})|\[([0-9A-Fa-f:.]{2,45})\]):([1-9][0-9]{0,4})")


class NoticeAddress(NamedTuple):
    """Where a notice goes: the socket family and ``sendto``'s address."""

    family: socket.AddressFamily
    sockaddr: tuple[str, int] | tuple[str, int, int, int]


@functools.lru_cache(maxsize=256)
def notice_address(done_to: str) -> NoticeAddress | None:
    """Where ``done_to`` sends a notice, or None when it is no ``udp://ip:port`` (an IPv4
    literal or a bracketed IPv6 one, no zone; port 1 to 65535). Never looks a name up.
    Cached: a D's address comes back with each of its pulls, and this is on the write's
    path."""
    match = _ADDRESS.fullmatch(done_to)
    if match is None or int(match.group(3)) > 65535:
        return None
    v4, v6, port = match.group(1), match.group(2), int(match.group(3))
    try:
        if v4 is not None:
            return NoticeAddress(socket.AF_INET, (str(ipaddress.IPv4Address(v4)), port))
        return NoticeAddress(socket.AF_INET6, (str(ipaddress.IPv6Address(v6)), port, 0, 0))
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class DoneNoticeStats:
    """``sent``: datagrams handed to the kernel; ``dropped``: notices lost to a socket error
    (a full buffer, no route...); ``refused``: pulls whose ``done_to`` was no valid address
    (no notice); ``sockets``: UDP sockets open now (one per address family at most)."""

    sent: int = 0
    dropped: int = 0
    refused: int = 0
    sockets: int = 0


class DoneNotices:
    """The UDP sockets that send D's fast completion notices (the module's docstring).

    Sockets are made when first needed; :meth:`close` closes them all.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sockets: dict[socket.AddressFamily, socket.socket] = {}
        self._closed = False
        self.sent = self.dropped = self.refused = 0

    def after(self, pull: PullRequest) -> Callable[[], None] | None:
        """The data plane's ``after`` for the write that completes ``pull`` (None: the pull
        asks for no notice, or names no valid address: logged at debug, counted). Parses the
        address here, in Trio; not a checkpoint."""
        if not pull.done_to:
            return None
        target = notice_address(pull.done_to)
        if target is None:
            with self._lock:
                self.refused += 1
            log.debug("transfer %r: done_to %.80r is no udp://ip:port; no fast notice",
                      pull.transfer_id, pull.done_to)  # fmt: skip
            return None
        return partial(self.send, target, pull.done_token)

    def send(self, target: NoticeAddress, token: int) -> None:
        """Send ``token`` to ``target`` as one datagram, without blocking. Never raises: a
        notice that cannot be sent now is counted in ``dropped``. A no-op once closed."""
        with self._lock:
            if self._closed:
                return
            try:
                sock = self._socket(target.family)
                sock.sendto(token.to_bytes(8, "little"), socket.MSG_DONTWAIT, target.sockaddr)
            except (OSError, OverflowError):  # EAGAIN, ENOBUFS, EHOSTUNREACH... or no IPv6
                self.dropped += 1
                return
            self.sent += 1

    def _socket(self, family: socket.AddressFamily) -> socket.socket:
        sock = self._sockets.get(family)
        if sock is None:
            sock = socket.socket(family, socket.SOCK_DGRAM)
            sock.setblocking(False)
            self._sockets[family] = sock
        return sock

    def statistics(self) -> DoneNoticeStats:
        """A snapshot of the counters."""
        with self._lock:
            return DoneNoticeStats(self.sent, self.dropped, self.refused, len(self._sockets))

    def close(self) -> None:
        """Close every socket; later sends do nothing. Blocking only while a worker thread is
        inside :meth:`send` (a non-blocking send)."""
        with self._lock:
            self._closed = True
            for sock in self._sockets.values():
                sock.close()
            self._sockets.clear()


@asynccontextmanager
async def open_done_notices() -> AsyncIterator[DoneNotices]:
    """A :class:`DoneNotices` closed when the block exits (after the writes in it ended: the
    sender's nursery sits inside this block). Not a checkpoint beyond the block's own."""
    notices = DoneNotices()
    try:
        yield notices
    finally:
        notices.close()
