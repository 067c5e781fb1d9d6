"""P side: the rendezvous of D's pull and P's finished prefill, by ``transfer_id``.

Sans-IO: every method takes the current time, changes state, and returns the effects the
actor must carry out (:class:`Reply`, :class:`StartSend`, :class:`Release`). Nothing here
blocks, sleeps or talks to the network.

Rules (``state`` of one transfer id):

============  ==============================  ==============================================
state         entered when                    leaves when
============  ==============================  ==============================================
PENDING       P's prefill started, or D's     P: ready → SENDING if pulls wait, else READY;
              pull came first                 P: streaming with a pull waiting → SENDING
                                              (streamed: written layer by layer while P
                                              computes it; otherwise no change);
                                              P: dropped → DROPPED (waiting pull failed now);
                                              D cancels, or the pulling D is gone →
                                              CANCELLED; the waiting pull passes
                                              ``ready_timeout`` → TIMED_OUT; no pull and no
                                              ready within ``ready_timeout`` → EXPIRED
READY         P finished: its block ids       pull arrives → SENDING; ``unclaimed_ttl``
              are known, no pull (or not      passes → EXPIRED (+Release); D cancels or P
              every expected pull) yet        drops → CANCELLED / DROPPED (+Release)
SENDING       a pull met P's blocks; more     the last write in flight ends → DONE, or
              pulls may join while writing    FAILED when a write failed (+Reply, +Release),
                                              or READY while expected pulls are still to
                                              come; cancels and drops wait for the writes
                                              (they cannot be stopped), then end it
DONE, FAILED, an end                          ``tombstone_ttl`` passes → forgotten
TIMED_OUT,
EXPIRED,
DROPPED,
CANCELLED
============  ==============================  ==============================================

Every deadline is ``now`` plus a constant of the table, so each kind of deadline comes due in
the order it was set: the table keeps one insertion-ordered queue per kind (waiting for a pull,
a pull waiting, unclaimed KV, tombstones), and :meth:`tick` looks only at the heads that are
due. A tick costs what it ends, not what the table holds: at thousands of transfers per second
the tombstones alone are hundreds of thousands of entries. ``now`` must never go backwards.

One transfer may be pulled by several D workers (heterogeneous tensor parallelism: D ranks
that take different heads of one P rank). The first pull says how many will come
(``expected``; one unless D's shape says otherwise); each pull is written as soon as both it
and P's blocks are there, and the transfer ends once every expected pull was answered, or one
write failed. Between writes it waits, READY, for the pulls still to come.

An ended transfer stays as a *tombstone* for ``tombstone_ttl`` so that a late pull is answered
at once (no long waits), and a late "ready" for a transfer D gave up on is released at once.
P's blocks are released (``Release``) exactly once for every transfer that was READY.
Anything else — a second "ready", a send result for a transfer not being sent — raises
:class:`IllegalTransition`.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field

from pdactors.errors import IllegalTransition
from pdactors.messages import BlockIds, Msg, PullDone, PullFailed, PullRequest

__all__ = [
    "Effect",
    "IllegalTransition",
    "Release",
    "Reply",
    "SendState",
    "SendTable",
    "StartSend",
]


class SendState(enum.Enum):
    PENDING = "pending"
    READY = "ready"
    SENDING = "sending"
    DONE = "done"
    FAILED = "failed"
    TIMED_OUT = "timed_out"
    EXPIRED = "expired"
    DROPPED = "dropped"
    CANCELLED = "cancelled"

    @property
    def ended(self) -> bool:
        return self not in _LIVE


_LIVE = frozenset({SendState.PENDING, SendState.READY, SendState.SENDING})

_END_REASONS = {
    SendState.DONE: "already delivered",
    SendState.FAILED: "the transfer failed",
    SendState.TIMED_OUT: "P's prefill was not ready in time",
    SendState.EXPIRED: "P's KV expired before the pull arrived",
    SendState.DROPPED: "P dropped the request (aborted or failed)",
    SendState.CANCELLED: "the transfer was cancelled by D",
}


@dataclass(frozen=True, slots=True)
class Reply:
    """Send ``msg`` to the D worker behind ROUTER identity ``identity``."""

    identity: bytes
    msg: Msg


@dataclass(frozen=True, slots=True)
class StartSend:
    """Write P's ``src_blocks`` into the blocks named by ``pull`` (from the D worker behind
    ``identity``); then call ``send_finished``.

    ``streamed``: P is still computing the KV; the actor writes it layer by layer as P reports
    each one complete, and the rest once P says the prefill is done.
    """

    transfer_id: str
    pull: PullRequest
    src_blocks: BlockIds
    streamed: bool = False
    identity: bytes = b""


@dataclass(frozen=True, slots=True)
class Release:
    """P may free the blocks of ``transfer_id`` (reported as ``finished_sending``)."""

    transfer_id: str
    state: SendState


Effect = Reply | StartSend | Release


@dataclass(slots=True)
class _Claim:
    """One D worker's pull of a transfer, not answered yet."""

    identity: bytes
    pull: PullRequest
    writing: bool = False


@dataclass(slots=True)
class _Entry:
    state: SendState
    since: float
    blocks: BlockIds | None = None
    #: Pulls not answered yet: all waiting while PENDING, all being written while SENDING.
    claims: list[_Claim] = field(default_factory=list)
    expected: int = 0  # pulls this transfer gets in all (0: none arrived yet)
    answered: int = 0  # pulls answered by a write
    pulled_by: set[int] = field(default_factory=set)  # D tp ranks whose pull arrived
    error: str = ""  # the first failed write's
    #: P dropped it or D cancelled while writes were in flight: how it ends after them.
    giving_up: SendState | None = None
    reason: str = ""
    had_blocks: bool = False
    #: The deadline queue this entry is in (None: SENDING has no deadline).
    timer: OrderedDict[str, float] | None = None


@dataclass(frozen=True, slots=True)
class SendTableStats:
    live: int
    tombstones: int
    sent: int
    failed: int
    expired: int
    timed_out: int


class SendTable:
    """The rendezvous table of one P worker (see the module docstring for the rules)."""

    def __init__(self, *, ready_timeout: float, unclaimed_ttl: float, tombstone_ttl: float):
        self.ready_timeout = ready_timeout
        self.unclaimed_ttl = unclaimed_ttl
        self.tombstone_ttl = tombstone_ttl
        self._entries: dict[str, _Entry] = {}
        self._counts = {s: 0 for s in SendState}
        # Deadline queues, transfer id -> deadline, each in deadline order (see the module doc).
        self._no_pull: OrderedDict[str, float] = OrderedDict()  # PENDING, no pull yet
        self._pulls: OrderedDict[str, float] = OrderedDict()  # PENDING, D's pull waits
        self._unclaimed: OrderedDict[str, float] = OrderedDict()  # READY
        self._tombstones: OrderedDict[str, float] = OrderedDict()  # ended

    # ------------------------------------------------------------------ queries

    def state(self, transfer_id: str) -> SendState | None:
        """The state of ``transfer_id``, or None when unknown (or forgotten)."""
        entry = self._entries.get(transfer_id)
        return entry.state if entry else None

    def statistics(self) -> SendTableStats:
        return SendTableStats(
            live=len(self._entries) - len(self._tombstones),
            tombstones=len(self._tombstones),
            sent=self._counts[SendState.DONE],
            failed=self._counts[SendState.FAILED],
            expired=self._counts[SendState.EXPIRED],
            timed_out=self._counts[SendState.TIMED_OUT],
        )

    # ------------------------------------------------------------------ P's engine

    def prefill_started(self, transfer_id: str, now: float) -> list[Effect]:
        """P scheduled the prefill of ``transfer_id``."""
        entry = self._entries.get(transfer_id)
        if entry is None:
            self._new_pending(transfer_id, now)
        elif entry.state in (SendState.READY, SendState.SENDING):
            raise IllegalTransition(f"{transfer_id}: started again while {entry.state.value}")
        return []

    def prefill_ready(self, transfer_id: str, blocks: BlockIds, now: float) -> list[Effect]:
        """P finished the prefill; its KV is in ``blocks`` until a :class:`Release`."""
        entry = self._entries.get(transfer_id)
        if entry is None:
            entry = self._new_pending(transfer_id, now)
        if entry.had_blocks:
            raise IllegalTransition(f"{transfer_id}: ready again ({entry.state.value})")
        entry.had_blocks = True
        if entry.state.ended:
            # D gave up (or P dropped it) before the KV was ready: nobody will pull it.
            return [Release(transfer_id, entry.state)]
        entry.blocks = blocks
        if entry.claims:
            return self._start_sends(transfer_id, entry, now)
        self._move(transfer_id, entry, SendState.READY, now)
        return []

    def prefill_streaming(self, transfer_id: str, blocks: BlockIds, now: float) -> list[Effect]:
        """P begins computing the KV of ``transfer_id`` into ``blocks`` now, layer by layer.

        If D's pull is waiting (and it is the only one the transfer gets), the write starts at
        once, streamed (SENDING; the actor then takes P's word that the prefill is done
        itself, not through :meth:`prefill_ready`). Otherwise nothing changes:
        :meth:`prefill_ready` sends the whole KV as usual.
        """
        entry = self._entries.get(transfer_id)
        if entry is None or entry.state is not SendState.PENDING or entry.expected != 1:
            return []
        if not entry.claims:
            return []
        if entry.had_blocks:
            raise IllegalTransition(f"{transfer_id}: streaming after its KV was ready")
        entry.had_blocks = True
        entry.blocks = blocks
        return self._start_sends(transfer_id, entry, now, streamed=True)

    def prefill_dropped(self, transfer_id: str, now: float, reason: str = "") -> list[Effect]:
        """P will not finish ``transfer_id`` (aborted, failed); a waiting D hears at once."""
        return self._give_up(transfer_id, SendState.DROPPED, now, reason)

    # ------------------------------------------------------------------ D's side channel

    def pull_arrived(
        self,
        transfer_id: str,
        identity: bytes,
        pull: PullRequest,
        now: float,
        *,
        expected: int = 1,
    ) -> list[Effect]:
        """D asks for ``transfer_id``; answered now, when P is ready, or at the deadline.

        ``expected``: how many D workers pull this transfer from this P worker (D's shape
        says; each D tp rank once).
        """
        entry = self._entries.get(transfer_id)
        if entry is None:
            entry = self._new_pending(transfer_id, now)
        if entry.state.ended or entry.giving_up is not None:
            reason = entry.reason or _END_REASONS[entry.giving_up or entry.state]
            return [Reply(identity, PullFailed(transfer_id, reason))]
        if entry.error:  # a write failed: it ends FAILED once the others are done
            return [Reply(identity, PullFailed(transfer_id, entry.error))]
        for claim in entry.claims:
            if claim.identity == identity and _same_pull(pull, claim.pull):
                return []  # the same request again (a resend): the first one is answered
        if pull.tp_rank in entry.pulled_by:
            return [Reply(identity, PullFailed(transfer_id, "duplicate pull for this transfer"))]
        if entry.expected and expected != entry.expected:
            reason = f"D's pulls disagree on its shape ({entry.expected} vs {expected} pullers)"
            return [Reply(identity, PullFailed(transfer_id, reason))]
        entry.expected = expected
        entry.pulled_by.add(pull.tp_rank)
        claim = _Claim(identity, pull)
        entry.claims.append(claim)
        if entry.blocks is not None:  # READY, or SENDING another D's pull
            return self._start_sends(transfer_id, entry, now)
        if entry.timer is not self._pulls:
            self._arm(transfer_id, entry, self._pulls, now + self.ready_timeout)
        return []

    def peer_gone(self, identity: bytes, now: float, reason: str = "") -> list[Effect]:
        """The D worker behind ``identity`` is gone (its side channel closed or went silent).

        Every transfer with a pull of its waiting for P's KV ends as CANCELLED (other D
        workers waiting for it are told); P's blocks are released now, or as soon as they are
        ready (the tombstone). A write in flight runs to its end, which releases the blocks.
        """
        reason = "the pulling D worker is gone" + (f": {reason}" if reason else "")
        effects: list[Effect] = []
        # Only PENDING entries have waiting pulls: they are all in the pull queue.
        for tid in [t for t in self._pulls if _has_claim_from(self._entries[t], identity)]:
            entry = self._entries[tid]
            entry.claims = [c for c in entry.claims if c.identity != identity]  # no answer
            effects += self._end(tid, entry, SendState.CANCELLED, now, reason)
        return effects

    def pull_cancelled(
        self, transfer_id: str, identity: bytes, now: float, reason: str = ""
    ) -> list[Effect]:
        """D gave up on ``transfer_id``: free P's blocks now or as soon as they are ready.

        D waits for P's word that its blocks are no longer being written: answered at once,
        or by the reply of its write in flight.
        """
        entry = self._entries.get(transfer_id)
        writing = False
        if entry is not None:
            writing = any(c.writing and c.identity == identity for c in entry.claims)
            entry.claims = [c for c in entry.claims if c.writing or c.identity != identity]
        effects = self._give_up(transfer_id, SendState.CANCELLED, now, reason)
        if not writing:
            effects.append(Reply(identity, PullFailed(transfer_id, "cancelled")))
        return effects

    # ------------------------------------------------------------------ the actor's write

    def send_finished(
        self,
        transfer_id: str,
        now: float,
        *,
        identity: bytes | None = None,
        error: str | None = None,
        nbytes: int = 0,
        descriptors: int = 0,
    ) -> list[Effect]:
        """The write started by :class:`StartSend` for the D worker behind ``identity`` ended
        (``error`` None: it landed). ``identity`` may be left out while one write is in
        flight."""
        entry = self._entries.get(transfer_id)
        writes = [c for c in entry.claims if c.writing] if entry is not None else []
        if entry is None or entry.state is not SendState.SENDING:
            state = entry.state.value if entry else "unknown"
            raise IllegalTransition(f"{transfer_id}: send finished while {state}")
        if identity is not None:
            writes = [c for c in writes if c.identity == identity]
        if len(writes) != 1:
            raise IllegalTransition(f"{transfer_id}: {len(writes)} writes match this end")
        claim = writes[0]
        entry.claims.remove(claim)
        entry.answered += 1
        if error is None:
            reply: Msg = PullDone(transfer_id, nbytes, descriptors)
        else:
            reply = PullFailed(transfer_id, error)
            entry.error = entry.error or error
        effects: list[Effect] = [Reply(claim.identity, reply)]
        if entry.claims:  # other D workers' writes are in flight
            return effects
        if entry.error:
            return effects + self._end(transfer_id, entry, SendState.FAILED, now, entry.error)
        if entry.answered >= entry.expected:
            return effects + self._end(transfer_id, entry, SendState.DONE, now, "")
        if entry.giving_up is not None:
            return effects + self._end(transfer_id, entry, entry.giving_up, now, entry.reason)
        self._move(transfer_id, entry, SendState.READY, now)  # more D workers will pull it
        return effects

    # ------------------------------------------------------------------ time

    def tick(self, now: float) -> list[Effect]:
        """Time out waiting pulls, expire unclaimed KV, forget old tombstones."""
        effects: list[Effect] = []
        ready_timeout = f"{self.ready_timeout:g} s"
        for tid in _due(self._pulls, now):
            reason = f"P's prefill was not ready within {ready_timeout}"
            effects += self._end(tid, self._entries[tid], SendState.TIMED_OUT, now, reason)
        for tid in _due(self._no_pull, now):
            reason = f"no pull and no ready KV within {ready_timeout}"
            effects += self._end(tid, self._entries[tid], SendState.EXPIRED, now, reason)
        for tid in _due(self._unclaimed, now):
            reason = f"P's KV expired: no pull within {self.unclaimed_ttl:g} s"
            effects += self._end(tid, self._entries[tid], SendState.EXPIRED, now, reason)
        for tid in _due(self._tombstones, now):
            del self._tombstones[tid]
            del self._entries[tid]
        return effects

    # ------------------------------------------------------------------ internals

    def _give_up(self, transfer_id: str, state: SendState, now: float, reason: str) -> list[Effect]:
        """P (DROPPED) or D (CANCELLED) gave up: end a live transfer, or leave a tombstone."""
        reason = _END_REASONS[state] + (f": {reason}" if reason else "")
        entry = self._entries.get(transfer_id)
        if entry is None:
            entry = self._entries[transfer_id] = _Entry(state, now, reason=reason)
            self._arm(transfer_id, entry, self._tombstones, now + self.tombstone_ttl)
            self._counts[state] += 1
            return []
        if entry.state.ended:
            return []
        if entry.state is SendState.SENDING:
            # A write in flight cannot be stopped; its end ends the transfer and frees blocks.
            if entry.giving_up is None:
                entry.giving_up, entry.reason = state, reason
            return []
        return self._end(transfer_id, entry, state, now, reason)

    def _new_pending(self, transfer_id: str, now: float) -> _Entry:
        entry = self._entries[transfer_id] = _Entry(SendState.PENDING, now)
        self._arm(transfer_id, entry, self._no_pull, now + self.ready_timeout)
        return entry

    def _move(self, transfer_id: str, entry: _Entry, state: SendState, now: float) -> None:
        """Leave PENDING or READY for ``state``, with the deadline that state has."""
        entry.state, entry.since = state, now
        if state is SendState.READY:
            self._arm(transfer_id, entry, self._unclaimed, now + self.unclaimed_ttl)
        elif state is SendState.SENDING:
            self._arm(transfer_id, entry, None, 0.0)
        else:
            self._arm(transfer_id, entry, self._tombstones, now + self.tombstone_ttl)

    @staticmethod
    def _arm(
        transfer_id: str, entry: _Entry, queue: OrderedDict[str, float] | None, deadline: float
    ) -> None:
        """Move the entry's deadline to ``queue`` (None: no deadline)."""
        if entry.timer is not None:
            del entry.timer[transfer_id]
        entry.timer = queue
        if queue is not None:
            queue[transfer_id] = deadline

    def _start_sends(
        self, transfer_id: str, entry: _Entry, now: float, *, streamed: bool = False
    ) -> list[Effect]:
        """Write every pull that waits (P's blocks are known)."""
        assert entry.blocks is not None
        self._move(transfer_id, entry, SendState.SENDING, now)
        effects: list[Effect] = []
        for claim in entry.claims:
            if not claim.writing:
                claim.writing = True
                effects.append(
                    StartSend(transfer_id, claim.pull, entry.blocks, streamed, claim.identity)
                )
        return effects

    def _end(
        self, transfer_id: str, entry: _Entry, state: SendState, now: float, reason: str
    ) -> list[Effect]:
        """Move a live entry to the end ``state``: answer waiting pulls, release blocks."""
        reply = PullFailed(transfer_id, reason or _END_REASONS[state])
        effects: list[Effect] = [Reply(c.identity, reply) for c in entry.claims if not c.writing]
        if entry.blocks is not None:
            effects.append(Release(transfer_id, state))
        self._move(transfer_id, entry, state, now)
        entry.reason, entry.blocks, entry.claims = reason, None, []
        entry.pulled_by = set()
        self._counts[state] += 1
        return effects


def _same_pull(a: PullRequest, b: PullRequest) -> bool:
    """The same request, whether or not one of them carried D's layout."""
    return (a.session, a.block_ids, a.layout_id) == (b.session, b.block_ids, b.layout_id)


def _has_claim_from(entry: _Entry, identity: bytes) -> bool:
    return any(c.identity == identity for c in entry.claims)


def _due(queue: OrderedDict[str, float], now: float) -> list[str]:
    """The ids at the head of a deadline-ordered queue whose deadline has come."""
    due = []
    for tid, deadline in queue.items():
        if deadline > now:
            break
        due.append(tid)
    return due
