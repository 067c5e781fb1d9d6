"""The send table's rules as data: every (state, event) pair, enumerated.

Two checks of each pair: the table of rules itself against a copy written out here by hand (and
moved through ``SendTable._fire``, which every method goes through), and the public methods
from every state against an oracle written out here by hand, so that a wrong entry in the rules
cannot pass both.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from pdactors.core.send_rules import (
    STREAM_TRANSITIONS,
    TRANSITIONS,
    Do,
    SendEvent,
    SendState,
    StreamEvent,
    StreamState,
)
from pdactors.core.send_stream import Stream, Wake, stream_event
from pdactors.core.send_table import SendTable
from pdactors.errors import IllegalTransition
from pdactors.wire import PullRequest

D, D2 = b"d-worker", b"d-worker-rank-1"
S = SendState


def pull(d_rank: int = 0) -> PullRequest:
    return PullRequest("t", "127.0.0.1:1", d_rank, 1 + d_rank, 0, 1, ((5, 6),), "layout")


def table() -> SendTable:
    return SendTable(ready_timeout=5.0, unclaimed_ttl=30.0, tombstone_ttl=60.0)


def sending(t: SendTable) -> None:
    t.prefill_ready("t", (1,), 0.0)
    t.pull_arrived("t", D, pull(), 0.0)


#: How to bring transfer "t" into each state with public calls (all before time 30).
RECIPES: dict[str, Callable[[SendTable], object]] = {
    "unknown": lambda t: None,
    "pending": lambda t: t.prefill_started("t", 0.0),
    "pending_pulled": lambda t: t.pull_arrived("t", D, pull(), 0.0),
    "ready": lambda t: t.prefill_ready("t", (1,), 0.0),
    "sending": sending,
    "done": lambda t: (sending(t), t.send_finished("t", 0.0)),
    "failed": lambda t: (sending(t), t.send_finished("t", 0.0, error="lost")),
    "timed_out": lambda t: (t.pull_arrived("t", D, pull(), 0.0), t.tick(5.0)),
    "expired": lambda t: (t.prefill_ready("t", (1,), 0.0), t.tick(30.0)),
    "dropped": lambda t: t.prefill_dropped("t", 0.0),
    "cancelled": lambda t: t.pull_cancelled("t", D, 0.0),
}
RECIPE_STATE = {
    "unknown": None,
    "pending": S.PENDING,
    "pending_pulled": S.PENDING,
    "ready": S.READY,
    "sending": S.SENDING,
    "done": S.DONE,
    "failed": S.FAILED,
    "timed_out": S.TIMED_OUT,
    "expired": S.EXPIRED,
    "dropped": S.DROPPED,
    "cancelled": S.CANCELLED,
}
CALLS: dict[str, Callable[[SendTable], object]] = {
    "started": lambda t: t.prefill_started("t", 30.0),
    "ready": lambda t: t.prefill_ready("t", (2,), 30.0),
    "streaming": lambda t: t.prefill_streaming("t", (2,), 30.0),
    "dropped": lambda t: t.prefill_dropped("t", 30.0),
    "cancelled": lambda t: t.pull_cancelled("t", D2, 30.0),
    "pull": lambda t: t.pull_arrived("t", D2, pull(1), 30.0),
    "finished": lambda t: t.send_finished("t", 30.0, identity=D),
}
X = IllegalTransition
Outcome = SendState | type[IllegalTransition] | None


def row(*outcomes: Outcome) -> dict[str, Outcome]:
    """One state's outcomes, in the order of CALLS."""
    return dict(zip(CALLS, outcomes, strict=True))


#: What each public call does from each state: the next state, or IllegalTransition. Written
#: from the module docstring of send_table, not from the rules.
ORACLE: dict[str, dict[str, Outcome]] = {
    # started, ready, streaming, dropped, cancelled, pull, finished
    "unknown": row(S.PENDING, S.READY, None, S.DROPPED, S.CANCELLED, S.PENDING, X),
    "pending": row(S.PENDING, S.READY, S.PENDING, S.DROPPED, S.CANCELLED, S.PENDING, X),
    "pending_pulled": row(S.PENDING, S.SENDING, S.SENDING, S.DROPPED, S.CANCELLED, S.PENDING, X),
    "ready": row(X, X, S.READY, S.DROPPED, S.CANCELLED, S.SENDING, X),
    "sending": row(X, X, S.SENDING, S.SENDING, S.SENDING, S.SENDING, S.DONE),
}
for _name, _end in [("done", S.DONE), ("failed", S.FAILED), ("expired", S.EXPIRED)]:
    ORACLE[_name] = row(_end, X, _end, _end, _end, _end, X)  # had its KV: "ready" again
for _name, _end in [("timed_out", S.TIMED_OUT), ("dropped", S.DROPPED), ("cancelled", S.CANCELLED)]:
    ORACLE[_name] = row(_end, _end, _end, _end, _end, _end, X)  # late KV: released at once


E = SendEvent
Move = tuple[SendState | None, Do]


def rules(**moves: Move) -> dict[SendEvent, Move]:
    """One state's legal events (by name) and where each leads; every other event is illegal."""
    return {E[name.upper()]: move for name, move in moves.items()}


def tombstone(end: SendState) -> dict[SendEvent, Move]:
    """An end answers a late pull, releases late KV, ignores the rest, and is forgotten."""
    return rules(
        started=(end, Do.NOTHING),
        ready=(end, Do.RELEASE),
        stream_unpulled=(end, Do.NOTHING),
        dropped=(end, Do.NOTHING),
        cancelled=(end, Do.NOTHING),
        pull=(end, Do.REFUSE),
        forget=(None, Do.FORGET),
    )


#: The rules, written out again by hand from the module docstrings of send_rules and
#: send_table (not read from TRANSITIONS): an edit of the table must be made here too.
RULES: dict[SendState | None, dict[SendEvent, Move]] = {
    # unknown: P's word or a pull makes a record; P or D giving up leaves a tombstone
    None: rules(
        started=(S.PENDING, Do.NOTHING),
        ready=(S.READY, Do.NOTHING),
        stream_unpulled=(None, Do.NOTHING),
        dropped=(S.DROPPED, Do.END),
        cancelled=(S.CANCELLED, Do.END),
        pull=(S.PENDING, Do.WAIT),
    ),
    # waiting for P's KV: it comes (sent at once if pulled), or the ready timeout passes
    S.PENDING: rules(
        started=(S.PENDING, Do.NOTHING),
        ready=(S.READY, Do.NOTHING),
        ready_pulled=(S.SENDING, Do.START),
        streaming=(S.SENDING, Do.START_STREAM),
        stream_unpulled=(S.PENDING, Do.NOTHING),
        dropped=(S.DROPPED, Do.END),
        cancelled=(S.CANCELLED, Do.END),
        peer_gone=(S.CANCELLED, Do.END),
        pull=(S.PENDING, Do.WAIT),
        no_pull_due=(S.EXPIRED, Do.END),
        pull_due=(S.TIMED_OUT, Do.END),
    ),
    # P's KV is here: a pull starts the write; unclaimed it expires (at once when no D can
    # find P)
    S.READY: rules(
        stream_unpulled=(S.READY, Do.NOTHING),
        dropped=(S.DROPPED, Do.END),
        cancelled=(S.CANCELLED, Do.END),
        pull_blocks=(S.SENDING, Do.START),
        unclaimed_due=(S.EXPIRED, Do.END),
        unreachable=(S.EXPIRED, Do.END),
    ),
    # writes in flight: giving up waits for them; the last one's end says how it ends
    S.SENDING: rules(
        stream_unpulled=(S.SENDING, Do.NOTHING),
        dropped=(S.SENDING, Do.DEFER),
        cancelled=(S.SENDING, Do.DEFER),
        pull_blocks=(S.SENDING, Do.START),
        write_ended=(S.SENDING, Do.NOTHING),
        writes_done=(S.DONE, Do.END),
        writes_failed=(S.FAILED, Do.END),
        writes_paused=(S.READY, Do.NOTHING),
        writes_dropped=(S.DROPPED, Do.END),
        writes_cancelled=(S.CANCELLED, Do.END),
    ),
    **{end: tombstone(end) for end in SendState if end.ended},
}


def test_the_table_is_the_rules_written_here() -> None:
    assert set(RULES) == {None, *SendState}
    written = {(state, event): move for state, row in RULES.items() for event, move in row.items()}
    assert written == TRANSITIONS


@pytest.mark.parametrize(("start", "event"), list(itertools.product(RECIPES, SendEvent)))
def test_every_pair_of_the_rules_moves_or_raises(start: str, event: SendEvent) -> None:
    t = table()
    RECIPES[start](t)
    state = RECIPE_STATE[start]
    assert t.state("t") is state
    if event in RULES[state]:
        t._fire("t", event, 30.0)
        assert t.state("t") is RULES[state][event][0]
    else:
        with pytest.raises(IllegalTransition):
            t._fire("t", event, 30.0)
        assert t.state("t") is state  # an illegal event changes nothing


@pytest.mark.parametrize(("start", "call"), list(itertools.product(RECIPES, CALLS)))
def test_every_public_call_from_every_state_agrees_with_the_oracle(start: str, call: str) -> None:
    t = table()
    RECIPES[start](t)
    expected = ORACLE[start][call]
    if expected is X:
        with pytest.raises(IllegalTransition):
            CALLS[call](t)
        assert t.state("t") is RECIPE_STATE[start]
    else:
        CALLS[call](t)
        assert t.state("t") is expected


def test_the_rules_name_only_real_states_and_every_end_is_forgotten() -> None:
    for (state, _), (nxt, _) in TRANSITIONS.items():
        assert state is None or isinstance(state, SendState)
        assert nxt is None or isinstance(nxt, SendState)
    ends = [s for s in SendState if s.ended]
    assert all(TRANSITIONS[end, SendEvent.FORGET][0] is None for end in ends)
    assert all((s, SendEvent.FORGET) not in TRANSITIONS for s in [None, S.PENDING, S.READY])
    # READY_AGAIN is never legal: a second "ready" is a bug in the caller
    assert not [k for k in TRANSITIONS if k[1] is SendEvent.READY_AGAIN]


SS, SE = StreamState, StreamEvent
#: The stream rules written out by hand (layer, P ready, P dropped, the write ended; None:
#: closed; X: illegal): P's last word is kept until the write ends; after the KV is complete,
#: or dropped, P's word changes nothing; a write that ended first waits for P's word to close.
# fmt: off
STREAM_RULES: dict[StreamState, tuple[StreamState | type[IllegalTransition] | None, ...]] = {
    SS.COMPUTING: (SS.COMPUTING, SS.FINISHING, SS.DROPPED, SS.ORPHANED),
    SS.FINISHING: (SS.FINISHING, SS.FINISHING, SS.FINISHING, None),
    SS.DROPPED: (SS.DROPPED, SS.DROPPED, SS.DROPPED, None),
    SS.ORPHANED: (SS.ORPHANED, None, None, X),
}
# fmt: on


def test_the_stream_table_is_the_rules_written_here() -> None:
    written = {
        (state, event): nxt
        for state, row in STREAM_RULES.items()
        for event, nxt in zip(StreamEvent, row, strict=True)
        if nxt is not X
    }
    assert written == STREAM_TRANSITIONS


@pytest.mark.parametrize(("state", "event"), list(itertools.product(StreamState, StreamEvent)))
def test_every_pair_of_the_stream_rules_moves_or_raises(
    state: StreamState, event: StreamEvent
) -> None:
    stream = Stream(state=state, waiter="w")
    nxt = dict(zip(StreamEvent, STREAM_RULES[state], strict=True))[event]
    if nxt is not X:
        after, wakes = stream_event("t", stream, event)
        assert after is (None if nxt is None else stream)
        assert nxt is None or stream.state is nxt
        # the write task is woken only by P's word while it waits for P
        woken = state is StreamState.COMPUTING and event is not StreamEvent.WRITER_ENDED
        assert wakes == ([Wake("w")] if woken else [])
    else:
        with pytest.raises(IllegalTransition):
            stream_event("t", stream, event)
        assert stream.state is state


def streaming() -> SendTable:
    t = table()
    t.pull_arrived("t", D, pull(), 0.0)
    t.prefill_streaming("t", (3, 4), 0.1)
    return t


def test_a_streamed_transfer_queues_layers_wakes_its_write_and_keeps_p_s_last_word() -> None:
    t = streaming()
    assert t.take_layers("t", "waiter") == ([], t.stream("t"))
    assert t.layer_ready("t", [0]) == [Wake("waiter")]
    assert t.layer_ready("t", [1]) == []  # nobody waits: it is queued
    layers, stream = t.take_layers("t", "again")
    assert layers == [((0,), None), ((1,), None)] and stream.state is StreamState.COMPUTING
    assert t.prefill_ready("t", (3, 4), 0.2, complete=print) == []  # the write did not wait
    assert stream.state is StreamState.FINISHING and stream.rest_complete is print
    assert t.layer_ready("t", [2]) == [] and t.take_layers("t", "late")[0] == []
    assert t.prefill_ready("t", (3, 4), 0.3) == []  # ready twice: P's KV was complete already
    assert stream.state is StreamState.FINISHING and stream.rest_complete is print
    t.send_finished("t", 0.4)
    assert t.state("t") is S.DONE and t.stream("t") is None


def test_a_stream_whose_write_ended_first_is_closed_by_p_s_late_word() -> None:
    t = streaming()
    t.send_finished("t", 5.0, error="P's streamed prefill did not finish within 5 s")
    assert t.state("t") is S.FAILED
    stream = t.stream("t")
    assert stream is not None and stream.state is StreamState.ORPHANED
    assert t.layer_ready("t", [0]) == []
    assert t.prefill_ready("t", (3, 4), 6.0) == []  # released already: nothing more
    assert t.stream("t") is None and t.state("t") is S.FAILED


def test_p_dropping_a_stream_tells_the_write_why() -> None:
    t = streaming()
    t.take_layers("t", "waiter")
    assert t.prefill_dropped("t", 0.2, "aborted") == [Wake("waiter")]
    stream = t.stream("t")
    assert stream is not None and stream.state is StreamState.DROPPED
    assert stream.failed == "P dropped the prefill: aborted"
    assert t.prefill_ready("t", (3, 4), 0.3) == []  # after a drop, a "ready" changes nothing
    with pytest.raises(IllegalTransition):
        table().take_layers("t", "waiter")  # not streamed
