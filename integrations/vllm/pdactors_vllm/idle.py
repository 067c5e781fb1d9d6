"""Quiet idle steps: a D whose requests only wait for KV should cost almost no CPU.

While requests sit in WAITING_FOR_REMOTE_KVS, vLLM's engine loop keeps stepping empty batches,
and both ends of the executor's shared-memory queue spin (``sched_yield``) waiting for each
other: measured 150–160 % CPU for 8 waiting requests on a 2-core host, taken from P. Two halves
make such a step quiet:

* the worker side waits, bounded by ``idle_wait_ms``, for the next transfer result in
  ``get_finished`` on a step with nothing to compute (the scheduler side marks it ``idle``),
  and returns the moment a result arrives;
* meanwhile the engine core, which spins in vLLM's ``SpinCondition.wait`` for the worker's
  answer, naps :data:`NAP` seconds per spin instead of yielding: the scheduler side (which
  lives in the engine core's process) raises :func:`begin` when it hands out an idle step and
  :func:`end` when the step's output comes back. That is a patch of vLLM's private
  ``shm_broadcast.sched_yield``, installed once per process by :func:`install` and only where
  that name exists; without it the worker still waits, and only the engine core spins.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

__all__ = ["NAP", "begin", "end", "install"]

log = logging.getLogger("pdactors.vllm")

#: How long the engine core sleeps per spin while an idle step is in flight (seconds): it adds
#: at most this to noticing the worker's answer.
NAP = 0.0005

_idle = threading.Event()
_installed = False
_lock = threading.Lock()


def begin() -> None:
    """An idle step is in flight: spins in this process may nap."""
    _idle.set()


def end() -> None:
    """The idle step is over: spin at full speed again."""
    _idle.clear()


def install() -> bool:
    """Make vLLM's shared-memory queue nap instead of spinning during idle steps (once per
    process). Returns whether the patch is in place."""
    global _installed
    with _lock:
        if _installed:
            return True
        try:
            from vllm.distributed.device_communicators import shm_broadcast
        except ImportError:
            return False
        original: Callable[[], object] | None = getattr(shm_broadcast, "sched_yield", None)
        if original is None:
            log.info("PdActorsConnector: this vLLM has no shm_broadcast.sched_yield to quiet")
            return False

        def quiet_yield() -> None:
            if _idle.is_set():
                time.sleep(NAP)
            else:
                original()

        setattr(shm_broadcast, "sched_yield", quiet_yield)  # noqa: B010 (private name)
        _installed = True
        return True
