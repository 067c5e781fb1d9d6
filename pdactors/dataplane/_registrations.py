"""The memory a :class:`~pdactors.dataplane.mooncake.MooncakeDataPlane` has registered with
its engine.

Mooncake refuses to register overlapping memory, and a descriptor that crosses from one
registration into the next fails. What a data plane is given is therefore merged into
disjoint intervals first (:mod:`pdactors.dataplane._intervals`), and only memory no earlier
registration covers is registered: each storage once.
"""

from __future__ import annotations

import logging
from typing import Protocol

from pdactors.dataplane._intervals import merged, uncovered
from pdactors.errors import DataPlaneError

__all__ = ["MemoryRegistrar", "Registrations"]

log = logging.getLogger("pdactors.dataplane.mooncake")  # the data plane's own logger


class MemoryRegistrar(Protocol):
    """The registration calls of ``mooncake.engine.TransferEngine``."""

    def register_memory(self, addr: int, length: int) -> int: ...

    def unregister_memory(self, addr: int) -> int: ...


class Registrations:
    """Sorted, disjoint ``(addr, length)`` intervals, one per ``register_memory`` call that
    worked."""

    def __init__(self) -> None:
        self._intervals: list[tuple[int, int]] = []

    def __len__(self) -> int:
        return len(self._intervals)

    @property
    def nbytes(self) -> int:
        """The bytes registered."""
        return sum(length for _, length in self._intervals)

    def add(self, engine: MemoryRegistrar, regions: list[tuple[int, int]]) -> None:
        """Register the parts of ``(address, length)`` regions not registered yet (merged
        first: overlapping, duplicate and adjacent ones become one interval; zero-length ones
        are ignored). Blocking. Raises :class:`DataPlaneError` for a negative address or
        length, or a failed registration (earlier intervals of the same call stay
        registered)."""
        for start, end in merged(regions):
            for addr, length in uncovered(start, end, self._intervals):
                rc = engine.register_memory(addr, length)
                if rc != 0:
                    raise DataPlaneError(
                        f"register_memory({addr:#x}, {length}) failed with code {rc}"
                    )
                self._intervals.append((addr, length))
                self._intervals.sort()
                log.debug("registered %d bytes at %#x", length, addr)

    def release(self, engine: MemoryRegistrar) -> None:
        """Unregister everything. Blocking. Failures are logged: this is cleanup."""
        for addr, length in self._intervals:
            rc = engine.unregister_memory(addr)
            if rc != 0:
                log.warning("unregister_memory(%#x) of %d bytes returned %d", addr, length, rc)
        self._intervals.clear()
