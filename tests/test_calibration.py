"""Each engine is calibrated as it enters the rotation: the placement's first decisions are
made on what the engines took for a few probe requests, not on the prior (issue 39).

Against the counting engines of tests/test_migration.py (real HTTP servers answering like
vLLM), the proxy with its shipped defaults."""

from __future__ import annotations

import trio

from pdactors.proxy._calibrate import PROBE_TOKENS, REPEATS
from tests.test_migration import TIMEOUT, open_counting
from tests.test_placement import placement_counts


async def test_every_engine_is_probed_before_it_serves_and_the_placer_starts_from_it() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_counting(n_p=1, n_d=2, calibrate=True) as s:
            _, report = await s.health()  # every engine in rotation: each was calibrated
            for engine in s.p + s.d:
                probes = engine.received
                assert len(probes) == 1 + REPEATS * len(PROBE_TOKENS)  # a warm-up, then each length
                assert all(p["stream"] and p["stream_options"]["include_usage"] for p in probes)
                assert len({p["prompt"].split()[0] + p["prompt"] for p in probes}) == len(probes)
                learnt = report["placement"]["ttft"][engine.url]
                assert learnt["n"] == len(PROBE_TOKENS)  # the warm-up is not learnt
                assert report["placement"]["step_ms"][engine.url] >= 0


async def test_of_a_lengths_probes_the_faster_is_learnt() -> None:
    """Each engine's first probe of each length meets other work (0.2 s more to its first
    token), its second does not: what the placer starts from is the quick ones'."""
    slow_first = [0.0] + [0.2, 0.0] * len(PROBE_TOKENS)  # the warm-up, then each length
    with trio.fail_after(TIMEOUT):
        async with open_counting(calibrate=True, first_pause=(slow_first, slow_first)) as s:
            _, report = await s.health()
            for engine in s.p + s.d:
                learnt = report["placement"]["ttft"][engine.url]
                assert learnt["n"] == len(PROBE_TOKENS)
                assert learnt["a_ms"] < 50, learnt  # learnt from the slow ones: ~140 ms


async def test_an_engine_whose_probes_fail_still_enters_the_rotation() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_counting(calibrate=True, models=404) as s:
            _, report = await s.health()
            assert all(e["up"] for e in report["prefill"] + report["decode"])
            assert all(not e.received for e in s.p + s.d)  # nothing but /v1/models was asked
            assert report["placement"]["ttft"] == {}


async def test_a_pinned_placement_is_not_calibrated() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_counting(calibrate=True, placement="disaggregate") as s:
            assert all(not e.received for e in s.p + s.d)


async def test_a_lone_request_in_a_pool_goes_whole_to_the_engine_calibrated_faster() -> None:
    """Two engines of every role behind the proxy's shipped defaults; e1 takes 80 ms longer to
    a first token than e0. From the first one on, each lone request (one at a time), whichever
    engine the routing names its D, is served whole by e0: by e0 as D (``local``), or by e0
    as its P (``whole-on-p``, reason ``p_faster``) — what the calibration told the placer."""
    body = {"model": "tiny", "prompt": list(range(1, 40)), "max_tokens": 3, "stream": True}
    with trio.fail_after(TIMEOUT):
        async with open_counting(0, 0, n_both=2, calibrate=True, first_pause=(0.0, 0.08)) as s:
            fast, slow = s.both
            probed = len(fast.received), len(slow.received)
            for _ in range(4):
                resp = await s.client.post("/v1/completions", json=body)
                assert resp.status_code == 200, resp.text
                while any(e["outstanding"] for e in (await s.health())[1]["decode"]):
                    await trio.sleep(0.01)  # the stream's end counted: the next one is lone
            assert (len(fast.received) - probed[0], len(slow.received) - probed[1]) == (4, 0)
            assert all("kv_transfer_params" not in b for b in fast.received[probed[0] :])
            counts = await placement_counts(s)
            assert set(counts) == {("local", "d_idle"), ("whole-on-p", "p_faster")}, counts
            assert sum(counts.values()) == 4
