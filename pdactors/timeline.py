"""Per-transfer timelines: where a request's time to first token goes.

Every actor (and the vLLM connector) marks what happens to a transfer as it happens:
``mark(transfer_id, "write_start")``. A mark costs one branch while the timeline is off. When
it is on, each mark is

* a DEBUG line on the ``pdactors.timeline`` logger (``transfer T: write_start``), and
* with a sink file (:func:`enable`'s ``path``), one JSON line
  ``{"tid": T, "event": E, "t": wall-clock seconds, "pid": P}`` appended to it. Processes on
  one machine share the file: lines are written whole with ``O_APPEND``, and wall-clock times
  of different processes compare.

The timeline is on when :func:`enable` was called, or when ``pdactors.timeline`` logs at DEBUG.
This module reads no environment: the edges do, and call :func:`enable` with the file that
``$PDACTORS_TIMELINE`` (:data:`ENV`) names: the ``pdactors`` commands and the vLLM connector's
settings parsing. :func:`read_timelines` joins a sink file per transfer.

The events, in the order of one PD request (see ``bench/vllm_pd.py`` for the segments):

=================  ==========================================================================
``p_scheduled``    P's scheduler first schedules the prompt (vLLM scheduler side)
``p_computed``     the forward that completes the prompt has run (P worker, eager send), or
                   the request finished and its KV is handed over one step later
                   (``p_finished``, scheduler side)
``ready``          the sender has the block ids (P's Trio thread)
``pull_at_p``      D's pull reached the sender
``write_start``    the write into D's blocks begins (both of the above have happened)
``write_end``      the data plane says the bytes landed
``pull_sent``      D's receiver sent the pull
``landed``         D's receiver got P's answer: the KV is in D's blocks
``reported``       the D worker reported the transfer to vLLM (``finished_recving``)
=================  ==========================================================================

Spans: P's write and D's pull, each as it ends, as a :class:`TransferSpan` (wall-clock start
and end, bytes, peer, outcome) to the callbacks given to :func:`watch` — the vLLM connector's
OpenTelemetry export (``pdactors_vllm.tracing``). With no watcher, the actors build none.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import msgspec

__all__ = [
    "ENV",
    "TransferSpan",
    "disable",
    "enable",
    "enabled",
    "mark",
    "read_timelines",
    "span_ended",
    "unwatch",
    "watch",
    "watching",
]

#: The environment variable naming the sink file (read by the CLI and the vLLM adapter).
ENV = "PDACTORS_TIMELINE"

log = logging.getLogger("pdactors.timeline")


class _Mark(msgspec.Struct, frozen=True):
    tid: str
    event: str
    t: float
    pid: int


class TransferSpan(msgspec.Struct, frozen=True, kw_only=True):
    """One side of a transfer, ended: P's write into D's blocks (``"write"``: ``peer`` is D's
    data-plane session) or D's pull (``"pull"``: ``peer`` is P's engine id). ``start`` and
    ``end`` are wall-clock seconds (``time.time()``); ``nbytes`` what was written (P) or what
    P said landed (D); ``outcome`` is ``"ok"`` or why it failed."""

    transfer_id: str
    side: Literal["write", "pull"]
    start: float
    end: float
    nbytes: int
    peer: str
    outcome: str


_encoder = msgspec.json.Encoder()
_lock = threading.Lock()
_fd: int | None = None
_on = False


def enable(path: str | os.PathLike[str] | None = None) -> None:
    """Turn the timeline on (idempotent); ``path``: also append marks to this file."""
    global _fd, _on
    with _lock:
        _on = True
        if path is not None and _fd is None:
            _fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)


def disable() -> None:
    """Turn the timeline off and close its sink file (DEBUG logging still turns it on)."""
    global _fd, _on
    with _lock:
        _on = False
        if _fd is not None:
            os.close(_fd)
            _fd = None


def enabled() -> bool:
    """Whether marks are recorded."""
    return _on or log.isEnabledFor(logging.DEBUG)


def mark(transfer_id: str, event: str) -> None:
    """Record that ``event`` happened to ``transfer_id`` now (a no-op while off)."""
    if not (_on or log.isEnabledFor(logging.DEBUG)):
        return
    t = time.time()
    shown = transfer_id if transfer_id.isprintable() else repr(transfer_id)  # a peer's text
    log.debug("transfer %s: %s", shown, event)
    fd = _fd
    if fd is not None:
        line = _encoder.encode(_Mark(transfer_id, event, t, os.getpid())) + b"\n"
        try:
            os.write(fd, line)  # one write per line: O_APPEND keeps lines whole
        except OSError:
            pass  # closed by disable() meanwhile


_watchers: tuple[Callable[[TransferSpan], None], ...] = ()


def watch(watcher: Callable[[TransferSpan], None]) -> None:
    """Call ``watcher`` with every :class:`TransferSpan` of this process from now on (from the
    actors' Trio threads: it must not block, and what it raises propagates to the actor)."""
    global _watchers
    with _lock:
        _watchers = (*_watchers, watcher)


def unwatch(watcher: Callable[[TransferSpan], None]) -> None:
    """Stop calling ``watcher`` (idempotent)."""
    global _watchers
    with _lock:
        _watchers = tuple(w for w in _watchers if w != watcher)  # (bound methods: equal)


def watching() -> bool:
    """Whether anyone takes spans: the actors build them only then."""
    return bool(_watchers)


def span_ended(span: TransferSpan) -> None:
    """Hand ``span`` to every watcher."""
    for watcher in _watchers:
        watcher(span)


def span_done(
    transfer_id: str,
    side: Literal["write", "pull"],
    seconds: float,
    *,
    nbytes: int,
    peer: str,
    outcome: str,
) -> None:
    """A side of a transfer that took ``seconds`` (on the actor's clock) and ends now, to the
    watchers, if any; the span is stamped with the wall clock (spans are compared with other
    processes')."""
    if not _watchers:
        return
    end = time.time()
    span_ended(TransferSpan(transfer_id=transfer_id, side=side, start=end - seconds, end=end,
                            nbytes=nbytes, peer=peer, outcome=outcome))  # fmt: skip


def read_timelines(path: str | os.PathLike[str]) -> dict[str, dict[str, float]]:
    """A sink file → ``{transfer id: {event: first time it happened}}``."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    decoder = msgspec.json.Decoder(_Mark)
    for line in Path(path).read_bytes().splitlines():
        if line:
            m = decoder.decode(line)
            out[m.tid].setdefault(m.event, m.t)
    return dict(out)
