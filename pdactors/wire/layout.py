"""KV memory as the wire describes it: regions (:class:`BlockLayout`), an engine rank's
:class:`Layout`, and block ids per KV-cache group (:data:`BlockIds`)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Annotated, TypeAlias

import msgspec
from msgspec import Meta

from pdactors.errors import BadBlockIds
from pdactors.wire.limits import (
    MAX_BLOCK_IDS,
    MAX_GROUPS,
    MAX_NAME,
    U64,
    BlockId,
    PerRegion,
)  # fmt: skip

__all__ = [
    "BlockIds", "BlockIdsLike", "BlockLayout", "Layout", "WireBlockIds", "block_groups",
    "layout_id", "region_groups",
]  # fmt: skip


class BlockLayout(msgspec.Struct, frozen=True, array_like=True):
    """One registered KV region: ``num_blocks`` blocks, block ``i`` at ``base + i*stride``.

    ``block_bytes`` bytes of each block are transferred (``block_bytes <= stride``). A vLLM
    engine has one region per layer (or two, for layouts that keep K and V apart).
    """

    base: U64
    num_blocks: U64
    block_bytes: U64
    stride: U64


class Layout(msgspec.Struct, frozen=True, array_like=True):
    """An engine rank's KV memory: its regions in a fixed order shared by P and D.

    ``names``: one per region (vLLM's layer name, with the part for K and V kept apart), or
    none. With names on both sides, P writes each of its regions into D's region of the same
    name: how a pipeline stage of P, which holds some layers, fills a D that holds them all.
    Without, regions pair by position.

    ``groups``: each region's KV-cache group (vLLM's hybrid KV cache: the layers of one kind
    of attention share block ids, e.g. the sliding-window layers and the full ones), or none:
    every region in group 0. A transfer names its blocks per group (:data:`BlockIds`).
    """

    regions: Annotated[tuple[BlockLayout, ...], PerRegion]
    names: Annotated[tuple[Annotated[str, Meta(max_length=MAX_NAME)], ...], PerRegion] = ()
    groups: Annotated[tuple[Annotated[int, Meta(ge=0, lt=MAX_GROUPS)], ...], PerRegion] = ()

    @property
    def bytes_per_block(self) -> int:
        """Bytes moved per block id, summed over all regions."""
        return sum(r.block_bytes for r in self.regions)


def region_groups(layout: Layout) -> tuple[int, ...]:
    """The KV-cache group of each of ``layout``'s regions (all 0 when it names none)."""
    return layout.groups or (0,) * len(layout.regions)


#: The blocks of one transfer: one tuple of block ids per KV-cache group, in the groups' order
#: (a model with one kind of attention has one group). A group left out, or empty, moves
#: nothing.
BlockIds: TypeAlias = tuple[tuple[int, ...], ...]
#: :data:`BlockIds` as the wire bounds it (the total is checked after decoding).
WireGroup = Annotated[tuple[BlockId, ...], Meta(max_length=MAX_BLOCK_IDS)]
WireBlockIds = Annotated[tuple[WireGroup, ...], Meta(max_length=MAX_GROUPS)]
#: What the actors' block-taking calls accept: a flat sequence of ids (one group), or one
#: sequence per group.
BlockIdsLike: TypeAlias = Sequence[int] | Sequence[Sequence[int]]


def block_groups(ids: BlockIdsLike) -> BlockIds:
    """``ids`` as :data:`BlockIds`: a flat sequence of ids is the one group's; a sequence of
    sequences is one per group. Raises :class:`~pdactors.errors.BadBlockIds` (a ``TypeError``)
    for anything else."""
    if not ids:
        return ()
    first = ids[0]
    if isinstance(first, int):
        if not all(isinstance(i, int) for i in ids):
            raise BadBlockIds("block ids mix integers and lists")
        return (tuple(ids),)  # type: ignore[arg-type]
    if isinstance(first, str | bytes) or not isinstance(first, Sequence):
        raise BadBlockIds(f"block ids must be integers or lists of them, not {type(first)!r}")
    return tuple(tuple(group) for group in ids)  # type: ignore[arg-type]


def layout_id(session: str, layout: Layout) -> str:
    """A short, stable id for ``layout`` at data-plane ``session`` (sent instead of the layout)."""
    digest = hashlib.blake2b(session.encode() + msgspec.msgpack.encode(layout), digest_size=12)
    return digest.hexdigest()
