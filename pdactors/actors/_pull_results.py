"""How the engine hears how its pulls ended: :class:`PullResults`, gathered between two
:meth:`~pdactors.actors.receiver.Receiver.take_results`.

A pull reported landed early (through its ``on_landed``, by the notices thread of
:mod:`pdactors.actors._landed_notices`) is not reported again when it ends in Trio: neither as
delivered (it was, once) nor as failed (its KV did land whole: P sends the notice only once its
write returned 0, so a later abort or loss of P only ends the pull's bookkeeping). Its id comes
back in :attr:`PullResults.early`, for the engine to forget what it kept for the pull.
An awaiting caller hears its own pull's end through a :class:`Waiter`.
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

from pdactors import timeline
from pdactors._pulse import Pulse
from pdactors.core.pull_table import Completed

__all__ = ["PullReports", "PullResults", "Waiter", "end_span"]


@dataclass(frozen=True, slots=True)
class PullResults:
    """Pulls that ended since the last :meth:`Receiver.take_results`: ``finished`` (delivered),
    ``failed`` (with why), and ``early``: pulls that ended (either way) after their
    ``on_landed`` had reported them landed, which are in neither of the others."""

    finished: frozenset[str]
    failed: dict[str, str]
    early: frozenset[str] = frozenset()


class PullReports:
    """The ends of pulls started with ``start_pull``, until they are taken."""

    def __init__(self) -> None:
        self._finished: set[str] = set()
        self._failed: dict[str, str] = {}
        self._early: set[str] = set()
        self._changed = Pulse()

    def add(self, done: Completed, *, landed_early: bool) -> None:
        """``done`` ended a pull; ``landed_early``: its ``on_landed`` reported it already."""
        if landed_early:
            self._early.add(done.transfer_id)
        elif done.ok:
            self._finished.add(done.transfer_id)
        else:
            self._failed[done.transfer_id] = done.reason
        self._changed.fire()

    def take(self) -> PullResults:
        results = PullResults(frozenset(self._finished), self._failed, frozenset(self._early))
        self._finished, self._failed, self._early = set(), {}, set()
        return results

    async def wait(self) -> PullResults:
        """Wait until some pull ended, then take the results. Checkpoint."""
        while not (self._finished or self._failed or self._early):
            await self._changed.wait()
        await trio.lowlevel.checkpoint()
        return self.take()


class Waiter:
    """How an awaiting ``Receiver.pull`` hears its pull's end (kept in the pull's record)."""

    __slots__ = ("done", "result")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.result: Completed | None = None


def end_span(done: Completed, now: float) -> None:
    """The pull's span to the timeline's watchers, if any (``now``: Trio's clock)."""
    pull = done.pull
    if pull is not None:
        timeline.span_done(done.transfer_id, "pull", now - pull.started, nbytes=pull.nbytes,
                           peer=pull.engine_id, outcome=done.reason or "ok")  # fmt: skip
