"""The proxy pairs only a P and a D that answer with the same model (issue 26), against
tests/test_proxy.py's stand-in engines: P's identity in its bootstrap's ``/query`` answer, D's
as our connector's info gauge on its ``/metrics``. An incompatible P never computes a prompt
for that D (in the P-first flow its token would be the client's first): D serves alone."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio

from pdactors.proxy._pairs import REREAD_ROUNDS, parse_identity
from pdactors.wire import Compat
from tests.test_proxy import (
    TIMEOUT,
    Setup,
    chat_body,
    completion_body,
    eventually,
    eventually_health,
    open_setup,
    total,
    wait_health,
)

OLD = {"model": "LlamaForCausalLM:0123456789abcdef", "weights": "a" * 32, "dtype": "float32"}
NEW = {**OLD, "weights": "b" * 32}
#: P computes every prompt it may (the shipped ``auto`` would serve these short prompts on D
#: alone, pair or no pair): whether P and D are paired is then what decides.
P_FIRST: dict[str, Any] = {"first_token": "p", "placement": "disaggregate", "fall_back_to_d": True}


def fallbacks(m: dict[Any, float], why: str) -> float:
    return m.get(("pdactors_proxy_fallbacks_total", (("why", why),)), 0.0)


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.message for r in caplog.records if "are never paired" in r.message]


async def send_all(s: Setup) -> list[str]:
    """A completion, a streamed one, a chat and a streamed chat; their placement headers."""
    placements = []
    for path, body in [
        ("/v1/completions", completion_body()),
        ("/v1/completions", completion_body(stream=True)),
        ("/v1/chat/completions", chat_body()),
        ("/v1/chat/completions", chat_body(stream=True)),
    ]:
        resp = await s.client.post(path, json=body)
        assert resp.status_code == 200, resp.text
        assert "p0" not in resp.text  # not a token of P's
        placements.append(resp.headers["x-pdactors-placement"])
    return placements


@pytest.mark.parametrize("first_token", ["p", "d"])
async def test_an_incompatible_pair_is_never_used_d_serves_alone(
    first_token: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Pinned ``disaggregate`` (P_FIRST) and all: P serving other weights than D
    gets no request, D gets each as the client wrote it; counted, logged once naming the
    field and both values, shown on /health."""
    caplog.set_level(logging.INFO, "pdactors.proxy")
    with trio.fail_after(TIMEOUT):
        identities = {"p0": OLD, "d0": NEW}
        config = {**P_FIRST, "first_token": first_token}
        async with open_setup(identities=identities, **config) as s:
            assert await send_all(s) == ["local"] * 4
            assert s.p[0].received == []
            assert all("kv_transfer_params" not in body for body in s.d[0].received)
            assert len(s.d[0].received) == 4
            m = await s.metrics()
            assert fallbacks(m, "incompatible") == 4
            assert m[("pdactors_proxy_placement_total",
                      (("placement", "local"), ("reason", "incompatible")))] == 4  # fmt: skip
            assert m[total("completions", "ok")] == m[total("chat_completions", "ok")] == 2
            answered = s.p[0].health_answers
            await eventually(lambda: s.p[0].health_answers >= answered + 3)  # two rounds more
            (line,) = refusals(caplog)
            assert f"prefill {s.p[0].url} and decode {s.d[0].url}" in line
            assert "weights differ (P aaaaaaaaaaaa…, D bbbbbbbbbbbb…)" in line
            code, report = await s.health()
            assert code == 200
            (pair,) = report["incompatible"]
            assert pair["prefill"] == s.p[0].url and "weights differ" in pair["reason"]
            assert report["decode"][0]["identity"] == NEW


async def test_a_compatible_pair_is_served_p_first_as_before() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_setup(identities={"p0": OLD, "d0": OLD}, **P_FIRST) as s:
            resp = await s.client.post("/v1/completions", json=completion_body())
            assert resp.json()["choices"][0]["text"] == "p0 says hid0 says hi"  # P's token first
            assert resp.headers["x-pdactors-placement"] == "disaggregated"
            assert s.d[0].received[0]["kv_transfer_params"]["remote_engine_id"] == "prefill-0"
            _, report = await s.health()
            assert "incompatible" not in report
            assert report["prefill"][0]["identity"] == report["decode"][0]["identity"] == OLD


async def test_of_two_p_only_the_compatible_one_is_used() -> None:
    with trio.fail_after(TIMEOUT):
        identities = {"p0": NEW, "p1": OLD, "d0": OLD}
        async with open_setup(2, identities=identities, **P_FIRST) as s:
            for _ in range(4):  # round robin would alternate
                resp = await s.client.post("/v1/completions", json=completion_body())
                assert resp.json()["choices"][0]["text"] == "p1 says hid0 says hi"
            assert s.p[0].received == [] and len(s.p[1].received) == 4
            assert fallbacks(await s.metrics(), "incompatible") == 0


@pytest.mark.parametrize("known", ["p0", "d0"])
async def test_an_identity_not_known_on_one_side_pairs_as_before(known: str) -> None:
    """A D without the gauge (an older D, one without our connector) or a P whose workers
    registered no description: not compared; D's check at its pull stays."""
    with trio.fail_after(TIMEOUT):
        async with open_setup(identities={known: OLD}, **P_FIRST) as s:
            resp = await s.client.post("/v1/completions", json=completion_body())
            assert resp.json()["choices"][0]["text"] == "p0 says hid0 says hi"
            assert fallbacks(await s.metrics(), "incompatible") == 0


async def test_d_enters_the_rotation_only_once_its_identity_is_read() -> None:
    """The start-up race: a D whose /metrics has not answered is not paired with anyone (it
    is out of rotation); once read, an incompatible P is never its first request's P."""
    with trio.fail_after(TIMEOUT):
        identities = {"p0": OLD, "d0": NEW}
        async with open_setup(healthy=False, identities=identities, **P_FIRST) as s:
            s.d[0].metrics_hold = trio.Event()
            s.p[0].healthy = True
            await eventually(lambda: s.p[0].health_answers > 0 and s.d[0].health_answers > 0)
            _, report = await s.health()
            assert report["status"] != "ok" and not report["decode"][0]["up"]
            s.d[0].healthy = True
            await eventually_health(s, lambda r: "identity not read" in r["decode"][0]["problem"])
            _, report = await s.health()
            assert report["status"] != "ok" and not report["decode"][0]["up"]  # /metrics unread
            s.d[0].metrics_hold.set()
            await wait_health(s, 200)
            resp = await s.client.post("/v1/completions", json=completion_body())
            assert resp.headers["x-pdactors-placement"] == "local" and s.p[0].received == []


async def test_a_ds_metrics_that_gives_no_answer_keeps_it_out_with_why() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_setup(healthy=False, identities={"d0": NEW}, **P_FIRST) as s:
            s.d[0].metrics_hold = trio.Event()
            s.p[0].healthy = s.d[0].healthy = True
            await eventually(lambda: s.d[0].health_answers > 1)
            with trio.fail_after(3):
                while "identity not read" not in (await s.health())[1]["decode"][0]["problem"]:
                    await trio.sleep(0.05)
            s.d[0].metrics_hold.set()
            await wait_health(s, 200)


async def test_without_the_fall_back_an_incompatible_pair_is_refused_by_name() -> None:
    with trio.fail_after(TIMEOUT):
        identities = {"p0": OLD, "d0": {**OLD, "dtype": "bfloat16"}}
        async with open_setup(identities=identities, **{**P_FIRST, "fall_back_to_d": False}) as s:
            resp = await s.client.post("/v1/completions", json=completion_body())
            assert resp.status_code == 503
            message = resp.json()["error"]["message"]
            assert "dtype differs (P float32, D bfloat16)" in message and s.d[0].url in message
            assert s.p[0].received == s.d[0].received == []


async def test_a_d_restarted_with_other_weights_is_caught_by_the_re_read(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A D that restarted between two probes (never out of rotation) with other weights:
    its identity is read again within REREAD_ROUNDS rounds; a P whose weights follow it is
    compatible again (P's identity is read each round)."""
    caplog.set_level(logging.INFO, "pdactors.proxy")
    with trio.fail_after(TIMEOUT):
        async with open_setup(identities={"p0": OLD, "d0": OLD}, **P_FIRST) as s:
            s.d[0].identity = NEW
            with trio.fail_after(0.05 * (REREAD_ROUNDS + 2) + 2):  # (rounds of 0.05 s; slack)
                await eventually(lambda: len(refusals(caplog)) == 1)
            resp = await s.client.post("/v1/completions", json=completion_body())
            assert resp.headers["x-pdactors-placement"] == "local"
            s.p[0].identity = NEW
            await eventually(lambda: any("compatible again" in r.message for r in caplog.records))
            resp = await s.client.post("/v1/completions", json=completion_body())
            assert resp.headers["x-pdactors-placement"] == "disaggregated"


async def test_fields_ds_compat_relax_names_may_differ() -> None:
    with trio.fail_after(TIMEOUT):
        identities = {"p0": OLD, "d0": {**NEW, "relax": "weights,kv_dtype"}}
        async with open_setup(identities=identities, **P_FIRST) as s:
            resp = await s.client.post("/v1/completions", json=completion_body())
            assert resp.headers["x-pdactors-placement"] == "disaggregated"


def test_the_gauge_is_read_from_a_prometheus_text() -> None:
    text = (
        "# HELP vllm:pdactors_compat_info x\n# TYPE vllm:pdactors_compat_info gauge\n"
        'vllm:pdactors_compat_info{engine="0",model="A:\\"q\\"",weights="w",dtype="float32",'
        'relax="weights,nonsense",role="kv_consumer"} 1.0\n'
        'vllm:pdactors_compat_info{engine="1",model="other"} 1.0\n'
    )
    found = parse_identity(text)
    assert found is not None
    assert found.compat == Compat(model='A:"q"', weights="w", dtype="float32")
    assert found.relax == ("weights",)
    assert parse_identity("vllm:other 1\n") is None
    assert parse_identity("vllm:pdactors_compat_info{broken 1\n") is None
    long = parse_identity(f'vllm:pdactors_compat_info{{model="{"m" * 1000}"}} 1\n')
    assert long is not None and len(long.compat.model) == 256
