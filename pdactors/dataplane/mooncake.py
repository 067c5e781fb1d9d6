"""The Mooncake Transfer Engine as a :class:`~pdactors.dataplane.base.DataPlane`.

Safety limits this module enforces (measured, see DESIGN.md):

* More than 2048 descriptors in flight to one peer over TCP fails and can break the path to
  that peer for good. A write is cut into calls of at most ``max_descriptors_per_call``
  descriptors, and a per-peer semaphore allows ``max_calls_per_peer`` calls in flight, so
  descriptors in flight per peer never exceed their product.
* Only ``batch_transfer_sync_write`` is used: ``get_batch_transfer_status`` on a completed
  batch segfaults, so the asynchronous API is off limits.
* Mooncake refuses to register overlapping memory, and a descriptor that crosses from one
  registration into the next fails. :meth:`MooncakeDataPlane.register` therefore merges what
  it is given into disjoint intervals and registers each storage once.
* Engine destruction takes about a second and runs in a worker thread. The binding holds the
  GIL all that time, so every Python thread, the Trio loop included, stalls for it anyway:
  close engines at shutdown, not on a hot path.

``mooncake.engine`` is imported only by :func:`open_mooncake`, so ``import pdactors`` works
without it. Its log level is the user's business (``MC_LOG_LEVEL=ERROR`` in the environment).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import trio

from pdactors.config import DataPlaneConfig
from pdactors.errors import DataPlaneError, TransferError

__all__ = ["DataPlaneStatistics", "MooncakeDataPlane", "MooncakeEngine", "open_mooncake"]

log = logging.getLogger(__name__)

Addrs = npt.NDArray[np.uint64]

#: How long closing may take before it is left to finish in the background.
CLOSE_TIMEOUT = 5.0


class MooncakeEngine(Protocol):
    """The part of ``mooncake.engine.TransferEngine`` this module uses (an initialised one)."""

    def register_memory(self, addr: int, length: int) -> int: ...

    def unregister_memory(self, addr: int) -> int: ...

    def batch_transfer_sync_write(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
    ) -> int: ...


@dataclass(frozen=True, slots=True)
class DataPlaneStatistics:
    """Counters of a :class:`MooncakeDataPlane`.

    ``writes``, ``bytes`` and ``descriptors`` count writes that completed; ``failures`` counts
    writes that raised :class:`TransferError`; ``calls`` counts engine calls (chunks), failed
    ones included; ``registrations`` and ``registered_bytes`` describe the memory registered.
    """

    writes: int
    bytes: int
    descriptors: int
    failures: int
    calls: int
    registrations: int
    registered_bytes: int


class MooncakeDataPlane:
    """Writes KV bytes into peers' memory through an initialised Mooncake engine.

    ``engine`` must already be initialised; ``session`` is the name peers write to
    (``"host:rpc_port"``). Most callers use :func:`open_mooncake`, which makes both and
    cleans up; tests may share one engine between several data planes.
    """

    def __init__(self, engine: MooncakeEngine, config: DataPlaneConfig, session: str) -> None:
        self._engine: MooncakeEngine | None = engine
        self._config = config
        self._session = session
        self._limiter = trio.CapacityLimiter(config.workers)
        self._per_peer: dict[str, trio.Semaphore] = {}
        # Sorted, disjoint (addr, length) intervals, one per register_memory call that worked.
        self._registered: list[tuple[int, int]] = []
        self._writes = self._bytes = self._descriptors = self._failures = self._calls = 0

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
            descriptors=self._descriptors,
            failures=self._failures,
            calls=self._calls,
            registrations=len(self._registered),
            registered_bytes=sum(length for _, length in self._registered),
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
        engine = self._live_engine()
        wanted: list[tuple[int, int]] = []
        for addr, length in sorted(regions):
            if addr < 0 or length < 0:
                raise DataPlaneError(f"cannot register region at {addr:#x} of {length} bytes")
            if length == 0:
                continue
            end = addr + length
            if wanted and addr <= wanted[-1][1]:
                wanted[-1] = (wanted[-1][0], max(wanted[-1][1], end))
            else:
                wanted.append((addr, end))
        for start, end in wanted:
            for addr, length in _uncovered(start, end, self._registered):
                rc = engine.register_memory(addr, length)
                if rc != 0:
                    raise DataPlaneError(
                        f"register_memory({addr:#x}, {length}) failed with code {rc}"
                    )
                self._registered.append((addr, length))
                self._registered.sort()
                log.debug("registered %d bytes at %#x", length, addr)

    async def write(self, peer: str, src: Addrs, dst: Addrs, lengths: Addrs) -> None:
        """Write ``lengths[i]`` bytes from local ``src[i]`` to ``peer``'s ``dst[i]``.

        Checkpoint, even when there is nothing to write. The descriptors go out in calls of at
        most ``max_descriptors_per_call``, one after the other, each in a worker thread
        (at most ``workers`` threads for the whole data plane, at most ``max_calls_per_peer``
        calls in flight to one peer).

        Cancellation: waiting for a worker or for the peer's turn is cancellable, but a call
        the engine has started is not abandoned, since the engine may still be reading our
        memory and writing the peer's. A cancelled write therefore returns only when the call
        in flight does; Mooncake bounds that with its own TCP timeouts (about 30 s for a
        stopped peer, about 60 s for one that accepts but never answers). Calls not yet
        started are skipped. After a cancellation or failure, an unknown prefix of the write
        may have landed.

        Raises :class:`TransferError` naming the peer, the bytes of the whole write and the
        engine's code, and :class:`DataPlaneError` for arrays of different lengths or a
        closed data plane.
        """
        count = len(lengths)
        if len(src) != count or len(dst) != count:
            raise DataPlaneError(
                f"src, dst and lengths differ in length ({len(src)}, {len(dst)}, {count})"
            )
        engine = self._live_engine()
        if count == 0:
            await trio.lowlevel.checkpoint()
            return
        nbytes = int(lengths.sum())
        step = self._config.max_descriptors_per_call
        chunks = range(0, count, step)
        peer_calls = self._per_peer.get(peer)
        if peer_calls is None:
            peer_calls = self._per_peer[peer] = trio.Semaphore(self._config.max_calls_per_peer)
        for index, start in enumerate(chunks):
            stop = start + step
            call = _chunk_call(engine, peer, src[start:stop], dst[start:stop], lengths[start:stop])
            async with peer_calls:
                self._calls += 1
                rc = await trio.to_thread.run_sync(
                    call, limiter=self._limiter, abandon_on_cancel=False
                )
            if rc != 0:
                self._failures += 1
                landed = "; the calls before it landed" if index else ""
                raise TransferError(
                    peer,
                    nbytes,
                    rc,
                    f"engine call {index + 1} of {len(chunks)} "
                    f"({min(step, count - start)} descriptors) failed{landed}",
                )
        self._writes += 1
        self._bytes += nbytes
        self._descriptors += count

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
        for addr, length in self._registered:
            rc = engine.unregister_memory(addr)
            if rc != 0:
                log.warning("unregister_memory(%#x) of %d bytes returned %d", addr, length, rc)
        self._registered.clear()
        return engine

    def close(self) -> None:
        """Unregister this data plane's memory and stop using the engine.

        Blocking (not a checkpoint). The engine itself is not destroyed: whoever made it owns
        it. :func:`open_mooncake` does this for you.
        """
        self._detach()


def _chunk_call(
    engine: MooncakeEngine, peer: str, src: Addrs, dst: Addrs, lengths: Addrs
) -> Callable[[], int]:
    # Lists are built in the worker thread: for a 1024-descriptor chunk that is ~50 µs the
    # Trio thread does not spend.
    def call() -> int:
        return engine.batch_transfer_sync_write(peer, src.tolist(), dst.tolist(), lengths.tolist())

    return call


def _uncovered(start: int, end: int, registered: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Parts of ``[start, end)`` not covered by the sorted, disjoint ``registered`` intervals,
    as ``(addr, length)``."""
    parts = []
    cursor = start
    for addr, length in registered:
        if addr + length <= cursor:
            continue
        if addr >= end:
            break
        if addr > cursor:
            parts.append((cursor, addr - cursor))
        cursor = max(cursor, addr + length)
        if cursor >= end:
            break
    if cursor < end:
        parts.append((cursor, end - cursor))
    return parts


def _start_engine(config: DataPlaneConfig) -> tuple[Any, int]:
    """Import Mooncake, create and initialise an engine. Blocking (~1 s)."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        if "libibverbs" in str(exc):
            hint = "Mooncake needs libibverbs even for tcp: apt-get install -y libibverbs1"
        else:
            hint = "install mooncake-transfer-engine-non-cuda (or the CUDA build)"
        raise DataPlaneError(f"cannot import mooncake.engine ({exc}); {hint}") from exc
    engine = TransferEngine()
    rc = engine.initialize(config.hostname, "P2PHANDSHAKE", config.protocol, config.device_name)
    if rc != 0:
        raise DataPlaneError(
            f"Mooncake engine failed to start (code {rc}) with protocol {config.protocol!r}, "
            f"hostname {config.hostname!r}, device {config.device_name!r}"
        )
    return engine, int(engine.get_rpc_port())


def _close_engine(plane: MooncakeDataPlane) -> None:
    engine = plane._detach()
    # Dropping the last reference here destroys the engine (~1 s) in this worker thread.
    del engine


@asynccontextmanager
async def open_mooncake(config: DataPlaneConfig) -> AsyncIterator[MooncakeDataPlane]:
    """Start a Mooncake engine and yield a :class:`MooncakeDataPlane` over it.

    Checkpoint on entry and exit. The engine starts in a worker thread; on exit the
    registered memory is unregistered and the engine destroyed in a worker thread, shielded
    from cancellation and bounded to :data:`CLOSE_TIMEOUT` seconds (past that the thread is
    left to finish on its own). Destruction takes ~1 s with the GIL held (a Mooncake binding
    fact), so the whole process, Trio loop included, stalls for that second.
    Every write must have finished before the block exits (run writers in a nursery inside
    it): the engine must not be destroyed under a call in flight.

    Raises :class:`DataPlaneError` when Mooncake cannot be imported (with a hint) or the
    engine fails to start.
    """
    engine, port = await trio.to_thread.run_sync(_start_engine, config)
    plane = MooncakeDataPlane(engine, config, f"{config.hostname}:{port}")
    # The data plane now owns the only reference, so the engine dies in the closing thread.
    del engine
    log.info("Mooncake %s engine up at %s", config.protocol, plane.session)
    try:
        yield plane
    finally:
        with trio.move_on_after(CLOSE_TIMEOUT, shield=True) as scope:
            await trio.to_thread.run_sync(_close_engine, plane, abandon_on_cancel=True)
        if scope.cancelled_caught:
            log.warning("Mooncake engine %s took over %ss to close", plane.session, CLOSE_TIMEOUT)
