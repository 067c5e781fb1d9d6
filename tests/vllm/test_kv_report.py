"""The KV layout a worker reports at registration (pdactors_vllm.kv_report): what vLLM gave
it per KV-cache group, which tests read instead of assuming a host's block sizes and dtypes."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

pytest.importorskip("vllm")

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from pdactors import BlockLayout, Layout, RankInfo
from pdactors_vllm.connector import kv_groups
from pdactors_vllm.kv_report import PREFIX, kv_layout_report, parse_kv_layout, show_with_vllm_logs


def hybrid_config() -> KVCacheConfig:
    """A sliding layer, a full-attention layer (bfloat16, 64-token blocks) and a state layer
    whose page vLLM padded to the attention page."""
    attention = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    sliding = SlidingWindowSpec(
        block_size=64, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, sliding_window=32
    )
    state = MambaSpec(
        block_size=64,
        shapes=((3, 16), (2, 8, 8)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=attention.page_size_bytes,
        mamba_cache_mode="none",
    )
    return KVCacheConfig(
        8,
        [],
        [
            KVCacheGroupSpec(["layers.0.attn"], sliding),
            KVCacheGroupSpec(["layers.1.attn"], attention),
            KVCacheGroupSpec(["layers.2.linear_attn"], state),
        ],
    )


def test_the_report_says_each_groups_kind_block_dtypes_and_moved_bytes() -> None:
    config = hybrid_config()
    block = 64 * 2 * 2 * 32 * 2  # tokens x (K, V) x heads x dims x bfloat16
    state = 3 * 16 * 2 + 2 * 8 * 8 * 4  # the conv state in bfloat16, the recurrent in float32
    regions = [BlockLayout(base=4096 * i, num_blocks=8, block_bytes=n, stride=n) for i, n in
               enumerate([block, block, state])]  # fmt: skip
    layout = Layout(tuple(regions), groups=(0, 1, 2))
    ranks = RankInfo(tp_rank=1, tp_size=2)
    report = kv_layout_report(
        "prefill-0", ranks, config, kv_groups(config), layout, prefix_caching=False
    )
    assert report["engine_id"] == "prefill-0" and report["tp_rank"] == 1
    assert report["prefix_caching"] is False
    sliding, full, pages = report["groups"]
    assert (sliding["kind"], sliding["window"], sliding["bytes_per_block"]) == (
        "sliding",
        32,
        block,
    )
    assert (full["kind"], full["block_size"], full["dtypes"]) == ("attention", 64, ["bfloat16"])
    assert full["page_bytes"] == block
    assert (pages["kind"], pages["dtypes"]) == ("state", ["bfloat16", "float32"])
    assert pages["bytes_per_block"] == state < pages["page_bytes"] == block  # padding stays
    assert all(g["transfer"] for g in report["groups"])
    text = f"noise\nINFO 12-02 [connector.py:1] {PREFIX}{json.dumps(report)}\nmore noise\n"
    assert parse_kv_layout(text) == [report]


@pytest.fixture
def loggers() -> Iterator[tuple[logging.Logger, logging.Logger]]:
    """The adapter's logger bare, and vLLM's with a handler as vLLM's servers configure it."""
    ours, theirs = logging.getLogger("pdactors.vllm"), logging.getLogger("vllm")
    saved = [(lg, list(lg.handlers), lg.level) for lg in (ours, theirs)]
    ours.handlers.clear()
    vllms = logging.StreamHandler(io.StringIO())
    vllms.setFormatter(logging.Formatter("VLLM %(levelname)s %(message)s"))
    theirs.handlers[:] = [vllms]
    try:
        yield ours, theirs
    finally:
        for lg, handlers, level in saved:
            lg.handlers[:] = handlers
            lg.setLevel(level)


def test_the_adapters_info_lines_go_where_vllms_do(
    loggers: tuple[logging.Logger, logging.Logger],
) -> None:
    """vLLM configures only its 'vllm' logger: the adapter takes its stream and format, once."""
    ours, theirs = loggers
    show_with_vllm_logs()
    show_with_vllm_logs()
    (handler,) = ours.handlers
    ours.info("%sx", PREFIX)
    stream = theirs.handlers[0].stream  # type: ignore[attr-defined]
    assert stream.getvalue() == f"VLLM INFO {PREFIX}x\n"
    assert handler.formatter is theirs.handlers[0].formatter
