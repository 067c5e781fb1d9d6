"""Transfer planning: KV regions and block ids → coalesced ``(src, dst, length)`` descriptors.

Pure and sans-IO (numpy only). The rules:

* P and D list their regions in the same order (one per layer, or K and V apart); region ``r``
  on both sides must move the same ``block_bytes`` per block.
* Block ``i`` of region ``r`` lives at ``base + i * stride``; ``block_bytes <= stride`` bytes of
  it are moved.
* Prefix caching: D may ask for fewer blocks than P holds (D already has a prefix of the prompt
  locally); P then sends its *last* ``len(dst_blocks)`` blocks.
* Descriptors are emitted in (region, block) order and adjacent ones merge whenever both the
  source and the destination are contiguous, so a run of consecutive block ids becomes one
  descriptor per region, and regions that sit back to back on both sides merge further.
  Coalescing is worth about tenfold on GPUs (see DESIGN.md), which is why it happens here, once.
* Every block id is bounds-checked against its region on its side before any address is
  computed: a plan never holds a descriptor outside its region.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from pdactors.errors import LayoutMismatch, PlanError
from pdactors.messages import BlockLayout, Layout

__all__ = ["TransferPlan", "check_layout", "peer_tp_rank", "plan_transfer"]

Addrs = npt.NDArray[np.uint64]
_Ids = npt.NDArray[np.int64]

_ADDR_LIMIT = 1 << 64


@dataclass(frozen=True, eq=False, slots=True)
class TransferPlan:
    """Descriptors of one transfer: copy ``lengths[i]`` bytes from ``src[i]`` to ``dst[i]``.

    The three arrays are ``uint64``, equally long and read-only.
    """

    src: Addrs
    dst: Addrs
    lengths: Addrs

    @property
    def nbytes(self) -> int:
        """Total bytes the plan moves."""
        return int(self.lengths.sum())

    @property
    def descriptors(self) -> int:
        """Number of descriptors (after coalescing)."""
        return len(self.lengths)


def packed_layout(base: int, regions: int, num_blocks: int, block_bytes: int) -> Layout:
    """``regions`` regions of ``num_blocks`` packed blocks each, back to back from ``base``
    (a ``[regions, num_blocks, block_bytes]`` buffer)."""
    size = num_blocks * block_bytes
    return Layout(
        tuple(
            BlockLayout(base + i * size, num_blocks, block_bytes, block_bytes)
            for i in range(regions)
        )
    )


def check_layout(layout: Layout) -> None:
    """Check that ``layout`` is well formed.

    At least one region; in each, ``base >= 0``, positive ``num_blocks``, ``block_bytes`` and
    ``stride``, ``block_bytes <= stride``, and the region's last byte is a 64-bit address.
    Raises :class:`PlanError` naming the first bad region.
    """
    if not layout.regions:
        raise PlanError("layout has no regions")
    for r, reg in enumerate(layout.regions):
        if reg.base < 0 or reg.num_blocks <= 0 or reg.block_bytes <= 0 or reg.stride <= 0:
            raise PlanError(f"region {r}: base must be >= 0 and sizes > 0, got {reg}")
        if reg.block_bytes > reg.stride:
            raise PlanError(
                f"region {r}: block_bytes {reg.block_bytes} exceeds stride {reg.stride}"
            )
        if reg.base + (reg.num_blocks - 1) * reg.stride + reg.block_bytes > _ADDR_LIMIT:
            raise PlanError(f"region {r}: does not fit in a 64-bit address space: {reg}")


class _Prepared(NamedTuple):
    base: Addrs
    stride: Addrs
    block_bytes: Addrs
    num_blocks: tuple[int, ...]
    min_blocks: int


# A sender plans against the same few layouts (one per D worker) over and over; turning a
# 36-region layout into arrays and validating it costs more than the plan itself, so it is
# done once per distinct layout. Layouts are frozen and hashable; this is pure memoisation.
@functools.lru_cache(maxsize=64)
def _prepare(layout: Layout) -> _Prepared:
    check_layout(layout)
    regions = layout.regions
    num_blocks = tuple(r.num_blocks for r in regions)
    return _Prepared(
        base=np.array([r.base for r in regions], dtype=np.uint64),
        stride=np.array([r.stride for r in regions], dtype=np.uint64),
        block_bytes=np.array([r.block_bytes for r in regions], dtype=np.uint64),
        num_blocks=num_blocks,
        min_blocks=min(num_blocks),
    )


@functools.lru_cache(maxsize=64)
def _prepare_pair(src: Layout, dst: Layout) -> tuple[_Prepared, _Prepared]:
    """Both layouts prepared, checked to be alike once per pair (D workers are few)."""
    sp = _prepare(src)
    dp = _prepare(dst)
    if len(sp.num_blocks) != len(dp.num_blocks):
        raise LayoutMismatch(
            f"P has {len(sp.num_blocks)} KV regions, D has {len(dp.num_blocks)}: "
            "the engines are not configured alike"
        )
    if not np.array_equal(sp.block_bytes, dp.block_bytes):
        r = int(np.flatnonzero(sp.block_bytes != dp.block_bytes)[0])
        raise LayoutMismatch(
            f"region {r} moves {int(sp.block_bytes[r])} bytes per block on P but "
            f"{int(dp.block_bytes[r])} on D (different dtype, heads or block size?)"
        )
    return sp, dp


def _as_ids(ids: Sequence[int], side: str) -> _Ids:
    try:
        arr = np.asarray(ids, dtype=np.int64)
    except (OverflowError, TypeError, ValueError) as exc:
        raise PlanError(f"{side} block ids are not 64-bit integers: {exc}") from None
    if arr.ndim != 1:
        raise PlanError(f"{side} block ids must be a flat sequence, got shape {arr.shape}")
    return arr


def _check_bounds(ids: _Ids, prep: _Prepared, side: str) -> None:
    if not len(ids):
        return
    # Python's min and max beat numpy's reductions on the short lists a transfer has.
    listed = ids.tolist() if len(ids) <= 4096 else None
    lo, hi = (min(listed), max(listed)) if listed else (int(ids.min()), int(ids.max()))
    if lo >= 0 and hi < prep.min_blocks:
        return
    bad = lo if lo < 0 else hi
    # Name the region that rejects it (regions may differ in size).
    r = next(r for r, n in enumerate(prep.num_blocks) if not 0 <= bad < n)
    raise PlanError(
        f"{side} block id {bad} is out of range [0, {prep.num_blocks[r]}) of {side} region {r}"
    )


def _only(prep: _Prepared, regions: Sequence[int]) -> _Prepared:
    """``prep`` restricted to ``regions`` (indices)."""
    rows = np.asarray(regions, dtype=np.intp)
    n = len(prep.num_blocks)
    if rows.ndim != 1 or (len(rows) and not 0 <= rows.min() <= rows.max() < n):
        raise PlanError(f"regions {list(regions)} are not among the {n} of the layout")
    return prep._replace(
        base=prep.base[rows], stride=prep.stride[rows], block_bytes=prep.block_bytes[rows]
    )


def _descriptors(prep: _Prepared, ids: _Ids) -> Addrs:
    # (region, block) order: row r holds region r's addresses for every id.
    addrs = prep.base[:, None] + ids.astype(np.uint64)[None, :] * prep.stride[:, None]
    return addrs.ravel()


def plan_transfer(
    src: Layout,
    src_blocks: Sequence[int],
    dst: Layout,
    dst_blocks: Sequence[int],
    regions: Sequence[int] | None = None,
) -> TransferPlan:
    """Plan copying P's blocks ``src_blocks`` (in layout ``src``) into D's ``dst_blocks``.

    If D asks for fewer blocks than P has, P's *last* ``len(dst_blocks)`` blocks are sent
    (D holds the prefix already). Empty ``dst_blocks`` gives an empty plan. ``regions``: only
    these regions (by index, e.g. one layer's K and V while it is streamed), default all.

    Raises :class:`LayoutMismatch` when the region counts or per-region ``block_bytes``
    differ, and :class:`PlanError` for a malformed layout, more ``dst_blocks`` than
    ``src_blocks``, a block id outside its region, or a destination block named twice.
    """
    sp, dp = _prepare_pair(src, dst)
    n, m = len(dst_blocks), len(src_blocks)
    if n > m:
        raise PlanError(f"D asks for {n} blocks but P holds only {m}")
    s_ids = _as_ids(src_blocks, "P")
    d_ids = _as_ids(dst_blocks, "D")
    # Every P id is checked, sent or not: a bad one means P's bookkeeping is wrong.
    _check_bounds(s_ids, sp, "P")
    _check_bounds(d_ids, dp, "D")
    s_ids = s_ids[m - n :]
    if n > 1 and len(set(d_ids.tolist())) != n:
        # Chunks of a write may land in any order: two copies into one block race.
        raise PlanError("D block ids contain duplicates")

    if regions is not None:
        sp, dp = _only(sp, regions), _only(dp, regions)
    s_addr = _descriptors(sp, s_ids)
    d_addr = _descriptors(dp, d_ids)
    lengths = np.repeat(sp.block_bytes, n)
    total = len(lengths)
    if total > 1:
        # A descriptor starts a new run unless it continues the previous one on both sides.
        starts_run = np.empty(total, dtype=np.bool_)
        starts_run[0] = True
        np.not_equal(s_addr[:-1] + lengths[:-1], s_addr[1:], out=starts_run[1:])
        starts_run[1:] |= d_addr[:-1] + lengths[:-1] != d_addr[1:]
        starts = np.flatnonzero(starts_run)
        if len(starts) < total:
            s_addr = s_addr[starts]
            d_addr = d_addr[starts]
            lengths = np.add.reduceat(lengths, starts)
    for arr in (s_addr, d_addr, lengths):
        arr.setflags(write=False)
    return TransferPlan(src=s_addr, dst=d_addr, lengths=lengths)


def peer_tp_rank(local_tp_rank: int, local_tp_size: int, remote_tp_size: int) -> int:
    """The remote TP rank that exchanges KV with ``local_tp_rank``.

    Only homogeneous TP is supported (rank ``i`` ↔ rank ``i``). This is the one place the
    mapping lives. Raises :class:`PlanError` for a bad rank or different TP sizes.
    """
    if not 0 <= local_tp_rank < local_tp_size:
        raise PlanError(f"tp_rank {local_tp_rank} is outside tp_size {local_tp_size}")
    if remote_tp_size != local_tp_size:
        raise PlanError(
            f"heterogeneous TP (local tp_size {local_tp_size}, remote {remote_tp_size}) "
            "is not supported yet"
        )
    return local_tp_rank
