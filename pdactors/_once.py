"""Doing something the first time a key is seen only, or once per interval: logging a refusal
once per peer."""

from __future__ import annotations

from collections.abc import Hashable

__all__ = ["Every", "FirstTimes"]


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


class Every:
    """Logging at most once per ``interval`` seconds per key, with a count of what was not
    logged: ``n = every.due(key, now)`` is None while the key's interval runs (the event is
    counted), else how many events of that key the line stands for (this one included).
    Bounded like :class:`FirstTimes`: past ``limit`` keys it forgets them all."""

    def __init__(self, interval: float, limit: int = 4096) -> None:
        self.interval = interval
        self._limit = limit
        self._keys: dict[Hashable, tuple[float, int]] = {}  # key -> (last logged, not logged)

    def due(self, key: Hashable, now: float) -> int | None:
        last = self._keys.get(key)
        if last is not None and now - last[0] < self.interval:
            self._keys[key] = (last[0], last[1] + 1)
            return None
        if last is None and len(self._keys) >= self._limit:
            self._keys.clear()
        self._keys[key] = (now, 0)
        return 1 + (last[1] if last is not None else 0)

    def forget(self, key: Hashable) -> None:
        self._keys.pop(key, None)
