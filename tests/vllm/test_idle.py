"""Quiet waits (pdactors_vllm.idle): a busy wait spins only at first, then naps a share of the
time it has waited; each new wait starts spinning again. A fake clock stands in for time."""

from __future__ import annotations

import pytest

from pdactors_vllm import idle


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.naps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.naps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(idle.time, "monotonic", c.monotonic)
    monkeypatch.setattr(idle.time, "sleep", c.sleep)
    monkeypatch.setattr(idle._waits, "last", 0.0, raising=False)
    return c


def spin(clock: Clock, seconds: float, step: float = 1e-6) -> list[str]:
    """Call the busy nap until ``seconds`` of the fake clock have passed: what each call did."""
    did: list[str] = []

    def original() -> None:  # vLLM's sched_yield: a microsecond of spinning
        did.append("spin")
        clock.now += step

    end = clock.now + seconds
    while clock.now < end:
        naps = len(clock.naps)
        idle._busy_nap(original)
        if len(clock.naps) > naps:
            did.append("nap")
    return did


def test_a_wait_spins_first_then_naps_a_share_of_what_it_waited(clock: Clock) -> None:
    did = spin(clock, 0.050)  # a 50 ms forward pass
    spins = did.index("nap")
    assert spins == pytest.approx(idle.SPIN_S / 1e-6, rel=0.05)  # 0.2 ms of spinning
    assert set(did[spins:]) == {"nap"}  # then naps only
    assert max(clock.naps) == idle.NAP  # capped
    # each nap is at most NAP_SHARE of the time waited before it: late by at most that much
    waited = idle.SPIN_S
    for nap in clock.naps:
        assert nap <= idle.NAP_SHARE * waited * 1.01
        waited += nap
    assert len(clock.naps) < 200  # ~60 growing naps, then ~100 of 0.5 ms: not ~50,000 spins


def test_each_new_wait_spins_again(clock: Clock) -> None:
    spin(clock, 0.010)
    clock.now += 0.005  # the answer came; the process worked 5 ms before its next wait
    assert spin(clock, 0.0001)[:3] == ["spin"] * 3
