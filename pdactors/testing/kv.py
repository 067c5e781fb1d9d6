"""What the standalone harness has in place of vLLM's KV cache: a block pool and KV buffers.

A :class:`BlockPool` plays vLLM's block manager (a free list; double frees raise). A
:class:`KVBuffer` is one worker's KV cache, a numpy buffer ``[layers, num_blocks, block_bytes]``
registered as one region, whose :meth:`KVBuffer.expected` bytes let D verify every head of every
block it received. :class:`KVMemory` is what a harness worker needs of its KV, wherever it
lives (``pdactors_vllm.device_kv`` keeps it in CUDA tensors, with the same bytes:
:func:`head_offsets`).
"""

from __future__ import annotations

import hashlib
from typing import Protocol

import numpy as np
import numpy.typing as npt
import trio

from pdactors._pulse import Pulse
from pdactors.core.plan import packed_layout
from pdactors.errors import PdError
from pdactors.wire import Layout

__all__ = ["BlockPool", "KVBuffer", "KVDeviceUnavailable", "KVMemory", "head_offsets"]


class KVDeviceUnavailable(PdError):
    """The KV device asked for is not there (no GPU, torch without CUDA, no such index)."""


class KVMemory(Protocol):
    """One worker's KV as the harness drives it: registered regions, the layout the actors
    plan with, P's fill and D's check of a transfer's bytes."""

    @property
    def layout(self) -> Layout: ...

    @property
    def regions(self) -> list[tuple[int, int]]: ...

    def fill(self, transfer_id: str, blocks: list[int]) -> None: ...

    def verify(self, transfer_id: str, blocks: list[int], src_count: int) -> bool: ...


def head_offsets(
    transfer_id: str, layers: int, count: int, heads: range, total_heads: int, first_layer: int
) -> npt.NDArray[np.uint8]:
    """The pattern's offset of each (layer, block, head) of a transfer: ``[layers * count,
    len(heads)]``. A head of ``n`` bytes holds ``(arange(n) + offset) % 256``, so a misplaced,
    shifted or missing block — or head — is caught. Unique to (request, layer, block, head):
    ``heads`` are the worker's part of the model's ``total_heads``, ``first_layer`` its first
    model layer."""
    seed = int.from_bytes(hashlib.blake2b(transfer_id.encode(), digest_size=4).digest())
    cells = np.arange(layers * count, dtype=np.uint64) + np.uint64(first_layer * count)
    cells = cells[:, None] * np.uint64(total_heads)
    ids = cells + np.arange(heads.start, heads.stop, dtype=np.uint64)[None, :]
    return ((seed + ids * 40503) % 251).astype(np.uint8)


class BlockPool:
    """A free list of block ids, like vLLM's block pool; double frees raise."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._used: set[int] = set()
        self._freed = Pulse()

    @property
    def in_use(self) -> int:
        return len(self._used)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks. Raises :class:`PdError` when fewer are free."""
        if n > len(self._free):
            raise PdError(f"out of KV blocks: want {n}, {len(self._free)} free")
        ids = [self._free.pop() for _ in range(n)]
        self._used.update(ids)
        return ids

    async def take(self, n: int) -> list[int]:
        """Take ``n`` blocks, waiting while fewer are free (blocks a sender has not released
        yet; the caller bounds the wait). Raises :class:`PdError` when the pool is smaller
        than ``n``. Checkpoint."""
        if n > self.num_blocks:
            raise PdError(f"out of KV blocks: want {n}, the pool has {self.num_blocks}")
        while n > len(self._free):
            await self._freed.wait()
        await trio.lowlevel.checkpoint()
        return self.allocate(n)

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if i not in self._used:
                raise PdError(f"block {i} freed twice")
            self._used.remove(i)
            self._free.append(i)
        self._freed.fire()

    async def wait_empty(self) -> None:
        """Wait until no block is allocated. Checkpoint."""
        while self._used:
            await self._freed.wait()
        await trio.lowlevel.checkpoint()


class KVBuffer:
    """One worker's KV cache: ``layers`` regions of ``num_blocks`` blocks of ``block_bytes``.

    ``heads``: which of the model's ``total_heads`` KV heads its blocks hold, back to back
    (a tensor-parallel rank's; default the one "head" that is the whole block).
    ``first_layer``: the model layer of its first region (a pipeline stage's); regions are
    named by model layer.
    """

    def __init__(
        self,
        layers: int,
        num_blocks: int,
        block_bytes: int,
        *,
        heads: range = range(1),
        total_heads: int = 1,
        first_layer: int = 0,
    ) -> None:
        if block_bytes % len(heads):
            raise ValueError(f"{block_bytes} block bytes do not split into {len(heads)} heads")
        self.heads, self.total_heads = heads, total_heads
        self.head_bytes = block_bytes // len(heads)
        self.first_layer = first_layer
        self.data: npt.NDArray[np.uint8] = np.zeros((layers, num_blocks, block_bytes), np.uint8)
        packed = packed_layout(self.data.ctypes.data, layers, num_blocks, block_bytes)
        names = tuple(f"layers.{first_layer + i}" for i in range(layers))
        self.layout = Layout(packed.regions, names)

    @property
    def regions(self) -> list[tuple[int, int]]:
        return [(self.data.ctypes.data, self.data.nbytes)]

    def expected(self, transfer_id: str, count: int) -> npt.NDArray[np.uint8]:
        """The bytes P writes for ``transfer_id``: ``[layers, count, block_bytes]``
        (:func:`head_offsets`; this buffer's heads are its part of the model's block)."""
        layers, _, block_bytes = self.data.shape
        ramp = np.arange(self.head_bytes, dtype=np.uint64).astype(np.uint8)  # wraps at 256
        offsets = head_offsets(
            transfer_id, layers, count, self.heads, self.total_heads, self.first_layer
        )
        block = ramp[None, None, :] + offsets[:, :, None]  # uint8: wraps at 256 too
        return block.reshape(layers, count, block_bytes)

    def fill(self, transfer_id: str, blocks: list[int]) -> None:
        self.data[:, blocks, :] = self.expected(transfer_id, len(blocks))

    def verify(self, transfer_id: str, blocks: list[int], src_count: int) -> bool:
        """True when ``blocks`` hold the last ``len(blocks)`` of P's ``src_count`` blocks."""
        want = self.expected(transfer_id, src_count)[:, src_count - len(blocks) :, :]
        return bool(np.array_equal(self.data[:, blocks, :], want))
