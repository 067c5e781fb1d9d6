"""The proxy exchange's sans-IO record (pdactors/core/exchange.py): every (phase, event) pair of
its transition table (pdactors/core/exchange_rules.py) against rules written out by hand, the
effects each legal pair gives, every flow as a path through the table, what follows a failure
(pdactors/core/exchange_next.py), and the effects that give back what an exchange holds,
exactly once."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdactors.core.exchange import ExchangeState
from pdactors.core.exchange_effects import (
    Admit,
    CancelLegs,
    DGoesOn,
    Effect,
    Ended,
    FellBack,
    FirstChunk,
    FreeAtP,
    FreshLeg,
    Hold,
    Migrate,
    PFirstPath,
    Placed,
    PromptCounted,
    Release,
    Retried,
    SecondChunk,
    Step,
    Unhold,
)
from pdactors.core.exchange_next import Next, Policy, after_failure, retry_reason
from pdactors.core.exchange_rules import TRANSITIONS, Do, Event, Flow, Phase, flow_for
from pdactors.errors import IllegalTransition


@dataclass(frozen=True)
class Cause:
    outcome: str = "decode_error"
    status: int = 502
    message: str = "failed"
    retry: str = ""
    fallback: str = ""


KV_MISSING = Cause(retry="decode_failed")  # D failed before its first token
P_DOWN = Cause("prefill_error", message="P down")
P_400 = Cause("prefill_error", status=400)
TOKENS = 10
P, D = "P-engine", "D-engine"  # the engines' handles (not the legs' names "p" and "d")
DEFAULT = Policy()  # the operator's defaults: fall back to D, up to 3 migrations


def record(arrived: float = 0.0, **kw: object) -> ExchangeState[str]:
    return ExchangeState(arrived, P, D, prompt_tokens=TOKENS, **kw)  # type: ignore[arg-type]


def started(flow: Flow, arrived: float = 0.0, **kw: object) -> ExchangeState[str]:
    ex = record(arrived, **kw)
    ex.start(flow, arrived, TOKENS, why="pinned")
    return ex


#: How to bring a record to each phase by a legal path.
RECIPES: dict[Phase, Callable[[], ExchangeState[str]]] = {
    Phase.NEW: record,
    Phase.AT_P: lambda: started(Flow.P_FIRST),
    Phase.P_ANSWERS: lambda: _then(
        started(Flow.P_FIRST),
        lambda ex: ex.p_ended(0.5, status=200),
        lambda ex: ex.p_answer(TOKENS, ends=True),
    ),
    Phase.TO_D: lambda: _then(
        started(Flow.P_FIRST),
        lambda ex: ex.p_ended(0.5, status=200),
        lambda ex: ex.p_answer(TOKENS, ends=False),
    ),
    Phase.OPEN: lambda: started(Flow.CONCURRENT),
    Phase.D_ANSWERING: lambda: _then(started(Flow.CONCURRENT), lambda ex: ex.d_answered(0.5)),
    Phase.FAILED_AT_P: lambda: _then(
        started(Flow.P_FIRST),
        lambda ex: ex.p_ended(0.5, status=None),
        lambda ex: ex.p_failed(P_DOWN),
    ),
    Phase.FAILED: lambda: _then(started(Flow.CONCURRENT), lambda ex: ex.fail(KV_MISSING)),
    Phase.DONE: lambda: _then(started(Flow.CONCURRENT), lambda ex: ex.end("ok", 1.0)),
}


def _then(
    ex: ExchangeState[str], *steps: Callable[[ExchangeState[str]], object]
) -> ExchangeState[str]:
    for step in steps:
        step(ex)
    return ex


#: One call of the record's per event.
FIRE: dict[Event, Callable[[ExchangeState[str]], list[Effect]]] = {
    Event.START_P_FIRST: lambda ex: ex.start(Flow.P_FIRST, 1.0, TOKENS, why="pinned"),
    Event.START_CONCURRENT: lambda ex: ex.start(Flow.CONCURRENT, 1.0, TOKENS, why="pinned"),
    Event.START_LOCAL: lambda ex: ex.start(Flow.LOCAL, 1.0, TOKENS, why="pinned"),
    Event.START_WHOLE_ON_P: lambda ex: ex.start(Flow.WHOLE_ON_P, 1.0, TOKENS, why="pinned"),
    Event.P_ENDED: lambda ex: ex.p_ended(1.0, status=200),
    Event.P_FAILED: lambda ex: ex.p_failed(P_DOWN),
    Event.P_REFUSED: lambda ex: ex.p_failed(P_400),
    Event.ENDS_AT_P: lambda ex: ex.p_answer(TOKENS, ends=True),
    Event.GOES_ON: lambda ex: ex.p_answer(TOKENS, ends=False),
    Event.STREAM_OPENED: lambda ex: ex.stream_opened(),
    Event.P_TOKEN_SENT: lambda ex: ex.p_token_sent(1.0),
    Event.D_ASKED: lambda ex: ex.d_asked(1.0),
    Event.D_ANSWERED: lambda ex: ex.d_answered(1.0),
    Event.D_CHUNK: lambda ex: ex.d_chunk(1.0),
    Event.FAIL: lambda ex: ex.fail(KV_MISSING),
    Event.FALL_BACK: lambda ex: ex.fall_back(1.0, TOKENS),
    Event.RETRY: lambda ex: ex.retry(1.0, TOKENS),
    Event.MIGRATE: lambda ex: ex.migrate("d2"),
    Event.END: lambda ex: ex.end("ok", 1.0),
}


def test_every_event_has_a_call_and_every_phase_a_recipe() -> None:
    assert set(FIRE) == set(Event)
    assert set(RECIPES) == set(Phase)
    for phase, recipe in RECIPES.items():
        assert recipe().phase is phase


S, E = Phase, Event
Move = tuple[Phase, Do]


def rules(**moves: Move) -> dict[Event, Move]:
    """One phase's legal events (by name) and where each leads; every other is illegal."""
    return {E[name.upper()]: move for name, move in moves.items()}


#: The rules written out again by hand from the module docstring of exchange_rules (not read
#: from TRANSITIONS): an edit of the table must be made here too.
RULES: dict[Phase, dict[Event, Move]] = {
    # routed: admitted in one of the four flows, nothing else
    S.NEW: rules(
        start_p_first=(S.AT_P, Do.ADMIT_PAIR),
        start_concurrent=(S.OPEN, Do.ADMIT_PAIR),
        start_local=(S.OPEN, Do.ADMIT_ALONE),
        start_whole_on_p=(S.OPEN, Do.ADMIT_ALONE),
    ),
    # P-first, P computing: its leg ends, it fails (its 4xx too), or its token ends the
    # answer or goes on to D; the client may go away. No D yet, nothing sent yet.
    S.AT_P: rules(
        p_ended=(S.AT_P, Do.GIVE_BACK_P),
        p_failed=(S.FAILED_AT_P, Do.FAIL),
        p_refused=(S.FAILED_AT_P, Do.FAIL),
        ends_at_p=(S.P_ANSWERS, Do.LEARN_PROMPT),
        goes_on=(S.TO_D, Do.LEARN_PROMPT),
        end=(S.DONE, Do.GIVE_BACK),
    ),
    # P's token is the answer: the stream opens, the token goes, it ends
    S.P_ANSWERS: rules(
        stream_opened=(S.P_ANSWERS, Do.OPEN_STREAM),
        p_token_sent=(S.P_ANSWERS, Do.FIRST_CHUNK),
        end=(S.DONE, Do.GIVE_BACK),
    ),
    # D continues after P's token: the stream opens, P's token goes, D is asked
    S.TO_D: rules(
        stream_opened=(S.TO_D, Do.OPEN_STREAM),
        p_token_sent=(S.TO_D, Do.FIRST_CHUNK),
        d_asked=(S.OPEN, Do.NOTE_ASKED),
        end=(S.DONE, Do.GIVE_BACK),
    ),
    # D asked: P's leg beside it ends, fails (noted) or refuses (the request's fault); D's
    # answer begins, or D fails
    S.OPEN: rules(
        p_ended=(S.OPEN, Do.GIVE_BACK_P),
        p_failed=(S.OPEN, Do.NOTE_P),
        p_refused=(S.FAILED, Do.FAIL),
        d_answered=(S.D_ANSWERING, Do.NOTE_ANSWERED),
        fail=(S.FAILED, Do.FAIL),
        end=(S.DONE, Do.GIVE_BACK),
    ),
    # D answering: as OPEN for P's leg; the stream opens, chunks are relayed, D may fail
    S.D_ANSWERING: rules(
        p_ended=(S.D_ANSWERING, Do.GIVE_BACK_P),
        p_failed=(S.D_ANSWERING, Do.NOTE_P),
        p_refused=(S.FAILED, Do.FAIL),
        stream_opened=(S.D_ANSWERING, Do.OPEN_STREAM),
        d_chunk=(S.D_ANSWERING, Do.CHUNK),
        fail=(S.FAILED, Do.FAIL),
        end=(S.DONE, Do.GIVE_BACK),
    ),
    # P failed before its token: D alone serves it, or the failure is told
    S.FAILED_AT_P: rules(
        fall_back=(S.OPEN, Do.ALONE_ON_D),
        end=(S.DONE, Do.GIVE_BACK),
    ),
    # failed: later failures are echoes, a chunk in hand teaches nothing; D is asked again,
    # another engine continues, or the failure is told
    S.FAILED: rules(
        p_ended=(S.FAILED, Do.GIVE_BACK_P),
        p_failed=(S.FAILED, Do.NOTE_P),
        p_refused=(S.FAILED, Do.ECHO),
        d_chunk=(S.FAILED, Do.NOTHING),
        fail=(S.FAILED, Do.ECHO),
        retry=(S.OPEN, Do.D_COMPUTES),
        migrate=(S.OPEN, Do.MOVE_D),
        end=(S.DONE, Do.GIVE_BACK),
    ),
    # ended: P's leg in its grace, a late failure or a second end change nothing
    S.DONE: rules(
        p_ended=(S.DONE, Do.NOTHING),
        p_failed=(S.DONE, Do.NOTHING),
        p_refused=(S.DONE, Do.NOTHING),
        fail=(S.DONE, Do.NOTHING),
        end=(S.DONE, Do.NOTHING),
    ),
}

#: The kinds of effects each legal pair gives from its phase's recipe, by hand.
# fmt: off
EFFECTS: dict[tuple[Phase, Event], list[type]] = {
    **{(S.NEW, e): [Placed, Admit, Hold] for e in (E.START_P_FIRST, E.START_CONCURRENT,
                                                   E.START_LOCAL, E.START_WHOLE_ON_P)},
    (S.AT_P, E.P_ENDED): [Unhold, Release],
    (S.AT_P, E.P_FAILED): [CancelLegs],
    (S.AT_P, E.P_REFUSED): [CancelLegs],
    (S.AT_P, E.ENDS_AT_P): [PFirstPath],
    (S.AT_P, E.GOES_ON): [PFirstPath],
    (S.AT_P, E.END): [Unhold, Release, Release, Ended],  # P's queue, P's count, D's count
    (S.P_ANSWERS, E.STREAM_OPENED): [],
    (S.P_ANSWERS, E.P_TOKEN_SENT): [FirstChunk],
    (S.P_ANSWERS, E.END): [Release, Ended],
    (S.TO_D, E.STREAM_OPENED): [],
    (S.TO_D, E.P_TOKEN_SENT): [FirstChunk],
    (S.TO_D, E.D_ASKED): [],
    (S.TO_D, E.END): [Release, Ended],
    (S.OPEN, E.P_ENDED): [Unhold, Release],
    (S.OPEN, E.P_FAILED): [DGoesOn],
    (S.OPEN, E.P_REFUSED): [CancelLegs],
    (S.OPEN, E.D_ANSWERED): [],
    (S.OPEN, E.FAIL): [CancelLegs],
    (S.OPEN, E.END): [Unhold, Release, Release, Ended],
    (S.D_ANSWERING, E.P_ENDED): [Unhold, Release],
    (S.D_ANSWERING, E.P_FAILED): [DGoesOn],
    (S.D_ANSWERING, E.P_REFUSED): [CancelLegs],
    (S.D_ANSWERING, E.STREAM_OPENED): [],
    (S.D_ANSWERING, E.D_CHUNK): [FirstChunk],
    (S.D_ANSWERING, E.FAIL): [CancelLegs],
    (S.D_ANSWERING, E.END): [Unhold, Release, Release, Ended],
    (S.FAILED_AT_P, E.FALL_BACK): [FellBack, Placed, FreshLeg, Hold],
    (S.FAILED_AT_P, E.END): [Release, Ended],  # P's queue and count went at its leg's end
    (S.FAILED, E.P_ENDED): [Unhold, Release],
    (S.FAILED, E.P_FAILED): [],  # noted, not logged: the request failed already
    (S.FAILED, E.P_REFUSED): [CancelLegs],
    (S.FAILED, E.D_CHUNK): [],
    (S.FAILED, E.FAIL): [CancelLegs],
    (S.FAILED, E.RETRY): [Retried, FreshLeg, FreeAtP, Unhold, Hold],  # D's pull given up
    (S.FAILED, E.MIGRATE): [FreeAtP, Unhold, Migrate, FreshLeg],
    (S.FAILED, E.END): [Unhold, Release, Release, Ended],
    **{(S.DONE, e): [] for e in (E.P_ENDED, E.P_FAILED, E.P_REFUSED, E.FAIL, E.END)},
}
# fmt: on


def test_the_table_is_the_rules_written_out_by_hand() -> None:
    written = {
        (phase, event): move for phase, moves in RULES.items() for event, move in moves.items()
    }
    assert TRANSITIONS == written
    assert set(EFFECTS) == set(written)


@pytest.mark.parametrize(
    ("phase", "event"), list(itertools.product(Phase, Event)), ids=lambda x: x.value
)
def test_every_pair_moves_as_the_rules_say_with_its_effects_or_raises(
    phase: Phase, event: Event
) -> None:
    ex = RECIPES[phase]()
    move = RULES[phase].get(event)
    if move is None:
        with pytest.raises(IllegalTransition):
            FIRE[event](ex)
        assert ex.phase is phase  # an illegal event changes nothing
        return
    effects = FIRE[event](ex)
    assert ex.phase is move[0]
    assert [type(e) for e in effects] == EFFECTS[phase, event]


def test_the_table_names_only_real_phases_and_events_and_done_is_final() -> None:
    for (phase, event), (after, do) in TRANSITIONS.items():
        assert isinstance(phase, Phase) and isinstance(event, Event)
        assert isinstance(after, Phase) and isinstance(do, Do)
        if phase is Phase.DONE:
            assert (after, do) == (Phase.DONE, Do.NOTHING)
    assert all(after is not Phase.NEW for after, _ in TRANSITIONS.values())
    assert {do for _, do in TRANSITIONS.values()} == set(Do)  # every effect kind is used


def test_the_flow_of_each_placement() -> None:
    assert flow_for("disaggregated", p_first=True) is Flow.P_FIRST
    assert flow_for("disaggregated", p_first=False) is Flow.CONCURRENT
    for p_first in (True, False):
        assert flow_for("local", p_first=p_first) is Flow.LOCAL
        assert flow_for("whole-on-p", p_first=p_first) is Flow.WHOLE_ON_P


# --------------------------------------------------------------------------- the flows, end to end


def test_a_new_record_holds_nothing_and_has_no_flow_yet() -> None:
    ex = record()
    assert ex.phase is Phase.NEW and ex.flow is None and ex.fallback is None
    assert ex.placed_why == "" and ex.prefilling is None and ex.cause is None
    assert (ex.p, ex.d, ex.tried, ex.failed_engines) == (P, D, [D], [])
    assert ex.p_answered_at is None and ex.d_answered_at is None and not ex.streaming
    assert ex.answer.first_sent is None and ex.answer.d_sent is None


def test_p_first_continued_on_d_stream() -> None:
    ex = record(10.0, prompt_chars=40)
    assert ex.start(Flow.P_FIRST, 10.0, 25, why="short") == [
        Placed("disaggregated", "short"), Admit(P, D), Hold(P, TOKENS, D)
    ]  # fmt: skip
    assert ex.phase is Phase.AT_P and ex.placement == "disaggregated" and ex.fallback is None
    assert ex.placed_why == "short" and ex.prefilling == "p"
    assert ex.p_ended(10.2, status=200) == [Unhold(P, TOKENS, D, 25, pytest.approx(0.2)),
                                            Release(P)]  # fmt: skip
    assert ex.p_answered_at == 10.2
    assert ex.p_answer(12, ends=False) == [PromptCounted(40, 12), PFirstPath("continued_on_d")]
    assert ex.prompt_tokens == 12 and ex.phase is Phase.TO_D
    assert ex.stream_opened() == [] and ex.streaming
    assert ex.p_token_sent(10.3) == [FirstChunk(pytest.approx(0.3))]
    assert ex.d_asked(10.3) == [] and ex.phase is Phase.OPEN
    assert ex.d_answered(10.4) == [] and ex.d_answered_at == 10.4
    # timed from the request's arrival; D's catch-up from when it was asked
    assert ex.d_chunk(10.5) == [SecondChunk(pytest.approx(0.5), pytest.approx(0.2), 12)]
    assert ex.d_chunk(10.55) == []  # only D's first chunk is timed, even given a time
    ex.d_chunk(None)
    # D's step from its own 3 chunks (2 gaps in 0.2 s); the client's time per chunk from P's
    # token at 10.3, D's catch-up included (3 gaps in 0.4 s).
    effects = ex.end("ok", 10.7)
    assert effects[0] == Release(D) and effects[-1] == Ended("ok", pytest.approx(0.7))
    (step,) = [e for e in effects if isinstance(e, Step)]
    assert (step.seconds, step.gaps) == (pytest.approx(0.1), 2)
    assert step.per_chunk == pytest.approx(0.4 / 3)


def test_p_first_ended_at_p() -> None:
    ex = started(Flow.P_FIRST, 10.0)
    ex.p_ended(10.2, status=200)
    assert ex.p_answer(TOKENS, ends=True) == [PFirstPath("ended_at_p")]  # no characters counted
    ex.stream_opened()
    assert ex.p_token_sent(10.3) == [FirstChunk(pytest.approx(0.3))]
    assert ex.end("ok", 10.4) == [Release(D), Ended("ok", pytest.approx(0.4))]


def test_p_first_falls_back_to_d() -> None:
    ex = started(Flow.P_FIRST, 10.0)
    assert ex.p_ended(10.2, status=None) == [Unhold(P, TOKENS, D, TOKENS, None), Release(P)]
    assert ex.p_answered_at is None  # no answer came
    cut = Cause("prefill_error", message="x", fallback="p_unhealthy")
    assert ex.p_failed(cut) == [CancelLegs()]
    assert ex.phase is Phase.FAILED_AT_P and ex.cause is cut
    assert after_failure(ex, 10.25, Policy()) is Next.FALL_BACK
    assert ex.fall_back(10.3, 30) == [  # (P's engine may have finished the prompt: freed)
        FellBack("p_unhealthy", cut), Placed("local", None), FreshLeg(), FreeAtP(P),
        Hold(D, TOKENS, None),
    ]  # fmt: skip
    assert ex.flow is Flow.LOCAL and ex.placement == "local" and ex.fallback == "p_unhealthy"
    assert ex.cause is None and ex.prefilling == "d" and ex.phase is Phase.OPEN
    ex.d_answered(10.4)
    # D's first chunk is the client's first, and ends D's prefill
    assert ex.d_chunk(10.5) == [
        Unhold(D, TOKENS, None, 30, pytest.approx(0.2)), FirstChunk(pytest.approx(0.5))
    ]  # fmt: skip
    assert ex.outcome is None  # until it ends
    assert ex.end("ok", 11.0)[-1] == Ended("ok", 1.0) and ex.outcome == "ok"


def test_a_fall_back_is_prefill_failed_by_default_and_undoes_a_hold_still_at_p() -> None:
    ex = started(Flow.P_FIRST)
    ex.p_failed(P_DOWN)  # (P's leg not ended yet: its prompt is still in P's queue)
    assert ex.fall_back(1.0, TOKENS) == [
        FellBack("prefill_failed", P_DOWN), Placed("local", None), FreshLeg(),
        Unhold(P, TOKENS, D, TOKENS, None), Hold(D, TOKENS, None),
    ]  # fmt: skip
    assert ex.end("cancelled", 2.0) == [
        Unhold(D, TOKENS, None, TOKENS, None), Release(P), Release(D), CancelLegs(),
        Ended("cancelled", None),
    ]  # fmt: skip


def test_ps_500_is_ps_own_failure_and_its_499_the_requests() -> None:
    for status, phase in ((499, Phase.FAILED), (500, Phase.OPEN)):
        ex = started(Flow.CONCURRENT)
        ex.p_failed(Cause("prefill_error", status=status))  # beside D: refused, or noted
        assert ex.phase is phase, status
    ex = started(Flow.P_FIRST, deadline=10.0)
    p_500 = Cause("prefill_error", status=500)
    ex.p_failed(p_500)
    assert after_failure(ex, 1.0, DEFAULT) is Next.FALL_BACK
    assert ex.fall_back(1.0, TOKENS)[0] == FellBack("prefill_failed", p_500)
    ex = started(Flow.P_FIRST, deadline=10.0)
    ex.p_failed(Cause("prefill_error", status=499))
    assert after_failure(ex, 1.0, DEFAULT) is Next.TELL
    with pytest.raises(IllegalTransition, match="4xx"):
        ex.fall_back(1.0, TOKENS)


def test_ps_4xx_before_its_token_is_never_a_fall_back() -> None:
    ex = started(Flow.P_FIRST)
    ex.p_ended(1.0, status=400)
    assert ex.p_answered_at == 1.0  # an answer came, not a good one
    assert ex.p_failed(P_400) == [CancelLegs()] and ex.phase is Phase.FAILED_AT_P
    assert after_failure(ex, 1.0, Policy()) is Next.TELL
    with pytest.raises(IllegalTransition, match="4xx"):
        ex.fall_back(1.0, TOKENS)
    assert ex.phase is Phase.FAILED_AT_P and ex.cause is P_400


def test_the_concurrent_flow() -> None:
    ex = record(10.0)
    assert ex.start(Flow.CONCURRENT, 10.0, 25, why="pinned") == [
        Placed("disaggregated", "pinned"), Admit(P, D), Hold(P, TOKENS, D)
    ]  # fmt: skip
    assert ex.prefilling == "p" and ex.phase is Phase.OPEN
    assert ex.d_answered(10.5) == []
    ex.stream_opened()
    assert ex.d_chunk(11.0) == [FirstChunk(1.0)]
    assert ex.d_chunk(None) == []  # only counted: no clock read per chunk
    assert ex.d_chunk(None) == []
    assert ex.p_ended(12.0, status=200) == [Unhold(P, TOKENS, D, 25, 2.0), Release(P)]
    # D's step is learnt from the stream's span: 3 chunks, 2 gaps in 2 s.
    assert ex.end("ok", 13.0) == [Release(D), Step(1.0, 2, 1.0), Ended("ok", 3.0)]
    assert ex.over and ex.outcome == "ok"
    assert ex.p_ended(13.1, status=None) == []  # P's leg in its grace: nothing left
    assert ex.end("cancelled", 13.2) == []  # an echo


def test_local_and_whole_on_p_one_engine_whose_first_chunk_ends_its_prefill() -> None:
    for flow, placement in ((Flow.LOCAL, "local"), (Flow.WHOLE_ON_P, "whole-on-p")):
        ex = record()
        assert ex.start(flow, 0.0, TOKENS, why="no_prefill", fallback="no_prefill") == [
            Placed(placement, "no_prefill"), FellBack("no_prefill", None), Admit(None, D),
            Hold(D, TOKENS, None),
        ]  # fmt: skip
        ex.d_answered(0.1)
        assert ex.d_chunk(0.5) == [Unhold(D, TOKENS, None, TOKENS, 0.5), FirstChunk(0.5)]
        assert ex.end("ok", 1.0) == [Release(D), Ended("ok", 1.0)]  # no P to give back


def test_the_first_failure_is_the_cause_and_a_late_one_changes_nothing() -> None:
    ex = RECIPES[Phase.D_ANSWERING]()
    first, second = Cause("prefill_error", status=400), Cause("decode_error")
    assert ex.p_failed(first) == [CancelLegs()]  # P's 4xx: the request's own fault
    assert ex.fail(second) == [CancelLegs()]
    assert ex.cause is first
    assert ex.d_chunk(2.0) == []  # a chunk in hand when the failure came teaches nothing
    effects = ex.end("prefill_error", 3.0)
    assert effects == [
        Unhold(P, TOKENS, D, TOKENS, None), Release(P), Release(D), CancelLegs(),
        Ended("prefill_error", None),
    ]  # fmt: skip
    assert ex.fail(second) == [] and ex.cause is first


def test_p_failing_beside_d_cancels_nothing_and_is_kept_for_the_message() -> None:
    """The concurrent flow: P's failure is noted (logged once), D's answer decides."""
    for phase in (Phase.OPEN, Phase.D_ANSWERING):
        ex = RECIPES[phase]()
        first, second = P_DOWN, Cause("timeout", status=504)
        assert ex.p_failed(first) == [DGoesOn(first)] and ex.phase is phase
        assert ex.p_failed(second) == [] and ex.p_cause is first
        assert ex.cause is None
    ex = RECIPES[Phase.D_ANSWERING]()
    ex.p_failed(P_DOWN)
    assert ex.d_chunk(1.0) == [FirstChunk(1.0)]
    assert ex.end("ok", 2.0)[-1] == Ended("ok", 2.0)
    ex = RECIPES[Phase.FAILED]()
    assert ex.p_failed(P_DOWN) == [] and ex.p_cause is P_DOWN  # kept, not logged


def test_two_chunks_of_d_teach_one_gap() -> None:
    ex = RECIPES[Phase.D_ANSWERING]()
    ex.d_chunk(1.0)
    ex.d_chunk(None)
    (step,) = [e for e in ex.end("ok", 1.5) if isinstance(e, Step)]
    assert step == Step(0.5, 1, 0.5)


def test_a_stream_that_did_not_end_well_teaches_no_step() -> None:
    ex = RECIPES[Phase.D_ANSWERING]()
    ex.d_chunk(1.0)
    ex.d_chunk(None)
    effects = ex.end("decode_error", 9.0)  # its last gap may be a stall
    assert not any(isinstance(e, Step) for e in effects)


def test_ds_first_chunk_needs_its_time_and_the_stream_opens_once() -> None:
    ex = RECIPES[Phase.D_ANSWERING]()
    with pytest.raises(IllegalTransition, match="needs its time"):
        ex.d_chunk(None)
    assert not ex.d_relayed  # nothing counted
    ex.stream_opened()
    with pytest.raises(IllegalTransition, match="opened twice"):
        ex.stream_opened()


def test_a_prompt_sits_in_one_queue() -> None:
    """Every move of the prompt (admission, fall-back, retry, migration) takes it out of the
    queue it was in first: whatever path, at most one Hold is outstanding."""
    ex = started(Flow.CONCURRENT)  # at P
    ex.fail(KV_MISSING)
    assert ex.retry(1.0, TOKENS)[-2:] == [Unhold(P, TOKENS, D, TOKENS, None), Hold(D, TOKENS, None)]
    ex.fail(Cause())
    assert ex.migrate("d2")[0] == Unhold(D, TOKENS, None, TOKENS, None)
    assert ex.prefilling is None


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from(list(Flow)),
    st.lists(st.sampled_from([e for e in Event if not e.name.startswith("START")]), max_size=14),
)
def test_every_count_is_given_back_exactly_once(flow: Flow, events: list[Event]) -> None:
    """Whatever legal events come in whatever order in whatever flow, the counts the effects
    raise never go below zero and are all back at zero once the exchange ended."""
    ex = record()
    counts: dict[str, int] = {}

    def add(key: object, n: int) -> None:
        counts[str(key)] = counts.get(str(key), 0) + n

    def apply(effects: list[Effect]) -> None:
        for effect in effects:
            match effect:
                case Admit(p=p, d=d):
                    if p is not None:
                        add(p, 1)
                    add(d, 1)
                    add("in_flight", 1)
                case Hold(engine=engine, tokens=t, waiting=waiting):
                    add(f"queue_{engine}", t)
                    if waiting is not None:
                        add(f"incoming_{waiting}", 1)
                case Unhold(engine=engine, tokens=t, waiting=waiting):
                    add(f"queue_{engine}", -t)
                    if waiting is not None:
                        add(f"incoming_{waiting}", -1)
                case Release(engine=engine):
                    add(engine, -1)
                case Migrate(frm=frm, to=to):
                    add(frm, -1)
                    add(to, 1)
                case Ended():
                    add("in_flight", -1)
                    add("ended", 1)
        assert min(counts.values(), default=0) >= 0

    apply(ex.start(flow, 0.0, TOKENS, why="pinned"))
    for i, event in enumerate(events):
        if (ex.phase, event) not in TRANSITIONS:
            continue
        if event is Event.MIGRATE:
            apply(ex.migrate(f"d{i}"))
            continue
        try:
            apply(FIRE[event](ex) if event is not Event.D_CHUNK else ex.d_chunk(float(i)))
        except IllegalTransition:  # a guard (a second retry, the stream opened twice...)
            continue
    apply(ex.end("cancelled", 100.0))
    assert counts.pop("ended") == 1
    assert set(counts.values()) == {0}


# --------------------------------------------------------------------------- retries


def test_a_retry_moves_the_prompt_to_d_and_keeps_the_first_failure() -> None:
    ex = started(Flow.CONCURRENT)
    ex.d_answered(0.5)
    assert ex.fail(KV_MISSING) == [CancelLegs()]
    assert ex.may_retry and after_failure(ex, 1.0, Policy()) is Next.RETRY
    assert ex.retry(1.0, 30) == [
        Retried("decode_failed", KV_MISSING), FreshLeg(), FreeAtP(P),
        Unhold(P, TOKENS, D, TOKENS, None), Hold(D, TOKENS, None),
    ]  # fmt: skip
    assert ex.phase is Phase.OPEN and ex.cause is None and ex.retried_after is KV_MISSING
    assert ex.prefilling == "d" and not ex.may_retry
    ex.d_answered(1.2)
    # D computed the prompt itself: its first chunk ends that prefill (the placer learns it)
    assert ex.d_chunk(1.5) == [Unhold(D, TOKENS, None, 30, 0.5), FirstChunk(1.5)]
    assert ex.end("ok", 2.0) == [Release(P), Release(D), Ended("ok", 2.0)]


def _freed(effects: list[Effect]) -> list[Effect]:
    return [e for e in effects if isinstance(e, FreeAtP)]


def test_p_is_told_to_free_the_kv_it_keeps_once_ds_leg_is_given_up_and_only_then() -> None:
    """P keeps the prompt's KV for D's pull in the concurrent flow from its start and in the
    P-first flow once its token did not end the answer: giving D's leg up (asked again, moved
    to another engine, the request ending otherwise than ok) frees it at P, once; a request
    served ok, P's own 4xx, and a P-first answer P's token ended keep nothing at P."""
    # a migration, then the end: told once
    ex = RECIPES[Phase.TO_D]()
    ex.d_asked(0.6)
    ex.fail(KV_MISSING)
    assert _freed(ex.migrate("D2")) == [FreeAtP(P)]
    ex.fail(KV_MISSING)
    assert _freed(ex.end("decode_error", 2.0)) == []  # told already
    # the concurrent flow, ended by the client before D answered
    ex = started(Flow.CONCURRENT)
    assert _freed(ex.end("cancelled", 1.0)) == [FreeAtP(P)]
    # served ok: D pulled it
    ex = RECIPES[Phase.TO_D]()
    ex.d_asked(0.6)
    ex.d_answered(0.7)
    assert _freed(ex.end("ok", 1.0)) == []
    # P-first, before P's token: P keeps nothing yet (its leg, closed, aborts its request)
    ex = started(Flow.P_FIRST)
    assert _freed(ex.end("cancelled", 1.0)) == []
    # P's token ended the answer: P freed the KV itself
    ex = RECIPES[Phase.P_ANSWERS]()
    assert _freed(ex.end("cancelled", 1.0)) == []
    # P refused the request (its 4xx): it computed nothing
    ex = started(Flow.CONCURRENT)
    ex.p_failed(P_400)
    assert _freed(ex.end("prefill_error", 1.0)) == []
    # a local request never asked P
    ex = started(Flow.LOCAL)
    ex.fail(KV_MISSING)
    assert _freed(ex.end("decode_error", 1.0)) == []


def test_a_p_first_retry_after_ps_token_is_no_catch_up() -> None:
    ex = RECIPES[Phase.TO_D]()
    ex.stream_opened()
    ex.p_token_sent(0.3)
    ex.d_asked(0.3)
    ex.d_answered(0.4)
    ex.fail(KV_MISSING)
    effects = ex.retry(1.0, TOKENS)
    assert effects[-1] == Hold(D, TOKENS, None)
    assert not any(isinstance(e, Unhold) for e in effects)  # P's queue was given back already
    ex.d_answered(1.2)
    assert ex.d_chunk(1.5) == [Unhold(D, TOKENS, None, TOKENS, 0.5), SecondChunk(1.5, None, TOKENS)]


def test_a_retry_comes_once_and_never_after_ds_answer_was_relayed() -> None:
    ex = RECIPES[Phase.D_ANSWERING]()
    ex.d_chunk(1.0)
    ex.fail(KV_MISSING)
    assert not ex.may_retry
    with pytest.raises(IllegalTransition, match="relayed"):
        ex.retry(2.0, TOKENS)
    ex = RECIPES[Phase.FAILED]()
    ex.retry(1.0, TOKENS)
    ex.fail(KV_MISSING)
    with pytest.raises(IllegalTransition, match="retried already"):
        ex.retry(2.0, TOKENS)
    assert ex.phase is Phase.FAILED
    with pytest.raises(IllegalTransition):
        RECIPES[Phase.OPEN]().retry(1.0, TOKENS)


def test_a_d_that_computed_the_prompt_is_never_retried() -> None:
    for flow in (Flow.LOCAL, Flow.WHOLE_ON_P):
        ex = started(flow)
        ex.fail(KV_MISSING)
        assert retry_reason(ex, 1.0) is None
        with pytest.raises(IllegalTransition, match="computed the prompt"):
            ex.retry(1.0, TOKENS)
        assert ex.phase is Phase.FAILED


def test_only_ds_own_failure_of_a_kv_leg_is_retried_once_with_nothing_relayed() -> None:
    broke = Cause(retry="decode_broke")
    refused, timeout = Cause(), Cause("timeout", status=504)
    passed_4xx = Cause(status=400)
    for failure, why in ((KV_MISSING, "decode_failed"), (broke, "decode_broke"),
                         (refused, None), (timeout, None), (passed_4xx, None)):  # fmt: skip
        for flow in (Flow.CONCURRENT, Flow.P_FIRST):
            ex = started(flow, deadline=100.0) if flow is Flow.CONCURRENT else _continued()
            ex.fail(failure)
            assert retry_reason(ex, 1.0) == why, (failure, flow)
    ex = started(Flow.CONCURRENT, deadline=1.0)
    ex.fail(KV_MISSING)
    assert retry_reason(ex, 1.0) is None  # no time left
    assert retry_reason(ex, 0.99) == "decode_failed"
    ex = started(Flow.CONCURRENT)
    ex.d_answered(0.2)
    ex.d_chunk(0.5)  # some of D's answer reached the client
    ex.fail(KV_MISSING)
    assert retry_reason(ex, 1.0) is None
    ex = RECIPES[Phase.FAILED]()
    ex.retry(1.0, TOKENS)
    ex.fail(KV_MISSING)
    assert retry_reason(ex, 2.0) is None  # once
    assert retry_reason(started(Flow.CONCURRENT), 1.0) is None  # nothing failed


def _continued() -> ExchangeState[str]:
    ex = RECIPES[Phase.TO_D]()
    ex.d_asked(0.6)
    return ex


# --------------------------------------------------------------------------- what follows a failure


def test_what_follows_a_failure_of_ps_before_its_token() -> None:
    def decided(cause: Cause, now: float = 1.0, policy: Policy = DEFAULT) -> Next:
        ex = started(Flow.P_FIRST, deadline=10.0)
        ex.p_failed(cause)
        return after_failure(ex, now, policy)

    assert decided(P_DOWN) is Next.FALL_BACK
    assert decided(Cause("prefill_error", status=500)) is Next.FALL_BACK
    assert decided(Cause("prefill_error", status=499)) is Next.TELL
    assert decided(Cause("prefill_error", fallback="p_unhealthy")) is Next.FALL_BACK
    assert decided(P_DOWN, policy=Policy(fall_back_to_d=False)) is Next.TELL
    assert decided(P_DOWN, now=10.0) is Next.TELL  # no time left
    assert decided(P_400) is Next.TELL  # the request's own fault
    assert decided(Cause("timeout", status=504)) is Next.TELL  # P's time ran out: so did D's


def test_what_follows_a_failure_of_ds() -> None:
    def decided(cause: Cause, now: float = 1.0, policy: Policy = DEFAULT, moved: int = 0) -> Next:
        ex = started(Flow.LOCAL, deadline=10.0)
        for i in range(moved):
            ex.fail(Cause())
            ex.migrate(f"d{i}")
        ex.fail(cause)
        return after_failure(ex, now, policy)

    assert decided(Cause()) is Next.MIGRATE
    assert decided(KV_MISSING) is Next.MIGRATE  # a local D is not retried: it moves
    assert decided(Cause(status=400)) is Next.TELL
    assert decided(Cause(), now=10.0) is Next.TELL
    assert decided(Cause(), policy=Policy(migration_limit=0)) is Next.TELL
    assert decided(Cause(), moved=2) is Next.MIGRATE
    assert decided(Cause(), moved=3) is Next.TELL  # the default limit: 3
    assert decided(Cause(status=500)) is Next.MIGRATE
    assert decided(Cause(status=499)) is Next.TELL
    ex = started(Flow.CONCURRENT)
    ex.fail(KV_MISSING)
    assert after_failure(ex, 1.0, Policy()) is Next.RETRY  # a retry first
    for phase in (Phase.NEW, Phase.OPEN, Phase.D_ANSWERING, Phase.DONE):
        with pytest.raises(IllegalTransition, match="nothing failed"):
            after_failure(RECIPES[phase](), 1.0, Policy())
    ex = RECIPES[Phase.FAILED]()
    ex.end("decode_error", 2.0)  # the failure was told: nothing follows it any more
    assert ex.cause is KV_MISSING
    with pytest.raises(IllegalTransition, match="nothing failed"):
        after_failure(ex, 1.0, Policy())


# --------------------------------------------------------------------------- migrations


def test_a_migration_moves_d_and_keeps_each_failure_and_learns_no_step() -> None:
    ex = started(Flow.LOCAL, 10.0)
    ex.d_answered(10.05)
    ex.d_chunk(10.1)
    ex.d_chunk(None)
    first, second = Cause(message="one"), Cause(message="two")
    assert ex.fail(first) == [CancelLegs()]
    # D's prompt left its queue at its first chunk
    assert ex.migrate("d2") == [Migrate(D, "d2", 1, first), FreshLeg()]
    assert ex.phase is Phase.OPEN and ex.cause is None and ex.migrated_after == [first]
    assert ex.d == "d2" and ex.tried == [D, "d2"]
    ex.d_answered(10.2)
    ex.d_chunk(None)
    ex.fail(second)
    assert ex.migrate("d3") == [Migrate("d2", "d3", 2, second), FreshLeg()]
    assert ex.migrated_after == [first, second] and ex.failed_engines == [D, "d2"]
    ex.d_answered(10.3)
    ex.d_chunk(None)
    effects = ex.end("ok", 11.0)
    assert effects[0] == Release("d3")  # the count went with the request
    assert not any(isinstance(e, Step) for e in effects)  # three engines' gaps: not one D's
    assert effects[-1] == Ended("ok", 1.0)


def test_a_migration_before_d_answered_undoes_the_prompts_hold() -> None:
    ex = started(Flow.LOCAL, 10.0)
    cause = Cause()
    ex.fail(cause)
    assert ex.migrate("d2") == [
        Unhold(D, TOKENS, None, TOKENS, None), Migrate(D, "d2", 1, cause), FreshLeg()
    ]  # fmt: skip
    assert ex.prefilling is None


# --------------------------------------------------------------------------- the client's message


def test_the_clients_error_names_what_failed_before() -> None:
    from pdactors.proxy._asgi import Reply
    from pdactors.proxy._exchange import Exchange
    from pdactors.proxy._openai import COMPLETIONS, Failure
    from pdactors.proxy._state import Backend

    p, d = Backend("prefill", "http://p:1", "http://p:2"), Backend("decode", "http://d:1")
    state = ExchangeState(0.0, p, d, prompt_tokens=TOKENS)
    state.start(Flow.CONCURRENT, 0.0, TOKENS, why="pinned")

    async def send(message: object) -> None:
        raise AssertionError("nothing is sent")

    ex = Exchange(COMPLETIONS, True, "tid", [], [], "p-id", state, Reply(send))
    state.p_failed(Failure.of(502, "prefill engine http://p:1 failed: gone",
                              "upstream_error", "prefill_error"))  # fmt: skip
    state.fail(Failure.of(502, "decode engine http://d:1 failed before its first token: "
                          "Internal server error", "upstream_error", "decode_error",
                          retry="decode_failed"))  # fmt: skip
    state.retry(1.0, TOKENS)
    state.fail(Failure.of(502, "decode engine http://d:1 answered HTTP 503: busy",
                          "upstream_error", "decode_error"))  # fmt: skip
    told = ex.told()
    assert told.status == 502 and told.outcome == "decode_error"
    assert told.message == (
        "prefill engine http://p:1 failed: gone; decode engine http://d:1 failed before its "
        "first token: Internal server error; asked again to compute the prompt itself, it "
        "failed too; decode engine http://d:1 answered HTTP 503: busy"
    )
