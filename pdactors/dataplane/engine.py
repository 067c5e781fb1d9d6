"""Starting and closing a Mooncake Transfer Engine as a
:class:`~pdactors.dataplane.mooncake.MooncakeDataPlane`.

Engine destruction takes about a second and runs in a worker thread. The binding holds the
GIL all that time, so every Python thread, the Trio loop included, stalls for it anyway:
close engines at shutdown, not on a hot path.

``mooncake.engine`` is imported only by :func:`open_mooncake`, so ``import pdactors`` works
without it. Its log level is the user's business (``MC_LOG_LEVEL=ERROR`` in the environment).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from pdactors.config import DataPlaneConfig
from pdactors.dataplane.mooncake import MooncakeDataPlane
from pdactors.errors import DataPlaneError

__all__ = ["CLOSE_TIMEOUT", "open_mooncake"]

log = logging.getLogger("pdactors.dataplane.mooncake")

#: How long closing may take before it is left to finish in the background.
CLOSE_TIMEOUT = 5.0


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
