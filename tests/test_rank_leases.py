"""A live lease is its holder's: the registry's rules (pure), its 409 over HTTP, the client's
typed refusal, and upstream-shaped registrations (no epoch, no lease) as before."""

from __future__ import annotations

import json

import httpx
import msgspec
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from pdactors.bootstrap_client import open_bootstrap_client
from pdactors.core.registry import (
    MAX_ADDR_CHARS,
    MAX_ENGINE_ID_CHARS,
    MAX_RANK,
    BootstrapRegistry,
)
from pdactors.errors import BootstrapError, RankHeld
from pdactors.wire import BootstrapEntry, RegisterWorker
from tests.test_bootstrap import running_bootstrap

P_EPOCH, NEXT_EPOCH = 0x1234_5678_9ABC, 0x0FED_CBA9_8765


def reg(
    addr: str = "tcp://p:1",
    *,
    engine: str = "e",
    dp: int = 0,
    tp: int = 0,
    epoch: int = P_EPOCH,
    replaces: int = 0,
) -> RegisterWorker:
    return RegisterWorker(engine, dp, tp, 0, addr, epoch=epoch, replaces=replaces)


def held() -> BootstrapRegistry:
    registry = BootstrapRegistry()
    assert registry.register(reg(), now=0.0, lease=5.0) == "added"
    return registry


def test_a_foreign_address_cannot_take_a_live_lease_and_names_rank_and_holder() -> None:
    registry = held()
    for foreign in (
        reg("tcp://evil:1"),
        reg("tcp://evil:1", epoch=0),
        reg("tcp://evil:1", epoch=7),
    ):
        for lease in (None, 5.0):
            with pytest.raises(
                RankHeld, match=r"dp=0 tp=0 pp=0 of engine 'e' is held by 'tcp://p:1'"
            ):
                registry.register(foreign, now=1.0, lease=lease)
    assert registry.answer(now=1.0)[0].worker_addr == {0: {0: "tcp://p:1"}}  # untouched


def test_nor_can_another_engine_id_take_the_dp_rank() -> None:
    registry = held()
    with pytest.raises(RankHeld):
        registry.register(reg(engine="other"), now=1.0, lease=5.0)
    with pytest.raises(RankHeld):  # not even on another tp rank: it would drop P's whole entry
        registry.register(reg("tcp://q:1", engine="other", tp=1), now=1.0)
    assert registry.register(reg("tcp://q:1", tp=1), now=1.0) == "added"  # a new rank is free


def test_the_holders_epoch_in_replaces_moves_it_and_only_that() -> None:
    registry = held()
    with pytest.raises(RankHeld):
        registry.register(reg("tcp://p:2", epoch=NEXT_EPOCH, replaces=NEXT_EPOCH), now=1.0)
    moved = reg("tcp://p:2", epoch=NEXT_EPOCH, replaces=P_EPOCH)
    assert registry.register(moved, now=1.0, lease=5.0) == "moved"
    answer = registry.answer(now=1.0)[0]
    assert answer.worker_addr == {0: {0: "tcp://p:2"}} and answer.epochs == {0: {0: NEXT_EPOCH}}
    # the predecessor, resuming, cannot take it back: its epoch is no longer the holder's
    with pytest.raises(RankHeld):
        registry.register(reg(), now=2.0, lease=5.0)


def test_replaces_displaces_a_new_engine_id_only_for_its_own_rank() -> None:
    registry = held()
    registry.register(reg("tcp://p:9", tp=1, epoch=99), now=0.0, lease=5.0)
    replacing = reg("tcp://n:1", engine="new", epoch=NEXT_EPOCH, replaces=P_EPOCH)
    with pytest.raises(RankHeld, match="tp=1"):  # tp 1 is still held by the old engine
        registry.register(replacing, now=1.0, lease=5.0)
    lone = held()
    assert lone.register(replacing, now=1.0, lease=5.0) == "engine_replaced"


def test_the_same_address_with_a_new_epoch_is_a_restart_and_renewals_are_unchanged() -> None:
    registry = held()
    assert registry.register(reg(), now=1.0, lease=5.0) == "unchanged"
    assert registry.register(reg(epoch=NEXT_EPOCH), now=2.0, lease=5.0) == "restarted"
    assert registry.answer(now=2.0)[0].epochs == {0: {0: NEXT_EPOCH}}


def test_a_lapsed_lease_can_be_taken_by_anyone() -> None:
    registry = held()
    with pytest.raises(RankHeld):
        registry.register(reg("tcp://evil:1"), now=4.9, lease=5.0)
    assert registry.register(reg("tcp://evil:1", epoch=7), now=5.0, lease=5.0) == "added"
    # and then the old holder's renewal is the foreign one: refused while the new lease lives
    with pytest.raises(RankHeld, match="held by 'tcp://evil:1'"):
        registry.register(reg(), now=6.0, lease=5.0)


def test_upstream_shaped_registrations_keep_their_replace_semantics() -> None:
    """No lease (upstream's P, its tools): anyone replaces them, as before; no epoch in the
    answer, nor in the JSON either way."""
    registry = BootstrapRegistry()
    plain = RegisterWorker("e", 0, 0, 0, "tcp://p:1")
    assert msgspec.json.decode(msgspec.json.encode(plain)) == {
        "engine_id": "e", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://p:1",
    }  # fmt: skip
    assert registry.register(plain) == "added"
    assert registry.register(RegisterWorker("e", 0, 0, 0, "tcp://q:1")) == "moved"
    assert registry.register(RegisterWorker("f", 0, 0, 0, "tcp://r:1")) == "engine_replaced"
    assert registry.register(reg("tcp://s:1", engine="g"), now=0.0, lease=5.0) == "engine_replaced"
    assert json.loads(msgspec.json.encode(BootstrapRegistry().answer())) == {}
    registry = BootstrapRegistry()
    registry.register(plain)
    assert json.loads(msgspec.json.encode(registry.answer())) == {
        "0": {"engine_id": "e", "worker_addr": {"0": {"0": "tcp://p:1"}}}
    }


_ADDRS = st.sampled_from(["tcp://a:1", "tcp://b:1"])
_EPOCHS = st.sampled_from([0, 1, 2])
_STEP = st.tuples(_ADDRS, _EPOCHS, _EPOCHS, st.sampled_from([None, 3.0]), st.floats(0, 2))


@settings(max_examples=300, deadline=None)
@given(st.lists(_STEP, max_size=20))
def test_whoever_holds_a_live_lease_is_only_moved_by_naming_its_epoch(steps: list) -> None:
    """After any sequence of registrations, a refusal changed nothing, and a registration
    that moved a rank whose lease was live named the holder's epoch."""
    registry, now = BootstrapRegistry(), 0.0
    holder: tuple[str, int, float] | None = None  # (addr, epoch, lease expiry)
    for addr, epoch, replaces, lease, dt in steps:
        now += dt
        if holder is not None and holder[2] <= now:
            holder = None  # lapsed
        before = registry.answer(now)
        live = holder is not None and holder[2] != float("inf")
        try:
            registry.register(reg(addr, epoch=epoch, replaces=replaces), now=now, lease=lease)
        except RankHeld:
            assert live and holder is not None and addr != holder[0]
            assert not (replaces and replaces == holder[1])
            assert registry.answer(now) == before
            continue
        if live and holder is not None and addr != holder[0]:
            assert replaces and replaces == holder[1]
        holder = (addr, epoch, now + lease if lease is not None else float("inf"))
        assert registry.answer(now)[0].worker_addr == {0: {0: addr}}


async def test_the_bootstrap_answers_409_and_the_client_raises_rank_held_at_once() -> None:
    with trio.fail_after(20):
        async with running_bootstrap() as url, open_bootstrap_client() as client:
            await client.register(url, reg(), timeout=5, lease=30)
            async with httpx.AsyncClient(trust_env=False) as http:
                body = msgspec.json.encode(reg("tcp://evil:1", epoch=0))
                resp = await http.post(f"{url}/register", content=body)
            assert resp.status_code == 409
            assert "held by 'tcp://p:1'" in resp.json()["error"]
            start = trio.current_time()
            with pytest.raises(RankHeld, match="HTTP 409"):  # a refusal: not retried
                await client.register(url, reg("tcp://evil:1"), timeout=30)
            assert trio.current_time() - start < 5
            assert issubclass(RankHeld, BootstrapError)
            answer = await client.query(url, timeout=5)
            assert answer == {
                0: BootstrapEntry("e", {0: {0: "tcp://p:1"}}, epochs={0: {0: P_EPOCH}})
            }


def test_the_refusal_says_how_long_the_lease_lives() -> None:
    registry = held()  # leased at 0.0 for 5 s
    with pytest.raises(RankHeld, match=r"whose lease is live for 3\.5 s more"):
        registry.register(reg("tcp://evil:1"), now=1.5, lease=5.0)


def test_a_lapsed_worker_beside_a_lasting_one_leaves_its_place_free() -> None:
    registry = BootstrapRegistry()
    registry.register(reg("tcp://p:2", tp=1))  # no lease: stays
    registry.register(reg(), now=0.0, lease=5.0)
    assert registry.expire(6.0) == ["'e' dp=0 tp=0 pp=0 at 'tcp://p:1'"]
    assert registry.register(reg("tcp://new:1"), now=6.0, lease=5.0) == "added"
    assert registry.answer(now=6.0)[0].worker_addr == {0: {0: "tcp://new:1"}, 1: {0: "tcp://p:2"}}


def test_the_answer_carries_each_workers_curve_key_and_a_registration_without_drops_it() -> None:
    registry = BootstrapRegistry()
    keyed = RegisterWorker("e", 0, 0, 0, "tcp://p:1", curve_key="K" * 40, epoch=P_EPOCH)
    assert registry.register(keyed) == "added"
    assert registry.answer()[0].curve_keys == {0: {0: "K" * 40}}
    assert registry.register(reg()) == "moved"  # the same address, its key gone
    assert registry.answer()[0].curve_keys == {}


def test_fields_at_their_limits_are_taken() -> None:
    registry = BootstrapRegistry()
    at_limits = RegisterWorker(
        "e" * MAX_ENGINE_ID_CHARS,
        MAX_RANK,
        MAX_RANK,
        MAX_RANK,
        "tcp://" + "a" * (MAX_ADDR_CHARS - 6),
    )
    assert registry.register(at_limits) == "added"
