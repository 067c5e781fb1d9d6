"""Quiet idle steps: a D whose requests only wait for KV should cost almost no CPU.

While requests sit in WAITING_FOR_REMOTE_KVS, vLLM's engine loop keeps stepping empty batches,
and both ends of the executor's shared-memory queue spin (``sched_yield``) waiting for each
other: measured 150–160 % CPU for 8 waiting requests on a 2-core host, taken from P. Two halves
make such a step quiet:

* the worker side waits, bounded by ``idle_wait_ms``, for the next transfer result in
  ``get_finished`` on a step with nothing to compute (the scheduler side marks it ``idle``),
  and returns the moment a result arrives;
* meanwhile the engine core, which would spin in vLLM's ``SpinCondition.wait`` for the
  worker's answer, blocks instead on the socket vLLM's writer already pings after every write
  (vLLM's own "idle reader" branch, which it takes only after a second without reads), for at
  most :data:`IDLE_POLL_MS` before it reads the buffer again: the scheduler side (which lives
  in the engine core's process) raises :func:`begin` when it hands out an idle step and
  :func:`end` when the step's output comes back. The worker does the same for the next
  step's input after it answered an idle step (the engine core pauses between idle steps),
  until the next step's metadata is bound. That is a patch of vLLM's private
  ``shm_broadcast.SpinCondition.wait``, installed once per process by :func:`install` and only
  where that name exists; where only ``shm_broadcast.sched_yield`` exists (older vLLM), a
  spin naps :data:`NAP` seconds instead; without either the worker still waits, and only the
  engine core spins.

Busy steps (``quiet_busy_waits``, the default): the same spins go on for the whole of every
step the worker computes — the engine core waits for the worker's output, the worker for the
next step's input — each burning a CPU while the other process works. On a host where P and
D share the cores, each engine's spinning core process takes the CPU the other engine's
worker needs (measured with py-spy on 2 cores: 67–86 % of the engine cores' samples were
``sched_yield``). With the patch a wait spins for :data:`SPIN_S` and then naps a twentieth of
the time it has waited so far, at most :data:`NAP`: an answer is noticed at most 5 % (and
0.5 ms) later than by spinning, and a long wait costs almost no CPU. It naps only while the
host has more runnable tasks than CPUs (:func:`contended`, read from ``/proc/loadavg`` at most
every :data:`CONTENTION_TTL`): a spin then takes a CPU another task wants; without such a task
it costs nobody anything, and a lone request's decode steps are not made later by naps.
:func:`install` is called in the engine core's process (scheduler side) and in the worker's
(worker side).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

__all__ = ["CONTENTION_TTL", "IDLE_POLL_MS", "NAP", "begin", "contended", "end", "install"]

log = logging.getLogger("pdactors.vllm")

#: How long the engine core sleeps per spin while an idle step is in flight (seconds): it adds
#: at most this to noticing the worker's answer. Busy waits nap at most this long too.
NAP = 0.0005
#: While an idle step is in flight, how long a wait blocks on vLLM's write notification before
#: it reads the shared buffer again (milliseconds). vLLM's own idle mode waits for it without
#: a bound (its writer notifies after every write, and the reader's subscription keeps the last
#: notification until read, so none is lost); this bound is only a second line.
IDLE_POLL_MS = 50
#: Busy waits: how long a wait spins at full speed before it naps (seconds), and the share of
#: the time waited so far that each nap lasts.
SPIN_S = 0.0002
NAP_SHARE = 0.05
#: A call to ``sched_yield`` this long after the previous one returned starts a new wait.
_NEW_WAIT = 0.001
#: How long one reading of the host's runnable tasks stands, per thread (seconds).
CONTENTION_TTL = 0.001
_LOADAVG = "/proc/loadavg"
_CPUS = os.cpu_count() or 1

_idle = threading.Event()
_installed = False
_busy_quiet = False
_lock = threading.Lock()
_waits = threading.local()  # per thread: when its current wait began, when its last call ended


def begin() -> None:
    """An idle step is in flight: spins in this process may nap."""
    _idle.set()


def end() -> None:
    """The idle step is over: spin at full speed again."""
    _idle.clear()


def _busy_nap(original: Callable[[], object]) -> None:
    """One spin of a busy wait that is not a reader's (the writer's, for a full buffer): a
    wait is told from the next by a pause of :data:`_NEW_WAIT` between calls."""
    now = time.monotonic()
    if now - getattr(_waits, "last", 0.0) > _NEW_WAIT:
        _waits.start = now
    _nap(now - _waits.start, original)
    _waits.last = time.monotonic()


def contended() -> bool:
    """Whether the host has more runnable tasks now than CPUs (``/proc/loadavg``'s count of
    runnable scheduling entities, this one included), read at most once per
    :data:`CONTENTION_TTL` per thread; True where it cannot be read (a wait naps, as before)."""
    now = time.monotonic()
    if now < getattr(_waits, "checked_until", 0.0):
        return bool(_waits.contended)
    try:
        with open(_LOADAVG, "rb") as f:
            running = int(f.read().split()[3].split(b"/")[0])
        busy = running > _CPUS
    except (OSError, ValueError, IndexError):
        busy = True
    _waits.contended, _waits.checked_until = busy, now + CONTENTION_TTL
    return busy


def _nap(waited: float, original: Callable[[], object]) -> None:
    """One spin of a busy wait that has lasted ``waited`` seconds: vLLM's own for the first
    :data:`SPIN_S` or while no other task wants a CPU (:func:`contended`), else a nap of
    :data:`NAP_SHARE` of the time waited, at most :data:`NAP`."""
    if waited < SPIN_S or not contended():
        original()
    else:
        time.sleep(min(NAP, waited * NAP_SHARE))


def _reader_waited(condition: object) -> float:
    """How long the reader of ``condition`` has waited (seconds): its wait began at its first
    call after its last read (vLLM's ``record_read``), however soon after that read it came.
    (A pause between calls cannot tell a reader's waits apart: a decode step's worker reads
    its input, computes for under a millisecond and waits again, and the engine core
    likewise; taken for one long wait, every step's wait napped at once, up to :data:`NAP`:
    1.4 ms per decode step of the ``small`` shape on a 2-core AMD EPYC.)"""
    now = time.monotonic()
    read = getattr(condition, "last_read", None)
    if getattr(condition, "_pdactors_read", None) != read:
        condition._pdactors_read = read  # type: ignore[attr-defined]
        condition._pdactors_wait = now  # type: ignore[attr-defined]
    return now - condition._pdactors_wait  # type: ignore[attr-defined, no-any-return]


def install(*, busy: bool = False) -> bool:
    """Make vLLM's shared-memory queue nap instead of spinning during idle steps, and with
    ``busy`` during busy ones too (once per process; ``busy`` can be turned on later).
    Returns whether the patch is in place."""
    global _installed, _busy_quiet
    with _lock:
        _busy_quiet = _busy_quiet or busy
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
            elif _busy_quiet:
                _busy_nap(original)
            else:
                original()

        setattr(shm_broadcast, "sched_yield", quiet_yield)  # noqa: B010 (private name)
        _install_idle_wait(getattr(shm_broadcast, "SpinCondition", None), original)
        _installed = True
        return True


def _install_idle_wait(condition: type | None, spin: Callable[[], object]) -> bool:
    """Patch ``SpinCondition.wait`` (a reader's): during idle steps it takes vLLM's own idle
    branch (a poll of the writer's notify socket) for at most :data:`IDLE_POLL_MS` instead
    of spinning; during busy ones (``quiet_busy_waits``) it spins (``spin``: vLLM's own
    ``sched_yield``) for :data:`SPIN_S` of each wait, then naps. A reader that has not read
    for vLLM's ``busy_loop_s`` waits as vLLM has it (its own idle branch)."""
    original = getattr(condition, "wait", None)
    if condition is None or original is None:
        return False

    def wait(self: object, timeout_ms: int | None = None) -> None:
        if getattr(self, "poller", None) is None or not hasattr(self, "busy_loop_s"):
            original(self, timeout_ms)
        elif _idle.is_set():
            _poll(original, self, timeout_ms)
        elif _busy_quiet and time.monotonic() <= self.last_read + self.busy_loop_s:  # type: ignore[attr-defined]
            _nap(_reader_waited(self), spin)
        else:
            original(self, timeout_ms)

    condition.wait = wait  # type: ignore[attr-defined]
    return True


def _poll(original: Callable[..., None], condition: object, timeout_ms: int | None) -> None:
    """vLLM's idle branch of ``SpinCondition.wait``: block on the writer's notification for at
    most :data:`IDLE_POLL_MS` (a lost one costs at most that)."""
    cap = IDLE_POLL_MS if timeout_ms is None else min(timeout_ms, IDLE_POLL_MS)
    busy = condition.busy_loop_s  # type: ignore[attr-defined]
    condition.busy_loop_s = -1.0  # type: ignore[attr-defined]  # past its busy time: it polls
    try:
        original(condition, cap)
    finally:
        condition.busy_loop_s = busy  # type: ignore[attr-defined]
