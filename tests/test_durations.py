"""The frozen duration records the actors return instead of deques readers drain."""

from __future__ import annotations

from pdactors.actors._durations import RECENT, Durations, DurationStatistics


def test_a_record_is_frozen_and_later_adds_do_not_change_it() -> None:
    durations = Durations()
    durations.add(0.5)
    first = durations.statistics()
    durations.add(0.25)
    assert first == DurationStatistics(1, (0.5,))
    assert durations.statistics() == DurationStatistics(2, (0.5, 0.25))


def test_since_gives_what_is_new_since_a_count() -> None:
    durations = Durations()
    for s in (1.0, 2.0, 3.0):
        durations.add(s)
    stats = durations.statistics()
    assert stats.since(0) == (1.0, 2.0, 3.0)
    assert stats.since(2) == (3.0,)
    assert stats.since(3) == ()


def test_the_count_goes_on_past_the_recent_bound() -> None:
    durations = Durations()
    for i in range(RECENT + 10):
        durations.add(float(i))
    stats = durations.statistics()
    assert stats.count == RECENT + 10
    assert len(stats.recent) == RECENT
    assert stats.since(0) == stats.recent  # a reader far behind gets what is still held
    assert stats.since(RECENT + 8) == (float(RECENT + 8), float(RECENT + 9))
