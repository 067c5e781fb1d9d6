"""How long an actor's operations took (a sender's writes, a receiver's pulls), as a frozen
record a reader in any thread can diff: trio's ``statistics()`` shape, never a shared deque
that readers drain."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

__all__ = ["DurationStatistics", "Durations"]

#: Durations a record keeps: readers that fall further behind miss the oldest (the count
#: still says how many there were).
RECENT = 1024


@dataclass(frozen=True, slots=True)
class DurationStatistics:
    """``count`` operations took a duration since the actor started; ``recent`` holds the
    newest of them in seconds, oldest first (at most :data:`RECENT`)."""

    count: int
    recent: tuple[float, ...]

    def since(self, seen: int) -> tuple[float, ...]:
        """The durations recorded after the first ``seen`` (a previous record's ``count``),
        as far as ``recent`` still holds them."""
        fresh = self.count - seen
        if fresh <= 0:
            return ()
        return self.recent[-fresh:]


class Durations:
    """The actor's side: append-only, read as :class:`DurationStatistics` (Trio thread)."""

    __slots__ = ("_count", "_recent")

    def __init__(self) -> None:
        self._count = 0
        self._recent: deque[float] = deque(maxlen=RECENT)

    def add(self, seconds: float) -> None:
        self._count += 1
        self._recent.append(seconds)

    def statistics(self) -> DurationStatistics:
        return DurationStatistics(self._count, tuple(self._recent))
