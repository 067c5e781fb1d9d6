"""The D-side pull table: every pull ends exactly once, with a typed end."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdactors.core.pull_table import Completed, PullEnd, PullState, PullTable, SendCancel
from pdactors.errors import DuplicateTransfer, IllegalTransition


def started(timeout: float = 10.0, tid: str = "t1") -> PullTable:
    t = PullTable(timeout=timeout)
    t.start(tid, 0.0, bootstrap_url="http://b", engine_id="p", block_ids=(1, 2))
    return t


def test_the_record_holds_the_whole_pull() -> None:
    t = started()
    pull = t.get("t1")
    assert pull is not None
    assert (pull.bootstrap_url, pull.engine_id, pull.block_ids) == ("http://b", "p", (1, 2))
    assert (pull.started, pull.deadline, pull.state) == (0.0, 10.0, PullState.LOOKING_UP)
    t.sent("t1", "tcp://p")
    assert (pull.state, pull.peers, pull.waiting) == (PullState.SENT, ("tcp://p",), {"tcp://p"})
    [done] = t.answered("t1", ok=True)
    assert isinstance(done, Completed) and done.pull is pull


def test_pull_answered_ok() -> None:
    t = started()
    assert t.sent("t1", "tcp://p") == []
    assert t.answered("t1", ok=True) == [Completed("t1", PullEnd.DELIVERED)]
    assert "t1" not in t
    assert t.answered("t1", ok=True) == []  # a late duplicate is ignored


def test_pull_answered_failed() -> None:
    t = started()
    t.sent("t1", "tcp://p")
    [done] = t.answered("t1", ok=False, reason="no")
    assert done == Completed("t1", PullEnd.REFUSED, "no") and not done.ok


def test_answer_from_another_peer_is_ignored() -> None:
    t = started()
    t.sent("t1", "tcp://p")
    assert t.answered("t1", ok=True, peer="tcp://other") == []
    assert t.answered("t1", ok=True, peer="tcp://p") == [Completed("t1", PullEnd.DELIVERED)]


def test_deadline_after_send_cancels_at_p() -> None:
    t = started()
    t.sent("t1", "tcp://p")
    assert t.next_deadline() == 10.0
    assert t.tick(9.9) == []
    reason = "no answer from a live P within the pull deadline (10 s)"
    assert t.tick(10.0) == [
        Completed("t1", PullEnd.DEADLINE, reason),
        SendCancel("tcp://p", "t1", reason),
    ]
    assert t.next_deadline() == float("inf")


def test_deadline_while_looking_up_sends_no_cancel() -> None:
    t = started(timeout=1.0)
    [done] = t.tick(1.0)
    assert done.end is PullEnd.DEADLINE


def test_abort_before_send_then_send_cancels() -> None:
    t = started()
    assert t.abort("t1") == [Completed("t1", PullEnd.ABORTED, "aborted by D")]
    # the request went out anyway (it was in the socket already): tell P at once
    assert t.sent("t1", "tcp://p") == [SendCancel("tcp://p", "t1", "pull ended before it was sent")]


def test_abort_after_send_waits_for_p_to_confirm() -> None:
    t = started()
    t.sent("t1", "tcp://p")
    assert t.abort("t1", "client went away") == [SendCancel("tcp://p", "t1", "client went away")]
    assert t.state("t1") is PullState.ABORTING
    assert t.abort("t1") == []  # once is enough
    # P's write landed after all: D still reports the abort, and may now reuse its blocks
    assert t.answered("t1", ok=True) == [Completed("t1", PullEnd.ABORTED, "client went away")]
    assert "t1" not in t


def test_abort_unconfirmed_ends_at_the_deadline() -> None:
    t = started()
    t.sent("t1", "tcp://p")
    t.abort("t1", "bye")
    assert t.tick(10.0) == [Completed("t1", PullEnd.ABORTED, "bye; P did not confirm within 10 s")]


def test_peer_lost_ends_every_pull_sent_there_and_frees_aborting_ones_at_once() -> None:
    t = PullTable(timeout=10.0)
    for tid in ("a", "b", "c", "d"):
        t.start(tid, 0.0)
    t.sent("a", "tcp://p")
    t.sent("b", "tcp://p")
    t.sent("c", "tcp://q")  # another P worker: untouched
    t.abort("b", "client went away")
    assert t.on_peer("tcp://p") == ["a", "b"]
    effects = t.peer_lost("tcp://p", "P gone: closed")
    assert effects == [
        Completed("a", PullEnd.P_GONE, "P gone: closed"),
        Completed("b", PullEnd.ABORTED, "client went away; P gone: closed"),
    ]
    assert set(t._pulls) == {"c", "d"}
    assert PullEnd.P_GONE.p_may_have_moved and not PullEnd.REFUSED.p_may_have_moved


def test_local_failure_ends_pull() -> None:
    t = started()
    assert t.fail("t1", "no bootstrap") == [Completed("t1", PullEnd.UNREACHABLE, "no bootstrap")]


def test_a_duplicate_is_refused_and_the_pull_in_flight_is_untouched() -> None:
    t = started()
    t.sent("t1", "tcp://p")
    first = t.get("t1")
    with pytest.raises(DuplicateTransfer, match="already in flight"):
        t.start("t1", 5.0, engine_id="other")
    assert t.get("t1") is first and first is not None and first.engine_id == "p"
    assert t.answered("t1", ok=True) == [Completed("t1", PullEnd.DELIVERED)]


def test_illegal_transitions() -> None:
    t = started()
    with pytest.raises(IllegalTransition):
        t.start("t1", 0.0)
    t.sent("t1", "tcp://p")
    with pytest.raises(IllegalTransition):
        t.sent("t1", "tcp://p")


def test_answer_before_send_recorded_is_ignored() -> None:
    t = started()
    assert t.answered("t1", ok=True) == []
    assert t.state("t1") is PullState.LOOKING_UP


_KINDS = "sent sent2 ok no fail abort lost tick writing confirmed dead".split()
_EVENTS = st.lists(
    st.tuples(
        st.sampled_from(_KINDS),
        st.sampled_from(["t1", "t2", "t3"]),
        st.sampled_from(["tcp://p", "tcp://q"]),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(_EVENTS)
def test_every_pull_ends_exactly_once_whatever_happens(events: list[tuple[str, str, str]]) -> None:
    """Pulls to one or two P workers: each ends exactly once, and never while a P worker it
    went to may still write (not answered, not lost, not fenced), except at its deadline or,
    fenced, at its fence timeout; a pull ever fenced is never delivered."""
    t = PullTable(timeout=5.0, fence_timeout=3.0)
    ends: list[str] = []
    fenced: set[str] = set()
    for tid in ("t1", "t2", "t3"):
        t.start(tid, 0.0)
    now = 0.0
    for kind, tid, peer in events:
        effects = []
        pull = t.get(tid)
        if kind in ("sent", "sent2") and t.state(tid) is PullState.LOOKING_UP:
            effects = t.sent(tid, peer if kind == "sent" else ("tcp://p", "tcp://q"))
        elif kind in ("ok", "no"):
            effects = t.answered(tid, ok=kind == "ok", peer=peer)
        elif kind == "fail":
            effects = t.fail(tid, "x", peer=peer if pull and len(pull.peers) > 1 else None)
        elif kind == "abort":
            effects = t.abort(tid)
        elif kind == "lost":
            effects = t.peer_lost(peer, "gone", now)
        elif kind == "writing":
            effects = t.writing(tid, peer)
        elif kind == "confirmed":
            effects = t.fenced(peer, tid, "confirmed")
        elif kind == "dead":
            effects = t.fenced(peer, None, "dead")
        elif kind == "tick":
            now += 2.0
            effects = t.tick(now)
        fenced.update(t.fenced_pulls())
        for e in effects:
            if isinstance(e, Completed):
                ends.append(e.transfer_id)
                assert e.pull is not None and not e.pull.fencing, e
                at_risk = "late write" in e.reason
                assert not e.pull.waiting or now >= e.pull.deadline or at_risk, e
                assert not (e.ok and e.transfer_id in fenced), e
    ends += [e.transfer_id for e in t.tick(1e9) if isinstance(e, Completed)]
    assert sorted(ends) == ["t1", "t2", "t3"]
    assert len(t) == 0


# --------------------------------------------------------------------------- several P workers


def test_a_pull_from_two_p_workers_is_delivered_when_both_answered() -> None:
    t = started()
    assert t.sent("t1", ("tcp://p0", "tcp://p1")) == []
    assert t.on_peer("tcp://p1") == ["t1"]
    assert t.answered("t1", ok=True, peer="tcp://p0") == []
    assert t.answered("t1", ok=True, peer="tcp://p0") == []  # twice: ignored
    assert t.on_peer("tcp://p0") == []
    assert t.answered("t1", ok=True, peer="tcp://p1") == [Completed("t1", PullEnd.DELIVERED)]
    with pytest.raises(ValueError, match="distinct"):
        started().sent("t1", ("tcp://p", "tcp://p"))


def test_one_refusal_stops_the_other_p_worker_and_ends_once_it_answered() -> None:
    t = started()
    t.sent("t1", ("tcp://p0", "tcp://p1"))
    with pytest.raises(ValueError, match="say which"):
        t.answered("t1", ok=True)
    # P1 refuses while P0 may be writing into D's blocks: stop P0, end when it says so
    assert t.answered("t1", ok=False, reason="bad", peer="tcp://p1") == [
        SendCancel("tcp://p0", "t1", "bad")
    ]
    assert t.state("t1") is PullState.ABORTING
    assert t.answered("t1", ok=True, peer="tcp://p0") == [Completed("t1", PullEnd.REFUSED, "bad")]


def test_a_lost_p_worker_fails_the_pull_once_the_others_are_done() -> None:
    t = started()
    t.sent("t1", ("tcp://p0", "tcp://p1"))
    assert t.peer_lost("tcp://p0", "P gone: closed") == [
        SendCancel("tcp://p1", "t1", "P gone: closed")
    ]
    assert t.peer_lost("tcp://p1", "P gone: closed") == [
        Completed("t1", PullEnd.P_GONE, "P gone: closed")
    ]


def test_abort_of_a_pull_from_two_p_workers_cancels_both_and_waits_for_both() -> None:
    t = started()
    t.sent("t1", ("tcp://p0", "tcp://p1"))
    assert t.abort("t1", "bye") == [
        SendCancel("tcp://p0", "t1", "bye"),
        SendCancel("tcp://p1", "t1", "bye"),
    ]
    assert t.answered("t1", ok=False, reason="cancelled", peer="tcp://p1") == []
    assert t.answered("t1", ok=True, peer="tcp://p0") == [Completed("t1", PullEnd.ABORTED, "bye")]


def test_deadline_cancels_only_the_p_workers_that_did_not_answer() -> None:
    t = started()
    t.sent("t1", ("tcp://p0", "tcp://p1"))
    t.answered("t1", ok=True, peer="tcp://p0")
    reason = "no answer from a live P within the pull deadline (10 s)"
    assert t.tick(10.0) == [
        Completed("t1", PullEnd.DEADLINE, reason),
        SendCancel("tcp://p1", "t1", reason),
    ]


def test_a_pull_counts_what_its_landed_parts_wrote() -> None:
    t = started()
    t.sent("t1", ("tcp://p0", "tcp://p1"))
    assert t.answered("t1", ok=True, peer="tcp://p0", nbytes=100) == []
    [done] = t.answered("t1", ok=True, peer="tcp://p1", nbytes=28)
    assert isinstance(done, Completed) and done.pull is not None and done.pull.nbytes == 128
    t = started()
    t.sent("t1", ("tcp://p0", "tcp://p1"))
    t.answered("t1", ok=False, reason="bad", peer="tcp://p1", nbytes=7)  # a refusal wrote nothing
    [done] = t.answered("t1", ok=True, peer="tcp://p0", nbytes=100)
    assert isinstance(done, Completed) and done.end is PullEnd.REFUSED
    assert done.pull is not None and done.pull.nbytes == 100


def test_the_next_deadline_is_the_earliest_pull_in_flight() -> None:
    assert PullTable(timeout=10.0).next_deadline() == float("inf")
    t = started(timeout=10.0)
    t.start("t2", 5.0)
    assert t.next_deadline() == 10.0
    t.fail("t1", "unreachable")
    assert t.next_deadline() == 15.0
