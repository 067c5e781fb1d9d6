"""Memory intervals for registration: Mooncake refuses overlapping registrations and fails a
descriptor that crosses from one into the next, so what is registered is kept as sorted,
disjoint ``(addr, length)`` intervals and only memory none of them covers is registered."""

from __future__ import annotations

from pdactors.errors import DataPlaneError

__all__ = ["merged", "uncovered"]


def merged(regions: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(address, length)`` regions as sorted, disjoint ``(start, end)`` intervals:
    overlapping, duplicate and adjacent ones joined, zero-length ones dropped. Raises
    :class:`DataPlaneError` for a negative address or length."""
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
    return wanted


def uncovered(start: int, end: int, registered: list[tuple[int, int]]) -> list[tuple[int, int]]:
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
