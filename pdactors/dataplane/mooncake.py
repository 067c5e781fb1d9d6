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
    BEFORE_FAILED,
    RAISED,
    EngineWriter,
    PeerQueue,
    Piece,
    Write,
    batch_call,
    descriptors,
    inline,
    not_complete,
    ready,
    run_after,
)
from pdactors.dataplane._registrations import MemoryRegistrar, Registrations
from pdactors.errors import DataPlaneError, TransferError

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
        at most ``max_descriptors_per_call`` and queued for ``peer``. Engine calls run in worker
        threads (at most ``workers`` for the whole data plane, at most ``max_calls_per_peer``
        in flight to one peer), and each call carries as many queued pieces, from any writes
        to that peer, as fit in ``max_descriptors_per_call``: under load one worker-thread hop
        and one engine call serve many writes. Whichever waiting write finds a call free makes
        it, on behalf of everyone it carries, so no background task is needed.

        Cancellation: a piece not yet in a call is dropped, but a call the engine has started
        is not abandoned, since the engine may still be reading our memory and writing the
        peer's. A cancelled write therefore returns only when its pieces in flight have; Mooncake
        bounds that with its own TCP timeouts (about 30 s for a stopped peer, about 60 s for one
        that accepts but never answers). After a cancellation or failure, an unknown part of
        the write may have landed.

        A failed engine call fails every write it carried (they all go to ``peer``; what fails
        a call is the peer or its memory). Raises :class:`TransferError` naming the peer, the
        bytes of the whole write and the engine's code, and :class:`DataPlaneError` for arrays
        of different lengths or a closed data plane.
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
        queue = self._per_peer.get(peer)
        if (nbytes := self._at_once(queue, count, lengths, before)) is not None:
            await trio.lowlevel.checkpoint_if_cancelled()
            self._write_at_once(peer, src, dst, lengths, nbytes, before, after)
            return
        if queue is None:
            queue = self._per_peer[peer] = PeerQueue(self._config.max_calls_per_peer)
        queue.writes += 1
        try:
            await self._write(peer, queue, src, dst, lengths, before, after)
        finally:
            queue.writes -= 1
            if not queue.writes:  # no write left to queue behind: a restarted D is a new peer
                del self._per_peer[peer]

    def _at_once(
        self,
        queue: PeerQueue | None,
        count: int,
        lengths: Addrs,
        before: Callable[[], object] | None,
    ) -> int | None:
        """The write's bytes if it can be made at once in the Trio thread, in one engine call
        of its own (else None): calls that small are made there (``inline_max_bytes``), its KV
        is complete, it fits one call, and no piece to its peer waits while a call to it is
        free (nothing queued to overtake, the per-peer limit kept)."""
        limit = self._inline_limit
        if not limit or count > self._config.max_descriptors_per_call:
            return None
        if queue is not None and (not queue.free_calls or queue.pieces):
            return None
        nbytes = int(lengths.sum())
        return nbytes if nbytes <= limit and ready(before) else None

    def _write_at_once(
        self,
        peer: str,
        src: Addrs,
        dst: Addrs,
        lengths: Addrs,
        nbytes: int,
        before: Callable[[], object] | None,
        after: Callable[[], object] | None,
    ) -> None:
        """The write of :meth:`_at_once` (``nbytes``: what it returned): its engine call here,
        in the Trio thread, with no queue, no worker thread and no schedule point (the call
        blocks the loop anyway; yielding after it only delays what the caller does with the
        landed write). Fails as a write through the queue fails."""
        engine = self._live_engine()
        self._calls += 1
        self._inline_calls += 1
        rc, error = 0, None
        try:
            if before is not None:
                before()
        except Exception as exc:  # as in a worker thread: the KV never became complete
            rc, error = BEFORE_FAILED, not_complete(exc)
        else:
            try:
                rc = engine.batch_transfer_sync_write(
                    peer, src.tolist(), dst.tolist(), lengths.tolist()
                )
            except Exception as exc:
                rc, error = RAISED, f"the engine call raised {exc!r}"
            if rc == 0 and after is not None:
                run_after(after)
            elif rc not in (0, RAISED):
                error = f"engine call of {len(lengths)} descriptors failed"
        self._count(peer, nbytes, len(lengths), rc, error)

    def _count(self, peer: str, nbytes: int, count: int, code: int, error: str | None) -> None:
        """Count a write that ended: done (``error`` None), or failed with ``code`` (raised
        here: :class:`DataPlaneError` when its wait failed, else :class:`TransferError`)."""
        if error is not None:
            self._failures += 1
            if code == BEFORE_FAILED:
                raise DataPlaneError(f"write of {nbytes} bytes to {peer}: {error}")
            raise TransferError(peer, nbytes, code, error)
        self._writes += 1
        self._bytes += nbytes
        self.descriptors += count

    async def _write(
        self,
        peer: str,
        queue: PeerQueue,
        src: Addrs,
        dst: Addrs,
        lengths: Addrs,
        before: Callable[[], object] | None,
        after: Callable[[], object] | None,
    ) -> None:
        count = len(lengths)
        step = self._config.max_descriptors_per_call
        pieces = -(-count // step)
        job = Write(int(lengths.sum()), pieces, before=before, after=after, unlanded=pieces)
        for start in range(0, count, step):
            stop = start + step
            queue.pieces.append(Piece(job, src[start:stop], dst[start:stop], lengths[start:stop]))
        try:
            while job.pending and job.error is None:
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
        self._count(peer, job.nbytes, count, job.code, job.error)

    async def _call(self, peer: str, queue: PeerQueue) -> None:
        """Make one engine call to ``peer`` carrying the pieces at the head of its queue."""
        engine = self._live_engine()
        batch = queue.take(self._config.max_descriptors_per_call)
        for piece in batch:
            piece.write.running += 1
        queue.free_calls -= 1
        self._calls += 1
        jobs = {id(piece.write): piece.write for piece in batch}
        result: tuple[int, dict[int, str]] | None = None
        failure = ""
        call = batch_call(engine, peer, batch)
        try:
            if inline(batch, self._inline_limit):
                self._inline_calls += 1
                result = call()  # in the Trio thread: no hand-off to a thread and back
                await trio.lowlevel.cancel_shielded_checkpoint()  # (the call is done)
            else:
                result = await trio.to_thread.run_sync(
                    call, limiter=self._limiter, abandon_on_cancel=False
                )
        except trio.Cancelled:
            raise  # only while waiting for a worker thread: the call never started
        except Exception as exc:  # the engine call itself raised: each write it carried fails
            result, failure = (RAISED, {}), f"the engine call raised {exc!r}"
        finally:
            queue.free_calls += 1
            if result is None:  # cancelled before the call started: the pieces wait for another
                queue.pieces.extendleft(reversed(batch))
            rc, unready = result if result is not None else (0, {})
            if rc not in (0, RAISED):
                others = len(jobs) - 1
                plural = "s" if others > 1 else ""
                carried = f", carrying {others} other write{plural}" if others else ""
                failure = f"engine call of {descriptors(batch)} descriptors{carried} failed"
            for piece in batch:
                job = piece.write
                job.running -= 1
                if result is None:
                    continue
                if id(job) in unready:
                    code, error = BEFORE_FAILED, unready[id(job)]
                elif rc == 0:
                    job.pending -= 1
                    continue
                else:
                    code, error = rc, failure
                if job.error is None:  # the first failure of a write is its cause
                    job.code, job.error = code, error
            for job in jobs.values():
                job.changed.fire()
            queue.kick()

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
