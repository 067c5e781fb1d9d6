"""Placement per request (``placement="auto"``): the placer's estimates as pure functions, then
the proxy placing requests among stand-in engines by what it measured."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from pdactors.core.placement import CostModel, EngineLoad, Placer, TokenCount, prompt_size
from tests.test_proxy import TIMEOUT, completion_body, eventually, open_setup

P, D = "http://p", "http://d"


def idle() -> EngineLoad:
    return EngineLoad(waiting_tokens=0, decoding=0)


# --------------------------------------------------------------------------- the estimates


def test_a_cost_model_learns_a_line_and_forgets_the_old_one() -> None:
    model = CostModel(20.0, 0.1)
    for _ in range(3):
        for tokens in (100, 400, 900):
            model.observe(tokens, 5.0 + 0.03 * tokens)
    a, b = model.fit()
    assert 0.02 < b < 0.06 and a < 15  # pulled most of the way from the prior (20, 0.1)
    for _ in range(60):
        for tokens in (100, 400, 900):
            model.observe(tokens, 50.0 + 0.2 * tokens)
    a, b = model.fit()
    assert abs(b - 0.2) < 0.02 and abs(a - 50) < 5


def test_observations_of_one_size_move_the_level_not_the_slope() -> None:
    model = CostModel(20.0, 0.1)
    for _ in range(50):
        model.observe(500, 100.0)
    a, b = model.fit()
    assert abs(a + b * 500 - 100) < 5  # where it was measured: what it saw, the prior aside
    assert b > 0  # and the slope stays the prior's kind, not a division by zero


@given(st.lists(st.tuples(st.integers(0, 10_000), st.floats(0, 1e5)), max_size=50))
def test_a_cost_model_never_predicts_a_negative_cost(points: list[tuple[int, float]]) -> None:
    model = CostModel(20.0, 0.1)
    for tokens, ms in points:
        model.observe(tokens, ms)
    a, b = model.fit()
    assert a >= 0 and b >= 0
    assert model.predict(0) >= 0


def test_prompt_size_counts_ids_exactly_and_text_by_characters() -> None:
    assert prompt_size({"prompt": [1, 2, 3]}, chat=False) == (3, 0)
    assert prompt_size({"prompt": [[1, 2]]}, chat=False) == (2, 0)  # a list of one prompt
    assert prompt_size({"prompt": "hello"}, chat=False) == (None, 5)
    assert prompt_size({"prompt": ["hey"]}, chat=False) == (None, 3)
    messages = [
        {"role": "system", "content": "ab"},
        {"role": "user", "content": [{"type": "text", "text": "cde"}, {"type": "image_url"}]},
    ]
    assert prompt_size({"messages": messages}, chat=True) == (None, 5)
    assert prompt_size({}, chat=False) == (None, 0)  # no prompt: nothing to count


def test_tokens_per_character_are_learned_from_what_p_counted() -> None:
    count = TokenCount()
    assert count.tokens((None, 400)) == 100  # the prior: 4 characters a token
    assert count.tokens((7, 0)) == 7
    assert count.tokens((None, 1)) == 1  # a prompt of text is at least one token
    count.observe(chars=0, tokens=10)  # an answer that counted no text, or no tokens,
    count.observe(chars=200, tokens=0)  # teaches nothing (and never divides by zero)
    assert count.tokens((None, 400)) == 100
    for _ in range(30):
        count.observe(chars=200, tokens=100)
    assert count.tokens((None, 400)) == 200


def test_a_decoding_engines_running_step_is_added_to_its_estimate() -> None:
    placer = Placer(stall_weight=0.0)  # no stall: the step alone
    placer.steps(D, 0.05, gaps=1, per_chunk=0.04)  # a first stream: the means start there
    placer.steps(P, 0.0123456)
    assert placer.describe()["step_ms"] == {D: 50.0, P: 12.35}
    assert placer.describe()["tpot_ms"] == {D: 40.0, P: 12.35}
    busy = EngineLoad(waiting_tokens=0, decoding=1)
    quiet = placer.decide(100, P, idle(), D, idle())
    both_busy = placer.decide(100, P, busy, D, busy)
    assert both_busy.local_ms == pytest.approx(quiet.local_ms + 50.0)
    assert both_busy.disaggregated_ms == pytest.approx(quiet.disaggregated_ms + 12.3456)
    unmeasured = Placer(stall_weight=0.0).decide(100, P, busy, D, busy)  # no step learnt yet
    assert (unmeasured.local_ms, unmeasured.disaggregated_ms) == pytest.approx(
        (quiet.local_ms, quiet.disaggregated_ms)
    )


def test_an_idle_d_computes_the_prompt_itself() -> None:
    placer = Placer(stall_weight=0.25)
    decision = placer.decide(500, P, idle(), D, idle())
    assert decision.where == "local" and decision.reason == "d_idle"
    # ... unless P is much faster than D, as measured.
    for _ in range(20):
        placer.first_token(P, 500, 0.010)
        placer.first_token(D, 500, 0.200)
    decision = placer.decide(500, P, idle(), D, idle())
    assert decision.where == "disaggregated" and decision.reason == "p_faster"
    # P an engine of every role, which decodes for the pool anyway: it serves it whole
    decision = placer.decide(500, P, idle(), D, idle(), p_decodes=True)
    assert decision.where == "whole-on-p" and decision.reason == "p_faster"  # no transfer
    assert decision.whole_ms is not None and decision.whole_ms < decision.local_ms


def test_a_lone_request_is_served_whole_by_the_engine_that_answers_sooner() -> None:
    """In a pool of engines of every role, nothing in flight on either engine: the faster
    one serves the request whole (no transfer, no catch-up before its second token), even
    where disaggregating would have won on the estimates (P faster, its first token the
    client's); with anything in flight on either, or a P that only prefills, the estimates
    between local and disaggregated decide as before."""
    placer = Placer(stall_weight=0.25)
    for _ in range(20):
        for tokens in (100, 900):
            placer.first_token(P, tokens, (10 + 0.03 * tokens) / 1e3)
            placer.first_token(D, tokens, (10 + 0.05 * tokens) / 1e3)
    lone = placer.decide(500, P, idle(), D, idle(), p_decodes=True)
    assert (lone.where, lone.reason) == ("whole-on-p", "p_faster")
    assert lone.whole_ms is not None and lone.whole_ms < lone.disaggregated_ms < lone.local_ms
    for load in (EngineLoad(1, 0), EngineLoad(0, 1)):  # P (or D) has something in flight
        assert placer.decide(500, P, load, D, idle(), p_decodes=True).where != "whole-on-p"
        assert placer.decide(500, P, idle(), D, load, p_decodes=True).where != "whole-on-p"
    dedicated = placer.decide(500, P, idle(), D, idle())  # a P that only prefills
    assert (dedicated.where, dedicated.reason) == ("disaggregated", "p_faster")
    for _ in range(40):
        for tokens in (100, 900):  # now D answers sooner: it serves it alone
            placer.first_token(D, tokens, (5 + 0.01 * tokens) / 1e3)
    assert placer.decide(500, P, idle(), D, idle(), p_decodes=True).where == "local"


def test_lone_requests_served_whole_on_p_refresh_ds_model_once_in_a_while() -> None:
    placer = Placer(stall_weight=0.25)
    for _ in range(20):
        placer.first_token(P, 500, 0.010)
        placer.first_token(D, 500, 0.200)
    wheres = [placer.decide(500, P, idle(), D, idle(), p_decodes=True).where for _ in range(48)]
    assert wheres.count("local") == 3 and wheres.count("whole-on-p") == 45  # one in 16


def test_a_busy_d_keeps_short_prompts_and_hands_long_ones_to_p() -> None:
    placer = Placer(stall_weight=0.25)
    busy = EngineLoad(waiting_tokens=0, decoding=8)
    long = placer.decide(900, P, idle(), D, busy)
    assert long.where == "disaggregated" and long.reason == "d_busy"
    short = placer.decide(8, P, idle(), D, EngineLoad(0, 1))
    assert short.where == "local" and short.reason == "short"


def test_a_long_queue_on_p_sends_prompts_to_a_busy_d() -> None:
    placer = Placer(stall_weight=0.25)
    queued = EngineLoad(waiting_tokens=20_000, decoding=0)
    decision = placer.decide(900, P, queued, D, EngineLoad(0, 2))
    assert decision.where == "local" and decision.reason == "p_queue"
    assert decision.local_ms < decision.disaggregated_ms


def test_the_stall_weight_decides_between_a_decode_pause_and_a_queue() -> None:
    queued = EngineLoad(waiting_tokens=2_000, decoding=0)
    busy = EngineLoad(0, 8)
    assert Placer(stall_weight=0.0).decide(900, P, queued, D, busy).where == "local"
    assert Placer(stall_weight=2.0).decide(900, P, queued, D, busy).where == "disaggregated"


def test_each_engine_has_its_own_model() -> None:
    placer = Placer(stall_weight=0.25)
    for _ in range(20):
        placer.first_token(P, 500, 0.300)  # P slow under disaggregation ...
    before = placer.decide(500, P, idle(), D, idle())
    assert before.local_ms < before.disaggregated_ms / 3  # ... says nothing of D
    for _ in range(20):
        placer.first_token(D, 500, 0.600)
    after = placer.decide(500, P, idle(), D, idle())
    assert after.where == "disaggregated" and after.local_ms > before.local_ms * 3
    described = placer.describe()
    assert described["ttft"][D]["n"] == 20 and described["ttft"][P]["n"] == 20


def test_the_choice_not_taken_is_taken_once_in_a_while() -> None:
    placer = Placer(stall_weight=0.25)
    wheres = [placer.decide(500, P, idle(), D, idle()) for _ in range(100)]
    explored = [i for i, d in enumerate(wheres) if d.reason == "explore"]
    assert explored, "P's model is never refreshed"
    # once in a while: one decision in every `period`, neither most of them nor rarely
    period = explored[0] + 1
    assert 4 <= period <= 50
    assert explored == list(range(period - 1, len(wheres), period))
    assert all(wheres[i].where == "disaggregated" for i in explored)
    assert all(d.where == "local" for i, d in enumerate(wheres) if i not in explored)


def test_a_d_whose_decode_step_nears_the_tpot_objective_sheds_requests_to_p_whole() -> None:
    """Roles per request: D's step (its streams' mean chunk gap) at 80 % of the objective or
    more, D decoding, P decoding faster (or not at all): P serves the request whole."""
    placer = Placer(stall_weight=0.25)
    busy = EngineLoad(0, 12)
    placer.steps(D, 0.021, gaps=63)  # 21 ms per token on D: 84 % of 25 ms
    shed = placer.decide(500, P, idle(), D, busy, slo_tpot_ms=25)
    assert (shed.where, shed.reason) == ("whole-on-p", "d_decode_full")
    assert shed.whole_ms is not None and shed.whole_ms <= shed.disaggregated_ms
    # below 80 % of the objective, no objective, or D not decoding: D's roles as before
    assert placer.decide(500, P, idle(), D, busy, slo_tpot_ms=30).where != "whole-on-p"
    assert placer.decide(500, P, idle(), D, busy).where != "whole-on-p"
    assert placer.decide(500, P, idle(), D, idle(), slo_tpot_ms=25).where != "whole-on-p"
    # P decoding as slowly as D: nothing to gain
    placer.steps(P, 0.022, gaps=63)
    p_busy = EngineLoad(0, 12)
    assert placer.decide(500, P, p_busy, D, busy, slo_tpot_ms=25).where != "whole-on-p"
    # ... though P decoding faster still takes it, while it decodes no more than D
    placer.steps(P, 0.010, gaps=63)
    assert placer.decide(500, P, p_busy, D, busy, slo_tpot_ms=25).where == "whole-on-p"
    more = placer.decide(500, P, EngineLoad(0, 13), D, busy, slo_tpot_ms=25)
    assert more.reason != "d_decode_full"  # P's times per token are known only later


def test_what_ds_clients_got_per_token_decides_not_ds_own_step() -> None:
    """In the P-first flow a client's tokens after P's wait for D's catch-up too: D stepping
    at 8 ms while its clients got a token every 22 ms (a queue before D's first chunk) is a
    D whose requests miss a 25 ms objective."""
    placer = Placer(stall_weight=0.25)
    busy = EngineLoad(0, 12)
    placer.steps(D, 0.008, gaps=63, per_chunk=0.022)
    assert placer.decide(500, P, idle(), D, busy, slo_tpot_ms=25).where == "whole-on-p"
    assert placer.describe()["step_ms"][D] == pytest.approx(8, abs=0.01)  # what D steps at
    placer.steps(D, 0.008, gaps=63, per_chunk=0.009)
    assert placer.decide(500, P, idle(), D, busy, slo_tpot_ms=25).where != "whole-on-p"


def test_ps_decodes_count_against_the_prompts_it_computes() -> None:
    """A prompt P computes while P decodes (requests it serves whole) waits for P's step and
    pauses P's decodes, as on D."""
    placer = Placer(stall_weight=0.25)
    placer.steps(P, 0.010, gaps=63)
    quiet = placer.decide(500, P, idle(), D, EngineLoad(0, 4))
    decoding = placer.decide(500, P, EngineLoad(0, 4), D, EngineLoad(0, 4))
    assert decoding.disaggregated_ms > quiet.disaggregated_ms + 10


# --------------------------------------------------------------------------- in the proxy


async def placement_counts(s: object) -> dict[tuple[str, str], float]:
    m = await s.metrics()  # type: ignore[attr-defined]
    return {
        (dict(labels)["placement"], dict(labels)["reason"]): value
        for (name, labels), value in m.items()
        if name == "pdactors_proxy_placement_total"
    }


async def test_auto_serves_locally_while_d_is_idle_and_says_so() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_setup() as s:
            resp = await s.client.post("/v1/completions", json=completion_body())
            assert resp.status_code == 200
            assert resp.headers["x-pdactors-placement"] == "local"
            assert s.p[0].received == [] and len(s.d[0].received) == 1
            assert await placement_counts(s) == {("local", "d_idle"): 1}
            health = (await s.client.get("/health")).json()
            assert health["placement"]["ttft"][s.d[0].url]["n"] == 0  # a whole answer: no TTFT
            assert health["decode"][0]["waiting_tokens"] == 0


async def test_auto_hands_a_long_prompt_to_p_while_d_decodes() -> None:
    """D streams one request (its first chunk out: decoding); a long prompt then goes to P, is
    served P first, and every prompt token the proxy counted as waiting is released."""
    with trio.fail_after(TIMEOUT):
        async with open_setup() as s:
            d = s.d[0]
            steps, d.steps = trio.open_memory_channel[None](100)
            answers: dict[str, httpx.Response] = {}

            async def post(name: str, body: dict[str, object]) -> None:
                answers[name] = await s.client.post("/v1/completions", json=body)

            async def health() -> dict[str, Any]:
                return (await s.client.get("/health")).json()  # type: ignore[no-any-return]

            async with trio.open_nursery() as nursery:
                nursery.start_soon(post, "decoding", completion_body(stream=True))
                await steps.send(None)  # D's first chunk: the request now decodes on D
                while len(d.received) < 1 or (await health())["decode"][0]["waiting_tokens"]:
                    await trio.sleep(0.01)
                long = completion_body(prompt=list(range(2000)), stream=True)
                nursery.start_soon(post, "long", long)
                while len(s.p[0].received) + len(d.received) < 2:  # placed
                    await trio.sleep(0.01)
                for _ in range(10):  # the rest of both streams
                    await steps.send(None)
            assert answers["long"].status_code == 200
            assert answers["long"].headers["x-pdactors-placement"] == "disaggregated"
            assert answers["decoding"].headers["x-pdactors-placement"] == "local"
            assert len(s.p[0].received) == 1  # the long one, P first
            counts = await placement_counts(s)
            assert counts == {("local", "d_idle"): 1, ("disaggregated", "d_busy"): 1}
            report = await health()
            assert report["prefill"][0]["waiting_tokens"] == 0
            assert report["decode"][0]["waiting_tokens"] == 0
            assert report["prefill"][0]["prefills"] == report["decode"][0]["prefills"] == 0
            assert report["decode"][0]["incoming"] == 0
            assert report["placement"]["ttft"][s.p[0].url]["n"] == 1  # P's first token
            assert report["placement"]["ttft"][d.url]["n"] == 1  # D's, local


@pytest.mark.parametrize("placement", ["local", "disaggregate"])
async def test_a_pinned_placement_is_counted_as_pinned(placement: str) -> None:
    with trio.fail_after(TIMEOUT):
        async with open_setup(placement=placement) as s:
            resp = await s.client.post("/v1/completions", json=completion_body())
            assert resp.status_code == 200
            where = "local" if placement == "local" else "disaggregated"
            assert resp.headers["x-pdactors-placement"] == where
            assert await placement_counts(s) == {(where, "pinned"): 1}
            assert "placement" not in (await s.client.get("/health")).json()


async def test_a_request_header_overrides_the_placement_and_a_bad_one_is_refused() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_setup(placement="disaggregate") as s:
            body = completion_body()
            resp = await s.client.post(
                "/v1/completions", json=body, headers={"x-pdactors-placement": "local"}
            )
            assert resp.status_code == 200
            assert resp.headers["x-pdactors-placement"] == "local"
            assert s.p[0].received == []
            resp = await s.client.post(
                "/v1/completions", json=body, headers={"x-pdactors-placement": "elsewhere"}
            )
            assert resp.status_code == 400
            assert "x-pdactors-placement" in resp.json()["error"]["message"]
            assert s.p[0].received == [] and len(s.d[0].received) == 1
            resp = await s.client.post("/v1/completions", json=body)  # the operator's pin
            assert resp.headers["x-pdactors-placement"] == "disaggregated"
            assert len(s.p[0].received) == 1


@pytest.mark.parametrize("name", ["x-pdactors-slo-ttft-ms", "x-pdactors-slo-tpot-ms"])
async def test_a_requests_own_objectives_are_taken_and_a_bad_one_is_refused(name: str) -> None:
    with trio.fail_after(TIMEOUT):
        async with open_setup() as s:
            body = completion_body()
            for bad in ("fast", "-1", "inf", "nan"):
                resp = await s.client.post("/v1/completions", json=body, headers={name: bad})
                assert resp.status_code == 400 and name in resp.json()["error"]["message"]
            assert s.p[0].received == s.d[0].received == []
            resp = await s.client.post("/v1/completions", json=body, headers={name: "150.5"})
            assert resp.status_code == 200


def test_a_streams_mean_gap_counts_as_that_many_gaps() -> None:
    one_by_one, at_once = Placer(0.25), Placer(0.25)
    for placer in (one_by_one, at_once):
        placer.steps("d", 0.010)
    for _ in range(5):
        one_by_one.steps("d", 0.030)
    at_once.steps("d", 0.030, gaps=5)
    by_one, by_five = one_by_one.describe()["step_ms"]["d"], at_once.describe()["step_ms"]["d"]
    assert by_one == pytest.approx(by_five, abs=0.01)
    assert 10 < by_five < 30


# --------------------------------------------------------------------------- the TTFT objective


#: D decoding one request (not idle: the estimates decide, not the lone request's rule).
ONE = EngineLoad(waiting_tokens=0, decoding=1)


def _placer_where_d_is_cheap_but_slow_to_a_first_token() -> Placer:
    """D's first token costs 150 ms + 0.1 ms/token, P's 60 ms flat; P's catch-up is dear, so
    the weighted cost prefers D computing the prompt (local) for a 500-token prompt."""
    placer = Placer(stall_weight=1.0)
    for _ in range(60):
        for tokens in (100, 900):
            placer.first_token(D, tokens, (150 + 0.1 * tokens) / 1e3)
            placer.first_token(P, tokens, 60 / 1e3)
            placer.caught_up(D, tokens, 300 / 1e3)
    return placer


def test_the_ttft_objective_takes_the_only_placement_that_meets_it() -> None:
    placer = _placer_where_d_is_cheap_but_slow_to_a_first_token()
    plain = placer.decide(500, P, idle(), D, ONE)
    assert plain.where == "local"  # ~250 ms locally against ~60 + 300 disaggregated
    met = placer.decide(500, P, idle(), D, ONE, slo_ttft_ms=120)
    assert (met.where, met.reason) == ("disaggregated", "slo_ttft")  # P's token in ~60 ms
    # Upstream's flow: the client's first token is D's after its catch-up: neither meets it.
    upstream = Placer(stall_weight=1.0, p_first=False)
    upstream._ttft, upstream._catch_up = placer._ttft, placer._catch_up
    assert upstream.decide(500, P, idle(), D, ONE, slo_ttft_ms=120).reason != "slo_ttft"
    # Both meet a loose objective: the cheaper estimate decides, as without one.
    assert placer.decide(500, P, idle(), D, ONE, slo_ttft_ms=1000).where == "local"
    # Nothing in flight on either, in a pool: P, faster to a first token, serves it whole.
    lone = placer.decide(500, P, idle(), D, idle(), slo_ttft_ms=120, p_decodes=True)
    assert lone.where == "whole-on-p"


def test_exploring_never_breaks_the_ttft_objective() -> None:
    placer = _placer_where_d_is_cheap_but_slow_to_a_first_token()
    decisions = [placer.decide(500, P, idle(), D, ONE, slo_ttft_ms=120) for _ in range(100)]
    assert {d.where for d in decisions} == {"disaggregated"}


def test_an_overloaded_pair_serves_a_request_whole_where_it_waits_least() -> None:
    """Neither placement's first token meets the TTFT objective because of the queues (an
    idle engine would meet it): the request is served whole — by the engine with fewer
    requests in flight, or when they hold as many, where the queue is shorter — never
    disaggregated (two engines' time for one request); a prompt that misses the objective
    even on an idle engine is placed as without one."""
    placer = Placer(stall_weight=0.25)
    for _ in range(20):
        for tokens in (100, 900):
            for url in (P, D):
                placer.first_token(url, tokens, (10 + 0.1 * tokens) / 1e3)  # 60 ms for 500
    p_queued, d_queued = EngineLoad(3000, 0), EngineLoad(2000, 0)
    d_shorter = placer.decide(500, P, p_queued, D, d_queued, slo_ttft_ms=200)
    assert (d_shorter.where, d_shorter.reason) == ("local", "overloaded")
    p_shorter = placer.decide(500, P, d_queued, D, p_queued, slo_ttft_ms=200)
    assert (p_shorter.where, p_shorter.reason) == ("whole-on-p", "overloaded")
    assert p_shorter.whole_ms is not None and p_shorter.whole_ms < p_shorter.local_ms
    # Requests in flight decide before the estimates: the engine with fewer takes it.
    fewer_on_d = placer.decide(500, P, EngineLoad(2000, 0, 3), D, EngineLoad(3000, 0, 2),
                               slo_ttft_ms=200)  # fmt: skip
    assert (fewer_on_d.where, fewer_on_d.reason) == ("local", "overloaded")
    fewer_on_p = placer.decide(500, P, EngineLoad(3000, 4, 4), D, EngineLoad(2000, 6, 6),
                               slo_ttft_ms=200)  # fmt: skip
    assert (fewer_on_p.where, fewer_on_p.reason) == ("whole-on-p", "overloaded")
    # Without the objective, or with one no idle engine meets: the estimates decide.
    assert placer.decide(500, P, d_queued, D, p_queued).reason != "overloaded"
    unmeetable = placer.decide(500, P, d_queued, D, p_queued, slo_ttft_ms=50)
    assert unmeetable.reason != "overloaded" and unmeetable.where != "whole-on-p"
    # Queues short enough for one placement to meet it: that one, as before.
    met = placer.decide(500, P, idle(), D, d_queued, slo_ttft_ms=200)
    assert (met.where, met.reason) == ("disaggregated", "slo_ttft")


async def test_an_overloaded_pair_serves_the_next_request_whole_on_the_shorter_queue() -> None:
    """The shipped defaults (auto, TTFT objective 200 ms), the prior estimates (stand-ins give
    calibration nothing to fit): D holds a local prompt of 2,000 tokens and P a disaggregated
    one of 1,500, neither answered. A 500-token prompt would meet the objective on an idle
    engine (~70 ms) but on neither queue (~270 ms on D, ~220 on P): P, the shorter, serves it
    whole — an ordinary request, no transfer — and every request is answered once released."""
    with trio.fail_after(TIMEOUT):
        async with open_setup() as s:
            p, d = s.p[0], s.d[0]
            p.hold, d.hold = trio.Event(), trio.Event()
            answers: list[httpx.Response] = []

            async def post(tokens: int, pin: str | None = None) -> None:
                headers = {"x-pdactors-placement": pin} if pin else {}
                body = completion_body(prompt=list(range(tokens)), stream=True)
                answers.append(await s.client.post("/v1/completions", json=body, headers=headers))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(post, 2000, "local")
                await eventually(lambda: len(d.received) == 1)
                nursery.start_soon(post, 1500, "disaggregate")
                await eventually(lambda: len(p.received) == 1)
                nursery.start_soon(post, 500)
                await eventually(lambda: len(p.received) == 2)
                whole = p.received[1]
                assert "kv_transfer_params" not in whole and len(whole["prompt"]) == 500
                p.hold.set()
                d.hold.set()
            assert [a.status_code for a in answers] == [200] * 3
            assert sorted(a.headers["x-pdactors-placement"] for a in answers) == [
                "disaggregated", "local", "whole-on-p",
            ]  # fmt: skip
            counts = await placement_counts(s)
            assert counts == {("local", "pinned"): 1, ("disaggregated", "pinned"): 1,
                              ("whole-on-p", "overloaded"): 1}  # fmt: skip
