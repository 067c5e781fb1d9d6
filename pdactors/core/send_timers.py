"""The send table's deadlines: one insertion-ordered queue per kind of deadline.

Every deadline is ``now`` plus a constant of the table, so each kind of deadline comes due in
the order it was set: :class:`Timers` keeps one queue per kind (no pull and no KV yet, a pull
waiting for P's KV, unclaimed KV, tombstones), and the table's tick looks only at the heads
that are due. A tick costs what it ends, not what the table holds: at thousands of transfers
per second the tombstones alone are hundreds of thousands of entries. ``now`` must never go
backwards.
"""

from __future__ import annotations

from collections import OrderedDict

from pdactors.core.send_records import Entry
from pdactors.core.send_rules import SendState

__all__ = ["Timers", "due"]

Queue = OrderedDict[str, float]


class Timers:
    """The deadline queues of one send table (transfer id -> deadline, in deadline order)."""

    def __init__(self, *, ready_timeout: float, unclaimed_ttl: float, tombstone_ttl: float):
        self.ready_timeout = ready_timeout
        self.unclaimed_ttl = unclaimed_ttl
        self.tombstone_ttl = tombstone_ttl
        self.no_pull: Queue = OrderedDict()  # PENDING, no pull yet
        self.pulls: Queue = OrderedDict()  # PENDING, D's pull waits
        self.unclaimed: Queue = OrderedDict()  # READY
        self.tombstones: Queue = OrderedDict()  # ended
        #: a queue went from empty to not since :meth:`take_lowered`: only then can the
        #: earliest deadline have moved earlier (appending to a queue leaves its head alone)
        self.lowered = False

    def take_lowered(self) -> bool:
        """Whether :meth:`next_deadline` may have moved earlier since the last call."""
        lowered, self.lowered = self.lowered, False
        return lowered

    def next_deadline(self) -> float:
        """The earliest deadline of any queue (``inf`` when all are empty)."""
        queues = (self.no_pull, self.pulls, self.unclaimed, self.tombstones)
        return min((next(iter(q.values())) for q in queues if q), default=float("inf"))

    def enter(self, transfer_id: str, entry: Entry, now: float) -> None:
        """Start the deadline of the entry's new state (SENDING has none)."""
        if entry.state is SendState.PENDING:
            self.arm(transfer_id, entry, self.no_pull, now + self.ready_timeout)
        elif entry.state is SendState.READY:
            self.arm(transfer_id, entry, self.unclaimed, now + self.unclaimed_ttl)
        elif entry.state is SendState.SENDING:
            self.arm(transfer_id, entry, None, 0.0)
        else:
            self.arm(transfer_id, entry, self.tombstones, now + self.tombstone_ttl)

    def pull_waits(self, transfer_id: str, entry: Entry, now: float) -> None:
        """A pull waits for P's KV: it waits ``ready_timeout`` from the first one."""
        if entry.timer is not self.pulls:
            self.arm(transfer_id, entry, self.pulls, now + self.ready_timeout)

    def arm(self, transfer_id: str, entry: Entry, queue: Queue | None, deadline: float) -> None:
        """Move the entry's deadline to ``queue`` (None: no deadline)."""
        if entry.timer is not None:
            del entry.timer[transfer_id]
        entry.timer = queue
        if queue is not None:
            self.lowered = self.lowered or not queue
            queue[transfer_id] = deadline


def due(queue: Queue, now: float) -> list[str]:
    """The ids at the head of a deadline-ordered queue whose deadline has come."""
    due = []
    for tid, deadline in queue.items():
        if deadline > now:
            break
        due.append(tid)
    return due
