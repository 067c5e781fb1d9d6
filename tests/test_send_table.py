"""The P-side rendezvous table: plain synchronous tests of every transition."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdactors.core.send_table import Effect, Release, Reply, SendState, SendTable, StartSend
from pdactors.errors import IllegalTransition
from pdactors.wire import PullDone, PullFailed, PullRequest

D = b"d-worker"
D2 = b"d-worker-rank-1"


def pull(tid: str = "t1", blocks: tuple[int, ...] = (5, 6), d_rank: int = 0) -> PullRequest:
    return PullRequest(tid, "127.0.0.1:1", d_rank, 1 + d_rank, 0, 1, (blocks,), "layout")


def table() -> SendTable:
    return SendTable(ready_timeout=5.0, unclaimed_ttl=30.0, tombstone_ttl=60.0)


def test_ready_then_pull_starts_send_then_done_replies_and_releases() -> None:
    t = table()
    assert t.prefill_started("t1", 0.0) == []
    assert t.prefill_ready("t1", (1, 2), 1.0) == []
    assert t.state("t1") is SendState.READY
    p = pull()
    assert t.pull_arrived("t1", D, p, 2.0) == [StartSend("t1", p, (1, 2), identity=D)]
    assert t.state("t1") is SendState.SENDING
    effects = t.send_finished("t1", 3.0, nbytes=10, descriptors=1)
    assert effects == [Reply(D, PullDone("t1", 10, 1)), Release("t1", SendState.DONE)]
    assert t.statistics().sent == 1


def test_pull_before_prefill_waits_then_starts_when_ready() -> None:
    t = table()
    p = pull()
    assert t.pull_arrived("t1", D, p, 0.0) == []
    assert t.state("t1") is SendState.PENDING
    assert t.prefill_started("t1", 0.5) == []
    assert t.prefill_ready("t1", (3,), 1.0) == [StartSend("t1", p, (3,), identity=D)]


def test_streaming_with_a_waiting_pull_starts_a_streamed_send() -> None:
    t = table()
    p = pull()
    t.prefill_started("t1", 0.0)
    t.pull_arrived("t1", D, p, 0.1)
    assert t.prefill_streaming("t1", (3, 4), 0.2) == [
        StartSend("t1", p, (3, 4), streamed=True, identity=D)
    ]
    assert t.state("t1") is SendState.SENDING
    # a cancel waits for the write, which ends once P is done
    assert t.pull_cancelled("t1", D, 0.3) == []
    effects = t.send_finished("t1", 0.4, nbytes=8, descriptors=2)
    assert effects == [Reply(D, PullDone("t1", 8, 2)), Release("t1", SendState.DONE)]


def test_streaming_without_a_pull_changes_nothing_and_ready_sends_as_usual() -> None:
    t = table()
    t.prefill_started("t1", 0.0)
    assert t.prefill_streaming("t1", (3,), 0.1) == []
    assert t.state("t1") is SendState.PENDING
    assert t.prefill_ready("t1", (3,), 0.2) == []
    p = pull()
    assert t.pull_arrived("t1", D, p, 0.3) == [StartSend("t1", p, (3,), identity=D)]


def test_streaming_after_the_end_or_after_ready_changes_nothing() -> None:
    t = table()
    t.prefill_ready("t1", (1,), 0.0)
    assert t.prefill_streaming("t1", (1,), 0.1) == []
    assert t.state("t1") is SendState.READY
    t.prefill_dropped("t2", 0.0)
    assert t.prefill_streaming("t2", (1,), 0.1) == []
    assert t.state("t2") is SendState.DROPPED


def test_failed_send_replies_failure_and_still_releases() -> None:
    t = table()
    t.prefill_ready("t1", (1,), 0.0)
    t.pull_arrived("t1", D, pull(), 0.0)
    effects = t.send_finished("t1", 1.0, error="boom")
    assert effects == [Reply(D, PullFailed("t1", "boom")), Release("t1", SendState.FAILED)]


def test_dropped_prefill_answers_waiting_pull_at_once() -> None:
    t = table()
    t.prefill_started("t1", 0.0)
    t.pull_arrived("t1", D, pull(), 0.1)
    effects = t.prefill_dropped("t1", 0.2, "aborted")
    assert effects == [
        Reply(D, PullFailed("t1", "P dropped the request (aborted or failed): aborted"))
    ]
    assert t.state("t1") is SendState.DROPPED


def test_pull_after_drop_is_answered_from_the_tombstone() -> None:
    t = table()
    assert t.prefill_dropped("t1", 0.0) == []
    (reply,) = t.pull_arrived("t1", D, pull(), 1.0)
    assert isinstance(reply, Reply) and isinstance(reply.msg, PullFailed)
    assert "dropped" in reply.msg.reason


def test_drop_of_ready_transfer_releases_blocks() -> None:
    t = table()
    t.prefill_ready("t1", (1,), 0.0)
    assert t.prefill_dropped("t1", 1.0) == [Release("t1", SendState.DROPPED)]


def test_waiting_pull_times_out() -> None:
    t = table()
    t.pull_arrived("t1", D, pull(), 0.0)
    assert t.tick(4.9) == []
    (reply,) = t.tick(5.0)
    assert isinstance(reply, Reply) and isinstance(reply.msg, PullFailed)
    assert "not ready within 5 s" in reply.msg.reason
    assert t.state("t1") is SendState.TIMED_OUT
    # P finishes late: nobody will pull, the blocks go back at once.
    assert t.prefill_ready("t1", (9,), 6.0) == [Release("t1", SendState.TIMED_OUT)]


def test_unclaimed_ready_transfer_expires_and_releases() -> None:
    t = table()
    t.prefill_ready("t1", (1,), 0.0)
    assert t.tick(29.0) == []
    assert t.tick(30.0) == [Release("t1", SendState.EXPIRED)]
    (reply,) = t.pull_arrived("t1", D, pull(), 31.0)
    assert isinstance(reply.msg, PullFailed) and "expired" in reply.msg.reason


def test_tombstones_are_forgotten_after_their_ttl() -> None:
    t = table()
    t.prefill_dropped("t1", 0.0)
    t.tick(59.0)
    assert t.state("t1") is SendState.DROPPED
    t.tick(60.0)
    assert t.state("t1") is None
    assert t.statistics().tombstones == 0


def test_cancel_by_d_releases_ready_blocks() -> None:
    t = table()
    t.prefill_ready("t1", (1,), 0.0)
    assert t.pull_cancelled("t1", D, 1.0) == [
        Release("t1", SendState.CANCELLED),
        Reply(D, PullFailed("t1", "cancelled")),
    ]


def test_cancel_before_ready_releases_when_ready_comes() -> None:
    t = table()
    t.prefill_started("t1", 0.0)
    t.pull_arrived("t1", D, pull(), 0.0)
    # the waiting pull gets no "failed"; the cancel itself is confirmed
    assert t.pull_cancelled("t1", D, 1.0) == [Reply(D, PullFailed("t1", "cancelled"))]
    assert t.prefill_ready("t1", (1,), 2.0) == [Release("t1", SendState.CANCELLED)]


def test_cancel_for_unknown_transfer_leaves_a_tombstone() -> None:
    t = table()
    assert t.pull_cancelled("t1", D, 0.0) == [Reply(D, PullFailed("t1", "cancelled"))]
    assert t.prefill_ready("t1", (4,), 1.0) == [Release("t1", SendState.CANCELLED)]


def test_cancel_or_drop_while_sending_waits_for_the_write() -> None:
    t = table()
    t.prefill_ready("t1", (1,), 0.0)
    t.pull_arrived("t1", D, pull(), 0.0)
    assert t.pull_cancelled("t1", D, 0.5) == []  # the write's own reply confirms it
    assert t.prefill_dropped("t1", 0.6) == []
    effects = t.send_finished("t1", 1.0)
    assert Release("t1", SendState.DONE) in effects


def test_duplicate_pull_is_refused() -> None:
    t = table()
    t.pull_arrived("t1", D, pull(), 0.0)
    (reply,) = t.pull_arrived("t1", b"other", pull(), 0.1)
    assert reply.identity == b"other" and isinstance(reply.msg, PullFailed)


@pytest.mark.parametrize(
    "setup",
    [
        lambda t: t.prefill_ready("t1", (1,), 0.0),
        lambda t: (t.prefill_ready("t1", (1,), 0.0), t.tick(100.0)),  # expired
        lambda t: (t.prefill_ready("t1", (1,), 0.0), t.prefill_dropped("t1", 0.0)),
    ],
)
def test_second_ready_is_illegal(setup: object) -> None:
    t = table()
    setup(t)  # type: ignore[operator]
    with pytest.raises(IllegalTransition):
        t.prefill_ready("t1", (2,), 1.0)


def test_send_finished_without_send_is_illegal() -> None:
    t = table()
    with pytest.raises(IllegalTransition):
        t.send_finished("t1", 0.0)
    t.prefill_ready("t1", (1,), 0.0)
    with pytest.raises(IllegalTransition):
        t.send_finished("t1", 0.0)


def test_started_while_ready_is_illegal() -> None:
    t = table()
    t.prefill_ready("t1", (1,), 0.0)
    with pytest.raises(IllegalTransition):
        t.prefill_started("t1", 0.0)


def test_every_ready_transfer_is_released_exactly_once() -> None:
    """Whatever happens after "ready", exactly one Release comes out."""
    endings = [
        lambda t: t.tick(1000.0),
        lambda t: t.prefill_dropped("t1", 1.0),
        lambda t: t.pull_cancelled("t1", D, 1.0),
        lambda t: t.pull_arrived("t1", D, pull(), 1.0) + t.send_finished("t1", 2.0),
        lambda t: t.pull_arrived("t1", D, pull(), 1.0) + t.send_finished("t1", 2.0, error="x"),
    ]
    for ending in endings:
        t = table()
        effects = t.prefill_ready("t1", (1,), 0.0) + ending(t)
        effects += t.tick(1e6) + t.prefill_dropped("t1", 1e6) + t.pull_cancelled("t1", D, 1e6)
        assert sum(isinstance(e, Release) for e in effects) == 1


def test_a_lost_d_ends_its_waiting_pulls_without_a_reply() -> None:
    t = table()
    other = b"other-d"
    t.pull_arrived("t1", D, pull("t1"), 0.0)  # waits for P's prefill
    t.pull_arrived("t2", other, pull("t2"), 0.0)  # another D: untouched
    t.prefill_ready("t3", (7,), 0.0)
    t.pull_arrived("t3", D, pull("t3"), 0.5)  # being written: runs to its end
    assert t.peer_gone(D, 1.0) == []  # nothing held, nobody to answer
    assert t.state("t1") is SendState.CANCELLED
    assert t.state("t2") is SendState.PENDING
    assert t.state("t3") is SendState.SENDING
    # P's prefill finishes after D left: released at once, not written
    assert t.prefill_ready("t1", (1, 2), 2.0) == [Release("t1", SendState.CANCELLED)]
    # the write to the lost D ends (it fails): the reply goes nowhere, the blocks come back
    effects = t.send_finished("t3", 3.0, error="peer gone")
    assert Release("t3", SendState.FAILED) in effects


def test_a_pending_prefill_that_nobody_pulls_expires() -> None:
    t = table()
    t.prefill_started("t1", 0.0)
    assert t.tick(4.9) == []
    assert t.tick(5.0) == []  # PENDING holds no blocks: nothing to release
    assert t.state("t1") is SendState.EXPIRED
    # its KV arrives late: released at once; a late pull is answered from the tombstone
    assert t.prefill_ready("t1", (1,), 6.0) == [Release("t1", SendState.EXPIRED)]
    [reply] = t.pull_arrived("t1", D, pull(), 7.0)
    assert isinstance(reply, Reply) and isinstance(reply.msg, PullFailed)


def test_the_same_pull_twice_from_the_same_d_is_a_resend_not_a_duplicate() -> None:
    t = table()
    first = pull()
    assert t.pull_arrived("t1", D, first, 0.0) == []
    # the same request again (a duplicated message): ignored, the first is answered once
    assert t.pull_arrived("t1", D, pull(), 0.1) == []
    # another D, or other blocks, for a transfer in flight: refused
    [refused] = t.pull_arrived("t1", b"other", pull(), 0.2)
    assert isinstance(refused, Reply) and isinstance(refused.msg, PullFailed)
    [refused] = t.pull_arrived("t1", D, pull(blocks=(9,)), 0.3)
    assert isinstance(refused, Reply) and isinstance(refused.msg, PullFailed)
    assert t.prefill_ready("t1", (1, 2), 1.0) == [StartSend("t1", first, (1, 2), identity=D)]


_OPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["started", "ready", "streaming", "dropped", "pull", "cancel", "gone", "done", "fail"]
        ),
        st.sampled_from(["t1", "t2", "t3", "t4"]),  # t3 and t4 are pulled by two D workers
        st.sampled_from([0.0, 0.5, 3.0, 20.0, 50.0]),  # time passing before the op
        st.sampled_from([0, 1]),  # which D worker acts (t1 and t2: always the first)
    ),
    max_size=60,
)
_PULLERS = {"t1": 1, "t2": 1, "t3": 2, "t4": 2}


@settings(max_examples=300, deadline=None)
@given(_OPS)
def test_deadlines_come_due_in_order_and_every_block_is_released_once(
    ops: list[tuple[str, str, float, int]],
) -> None:
    """Whatever happens, each tick ends exactly the transfers whose deadline passed (the
    deadline queues stay ordered and consistent with the states), the earliest deadline moves
    earlier only when the table says so, and every transfer given blocks is released exactly
    once, also when two D workers pull one transfer."""
    t = table()
    now = 0.0
    given_blocks: set[str] = set()
    released: list[str] = []
    asked: list[tuple[str, bytes]] = []  # pulls the table took and must answer, once each
    answered: list[tuple[str, bytes]] = []
    gone: set[bytes] = set()  # D workers that went away: nobody to answer
    earliest = t.next_deadline()
    for op, tid, wait, who in ops:
        now += wait
        expected = _PULLERS[tid]
        who = who if expected > 1 else 0
        d = (D, D2)[who]
        effects = list(t.tick(now))
        state = t.state(tid)
        if op == "started" and state not in (SendState.READY, SendState.SENDING):
            effects += t.prefill_started(tid, now)
        elif op in ("ready", "streaming") and tid not in given_blocks:
            call = t.prefill_ready if op == "ready" else t.prefill_streaming
            before = t.state(tid)
            effects += call(tid, (1, 2), now)
            if op == "ready" or t.state(tid) is not before:
                given_blocks.add(tid)
        elif op == "dropped":
            effects += t.prefill_dropped(tid, now)
        elif op == "pull":
            before = len(t._entries[tid].claims) if tid in t._entries else 0
            effects += t.pull_arrived(tid, d, pull(tid, d_rank=who), now, expected=expected)
            if (tid in t._entries and len(t._entries[tid].claims) > before) or any(
                isinstance(e, StartSend) and e.identity == d for e in effects
            ):
                asked.append((tid, d))
        elif op == "cancel":
            effects += t.pull_cancelled(tid, d, now)
        elif op == "gone":
            effects += t.peer_gone(d, now)
            gone.add(d)
        elif op in ("done", "fail") and _writing(t, tid, d):
            error = "x" if op == "fail" else None
            effects += t.send_finished(tid, now, identity=d, error=error)
        released += [e.transfer_id for e in effects if isinstance(e, Release)]
        answered += [(e.msg.transfer_id, e.identity) for e in effects if isinstance(e, Reply)]
        _check_deadlines(t, now)
        # The sender re-arms its wake-up only when the table says its deadline may be earlier.
        lowered, earliest_before, earliest = t.take_deadline_lowered(), earliest, t.next_deadline()
        assert lowered or earliest >= earliest_before, (op, tid)
    late: list[Effect] = []
    for tid in given_blocks:
        for d in (D, D2):
            if _writing(t, tid, d):
                late += t.send_finished(tid, now, identity=d)
    late += t.tick(now + 1e4)
    released += [e.transfer_id for e in late if isinstance(e, Release)]
    answered += [(e.msg.transfer_id, e.identity) for e in late if isinstance(e, Reply)]
    assert sorted(released) == sorted(given_blocks)
    assert t.statistics().live == 0
    # Every pull the table took was answered, unless its D worker went away (no one to tell).
    unanswered = [a for a in asked if a not in answered and a[1] not in gone]
    assert not unanswered


def _writing(t: SendTable, tid: str, identity: bytes) -> bool:
    entry = t._entries.get(tid)
    return entry is not None and any(c.writing and c.identity == identity for c in entry.claims)


def _check_deadlines(t: SendTable, now: float) -> None:
    queues = {
        "no_pull": t._timers.no_pull,
        "pulls": t._timers.pulls,
        "unclaimed": t._timers.unclaimed,
        "tombstones": t._timers.tombstones,
    }
    for name, queue in queues.items():
        deadlines = list(queue.values())
        assert deadlines == sorted(deadlines), name
        assert not deadlines or deadlines[0] > now, name
    for tid, entry in t._entries.items():
        match entry.state:
            case SendState.PENDING:
                expected = "pulls" if entry.claims else "no_pull"
                assert not any(c.writing for c in entry.claims)
            case SendState.READY:
                expected = "unclaimed"
                assert not entry.claims
            case SendState.SENDING:
                expected = None
                assert entry.claims and all(c.writing for c in entry.claims)
            case _:
                expected = "tombstones"
        inside = [name for name, queue in queues.items() if tid in queue]
        assert inside == ([expected] if expected else []), (tid, entry.state, inside)


# --------------------------------------------------------------------------- several D workers


def test_two_d_workers_each_get_a_write_and_the_blocks_wait_for_both() -> None:
    """P TP 1 → D TP 2: both D ranks pull one transfer; P frees its blocks after the second."""
    t = table()
    p0, p1 = pull(d_rank=0), pull(d_rank=1)
    t.prefill_ready("t1", (1, 2), 0.0)
    assert t.pull_arrived("t1", D, p0, 0.1, expected=2) == [StartSend("t1", p0, (1, 2), identity=D)]
    [done] = t.send_finished("t1", 0.2, identity=D, nbytes=4)
    assert done == Reply(D, PullDone("t1", 4, 0))
    assert t.state("t1") is SendState.READY  # D rank 1 has not pulled yet: keep the blocks
    assert t.pull_arrived("t1", D2, p1, 0.3, expected=2) == [
        StartSend("t1", p1, (1, 2), identity=D2)
    ]
    assert t.send_finished("t1", 0.4, identity=D2) == [
        Reply(D2, PullDone("t1", 0, 0)),
        Release("t1", SendState.DONE),
    ]
    [late] = t.pull_arrived("t1", D2, p1, 0.5, expected=2)
    assert isinstance(late.msg, PullFailed) and "already delivered" in late.msg.reason


def test_two_d_workers_waiting_both_start_when_ready_and_end_after_the_last_write() -> None:
    t = table()
    p0, p1 = pull(d_rank=0), pull(d_rank=1)
    t.pull_arrived("t1", D, p0, 0.0, expected=2)
    t.pull_arrived("t1", D2, p1, 0.1, expected=2)
    assert t.prefill_streaming("t1", (3,), 0.2) == []  # several writers: not streamed
    assert t.prefill_ready("t1", (3,), 0.3) == [
        StartSend("t1", p0, (3,), identity=D),
        StartSend("t1", p1, (3,), identity=D2),
    ]
    with pytest.raises(IllegalTransition, match="2 writes match"):
        t.send_finished("t1", 0.4)  # which one?
    [failed] = t.send_finished("t1", 0.4, identity=D2, error="boom")
    assert failed == Reply(D2, PullFailed("t1", "boom"))
    assert t.state("t1") is SendState.SENDING  # D rank 0's write is still in flight
    effects = t.send_finished("t1", 0.5, identity=D)
    assert effects == [Reply(D, PullDone("t1", 0, 0)), Release("t1", SendState.FAILED)]


def test_pulls_that_disagree_on_d_shape_or_repeat_a_rank_are_refused() -> None:
    t = table()
    t.pull_arrived("t1", D, pull(d_rank=0), 0.0, expected=2)
    [other] = t.pull_arrived("t1", D2, pull(d_rank=1), 0.1, expected=3)
    assert isinstance(other.msg, PullFailed) and "disagree" in other.msg.reason
    [dup] = t.pull_arrived("t1", D2, pull(d_rank=0), 0.2, expected=2)
    assert isinstance(dup.msg, PullFailed) and "duplicate" in dup.msg.reason


def test_a_cancel_while_another_d_is_written_ends_the_transfer_after_that_write() -> None:
    t = table()
    t.prefill_ready("t1", (1,), 0.0)
    t.pull_arrived("t1", D, pull(d_rank=0), 0.1, expected=2)
    # D rank 1 gives up before pulling: answered at once; D rank 0's write runs to its end
    assert t.pull_cancelled("t1", D2, 0.2, "client left") == [
        Reply(D2, PullFailed("t1", "cancelled"))
    ]
    assert t.send_finished("t1", 0.3, identity=D) == [
        Reply(D, PullDone("t1", 0, 0)),
        Release("t1", SendState.CANCELLED),
    ]


def test_a_gone_d_worker_ends_a_transfer_another_d_waits_for() -> None:
    t = table()
    t.pull_arrived("t1", D, pull(d_rank=0), 0.0, expected=2)
    t.pull_arrived("t1", D2, pull(d_rank=1), 0.1, expected=2)
    [told] = t.peer_gone(D2, 0.2)
    assert told.identity == D and isinstance(told.msg, PullFailed)
    assert t.state("t1") is SendState.CANCELLED
    assert t.prefill_ready("t1", (1,), 0.3) == [Release("t1", SendState.CANCELLED)]


def test_p_dropping_while_one_of_two_d_workers_is_written_ends_it_after_that_write() -> None:
    t = table()
    t.prefill_ready("t1", (1,), 0.0)
    t.pull_arrived("t1", D, pull(d_rank=0), 0.1, expected=2)
    assert t.prefill_dropped("t1", 0.2, "aborted") == []  # the write in flight cannot be stopped
    assert t.state("t1") is SendState.SENDING
    dropped = PullFailed("t1", "P dropped the request (aborted or failed): aborted")
    assert t.pull_arrived("t1", D2, pull(d_rank=1), 0.25, expected=2) == [Reply(D2, dropped)]
    assert t.send_finished("t1", 0.3, identity=D) == [
        Reply(D, PullDone("t1", 0, 0)),
        Release("t1", SendState.DROPPED),
    ]
    assert t.pull_arrived("t1", D2, pull(d_rank=1), 0.4, expected=2) == [Reply(D2, dropped)]


def test_a_late_pull_is_told_how_the_transfer_ended() -> None:
    t = table()
    t.pull_cancelled("t1", D, 0.0)
    assert t.pull_arrived("t1", D2, pull(d_rank=1), 1.0) == [
        Reply(D2, PullFailed("t1", "the transfer was cancelled by D"))
    ]
    t.prefill_ready("t2", (1,), 0.0)
    t.pull_arrived("t2", D, pull("t2"), 0.0)
    t.send_finished("t2", 0.1)
    assert t.pull_arrived("t2", D2, pull("t2", d_rank=1), 0.2) == [
        Reply(D2, PullFailed("t2", "already delivered"))
    ]


def test_pulls_waiting_counts_the_unanswered_pulls_of_a_transfer() -> None:
    t = table()
    assert t.pulls_waiting("t1") == 0  # unknown
    t.pull_arrived("t1", D, pull(d_rank=0), 0.0, expected=2)
    t.pull_arrived("t1", D2, pull(d_rank=1), 0.1, expected=2)
    assert t.pulls_waiting("t1") == 2


def test_a_gone_d_worker_is_named_in_the_answer_to_the_others() -> None:
    t = table()
    t.pull_arrived("t1", D, pull(d_rank=0), 0.0, expected=2)
    t.pull_arrived("t1", D2, pull(d_rank=1), 0.1, expected=2)
    assert t.peer_gone(D2, 0.2, "heartbeats stopped") == [
        Reply(D, PullFailed("t1", "the pulling D worker is gone: heartbeats stopped"))
    ]


def test_a_layer_not_streamed_is_ignored_and_streaming_twice_changes_nothing() -> None:
    t = table()
    assert t.layer_ready("t1", [0]) == []  # unknown
    t.pull_arrived("t1", D, pull(), 0.0)
    [start] = t.prefill_streaming("t1", (3,), 0.1)
    assert isinstance(start, StartSend) and start.streamed
    assert t.prefill_streaming("t1", (3,), 0.2) == []  # P said it again: one write already
    assert t.state("t1") is SendState.SENDING


def test_the_deadline_is_said_lowered_only_when_a_queue_was_empty() -> None:
    t = table()
    assert not t.take_deadline_lowered()
    t.prefill_ready("t1", (1,), 0.0)  # the unclaimed queue was empty: a new earliest deadline
    assert t.take_deadline_lowered()
    assert not t.take_deadline_lowered()  # taken
    t.prefill_ready("t2", (1,), 1.0)  # appended behind t1: the earliest did not move
    assert not t.take_deadline_lowered()


def test_a_write_ending_where_none_was_started_names_the_illegal_pair() -> None:
    t = table()
    t.prefill_ready("t1", (1,), 0.0)
    with pytest.raises(IllegalTransition, match="write_ended while ready"):
        t.send_finished("t1", 1.0)
    sending = table()
    sending.prefill_ready("t1", (1,), 0.0)
    sending.pull_arrived("t1", D, pull(), 0.0)
    with pytest.raises(IllegalTransition, match="0 writes match this end"):
        sending.send_finished("t1", 1.0, identity=D2)
