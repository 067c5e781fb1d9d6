"""Logging refused requests (and connections closed on a client) for operators: one line per
client per interval, not per request.

A scanner or a misconfigured client is refused on every request; the log gets its first
refusal, then at most one line per ``interval`` for it, each saying how many refusals it
stood for. What the client sent is logged escaped (``%r``), so a newline in it cannot forge a
log line.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

__all__ = ["REFUSAL_LOG_INTERVAL", "RefusalLog"]

#: Seconds between two log lines about the same refused client.
REFUSAL_LOG_INTERVAL: Final = 60.0


@dataclass
class _Client:
    logged: float  # when its last line was written
    unlogged: int = 0  # refusals since


class RefusalLog:
    """Refusals of one door (``what``), logged at WARNING on ``log`` once per client per
    ``interval``. Bounded: past ``max_clients`` clients it forgets them all at once (a client
    may then be logged again early, which only repeats a line)."""

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        *,
        interval: float = REFUSAL_LOG_INTERVAL,
        max_clients: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = log
        self._what = what
        self._interval = interval
        self._max_clients = max_clients
        self._clock = clock
        self._clients: dict[str, _Client] = {}

    def refused(self, client: str, status: int, reason: str) -> None:
        """Note that ``client`` was answered ``status`` because of ``reason``; log it if this
        client's last line is older than the interval."""
        if (more := self._due(client)) is not None:
            self._log.warning("%s refused %s: %d %r%s", self._what, client, status, reason, more)

    def closed(self, client: str, reason: str) -> None:
        """Note that a connection of ``client`` was closed, with no answer, because of
        ``reason``; logged as :meth:`refused` is (the same interval per client)."""
        if (more := self._due(client)) is not None:
            self._log.warning(
                "%s closed a connection of %s: %r%s", self._what, client, reason, more
            )

    def _due(self, client: str) -> str | None:
        """None when ``client``'s last line is younger than the interval (counted); else the
        line's tail, saying how many refusals it stands for."""
        now = self._clock()
        seen = self._clients.get(client)
        if seen is not None and now - seen.logged < self._interval:
            seen.unlogged += 1
            return None
        if seen is None and len(self._clients) >= self._max_clients:
            self._clients.clear()
        self._clients[client] = _Client(now)
        return f" (+{seen.unlogged} since its last line)" if seen and seen.unlogged else ""
