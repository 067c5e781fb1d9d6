"""The cross-thread mailbox between vLLM's thread and the worker's Trio thread.

vLLM's thread posts each step's work (:class:`StepWork`) and, until the Trio thread applies
it, the mailbox holds it: should the thread die first, that work is failed, not lost. The Trio
thread adds transfer results and counters; vLLM's thread takes them each step. One lock
guards it all; nothing here waits on the network.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pdactors import timeline
from pdactors_vllm.counters import TransferCounters
from pdactors_vllm.scheduler_side import PullSpec, SendSpec

__all__ = ["Mailbox", "StepWork"]


@dataclass(eq=False)
class StepWork:
    """A step's work for the actors, as the worker posts it (worker-local, never sent)."""

    pending: list[str] = field(default_factory=list)  # P: transfer ids whose prefill started
    ready: dict[str, SendSpec] = field(default_factory=dict)  # P: req id -> KV to send
    streams: dict[str, SendSpec] = field(default_factory=dict)  # P: streamed layer by layer
    dropped: list[str] = field(default_factory=list)  # P: transfer ids never ready
    pulls: dict[str, PullSpec] = field(default_factory=dict)  # D: req id -> what to pull
    aborts: dict[str, str] = field(default_factory=dict)  # D: req id -> transfer id

    def releases(self) -> tuple[set[str], set[str]]:
        """(P requests whose blocks may be freed, D requests whose pull fails) when the actors
        cannot take this work."""
        pulls = {req for req, pull in self.pulls.items() if not pull.notify_only}
        return set(self.ready) | set(self.streams), pulls


Results = tuple[set[str], set[str], set[str]]


class Mailbox:
    """Results for vLLM's next ``get_finished``, work not yet applied, and why the actors are
    down (None: they run). Every method may be called from any thread."""

    def __init__(self, on_result: Callable[[], object] = lambda: None) -> None:
        """``on_result``: called (outside the lock, from the adding thread) when results
        are added."""
        self._on_result = on_result
        self._lock = threading.Lock()
        self._sent: set[str] = set()
        self._recved: set[str] = set()
        self._failed: set[str] = set()
        self._results_ready = threading.Event()  # set when any of the three sets grows
        self._unapplied: deque[StepWork] = deque()
        self._down: str | None = None
        self._landed: dict[str, str] = {}  # D req id -> transfer id, until reported (timeline)
        self._counters = TransferCounters()

    @property
    def down(self) -> str | None:
        """Why the actors are not running (None: they are)."""
        with self._lock:
            return self._down

    def set_down(self, reason: str | None) -> list[StepWork]:
        """The actors stopped (``reason``) or run again (None). Returns the work posted but
        not applied, which the caller fails: the thread that would apply it is gone."""
        with self._lock:
            self._down = reason
            unapplied = list(self._unapplied) if reason is not None else []
            if reason is not None:
                self._unapplied.clear()
            return unapplied

    def hold(self, work: StepWork) -> str | None:
        """Keep ``work`` until :meth:`applied`; returns why the actors are down instead (the
        work is then not kept)."""
        with self._lock:
            if self._down is None:
                self._unapplied.append(work)
            return self._down

    def applied(self, work: StepWork) -> None:
        """The Trio thread has taken ``work``."""
        with self._lock:
            self._unapplied.remove(work)

    def add(
        self,
        *,
        sent: Iterable[str] = (),
        recved: Iterable[str] = (),
        failed: Iterable[str] = (),
        landed: dict[str, str] | None = None,
        count: Callable[[TransferCounters], Any] | None = None,
    ) -> None:
        """Add requests to the next :meth:`take` (``landed``: their transfer ids, for the
        timeline) and ``count`` them; wakes a :meth:`take` that waits."""
        with self._lock:
            before = len(self._sent) + len(self._recved) + len(self._failed)
            self._sent.update(sent)
            self._recved.update(recved)
            self._failed.update(failed)
            if landed:
                self._landed.update(landed)
            if count is not None:
                count(self._counters)
            grew = len(self._sent) + len(self._recved) + len(self._failed) > before
            if grew:
                self._results_ready.set()
        if grew:
            self._on_result()

    def take(self, wait: float = 0.0) -> Results:
        """(finished_sending, finished_recving, failed_recving) since the last call; failed
        pulls are in ``finished_recving`` too. Waits up to ``wait`` seconds for a result when
        none is there yet, and returns as soon as one arrives."""
        if wait > 0 and not self._results_ready.is_set():
            self._results_ready.wait(wait)
        with self._lock:
            self._results_ready.clear()
            sent, self._sent = self._sent, set()
            recvd, self._recved = self._recved, set()
            failed, self._failed = self._failed, set()
            tids = [self._landed.pop(r) for r in recvd if r in self._landed]
        for tid in tids:
            timeline.mark(tid, "reported")
        return sent, recvd | failed, failed

    def take_counters(self) -> dict[str, Any]:
        """The counters since the last call, as connector-stats data."""
        with self._lock:
            return self._counters.take()

    def count(self, fn: Callable[[TransferCounters], Any]) -> None:
        """Apply ``fn`` to the counters under the lock."""
        with self._lock:
            fn(self._counters)
