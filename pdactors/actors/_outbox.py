"""P's replies to D workers: one bounded queue per peer, and how much garbage is answered.

One peer that stops reading must not hold up the others: each peer's replies wait in a queue
of their own (at most ``max_queued``), sent without blocking (``Router.send_nowait``). A peer
whose queue is full, or whose socket refuses every reply for ``stall_timeout`` seconds, is
*cut off*: its queue is dropped, nothing it sends is read any more, and the actor ends its
transfers as it does a lost D's (``on_cut``).

Garbage is answered at most once per bad frame and never with more bytes than the peer sent
(:class:`Refusals`): a bad frame earns its sender credit of its own size, an answer spends
its encoded size, and an answer the credit cannot pay is cut short or withheld (counted).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import trio

from pdactors._once import Every
from pdactors._pulse import Pulse
from pdactors.actors._done_notices import DoneNotices, DoneNoticeStats
from pdactors.transport import PeerUnreachable, Router
from pdactors.wire import ErrorReply, Msg, PullFailed, encode_frames

__all__ = ["Outbox", "Refusals", "SideChannelStats"]

log = logging.getLogger("pdactors.sender")

#: How often a peer's refusals (garbage, cut-off) are logged: once per peer per interval.
LOG_INTERVAL = 60.0
#: Seconds between attempts to send to a peer whose socket queue is full.
_RETRY = 0.01
#: Replies sent between checkpoints (the receive loop runs in between).
_BATCH = 64
#: Credit a peer may save up from bad frames (bytes).
_MAX_CREDIT = 1 << 16


@dataclass(frozen=True, slots=True)
class SideChannelStats:
    """What P's side channel refused, since the sender started.

    ``bad_frames``: frames that did not decode or broke a limit; ``answers_withheld``: bad
    frames not answered (their sender had not sent the bytes an answer takes);
    ``peers_cut_off``: peers cut off for not reading their replies; ``dropped``: messages from
    cut-off peers and replies to peers that were gone or cut off. Beside the side channel,
    D's fast completion notices (:mod:`pdactors.actors._done_notices`): ``notices_sent`` by
    P's write threads, ``notices_dropped`` (the ``PullDone`` that follows them stands), and
    ``notices_refused`` (pulls whose ``done_to`` was no numeric ``udp://ip:port``).
    """

    bad_frames: int = 0
    answers_withheld: int = 0
    peers_cut_off: int = 0
    dropped: int = 0
    notices_sent: int = 0
    notices_dropped: int = 0
    notices_refused: int = 0


class Refusals:
    """Per peer: the bytes of bad frames not yet spent on answers, and the log throttle."""

    def __init__(self) -> None:
        self._credit: dict[bytes, int] = {}
        self._every = Every(LOG_INTERVAL)
        self.bad_frames = self.withheld = 0

    def answer(
        self, identity: bytes, nbytes: int, reply: ErrorReply | PullFailed, why: str
    ) -> Msg | None:
        """A bad frame of ``nbytes`` came from ``identity``: log it (throttled) and return
        ``reply`` (its reason cut short if need be) if the peer's credit pays for it."""
        self.bad_frames += 1
        if (n := self._every.due(identity, trio.current_time())) is not None:
            log.warning(
                "bad frame from peer %s (%d in %g s): %r", identity.hex(), n, LOG_INTERVAL, why
            )
        if len(self._credit) >= 4096 and identity not in self._credit:
            self._credit.clear()
        credit = min(self._credit.get(identity, 0) + nbytes, _MAX_CREDIT)
        cost = sum(map(len, encode_frames(reply)))
        if cost > credit:  # cut the reason to what the credit pays for, if that leaves any
            spare = len(reply.reason.encode()) - (cost - credit)
            if spare < 16:
                self._credit[identity] = credit
                self.withheld += 1
                return None
            short = reply.reason.encode()[:spare].decode(errors="ignore")
            reply = msgspec.structs.replace(reply, reason=short)
            cost = sum(map(len, encode_frames(reply)))
        self._credit[identity] = credit - cost
        return reply

    def forget(self, identity: bytes) -> None:
        self._credit.pop(identity, None)
        self._every.forget(identity)


class Outbox:
    """The replies of one sender, queued per peer; :meth:`serve` sends them (see the module
    docstring). ``on_cut(identity, reason)`` is called, once, for each peer cut off."""

    def __init__(
        self,
        router: Router,
        on_cut: Callable[[bytes, str], None],
        *,
        max_queued: int = 4096,
        stall_timeout: float = 3.0,
    ) -> None:
        self._router = router
        self._on_cut = on_cut
        self.max_queued = max_queued
        self.stall_timeout = stall_timeout
        self._queues: dict[bytes, deque[Msg]] = {}
        self._stalled: dict[bytes, float] = {}  # peer -> when its socket first refused
        self._cut: set[bytes] = set()
        self._changed = Pulse()
        self.cut_off = self.dropped = 0

    def is_cut(self, identity: bytes) -> bool:
        """Whether ``identity`` was cut off (its messages are to be dropped unread)."""
        return identity in self._cut

    def put(self, identity: bytes, msg: Msg) -> None:
        """Queue ``msg`` for ``identity``; cut the peer off when its queue is full."""
        if identity in self._cut:
            self.dropped += 1
            return
        queue = self._queues.setdefault(identity, deque())
        if len(queue) >= self.max_queued:
            self.cut(identity, f"{len(queue)} replies wait for it: it does not read them")
            return
        queue.append(msg)
        self._changed.fire()

    def put_now(self, identity: bytes, msg: Msg) -> None:
        """Hand ``msg`` to ZMQ now when nothing waits before it for ``identity`` (the caller
        acts on the peer's behalf right after); else queue it as :meth:`put` does."""
        if identity not in self._queues and identity not in self._cut:
            try:
                if self._router.send_nowait(identity, encode_frames(msg)):
                    return
            except PeerUnreachable:
                self.dropped += 1
                return  # gone: the loss loop ends its transfers
        self.put(identity, msg)

    def cut(self, identity: bytes, reason: str) -> None:
        """Cut ``identity`` off: drop its replies, end its transfers (``on_cut``)."""
        if identity in self._cut:
            return
        if len(self._cut) >= 4096:  # their connections end unseen without liveness
            self._cut.clear()
        self._cut.add(identity)
        self.dropped += len(self._queues.pop(identity, ()))
        self._stalled.pop(identity, None)
        self.cut_off += 1
        self._on_cut(identity, reason)

    def forget(self, identity: bytes) -> None:
        """``identity``'s connection ended: its queue goes. A cut-off identity stays cut off
        (what it sent before may still be queued; a ROUTER does not reuse the names it makes)."""
        self.dropped += len(self._queues.pop(identity, ()))
        self._stalled.pop(identity, None)

    async def serve(self) -> None:
        """Send queued replies until cancelled, never waiting on one peer."""
        sent = 0
        while True:
            while not self._queues:
                await self._changed.wait()
            now = trio.current_time()
            for identity in list(self._queues):
                queue = self._queues.get(identity)
                while queue:
                    try:
                        ok = self._router.send_nowait(identity, encode_frames(queue[0]))
                    except PeerUnreachable:  # gone: the loss loop ends its transfers
                        self.forget(identity)
                        break
                    if not ok:
                        since = self._stalled.setdefault(identity, now)
                        if now - since >= self.stall_timeout:
                            self.cut(identity, f"its socket took no reply for {now - since:.1f} s")
                        break
                    queue.popleft()
                    self._stalled.pop(identity, None)
                    sent += 1
                    if sent % _BATCH == 0:
                        await trio.lowlevel.checkpoint()
                if queue is not None and not queue and self._queues.get(identity) is queue:
                    del self._queues[identity]
            if self._stalled and len(self._stalled) == len(self._queues):
                with trio.move_on_after(_RETRY):  # only stalled peers left: retry soon
                    await self._changed.wait()
            else:
                await trio.lowlevel.checkpoint()

    def statistics(self, refusals: Refusals, notices: DoneNotices | None) -> SideChannelStats:
        sent = notices.statistics() if notices is not None else DoneNoticeStats()
        return SideChannelStats(refusals.bad_frames, refusals.withheld, self.cut_off,
                                self.dropped, sent.sent, sent.dropped, sent.refused)  # fmt: skip
