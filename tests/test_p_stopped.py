"""P-first requests waiting on a P that stops answering (issue 26), against tests/test_proxy.py's
stand-in engines: the proxy's health loop judges P failed and every request still waiting for
P's first token is cut from P and served by D alone (or, with the fall-back off, failed at once
naming P and why). A stopped P is a stand-in that accepts every request and never answers
(what a SIGSTOPped API server looks like: the kernel accepts, nothing answers), and then its
``/health`` too. The autojump clock (tests/conftest.py's ``mock_clock``) makes the health
timeout (1 s) pass at once and exactly; the request timeout is the default 600 s, so without
the cut every request here would wait past the test's limit.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from pdactors import PrefillBackend, ProxyConfig
from pdactors.bootstrap_client import BootstrapClient
from pdactors.proxy._engine_failures import EngineFailures
from pdactors.proxy._engine_http import ConnectFailed
from pdactors.proxy._health import HealthWatch
from pdactors.proxy._state import Backend, Metrics, Pool
from tests.test_p_first import P_FIRST, data_events
from tests.test_proxy import (
    CONCURRENT,
    TIMEOUT,
    Setup,
    as_relayed,
    chat_body,
    completion_body,
    eventually,
    eventually_health,
    open_setup,
    total,
)

#: The proxy's health_timeout in open_setup: P's verdict comes this long after its /health
#: stopped answering.
HEALTH_TIMEOUT = 1.0
KINDS = [
    ("/v1/completions", False),
    ("/v1/completions", True),
    ("/v1/chat/completions", False),
    ("/v1/chat/completions", True),
]
#: Eight requests: two of each kind.
MIXED = [kind for kind in KINDS for _ in range(2)]


def body_of(path: str, stream: bool) -> dict[str, Any]:
    return (chat_body if "chat" in path else completion_body)(stream=stream)


Answers = list[tuple[httpx.Response, float]]


async def ask(s: Setup, path: str, stream: bool, answers: Answers) -> None:
    """One request of that kind; its answer and when it came (the test's clock) go to
    ``answers``."""
    resp = await s.client.post(path, json=body_of(path, stream))
    answers.append((resp, trio.current_time()))


async def waiting_on_p(s: Setup, kinds: list[tuple[str, bool]]) -> Answers:
    """One request of each of ``kinds`` while P holds every answer; once P has them all,
    P's ``/health`` stops answering. Returns when every request was answered."""
    answers: Answers = []
    async with trio.open_nursery() as nursery:
        for path, stream in kinds:
            nursery.start_soon(ask, s, path, stream, answers)
        await eventually(lambda: len(s.p[0].received) == len(kinds))
        s.p[0].health_hold = trio.Event()
    return answers


def text_of(resp: httpx.Response, stream: bool) -> str:
    """The answer's text: streamed, its events' (the stand-in D streams completion chunks),
    else a completion's or a chat's."""
    if stream:
        return "".join(e["choices"][0]["text"] for e in data_events(resp.text))
    choice = resp.json()["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


def cut_logs(caplog: pytest.LogCaptureFixture, tid: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if tid in r.getMessage() and "judged failed" in r.getMessage()
    ]


@pytest.mark.parametrize(("path", "stream"), KINDS)
async def test_requests_waiting_on_a_stopped_p_go_to_d_alone_at_its_health_verdict(
    path: str, stream: bool, mock_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "pdactors.proxy")
    with trio.fail_after(TIMEOUT):
        async with open_setup(**P_FIRST, fall_back_to_d=True) as s:
            p, d = s.p[0], s.d[0]
            p.hold = trio.Event()  # P takes every request and never answers
            answers = await waiting_on_p(s, [(path, stream)] * 8)
            verdict = p.health_held[0] + HEALTH_TIMEOUT  # the first /health left unanswered
            for resp, at in answers:
                assert resp.status_code == 200, resp.text
                assert resp.headers["x-pdactors-placement"] == "local"
                assert text_of(resp, stream).startswith("d0")
                assert verdict - 0.1 <= at <= verdict + 0.5  # at the verdict, not before
            assert d.received == [as_relayed(body_of(path, stream))] * 8  # as the client's
            name = "chat_completions" if "chat" in path else "completions"
            m = await s.metrics()
            assert m[("pdactors_proxy_fallbacks_total", (("why", "p_unhealthy"),))] == 8
            assert ("pdactors_proxy_fallbacks_total", (("why", "prefill_failed"),)) not in m
            assert m[total(name, "ok")] == 8
            # P's 8 requests were abandoned as a client that went away abandons them (their
            # connections closed: vLLM aborts them, a stopped P when it runs again)
            await eventually(lambda: sorted(p.cancelled) == sorted(p.tids()))
            for tid in p.tids():
                assert len(cut_logs(caplog, tid)) == 1  # one line per request, with its id
            (cut,) = [r.getMessage() for r in caplog.records if "cut from it" in r.getMessage()]
            assert p.url in cut and "8 requests" in cut and "no answer within 1 s" in cut
            _, report = await s.health()
            counts = [(e["outstanding"], e["waiting_tokens"], e["prefills"]) for e in
                      (report["prefill"][0], report["decode"][0])]  # fmt: skip
            assert counts == [(0, 0, 0), (0, 0, 0)]
            assert not report["prefill"][0]["up"]


async def test_without_the_fall_back_each_request_fails_at_once_naming_p(
    mock_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(TIMEOUT):
        async with open_setup(**P_FIRST, fall_back_to_d=False) as s:
            p = s.p[0]
            p.hold = trio.Event()
            answers = await waiting_on_p(s, MIXED)
            verdict = p.health_held[0] + HEALTH_TIMEOUT
            for resp, at in answers:
                assert resp.status_code == 502
                message = resp.json()["error"]["message"]
                assert message == (
                    f"prefill engine {p.url} judged failed: GET /health gave no answer within 1 s"
                )
                assert verdict - 0.1 <= at <= verdict + 0.5
            assert s.d[0].received == []
            m = await s.metrics()
            assert m[total("completions", "prefill_error")] == 4
            assert m[total("chat_completions", "prefill_error")] == 4
            await eventually(lambda: sorted(p.cancelled) == sorted(p.tids()))


async def test_a_slow_but_healthy_p_is_not_cut(mock_clock: trio.testing.MockClock) -> None:
    """P holds its answers (a long queue) while its /health answers: nothing is cut however
    long it takes; each request gets P's token, then D's."""
    with trio.fail_after(TIMEOUT):
        async with open_setup(**P_FIRST, fall_back_to_d=True) as s:
            p = s.p[0]
            p.hold = trio.Event()
            answers: Answers = []
            async with trio.open_nursery() as nursery:
                for path, stream in MIXED:
                    nursery.start_soon(ask, s, path, stream, answers)
                await eventually(lambda: len(p.received) == len(MIXED))
                seen = p.health_answers
                # many health rounds, longer than the health timeout: P stays in rotation
                await eventually(lambda: p.health_answers >= seen + 25)
                assert answers == [] and s.d[0].received == []
                p.hold.set()
            for resp, _ in answers:
                assert resp.status_code == 200, resp.text
                assert resp.headers["x-pdactors-placement"] == "disaggregated"
                assert "p0 says hi" in resp.text  # P's token first
            m = await s.metrics()
            assert m[("pdactors_proxy_p_first_total", (("path", "continued_on_d"),))] == 8
            assert not [k for k in m if k[0] == "pdactors_proxy_fallbacks_total"]
            assert p.cancelled == []


async def test_a_failed_bootstrap_takes_p_out_but_cuts_nothing(
    mock_clock: trio.testing.MockClock,
) -> None:
    """P's bootstrap failing says D could not find P for a new request; the requests already
    at P still get P's token (and D's look-ups are cached): they are not cut."""
    with trio.fail_after(TIMEOUT):
        async with open_setup(**P_FIRST, fall_back_to_d=True) as s:
            p = s.p[0]
            p.hold = trio.Event()
            answers: Answers = []
            async with trio.open_nursery() as nursery:
                for path, stream in MIXED:
                    nursery.start_soon(ask, s, path, stream, answers)
                await eventually(lambda: len(p.received) == len(MIXED))
                p.query_ok = False
                await eventually_health(s, lambda r: not r["prefill"][0]["up"])  # P out of rotation
                assert answers == [] and p.cancelled == []
                p.hold.set()
            assert [r.status_code for r, _ in answers] == [200] * 8
            m = await s.metrics()
            assert m[("pdactors_proxy_p_first_total", (("path", "continued_on_d"),))] == 8


async def test_the_concurrent_flow_is_not_held_by_a_stopped_p(
    mock_clock: trio.testing.MockClock,
) -> None:
    """``--first-token d``: D's answer decides, so a stopped P holds nothing: its verdict cuts
    nothing, each request is answered the moment D answers, and P's legs are then cancelled."""
    with trio.fail_after(TIMEOUT):
        async with open_setup(**CONCURRENT, fall_back_to_d=True) as s:
            p, d = s.p[0], s.d[0]
            p.hold, d.hold = trio.Event(), trio.Event()
            answers: Answers = []
            async with trio.open_nursery() as nursery:
                for path, stream in MIXED:
                    nursery.start_soon(ask, s, path, stream, answers)
                await eventually(lambda: len(p.received) == len(d.received) == len(MIXED))
                p.health_hold = trio.Event()
                await eventually(lambda: bool(p.health_held))
                await eventually_health(s, lambda r: not r["prefill"][0]["up"])  # P judged failed
                assert answers == [] and d.cancelled == []
                d.hold.set()
            assert [r.status_code for r, _ in answers] == [200] * 8
            await eventually(lambda: sorted(p.cancelled) == sorted(p.tids()))
            m = await s.metrics()
            assert not [k for k in m if k[0] == "pdactors_proxy_fallbacks_total"]


async def test_which_verdicts_cut_the_requests_waiting_on_p() -> None:
    """The rule, without engines: P's bootstrap failing takes P out of rotation but cuts
    nothing; P's own failure (here a refused connection, met by another request) cuts every
    request waiting for its first token, even with P out of rotation already."""
    config = ProxyConfig(
        prefill=(PrefillBackend("http://p:1", "http://p:2"),), decode=("http://d:1",)
    )
    async with httpx.AsyncClient() as http:
        p = Backend("prefill", "http://p:1", "http://p:2", up=True, dp_engines={0: "p"})
        pools = (Pool("prefill", [p], "round_robin"), Pool("decode", [], "round_robin"))
        watch = HealthWatch(config, http, BootstrapClient(http), pools, Metrics())
        waiting = {trio.CancelScope(), trio.CancelScope()}
        p.waiting_on |= waiting
        watch.set(p, "bootstrap: HTTP 500", None)  # out of rotation, nothing cut
        assert not p.up and not any(s.cancel_called for s in waiting)
        assert p.waiting_on == waiting
        failures = EngineFailures(config, Metrics(), watch)
        failure = failures.transport_failure(p, ConnectFailed("connection refused"))
        assert failure.outcome == "prefill_error" and failure.fallback == ""  # prefill_failed
        assert all(s.cancel_called for s in waiting) and p.waiting_on == set()
        cut = failures.judged_failed(p)
        assert cut.fallback == "p_unhealthy" and cut.status == 502
        assert cut.message.startswith("prefill engine http://p:1 judged failed: connection failed")
