"""Engines that take every role (vLLM's ``kv_both``; ``ProxyConfig.engines``, ``pdactors proxy
--engine``): one engine in both pools, never a request's P and D at once, its load counted in
both roles, drained and calibrated as one engine. Stand-in engines (tests/test_proxy.py)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from pdactors import PrefillBackend, ProxyConfig
from pdactors.errors import ConfigError
from pdactors.proxy._completions import _engine_load
from pdactors.proxy._state import Backend
from tests.test_proxy import TIMEOUT, FakeEngine, completion_body, eventually, open_setup

PLACEMENT = "x-pdactors-placement"


def legs(engines: list[FakeEngine]) -> dict[str, dict[str, str]]:
    """Per transfer id, which engine was sent its P leg (``do_remote_decode``) and which its D
    leg (``do_remote_prefill``)."""
    out: dict[str, dict[str, str]] = {}
    for e in engines:
        for body in e.received:
            params = body.get("kv_transfer_params") or {}
            role = "p" if params.get("do_remote_decode") else "d"
            if params.get("do_remote_decode") or params.get("do_remote_prefill"):
                out.setdefault(params["transfer_id"], {})[role] = e.name
    return out


async def post(client: httpx.AsyncClient, placement: str | None = None) -> httpx.Response:
    headers = {PLACEMENT: placement} if placement else {}
    resp = await client.post("/v1/completions", json=completion_body(), headers=headers)
    assert resp.status_code == 200, resp.text
    return resp


async def test_two_engines_of_every_role_take_both_roles_and_never_pair_one_with_itself() -> None:
    """Disaggregated requests over two kv_both engines: each one's P is the other engine, and
    each engine is P for some and D for others; each engine was calibrated once (as it
    entered as a P), not once per role."""
    with trio.fail_after(TIMEOUT):
        async with open_setup(0, 0, n_both=2) as s:
            assert [len(e.probes) for e in s.both] == [1, 1]
            for _ in range(6):
                resp = await post(s.client, "disaggregate")
                assert resp.headers[PLACEMENT] == "disaggregated"
            pairs = legs(s.both)
            assert len(pairs) == 6
            assert all(set(roles) == {"p", "d"} and roles["p"] != roles["d"]
                       for roles in pairs.values()), pairs  # fmt: skip
            assert (
                {r["p"] for r in pairs.values()}
                == {r["d"] for r in pairs.values()}
                == {
                    "e0",
                    "e1",
                }
            )
            code, report = await s.health()
            assert code == 200 and report["status"] == "ok"
            assert [b["every_role"] for b in report["prefill"] + report["decode"]] == [True] * 4


async def test_one_engine_of_every_role_serves_every_placement_alone() -> None:
    """A pool of one kv_both engine: nothing to disaggregate with (its P would be its D), so a
    request pinned disaggregated is served by it alone, and so is every other placement; the
    proxy is ``ok``. Every request that got no P but the whole-on-p one counts as D alone for
    want of a P (``no_prefill``), as with a P out of rotation."""
    with trio.fail_after(TIMEOUT):
        async with open_setup(0, 0, n_both=1) as s:
            (e,) = s.both
            placed = [
                (await post(s.client, pin)).headers[PLACEMENT]
                for pin in ("disaggregate", "local", "whole-on-p", None)
            ]
            assert placed == ["local", "local", "whole-on-p", "local"]
            assert len(e.received) == 4 and legs(s.both) == {}
            m = await s.metrics()
            assert m["pdactors_proxy_fallbacks_total", (("why", "no_prefill"),)] == 3
            assert (await s.health())[1]["status"] == "ok"


async def test_least_outstanding_counts_an_engines_requests_in_both_roles() -> None:
    """e0 decodes a request (held); a request served whole by a P then goes to e1, although
    e0 holds nothing in its P role: its load is the engine's, both roles together."""
    with trio.fail_after(TIMEOUT):
        async with open_setup(0, 0, n_both=2, routing="least_outstanding") as s:
            e0, e1 = s.both
            e0.hold = e1.hold = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(post, s.client, "local")
                await eventually(lambda: len(e0.received) + len(e1.received) == 1)
                busy, idle = (e0, e1) if e0.received else (e1, e0)
                nursery.start_soon(post, s.client, "whole-on-p")
                await eventually(lambda: len(idle.received) == 1)
                assert len(busy.received) == 1
                e0.hold.set()


async def test_draining_an_engine_of_every_role_takes_it_out_of_both() -> None:
    """``POST /admin/drain`` names the engine's URL once: both its records drain, every
    placement goes to the other engine (alone: it cannot be its own P), and a resume puts both
    back."""
    with trio.fail_after(TIMEOUT):
        async with open_setup(0, 0, n_both=2) as s:
            e0, e1 = s.both
            resp = await s.client.post("/admin/drain", json={"engine": e0.url})
            assert resp.status_code == 200 and resp.json()["empty"] is True
            engines = (await s.client.get("/admin/engines")).json()["engines"]
            assert [(x["role"], x["draining"]) for x in engines if x["url"] == e0.url] == [
                ("prefill", True),
                ("decode", True),
            ]
            for pin in ("disaggregate", "local", "whole-on-p", None):
                await post(s.client, pin)
            assert e0.received == [] and len(e1.received) == 4
            await s.client.post("/admin/resume", json={"engine": e0.url})
            engines = (await s.client.get("/admin/engines")).json()["engines"]
            assert not any(x["draining"] for x in engines)
            await post(s.client, "disaggregate")
            assert legs(s.both) != {} and e0.received


def test_an_engines_load_is_both_its_roles() -> None:
    """What the placer weighs of an engine of every role: the prompt tokens waiting and the
    requests decoding on it in both roles (D's incoming prompts, still at a P, not)."""
    p, d = Backend("prefill", "http://e"), Backend("decode", "http://e")
    p.outstanding, p.prefills, p.waiting_tokens = 3, 1, 100  # 2 served whole, 1 prefill
    d.outstanding, d.prefills, d.incoming, d.waiting_tokens = 5, 1, 1, 40  # 3 decoding
    alone = _engine_load(d)
    assert (alone.waiting_tokens, alone.decoding) == (40, 3)
    p.twin, d.twin = d, p
    for half in (p, d):
        load = _engine_load(half)
        assert (load.waiting_tokens, load.decoding) == (140, 5)
    assert p.load == d.load == 8


@pytest.mark.parametrize(
    ("given", "error"),
    [
        ({}, "at least one prefill and one decode engine"),
        ({"prefill": (PrefillBackend("http://a", "http://b"),)}, "at least one"),
        (
            {"engines": (PrefillBackend("http://a", "http://b"),), "decode": ("http://a",)},
            "listed once, as one of engines",
        ),
    ],
)
def test_a_pool_needs_both_roles_and_each_engine_once(given: dict[str, Any], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        ProxyConfig(**given)


def test_engines_alone_or_beside_prefill_and_decode_make_a_pool() -> None:
    e = PrefillBackend("http://e", "http://e:8998")
    assert ProxyConfig(engines=(e,)).engines == (e,)
    assert ProxyConfig(prefill=(PrefillBackend("http://p", "http://p:1"),), engines=(e,))
    assert ProxyConfig(decode=("http://d",), engines=(e,))
