"""The send table's mechanics: its records, its deadline queues, and the moves every
operation of :class:`~pdactors.core.send_table.SendTable` is made of (fire an event through
the rules, end a transfer, give it up, start its writes).

The operations themselves, and the rules they follow, are in
:mod:`pdactors.core.send_table` and :mod:`pdactors.core.send_rules`.
"""

from __future__ import annotations

from pdactors.core.send_records import END_REASONS, Effect, Entry, Release, Reply, StartSend
from pdactors.core.send_rules import Do, SendEvent, SendState, next_state
from pdactors.core.send_timers import Timers
from pdactors.wire import PullFailed

__all__ = ["SendMoves"]


class SendMoves:
    """The state of one P worker's send table and the moves its operations are made of."""

    def __init__(self, *, ready_timeout: float, unclaimed_ttl: float, tombstone_ttl: float):
        self.ready_timeout = ready_timeout
        self.unclaimed_ttl = unclaimed_ttl
        self.tombstone_ttl = tombstone_ttl
        self._entries: dict[str, Entry] = {}
        self._counts = {s: 0 for s in SendState}
        self._timers = Timers(
            ready_timeout=ready_timeout, unclaimed_ttl=unclaimed_ttl, tombstone_ttl=tombstone_ttl
        )

    def _fire(self, transfer_id: str, event: SendEvent, now: float) -> tuple[Entry | None, Do]:
        """Move ``transfer_id`` as :data:`~pdactors.core.send_rules.TRANSITIONS` says (a new
        state starts its own deadline); the entry after the move, and what the move does."""
        entry = self._entries.get(transfer_id)
        state, do = next_state(transfer_id, entry.state if entry else None, event)
        if state is None:  # forgotten
            if entry is not None:
                self._timers.arm(transfer_id, entry, None, 0.0)
                del self._entries[transfer_id]
            return None, do
        if entry is None:
            entry = self._entries[transfer_id] = Entry(state)
            self._timers.enter(transfer_id, entry, now)
        elif state is not entry.state:
            entry.state = state
            self._timers.enter(transfer_id, entry, now)
        if do is Do.WAIT:
            self._timers.pull_waits(transfer_id, entry, now)
        return entry, do

    def _give_up(self, transfer_id: str, event: SendEvent, now: float, reason: str) -> list[Effect]:
        """P (DROPPED) or D (CANCELLED) gave up: end a live transfer, or leave a tombstone; a
        write in flight cannot be stopped: its end ends the transfer and frees blocks."""
        gives_up = SendState.DROPPED if event is SendEvent.DROPPED else SendState.CANCELLED
        reason = END_REASONS[gives_up] + (f": {reason}" if reason else "")
        entry = self._entries.get(transfer_id)
        if entry is not None and entry.state is SendState.SENDING:
            self._fire(transfer_id, event, now)  # DEFER
            if entry.giving_up is None:
                entry.giving_up, entry.reason = gives_up, reason
            return []
        return self._end(transfer_id, event, now, reason)

    def _end(self, transfer_id: str, event: SendEvent, now: float, reason: str) -> list[Effect]:
        """Fire ``event``; when it ends the transfer, answer waiting pulls, release blocks."""
        entry, do = self._fire(transfer_id, event, now)
        if do is not Do.END:
            return []
        assert entry is not None
        state = entry.state
        reply = PullFailed(transfer_id, reason or END_REASONS[state])
        effects: list[Effect] = [Reply(c.identity, reply) for c in entry.claims if not c.writing]
        if entry.blocks is not None:
            effects.append(Release(transfer_id, state))
        entry.reason, entry.blocks, entry.complete, entry.claims = reason, None, None, []
        entry.pulled_by = set()
        self._counts[state] += 1
        return effects

    def _start_sends(
        self, transfer_id: str, entry: Entry, *, streamed: bool = False
    ) -> list[Effect]:
        """Write every pull that waits (P's blocks are known; the entry is SENDING)."""
        assert entry.blocks is not None
        effects: list[Effect] = []
        for claim in entry.claims:
            if not claim.writing:
                claim.writing = True
                job = StartSend(
                    transfer_id, claim.pull, entry.blocks, streamed, claim.identity, entry.complete
                )
                effects.append(job)
        return effects
