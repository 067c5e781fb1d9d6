"""The proxy exchange's rules as data: its phases, its events, and which event moves which phase.

:class:`~pdactors.core.exchange.ExchangeState` consults :data:`TRANSITIONS` for every event; a
pair that is not in the table raises :class:`~pdactors.errors.IllegalTransition`. The tests
enumerate it.

Rules (the ``phase`` of one exchange):

============  ==================================  ============================================
phase         entered when                        leaves when
============  ==================================  ============================================
NEW           the request was routed              admitted (+Admit: its counts are raised) →
                                                  OPEN
OPEN          admitted, or a P-first request      D's answer begins → D_ANSWERING; a leg fails
              falls back to D after P failed,     → FAILED (+CancelLegs); its answer ends →
              or D is asked again (a retry)       DONE
D_ANSWERING   D's answer began (status 200)       a leg fails → FAILED (+CancelLegs); its
                                                  answer ends → DONE
FAILED        the first failure (its cause kept)  its answer (the failure) ends → DONE; P-first
                                                  falls back to D → OPEN (cause cleared); D is
                                                  asked again, computing the prompt itself
                                                  (+Hold on D), once, when none of D's answer
                                                  reached the client → OPEN (cause kept as
                                                  ``retried_after``); another engine continues
                                                  after what the client got (a migration,
                                                  +Migrate) → OPEN (cause kept in
                                                  ``migrated_after``)
DONE          the client's answer ended: ok,      never; a late failure or end is an echo and
              failed or cancelled (+Unhold,       changes nothing
              +Release, +Ended: every count
              given back)
============  ==================================  ============================================

Events that do not change the phase (the prompt sent to an engine, P's leg ending, a chunk
sent to the client, P failing while D's leg goes on without it) are in the table too.
"""

from __future__ import annotations

import enum
from typing import Final

from pdactors.errors import IllegalTransition

__all__ = ["TRANSITIONS", "Event", "Phase", "next_phase"]


class Phase(enum.Enum):
    NEW = "new"
    OPEN = "open"
    D_ANSWERING = "d_answering"
    FAILED = "failed"
    DONE = "done"


class Event(enum.Enum):
    ADMIT = "admit"
    PREFILL_SENT = "prefill_sent"  # the prompt went to the engine computing it
    PREFILL_ENDED = "prefill_ended"  # P's leg ended (answered or not)
    P_TOKEN_SENT = "p_token_sent"  # P-first: P's token went to the client
    D_ANSWERED = "d_answered"  # D's answer began
    D_CHUNK = "d_chunk"  # one chunk of D's stream went to the client
    FAIL = "fail"
    P_FAILED = "p_failed"  # P's leg failed while D's goes on without it (the concurrent flow)
    FALL_BACK = "fall_back"
    RETRY = "retry"  # D is asked again, computing the prompt itself
    MIGRATE = "migrate"  # another engine continues after what the client already got
    END = "end"


_N, _O, _A, _F, _D = Phase.NEW, Phase.OPEN, Phase.D_ANSWERING, Phase.FAILED, Phase.DONE

#: (phase, event) → next phase. A pair not here is illegal.
TRANSITIONS: Final[dict[tuple[Phase, Event], Phase]] = {
    (_N, Event.ADMIT): _O,
    (_O, Event.PREFILL_SENT): _O,
    (_O, Event.PREFILL_ENDED): _O,
    (_O, Event.P_TOKEN_SENT): _O,
    (_O, Event.D_ANSWERED): _A,
    (_O, Event.FAIL): _F,
    (_O, Event.P_FAILED): _O,  # noted: D's answer decides
    (_O, Event.END): _D,
    (_A, Event.PREFILL_ENDED): _A,  # P answers after D began: both run at once
    (_A, Event.D_CHUNK): _A,
    (_A, Event.FAIL): _F,
    (_A, Event.P_FAILED): _A,  # D's answer began: P's fate no longer matters to it
    (_A, Event.END): _D,
    (_F, Event.PREFILL_ENDED): _F,
    (_F, Event.D_CHUNK): _F,  # one already in hand when the failure came: not learnt from
    (_F, Event.FAIL): _F,  # an echo of the first failure: the cause stays
    (_F, Event.P_FAILED): _F,
    (_F, Event.FALL_BACK): _O,
    (_F, Event.RETRY): _O,  # once, with none of D's answer relayed (else it raises)
    (_F, Event.MIGRATE): _O,  # another engine decodes in D's place (bounded by the caller)
    (_F, Event.END): _D,
    (_D, Event.PREFILL_ENDED): _D,  # P's leg, given a moment after the answer: nothing left
    (_D, Event.FAIL): _D,  # a leg failing after the answer ended changes nothing
    (_D, Event.P_FAILED): _D,
    (_D, Event.END): _D,  # an echo (a cancellation unwinding an answered request)
}


def next_phase(phase: Phase, event: Event) -> Phase:
    """Where ``event`` leads an exchange from ``phase``. Raises
    :class:`~pdactors.errors.IllegalTransition` for a pair the rules lack."""
    try:
        return TRANSITIONS[phase, event]
    except KeyError:
        raise IllegalTransition(f"exchange: {event.value} while {phase.value}") from None
