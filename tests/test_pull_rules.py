"""The pull table's rules as data: every (state, event) pair, enumerated.

As for the send table: the rules themselves against a copy written out by hand (and through
``PullTable._fire``, which every method goes through), and every public call from every state
against an oracle written out by hand.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest

from pdactors.core.pull_rules import PULL_TRANSITIONS, PullDo, PullEvent, PullState
from pdactors.core.pull_table import Completed, PullEnd, PullTable, Verify
from pdactors.errors import DuplicateTransfer, IllegalTransition

S = PullState


def table() -> PullTable:
    return PullTable(timeout=10.0, fence_timeout=5.0)


#: How to bring transfer "t" into each state (a pull sent to two P workers, or to one).
RECIPES: dict[str, Callable[[PullTable], object]] = {
    "none": lambda t: None,
    "looking_up": lambda t: t.start("t", 0.0),
    "sent": lambda t: (t.start("t", 0.0), t.sent("t", ["p1", "p2"])),
    "sent_to_one": lambda t: (t.start("t", 0.0), t.sent("t", "p1")),
    "aborting": lambda t: (t.start("t", 0.0), t.sent("t", ["p1", "p2"]), t.abort("t")),
    "verifying": lambda t: (
        t.start("t", 0.0),
        t.sent("t", "p1"),
        t.answered("t", ok=True, sums=b""),
    ),
    # p1 said it writes D's blocks now
    "writing": lambda t: (t.start("t", 0.0), t.sent("t", "p1"), t.writing("t", "p1")),
    # ... and D lost it at 1.0: fenced until it confirms, is found dead, or 6.0
    "fenced": lambda t: (
        t.start("t", 0.0),
        t.sent("t", "p1"),
        t.writing("t", "p1"),
        t.peer_lost("p1", "gone", 1.0),
    ),
}
RECIPE_STATE = {
    "none": None,
    "looking_up": S.LOOKING_UP,
    "sent": S.SENT,
    "sent_to_one": S.SENT,
    "aborting": S.ABORTING,
    "verifying": S.VERIFYING,
    "writing": S.SENT,
    "fenced": S.ABORTING,
}
CALLS: dict[str, Callable[[PullTable], list[object] | object]] = {
    "start": lambda t: t.start("t", 1.0),
    "sent": lambda t: t.sent("t", "p3"),
    "abort": lambda t: t.abort("t"),
    "answer": lambda t: t.answered("t", ok=True, peer="p1"),
    "refused": lambda t: t.answered("t", ok=False, reason="no", peer="p1"),
    "fail": lambda t: t.fail("t", "unreachable"),
    "lost": lambda t: t.peer_lost("p1", "gone"),
    "deadline": lambda t: t.tick(10.0),
    "verified": lambda t: t.verified("t", None),
    "corrupt": lambda t: t.verified("t", "run 0 differs"),
    "writing": lambda t: t.writing("t", "p1"),
    "fenced": lambda t: t.fenced("p1", "t", "p1 confirmed it stopped"),
    "fence_timeout": lambda t: t.tick(6.0),
}
Dup, X = DuplicateTransfer, IllegalTransition
Outcome = PullState | type[IllegalTransition] | None


def row(*outcomes: Outcome) -> dict[str, Outcome]:
    return dict(zip(CALLS, outcomes, strict=True))


#: The state after each call (None: not in flight), or the error. From the module docstring.
# fmt: off
ORACLE: dict[str, dict[str, Outcome]] = {
    # start, sent, abort, answer, refused, fail, lost, deadline, verified, corrupt,
    # writing, fenced, fence_timeout
    "none": row(S.LOOKING_UP, None, None, None, None, None, None, None, None, None,
                None, None, None),
    "looking_up": row(Dup, S.SENT, None, S.LOOKING_UP, S.LOOKING_UP, None, S.LOOKING_UP, None,
                      X, X, S.LOOKING_UP, S.LOOKING_UP, S.LOOKING_UP),
    "sent": row(Dup, X, S.ABORTING, S.SENT, S.ABORTING, S.ABORTING, S.ABORTING, None, X, X,
                S.SENT, S.SENT, S.SENT),
    # fail names no P worker: the one asked may be writing, so the pull waits for it
    "sent_to_one": row(Dup, X, S.ABORTING, None, None, S.ABORTING, None, None, X, X,
                       S.SENT, S.SENT, S.SENT),
    "aborting": row(Dup, X, S.ABORTING, S.ABORTING, S.ABORTING, S.ABORTING, S.ABORTING, None,
                    X, X, S.ABORTING, S.ABORTING, S.ABORTING),
    # every P worker answered: nothing writes, so D's abort or the deadline end it at once
    "verifying": row(Dup, X, None, S.VERIFYING, S.VERIFYING, S.VERIFYING, S.VERIFYING, None,
                     None, None, S.VERIFYING, S.VERIFYING, S.VERIFYING),
    # the writer's loss fences the pull (ABORTING, not ended); its answer ends it as before
    "writing": row(Dup, X, S.ABORTING, None, None, S.ABORTING, S.ABORTING, None, X, X,
                   S.SENT, S.SENT, S.SENT),
    # fenced: only the writer's word or death (fenced) or the fence timeout (6.0; the
    # deadline call's 10.0 is past it) end it; a late answer of the lost writer, D's abort
    # and other failures change nothing
    "fenced": row(Dup, X, S.ABORTING, S.ABORTING, S.ABORTING, S.ABORTING, S.ABORTING, None,
                  X, X, S.ABORTING, None, None),
}
# fmt: on


E, Do = PullEvent, PullDo
Move = tuple[PullState | None, PullDo]


def rules(**moves: Move) -> dict[PullEvent, Move]:
    """One state's legal events (by name) and where each leads; every other event is illegal."""
    return {E[name.upper()]: move for name, move in moves.items()}


#: The rules, written out again by hand from the module docstrings of pull_rules and pull_table
#: (not read from PULL_TRANSITIONS): an edit of the table must be made here too. A move to None
#: ends the pull, and only an END_* does that.
RULES: dict[PullState | None, dict[PullEvent, Move]] = {
    # no pull in flight: only a start makes one; a late send is cancelled where it went, any
    # other late word is ignored; losing a peer, settling, timers and landing need a pull
    None: rules(
        start=(S.LOOKING_UP, Do.NOTHING),
        sent=(None, Do.CANCEL_UNSENT),
        abort=(None, Do.NOTHING),
        answer=(None, Do.NOTHING),
        refused=(None, Do.NOTHING),
        fail=(None, Do.NOTHING),
        verified=(None, Do.NOTHING),
        corrupt=(None, Do.NOTHING),
        writing=(None, Do.NOTHING),
        fenced=(None, Do.NOTHING),
    ),
    # P not asked yet: an answer or a writer is not this pull's; nothing can be cancelled at P
    S.LOOKING_UP: rules(
        sent=(S.SENT, Do.NOTHING),
        abort=(None, Do.END_ABORTED),
        answer=(S.LOOKING_UP, Do.NOTHING),
        refused=(S.LOOKING_UP, Do.NOTHING),
        fail=(None, Do.END_UNREACHABLE),
        deadline=(None, Do.END_DEADLINE),
        writing=(S.LOOKING_UP, Do.NOTHING),
    ),
    # asked: an abort cancels at P; a part's failure stops the others, then settles
    S.SENT: rules(
        abort=(S.ABORTING, Do.CANCEL),
        answer=(S.SENT, Do.SETTLE),
        refused=(S.ABORTING, Do.PART_FAILED),
        fail=(S.ABORTING, Do.PART_FAILED),
        peer_lost=(S.ABORTING, Do.PART_FAILED),
        settled=(None, Do.END_DELIVERED),
        deadline=(None, Do.END_DEADLINE),
        landed=(S.VERIFYING, Do.VERIFY),
        writing=(S.SENT, Do.NOTE_WRITING),
    ),
    # the first abort or failure stands; every word settles; a fence holds it until its end
    S.ABORTING: rules(
        abort=(S.ABORTING, Do.NOTHING),
        answer=(S.ABORTING, Do.SETTLE),
        refused=(S.ABORTING, Do.SETTLE),
        fail=(S.ABORTING, Do.SETTLE),
        peer_lost=(S.ABORTING, Do.SETTLE),
        settled=(None, Do.END_ABORTING),
        deadline=(None, Do.END_ABORTING),
        writing=(S.ABORTING, Do.NOTE_WRITING),
        fenced=(S.ABORTING, Do.SETTLE),
        fence_timeout=(None, Do.END_ABORTING),
    ),
    # every part landed, nothing writes: an abort or the deadline end it at once, the check's
    # result ends it, late words change nothing
    S.VERIFYING: rules(
        abort=(None, Do.END_ABORTED),
        answer=(S.VERIFYING, Do.NOTHING),
        refused=(S.VERIFYING, Do.NOTHING),
        fail=(S.VERIFYING, Do.NOTHING),
        deadline=(None, Do.END_DEADLINE),
        verified=(None, Do.END_DELIVERED),
        corrupt=(None, Do.END_CORRUPT),
        writing=(S.VERIFYING, Do.NOTHING),
    ),
}


def test_the_table_is_the_rules_written_here() -> None:
    assert set(RULES) == {None, *PullState}
    written = {(state, event): move for state, row in RULES.items() for event, move in row.items()}
    assert written == PULL_TRANSITIONS
    for (state, _), (nxt, do) in written.items():
        if state is not None:  # a pull in flight ends exactly when its move says how
            assert (nxt is None) == do.name.startswith("END_")


@pytest.mark.parametrize(("start", "event"), list(itertools.product(RECIPES, PullEvent)))
def test_every_pair_of_the_rules_moves_or_raises(start: str, event: PullEvent) -> None:
    t = table()
    RECIPES[start](t)
    state = RECIPE_STATE[start]
    assert t.state("t") is state
    if event in RULES[state]:
        nxt, do = RULES[state][event]
        assert t._fire("t", event)[1] is do
        if state is not None and nxt is not None:
            assert t.state("t") is nxt
    else:
        error = DuplicateTransfer if event is PullEvent.START else IllegalTransition
        with pytest.raises(error):
            t._fire("t", event)
        assert t.state("t") is state


@pytest.mark.parametrize(("start", "call"), list(itertools.product(RECIPES, CALLS)))
def test_every_public_call_from_every_state_agrees_with_the_oracle(start: str, call: str) -> None:
    t = table()
    RECIPES[start](t)
    expected = ORACLE[start][call]
    if expected is Dup or expected is X:
        with pytest.raises(expected):
            CALLS[call](t)
        assert t.state("t") is RECIPE_STATE[start]
        return
    effects = CALLS[call](t)
    assert t.state("t") is expected
    if expected is None and RECIPE_STATE[start] is not None:  # it ended: exactly once
        assert isinstance(effects, list)
        assert len([e for e in effects if isinstance(e, Completed)]) == 1


def test_how_each_end_is_named() -> None:
    ends = {}
    for call in ["answer", "refused", "fail", "lost", "deadline"]:
        t = table()
        RECIPES["sent_to_one"](t)
        effects = t.fail("t", "unreachable", peer="p1") if call == "fail" else CALLS[call](t)
        assert isinstance(effects, list)
        [done] = [e for e in effects if isinstance(e, Completed)]
        ends[call] = done.end
    assert ends == {
        "answer": PullEnd.DELIVERED,
        "refused": PullEnd.REFUSED,
        "fail": PullEnd.UNREACHABLE,
        "lost": PullEnd.P_GONE,
        "deadline": PullEnd.DEADLINE,
    }


def test_a_pull_with_checksums_is_delivered_only_once_they_match() -> None:
    for error, end in ((None, PullEnd.DELIVERED), ("run 3 differs", PullEnd.CORRUPT)):
        t = table()
        t.start("t", 0.0, block_ids=((1, 2),))
        t.sent("t", ["p1", "p2"])
        assert t.answered("t", ok=True, peer="p1", sums=b"a") == []
        [verify] = t.answered("t", ok=True, peer="p2", sums=b"")
        assert isinstance(verify, Verify)
        assert verify.parts == (("p1", b"a"), ("p2", b"")) and verify.block_ids == ((1, 2),)
        assert t.state("t") is S.VERIFYING
        [done] = t.verified("t", error)
        assert isinstance(done, Completed) and done.end is end and done.reason == (error or "")
        assert t.verified("t", None) == []  # ended: a late result is ignored
