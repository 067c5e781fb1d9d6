"""TrioHost: a Trio run in a background thread, for synchronous callers (vLLM's hooks, tests).

One host per process is the intent: actors live in the host's nursery, and synchronous code
reaches them through :meth:`TrioHost.run` (await something in the Trio thread) and
:meth:`TrioHost.run_sync` (call a non-blocking function there).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from pdactors.errors import PdError

__all__ = ["TrioHost"]

T = TypeVar("T")

log = logging.getLogger("pdactors.host")


def _unpin_this_thread() -> None:
    """Let the calling thread, and every thread it starts from now on (Trio's worker threads,
    Mooncake's transport threads), run on any CPU. vLLM-CPU binds a worker's main thread to
    one core (``OMP_PROC_BIND``) and threads inherit their creator's affinity: without this
    Mooncake's one TCP I/O thread shares that core with the OpenMP thread and, on a host
    where a peer's busy-polling ``batch_transfer_sync_write`` thread is pinned there too,
    can get no CPU at all until Mooncake's 30 s progress timeout. The kernel keeps the
    threads within the process's cpuset (cgroup); an affinity set on the process itself (say
    with ``taskset``) is widened for them, for it cannot be told apart from vLLM's pin."""
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (AttributeError, OSError):  # not Linux, or a cpuset that refuses: stay as we are
        pass


class TrioHost:
    """Owns a thread running ``trio.run`` with one nursery that lives until :meth:`close`.

    Usable as a context manager. If the nursery dies of an error, the error is logged with its
    traceback at once, ``on_death(error)`` is called (in the dying thread, after the Trio run
    has ended), and :meth:`close` re-raises it (wrapped in :class:`PdError`).
    """

    def __init__(
        self,
        name: str = "pdactors-trio",
        on_death: Callable[[BaseException], object] | None = None,
    ) -> None:
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._error: BaseException | None = None
        self._closing = False
        self._on_death = on_death
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise PdError("the Trio thread failed to start") from self._error

    @property
    def alive(self) -> bool:
        """The Trio thread runs and has not died."""
        return self._thread.is_alive() and self._error is None and self._token is not None

    def _main(self) -> None:
        _unpin_this_thread()
        try:
            trio.run(self._serve)
        except BaseException as exc:  # the thread must not die silently
            self._error = exc
            if self._token is not None and not self._closing:
                log.error("the Trio thread %s died", self._thread.name, exc_info=exc)
                if self._on_death is not None:
                    self._on_death(exc)
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        async with trio.open_nursery() as nursery:
            self._token = trio.lowlevel.current_trio_token()
            self._nursery = nursery
            self._ready.set()
            await trio.sleep_forever()

    @property
    def nursery(self) -> trio.Nursery:
        assert self._nursery is not None
        return self._nursery

    def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await fn(*args)`` in the Trio thread and return its result (blocks the caller)."""
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    def run_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """Call ``fn(*args)`` in the Trio thread (it must not block) and return its result."""
        return trio.from_thread.run_sync(fn, *args, trio_token=self._token)

    def post(self, fn: Callable[..., object], *args: Any) -> None:
        """Queue ``fn(*args)`` to run soon in the Trio thread; returns at once (never blocks).

        ``fn`` must not block. Whatever it raises is logged with its traceback, not propagated:
        the caller has long returned, and one bad call must not kill the thread. Raises
        :class:`PdError` when the Trio thread is not running (it died or was closed).
        """
        try:
            self._token_or_raise().run_sync_soon(self._run_logged, fn, args)
        except trio.RunFinishedError:
            raise PdError("the Trio thread is not running") from None

    @staticmethod
    def _run_logged(fn: Callable[..., object], args: tuple[Any, ...]) -> None:
        try:
            fn(*args)
        except Exception as exc:  # reported here: nobody else can hear it
            name = getattr(fn, "__name__", fn)
            log.error("%s posted into the Trio thread failed: %s", name, exc, exc_info=exc)

    def _token_or_raise(self) -> trio.lowlevel.TrioToken:
        if self._token is None:
            raise PdError("the Trio thread is not running")
        return self._token

    def start(self, serve: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """``nursery.start(serve, *args)`` in the host's nursery; returns what it reports."""
        return self.run(self.nursery.start, serve, *args)

    def close(self, timeout: float = 10.0) -> None:
        """Cancel everything in the host and wait (at most ``timeout`` s) for the thread."""
        self._closing = True
        if self._thread.is_alive() and self._nursery is not None:
            try:
                self.run_sync(self._nursery.cancel_scope.cancel)
            except trio.RunFinishedError:
                pass
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise PdError(f"the Trio thread did not stop within {timeout:g} s")
        if self._error is not None:
            raise PdError("the Trio thread died") from self._error

    def __enter__(self) -> TrioHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
