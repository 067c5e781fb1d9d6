"""How the Mooncake data plane batches writes: each write is cut into pieces queued per peer,
and one engine call carries as many queued pieces to that peer as fit
(:meth:`~pdactors.dataplane.mooncake.MooncakeDataPlane.write` says when calls are made).
:func:`engine_call` is the only code that calls the engine (:func:`run_call` for a batch,
wherever that call runs; a write made at once for itself); what a call came to is classified
by :mod:`pdactors.dataplane._outcomes`."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np

from pdactors._pulse import Pulse
from pdactors.dataplane._outcomes import Failure
from pdactors.dataplane.base import Addrs

__all__ = [
    "CallEnd",
    "EngineWriter",
    "PeerQueue",
    "Piece",
    "Write",
    "descriptors",
    "engine_call",
    "inline",
    "landed",
    "ready",
    "run_after",
    "run_call",
    "wait_for",
]

log = logging.getLogger("pdactors.dataplane")

#: Guards :attr:`Write.unlanded`: two calls carrying pieces of one write may return at once.
_LANDED = threading.Lock()


class EngineWriter(Protocol):
    """The engine call a batch makes: a part of
    :class:`~pdactors.dataplane.mooncake.MooncakeEngine`."""

    def batch_transfer_sync_write(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
    ) -> int: ...


@dataclass(eq=False, slots=True)
class Write:
    """One :meth:`~pdactors.dataplane.mooncake.MooncakeDataPlane.write` in progress."""

    nbytes: int
    pending: int  # pieces not yet landed
    before: Callable[[], object] | None = None  # run in the thread before the first call
    after: Callable[[], object] | None = None  # run in the thread once every piece landed
    unlanded: int = 0  # with ``after``: pieces not yet landed, counted in the threads
    running: int = 0  # pieces in an engine call now
    failure: Failure | None = None  # the first failure of one of its pieces: its cause
    changed: Pulse = field(default_factory=Pulse)


@dataclass(eq=False, slots=True)
class Piece:
    """At most ``max_descriptors_per_call`` descriptors of a write."""

    write: Write
    src: Addrs
    dst: Addrs
    lengths: Addrs


class PeerQueue:
    """The pieces waiting for an engine call to one peer, and that peer's free calls; kept
    while writes to that peer are in progress (a call in flight belongs to one of them)."""

    def __init__(self, calls: int) -> None:
        self.pieces: deque[Piece] = deque()
        self.free_calls = calls
        self.writes = 0

    def take(self, limit: int) -> list[Piece]:
        """Pieces from the head while their descriptors fit in ``limit`` (at least one). A
        piece whose write still has to wait (``before``) starts a call of its own: joined to
        the call before it, it would hold that call until its KV is computed (the layers of a
        streamed prefill each complete at their own time)."""
        batch = [self.pieces.popleft()]
        total = len(batch[0].lengths)
        while (
            self.pieces
            and total + len(self.pieces[0].lengths) <= limit
            and not may_wait(self.pieces[0].write.before)
        ):
            piece = self.pieces.popleft()
            total += len(piece.lengths)
            batch.append(piece)
        return batch

    def drop(self, job: Write) -> None:
        """Forget the pieces of ``job`` still waiting."""
        if any(piece.write is job for piece in self.pieces):
            self.pieces = deque(piece for piece in self.pieces if piece.write is not job)

    def kick(self) -> None:
        """Wake the owner of the head piece if a call is free: it makes the next call (an
        owner busy making another call takes the next one when that call returns)."""
        if self.free_calls and self.pieces:
            self.pieces[0].write.changed.fire()


def may_wait(before: Callable[[], object] | None) -> bool:
    """Whether a write's ``before`` may wait (for KV still being computed). One whose
    ``may_wait`` attribute is false (a preparation that never waits, such as hashing the
    source runs) joins a batch like a write without one: giving each such write an engine
    call of its own cost 2.5x the control plane's throughput at 64 in flight."""
    return before is not None and bool(getattr(before, "may_wait", True))


def inline(batch: list[Piece], max_bytes: int) -> bool:
    """Whether the call carrying ``batch`` may be made in the Trio thread itself: at most
    ``max_bytes`` bytes (0: never) and no write waiting for its KV — its ``before`` is None,
    or has a ``ready()`` saying the KV is complete (a CUDA event's ``query``). A ``before``
    without one (a wait, or hashing the runs) goes to a worker thread."""
    if not max_bytes or sum(int(piece.lengths.sum()) for piece in batch) > max_bytes:
        return False
    return all(ready(piece.write.before) for piece in batch)


def ready(before: Callable[[], object] | None) -> bool:
    """Whether a write's ``before`` has nothing to wait for: None, or its ``ready()`` says
    the KV is complete."""
    if before is None:
        return True
    ready = getattr(before, "ready", None)
    try:
        return ready is not None and bool(ready())
    except Exception:  # a probe that fails says nothing: the thread will wait and see
        return False


def descriptors(batch: list[Piece]) -> int:
    return sum(len(piece.lengths) for piece in batch)


def run_after(after: Callable[[], object]) -> None:
    """Run a write's ``after`` (its bytes landed): what it raises is logged, never the
    write's failure."""
    try:
        after()
    except Exception:
        log.exception("a write's after-landing callback raised (the write itself succeeded)")


def landed(pieces: list[Piece]) -> list[Callable[[], object]]:
    """Count ``pieces`` as landed (their engine call returned 0, in this thread); the
    ``after`` of each write whose last piece this was. A piece lands at most once, so each is
    returned once, and never that of a write a piece of which failed or was dropped."""
    for piece in pieces:  # (a loop, not all(): this runs after every call that landed)
        if piece.write.after is not None:
            break
    else:
        return []
    complete = []
    with _LANDED:
        for piece in pieces:
            job = piece.write
            if job.after is not None:
                job.unlanded -= 1
                if job.unlanded == 0:
                    complete.append(job.after)
    return complete


class CallEnd(NamedTuple):
    """What one engine call came to, as :func:`run_call` saw it (classified by
    :func:`~pdactors.dataplane._outcomes.classify`)."""

    #: The engine's own code, or what the call raised; None: no call was made (every write
    #: of the batch failed its wait).
    returned: int | Exception | None
    #: By ``id`` of the write: what its ``before`` raised (that write was left out of the call).
    waits: dict[int, Exception]


def wait_for(before: Callable[[], object] | None) -> Exception | None:
    """Run a write's ``before`` (blocking): None once the KV is complete, else what it
    raised (the write is then left out of its call and fails)."""
    if before is not None:
        try:
            before()
        except Exception as exc:
            return exc
    return None


def engine_call(
    engine: EngineWriter, peer: str, src: Addrs, dst: Addrs, lengths: Addrs
) -> int | Exception:
    """The one place the engine is called: ``batch_transfer_sync_write``'s code, or what
    the binding raised instead of returning one. Blocking."""
    try:
        return int(
            engine.batch_transfer_sync_write(peer, src.tolist(), dst.tolist(), lengths.tolist())
        )
    except Exception as exc:
        return exc


def run_call(engine: EngineWriter, peer: str, batch: list[Piece]) -> CallEnd:
    """One engine call for ``batch``: its writes' ``before`` waits, then one
    :func:`engine_call` for the pieces whose wait succeeded, then the ``after`` of each write
    whose last piece landed in it. Blocking; made in the Trio thread or a worker thread
    alike."""
    waits: dict[int, Exception] = {}
    for piece in batch:
        job = piece.write
        if job.before is not None:
            if (exc := wait_for(job.before)) is not None:  # that write fails
                waits[id(job)] = exc
            job.before = None  # once per write (a second, concurrent run is harmless)
    pieces = [piece for piece in batch if id(piece.write) not in waits] if waits else batch
    if not pieces:
        return CallEnd(None, waits)
    # The lists are built here: for a 1024-descriptor call that is ~50 µs the Trio thread
    # does not spend when the call runs in a worker thread.
    if len(pieces) == 1:
        src, dst, lengths = pieces[0].src, pieces[0].dst, pieces[0].lengths
    else:
        src = np.concatenate([piece.src for piece in pieces])
        dst = np.concatenate([piece.dst for piece in pieces])
        lengths = np.concatenate([piece.lengths for piece in pieces])
    returned = engine_call(engine, peer, src, dst, lengths)
    if returned == 0:
        for after in landed(pieces):
            run_after(after)
    return CallEnd(returned, waits)
