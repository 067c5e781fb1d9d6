"""The sender's clock: it ticks the send table when the table's next deadline comes.

The loop sleeps until then and is re-armed by every operation that may have added an earlier
deadline (:meth:`Ticks.rearm`, cheap: the table says whether a deadline queue went from empty
to not). Deadlines due within ``tick_interval`` of the last tick share the next one: at
thousands of transfers a second each end's tombstone would otherwise wake the loop on its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import trio

from pdactors.core.send_table import Effect, SendTable

__all__ = ["Ticks"]


class Ticks:
    """Ticks ``table`` at its deadlines and hands the effects to ``apply``."""

    def __init__(
        self, table: SendTable, tick_interval: float, apply: Callable[[list[Effect]], None]
    ) -> None:
        self._table = table
        self._interval = tick_interval
        self._apply = apply
        self._ticker: trio.CancelScope | None = None  # the loop's wait for the next deadline
        self._last_tick = -math.inf

    async def serve(self) -> None:
        """Tick the table at its deadlines, until cancelled."""
        while True:
            with trio.CancelScope() as self._ticker:
                self.rearm(force=True)
                await trio.sleep_forever()
            self._ticker = None
            self._last_tick = trio.current_time()
            self._apply(self._table.tick(self._last_tick))

    def rearm(self, *, force: bool = False) -> None:
        """Move the loop's wake-up to the table's next deadline, if that is earlier. Not a
        checkpoint."""
        if self._ticker is None or not (self._table.take_deadline_lowered() or force):
            return
        at = max(self._table.next_deadline(), self._last_tick + self._interval)
        if force or at < self._ticker.deadline:
            self._ticker.deadline = at
