"""P side: the rendezvous of D's pull and P's finished prefill, by ``transfer_id``.

Sans-IO: every method takes the current time, changes state, and returns the effects the
actor must carry out (:class:`Reply`, :class:`StartSend`, :class:`Release`, :class:`Wake`).
Nothing here blocks, sleeps or talks to the network. The deadlines are kept by
:mod:`pdactors.core.send_timers`; :meth:`SendTable.next_deadline` says when to tick next
(:meth:`SendTable.take_deadline_lowered`: whether it may have moved earlier, cheaply).

The rules — which event moves a transfer from which state to which, and what the move does —
are data: :data:`~pdactors.core.send_rules.TRANSITIONS`. In short: PENDING (P's prefill
started, or D's pull came first) → READY (P's KV is here, no pull yet) or SENDING (a pull met
P's KV; more pulls may join while writing) → DONE or FAILED; a pull that waits too long ends
TIMED_OUT, KV nobody pulls EXPIRED, P's drop DROPPED, D's cancel CANCELLED. Cancels and drops
wait for writes in flight (they cannot be stopped), then end the transfer.

One transfer may be pulled by several D workers (heterogeneous tensor parallelism: D ranks
that take different heads of one P rank). The first pull says how many will come
(``expected``; one unless D's shape says otherwise); each pull is written as soon as both it
and P's blocks are there, and the transfer ends once every expected pull was answered, or one
write failed. Between writes it waits, READY, for the pulls still to come.

An ended transfer stays a *tombstone* for ``tombstone_ttl``: a late pull is answered, a late
"ready" released at once. P's blocks are released exactly once for every READY transfer.
Anything else — a second "ready", a send result for a transfer not being sent — raises
:class:`IllegalTransition` (every change of state is looked up in the rules).

Layer-wise streaming is a state of the transfer's record too (:class:`Stream`, its rules in
:data:`~pdactors.core.send_rules.STREAM_TRANSITIONS`): the layers P reports complete queue
here until the actor's write task takes them, and P's last word (ready or dropped) is kept
here, so the actor keeps no map of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdactors.core.send_moves import SendMoves
from pdactors.core.send_records import (
    END_REASONS,
    WRITES_GIVEN_UP,
    Claim,
    Effect,
    Release,
    Reply,
    SendTableStats,
    StartSend,
    has_claim_from,
    refusal,
    same_pull,
    writes_into,
)
from pdactors.core.send_rules import Do, SendEvent, SendState, StreamEvent, next_state
from pdactors.core.send_stream import Complete, Layer, Stream, Wake, stream_event, take_layers
from pdactors.core.send_timers import due
from pdactors.errors import IllegalTransition
from pdactors.wire import BlockIds, Msg, PullDone, PullFailed, PullRequest

_LAYER, _READY, _DROP = StreamEvent.LAYER, StreamEvent.P_READY, StreamEvent.P_DROPPED

__all__ = [
    "Effect",
    "IllegalTransition",
    "Release",
    "Reply",
    "SendState",
    "SendTable",
    "SendTableStats",
    "StartSend",
    "Stream",
    "Wake",
]


class SendTable(SendMoves):
    """The rendezvous table of one P worker (see the module docstring for the rules)."""

    # ------------------------------------------------------------------ queries

    def state(self, transfer_id: str) -> SendState | None:
        """The state of ``transfer_id``, or None when unknown (or forgotten)."""
        entry = self._entries.get(transfer_id)
        return entry.state if entry else None

    def pulls_waiting(self, transfer_id: str) -> int:
        """How many D workers' pulls of ``transfer_id`` are not answered yet (0 when unknown)."""
        entry = self._entries.get(transfer_id)
        return len(entry.claims) if entry else 0

    def stream(self, transfer_id: str) -> Stream | None:
        """The streamed write of ``transfer_id`` (None: not streamed, or closed)."""
        entry = self._entries.get(transfer_id)
        return entry.stream if entry else None

    def next_deadline(self) -> float:
        """When :meth:`tick` next has something to do (``inf``: never, until something moves)."""
        return self._timers.next_deadline()

    def take_deadline_lowered(self) -> bool:  # since the last call
        return self._timers.take_lowered()

    def statistics(self) -> SendTableStats:
        """Transfers held now, and how many ended each way so far."""
        return SendTableStats(
            live=len(self._entries) - len(self._timers.tombstones),
            tombstones=len(self._timers.tombstones),
            sent=self._counts[SendState.DONE],
            failed=self._counts[SendState.FAILED],
            expired=self._counts[SendState.EXPIRED],
            timed_out=self._counts[SendState.TIMED_OUT],
        )

    # ------------------------------------------------------------------ P's engine

    def prefill_started(self, transfer_id: str, now: float) -> list[Effect]:
        """P scheduled the prefill of ``transfer_id``."""
        self._fire(transfer_id, SendEvent.STARTED, now)
        return []

    def prefill_ready(
        self, transfer_id: str, blocks: BlockIds, now: float, *, complete: Complete | None = None
    ) -> list[Effect]:
        """P finished the prefill; its KV is in ``blocks`` until a :class:`Release`
        (``complete``: the wait for it to be in memory, handed to the write). A streamed
        transfer's write sends the rest of its KV."""
        entry = self._entries.get(transfer_id)
        if entry is not None and entry.stream is not None:
            entry.stream, wakes = stream_event(transfer_id, entry.stream, _READY, complete=complete)
            return list(wakes)
        event = SendEvent.READY
        if entry is not None and entry.had_blocks:
            event = SendEvent.READY_AGAIN
        elif entry is not None and entry.claims:
            event = SendEvent.READY_PULLED
        entry, do = self._fire(transfer_id, event, now)
        assert entry is not None
        entry.had_blocks = True
        if do is Do.RELEASE:
            # D gave up (or P dropped it) before the KV was ready: nobody will pull it.
            return [Release(transfer_id, entry.state)]
        entry.blocks, entry.complete = blocks, complete
        return self._start_sends(transfer_id, entry) if do is Do.START else []

    def prefill_streaming(self, transfer_id: str, blocks: BlockIds, now: float) -> list[Effect]:
        """P begins computing the KV of ``transfer_id`` into ``blocks`` now, layer by layer.

        If D's pull is waiting (and it is the only one the transfer gets), the write starts at
        once, streamed (SENDING; P's layers then go to :meth:`layer_ready`, and its last word
        to :meth:`prefill_ready` or :meth:`prefill_dropped` as usual). Otherwise nothing
        changes: :meth:`prefill_ready` sends the whole KV as usual.
        """
        entry = self._entries.get(transfer_id)
        event = SendEvent.STREAM_UNPULLED
        if entry is not None and entry.claims and not entry.had_blocks and entry.expected == 1:
            event = SendEvent.STREAMING
        entry, do = self._fire(transfer_id, event, now)
        if do is not Do.START_STREAM:
            return []
        assert entry is not None
        entry.had_blocks, entry.blocks, entry.stream = True, blocks, Stream()
        return self._start_sends(transfer_id, entry, streamed=True)

    def layer_ready(
        self, transfer_id: str, regions: Sequence[int], complete: Complete | None = None
    ) -> list[Effect]:
        """P reports these layout regions complete (or once ``complete()`` returns); queued
        for the streamed write, ignored unless ``transfer_id`` is being streamed."""
        entry = self._entries.get(transfer_id)
        if entry is None or entry.stream is None:
            return []
        layer = (tuple(regions), complete)
        entry.stream, wakes = stream_event(
            transfer_id, entry.stream, StreamEvent.LAYER, layer=layer
        )
        return list(wakes)

    def take_layers(self, transfer_id: str, waiter: object) -> tuple[list[Layer], Stream]:
        """The streamed write takes the layers queued for it, and its record
        (:func:`~pdactors.core.send_stream.take_layers`)."""
        stream = self.stream(transfer_id)
        if stream is None:
            raise IllegalTransition(f"{transfer_id}: layers taken while not streamed")
        return take_layers(stream, waiter), stream

    def prefill_dropped(self, transfer_id: str, now: float, reason: str = "") -> list[Effect]:
        """P will not finish ``transfer_id`` (aborted, failed); a waiting D hears at once."""
        entry = self._entries.get(transfer_id)
        if entry is not None and entry.stream is not None:
            dropped = f"P dropped the prefill: {reason}" if reason else "P dropped it"
            entry.stream, wakes = stream_event(transfer_id, entry.stream, _DROP, failed=dropped)
            return list(wakes)
        return self._give_up(transfer_id, SendEvent.DROPPED, now, reason)

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
        if entry is not None and entry.state.ended:
            self._fire(transfer_id, SendEvent.PULL, now)  # REFUSE: an end answers at once
            reason = entry.reason or END_REASONS[entry.state]
            return [Reply(identity, PullFailed(transfer_id, reason))]
        if entry is not None:  # a live one: is this pull one it can take?
            if any(c.identity == identity and same_pull(pull, c.pull) for c in entry.claims):
                return []  # the same request again (a resend): the first one is answered
            if (refused := refusal(entry, pull, expected)) is not None:
                return [Reply(identity, PullFailed(transfer_id, refused))]
        blocks_here = entry is not None and entry.blocks is not None
        event = SendEvent.PULL_BLOCKS if blocks_here else SendEvent.PULL
        entry, do = self._fire(transfer_id, event, now)
        assert entry is not None
        entry.expected = expected
        entry.pulled_by.add(pull.tp_rank)
        entry.claims.append(Claim(identity, pull))
        return self._start_sends(transfer_id, entry) if do is Do.START else []

    def peer_gone(self, identity: bytes, now: float, reason: str = "") -> list[Effect]:
        """The D worker behind ``identity`` is gone (its side channel closed or went silent).

        Every transfer with a pull of its waiting for P's KV ends as CANCELLED (other D
        workers waiting for it are told); P's blocks are released now, or as soon as they are
        ready (the tombstone). A write in flight runs to its end, which releases the blocks.
        """
        reason = "the pulling D worker is gone" + (f": {reason}" if reason else "")
        effects: list[Effect] = []
        # Only PENDING entries have waiting pulls: they are all in the pull queue.
        for tid in [t for t in self._timers.pulls if has_claim_from(self._entries[t], identity)]:
            entry = self._entries[tid]
            entry.claims = [c for c in entry.claims if c.identity != identity]  # no answer
            effects += self._end(tid, SendEvent.PEER_GONE, now, reason)
        return effects

    def session_restarted(self, session: str, epoch: int, now: float, reason: str) -> list[Effect]:
        """D's data-plane ``session`` restarted as D epoch ``epoch`` (its first pull says so):
        every transfer with a pull of that session from another epoch waiting for P's KV ends
        as CANCELLED, as a lost D's would (its blocks belong to a dead process and are never
        written; P's are released now or as soon as ready). The old pull is answered
        ``reason``. A write already in flight cannot be stopped; it runs to its end."""
        effects: list[Effect] = []
        for tid in list(self._timers.pulls):  # only PENDING entries hold unanswered pulls
            entry = self._entries[tid]
            old = [c for c in entry.claims if c.pull.session == session and c.pull.d_epoch != epoch]
            if old:
                entry.claims = [c for c in entry.claims if c not in old]
                effects += [Reply(c.identity, PullFailed(tid, reason)) for c in old]
                effects += self._end(tid, SendEvent.PEER_GONE, now, reason)
        return effects

    def unreachable(self, now: float, reason: str) -> list[Effect]:
        """No D can find this P worker now (another registration holds its bootstrap rank):
        every READY transfer that no D has pulled yet ends as EXPIRED at once, its blocks
        released, instead of at ``unclaimed_ttl``; a late pull gets ``reason`` from the
        tombstone. Pulls already here, and writes, are not touched."""
        effects: list[Effect] = []
        for tid in [t for t in self._timers.unclaimed if not self._entries[t].pulled_by]:
            effects += self._end(tid, SendEvent.UNREACHABLE, now, reason)
        return effects

    def pull_cancelled(
        self, transfer_id: str, identity: bytes, now: float, reason: str = "", session: str = ""
    ) -> list[Effect]:
        """D gave up on ``transfer_id``: free P's blocks now or as soon as they are ready.

        D waits for P's word that its blocks are no longer being written: answered at once,
        or by the reply of its write in flight. With ``session`` (a D that lost the
        connection a write was for asks on a new one: its fence), answered once no write
        into that D memory is in flight, whichever connection its pull came on.
        """
        entry = self._entries.get(transfer_id)
        writing = fenced = False
        if entry is not None:
            writing = any(c.writing and c.identity == identity for c in entry.claims)
            fenced = bool(session) and any(writes_into(c, session) for c in entry.claims)
            entry.claims = [c for c in entry.claims if c.writing or c.identity != identity]
        effects = self._give_up(transfer_id, SendEvent.CANCELLED, now, reason)
        if fenced and not writing and entry is not None:
            entry.fence_waiters.append((identity, session))
        elif not writing:
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
        sums: bytes = b"",
    ) -> list[Effect]:
        """The write started by :class:`StartSend` for the D worker behind ``identity`` ended
        (``error`` None: it landed, with the checksums ``sums``). ``identity`` may be left out
        while one write is in flight."""
        entry = self._entries.get(transfer_id)
        writes = [c for c in entry.claims if c.writing] if entry is not None else []
        if identity is not None:
            writes = [c for c in writes if c.identity == identity]
        if entry is None or entry.state is not SendState.SENDING or len(writes) != 1:
            # Which pair was illegal: the write's end in this state, or this write.
            next_state(transfer_id, entry.state if entry else None, SendEvent.WRITE_ENDED)
            raise IllegalTransition(f"{transfer_id}: {len(writes)} writes match this end")
        claim = writes[0]
        entry.claims.remove(claim)
        entry.answered += 1
        if error is None:
            reply: Msg = PullDone(transfer_id, nbytes, descriptors, sums=sums)
        else:
            reply = PullFailed(transfer_id, error)
            entry.error = entry.error or error
        effects: list[Effect] = [Reply(claim.identity, reply)]
        for waiter in [w for w in entry.fence_waiters if w[1] == claim.pull.session]:
            if not any(writes_into(c, waiter[1]) for c in entry.claims):
                entry.fence_waiters.remove(waiter)  # that D memory is written no more
                effects.append(Reply(waiter[0], PullFailed(transfer_id, "cancelled")))
        if entry.stream is not None:
            entry.stream, _ = stream_event(transfer_id, entry.stream, StreamEvent.WRITER_ENDED)
        if entry.claims:  # other D workers' writes are in flight
            event, reason = SendEvent.WRITE_ENDED, ""
        elif entry.error:
            event, reason = SendEvent.WRITES_FAILED, entry.error
        elif entry.answered >= entry.expected:
            event, reason = SendEvent.WRITES_DONE, ""
        elif entry.giving_up is not None:
            event, reason = WRITES_GIVEN_UP[entry.giving_up], entry.reason
        else:
            event, reason = SendEvent.WRITES_PAUSED, ""  # more D workers will pull it
        return effects + self._end(transfer_id, event, now, reason)

    # ------------------------------------------------------------------ time

    def tick(self, now: float) -> list[Effect]:
        """Time out waiting pulls, expire unclaimed KV, forget old tombstones."""
        effects: list[Effect] = []
        ready_timeout = f"{self.ready_timeout:g} s"
        for tid in due(self._timers.pulls, now):
            reason = f"P's prefill was not ready within {ready_timeout}"
            effects += self._end(tid, SendEvent.PULL_DUE, now, reason)
        for tid in due(self._timers.no_pull, now):
            reason = f"no pull and no ready KV within {ready_timeout}"
            effects += self._end(tid, SendEvent.NO_PULL_DUE, now, reason)
        for tid in due(self._timers.unclaimed, now):
            reason = f"P's KV expired: no pull within {self.unclaimed_ttl:g} s"
            effects += self._end(tid, SendEvent.UNCLAIMED_DUE, now, reason)
        for tid in due(self._timers.tombstones, now):
            self._fire(tid, SendEvent.FORGET, now)
        return effects
