"""The Mooncake Transfer Engine as a :class:`~pdactors.dataplane.base.DataPlane`.

Safety limits this module enforces (each measured on Mooncake's TCP transport):

* More than 2048 descriptors in flight to one peer over TCP fails and can break the path to
  that peer for good. A write is cut into calls of at most ``max_descriptors_per_call``
  descriptors, and a per-peer semaphore allows ``max_calls_per_peer`` calls in flight, so
  descriptors in flight per peer never exceed their product.
* Only ``batch_transfer_sync_write`` is used: ``get_batch_transfer_status`` on a completed
  batch segfaults, so the asynchronous API is off limits.
* Mooncake refuses to register overlapping memory, and a descriptor that crosses from one
  registration into the next fails: :mod:`pdactors.dataplane._registrations`.

How a write goes: one whose KV is complete, that fits one call within ``inline_max_bytes``
and finds nothing queued to its peer is made at once in the Trio thread
(:meth:`MooncakeDataPlane._write_at_once`, which says why it skips the queue); every other
write queues its pieces per peer (:mod:`pdactors.dataplane._batching`), and each call carries
as many as fit, made in the Trio thread or a worker thread as
:func:`~pdactors.dataplane._batching.inline` decides. Both call the engine through
:func:`~pdactors.dataplane._batching.engine_call` and classify what it returned with
:func:`~pdactors.dataplane._outcomes.failure`, the one classification.

Starting and closing an engine: :mod:`pdactors.dataplane.engine` (:func:`open_mooncake`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt
import trio

from pdactors.config import DataPlaneConfig
from pdactors.dataplane._batching import (
    CallEnd,
    EngineWriter,
    PeerQueue,
    Piece,
    Write,
    descriptors,
    engine_call,
    inline,
    ready,
    run_after,
    run_call,
    wait_for,
)
from pdactors.dataplane._outcomes import Failure, failure
from pdactors.dataplane._registrations import MemoryRegistrar, Registrations
from pdactors.errors import DataPlaneError

__all__ = ["DataPlaneStatistics", "MooncakeDataPlane", "MooncakeEngine"]

Addrs = npt.NDArray[np.uint64]


class MooncakeEngine(EngineWriter, MemoryRegistrar, Protocol):
    """The part of ``mooncake.engine.TransferEngine`` this module uses (an initialised one)."""


@dataclass(frozen=True, slots=True)
class DataPlaneStatistics:
    """Counters of a :class:`MooncakeDataPlane`.

    ``writes``, ``bytes`` and ``descriptors`` count writes that completed; ``failures`` counts
    writes that failed; ``calls`` counts engine calls (one may carry several writes), failed
    ones included, and ``inline_calls`` those made in the Trio thread
    (``DataPlaneConfig.inline_max_bytes``); ``registrations`` and ``registered_bytes``
    describe the memory registered.
    """

    writes: int
    bytes: int
    descriptors: int
    failures: int
    calls: int
    registrations: int
    registered_bytes: int
    inline_calls: int = 0


class MooncakeDataPlane:
    """Writes KV bytes into peers' memory through an initialised Mooncake engine.

    ``engine`` must already be initialised; ``session`` is the name peers write to
    (``"host:rpc_port"``). Most callers use :func:`open_mooncake`, which makes both and
    cleans up; tests may share one engine between several data planes.
    """

    def __init__(self, engine: MooncakeEngine, config: DataPlaneConfig, session: str) -> None:
        self._engine: MooncakeEngine | None = engine
        self._config = config
        self._inline_limit = config.inline_limit  # (the protocol's default resolved once)
        self._session = session
        self._limiter = trio.CapacityLimiter(config.workers)
        self._per_peer: dict[str, PeerQueue] = {}
        self._registered = Registrations()
        self._writes = self._bytes = self.descriptors = self._failures = self._calls = 0
        self._inline_calls = 0

    @property
    def session(self) -> str:
        """The name other engines write to: ``"host:rpc_port"``."""
        return self._session

    @property
    def engine(self) -> MooncakeEngine:
        """The Mooncake engine underneath (benchmarks compare against its raw calls)."""
        return self._live_engine()

    @property
    def config(self) -> DataPlaneConfig:
        """The configuration this data plane was made with."""
        return self._config

    def statistics(self) -> DataPlaneStatistics:
        """A snapshot of this data plane's counters."""
        return DataPlaneStatistics(
            writes=self._writes,
            bytes=self._bytes,
            descriptors=self.descriptors,
            failures=self._failures,
            calls=self._calls,
            registrations=len(self._registered),
            registered_bytes=self._registered.nbytes,
            inline_calls=self._inline_calls,
        )

    def register(self, regions: list[tuple[int, int]]) -> None:
        """Register ``(address, length)`` regions as transfer sources and targets.

        Regions are merged first: overlapping, duplicate and adjacent ones (vLLM hands over
        views of one allocation) become one interval, and parts already registered are
        skipped, so ``register_memory`` sees only new, disjoint memory. Zero-length regions
        are ignored.

        A descriptor must lie within one registration: register all views of one allocation
        in one call, so that they become one registration. (Memory that only extends an
        earlier registration is registered separately next to it.)

        Not a checkpoint; blocks for as long as the engine takes to register (pinning memory
        for RDMA can take a while), so call it before serving. Raises
        :class:`DataPlaneError` for a negative address or length, a closed data plane or a
        failed registration (earlier intervals of the same call stay registered).
        """
        self._registered.add(self._live_engine(), regions)

    async def write(
        self,
        peer: str,
        src: Addrs,
        dst: Addrs,
        lengths: Addrs,
        *,
        before: Callable[[], object] | None = None,
        after: Callable[[], object] | None = None,
    ) -> None:
        """Write ``lengths[i]`` bytes from local ``src[i]`` to ``peer``'s ``dst[i]``.

        ``before``: a blocking callable the worker thread runs right before the write's first
        engine call, e.g. ``torch.cuda.Event.synchronize`` for KV a GPU is still computing.
        The wait then costs no hop of its own: the thread that saw the KV complete makes the
        call. If it raises, the write fails with :class:`DataPlaneError` and sends nothing.
        ``after``: a callable the worker thread whose engine call landed the write's last
        piece runs right after that call returned 0 (a write with nothing to move: in a
        worker thread of its own), once; never for a write that fails or is cancelled before
        every piece landed. What it raises is logged, never the write's failure.

        Checkpoint, even when there is nothing to write, but for a write made at once in the
        Trio thread (``inline_max_bytes``: its KV complete, one call's worth, nothing queued
        to its peer), which is a cancel point only. The descriptors are cut into pieces of
        at most ``max_descriptors_per_call`` and queued for ``peer``. Engine calls run in
        worker threads (at most ``workers`` for the whole data plane, at most
        ``max_calls_per_peer`` in flight to one peer; a call within ``inline_max_bytes`` whose
        writes wait for nothing runs in the Trio thread), and each call carries as many queued
        pieces, from any writes to that peer, as fit in ``max_descriptors_per_call``: under
        load one worker-thread hop and one engine call serve many writes. Whichever waiting
        write finds a call free makes it, on behalf of everyone it carries, so no background
        task is needed.

        Cancellation: a piece not yet in a call is dropped, but a call the engine has started
        is not abandoned, since the engine may still be reading our memory and writing the
        peer's. A cancelled write therefore returns only when its pieces in flight have; Mooncake
        bounds that with its own TCP timeouts (about 30 s for a stopped peer, about 60 s for one
        that accepts but never answers). After a cancellation or failure, an unknown part of
        the write may have landed.

        A failed engine call fails every write it carried (they all go to ``peer``; what fails
        a call is the peer or its memory). Every call's end, wherever the call ran, is
        classified once (:mod:`pdactors.dataplane._outcomes`). Raises
        :class:`~pdactors.errors.TransferError` naming the peer, the bytes of the whole write
        and the engine's code (None when the call raised instead of returning one), and
        :class:`DataPlaneError` when ``before`` raised, for arrays of different lengths or a
        closed data plane.
        """
        count = len(lengths)
        if len(src) != count or len(dst) != count:
            raise DataPlaneError(
                f"src, dst and lengths differ in length ({len(src)}, {len(dst)}, {count})"
            )
        self._live_engine()
        if count == 0:
            if after is None:
                await trio.lowlevel.checkpoint()
            else:
                await trio.to_thread.run_sync(run_after, after, limiter=self._limiter)
            return
        nbytes = int(lengths.sum())
        queue = self._per_peer.get(peer)
        if self._at_once(queue, count, nbytes, before):
            await trio.lowlevel.checkpoint_if_cancelled()
            failed = self._write_at_once(peer, src, dst, lengths, before, after)
        else:
            if queue is None:
                queue = self._per_peer[peer] = PeerQueue(self._config.max_calls_per_peer)
            queue.writes += 1
            try:
                failed = await self._queued(peer, queue, nbytes, src, dst, lengths, before, after)
            finally:
                queue.writes -= 1
                if not queue.writes:  # no write left to queue behind: a restarted D is a new peer
                    del self._per_peer[peer]
        self._finish(peer, nbytes, count, failed)

    def _at_once(
        self, queue: PeerQueue | None, count: int, nbytes: int, before: Callable[[], object] | None
    ) -> bool:
        """Whether a write is made at once (:meth:`_write_at_once`): calls that small are made
        in the Trio thread (``inline_max_bytes``), its KV is complete, it fits one call, and
        no piece to its peer waits while a call to it is free (nothing queued to overtake,
        the per-peer limit kept)."""
        limit = self._inline_limit
        if not limit or count > self._config.max_descriptors_per_call or nbytes > limit:
            return False
        if queue is not None and (not queue.free_calls or queue.pieces):
            return False
        return ready(before)

    def _write_at_once(
        self,
        peer: str,
        src: Addrs,
        dst: Addrs,
        lengths: Addrs,
        before: Callable[[], object] | None,
        after: Callable[[], object] | None,
    ) -> Failure | None:
        """A write of :meth:`_at_once`, in one engine call of its own here, in the Trio thread:
        no queue, no :class:`~pdactors.dataplane._batching.Write`, no wake-up and no schedule
        point (the call blocks the loop anyway). Its failure, None when it landed.

        Kept beside the queued path for a measured reason: the queue's bookkeeping (a
        ``Write`` and its ``Pulse``, a ``Piece``, settling a batch) cost as much again as the
        whole write made here (``bench/write_overhead.py``, 2-core machine: 2.9 µs a write
        here, 5.5-5.9 µs with a one-piece batch through :func:`run_call` and :meth:`_settle`;
        on an H200 skipping the queue took the write's own cost over its call from
        0.08-0.10 ms to 0.046-0.059 ms, docs/architecture.md). What it shares with every call:
        :func:`wait_for`, :func:`engine_call` and the one classification (:func:`failure`)."""
        engine = self._live_engine()
        self._calls += 1
        self._inline_calls += 1
        wait = None if before is None else wait_for(before)
        returned = engine_call(engine, peer, src, dst, lengths) if wait is None else None
        failed = failure(returned, wait, descriptors=len(lengths))
        if failed is None and after is not None:
            run_after(after)
        return failed

    async def _queued(
        self,
        peer: str,
        queue: PeerQueue,
        nbytes: int,
        src: Addrs,
        dst: Addrs,
        lengths: Addrs,
        before: Callable[[], object] | None,
        after: Callable[[], object] | None,
    ) -> Failure | None:
        """Queue a write's pieces for ``peer`` and make calls until it landed (None) or failed
        (its first failure)."""
        step = self._config.max_descriptors_per_call
        pieces = -(-len(lengths) // step)
        job = Write(nbytes, pieces, before=before, after=after, unlanded=pieces)
        for start in range(0, len(lengths), step):
            stop = start + step
            queue.pieces.append(Piece(job, src[start:stop], dst[start:stop], lengths[start:stop]))
        try:
            while job.pending and job.failure is None:
                if queue.free_calls and queue.pieces:
                    await self._call(peer, queue)
                else:
                    await job.changed.wait()
        finally:
            if job.pending:  # cancelled or failed: the rest is not sent, what is in flight ends
                queue.drop(job)
                queue.kick()
                with trio.CancelScope(shield=True):
                    while job.running:
                        await job.changed.wait()
        return job.failure

    async def _call(self, peer: str, queue: PeerQueue) -> None:
        """Make one engine call to ``peer`` carrying the pieces at the head of its queue: in
        the Trio thread when :func:`inline` allows (then yield once, the call done), else in
        a worker thread under the data plane's limiter (cancelled only while waiting for the
        thread: then the call never started and its pieces wait for another)."""
        engine = self._live_engine()  # closed: raise before any piece leaves the queue
        batch = queue.take(self._config.max_descriptors_per_call)
        here = inline(batch, self._inline_limit)
        for piece in batch:
            piece.write.running += 1
        self._calls += 1
        if here:
            self._inline_calls += 1
        queue.free_calls -= 1
        end: CallEnd | None = None
        try:
            if here:  # no hand-off to a thread and back
                end = run_call(engine, peer, batch)
                await trio.lowlevel.cancel_shielded_checkpoint()
            else:
                end = await trio.to_thread.run_sync(
                    run_call, engine, peer, batch, limiter=self._limiter, abandon_on_cancel=False
                )
        finally:
            queue.free_calls += 1
            if end is None:
                queue.pieces.extendleft(reversed(batch))
            self._settle(batch, end)
            queue.kick()

    def _settle(self, batch: list[Piece], end: CallEnd | None) -> None:
        """Settle each write ``batch`` carried with what its call came to (None: it never
        started), through the one classification (:func:`failure`), and wake them."""
        jobs = {id(piece.write): piece.write for piece in batch}
        carried, others = descriptors(batch), len(jobs) - 1
        for piece in batch:
            job = piece.write
            job.running -= 1
            if end is None:
                continue
            wait = end.waits.get(id(job))
            failed = failure(end.returned, wait, descriptors=carried, others=others)
            if failed is None:
                job.pending -= 1
            elif job.failure is None:  # the first failure of a write is its cause
                job.failure = failed
        for job in jobs.values():
            job.changed.fire()

    def _finish(self, peer: str, nbytes: int, count: int, failed: Failure | None) -> None:
        """Count a write that ended: landed (``failed`` None), or failed (raises the error of
        its failure: :meth:`~pdactors.dataplane._outcomes.Failure.error`)."""
        if failed is not None:
            self._failures += 1
            raise failed.error(peer, nbytes)
        self._writes += 1
        self._bytes += nbytes
        self.descriptors += count

    def _live_engine(self) -> MooncakeEngine:
        if self._engine is None:
            raise DataPlaneError(f"data plane {self._session} is closed")
        return self._engine

    def _detach(self) -> MooncakeEngine | None:
        """Unregister everything and hand the engine over (the data plane is closed after).

        Blocking; run in a worker thread. Failures are logged: this is cleanup.
        """
        engine, self._engine = self._engine, None
        if engine is None:
            return None
        self._registered.release(engine)
        return engine

    def close(self) -> None:
        """Unregister this data plane's memory and stop using the engine.

        Blocking (not a checkpoint). The engine itself is not destroyed: whoever made it owns
        it. :func:`open_mooncake` does this for you.
        """
        self._detach()
