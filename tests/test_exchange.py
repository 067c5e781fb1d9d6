"""The proxy exchange's sans-IO record (pdactors/core/exchange.py): every (phase, event) pair of
its transition table (pdactors/core/exchange_rules.py), and the effects that give back what an
exchange holds, exactly once."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdactors.core.exchange import (
    Admit,
    CancelLegs,
    Effect,
    Ended,
    ExchangeState,
    FirstChunk,
    Hold,
    Migrate,
    Release,
    SecondChunk,
    Step,
    Unhold,
)
from pdactors.core.exchange_rules import TRANSITIONS, Event, Phase
from pdactors.errors import IllegalTransition


@dataclass(frozen=True)
class Cause:
    outcome: str


TOKENS = 10


def in_phase(phase: Phase) -> ExchangeState:
    """A record brought to ``phase`` by a legal path."""
    ex = ExchangeState(0.0, TOKENS)
    steps: dict[Phase, list[Callable[[], object]]] = {
        Phase.NEW: [],
        Phase.OPEN: [lambda: ex.admit(with_p=True)],
        Phase.D_ANSWERING: [lambda: ex.admit(with_p=True), ex.d_answered],
        Phase.FAILED: [lambda: ex.admit(with_p=True), lambda: ex.fail(Cause("prefill_error"))],
        Phase.DONE: [lambda: ex.admit(with_p=True), lambda: ex.end("ok", 1.0)],
    }
    for step in steps[phase]:
        step()
    assert ex.phase is phase
    return ex


FIRE: dict[Event, Callable[[ExchangeState], list[Effect]]] = {
    Event.ADMIT: lambda ex: ex.admit(with_p=True),
    Event.PREFILL_SENT: lambda ex: ex.prefill_sent("p", 1.0, TOKENS),
    Event.PREFILL_ENDED: lambda ex: ex.prefill_ended(1.0, answered=True),
    Event.P_TOKEN_SENT: lambda ex: ex.p_token_sent(1.0),
    Event.D_ANSWERED: lambda ex: ex.d_answered(),
    Event.D_CHUNK: lambda ex: ex.d_chunk(1.0),
    Event.FAIL: lambda ex: ex.fail(Cause("decode_error")),
    Event.P_FAILED: lambda ex: ex.prefill_failed(Cause("prefill_error")),
    Event.FALL_BACK: lambda ex: ex.fall_back(),
    Event.RETRY: lambda ex: ex.retry(1.0, TOKENS),
    Event.MIGRATE: lambda ex: ex.migrate("another engine"),
    Event.END: lambda ex: ex.end("ok", 1.0),
}


def test_every_event_has_a_method() -> None:
    assert set(FIRE) == set(Event)


_N, _O, _A, _F, _D = Phase.NEW, Phase.OPEN, Phase.D_ANSWERING, Phase.FAILED, Phase.DONE
X = IllegalTransition
Outcome = Phase | type[IllegalTransition]


def row(*outcomes: Outcome) -> dict[Event, Outcome]:
    return dict(zip(Event, outcomes, strict=True))


#: The phase after each event, or the error: written from the rules in the module docstring
#: of pdactors/core/exchange_rules.py, not from its table.
# fmt: off
ORACLE: dict[Phase, dict[Event, Outcome]] = {
    # admit, prefill_sent, prefill_ended, p_token_sent, d_answered, d_chunk, fail, p_failed,
    # fall_back, retry, migrate, end
    _N: row(_O, X, X, X, X, X, X, X, X, X, X, X),
    # the prompt sent, P's leg ending, P's token sent and P failing beside D leave it open;
    # no chunk of D's before D answered
    _O: row(X, _O, _O, _O, _A, X, _F, _O, X, X, X, _D),
    # D's answer began: P's leg and fate no longer change it
    _A: row(X, X, _A, X, X, _A, _F, _A, X, X, X, _D),
    # the first failure stays; P-first falls back, D is asked again, or another engine
    # continues: open again
    _F: row(X, X, _F, X, X, _F, _F, _F, _O, _O, _O, _D),
    # the answer ended: a late leg, failure or end is an echo; nothing else may come
    _D: row(X, X, _D, X, X, X, _D, _D, X, X, X, _D),
}
# fmt: on


@pytest.mark.parametrize(
    ("phase", "event"), list(itertools.product(Phase, Event)), ids=lambda x: x.value
)
def test_every_pair_moves_as_the_oracle_says_or_raises(phase: Phase, event: Event) -> None:
    ex = in_phase(phase)
    expected = ORACLE[phase][event]
    if expected is X:
        with pytest.raises(IllegalTransition):
            FIRE[event](ex)
        assert ex.phase is phase  # an illegal event changes nothing
    else:
        FIRE[event](ex)
        assert ex.phase is expected
    assert TRANSITIONS.get((phase, event), X) is expected  # the table says the same


def test_the_table_names_only_real_phases_and_events_and_done_is_final() -> None:
    for (phase, event), after in TRANSITIONS.items():
        assert isinstance(phase, Phase) and isinstance(event, Event) and isinstance(after, Phase)
        if phase is Phase.DONE:
            assert after is Phase.DONE
    assert all(after is not Phase.NEW for after in TRANSITIONS.values())


def test_concurrent_flow_effects() -> None:
    ex = ExchangeState(10.0, TOKENS)
    assert ex.admit(with_p=True) == [Admit(p=True)]
    assert ex.prefill_sent("p", 10.0, 25) == [Hold("p", TOKENS)]
    assert ex.prefilling == "p"
    assert ex.d_answered() == []
    assert ex.d_chunk(11.0) == [FirstChunk(1.0)]
    assert ex.d_chunk(None) == []  # only counted: no clock read per chunk
    assert ex.d_chunk(None) == []
    assert ex.prefill_ended(12.0, answered=True) == [Unhold("p", TOKENS, 25, 2.0), Release("p")]
    # D's step is learnt from the stream's span: 3 chunks, 2 gaps in 2 s.
    assert ex.end("ok", 13.0) == [Release("d"), Step(1.0, 2, 1.0), Ended("ok", 3.0)]
    assert ex.over and ex.outcome == "ok"
    assert ex.prefill_ended(13.1, answered=False) == []  # P's leg in its grace: nothing left
    assert ex.end("cancelled", 13.2) == []  # an echo


def test_the_first_failure_is_the_cause_and_a_late_one_changes_nothing() -> None:
    ex = in_phase(Phase.D_ANSWERING)
    first, second = Cause("prefill_error"), Cause("decode_error")
    assert ex.fail(first) == [CancelLegs()]
    assert ex.fail(second) == [CancelLegs()]
    assert ex.cause is first
    assert ex.d_chunk(2.0) == []  # a chunk in hand when the failure came teaches nothing
    effects = ex.end("prefill_error", 3.0)
    assert effects == [Release("p"), Release("d"), CancelLegs(), Ended("prefill_error", None)]
    assert ex.fail(second) == [] and ex.cause is first


def test_local_prefill_ends_at_ds_first_chunk() -> None:
    ex = ExchangeState(0.0, TOKENS)
    assert ex.admit(with_p=False) == [Admit(p=False)]
    assert ex.prefill_sent("d", 0.0, TOKENS) == [Hold("d", TOKENS)]
    ex.d_answered()
    assert ex.d_chunk(0.5) == [Unhold("d", TOKENS, TOKENS, 0.5), FirstChunk(0.5)]
    assert ex.end("ok", 1.0) == [Release("d"), Ended("ok", 1.0)]  # no P to give back


def test_p_first_token_then_ds_second_chunk() -> None:
    ex = ExchangeState(0.0, TOKENS)
    ex.admit(with_p=True)
    ex.prefill_sent("p", 0.0, TOKENS)
    assert ex.prefill_ended(0.2, answered=True) == [Unhold("p", TOKENS, TOKENS, 0.2), Release("p")]
    assert ex.p_token_sent(0.3) == [FirstChunk(0.3)]
    ex.prompt_tokens = 12  # P said how many
    ex.d_sent = 0.3
    ex.d_answered()
    assert ex.d_chunk(0.5) == [SecondChunk(0.5, pytest.approx(0.2), 12)]
    ex.d_chunk(None)
    ex.d_chunk(None)
    # D's step from its own 3 chunks (2 gaps in 0.2 s); the client's time per chunk from P's
    # token at 0.3, D's catch-up included (3 gaps in 0.4 s).
    (step,) = [e for e in ex.end("ok", 0.7) if isinstance(e, Step)]
    assert (step.seconds, step.gaps) == (pytest.approx(0.1), 2)
    assert step.per_chunk == pytest.approx(0.4 / 3)


def test_p_first_falls_back_to_d() -> None:
    ex = ExchangeState(0.0, TOKENS)
    ex.admit(with_p=True)
    ex.prefill_sent("p", 0.0, TOKENS)
    assert ex.prefill_ended(0.2, answered=False) == [
        Unhold("p", TOKENS, TOKENS, None),
        Release("p"),
    ]
    ex.fail(Cause("prefill_error"))
    assert ex.fall_back() == []
    assert ex.phase is Phase.OPEN and ex.cause is None
    assert ex.prefill_sent("d", 0.3, TOKENS) == [Hold("d", TOKENS)]
    assert ex.end("cancelled", 0.4) == [
        Unhold("d", TOKENS, TOKENS, None), Release("d"), CancelLegs(), Ended("cancelled", None)
    ]  # fmt: skip


def test_p_first_chunks_are_timed_from_the_requests_arrival() -> None:
    ex = ExchangeState(10.0, TOKENS)
    ex.admit(with_p=True)
    ex.prefill_sent("p", 10.0, TOKENS)
    ex.prefill_ended(10.2, answered=True)
    assert ex.p_token_sent(10.3) == [FirstChunk(pytest.approx(0.3))]
    ex.d_sent = 10.3
    ex.d_answered()
    assert ex.d_chunk(10.5) == [SecondChunk(pytest.approx(0.5), pytest.approx(0.2), TOKENS)]


def test_after_a_fall_back_ds_first_chunk_is_the_clients_first() -> None:
    ex = ExchangeState(10.0, TOKENS)
    ex.admit(with_p=True)
    ex.prefill_sent("p", 10.0, TOKENS)
    ex.prefill_ended(10.2, answered=False)
    ex.fail(Cause("prefill_error"))
    ex.fall_back()
    ex.prefill_sent("d", 10.3, TOKENS)
    ex.d_answered()
    assert ex.d_chunk(10.5) == [
        Unhold("d", TOKENS, TOKENS, pytest.approx(0.2)), FirstChunk(pytest.approx(0.5))
    ]  # fmt: skip
    assert ex.outcome is None  # until it ends
    assert ex.end("ok", 11.0)[-1] == Ended("ok", 1.0) and ex.outcome == "ok"


def test_two_chunks_of_d_teach_one_gap() -> None:
    ex = in_phase(Phase.D_ANSWERING)
    ex.d_chunk(1.0)
    ex.d_chunk(None)
    (step,) = [e for e in ex.end("ok", 1.5) if isinstance(e, Step)]
    assert step == Step(0.5, 1, 0.5)


def test_ds_first_chunk_needs_its_time_and_a_prompt_sits_in_one_queue() -> None:
    ex = in_phase(Phase.D_ANSWERING)
    with pytest.raises(IllegalTransition):
        ex.d_chunk(None)
    ex = in_phase(Phase.OPEN)
    ex.prefill_sent("p", 0.0, TOKENS)
    with pytest.raises(IllegalTransition, match="sent to d while at p"):
        ex.prefill_sent("d", 0.0, TOKENS)


@settings(max_examples=300, deadline=None)
@given(st.booleans(), st.lists(st.sampled_from(list(Event)), max_size=12))
def test_every_count_is_given_back_exactly_once(with_p: bool, events: list[Event]) -> None:
    """Whatever legal events come in whatever order, the counts the effects raise never go
    below zero and are all back at zero once the exchange ended."""
    ex = ExchangeState(0.0, TOKENS)
    counts = {"p": 0, "d": 0, "in_flight": 0, "queue_p": 0, "queue_d": 0, "ended": 0}

    def apply(effects: list[Effect]) -> None:
        for effect in effects:
            match effect:
                case Admit(p=p):
                    counts["p"] += p
                    counts["d"] += 1
                    counts["in_flight"] += 1
                case Hold(engine=leg, tokens=t):
                    counts[f"queue_{leg}"] += t
                case Unhold(engine=leg, tokens=t):
                    counts[f"queue_{leg}"] -= t
                case Release(engine=leg):
                    counts[leg] -= 1
                case Ended():
                    counts["in_flight"] -= 1
                    counts["ended"] += 1
        assert min(counts.values()) >= 0

    apply(ex.admit(with_p=with_p))
    for i, event in enumerate(events):
        if (ex.phase, event) not in TRANSITIONS or event is Event.ADMIT:
            continue
        if event is Event.RETRY and not ex.may_retry:
            continue  # (test_a_retry_comes_once_and_never_after_ds_answer_was_relayed)
        if event is Event.PREFILL_SENT:
            if ex.prefilling is not None:
                continue
            apply(ex.prefill_sent("p" if with_p else "d", float(i), TOKENS))
        elif event is Event.D_CHUNK:
            apply(ex.d_chunk(float(i)))
        else:
            apply(FIRE[event](ex))
    apply(ex.end("cancelled", 100.0))
    assert counts == {"p": 0, "d": 0, "in_flight": 0, "queue_p": 0, "queue_d": 0, "ended": 1}


def test_a_stream_that_did_not_end_well_teaches_no_step() -> None:
    ex = in_phase(Phase.D_ANSWERING)
    ex.d_chunk(1.0)
    ex.d_chunk(None)
    effects = ex.end("decode_error", 9.0)  # its last gap may be a stall
    assert not any(isinstance(e, Step) for e in effects)


def test_p_failing_beside_d_cancels_nothing_and_is_kept_for_the_message() -> None:
    """The concurrent flow: P's failure is noted, D's answer decides (P's fate no longer
    matters once D has the KV)."""
    for phase in (Phase.OPEN, Phase.D_ANSWERING):
        ex = in_phase(phase)
        first, second = Cause("prefill_error"), Cause("timeout")
        assert ex.prefill_failed(first) == [] and ex.phase is phase
        assert ex.prefill_failed(second) == [] and ex.p_cause is first
        assert ex.cause is None
    ex = in_phase(Phase.D_ANSWERING)
    ex.prefill_failed(Cause("prefill_error"))
    assert ex.d_chunk(1.0) == [FirstChunk(1.0)]
    assert ex.end("ok", 2.0)[-1] == Ended("ok", 2.0)


def test_a_retry_moves_the_prompt_to_d_and_keeps_the_first_failure() -> None:
    ex = ExchangeState(0.0, TOKENS)
    ex.admit(with_p=True)
    ex.prefill_sent("p", 0.0, TOKENS)
    ex.d_answered()
    kv_missing = Cause("decode_error")
    assert ex.fail(kv_missing) == [CancelLegs()]
    assert ex.may_retry
    assert ex.retry(1.0, 30) == [Unhold("p", TOKENS, TOKENS, None), Hold("d", TOKENS)]
    assert ex.phase is Phase.OPEN and ex.cause is None and ex.retried_after is kv_missing
    assert ex.prefilling == "d" and not ex.may_retry
    ex.d_answered()
    # D computed the prompt itself: its first chunk ends that prefill (the placer learns it)
    assert ex.d_chunk(1.5) == [Unhold("d", TOKENS, 30, 0.5), FirstChunk(1.5)]
    assert ex.end("ok", 2.0) == [Release("p"), Release("d"), Ended("ok", 2.0)]


def test_a_p_first_retry_after_ps_token_is_no_catch_up() -> None:
    ex = ExchangeState(0.0, TOKENS)
    ex.admit(with_p=True)
    ex.prefill_sent("p", 0.0, TOKENS)
    ex.prefill_ended(0.2, answered=True)
    ex.p_token_sent(0.3)
    ex.d_sent = 0.3
    ex.d_answered()
    ex.fail(Cause("decode_error"))
    assert ex.retry(1.0, TOKENS) == [Hold("d", TOKENS)]  # P's queue was given back already
    ex.d_answered()
    assert ex.d_chunk(1.5) == [Unhold("d", TOKENS, TOKENS, 0.5), SecondChunk(1.5, None, TOKENS)]


def test_a_retry_comes_once_and_never_after_ds_answer_was_relayed() -> None:
    ex = in_phase(Phase.D_ANSWERING)
    ex.d_chunk(1.0)
    ex.fail(Cause("decode_error"))
    assert not ex.may_retry
    with pytest.raises(IllegalTransition, match="relayed"):
        ex.retry(2.0, TOKENS)
    ex = in_phase(Phase.FAILED)
    ex.retry(1.0, TOKENS)
    ex.fail(Cause("decode_error"))
    with pytest.raises(IllegalTransition, match="retried already"):
        ex.retry(2.0, TOKENS)
    assert ex.phase is Phase.FAILED
    with pytest.raises(IllegalTransition):
        in_phase(Phase.OPEN).retry(1.0, TOKENS)


# --------------------------------------------------------------------------- the retry decision


def _exchange(deadline: float = 100.0) -> Any:
    from pdactors.core.exchange import ExchangeState
    from pdactors.proxy._exchange import Exchange
    from pdactors.proxy._openai import COMPLETIONS
    from pdactors.proxy._state import Backend

    p, d = Backend("prefill", "http://p:1", "http://p:2"), Backend("decode", "http://d:1")
    state = ExchangeState(0.0, TOKENS)
    state.admit(with_p=True)
    return Exchange(COMPLETIONS, True, p, d, "tid", deadline, [], [], "p-id", state)


def test_the_proxy_retries_only_ds_own_failure_of_a_kv_leg_once_with_nothing_relayed() -> None:
    from pdactors.proxy._openai import Failure
    from pdactors.proxy._retry import retry_reason

    local = b"{}"
    kv = Failure.of(502, "D failed before its first token", "upstream_error", "decode_error",
                    retry="decode_failed")  # fmt: skip
    broke = Failure.of(502, "D's answer broke", "upstream_error", "decode_error",
                       retry="decode_broke")  # fmt: skip
    refused = Failure.of(502, "connect refused", "upstream_error", "decode_error")
    timeout = Failure.of(504, "no answer", "timeout", "timeout")
    passed_4xx = Failure(400, b'{"error": {}}', "decode_error")
    for failure, why in ((kv, "decode_failed"), (broke, "decode_broke"), (refused, None),
                         (timeout, None), (passed_4xx, None)):  # fmt: skip
        ex = _exchange()
        ex.state.fail(failure)
        assert retry_reason(ex, local, 1.0) == why
        assert retry_reason(ex, None, 1.0) is None  # a leg that pulled no KV: nothing to gain
    ex = _exchange(deadline=1.0)
    ex.state.fail(kv)
    assert retry_reason(ex, local, 1.0) is None  # no time left
    ex = _exchange()
    ex.state.d_answered()
    ex.state.d_chunk(0.5)  # some of D's answer reached the client
    ex.state.fail(kv)
    assert retry_reason(ex, local, 1.0) is None
    ex = _exchange()
    ex.state.fail(kv)
    ex.state.retry(1.0, TOKENS)
    ex.state.fail(kv)
    assert retry_reason(ex, local, 2.0) is None  # once
    assert retry_reason(_exchange(), local, 1.0) is None  # nothing failed


def test_the_clients_error_names_what_failed_before() -> None:
    from pdactors.proxy._openai import Failure

    ex = _exchange()
    ex.state.prefill_failed(Failure.of(502, "prefill engine http://p:1 failed: gone",
                                       "upstream_error", "prefill_error"))  # fmt: skip
    ex.state.fail(Failure.of(502, "decode engine http://d:1 failed before its first token: "
                             "Internal server error", "upstream_error", "decode_error",
                             retry="decode_failed"))  # fmt: skip
    ex.state.retry(1.0, TOKENS)
    ex.state.fail(Failure.of(502, "decode engine http://d:1 answered HTTP 503: busy",
                             "upstream_error", "decode_error"))  # fmt: skip
    told = ex.told()
    assert told.status == 502 and told.outcome == "decode_error"
    assert told.message == (
        "prefill engine http://p:1 failed: gone; decode engine http://d:1 failed before its "
        "first token: Internal server error; asked again to compute the prompt itself, it "
        "failed too; decode engine http://d:1 answered HTTP 503: busy"
    )


def test_a_migration_moves_d_and_keeps_each_failure_and_learns_no_step() -> None:
    ex = ExchangeState(10.0, TOKENS)
    ex.admit(with_p=False)
    ex.prefill_sent("d", 10.0, TOKENS)
    ex.d_answered()
    ex.d_chunk(10.1)
    ex.d_chunk(None)
    first, second = Cause("decode_error"), Cause("decode_error")
    assert ex.fail(first) == [CancelLegs()]
    assert ex.migrate("d2") == [Migrate("d2")]  # D's prompt left its queue at its first chunk
    assert ex.phase is Phase.OPEN and ex.cause is None and ex.migrated_after == [first]
    ex.d_answered()
    ex.d_chunk(None)
    ex.fail(second)
    ex.migrate("d3")
    assert ex.migrated_after == [first, second]
    ex.d_answered()
    ex.d_chunk(None)
    effects = ex.end("ok", 11.0)
    assert not any(isinstance(e, Step) for e in effects)  # three engines' gaps: not one D's
    assert effects[-1] == Ended("ok", 1.0)


def test_a_migration_before_d_answered_undoes_the_prompts_hold() -> None:
    ex = ExchangeState(10.0, TOKENS)
    ex.admit(with_p=False)
    ex.prefill_sent("d", 10.0, TOKENS)
    ex.fail(Cause("decode_error"))
    assert ex.migrate("d2") == [Unhold("d", TOKENS, TOKENS, None), Migrate("d2")]
    assert ex.prefilling is None
