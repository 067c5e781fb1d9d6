"""The worker's cross-thread mailbox, synchronously: work held until applied (and handed back
when the actors go down), results taken once, a waiting take woken by a result."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("vllm")

from pdactors_vllm.mailbox import Mailbox, StepWork
from pdactors_vllm.metadata import PullSpec, SendSpec

pytestmark = pytest.mark.vllm


def test_work_held_until_applied_is_handed_back_when_the_actors_go_down() -> None:
    mailbox = Mailbox()
    applied, lost = StepWork(pending=["t1"]), StepWork(ready={"p": SendSpec("t2", ((1,),))})
    assert mailbox.hold(applied) is None and mailbox.hold(lost) is None
    mailbox.applied(applied)
    assert mailbox.set_down("the thread died") == [lost]
    assert mailbox.down == "the thread died"
    assert mailbox.hold(StepWork()) == "the thread died"  # not held: the caller fails it
    assert mailbox.set_down(None) == [] and mailbox.down is None


def test_releases_free_sends_and_fail_pulls_but_not_notices() -> None:
    work = StepWork(
        ready={"p1": SendSpec("t1", ((1,),))},
        streams={"p2": SendSpec("t2", ((2,),))},
        pulls={
            "d1": PullSpec("t3", "e", "http://b", ((3,),)),
            "d2": PullSpec("t4", "e", "http://b", (), notify_only=True),
        },
    )
    assert work.releases() == ({"p1", "p2"}, {"d1"})


def test_results_are_taken_once_with_failed_pulls_finished_too() -> None:
    mailbox = Mailbox()
    mailbox.add(sent={"p1"}, recved={"d1"}, failed={"d2"})
    assert mailbox.take() == ({"p1"}, {"d1", "d2"}, {"d2"})
    assert mailbox.take() == (set(), set(), set())


def test_a_waiting_take_returns_when_a_result_arrives() -> None:
    mailbox = Mailbox()
    taken: list[tuple[set[str], set[str], set[str]]] = []
    taker = threading.Thread(target=lambda: taken.append(mailbox.take(wait=60)))
    taker.start()
    mailbox.add(sent={"p1"})
    taker.join(30)
    assert not taker.is_alive() and taken == [({"p1"}, set(), set())]


def test_counters_are_counted_and_taken_once() -> None:
    mailbox = Mailbox()

    def one_eager(counters: object) -> None:
        counters.eager_sent += 1  # type: ignore[attr-defined]

    mailbox.count(one_eager)
    mailbox.add(count=one_eager)
    assert mailbox.take_counters()["eager_sent"] == 2
    assert mailbox.take_counters()["eager_sent"] == 0
