"""Corruption in flight: a wrapper around a real :class:`DataPlane` that, on the writes it is
armed for, makes the bytes that land in D differ from P's — what D's KV checksums must catch.

* ``flip``: the real write, then one byte of one run overwritten with its complement;
* ``truncate``: one run written short; its tail holds the complement of P's bytes (D's stale
  bytes might happen to equal P's, and a corruption that changes nothing is none);
* ``shift``: one run written one byte off (to ``dst + 1``, one byte shorter), its first byte
  the complement of P's.

The extra bytes come from a small scratch buffer the wrapper registers with the real engine,
and go through it too, so the harness and ``pdactors chaos`` corrupt real Mooncake TCP writes.
A write is armed by kind (:meth:`CorruptingDataPlane.arm`), or for the write whose first source
byte is an address (one transfer's blocks: :meth:`CorruptingDataPlane.arm_source`).
"""

from __future__ import annotations

import ctypes
import random
from collections import deque
from collections.abc import Callable
from typing import Final

import numpy as np

from pdactors.dataplane.base import Addrs, DataPlane

__all__ = ["CORRUPTIONS", "CorruptingDataPlane"]

CORRUPTIONS: Final = ("flip", "truncate", "shift")
_SCRATCH: Final = 4096  # the longest tail a truncation replaces


def _addrs(*values: int) -> Addrs:
    return np.array(values, dtype=np.uint64)


class CorruptingDataPlane:
    """Wraps ``inner``; corrupts the writes it is armed for (see the module docstring), at a
    run and byte drawn from ``random.Random(seed)``. ``injected`` lists what it did:
    ``(kind, run index, destination address)``."""

    def __init__(self, inner: DataPlane, *, seed: int = 0) -> None:
        self.inner = inner
        self.random = random.Random(seed)
        self.armed: deque[str] = deque()
        self.by_source: dict[int, str] = {}
        self.injected: list[tuple[str, int, int]] = []
        self._scratch = np.zeros(_SCRATCH, dtype=np.uint8)
        inner.register([(self._scratch.ctypes.data, _SCRATCH)])

    @property
    def session(self) -> str:
        return self.inner.session

    def register(self, regions: list[tuple[int, int]]) -> None:
        self.inner.register(regions)

    def arm(self, kind: str) -> None:
        """Corrupt the next write (with bytes to move) not armed by source."""
        if kind not in CORRUPTIONS:
            raise ValueError(f"unknown corruption {kind!r} (one of {', '.join(CORRUPTIONS)})")
        self.armed.append(kind)

    def arm_source(self, addr: int, kind: str | None) -> None:
        """Corrupt the write whose first source byte is ``addr`` (None: disarm it)."""
        if kind is None:
            self.by_source.pop(addr, None)
            return
        self.arm(kind)
        self.armed.pop()  # checked, not queued
        self.by_source[addr] = kind

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
        kind = self.by_source.pop(int(src[0]), None) if len(src) and self.by_source else None
        if kind is None and self.armed and len(lengths):
            kind = self.armed.popleft()
        if kind is None:
            await self.inner.write(peer, src, dst, lengths, before=before, after=after)
            return
        i = self.random.randrange(len(lengths))
        s, d, n = int(src[i]), int(dst[i]), int(lengths[i])
        if kind == "flip" or n == 1:
            await self.inner.write(peer, src, dst, lengths, before=before)
            k = self.random.randrange(n)
            await self._poison(peer, s + k, d + k, 1, after)
        elif kind == "truncate":
            tail = 1 + self.random.randrange(min(n - 1, _SCRATCH))
            short = lengths.copy()
            short[i] = n - tail
            await self.inner.write(peer, src, dst, short, before=before)
            await self._poison(peer, s + n - tail, d + n - tail, tail, after)
        else:  # shift
            keep = np.arange(len(lengths)) != i
            if keep.any():  # ``before`` goes with the first write that moves bytes
                await self.inner.write(peer, src[keep], dst[keep], lengths[keep], before=before)
                before = None
            await self.inner.write(peer, _addrs(s), _addrs(d + 1), _addrs(n - 1), before=before)
            await self._poison(peer, s, d, 1, after)  # ``after``: once the corruption landed
        self.injected.append((kind, i, d))

    async def _poison(
        self, peer: str, src: int, dst: int, n: int, after: Callable[[], object] | None
    ) -> None:
        """Write the complement of P's ``n`` bytes at ``src`` to ``dst`` at ``peer``."""
        theirs = np.frombuffer(
            memoryview((ctypes.c_char * n).from_address(src)).cast("B"), np.uint8
        )
        np.invert(theirs, out=self._scratch[:n])
        scratch = _addrs(self._scratch.ctypes.data)
        await self.inner.write(peer, scratch, _addrs(dst), _addrs(n), after=after)
