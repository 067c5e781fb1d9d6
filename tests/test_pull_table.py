"""The D-side pull table: every pull ends exactly once."""

from __future__ import annotations

import pytest

from pdactors.core.pull_table import Completed, PullState, PullTable, SendCancel
from pdactors.errors import IllegalTransition


def test_pull_answered_ok() -> None:
    t = PullTable(timeout=10.0)
    t.start("t1", 0.0)
    assert t.state("t1") is PullState.LOOKING_UP
    assert t.sent("t1", "tcp://p") == []
    assert t.state("t1") is PullState.SENT
    assert t.answered("t1", ok=True) == [Completed("t1", True)]
    assert "t1" not in t
    assert t.answered("t1", ok=True) == []  # a late duplicate is ignored


def test_pull_answered_failed() -> None:
    t = PullTable(timeout=10.0)
    t.start("t1", 0.0)
    t.sent("t1", "tcp://p")
    assert t.answered("t1", ok=False, reason="no") == [Completed("t1", False, "no")]


def test_timeout_after_send_cancels_at_p() -> None:
    t = PullTable(timeout=10.0)
    t.start("t1", 0.0)
    t.sent("t1", "tcp://p")
    assert t.next_deadline() == 10.0
    assert t.tick(9.9) == []
    effects = t.tick(10.0)
    assert effects == [
        Completed("t1", False, "timed out after 10 s"),
        SendCancel("tcp://p", "t1", "timed out after 10 s"),
    ]
    assert t.next_deadline() == float("inf")


def test_timeout_while_looking_up_sends_no_cancel() -> None:
    t = PullTable(timeout=1.0)
    t.start("t1", 0.0)
    assert t.tick(1.0) == [Completed("t1", False, "timed out after 1 s")]


def test_abort_before_send_then_send_cancels() -> None:
    t = PullTable(timeout=10.0)
    t.start("t1", 0.0)
    assert t.abort("t1") == [Completed("t1", False, "aborted by D")]
    # the request went out anyway (it was in the socket already): tell P at once
    assert t.sent("t1", "tcp://p") == [SendCancel("tcp://p", "t1", "pull ended before it was sent")]


def test_abort_after_send_waits_for_p_to_confirm() -> None:
    t = PullTable(timeout=10.0)
    t.start("t1", 0.0)
    t.sent("t1", "tcp://p")
    assert t.abort("t1", "client went away") == [SendCancel("tcp://p", "t1", "client went away")]
    assert t.state("t1") is PullState.ABORTING
    assert t.abort("t1") == []  # once is enough
    # P's write landed after all: D still reports the abort, and may now reuse its blocks
    assert t.answered("t1", ok=True) == [Completed("t1", False, "client went away")]
    assert "t1" not in t


def test_abort_unconfirmed_ends_at_the_deadline() -> None:
    t = PullTable(timeout=10.0)
    t.start("t1", 0.0)
    t.sent("t1", "tcp://p")
    t.abort("t1", "bye")
    assert t.tick(10.0) == [Completed("t1", False, "bye; P did not confirm within 10 s")]


def test_local_failure_ends_pull() -> None:
    t = PullTable(timeout=10.0)
    t.start("t1", 0.0)
    assert t.fail("t1", "no bootstrap") == [Completed("t1", False, "no bootstrap")]


def test_illegal_transitions() -> None:
    t = PullTable(timeout=10.0)
    t.start("t1", 0.0)
    with pytest.raises(IllegalTransition):
        t.start("t1", 0.0)
    t.sent("t1", "tcp://p")
    with pytest.raises(IllegalTransition):
        t.sent("t1", "tcp://p")


def test_answer_before_send_recorded_is_ignored() -> None:
    t = PullTable(timeout=10.0)
    t.start("t1", 0.0)
    assert t.answered("t1", ok=True) == []
    assert t.state("t1") is PullState.LOOKING_UP
