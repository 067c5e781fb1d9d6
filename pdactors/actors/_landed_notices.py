"""D's fast completion path (issue 28 item 1, "C"): P's write thread says a pull's KV landed
straight to a thread of D's, which tells the engine at once, with no Trio loop on either side.

A pull that asks for it carries ``done_to`` (this object's :attr:`LandedNotices.address`) and a
``done_token`` (:meth:`LandedNotices.open_latch`). Once the pull's whole KV has landed (its
engine call returned 0), P's write thread sends the token's 8 bytes (little-endian) as one UDP
datagram to the socket here; the side channel's ``PullDone`` still follows and stays the
authority for every failure path.

The notice may be lost, repeated, late or forged by anyone who reaches the port, so it only
ever *completes an open latch*: one per pull, opened by the receiver (Trio) just before the
pull is sent, closed by it (:meth:`LandedNotices.close_latch`) when the pull leaves its waiting
state any other way (D's abort, P's loss) or ends. Under one lock, whoever comes first decides,
as between ``PullDone`` and D's abort in the pull table: the thread completes a latch only
while it is open, and ``close_latch`` says whether the thread had (the pull was then reported
landed through its ``on_landed``, and its later end in Trio only cleans up). A token with no
open latch (late, repeated, forged: 64 random bits) and any other datagram change nothing but
a counter.

The UDP socket is owned by the thread, which blocks in ``recv`` on it: one kernel hop from P's
write thread, one thread woken, and one system call, so one wait for the GIL, before the
notice is in hand (blocking in ``poll`` first made that two waits: each call gives the GIL up
and must take it back, up to the switch interval each while another thread runs Python;
``bench/gil_wakeup.py --readers recv poll``). :meth:`LandedNotices.close` stops it without
touching its socket: it raises a flag and sends an empty datagram there from a socket of its
own, again until the thread has gone (a datagram lost to a full receive buffer leaves the
thread datagrams to read, and it checks the flag before each).
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from pdactors.config import ReceiverConfig
from pdactors.core.pull_records import Pull

__all__ = [
    "LandedNoticeStats",
    "LandedNotices",
    "PullLatches",
    "open_latches",
    "session_host",
]

log = logging.getLogger("pdactors.receiver")

TOKEN_BYTES = 8
#: Bytes read per datagram: a longer one is cut there (and is malformed: a notice is 8 bytes).
_MAX_MESSAGE = 64
#: How long :meth:`LandedNotices.close` waits for the thread (it is woken at once; only an
#: ``on_landed`` that blocks can hold it).
JOIN_TIMEOUT = 5.0
#: How often :meth:`LandedNotices.close` sends its wake-up datagram again while it waits.
_WAKE_AGAIN = 0.1


@dataclass(frozen=True, slots=True)
class LandedNoticeStats:
    """What the notices thread saw: latches it completed, well-formed notices that matched no
    open latch (late, repeated or forged), malformed datagrams, and latches open now."""

    landed_early: int
    ignored: int
    malformed: int
    open: int


class LandedNotices:
    """A thread reading P's "landed" notices on a UDP socket bound to ``host``, port 0.

    ``host`` is resolved once, here (the first address ``getaddrinfo`` gives). Raises
    ``OSError`` (``socket.gaierror`` among them) when it cannot resolve or bind. :meth:`close`
    stops it (also on leaving a ``with`` block). Every method may be called from any thread but
    the notices thread.
    """

    def __init__(self, host: str) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, Callable[[], None]] = {}
        self._completed: set[int] = set()  # by the thread, until close_latch hears of it
        self._landed_early = self._ignored = self._malformed = 0
        family, _, proto, _, sockaddr = socket.getaddrinfo(host, 0, type=socket.SOCK_DGRAM)[0]
        notices = socket.socket(family, socket.SOCK_DGRAM, proto)
        wake: socket.socket | None = None
        try:
            wake = socket.socket(family, socket.SOCK_DGRAM, proto)
            notices.bind(sockaddr)
            wake.setblocking(False)
            self._where: tuple[object, ...] = notices.getsockname()
            ip, port = self._where[:2]
            bracketed = f"[{ip}]" if family == socket.AF_INET6 else ip
            #: Where P sends the notices (``PullRequest.done_to``): ``"udp://ip:port"``.
            self.address: str = f"udp://{bracketed}:{port}"
        except BaseException:
            notices.close()
            if wake is not None:
                wake.close()
            raise
        self._stopping = False  # read by the thread before each datagram it takes
        self._wake: socket.socket | None = wake
        # From here on only the thread touches ``notices``; it closes it.
        self._thread = threading.Thread(
            target=self._serve, args=(notices,), name="pdactors-landed", daemon=False
        )
        self._thread.start()

    def __enter__(self) -> LandedNotices:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the latches

    def open_latch(self, on_landed: Callable[[], None]) -> int:
        """A new latch for one pull; returns its token (64 random bits, never 0, unique among
        the latches not closed yet). Until :meth:`close_latch`, a notice carrying it calls
        ``on_landed`` once, in the notices thread (what it raises is logged)."""
        with self._lock:
            while True:
                token = secrets.randbits(64)
                if token and token not in self._open and token not in self._completed:
                    self._open[token] = on_landed
                    return token

    def close_latch(self, token: int) -> bool:
        """Close ``token``'s latch: from now on its notice changes nothing. Returns whether
        the thread had completed it (its ``on_landed`` was called, or is being called: the
        pull was reported landed)."""
        with self._lock:
            if self._open.pop(token, None) is not None:
                return False
            if token in self._completed:
                self._completed.discard(token)
                return True
            return False

    def statistics(self) -> LandedNoticeStats:
        with self._lock:
            return LandedNoticeStats(
                self._landed_early, self._ignored, self._malformed, len(self._open)
            )

    # ------------------------------------------------------------------ the thread

    def close(self) -> None:
        """Stop the thread and wait for it (at most :data:`JOIN_TIMEOUT`); idempotent. It
        closes its own socket as it exits."""
        wake, self._wake = self._wake, None
        if wake is None:
            return
        self._stopping = True
        deadline = time.monotonic() + JOIN_TIMEOUT
        try:
            while self._thread.is_alive() and (left := deadline - time.monotonic()) > 0:
                try:
                    wake.sendto(b"", self._where)
                except OSError as exc:  # a full buffer: the thread has datagrams to read
                    log.debug("the landed notices thread's wake-up was not sent: %s", exc)
                self._thread.join(min(_WAKE_AGAIN, left))
        finally:
            wake.close()
        if self._thread.is_alive():
            log.warning("the landed notices thread (%s) did not stop within %g s: an "
                        "on_landed callback blocks", self.address, JOIN_TIMEOUT)  # fmt: skip

    def _serve(self, notices: socket.socket) -> None:
        try:
            while True:
                datagram = notices.recv(_MAX_MESSAGE)
                if self._stopping:
                    return
                self._notice(datagram)
        except OSError as exc:  # the socket broke under it: no more notices
            log.error("the landed notices thread (%s) stopped: %s; pulls are reported "
                      "through the side channel only", self.address, exc)  # fmt: skip
        finally:
            notices.close()

    def _notice(self, datagram: bytes) -> None:
        if len(datagram) != TOKEN_BYTES:
            with self._lock:
                self._malformed += 1
            return
        token = int.from_bytes(datagram, "little")
        with self._lock:
            on_landed = self._open.pop(token, None)
            if on_landed is None:
                self._ignored += 1
                return
            self._completed.add(token)
            self._landed_early += 1
        try:
            on_landed()
        except Exception as exc:  # the engine's callback: the pull stays reported; go on
            log.error("on_landed of a pull failed: %r", exc, exc_info=exc)


class PullLatches:
    """The receiver's latches on ``notices`` (None: no fast completion path; see
    :func:`open_latches`). Trio thread only."""

    def __init__(self, notices: LandedNotices | None) -> None:
        self.notices = notices

    def open(self, pull: Pull, peers: int) -> tuple[str, int]:
        """Open ``pull``'s latch if it may take the fast completion path (a callback, one P
        worker): where P sends its notice and the token (``("", 0)``: it may not). Before the
        pull is sent: the notice may overtake the task that sends it."""
        if self.notices is None or pull.on_landed is None or peers != 1:
            return "", 0
        pull.done_token = self.notices.open_latch(pull.on_landed)
        return self.notices.address, pull.done_token

    def close(self, pull: Pull) -> None:
        """Close ``pull``'s latch, if open (D aborts, loses P, or the pull ends): from now on
        P's notice changes nothing, and ``pull.landed_early`` says whether it had come. This
        decides, as the table's first answer does."""
        if pull.done_token and self.notices is not None:
            pull.landed_early = self.notices.close_latch(pull.done_token)
        pull.done_token = 0

    def statistics(self) -> LandedNoticeStats | None:
        return None if self.notices is None else self.notices.statistics()


def session_host(session: str) -> str:
    """The host of a data plane's ``"host:port"`` session (an IPv6 address unbracketed)."""
    host = session.rpartition(":")[0] or session
    return host.removeprefix("[").removesuffix("]")


@contextmanager
def open_latches(config: ReceiverConfig, session: str) -> Iterator[PullLatches]:
    """A receiver's :class:`PullLatches` for the block, with a :class:`LandedNotices` on the
    host of its data plane's ``session`` when ``config`` asks for the fast path and it can bind
    there (else none, logged: pulls are then reported through the side channel only)."""
    if not (config.fast_done and config.verify_kv == "off"):
        yield PullLatches(None)
        return
    host = session_host(session)
    try:
        notices = LandedNotices(host)
    except OSError as exc:  # socket.gaierror too: the host does not resolve
        log.warning("no fast completion path: cannot bind udp://%s:0 for P's landed notices "
                    "(%s); pulls are reported through the side channel only",
                    host, exc)  # fmt: skip
        yield PullLatches(None)
        return
    with notices:
        log.info("P's landed notices are read at %s", notices.address)
        yield PullLatches(notices)
