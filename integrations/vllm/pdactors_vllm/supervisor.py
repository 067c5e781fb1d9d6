"""Restart supervision of a worker's Trio thread: when the thread dies, start it again on a
daemon thread (1 s, 2 s, 4 s apart), unless the connector has closed meanwhile.

The *closed* flag is the point: once :meth:`Supervisor.close` has begun, no restart starts a
thread, and one that was starting is closed again, so a shutdown leaks no thread, Mooncake
engine or bootstrap lease. ``close`` waits for the restart thread, which the flag wakes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from pdactors.errors import PdError
from pdactors.host import TrioHost

__all__ = ["RESTART_DELAYS", "SHUTDOWN_TIMEOUT", "Supervisor"]

log = logging.getLogger("pdactors.vllm")

SHUTDOWN_TIMEOUT = 10.0
#: Waits before each restart of a dead Trio thread; after the last failed one, give up.
RESTART_DELAYS = (1.0, 2.0, 4.0)


class Supervisor:
    """Owns the worker's :class:`TrioHost`: starts it, restarts it after a death, closes it.

    ``name`` names the worker in log lines.
    ``start`` makes and starts a host (raising when it cannot); ``on_up`` is called after a
    restart succeeded. Every method may be called from any thread.
    """

    def __init__(
        self,
        name: str,
        start: Callable[[], TrioHost],
        on_up: Callable[[], object],
        delays: Sequence[float] = RESTART_DELAYS,
    ) -> None:
        self._name = name
        self._start = start
        self._on_up = on_up
        self._delays = tuple(delays)
        self._lock = threading.Lock()
        self._host: TrioHost | None = None
        self._closed = threading.Event()
        self._restarter: threading.Thread | None = None

    @property
    def host(self) -> TrioHost | None:
        """The running host (None before the first start, and once closed)."""
        with self._lock:
            return self._host

    def start(self) -> None:
        """Start the first host (blocks until it runs). Raises whatever ``start`` raises, and
        :class:`PdError` once closed."""
        host = self._start()
        if not self._adopt(host):
            raise PdError("the connector was shut down")

    def died(self) -> None:
        """The host's thread died: restart it on a daemon thread (unless closed)."""
        with self._lock:
            if self._closed.is_set():
                return
            self._restarter = threading.Thread(
                target=self._restart, name="pdactors-restart", daemon=True
            )
            self._restarter.start()

    def close(self, timeout: float = SHUTDOWN_TIMEOUT) -> None:
        """No restart from now on; stop the restart thread and the host (each bounded by
        ``timeout``). A host that died is not an error here: its death was logged. Raises
        :class:`PdError` when the host does not stop in time."""
        with self._lock:
            self._closed.set()
            restarter, host, self._host = self._restarter, self._host, None
        if restarter is not None:
            restarter.join(timeout)
        if host is not None:
            _close(host, timeout)

    def _adopt(self, host: TrioHost) -> bool:
        """Make ``host`` the running one, unless closed: then close it; says which."""
        with self._lock:
            if not self._closed.is_set():
                self._host = host
                return True
        _close(host, SHUTDOWN_TIMEOUT)
        return False

    def _restart(self) -> None:
        with self._lock:
            old, self._host = self._host, None
        if old is not None:
            _close(old, SHUTDOWN_TIMEOUT)
        for attempt, delay in enumerate(self._delays, 1):
            if self._closed.wait(delay):
                return
            try:
                host = self._start()
            except Exception as exc:  # logged; the next attempt may succeed
                log.error("%s: restart %d failed: %s", self._name, attempt, exc)
                continue
            if self._adopt(host):
                self._on_up()
                log.warning("%s: actors restarted", self._name)
            return
        log.error(
            "%s: gave up restarting the actors; every transfer fails until the server is restarted",
            self._name,
        )


def _close(host: TrioHost, timeout: float) -> None:
    """Close ``host``; a death it reports was logged when it happened."""
    try:
        host.close(timeout=timeout)
    except PdError as exc:
        if exc.__cause__ is None:  # it did not stop in time (a death carries its cause)
            raise
