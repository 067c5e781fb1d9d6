"""Heterogeneous tensor parallelism: which P ranks hold which KV heads, and who pulls what.

Pure arithmetic, in closed form: the TP sizes and head counts come off the wire (bounded by
:data:`~pdactors.wire.LIMITS`), so no function here loops over the ranks of one side
for each rank of the other. :func:`tp_pulls` costs what it returns (one entry per P rank a D
rank pulls from), :func:`tp_expected` is constant time.

A rank holds a contiguous range of the model's KV heads (:func:`rank_heads`; with more ranks
than heads each holds one, replicated), and in each region a block is its heads back to
back. A :class:`HeadSlice` restricts a plan to some heads on both sides.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType
from typing import NamedTuple

from pdactors.errors import PlanError

__all__ = ["WHOLE_BLOCK", "HeadSlice", "rank_heads", "tp_expected", "tp_pulls", "tp_sources"]


class HeadSlice(NamedTuple):
    """``num_heads`` KV heads moved from P's local head ``src_first`` (of the ``src_heads``
    each P block holds) to D's local head ``dst_first`` (of ``dst_heads``)."""

    src_heads: int
    dst_heads: int
    src_first: int
    dst_first: int
    num_heads: int


#: The whole block: what a plan without a head slice moves.
WHOLE_BLOCK = HeadSlice(1, 1, 0, 0, 1)


def rank_heads(tp_rank: int, tp_size: int, total_heads: int) -> range:
    """The model's KV heads that TP rank ``tp_rank`` of ``tp_size`` holds (vLLM's split).

    ``tp_size <= total_heads``: an equal contiguous range each (``total_heads`` must divide
    evenly). More ranks than heads (GQA replication): one head each, ``tp_size /
    total_heads`` ranks in a row sharing it. Raises :class:`PlanError` for shapes vLLM refuses.
    """
    if total_heads < 1 or not 0 <= tp_rank < tp_size:
        raise PlanError(f"tp rank {tp_rank} of {tp_size} with {total_heads} KV heads")
    if tp_size <= total_heads:
        if total_heads % tp_size:
            raise PlanError(f"{total_heads} KV heads do not split over tp_size {tp_size}")
        per = total_heads // tp_size
        return range(tp_rank * per, (tp_rank + 1) * per)
    if tp_size % total_heads:
        raise PlanError(f"tp_size {tp_size} is not a multiple of {total_heads} KV heads")
    head = tp_rank // (tp_size // total_heads)
    return range(head, head + 1)


def tp_sources(d_rank: int, d_tp: int, p_tp: int, total_heads: int) -> list[tuple[int, HeadSlice]]:
    """Which P ranks supply D rank ``d_rank``'s heads: ``(p_rank, slice)`` in head order, one
    per contiguous run of heads from one P rank, covering D's heads exactly once.

    Where several P ranks hold a head (P has more ranks than heads), D rank ``j`` takes it from
    the ``j``-th of them (modulo their number), so D's ranks spread over P's replicas.
    """
    mine = rank_heads(d_rank, d_tp, total_heads)
    rank_heads(0, p_tp, total_heads)  # P's shape must be one vLLM runs
    n = len(mine)
    if p_tp > total_heads:  # one head per P rank: each of D's heads from its own replica
        rep = p_tp // total_heads
        return [
            (h * rep + d_rank % rep, HeadSlice(1, n, 0, h - mine.start, 1)) for h in mine
        ]  # fmt: skip
    per = total_heads // p_tp  # P rank p holds heads [p * per, (p + 1) * per)
    out: list[tuple[int, HeadSlice]] = []
    for p in range(mine.start // per, (mine.stop - 1) // per + 1):
        lo, hi = max(mine.start, p * per), min(mine.stop, (p + 1) * per)
        out.append((p, HeadSlice(per, n, lo - p * per, lo - mine.start, hi - lo)))
    return out


def _pullers(head: int, d_tp: int, total_heads: int) -> range:
    """The D ranks that hold ``head`` (consecutive)."""
    if d_tp <= total_heads:
        j = head // (total_heads // d_tp)
        return range(j, j + 1)
    rep = d_tp // total_heads
    return range(head * rep, (head + 1) * rep)


def _is_source(p_rank: int, d_tp: int, p_tp: int, total_heads: int) -> bool:
    """Whether some D rank takes heads from P rank ``p_rank`` (else it is a replica no D rank
    reads: it hears from one D rank, with no slices, so that it frees its blocks)."""
    if p_tp <= total_heads:
        return True  # every head has one holder, and D's ranks read every head
    rep = p_tp // total_heads
    head, replica = divmod(p_rank, rep)
    readers = _pullers(head, d_tp, total_heads)
    return (replica - readers.start) % rep < len(readers)


@functools.lru_cache(maxsize=256)
def tp_pulls(
    d_rank: int, d_tp: int, p_tp: int, total_heads: int
) -> Mapping[int, tuple[HeadSlice, ...]]:
    """The P ranks that D rank ``d_rank`` of ``d_tp`` pulls a transfer from, with the head
    slices each one writes: the one place P's and D's tensor-parallel ranks are paired.

    Equal TP sizes: rank ``i`` ↔ rank ``i``, whole blocks (``total_heads`` is not needed, 0
    will do). Otherwise the sources of :func:`tp_sources`, plus every P rank that is no D
    rank's source (GQA replicas D does not read) with no slices: P rank ``i`` then hears from
    D rank ``i % d_tp``, so each P rank gets at least one pull per transfer and knows when it
    may free its blocks. Raises :class:`PlanError` for shapes vLLM refuses.
    """
    if not 0 <= d_rank < d_tp or p_tp < 1:
        raise PlanError(f"D tp rank {d_rank} of {d_tp} with P tp_size {p_tp}")
    if d_tp == p_tp:
        return MappingProxyType({d_rank: (WHOLE_BLOCK,)})  # cached: read-only
    if total_heads < 1:
        raise PlanError(
            f"heterogeneous TP (P tp_size {p_tp}, D tp_size {d_tp}) needs the model's KV head "
            "count on both sides (kv_heads; a model with recurrent state, which does not split "
            "by head, has none: its P and D need equal TP sizes)"
        )
    pulls: dict[int, list[HeadSlice]] = {}
    for p_rank, heads in tp_sources(d_rank, d_tp, p_tp, total_heads):
        pulls.setdefault(p_rank, []).append(heads)
    for p_rank in range(d_rank, p_tp, d_tp):
        if not _is_source(p_rank, d_tp, p_tp, total_heads):
            pulls[p_rank] = []
    return MappingProxyType({p: tuple(slices) for p, slices in sorted(pulls.items())})


def tp_expected(p_rank: int, d_tp: int, p_tp: int, total_heads: int) -> int:
    """How many D ranks pull each transfer from P rank ``p_rank`` (see :func:`tp_pulls`).
    Raises :class:`PlanError` for shapes vLLM refuses."""
    if not 0 <= p_rank < p_tp or d_tp < 1:
        raise PlanError(f"P tp rank {p_rank} of {p_tp} with D tp_size {d_tp}")
    if d_tp == p_tp:
        return 1
    tp_pulls(0, d_tp, p_tp, total_heads)  # the same checks of both shapes
    if not _is_source(p_rank, d_tp, p_tp, total_heads):
        return 1  # D rank p_rank % d_tp tells it, with an empty pull
    if p_tp > total_heads:  # D ranks reading this head, taking replica j % rep: this one's
        rep = p_tp // total_heads
        head, replica = divmod(p_rank, rep)
        readers = _pullers(head, d_tp, total_heads)
        return (readers.stop - 1 - replica) // rep - (readers.start - 1 - replica) // rep
    per = total_heads // p_tp
    if d_tp > total_heads:  # every D rank holding one of its heads
        return per * (d_tp // total_heads)
    per_d = total_heads // d_tp
    return ((p_rank + 1) * per - 1) // per_d - (p_rank * per) // per_d + 1
