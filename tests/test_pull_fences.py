"""The in-flight write fence, sans IO: a write that may land after D lost its writer is never
reported as good KV, and D's blocks stay taken until the writer confirms it stopped, is found
dead, or the fence timeout passes — and are given back, exactly once, on every path.

D's side is :class:`~pdactors.core.pull_table.PullTable`; P's answer to a fence's cancel is
:meth:`~pdactors.core.send_table.SendTable.pull_cancelled` with D's session.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pdactors.core.pull_table import Completed, Fence, PullEffect, PullEnd, PullTable, SendCancel
from pdactors.core.send_table import Release, Reply, SendState, SendTable, StartSend
from pdactors.wire import PullDone, PullFailed, PullRequest

FENCE = 30.0


def fenced_table(*peers: str, writers: tuple[str, ...] = ("p1",)) -> tuple[PullTable, Fence]:
    """Pull "t" sent to ``peers`` at 0.0 (deadline 540), ``writers`` said Writing, D lost p1
    at 1.0."""
    t = PullTable(timeout=540.0, fence_timeout=FENCE)
    t.start("t", 0.0, block_ids=((4, 5),))
    t.sent("t", peers or ("p1",))
    for peer in writers:
        assert t.writing("t", peer) == []
    effects = t.peer_lost("p1", "P gone: heartbeats stopped", 1.0)
    [fence] = [e for e in effects if isinstance(e, Fence)]
    assert not [e for e in effects if isinstance(e, Completed)]  # not ended: fenced
    return t, fence


def ends(effects: list[PullEffect]) -> list[Completed]:
    return [e for e in effects if isinstance(e, Completed)]


def test_a_lost_writer_fences_its_pull_and_keeps_d_blocks_until_it_confirms() -> None:
    t, fence = fenced_table()
    assert fence == Fence("p1", ("t",), 1.0 + FENCE)
    assert t.fenced_pulls() == ["t"] and t.fencing("p1") == {"t"}
    assert t.next_deadline() == 1.0 + FENCE
    assert t.tick(FENCE) == []  # not yet
    assert t.abort("t", "client left") == []  # D's abort does not free the blocks either
    # the lost writer's late PullDone (its write landed after the loss) is not D's KV
    assert t.answered("t", ok=True, peer="p1", sums=b"") == []
    assert t.fenced("p2", "t", "another P worker") == []  # not the one fenced
    [done] = t.fenced("p1", "t", "P worker p1 confirmed no write is in flight any more")
    assert done.end is PullEnd.P_GONE and not done.ok
    assert "heartbeats stopped" in done.reason and "confirmed" in done.reason
    assert done.pull is not None and done.pull.block_ids == ((4, 5),)
    assert len(t) == 0 and t.fenced("p1", "t", "again") == []


def test_a_dead_writer_ends_every_pull_fenced_on_it_and_no_other() -> None:
    t = PullTable(timeout=540.0, fence_timeout=FENCE)
    for tid, peer in (("a", "p1"), ("b", "p1"), ("c", "p2")):
        t.start(tid, 0.0)
        t.sent(tid, peer)
        t.writing(tid, peer)
    [fence1] = t.peer_lost("p1", "gone", 1.0)
    [fence2] = t.peer_lost("p2", "gone", 2.0)
    assert fence1 == Fence("p1", ("a", "b"), 1.0 + FENCE)
    assert fence2 == Fence("p2", ("c",), 2.0 + FENCE)
    dead = t.fenced("p1", None, "P worker p1 is dead: it refuses connections")
    assert sorted(d.transfer_id for d in ends(dead)) == ["a", "b"]
    assert all("is dead" in d.reason and not d.ok for d in ends(dead))
    assert t.fenced_pulls() == ["c"]


def test_the_fence_timeout_ends_a_silent_writer_pull_and_names_the_risk() -> None:
    t, _ = fenced_table()
    assert t.tick(FENCE + 0.999) == []
    [done] = t.tick(1.0 + FENCE)
    assert done.end is PullEnd.P_GONE
    assert "late write may still land" in done.reason and "p1" in done.reason


def test_the_pull_deadline_does_not_end_a_fenced_pull() -> None:
    t = PullTable(timeout=10.0, fence_timeout=5.0)
    t.start("t", 0.0)
    t.sent("t", "p1")
    t.writing("t", "p1")
    [_] = t.peer_lost("p1", "gone", 8.0)  # fenced until 13, past the deadline (10)
    assert t.next_deadline() == 13.0
    assert t.tick(10.0) == []
    [done] = t.tick(13.0)
    assert "late write may still land" in done.reason


def test_only_a_pull_the_lost_p_said_it_writes_is_fenced() -> None:
    t = PullTable(timeout=540.0, fence_timeout=FENCE)
    t.start("t", 0.0)
    t.sent("t", "p1")
    t.writing("t", "p1", epoch=7)  # D did not know P's epoch: taken
    t.start("u", 0.0)
    t.sent("u", "p1", epochs=[3])
    t.writing("u", "p1", epoch=7)  # from another life than the one asked: ignored
    t.start("v", 0.0)
    t.sent("v", "p1")
    t.writing("v", "p1")
    t.answered("v", ok=False, reason="dropped", peer="p1")  # answered: no write in flight
    effects = t.peer_lost("p1", "gone", 1.0)
    assert [e.transfer_id for e in ends(effects)] == ["u"]
    assert [e for e in effects if isinstance(e, Fence)] == [Fence("p1", ("t",), 1.0 + FENCE)]


def test_without_a_fence_timeout_a_lost_writer_pull_ends_at_once_as_before() -> None:
    t = PullTable(timeout=540.0)  # fence_timeout 0
    t.start("t", 0.0)
    t.sent("t", "p1")
    t.writing("t", "p1")
    [done] = t.peer_lost("p1", "P gone", 1.0)
    assert isinstance(done, Completed) and done.end is PullEnd.P_GONE


def test_a_pull_of_several_p_workers_waits_for_the_others_and_the_fence() -> None:
    t, fence = fenced_table("p1", "p2")
    assert fence.transfer_ids == ("t",)
    assert t.answered("t", ok=True, peer="p2") == []  # p2 is done; p1 may still write
    [done] = t.fenced("p1", "t", "p1 confirmed")
    assert done.end is PullEnd.P_GONE


#: Every way a fenced pull can end, each from fenced_table("p1", "p2") (p1 fenced, p2 asked to
#: stop and not answered yet).
PATHS: dict[str, Callable[[PullTable], list[PullEffect]]] = {
    "confirmed": lambda t: t.fenced("p1", "t", "confirmed"),
    "dead": lambda t: t.fenced("p1", None, "dead"),
    "timeout": lambda t: t.tick(1.0 + FENCE),
    "aborted, then confirmed": lambda t: t.abort("t") + t.fenced("p1", "t", "confirmed"),
    "the other P lost, then timeout": lambda t: t.peer_lost("p2", "gone", 2.0) + t.tick(99.0),
    "the other P dead while writing": lambda t: (
        t.writing("t", "p2")
        + t.peer_lost("p2", "gone", 2.0)
        + t.fenced("p1", None, "dead")
        + t.fenced("p2", None, "dead")
    ),
}


@pytest.mark.parametrize("path", PATHS)
def test_every_block_of_a_fenced_pull_is_given_back_exactly_once(path: str) -> None:
    t, _ = fenced_table("p1", "p2")
    effects = PATHS[path](t) + t.answered("t", ok=True, peer="p2") + t.tick(1e9)
    [done] = ends(effects)  # exactly one end: D frees the blocks then, and only then
    assert not done.ok and done.pull is not None and done.pull.block_ids == ((4, 5),)
    assert len(t) == 0 and t.fenced_pulls() == []
    assert not [e for e in effects if isinstance(e, SendCancel) and e.peer == "p1"]


# ---------------------------------------------------------------------- P's side


D_OLD, D_FENCE, D_OTHER = b"d-lost-connection", b"d-fence-connection", b"other-d-worker"


def pull(session: str, rank: int = 0) -> PullRequest:
    return PullRequest("t", session, rank, 2, 0, 1, ((5, 6),), "layout", fence=True)


def writing_table() -> tuple[SendTable, list[StartSend]]:
    t = SendTable(ready_timeout=5.0, unclaimed_ttl=30.0, tombstone_ttl=60.0)
    t.prefill_ready("t", (1, 2), 0.0)
    starts = t.pull_arrived("t", D_OLD, pull("d-mem"), 0.1, expected=2)
    return t, [s for s in starts if isinstance(s, StartSend)]


def test_p_answers_a_fence_once_no_write_into_that_d_memory_is_in_flight() -> None:
    t, [start] = writing_table()
    assert start.pull.fence  # the sender says Writing before it runs this write
    assert t.pull_cancelled("t", D_FENCE, 0.2, "lost mid-write", session="d-mem") == []
    t.peer_gone(D_OLD, 0.3)  # P hears of the lost connection too: the write runs on
    assert t.state("t") is SendState.SENDING
    assert t.send_finished("t", 0.4, identity=D_OLD) == [
        Reply(D_OLD, PullDone("t", 0, 0)),  # to a connection that is gone: dropped
        Reply(D_FENCE, PullFailed("t", "cancelled")),  # the fence's answer: after the write
        Release("t", SendState.CANCELLED),
    ]


def test_p_answers_a_fence_at_once_when_no_write_into_that_d_memory_is_in_flight() -> None:
    t, _ = writing_table()
    # another D worker's memory: P never wrote there
    assert t.pull_cancelled("t", D_OTHER, 0.2, "abort", session="other-mem") == [
        Reply(D_OTHER, PullFailed("t", "cancelled"))
    ]
    t.send_finished("t", 0.3, identity=D_OLD)
    # the write ended before the fence asked: answered from the tombstone
    assert t.pull_cancelled("t", D_FENCE, 0.4, "lost mid-write", session="d-mem") == [
        Reply(D_FENCE, PullFailed("t", "cancelled"))
    ]


def test_a_fence_confirmed_gives_way_to_the_next_lost_writers_own_timeout() -> None:
    """Two writers: p1 lost at 1.0 and confirmed; p2 lost at 100.0 keeps the pull until
    100 + FENCE, not until p1's old fence timeout (31.0)."""
    t, fence = fenced_table("p1", "p2", writers=("p1", "p2"))
    assert fence.until == 1.0 + FENCE and t.next_deadline() == 1.0 + FENCE
    assert t.fenced("p1", "t", "p1 confirmed it stopped") == []  # p2 may still write
    assert t.next_deadline() == 540.0  # no fence left: the pull deadline again
    effects = t.peer_lost("p2", "P gone: heartbeats stopped", 100.0)
    assert [e.until for e in effects if isinstance(e, Fence)] == [100.0 + FENCE]
    assert t.next_deadline() == 100.0 + FENCE
    assert t.tick(100.0 + FENCE - 0.1) == []
    [done] = ends(t.tick(100.0 + FENCE))
    assert done.end is PullEnd.P_GONE


def test_one_lost_writer_confirming_keeps_the_others_fence() -> None:
    t = PullTable(timeout=540.0, fence_timeout=FENCE)
    t.start("t", 0.0)
    t.sent("t", ["p1", "p2"])
    t.writing("t", "p1")
    t.writing("t", "p2")
    t.peer_lost("p1", "gone", 1.0)
    t.peer_lost("p2", "gone", 2.0)
    assert t.fenced("p1", "t", "p1 confirmed it stopped") == []
    assert t.next_deadline() == 1.0 + FENCE  # p2's fence still holds D's blocks
    [done] = ends(t.tick(1.0 + FENCE))
    assert done.end is PullEnd.P_GONE


def test_a_fence_timeout_under_a_second_still_fences() -> None:
    t = PullTable(timeout=540.0, fence_timeout=0.5)
    t.start("t", 0.0)
    t.sent("t", "p1")
    t.writing("t", "p1")
    [fence] = t.peer_lost("p1", "gone", 1.0)
    assert isinstance(fence, Fence) and fence.until == 1.5
    [done] = ends(t.tick(1.5))
    assert done.end is PullEnd.P_GONE
