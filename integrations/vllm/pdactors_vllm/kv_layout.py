"""vLLM's per-layer KV tensors as the :class:`~pdactors.Layout` the actors move, the memory the
data plane registers, and which regions hold each layer (for layer-wise streaming)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from pdactors import BlockLayout, Layout
from pdactors.errors import PdError

__all__ = ["KVRegistration", "layout_from_kv_caches"]


class KVRegistration(NamedTuple):
    """What :func:`layout_from_kv_caches` finds in vLLM's KV tensors."""

    layout: Layout
    memory: list[tuple[int, int]]  # (address, bytes) to register with the data plane
    layer_regions: dict[str, tuple[int, ...]]  # vLLM layer name -> its regions in the layout


def layout_from_kv_caches(
    kv_caches: dict[str, torch.Tensor],
    num_blocks: int,
    group_of: Mapping[str, int] | None = None,
) -> KVRegistration:
    """vLLM's per-layer KV tensors → our :class:`Layout`, the memory to register, and which
    regions hold each layer (for layer-wise streaming).

    ``group_of``: each layer's KV-cache group (vLLM's ``kv_cache_groups``; none: one group).
    Every layer must have one; its regions move that group's blocks.

    A tensor whose first dimension is the block count is one region (vLLM CPU:
    ``[blocks, kv_heads, block_size, 2*head]``); one whose second dimension is, with K and V
    first (``[2, blocks, ...]``), is two. Regions are ordered by layer name and carry it, so a
    P pipeline stage (some layers) writes each into D's region of the same name.
    Memory is registered by underlying storage, so views of one allocation count once.
    Raises :class:`PdError` for a tensor without a block dimension, a layer in no group, or
    a block that is not contiguous.
    """
    regions: list[BlockLayout] = []
    names: list[str] = []
    storages: dict[int, int] = {}
    layer_regions: dict[str, tuple[int, ...]] = {}
    groups: list[int] = []
    for name in sorted(kv_caches):
        cache = kv_caches[name]
        storage = cache.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        if cache.shape[0] == num_blocks:
            parts = [cache]
        elif cache.ndim > 1 and cache.shape[1] == num_blocks:
            parts = list(cache.unbind(0))
        else:
            raise PdError(f"KV cache {name} of shape {tuple(cache.shape)} has no block dimension")
        if group_of is not None and name not in group_of:
            raise PdError(f"KV cache {name} is in no KV-cache group vLLM named")
        layer_regions[name] = tuple(range(len(regions), len(regions) + len(parts)))
        groups += [group_of[name] if group_of is not None else 0] * len(parts)
        names += [name] if len(parts) == 1 else [f"{name}[{k}]" for k in range(len(parts))]
        for part in parts:
            if not part[0].is_contiguous():
                raise PdError(f"KV cache {name}: a block is not contiguous in memory")
            regions.append(
                BlockLayout(
                    base=part.data_ptr(),
                    num_blocks=num_blocks,
                    block_bytes=part[0].nbytes,
                    stride=part.stride(0) * part.element_size(),
                )
            )
    layout = Layout(tuple(regions), tuple(names), tuple(groups) if any(groups) else ())
    return KVRegistration(layout, sorted(storages.items()), layer_regions)
