"""vLLM's KV events as vLLM itself encodes and serves them (its ``KVEventBatch`` structs and
its ``ZmqEventPublisher``, in this process) read by the proxy's index and feed
(:mod:`pdactors.core.kv_events`, :mod:`pdactors.proxy._kv_events`); tests/test_kv_events.py
holds the rules on a stand-in wire. No server."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
import trio

pytest.importorskip("vllm")

from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

from pdactors import PrefillBackend
from pdactors.core.kv_events import EngineBlocks, decode_batch
from pdactors.proxy._kv_events import KvEventFeeds
from pdactors.proxy._state import Metrics
from pdactors.proxy_config import ProxyConfig
from tests.vllm.servers import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(60)]

BS = 16
IDS = list(range(1000, 1064))  # four blocks


def store(ids: list[int], parent: bytes | None, tag: str = "", **more: object) -> BlockStored:
    n = len(ids) // BS
    return BlockStored(
        block_hashes=[f"{tag}{ids[i * BS]}".encode() * 4 for i in range(n)],  # vLLM: sha256
        parent_block_hash=parent,
        token_ids=ids,
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        **more,  # type: ignore[arg-type]
    )


def batches() -> list[KVEventBatch]:
    first = store(IDS[:32], None, group_idx=0, kv_cache_spec_kind="full_attention")
    second = store(IDS[32:], first.block_hashes[-1], group_idx=0)
    salted = store(IDS[:16], None, "salted", extra_keys=[("salt",)], session_id="s")
    return [
        KVEventBatch(ts=1.0, events=[first, second]),
        KVEventBatch(
            ts=2.0,
            events=[salted, BlockRemoved(block_hashes=[second.block_hashes[1]], medium="GPU")],
        ),
        KVEventBatch(ts=3.0, events=[AllBlocksCleared()], data_parallel_rank=0),
    ]


def test_vllms_encoding_is_read_and_indexed() -> None:
    blocks = EngineBlocks()
    encode = msgspec.msgpack.Encoder()
    one, two, three = (decode_batch(encode.encode(b)) for b in batches())
    blocks.apply(one[0])
    assert one[1] == 0 and blocks.matched({}, IDS, 100) == 64
    blocks.apply(two[0])
    assert two[1] == 0 and blocks.matched({}, IDS, 100) == 48  # block 4 removed
    assert len(blocks) == 4  # three of the prompt, the salted one beside them
    blocks.apply(three[0])
    assert len(blocks) == 0


@pytest.fixture
def publisher() -> Iterator[tuple[ZmqEventPublisher, int]]:
    replay = free_port()
    pub = ZmqEventPublisher(
        0, endpoint=f"tcp://*:{free_port()}", replay_endpoint=f"tcp://*:{replay}"
    )
    try:
        yield pub, replay
    finally:
        pub.shutdown()


def test_vllms_replay_endpoint_fills_a_gap(publisher: tuple[ZmqEventPublisher, int]) -> None:
    pub, port = publisher
    for b in batches()[:2]:
        pub.publish(b)
    feeds = KvEventFeeds(
        ProxyConfig(engines=(PrefillBackend("http://e", "http://b"),)), None, [], Metrics()
    )  # type: ignore[arg-type]

    async def main() -> tuple[bool, bool, int]:
        blocks = EngineBlocks()
        address = f"tcp://127.0.0.1:{port}"
        with trio.fail_after(20):
            while not pub._buffer or len(pub._buffer) < 2:  # published by its thread
                await trio.sleep(0.05)
            whole = await feeds._replay("http://e", address, 0, 2, blocks)
            matched = blocks.matched({}, IDS, 100)
            gone = await feeds._replay("http://e", address, 5, 9, EngineBlocks())  # too old
        return whole, gone, matched

    whole, gone, matched = trio.run(main)
    assert whole and matched == 48
    assert not gone
