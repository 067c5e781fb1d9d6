"""Doing something the first time a key is seen only: logging a refusal once per peer."""

from __future__ import annotations

from collections.abc import Hashable

__all__ = ["FirstTimes"]


class FirstTimes:
    """Which keys were seen. Bounded: past ``limit`` keys it forgets them all at once (a key
    may then count as new again, which only repeats a log line)."""

    def __init__(self, limit: int = 4096) -> None:
        self._limit = limit
        self._seen: set[Hashable] = set()

    def first(self, key: Hashable) -> bool:
        """True the first time ``key`` is seen (since it was forgotten)."""
        if key in self._seen:
            return False
        if len(self._seen) >= self._limit:
            self._seen.clear()
        self._seen.add(key)
        return True

    def forget(self, key: Hashable) -> None:
        self._seen.discard(key)
