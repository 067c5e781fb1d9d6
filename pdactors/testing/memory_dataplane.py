"""An in-process :class:`~pdactors.dataplane.base.DataPlane`: writes are ``memmove`` calls.

For actor tests where real bytes through a real engine are not the point: no engine threads,
so trio's autojump clock sees every wait and timeout tests run instantly and exactly. The
bytes still move (from P's registered memory into D's), so tests can verify them; a write into
memory the peer never registered, or to a session that does not exist or has closed, fails as a
real engine's would, with :class:`~pdactors.errors.TransferError`.

Keep the tests that move bytes through Mooncake (``tests/test_dataplane.py``, the real clusters):
this class models the protocol, not the engine's limits.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from pdactors.dataplane._batching import run_after
from pdactors.dataplane._intervals import merged
from pdactors.dataplane.base import Addrs
from pdactors.errors import DataPlaneError, TransferError

__all__ = ["MemoryDataPlane", "MemoryFabric"]

# What a refused write reports as the engine's code (Mooncake uses negative codes too).
_REFUSED = -1


@dataclass
class MemoryFabric:
    """The sessions of one test: which :class:`MemoryDataPlane` answers to which name."""

    _planes: dict[str, MemoryDataPlane] = field(default_factory=dict)
    _names: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def open(self) -> MemoryDataPlane:
        """A new data plane on this fabric, with a session name no other plane has had."""
        plane = MemoryDataPlane(self, f"memory:{next(self._names)}")
        self._planes[plane.session] = plane
        return plane

    def _peer(self, session: str) -> MemoryDataPlane | None:
        return self._planes.get(session)

    def _closed(self, plane: MemoryDataPlane) -> None:
        self._planes.pop(plane.session, None)


class MemoryDataPlane:
    """A data plane whose peers live in this process (see the module's docstring)."""

    def __init__(self, fabric: MemoryFabric, session: str) -> None:
        self._fabric = fabric
        self._session = session
        self._registered: list[tuple[int, int]] = []  # (start, end), sorted and disjoint
        self._closed = False
        self.writes = 0
        self.bytes = 0

    @property
    def session(self) -> str:
        return self._session

    def register(self, regions: list[tuple[int, int]]) -> None:
        """Register ``(address, length)`` regions; overlapping and repeated ones (views of one
        storage) are joined, as the Mooncake data plane joins them. Raises
        :class:`DataPlaneError` for a negative address or length, or a closed plane."""
        if self._closed:
            raise DataPlaneError(f"{self._session} is closed")
        known = [(start, end - start) for start, end in self._registered]
        self._registered = merged(known + regions)

    def covers(self, addr: int, length: int) -> bool:
        """Whether ``[addr, addr + length)`` lies inside one registered region."""
        i = bisect.bisect_right(self._registered, (addr, 2**64)) - 1
        return i >= 0 and addr + length <= self._registered[i][1]

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
        """Copy ``lengths[i]`` bytes from ``src[i]`` here to ``dst[i]`` at ``peer``.

        ``after`` runs here (no engine threads) once every byte moved; what it raises is
        logged. Checkpoint (one, before any byte moves: a cancelled write moves nothing). Raises
        :class:`TransferError` when the peer is unknown or closed or a range is not registered
        on its side, :class:`DataPlaneError` when the arrays differ in length, this plane is
        closed, or ``before`` raised.
        """
        count = len(lengths)
        if len(src) != count or len(dst) != count:
            raise DataPlaneError(
                f"src, dst and lengths differ in length ({len(src)}, {len(dst)}, {count})"
            )
        if self._closed:
            raise DataPlaneError(f"{self._session} is closed")
        await trio.lowlevel.checkpoint()
        nbytes = int(lengths.sum()) if count else 0
        if before is not None:
            try:
                before()
            except Exception as exc:
                raise DataPlaneError(f"write of {nbytes} bytes to {peer}: {exc}") from exc
        target = self._fabric._peer(peer)
        if target is None:
            raise TransferError(peer, nbytes, _REFUSED, "no such session")
        for s, d, n in zip(src.tolist(), dst.tolist(), lengths.tolist(), strict=True):
            if not self.covers(s, n):
                raise TransferError(peer, nbytes, _REFUSED, f"source {s:#x}+{n} not registered")
            if not target.covers(d, n):
                raise TransferError(peer, nbytes, _REFUSED, f"target {d:#x}+{n} not registered")
        for s, d, n in zip(src.tolist(), dst.tolist(), lengths.tolist(), strict=True):
            ctypes.memmove(d, s, n)
        self.writes += 1
        self.bytes += nbytes
        if after is not None:
            run_after(after)

    def close(self) -> None:
        """Leave the fabric: later writes to this session fail as to a dead peer."""
        self._closed = True
        self._fabric._closed(self)
