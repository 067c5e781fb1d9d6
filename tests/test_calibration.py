"""Each engine is calibrated as it enters the rotation: the placement's first decisions are
made on what the engines took for a few probe requests, not on the prior (issue 39).

Against the counting engines of tests/test_migration.py (real HTTP servers answering like
vLLM), the proxy with its shipped defaults."""

from __future__ import annotations

import trio

from pdactors.proxy._calibrate import PROBE_TOKENS
from tests.test_migration import TIMEOUT, open_counting


async def test_every_engine_is_probed_before_it_serves_and_the_placer_starts_from_it() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_counting(n_p=1, n_d=2, calibrate=True) as s:
            _, report = await s.health()  # every engine in rotation: each was calibrated
            for engine in s.p + s.d:
                probes = engine.received
                assert len(probes) == 1 + len(PROBE_TOKENS)  # a warm-up, then one a length
                assert all(p["stream"] and p["stream_options"]["include_usage"] for p in probes)
                assert len({p["prompt"].split()[0] + p["prompt"] for p in probes}) == len(probes)
                learnt = report["placement"]["ttft"][engine.url]
                assert learnt["n"] == len(PROBE_TOKENS)  # the warm-up is not learnt
                assert report["placement"]["step_ms"][engine.url] >= 0


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
