"""What a worker moves per KV-cache group, as vLLM configured the cache on this host.

vLLM derives block sizes, state dtypes and page sizes from the host's CPU or GPU (on x86 CPUs
with AVX-512 BF16 it stores gated delta-net state in float32 and raises the attention block to
fit it; with AMX its MLA kernel takes other block sizes), so the bytes a request moves are not
a constant of the model. Each worker says once, at registration, what vLLM gave it: one log
line (:data:`PREFIX` and a JSON object) that operators read and tests parse
(:func:`parse_kv_layout`) to derive what a request must move.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pdactors import Layout, RankInfo

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

    from pdactors_vllm.metadata import KVGroup

__all__ = ["PREFIX", "kv_layout_report", "parse_kv_layout", "show_with_vllm_logs"]

PREFIX = "PdActorsConnector KV layout: "
"""Starts the registration line; the rest of the line is :func:`kv_layout_report`'s JSON."""


def kv_layout_report(
    engine_id: str,
    ranks: RankInfo,
    kv_cache_config: KVCacheConfig,
    groups: Sequence[KVGroup],
    layout: Layout,
    *,
    prefix_caching: bool,
) -> dict[str, Any]:
    """This worker's KV cache per group: its kind (``attention``, ``sliding``, ``state``),
    vLLM's ``block_size`` in tokens and ``page_bytes`` (padded, as vLLM allocates it), the
    ``dtypes`` of its spec, whether the connector moves it (``transfer``) and the
    ``bytes_per_block`` it moves (this worker's regions of the group, without padding)."""
    per_group = [0] * len(kv_cache_config.kv_cache_groups)
    region_groups = layout.groups or (0,) * len(layout.regions)
    for region, g in zip(layout.regions, region_groups, strict=True):
        per_group[g] += region.block_bytes
    described = []
    pairs = zip(kv_cache_config.kv_cache_groups, groups, strict=True)
    for g, (vllm_group, ours) in enumerate(pairs):
        spec = vllm_group.kv_cache_spec
        kind = "state" if ours.state else "sliding" if ours.window else "attention"
        dtypes = getattr(spec, "dtypes", None) or (getattr(spec, "dtype", None),)
        described.append(
            {
                "group": g,
                "kind": kind,
                "layers": len(vllm_group.layer_names),
                "block_size": ours.block_size,
                "window": ours.window,
                "transfer": ours.transfer,
                "bytes_per_block": per_group[g],
                "page_bytes": int(spec.page_size_bytes),
                "dtypes": [str(d).removeprefix("torch.") for d in dtypes if d is not None],
            }
        )
    return {
        "engine_id": engine_id,
        "tp_rank": ranks.tp_rank,
        "tp_size": ranks.tp_size,
        "pp_rank": ranks.pp_rank,
        "prefix_caching": prefix_caching,
        "groups": described,
    }


def parse_kv_layout(text: str) -> list[dict[str, Any]]:
    """Every report in ``text`` (a server's log), in order."""
    reports = []
    for line in text.splitlines():
        _, found, rest = line.partition(PREFIX)
        if found:
            reports.append(json.loads(rest))
    return reports


def show_with_vllm_logs() -> None:
    """Send the adapter's INFO lines where vLLM sends its own (vLLM configures only its
    ``vllm`` logger, so ours would otherwise show warnings only). Idempotent; does nothing
    where the adapter's logger already has handlers or vLLM's has none."""
    ours = logging.getLogger("pdactors.vllm")
    if ours.handlers:
        return
    theirs = logging.getLogger("vllm").handlers
    if not theirs:
        return
    handler = logging.StreamHandler(getattr(theirs[0], "stream", sys.stdout))
    handler.setFormatter(theirs[0].formatter)
    ours.addHandler(handler)
    ours.setLevel(logging.INFO)
