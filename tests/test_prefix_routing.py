"""Prefix-aware routing (``routing="prefix_aware"``): the keys, the index and the rule as plain
functions (:mod:`pdactors.core.prefixes`), then the proxy routing conversations among stand-in
engines (tests/test_proxy.py's)."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import trio

from pdactors import PrefillBackend, ProxyConfig
from pdactors.core.prefixes import (
    BLOCK_CHARS,
    BLOCK_IDS,
    MAX_BLOCKS,
    Candidate,
    PrefixIndex,
    choose,
    prefix_keys,
)
from tests.test_proxy import TIMEOUT, Setup, eventually, eventually_health, open_setup


def turn(conversation: str, n: int) -> str:
    """Turn ``n`` of a conversation: every turn's prompt starts with the one before it."""
    return "".join(f"[{conversation} turn {i}] " + "lorem ipsum " * 20 for i in range(n + 1))


def completion(prompt: str | list[int]) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0}


# --------------------------------------------------------------------------- keys


def test_a_turn_that_extends_the_last_shares_its_leading_keys() -> None:
    first = prefix_keys(completion(turn("a", 0)), chat=False)
    second = prefix_keys(completion(turn("a", 1)), chat=False)
    other = prefix_keys(completion(turn("b", 1)), chat=False)
    whole = len(turn("a", 0)) // BLOCK_CHARS  # the first turn's full blocks
    assert second[:whole] == first[:whole] and len(second) > len(first)
    assert other[0] != first[0]


def test_token_ids_are_keyed_in_blocks_of_ids() -> None:
    ids = list(range(100))
    keys = prefix_keys(completion(ids), chat=False)
    assert len(keys) == -(-100 // BLOCK_IDS)
    assert prefix_keys(completion([ids]), chat=False) == keys  # a list of one prompt
    assert prefix_keys(completion([*ids[:32], 7]), chat=False)[:2] == keys[:2]


def test_a_list_of_one_text_prompt_is_that_prompt_and_a_batch_is_not_keyed() -> None:
    text = turn("a", 1)
    assert prefix_keys(completion([text]), chat=False) == prefix_keys(completion(text), False)
    assert prefix_keys(completion([text, text]), chat=False) == []


def test_a_chat_is_keyed_on_its_messages_in_order() -> None:
    system = {"role": "system", "content": "be brief " * 20}
    turn1 = [system, {"role": "user", "content": "hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "?"}]
    k1 = prefix_keys({"messages": turn1}, chat=True)
    k2 = prefix_keys({"messages": turn2}, chat=True)
    assert k2[: len(k1) - 1] == k1[:-1]
    parts = [{"type": "text", "text": "be brief " * 20}]
    as_parts = prefix_keys({"messages": [{"role": "system", "content": parts}]}, chat=True)
    assert as_parts[:2] == k1[:2]
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    with_image = [{"role": "system", "content": [image, "stray", *parts]}]
    assert prefix_keys({"messages": with_image}, chat=True) == as_parts  # text parts only
    other_role = prefix_keys({"messages": [{**system, "role": "user"}]}, chat=True)
    assert other_role[0] != k1[0]


def test_a_huge_prompt_costs_bounded_keys() -> None:
    assert len(prefix_keys(completion("x" * (BLOCK_CHARS * MAX_BLOCKS * 2)), False)) == MAX_BLOCKS
    assert len(prefix_keys(completion(list(range(BLOCK_IDS * MAX_BLOCKS + 50))), False)) == (
        MAX_BLOCKS
    )
    assert prefix_keys(completion(""), chat=False) == []


# --------------------------------------------------------------------------- the index


def test_a_match_counts_the_leading_blocks_an_engine_was_sent() -> None:
    index = PrefixIndex(max_blocks=100, max_age=60)
    index.sent("p0", [1, 2, 3], now=0)
    assert index.matched("p0", [1, 2, 3, 4], now=1) == 3
    assert index.matched("p0", [1, 9, 3], now=1) == 1  # a chain: a miss ends the match
    assert index.matched("p1", [1, 2, 3], now=1) == 0


def test_the_index_holds_at_most_max_blocks_and_drops_tails_first() -> None:
    index = PrefixIndex(max_blocks=10, max_age=60)
    for conversation in range(50):
        index.sent(f"p{conversation % 2}", [conversation * 100 + b for b in range(4)], now=0)
        assert len(index) <= 10
    index.sent("p0", [1, 2, 3, 4, 5, 6, 7, 8], now=1)
    index.sent("p0", [50, 51, 52, 53], now=1)  # pushes out two blocks: [1..8]'s last two
    assert len(index) == 10
    assert index.matched("p0", [1, 2, 3, 4, 5, 6, 7, 8], now=1) == 6


def test_a_prompt_sent_again_is_the_last_to_be_dropped() -> None:
    index = PrefixIndex(max_blocks=4, max_age=60)
    index.sent("p0", [1, 2], now=0)
    index.sent("p0", [3, 4], now=0)
    index.sent("p0", [1, 2], now=1)  # sent again: now the most recent
    index.sent("p0", [5], now=2)  # pushes out the least recently sent: 4
    assert index.matched("p0", [1, 2], now=2) == 2
    assert index.matched("p0", [3, 4], now=2) == 1


def test_the_index_refuses_an_empty_bound_and_keeps_what_is_exactly_max_age_old() -> None:
    for bad in ((0, 10.0), (1, 0.0)):
        with pytest.raises(ValueError):
            PrefixIndex(*bad)
    index = PrefixIndex(max_blocks=3, max_age=10)
    index.sent("p0", [1, 2], now=0)
    index.sent("p0", [3], now=10)  # trims what is older than 10 s: [1, 2] is not
    assert index.matched("p0", [1, 2], now=10) == 2
    assert len(PrefixIndex(max_blocks=1, max_age=0.5)) == 0


def test_old_entries_are_forgotten_and_a_restarted_engine_has_none() -> None:
    index = PrefixIndex(max_blocks=100, max_age=10)
    index.sent("p0", [1, 2], now=0)
    index.sent("p1", [1, 2], now=0)
    assert index.matched("p0", [1, 2], now=10) == 2
    assert index.matched("p0", [1, 2], now=10.5) == 0  # too old to count
    index.sent("p1", [1, 2], now=5)
    assert index.forget("p1") == 2
    assert index.matched("p1", [1, 2], now=6) == 0 and index.matched("p0", [1, 2], now=6) == 2
    index.sent("p0", [3], now=20)  # and old entries leave memory as new ones come
    assert len(index) == 1


# --------------------------------------------------------------------------- the rule


def test_the_longest_match_wins_unless_it_is_overloaded() -> None:
    c = Candidate
    assert choose([c(0, 0, 0), c(1, 3, 5)], imbalance=4) == (1, "prefix")
    assert choose([c(0, 0, 0), c(1, 5, 5)], imbalance=4) == (0, "spill")
    assert choose([c(0, 2, 0), c(1, 1, 0)], imbalance=4) == (1, "no_match")
    assert choose([c(1, 0, 0), c(0, 0, 0)], imbalance=4) == (1, "no_match")  # ties: the first
    assert choose([c(1, 0, 3), c(0, 0, 3)], imbalance=4) == (1, "prefix")
    assert choose([c(0, 1, 3), c(1, 0, 3)], imbalance=4) == (1, "prefix")  # the less loaded
    assert choose([c(0, 6, 9), c(1, 0, 2), c(2, 0, 0)], imbalance=4) == (1, "spill")
    assert choose([c(0, 3, 0), c(1, 7, 5)], imbalance=4) == (1, "prefix")  # 4 more: not over


# --------------------------------------------------------------------------- the proxy


#: P's routing is the point: P computes every prompt (the shipped ``auto`` placement would
#: serve these short prompts on D alone).
ON_P: dict[str, Any] = {"placement": "disaggregate"}


def where(s: Setup, prompt: str) -> list[str]:
    """The P engines that were asked to compute ``prompt``."""
    return [p.name for p in s.p for body in p.received if body["prompt"] == prompt]


async def ask(s: Setup, prompt: str) -> None:
    resp = await s.client.post("/v1/completions", json=completion(prompt))
    assert resp.status_code == 200, resp.text


async def routed(s: Setup, role: str, why: str) -> float:
    return (await s.metrics()).get(
        ("pdactors_proxy_routed_total", (("role", role), ("why", why))), 0.0
    )


async def test_a_conversation_stays_on_one_p_and_conversations_spread() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_setup(2, 1, routing="prefix_aware", **ON_P) as s:
            for n in range(3):  # round robin would send turn 1 to the other P
                await ask(s, turn("a", n))
            for n in range(3):
                await ask(s, turn("b", n))
            await ask(s, turn("a", 3))
            a = [where(s, turn("a", n)) for n in range(4)]
            b = [where(s, turn("b", n)) for n in range(3)]
            assert a == [["p0"]] * 4 and b == [["p1"]] * 3
            assert await routed(s, "prefill", "prefix") == 5
            assert await routed(s, "prefill", "no_match") == 2


async def test_a_hot_prefix_spills_to_another_p_when_its_own_is_loaded() -> None:
    with trio.fail_after(TIMEOUT):
        async with (
            open_setup(2, 1, routing="prefix_aware", prefix_imbalance=1, **ON_P) as s,
            trio.open_nursery() as n,
        ):
            await ask(s, turn("hot", 0))
            s.p[0].hold = trio.Event()  # p0's requests stay in flight
            for i in (1, 2):
                n.start_soon(ask, s, turn("hot", i))
                await eventually(partial(lambda i: len(s.p[0].received) == 1 + i, i))
            await ask(s, turn("hot", 3))  # p0 has 2 in flight, p1 none: more than 1 apart
            assert where(s, turn("hot", 3)) == ["p1"]
            assert await routed(s, "prefill", "spill") == 1
            s.p[0].hold.set()


async def test_a_p_out_of_rotation_is_not_chosen_and_a_restarted_one_not_preferred() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_setup(2, 1, routing="prefix_aware", **ON_P) as s:
            await ask(s, turn("a", 0))
            await ask(s, turn("a", 1))
            s.p[0].healthy = False
            await eventually_health(s, lambda r: not r["prefill"][0]["up"])
            await ask(s, turn("a", 2))
            assert where(s, turn("a", 2)) == ["p1"]
            s.p[0].healthy = True
            s.p[0].engine_id = "prefill-0-restarted"  # what it held is gone
            await eventually_health(s, lambda r: r["prefill"][0]["engine_id"].endswith("ed"))
            before = await routed(s, "prefill", "prefix")
            await ask(s, turn("a", 0))  # p0 was sent it, but before it restarted
            assert where(s, turn("a", 0)) == ["p0", "p1"]
            assert await routed(s, "prefill", "prefix") == before + 1  # p1: it has turn 2


async def test_a_decode_back_in_rotation_is_not_preferred() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_setup(1, 2, decode_routing="prefix_aware") as s:
            await ask(s, turn("a", 0))
            await ask(s, turn("a", 1))
            assert [len(d.received) for d in s.d] == [2, 0]
            s.d[0].healthy = False  # D has no engine id: back in rotation reads as restarted
            await eventually_health(s, lambda r: not r["decode"][0]["up"])
            s.d[0].healthy = True
            await eventually_health(s, lambda r: r["decode"][0]["up"])
            await ask(s, turn("a", 2))
            assert await routed(s, "decode", "no_match") == 2  # turn 0, and turn 2 now
            assert await routed(s, "prefill", "round_robin") == 3  # P keeps its own routing


async def test_the_proxy_remembers_at_most_prefix_max_blocks() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_setup(2, 1, routing="prefix_aware", prefix_max_blocks=16, **ON_P) as s:
            for c in range(6):
                await ask(s, turn(str(c), 2))  # ~12 blocks each
                code, report = await s.health()
                assert code == 200
                assert 0 < report["prefix_blocks"]["prefill"] <= 16
                assert 0 < report["prefix_blocks"]["decode"] <= 16


@pytest.mark.parametrize(
    "kwargs",
    [
        {"prefill_routing": "nearest"},
        {"decode_routing": "random"},
        {"prefix_imbalance": -1},
        {"prefix_max_blocks": 0},
        {"prefix_max_age": 0},
    ],
)
def test_config_rejects_bad_prefix_routing(kwargs: dict[str, Any]) -> None:
    base: dict[str, Any] = {
        "prefill": (PrefillBackend("http://p:8100", "http://p:8998"),),
        "decode": ("http://d:8200",),
    }
    with pytest.raises(ValueError):
        ProxyConfig(**{**base, **kwargs})
