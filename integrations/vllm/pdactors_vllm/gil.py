"""The GIL's switch interval in the engine's processes (the connector's ``gil_switch_ms``).

The connector's threads — the actors' Trio thread, the data plane's write threads, D's landed
notices thread, the engine core's idle-gate listener — sleep on I/O and, once woken, need the
GIL for a few microseconds of Python. In a vLLM process another thread holds it most of the
time: the worker's main thread runs the forward (Python between every kernel or op), the
engine core its busy loop. A thread that wants the GIL gets it when the holder blocks or, if
the holder keeps running Python, when CPython's switch interval (5 ms by default) has passed
and it forces a switch. So each wake-up of a connector thread can cost up to 5 ms while the
engine is busy: measured on a 2-core Xeon (``bench/gil_wakeup.py``, a thread woken by a
datagram while another runs Python), p90 5.3 ms and p99 10.4 ms at the default interval,
p90 0.64 ms at 0.5 ms, 0.29–0.32 ms at 0.1–0.2 ms; p50 10–24 µs whatever the interval.

A shorter interval makes the holder hand the GIL over sooner, and costs it only when some
thread asks for the GIL (a thread that never waits for it never forces a switch).
:func:`lower_switch_interval` only ever lowers the process's interval: a shorter one set by
someone else is kept.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["lower_switch_interval"]

log = logging.getLogger("pdactors.vllm")


def lower_switch_interval(ms: float) -> bool:
    """Make this process's GIL switch interval ``ms`` milliseconds if that is shorter than
    the current one (0: leave it). Returns whether it changed."""
    seconds = ms / 1000
    if seconds <= 0 or sys.getswitchinterval() <= seconds:
        return False
    log.info("PdActorsConnector: the GIL switch interval goes from %g ms to %g ms "
             "(gil_switch_ms)", sys.getswitchinterval() * 1000, ms)  # fmt: skip
    sys.setswitchinterval(seconds)
    return True
