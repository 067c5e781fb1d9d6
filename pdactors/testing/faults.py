"""Fault injection at the data-plane seam: wrappers around a real :class:`DataPlane`."""

from __future__ import annotations

import trio

from pdactors.dataplane.base import Addrs, DataPlane
from pdactors.errors import TransferError

__all__ = ["FaultyDataPlane"]


class FaultyDataPlane:
    """Wraps a real data plane; can hold writes at a gate and fail the next ``fail_writes``.

    Everything it does not break is passed to the real engine unchanged.
    """

    def __init__(self, inner: DataPlane, *, fail_writes: int = 0) -> None:
        self.inner = inner
        self.fail_writes = fail_writes
        self.gate: trio.Event | None = None
        self.writes_started = 0

    @property
    def session(self) -> str:
        return self.inner.session

    def register(self, regions: list[tuple[int, int]]) -> None:
        self.inner.register(regions)

    async def write(self, peer: str, src: Addrs, dst: Addrs, lengths: Addrs) -> None:
        self.writes_started += 1
        if self.gate is not None:
            await self.gate.wait()
        if self.fail_writes > 0:
            self.fail_writes -= 1
            raise TransferError(peer, int(lengths.sum()), -1, "injected fault")
        await self.inner.write(peer, src, dst, lengths)
