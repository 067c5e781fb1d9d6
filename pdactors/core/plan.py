"""Transfer planning: KV regions and block ids → coalesced ``(src, dst, length)`` descriptors.

Pure and sans-IO (numpy only). The rules:

* P and D list their regions in the same order (one per layer, or K and V apart); region ``r``
  on both sides must move the same ``block_bytes`` per block.
* Block ``i`` of region ``r`` lives at ``base + i * stride``; ``block_bytes <= stride`` bytes of
  it are moved.
* Block ids come per KV-cache group (:data:`~pdactors.wire.BlockIds`; a region moves its
  group's ids). Within a group, D may ask for fewer blocks than P holds (D already has a prefix
  of the prompt locally, or keeps only a sliding window's tail); P then sends its *last*
  ``len(dst_blocks)`` blocks of that group.
* Descriptors are emitted in (region, block) order and adjacent ones merge whenever both the
  source and the destination are contiguous, so a run of consecutive block ids becomes one
  descriptor per region, and regions that sit back to back on both sides merge further.
  Coalescing is worth about tenfold on GPUs (two H200s over NVLink: 141.75 MiB at ~312 GB/s as
  36 descriptors, ~27.6 GB/s as 2016 of 72 KiB), which is why it happens here, once.
* Every block id is bounds-checked against its region on its side before any address is
  computed: a plan never holds a descriptor outside its region.
* Heterogeneous tensor parallelism: in each region a block is its rank's KV heads back to
  back, ``block_bytes / heads`` bytes each (vLLM CPU's ``[blocks, kv_heads, block_size,
  2*head]``, and GPUs' head-major ``HND`` layout). A :class:`HeadSlice` restricts a plan to
  some heads on both sides; :mod:`pdactors.core.tp` says which P ranks supply which heads
  (its names are re-exported here).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from pdactors.core.tp import WHOLE_BLOCK, HeadSlice, rank_heads, tp_expected, tp_pulls, tp_sources
from pdactors.errors import LayoutMismatch, PlanError
from pdactors.wire import BlockIds, BlockLayout, Layout, block_groups, region_groups

__all__ = [
    "WHOLE_BLOCK",
    "HeadSlice",
    "TransferPlan",
    "check_layout",
    "matching_regions",
    "plan_transfer",
    "rank_heads",
    "tp_expected",
    "tp_pulls",
    "tp_sources",
]

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
    ``stride``, ``block_bytes <= stride``, and the region's last byte is a 64-bit address;
    names, if any, one per region and distinct. Raises :class:`PlanError` naming the first bad
    region.
    """
    if not layout.regions:
        raise PlanError("layout has no regions")
    if layout.names and (
        len(layout.names) != len(layout.regions) or len(set(layout.names)) != len(layout.names)
    ):
        raise PlanError(f"{len(layout.names)} region names for {len(layout.regions)} regions, "
                        "or a name given twice")  # fmt: skip
    if layout.groups and (len(layout.groups) != len(layout.regions) or min(layout.groups) < 0):
        raise PlanError(f"{len(layout.groups)} region groups for {len(layout.regions)} "
                        "regions, or a negative group")  # fmt: skip
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
    group: npt.NDArray[np.intp]
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
        group=np.array(region_groups(layout), dtype=np.intp),
        num_blocks=num_blocks,
        min_blocks=min(num_blocks),
    )


@functools.lru_cache(maxsize=64)
def _prepare_pair(
    src: Layout, dst: Layout, heads: HeadSlice | None = None
) -> tuple[_Prepared, _Prepared]:
    """Both layouts prepared and checked to be alike, once per pair (D workers are few); with
    ``heads``, narrowed to that head slice: each region's base moved to the slice's first head
    on its side and its block bytes cut to the slice's (equal on both sides, or the engines
    differ in dtype, head size or block size)."""
    sp, dp = _prepare(src), _prepare(dst)
    if len(sp.num_blocks) != len(dp.num_blocks):
        raise LayoutMismatch(
            f"P has {len(sp.num_blocks)} KV regions, D has {len(dp.num_blocks)}: "
            "the engines are not configured alike"
        )
    if not np.array_equal(sp.group, dp.group):
        r = int(np.flatnonzero(sp.group != dp.group)[0])
        groups = f"{int(sp.group[r])} on P but {int(dp.group[r])} on D"
        raise LayoutMismatch(f"region {r} is in KV-cache group {groups}: "
                             "the engines are not configured alike")  # fmt: skip
    h = WHOLE_BLOCK if heads is None else heads
    if h.num_heads < 1 or h.src_first < 0 or h.dst_first < 0 or min(h.src_heads, h.dst_heads) < 1:
        raise PlanError(f"bad head slice {h}")
    if h.src_first + h.num_heads > h.src_heads or h.dst_first + h.num_heads > h.dst_heads:
        raise PlanError(f"head slice {h} reaches past the heads a block holds")
    if np.any(sp.block_bytes % h.src_heads) or np.any(dp.block_bytes % h.dst_heads):
        raise LayoutMismatch(f"a region's block bytes do not split into {h.src_heads} (P) or "
                             f"{h.dst_heads} (D) heads")  # fmt: skip
    s_head = sp.block_bytes // np.uint64(h.src_heads)
    d_head = dp.block_bytes // np.uint64(h.dst_heads)
    if not np.array_equal(s_head, d_head):
        r = int(np.flatnonzero(s_head != d_head)[0])
        unit, why = ("per block", "heads") if heads is None else ("per head per block", "head size")
        raise LayoutMismatch(
            f"region {r} moves {int(s_head[r])} bytes {unit} on P but "
            f"{int(d_head[r])} on D (different dtype, {why} or block size?)"
        )
    if heads is None:
        return sp, dp
    moved = s_head * np.uint64(h.num_heads)
    return (
        sp._replace(base=sp.base + s_head * np.uint64(h.src_first), block_bytes=moved),
        dp._replace(base=dp.base + d_head * np.uint64(h.dst_first), block_bytes=moved),
    )


@functools.lru_cache(maxsize=64)
def matching_regions(src: Layout, dst: Layout) -> Layout:
    """``dst``'s regions in ``src``'s order, paired by name: what a P pipeline stage (some
    layers) writes into a D that holds more. Without names on both sides, or with the same
    names, ``dst`` itself (regions pair by position). Raises :class:`LayoutMismatch` naming a
    region of P that D does not have."""
    if not (src.names and dst.names) or src.names == dst.names:
        return dst
    index = {name: i for i, name in enumerate(dst.names)}
    missing = [n for n in src.names if n not in index]
    if missing:
        raise LayoutMismatch(
            f"D has no KV region {missing[0]!r} of P ({len(missing)} of P's "
            f"{len(src.names)} missing): the engines do not serve the same model"
        )
    rows = [index[n] for n in src.names]
    groups = tuple(dst.groups[i] for i in rows) if dst.groups else ()
    return Layout(tuple(dst.regions[i] for i in rows), src.names, groups)


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
        base=prep.base[rows],
        stride=prep.stride[rows],
        block_bytes=prep.block_bytes[rows],
        group=prep.group[rows],
    )


def _descriptors(prep: _Prepared, ids: _Ids) -> Addrs:
    # (region, block) order: row r holds region r's addresses for every id.
    addrs = prep.base[:, None] + ids.astype(np.uint64)[None, :] * prep.stride[:, None]
    return addrs.ravel()


def plan_transfer(
    src: Layout,
    src_blocks: BlockIds | Sequence[int],
    dst: Layout,
    dst_blocks: BlockIds | Sequence[int],
    regions: Sequence[int] | None = None,
    heads: HeadSlice | None = None,
) -> TransferPlan:
    """Plan copying P's blocks ``src_blocks`` (in layout ``src``) into D's ``dst_blocks``.

    Blocks are named per KV-cache group (:data:`~pdactors.wire.BlockIds`; a flat sequence
    is the one group's) and each region moves its group's. In a group where D asks for fewer
    blocks than P has, P's *last* ones are sent (D holds the prefix already, or keeps only a
    sliding window's tail). A group D leaves out or empty moves nothing; no blocks at all give
    an empty plan. ``regions``: only these regions (by index, e.g. one layer's K and V while
    it is streamed), default all. ``heads``: only these KV heads of each block (heterogeneous
    TP: P's and D's blocks hold different heads), default the whole block.

    Raises :class:`LayoutMismatch` when the region counts, groups or per-region
    ``block_bytes`` (per head, with ``heads``) differ, and :class:`PlanError` for a malformed
    layout or head slice, more blocks of a group on D than on P, blocks of a group no region
    is in, a block id outside its region, or a destination block named twice in a group.
    """
    sp, dp = _prepare_pair(src, dst, None if heads == WHOLE_BLOCK else heads)
    s_groups, d_groups = _groups(src_blocks, "P"), _groups(dst_blocks, "D")
    n_groups = int(sp.group.max()) + 1
    if len(d_groups) > len(s_groups) and any(d_groups[len(s_groups) :]):
        raise PlanError(f"D asks for blocks of {len(d_groups)} KV-cache groups but P names "
                        f"only {len(s_groups)}")  # fmt: skip
    if len(d_groups) > n_groups and any(d_groups[n_groups:]):
        raise PlanError(f"D asks for blocks of KV-cache group {len(d_groups) - 1}, but the "
                        f"layout has {n_groups} group(s)")  # fmt: skip
    # Every P id is checked, sent or not: a bad one means P's bookkeeping is wrong.
    s_ids = [_as_ids(g, "P") for g in s_groups]
    for ids in s_ids:
        _check_bounds(ids, sp, "P")
    if regions is not None:
        sp, dp = _only(sp, regions), _only(dp, regions)
    s_parts: list[Addrs] = []
    d_parts: list[Addrs] = []
    l_parts: list[Addrs] = []
    for g, wanted in enumerate(d_groups):
        n = len(wanted)
        if not n:
            continue  # (also a group P does not name: checked above to be empty)
        m = len(s_ids[g])
        if n > m:
            where = f" of KV-cache group {g}" if n_groups > 1 else ""
            raise PlanError(f"D asks for {n} blocks{where} but P holds only {m}")
        d_ids = _as_ids(wanted, "D")
        _check_bounds(d_ids, dp, "D")
        if n > 1 and len(set(d_ids.tolist())) != n:
            # Chunks of a write may land in any order: two copies into one block race.
            raise PlanError("D block ids contain duplicates")
        sg, dg = (sp, dp) if n_groups == 1 else _group_rows(sp, dp, g)
        s_parts.append(_descriptors(sg, s_ids[g][m - n :]))
        d_parts.append(_descriptors(dg, d_ids))
        l_parts.append(np.repeat(sg.block_bytes, n))  # per head slice: the slice's bytes
    if len(s_parts) == 1:
        s_addr, d_addr, lengths = s_parts[0], d_parts[0], l_parts[0]
    else:
        s_addr, d_addr, lengths = (
            np.concatenate(parts) if parts else _NONE for parts in (s_parts, d_parts, l_parts)
        )
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


_NONE: Addrs = np.zeros(0, dtype=np.uint64)


def _groups(ids: BlockIds | Sequence[int], side: str) -> BlockIds:
    if isinstance(ids, tuple) and (not ids or isinstance(ids[0], tuple)):
        return ids  # type: ignore[return-value]  # already per group (the wire's form)
    try:
        return block_groups(ids)
    except TypeError as exc:
        raise PlanError(f"{side} block ids: {exc}") from None


def _group_rows(sp: _Prepared, dp: _Prepared, group: int) -> tuple[_Prepared, _Prepared]:
    """Both sides restricted to the regions of KV-cache ``group`` (their groups are equal)."""
    rows = np.flatnonzero(sp.group == group)
    return _only(sp, rows.tolist()), _only(dp, rows.tolist())
