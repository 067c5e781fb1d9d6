"""Exact prefix routing from vLLM's KV events: the index as plain functions
(:mod:`pdactors.core.kv_events`), then the proxy following stand-in engines that publish on
vLLM's wire (an XPUB for the events, a ROUTER for replays, ``/kv_event_sources`` and
``/tokenize`` on each engine: tests/test_proxy.py's stand-ins). The wire against vLLM's own
classes and a real engine: tests/vllm/test_kv_events_vllm.py."""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
import trio
import zmq
from quart import Response, request
from quart_trio import QuartTrio

from pdactors.core.kv_events import BadBatch, EngineBlocks, chain_keys, decode_batch
from pdactors.transport.zmq import open_router
from tests.test_prefix_routing import ON_P, routed
from tests.test_proxy import TIMEOUT, FakeEngine, Setup, eventually_health, open_setup

BS = 4  #: tokens per block of the stand-ins' caches


def tokens(text: str) -> list[int]:
    """The stand-ins' tokenizer: a character is a token."""
    return [ord(c) for c in text]


def h(*ids: int) -> bytes:
    """A block's hash as vLLM sends it (bytes): any value unique per block will do."""
    return repr(ids).encode()


def stored(ids: list[int], parent: Any = None, **more: Any) -> dict[str, Any]:
    """vLLM's ``BlockStored`` for the whole blocks of ``ids`` after ``parent``, as msgpack
    maps it (a tag ``type``, every field without a default)."""
    n = len(ids) // BS
    return {
        "type": "BlockStored",
        "block_hashes": [h(*ids[: (i + 1) * BS]) for i in range(n)],
        "parent_block_hash": parent,
        "token_ids": ids[: n * BS],
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        **more,
    }


def removed(*hashes: bytes) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU"}


def batch(*events: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode([1.0, list(events), None])


def index(*events: dict[str, Any]) -> EngineBlocks:
    blocks = EngineBlocks()
    blocks.apply(decode_batch(batch(*events))[0])
    return blocks


def match(blocks: EngineBlocks, ids: list[int]) -> int:
    return blocks.matched({}, ids, 1024)


IDS = list(range(100, 120))  # five blocks


# --------------------------------------------------------------------------- the index


def test_stored_blocks_match_a_prompts_leading_whole_blocks() -> None:
    blocks = index(stored(IDS[:12]), stored(IDS[12:], parent=h(*IDS[:12])))
    assert len(blocks) == 5 and blocks.block_size == BS
    assert match(blocks, IDS) == 20
    assert match(blocks, [*IDS[:10], 0, *IDS[11:]]) == 8  # differs in block 3
    assert match(blocks, IDS[:7]) == 4  # a partial last block is not matched
    assert match(blocks, [0, *IDS]) == 0


def test_a_removed_block_ends_the_match_there_and_a_clear_empties_it() -> None:
    blocks = index(stored(IDS))
    blocks.apply(decode_batch(batch(removed(h(*IDS[:12]))))[0])
    assert len(blocks) == 4 and match(blocks, IDS) == 8
    blocks.apply(decode_batch(batch({"type": "AllBlocksCleared"}))[0])
    assert len(blocks) == 0 and match(blocks, IDS) == 0


def test_a_block_whose_parent_was_never_seen_is_skipped() -> None:
    blocks = index(stored(IDS[8:], parent=h(*IDS[:8])))
    assert len(blocks) == 0 and blocks.unchained == 3


def test_blocks_with_extra_keys_or_a_lora_never_match_plain_tokens() -> None:
    odd = {"b": [1, {"x": None}], 2: "two", "2": [3]}  # keys whose values do not compare
    index(stored(IDS, extra_keys=[odd, None, [b"mm", 4], None, {"c": 1.5}]))
    salted = stored(IDS, extra_keys=[["salt"]] * 5)
    lora = stored(IDS, lora_name="adapter", lora_id=1)
    for event in (salted, lora):
        blocks = index(event)
        assert len(blocks) == 5 and match(blocks, IDS) == 0


def test_only_groups_of_full_attention_count_and_the_least_of_them() -> None:
    full = stored(IDS, group_idx=0, kv_cache_spec_kind="full_attention")
    window = {**stored(IDS[:8], group_idx=1), "kv_cache_spec_kind": "sliding_window"}
    assert match(index(full, window), IDS) == 20  # the window's group does not count
    assert match(index(window), IDS) == 0
    other_full = stored(IDS[:8], group_idx=2, kv_cache_spec_kind="mla_attention")
    assert match(index(full, other_full), IDS) == 8


def test_a_block_stored_twice_is_held_until_both_are_removed() -> None:
    again = {**stored(IDS[:4]), "block_hashes": [b"other"]}  # equal tokens, another hash
    blocks = index(stored(IDS[:4]), again, removed(h(*IDS[:4])))
    assert match(blocks, IDS) == 4
    blocks.apply(decode_batch(batch(removed(b"other")))[0])
    assert match(blocks, IDS) == 0


def test_unknown_events_and_fields_are_skipped_and_a_non_batch_refused() -> None:
    newer = {**stored(IDS), "future_field": [1, 2]}
    events, skipped = decode_batch(batch(newer, {"type": "BlockMoved", "to": "CPU"}, {"x": 1}))
    assert skipped == 2 and len(events) == 1
    assert decode_batch(msgspec.msgpack.encode([1.0, [], 0, "more"]))[1] == 0  # longer batch
    for bad in (b"\xc1", msgspec.msgpack.encode({"ts": 1}), b""):
        with pytest.raises(BadBatch):
            decode_batch(bad)


def test_an_event_whose_tokens_do_not_fill_its_blocks_is_skipped() -> None:
    assert len(index({**stored(IDS), "token_ids": IDS[:19]})) == 0
    assert len(index({**stored(IDS), "block_size": 0})) == 0


def test_chain_keys_are_bounded_and_the_prompt_keys_are_shared_across_engines() -> None:
    assert len(chain_keys(IDS, BS, 2)) == 2
    one, two = index(stored(IDS)), index(stored(IDS[:8]))
    keys_of: dict[int, list[int]] = {}
    assert one.matched(keys_of, IDS, 1024) == 20 and two.matched(keys_of, IDS, 1024) == 8
    assert list(keys_of) == [BS]


# --------------------------------------------------------------------------- the proxy


@dataclass
class Publisher:
    """vLLM's ``ZmqEventPublisher`` wire for one stand-in engine, driven by the test:
    ``(topic, seq, payload)`` on an XPUB (which tells when the proxy subscribed) and a
    ROUTER answering replays from its buffer, then seq -1."""

    replay: bool = True
    pub: zmq.Socket[bytes] | None = None
    endpoint: str = ""
    replay_endpoint: str | None = None
    buffer: list[tuple[int, bytes]] = field(default_factory=list)
    seqs: Any = field(default_factory=itertools.count)
    replays: list[int] = field(default_factory=list)  # the start of each replay asked

    def publish(self, *events: dict[str, Any], live: bool = True) -> None:
        """One batch; ``live`` False: only in the replay buffer (a message the proxy lost)."""
        seq, payload = next(self.seqs), batch(*events)
        self.buffer.append((seq, payload))
        if live:
            assert self.pub is not None
            self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    def restart(self) -> None:
        """The engine's publisher began again: its counter and buffer from 0."""
        self.seqs, self.buffer = itertools.count(), []

    async def subscribed(self) -> None:
        """Until the proxy's SUB has subscribed (XPUB's subscription message)."""
        assert self.pub is not None
        with trio.fail_after(5):
            while True:
                try:
                    if self.pub.recv(zmq.NOBLOCK)[:1] == b"\x01":
                        return
                except zmq.Again:
                    await trio.sleep(0.01)

    def sources(self) -> dict[str, Any]:
        return {
            "0": {
                "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.endpoint,
                "replay_endpoint": self.replay_endpoint, "buffer_steps": 10000, "topic": "",
            }
        }  # fmt: skip

    async def serve(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.pub = zmq.Context.instance().socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://*:{port}"  # a wildcard bind, as vLLM's default says
        try:
            if not self.replay:
                task_status.started()
                await trio.sleep_forever()
            async with open_router("127.0.0.1") as router:
                self.replay_endpoint = router.address
                task_status.started()
                while True:
                    identity, frames = await router.receive()
                    start = int.from_bytes(frames[-1], "big")
                    self.replays.append(start)
                    for seq, payload in self.buffer:
                        if seq >= start:
                            await router.send(identity, [b"", b"", seq.to_bytes(8, "big"), payload])
                    await router.send(
                        identity, [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
                    )
        finally:
            self.pub.close(linger=0)


@dataclass
class EventRoutes:
    """``/kv_event_sources`` and ``/tokenize`` on each stand-in (``open_setup(routes=...)``)."""

    publishers: dict[str, Publisher]
    tokenize_status: int = 200
    tokens: list[Any] | None = None  # its answer's tokens (None: the prompt's)
    tokenized: list[dict[str, Any]] = field(default_factory=list)

    def __call__(self, app: QuartTrio, engine: FakeEngine) -> None:
        @app.get("/kv_event_sources")
        async def sources() -> Response:
            pub = self.publishers.get(engine.name)
            return Response(msgspec.json.encode(pub.sources() if pub else {}))

        @app.post("/tokenize")
        async def tokenize() -> Response:
            body = await request.get_json()
            self.tokenized.append(body)
            ids = tokens(body["prompt"]) if self.tokens is None else self.tokens
            answer = {"tokens": ids, "count": 0, "max_model_len": 4096}
            return Response(msgspec.json.encode(answer), status=self.tokenize_status)


@asynccontextmanager
async def open_events(
    names: tuple[str, ...] = ("p0", "p1"),
    replay: bool = True,
    replay_endpoint: str | None = None,
    **config: Any,
) -> AsyncIterator[tuple[Setup, dict[str, Publisher], EventRoutes]]:
    """Two P and one D behind a prefix_aware proxy pinned to disaggregate (P's routing is the
    point); the engines ``names`` publish KV events, followed once the proxy subscribed
    (without ``replay``: no replay endpoint, or the ``replay_endpoint`` they name)."""
    publishers = {name: Publisher(replay=replay, replay_endpoint=replay_endpoint) for name in names}
    routes = EventRoutes(publishers)
    async with trio.open_nursery() as nursery:
        for pub in publishers.values():
            await nursery.start(pub.serve)
        options = {"routing": "prefix_aware", **ON_P, **config}
        async with open_setup(2, 1, routes=routes, **options) as s:
            for pub in publishers.values() if config.get("kv_events", True) else ():
                await pub.subscribed()
            yield s, publishers, routes
        nursery.cancel_scope.cancel()


def prompt(n: int) -> str:
    return "".join(chr(0x4E00 + n * 64 + i) for i in range(40))  # 40 tokens, 10 blocks


def where(s: Setup, text: str) -> list[str]:
    return [p.name for p in s.p for body in p.received if body["prompt"] == text]


async def held(s: Setup, engine: FakeEngine, blocks: int) -> None:
    """Until the proxy's index of ``engine`` holds ``blocks`` blocks."""
    await eventually_health(s, lambda r: r.get("kv_event_blocks", {}).get(engine.url) == blocks)


async def ask(s: Setup, text: str) -> None:
    body = {"model": "tiny", "prompt": text, "max_tokens": 5, "temperature": 0}
    resp = await s.client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text


async def test_a_prompt_goes_to_the_engine_whose_events_say_it_holds_it() -> None:
    """p1 computed the prompt elsewhere (the proxy never sent it there): only its events can
    tell; round robin and the remembered prefixes would pick p0 first."""
    with trio.fail_after(TIMEOUT):
        async with open_events() as (s, pubs, routes):
            pubs["p1"].publish(stored(tokens(prompt(0))))
            await held(s, s.p[1], 10)
            await ask(s, prompt(0))
            assert where(s, prompt(0)) == ["p1"]
            assert await routed(s, "prefill", "exact") == 1
            assert routes.tokenized[-1]["prompt"] == prompt(0)
            # Evicted from p1 (its first block: nothing after it is reachable), held by p0.
            pubs["p1"].publish(removed(h(*tokens(prompt(0))[:4])))
            pubs["p0"].publish(stored(tokens(prompt(0))[:8]))
            await held(s, s.p[1], 9)
            await held(s, s.p[0], 2)
            await ask(s, prompt(0))  # the proxy remembers sending it to p1: the events win
            assert where(s, prompt(0)) == ["p0", "p1"]  # once each
            assert await routed(s, "prefill", "exact") == 2


async def test_a_token_id_prompt_is_matched_without_asking_an_engine() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_events() as (s, pubs, routes):
            ids = tokens(prompt(1))
            pubs["p1"].publish(stored(ids))
            await held(s, s.p[1], 10)
            body = {"model": "tiny", "prompt": ids, "max_tokens": 5, "temperature": 0}
            assert (await s.client.post("/v1/completions", json=body)).status_code == 200
            assert [p.name for p in s.p if p.received] == ["p1"]
            assert routes.tokenized == []


async def test_events_published_before_the_proxy_subscribed_are_replayed() -> None:
    """vLLM's PUB drops what no subscriber took: the first message the proxy sees (seq 3)
    makes it ask the replay endpoint for 0..2."""
    with trio.fail_after(TIMEOUT):
        async with open_events() as (s, pubs, _):
            ids = tokens(prompt(2))
            pubs["p0"].publish(stored(ids[:8]), live=False)
            pubs["p0"].publish(stored(ids[8:16], parent=h(*ids[:8])), live=False)
            pubs["p0"].publish(removed(h(*ids[:8])), live=False)  # block 2 gone
            pubs["p0"].publish(stored(tokens(prompt(3))))
            await held(s, s.p[0], 3 + 10)
            assert pubs["p0"].replays == [0]
            metrics = await s.metrics()
            assert metrics[("pdactors_proxy_kv_event_gaps_total",
                            (("backend", s.p[0].url), ("outcome", "replayed")))] == 1  # fmt: skip


async def test_a_gap_without_a_replay_clears_the_index_and_it_refills() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_events(replay=False) as (s, pubs, _):
            pub = pubs["p0"]
            pub.publish(stored(tokens(prompt(4))))
            await held(s, s.p[0], 10)
            pub.publish(removed(h(*tokens(prompt(4))[:4])), live=False)  # lost
            pub.publish(stored(tokens(prompt(5))[:8]))
            await held(s, s.p[0], 2)  # prompt 4's blocks are gone with the gap
            metrics = await s.metrics()
            assert metrics[("pdactors_proxy_kv_event_gaps_total",
                            (("backend", s.p[0].url), ("outcome", "cleared")))] == 1  # fmt: skip


async def test_a_replay_endpoint_that_cannot_be_reached_clears_and_the_feed_goes_on() -> None:
    """A malformed replay address (ZMQ refuses to connect to it): the gap is a lost one — the
    index cleared — and the feed goes on with the next batches."""
    with trio.fail_after(TIMEOUT):
        async with open_events(replay=False, replay_endpoint="tcp://no such host:1") as (
            s, pubs, _,
        ):  # fmt: skip
            pub = pubs["p0"]
            pub.publish(stored(tokens(prompt(4))))
            await held(s, s.p[0], 10)
            pub.publish(removed(h(*tokens(prompt(4))[:4])), live=False)  # lost
            pub.publish(stored(tokens(prompt(5))[:8]))
            await held(s, s.p[0], 2)
            pub.publish(stored(tokens(prompt(6))))
            await held(s, s.p[0], 12)  # still followed
            metrics = await s.metrics()
            assert metrics[("pdactors_proxy_kv_event_gaps_total",
                            (("backend", s.p[0].url), ("outcome", "cleared")))] == 1  # fmt: skip


async def test_a_gap_the_buffer_no_longer_holds_clears_the_index() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_events() as (s, pubs, _):
            pub = pubs["p0"]
            pub.publish(stored(tokens(prompt(4))))
            await held(s, s.p[0], 10)
            pub.publish(removed(h(*tokens(prompt(4))[:4])), live=False)
            pub.buffer.clear()  # beyond buffer_steps
            pub.publish(stored(tokens(prompt(5))[:8]))
            await held(s, s.p[0], 2)
            assert pub.replays == [1]


async def test_an_engine_whose_sequence_starts_again_is_cleared() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_events() as (s, pubs, _):
            pub = pubs["p0"]
            pub.publish(stored(tokens(prompt(6))))
            pub.publish(stored(tokens(prompt(7))))
            await held(s, s.p[0], 20)
            pub.restart()  # seq 0 again: a new engine, an empty cache
            pub.publish(stored(tokens(prompt(8))[:4]))
            await held(s, s.p[0], 1)


async def test_a_failed_tokenize_routes_on_remembered_prefixes_and_serves() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_events() as (s, pubs, routes):
            pubs["p1"].publish(stored(tokens(prompt(9))))
            await held(s, s.p[1], 10)
            routes.tokenize_status = 500
            await ask(s, prompt(9))  # no tokens: p1's events cannot be matched
            assert where(s, prompt(9)) == ["p0"]
            routes.tokenize_status, routes.tokens = 200, ["x", {"y": 1}] * 8  # not token ids
            await ask(s, prompt(9))
            assert await routed(s, "prefill", "exact") == 0


async def test_a_payload_that_is_not_a_batch_is_logged_once_and_the_feed_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with trio.fail_after(TIMEOUT), caplog.at_level(logging.WARNING, "pdactors.proxy"):
        async with open_events() as (s, pubs, _):
            pub = pubs["p0"]
            assert pub.pub is not None
            for seq in (0, 1):
                pub.buffer.append((seq, b"\xc1"))
                pub.pub.send_multipart([b"", seq.to_bytes(8, "big"), b"\xc1"])
            pub.seqs = itertools.count(2)
            pub.publish(stored(tokens(prompt(10))))
            await held(s, s.p[0], 10)
            bad = [r for r in caplog.records if "not a KV event batch" in r.getMessage()]
            assert len(bad) == 1


async def test_engines_that_publish_nothing_and_kv_events_off_use_remembered_prefixes() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_events(names=()) as (s, _, routes):
            await ask(s, prompt(11))
            await ask(s, prompt(11))
            assert routes.tokenized == [] and "kv_event_blocks" in (await s.health())[1]
            assert await routed(s, "prefill", "prefix") == 1
        async with open_events(kv_events=False) as (s, pubs, routes):
            pubs["p1"].publish(stored(tokens(prompt(12))))
            await ask(s, prompt(12))
            assert where(s, prompt(12)) == ["p0"] and routes.tokenized == []
            assert "kv_event_blocks" not in (await s.health())[1]


async def test_a_match_remembered_beside_an_exact_one_is_labelled_prefix() -> None:
    """p1 publishes events (matched exactly: none of this prompt), p0 none (matched by what it
    was sent): the second ask goes to p0 for its remembered prefix, and is counted so."""
    with trio.fail_after(TIMEOUT):
        async with open_events(names=("p1",)) as (s, _, _):
            await ask(s, prompt(13))
            await ask(s, prompt(13))
            assert where(s, prompt(13)) == ["p0", "p0"]
            assert await routed(s, "prefill", "prefix") == 1
            assert await routed(s, "prefill", "exact") == 0


def test_publishers_are_reached_at_the_engines_host() -> None:
    from pdactors.proxy._kv_events import _publishers

    answer = {
        "1": {"publisher": "zmq", "endpoint": "tcp://10.0.0.5:6001", "replay_endpoint": None},
        "0": {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"},
        "2": {"publisher": "null", "endpoint": "tcp://*:1"},
        "3": "junk",
    }
    assert _publishers(answer, "d.example") == [
        ("tcp://d.example:5557", "tcp://d.example:5558"),
        ("tcp://10.0.0.5:6001", None),
    ]
    assert _publishers([], "h") == [] and _publishers(None, "h") == []
