"""Engine epochs, pure: fresh epochs, the D sessions P remembers, P's refusal of another
life's pull, the send table's fences (a restarted D session, an unreachable P) and D's
refusal to take an answer from another life of P. Plain synchronous tests."""

from __future__ import annotations

from pdactors.core.epochs import SessionEpochs, Verdict, new_epoch, p_refusal
from pdactors.core.pull_table import PullEnd, PullTable
from pdactors.core.send_rules import TRANSITIONS, SendEvent, SendState
from pdactors.core.send_table import Release, Reply, SendTable
from pdactors.wire import PullDone, PullFailed, PullRequest

D1, D2 = 111, 222


def pull(tid: str, session: str = "d:1", d_epoch: int = D1, tp_rank: int = 0) -> PullRequest:
    return PullRequest(tid, session, tp_rank, 1, 0, 1, ((1, 2),), "lay", d_epoch=d_epoch)


def table() -> SendTable:
    return SendTable(ready_timeout=480, unclaimed_ttl=120, tombstone_ttl=60)


def test_epochs_are_nonzero_63_bit_and_differ() -> None:
    epochs = {new_epoch() for _ in range(1000)}
    assert len(epochs) == 1000 and all(0 < e < 2**63 for e in epochs)


def test_p_refuses_only_a_pull_that_names_another_of_its_lives() -> None:
    assert p_refusal(5, 5) is None and p_refusal(5, 0) is None and p_refusal(0, 7) is None
    assert (
        p_refusal(5, 7) == "pull meant for another life of this P worker (epoch 7; this one is 5)"
    )


def test_session_epochs_say_current_restarted_superseded() -> None:
    seen = SessionEpochs(max_sessions=2, max_past=2)
    assert seen.judge("a", D1).verdict is Verdict.CURRENT  # first heard of
    assert seen.judge("a", D1).verdict is Verdict.CURRENT
    assert seen.judge("a", 0).verdict is Verdict.CURRENT  # not said: accepted, not recorded
    restarted = seen.judge("a", D2)
    assert restarted.verdict is Verdict.RESTARTED and restarted.other == D1
    old = seen.judge("a", D1)
    assert old.verdict is Verdict.SUPERSEDED and old.other == D2
    assert "earlier life of D session 'a'" in old.reason("a", D1)
    assert seen.judge("b", 9).verdict is Verdict.CURRENT  # another session is its own
    # bounded: a third session forgets the least recently heard, which is then new again
    seen.judge("c", 1)
    assert len(seen) == 2
    assert seen.judge("a", D1).verdict is Verdict.CURRENT


def test_the_session_heard_least_recently_is_forgotten_with_its_past_epochs() -> None:
    seen = SessionEpochs(max_sessions=2, max_past=2)
    seen.judge("a", 1)
    seen.judge("a", 2)  # a restarted: 1 is its past
    seen.judge("b", 1)
    assert seen.judge("a", 2).verdict is Verdict.CURRENT  # a heard again: b is now the oldest
    seen.judge("c", 1)  # forgets b
    assert seen.judge("b", 2).verdict is Verdict.CURRENT  # new again, not a restart; forgets a
    assert seen.judge("a", 2).verdict is Verdict.CURRENT  # new again
    # a's past went with it: its old epoch is a restart now, never refused as superseded
    assert seen.judge("a", 1).verdict is Verdict.RESTARTED


def test_a_restarted_d_session_ends_its_earlier_lifes_waiting_pulls_and_nothing_else() -> None:
    t = table()
    t.prefill_started("old", 0.0)
    t.prefill_started("other", 0.0)
    assert t.pull_arrived("old", b"d-old", pull("old"), 1.0) == []
    assert t.pull_arrived("other", b"e", pull("other", session="d:2"), 1.0) == []
    effects = t.session_restarted("d:1", D2, 2.0, "D restarted")
    assert effects == [Reply(b"d-old", PullFailed("old", "D restarted"))]
    assert t.state("old") is SendState.CANCELLED and t.state("other") is SendState.PENDING
    # P's KV comes late: released at once, never written (no StartSend)
    assert t.prefill_ready("old", ((5, 6),), 3.0) == [Release("old", SendState.CANCELLED)]
    # a pull of the new life for the same session waits as usual
    t.prefill_started("new", 3.0)
    assert t.pull_arrived("new", b"d-new", pull("new", d_epoch=D2), 3.0) == []
    assert t.session_restarted("d:1", D2, 4.0, "again") == []  # nothing of another life left


def test_a_restart_ends_the_transfer_for_every_d_worker_waiting_on_it() -> None:
    t = table()
    t.prefill_started("x", 0.0)
    t.pull_arrived("x", b"a", pull("x", tp_rank=0), 0.0, expected=2)
    t.pull_arrived("x", b"b", pull("x", session="d:2", tp_rank=1), 0.0, expected=2)
    effects = t.session_restarted("d:1", D2, 1.0, "D restarted")
    assert {e.identity for e in effects if isinstance(e, Reply)} == {b"a", b"b"}
    assert t.state("x") is SendState.CANCELLED


def test_unreachable_releases_every_ready_transfer_no_d_pulled_at_once() -> None:
    t = table()
    t.prefill_ready("ready", ((1,),), 0.0)
    t.prefill_started("pending", 0.0)
    t.prefill_ready("half", ((2,),), 0.0)  # one of its two D pullers was served
    t.pull_arrived("half", b"a", pull("half"), 0.0, expected=2)
    t.send_finished("half", 0.5)
    assert t.state("half") is SendState.READY
    effects = t.unreachable(1.0, "no D can find P")
    assert effects == [Release("ready", SendState.EXPIRED)]  # long before unclaimed_ttl
    late = t.pull_arrived("ready", b"d", pull("ready"), 2.0)
    assert late == [Reply(b"d", PullFailed("ready", "no D can find P"))]
    assert t.state("pending") is SendState.PENDING and t.state("half") is SendState.READY
    assert t.statistics().expired == 1


def test_unreachable_is_a_legal_move_only_from_ready() -> None:
    moves = {s: TRANSITIONS.get((s, SendEvent.UNREACHABLE)) for s in (None, *SendState)}
    assert {s: m for s, m in moves.items() if m is not None} == {
        SendState.READY: (SendState.EXPIRED, moves[SendState.READY][1])  # type: ignore[index]
    }


def test_d_ignores_an_answer_from_another_life_of_p_but_takes_its_refusal_to_serve() -> None:
    t = PullTable(timeout=540)
    t.start("t", 0.0)
    t.sent("t", ["p:1"], pull("t"), epochs=[7])
    record = t.get("t")
    assert record is not None and record.p_epochs == {"p:1": 7}
    assert record.from_other_life("p:1", 8) and not record.from_other_life("p:1", 7)
    assert not record.from_other_life("p:1", 0)  # P did not say
    assert t.answered("t", ok=True, peer="p:1", epoch=8) == []  # never D's KV
    assert t.answered("t", ok=False, reason="x", peer="p:1", epoch=8) == []
    assert "t" in t
    (done,) = t.answered("t", ok=False, reason="other life", peer="p:1", epoch=8, lookup_again=True)
    assert done.end is PullEnd.REFUSED and done.reason == "other life"
    t.start("u", 1.0)
    t.sent("u", ["p:1"], pull("u"), epochs=[7])
    (ok,) = t.answered("u", ok=True, peer="p:1", epoch=7)
    assert ok.end is PullEnd.DELIVERED


def test_a_pull_sent_without_knowing_ps_epoch_takes_any_answer() -> None:
    t = PullTable(timeout=540)
    t.start("t", 0.0)
    t.sent("t", "p:1", pull("t"))
    (done,) = t.answered("t", ok=True, epoch=123)
    assert done.ok
    assert isinstance(PullDone("t", epoch=5).epoch, int)
