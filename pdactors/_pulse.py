"""A re-armable wake-up: :class:`Pulse` wakes every task waiting for the next change."""

from __future__ import annotations

import trio

__all__ = ["Pulse"]


class Pulse:
    """Like :class:`trio.Event`, but :meth:`fire` re-arms it: waiters wait for the *next* fire.

    Use it as ``while not condition(): await pulse.wait()`` with ``pulse.fire()`` after every
    change to the condition.
    """

    def __init__(self) -> None:
        self._event = trio.Event()

    def fire(self) -> None:
        """Wake the tasks waiting now. Not a checkpoint."""
        self._event.set()
        self._event = trio.Event()

    async def wait(self) -> None:
        """Wait for the next :meth:`fire`. Checkpoint."""
        await self._event.wait()
