"""The proxy exchange's rules as data: its flows, phases, events, and which event moves which
phase with what effect.

:class:`~pdactors.core.exchange.ExchangeState` consults :data:`TRANSITIONS` for every event; a
pair that is not in the table raises :class:`~pdactors.errors.IllegalTransition`. The tests
enumerate it against an oracle written out by hand. Every flow the proxy has is a path through
this table; the proxy's IO code only carries out the effects and asks what comes next after a
failure (:mod:`pdactors.core.exchange_next`).

The flows (:class:`Flow`, chosen when the request is admitted; a ``START_*`` event each):

* **P-first** (the default): P is asked for one token (``AT_P``). Its token ends the answer
  (EOS, a stop string, one token asked: ``ENDS_AT_P`` → ``P_ANSWERS``, P's answer is the
  client's) or D continues after it (``GOES_ON`` → ``TO_D``; a stream sends P's token first,
  then ``D_ASKED`` → ``OPEN``). P failing before its token (``FAILED_AT_P``) is either a
  **fall-back** (``FALL_BACK``: D serves it alone, the flow becomes local) or told to the client.
* **Concurrent** (``first_token = "d"``, or a body P-first cannot carry): P and D are asked at
  once (``OPEN``); P's leg runs beside D's. P failing there is only noted (``P_FAILED``: D's
  answer decides, a D whose KV did not come fails and is asked again); P's 4xx
  (``P_REFUSED``, the request's own fault) fails the request.
* **Local**: D alone computes the prompt (placement ``local``, or a fall-back at admission:
  no P in rotation, or none answering with D's model).
* **Whole-on-P**: a P serves the request whole in D's place (pinned, or no D in rotation).

Then, whatever the flow: D's answer begins (``D_ANSWERING``), its chunks reach the client, and
it ends (``DONE``). D's leg failing (``FAILED``, the first failure its cause) is either a
**retry** (``RETRY``: D asked again computing the prompt itself, once, when none of its answer
reached the client and the flow pulled KV), a **migration** (``MIGRATE``: another engine
continues after what the client got, up to ``migration_limit`` times) or told to the client
(an HTTP status, or a begun stream's last event). ``DONE`` gives back every count the exchange
holds, once; a late failure or end after it is an echo and changes nothing.
"""

from __future__ import annotations

import enum
from typing import Final

from pdactors.errors import IllegalTransition

__all__ = [
    "PLACEMENT",
    "PULLS_KV",
    "START",
    "TRANSITIONS",
    "Do",
    "Event",
    "Flow",
    "Phase",
    "flow_for",
    "next_move",
]


class Flow(enum.Enum):
    """How a request is served (see the module's doc)."""

    P_FIRST = "p_first"  # P's token first, D continues after it (pulling P's KV)
    CONCURRENT = "concurrent"  # P and D asked at once, D pulls P's KV (upstream's flow)
    LOCAL = "local"  # D alone computes the prompt
    WHOLE_ON_P = "whole_on_p"  # a P serves it whole, in D's place


class Phase(enum.Enum):
    NEW = "new"  # routed and placed, not admitted
    AT_P = "at_p"  # P-first: P asked for its token, D not asked
    P_ANSWERS = "p_answers"  # P-first: P's token is the whole answer
    TO_D = "to_d"  # P-first: P's token in hand, D about to continue after it
    OPEN = "open"  # D asked (in the concurrent flow, P beside it), its answer not begun
    D_ANSWERING = "d_answering"  # D's answer began (status 200)
    FAILED_AT_P = "failed_at_p"  # P-first: P failed before its token
    FAILED = "failed"  # the request's first failure (its cause kept)
    DONE = "done"  # the client's answer ended: ok, failed or cancelled


class Event(enum.Enum):
    START_P_FIRST = "start_p_first"  # admitted: P asked for its token first
    START_CONCURRENT = "start_concurrent"  # admitted: P and D asked at once
    START_LOCAL = "start_local"  # admitted: D alone computes the prompt
    START_WHOLE_ON_P = "start_whole_on_p"  # admitted: a P serves it whole as D
    P_ENDED = "p_ended"  # P's leg ended (answered or not)
    P_FAILED = "p_failed"  # P's leg failed on P's side (5xx, broken, no answer, judged failed)
    P_REFUSED = "p_refused"  # P answered a 4xx: the request's own fault
    ENDS_AT_P = "ends_at_p"  # P-first: P's token ends the answer
    GOES_ON = "goes_on"  # P-first: D continues after P's token
    STREAM_OPENED = "stream_opened"  # the client's stream began (status 200 sent)
    P_TOKEN_SENT = "p_token_sent"  # P-first: P's token went to the client
    D_ASKED = "d_asked"  # P-first: D asked to continue after P's token
    D_ANSWERED = "d_answered"  # D's answer began (status 200)
    D_CHUNK = "d_chunk"  # one chunk of D's stream went to the client
    FAIL = "fail"  # D's leg failed (its status, its stream, no answer in time, cut)
    FALL_BACK = "fall_back"  # P-first: D serves it alone after P failed before its token
    RETRY = "retry"  # D asked again, computing the prompt itself
    MIGRATE = "migrate"  # another engine continues after what the client already got
    END = "end"  # the client's answer ended (ok, a failure's outcome, or cancelled)


class Do(enum.Enum):
    """What a move does beyond the move (the record's methods carry it out)."""

    NOTHING = "nothing"  # an echo, or no effect beyond the move
    ADMIT_PAIR = "admit_pair"  # P's and D's counts up; the prompt in P's queue
    ADMIT_ALONE = "admit_alone"  # D's count up; the prompt in D's (a P's, whole-on-P) queue
    GIVE_BACK_P = "give_back_p"  # P's queue and count given back (its token's time learnt)
    NOTE_P = "note_p"  # P's first failure kept for the client's message; nothing cancelled
    FAIL = "fail"  # the first failure is the cause; every leg cancelled
    ECHO = "echo"  # a later failure: the legs cancelled (again), the cause stays
    LEARN_PROMPT = "learn_prompt"  # P said the prompt's size (the placer learns); path counted
    OPEN_STREAM = "open_stream"  # noted: a failure is now told as the stream's last event
    FIRST_CHUNK = "first_chunk"  # the client's first chunk: its time to first token
    NOTE_ASKED = "note_asked"  # when D was asked (its catch-up is learnt from it)
    NOTE_ANSWERED = "note_answered"  # when D's answer began (the debug timeline)
    CHUNK = "chunk"  # counted; D's first timed (TTFT, or P-first's second chunk)
    ALONE_ON_D = "alone_on_d"  # fall-back: the prompt to D's queue, placement local, counted
    D_COMPUTES = "d_computes"  # retry: the prompt to D's queue, the cause kept, counted
    MOVE_D = "move_d"  # migration: D's count to the next engine, the cause kept, counted
    GIVE_BACK = "give_back"  # every count still held given back, the outcome counted


P, S = Phase, Event

#: (phase, event) → (next phase, what the move does). A pair not here is illegal.
TRANSITIONS: Final[dict[tuple[Phase, Event], tuple[Phase, Do]]] = {
    # ---- admission: one row per flow
    (P.NEW, S.START_P_FIRST): (P.AT_P, Do.ADMIT_PAIR),
    (P.NEW, S.START_CONCURRENT): (P.OPEN, Do.ADMIT_PAIR),  # P's leg runs beside D's
    (P.NEW, S.START_LOCAL): (P.OPEN, Do.ADMIT_ALONE),
    (P.NEW, S.START_WHOLE_ON_P): (P.OPEN, Do.ADMIT_ALONE),  # the P is the exchange's D
    # ---- P-first: waiting for P's token
    (P.AT_P, S.P_ENDED): (P.AT_P, Do.GIVE_BACK_P),  # P's answer is read next
    (P.AT_P, S.P_FAILED): (P.FAILED_AT_P, Do.FAIL),  # the request depends on P's token
    (P.AT_P, S.P_REFUSED): (P.FAILED_AT_P, Do.FAIL),  # (never a fall-back: D would refuse too)
    (P.AT_P, S.ENDS_AT_P): (P.P_ANSWERS, Do.LEARN_PROMPT),  # counted ended_at_p
    (P.AT_P, S.GOES_ON): (P.TO_D, Do.LEARN_PROMPT),  # counted continued_on_d
    # ---- P-first: P's token is the whole answer (P kept no KV)
    (P.P_ANSWERS, S.STREAM_OPENED): (P.P_ANSWERS, Do.OPEN_STREAM),
    (P.P_ANSWERS, S.P_TOKEN_SENT): (P.P_ANSWERS, Do.FIRST_CHUNK),
    # ---- P-first: D continues after P's token (a stream gets P's token first)
    (P.TO_D, S.STREAM_OPENED): (P.TO_D, Do.OPEN_STREAM),
    (P.TO_D, S.P_TOKEN_SENT): (P.TO_D, Do.FIRST_CHUNK),
    (P.TO_D, S.D_ASKED): (P.OPEN, Do.NOTE_ASKED),  # D pulls the prompt's KV from P
    # ---- P-first: P failed before its token
    (P.FAILED_AT_P, S.FALL_BACK): (P.OPEN, Do.ALONE_ON_D),  # the flow becomes local
    # ---- D asked (in the concurrent flow P's leg runs beside it)
    (P.OPEN, S.P_ENDED): (P.OPEN, Do.GIVE_BACK_P),
    (P.OPEN, S.P_FAILED): (P.OPEN, Do.NOTE_P),  # D's answer decides (its KV did come, or not)
    (P.OPEN, S.P_REFUSED): (P.FAILED, Do.FAIL),
    (P.OPEN, S.D_ANSWERED): (P.D_ANSWERING, Do.NOTE_ANSWERED),
    (P.OPEN, S.FAIL): (P.FAILED, Do.FAIL),
    # ---- D's answer began
    (P.D_ANSWERING, S.P_ENDED): (P.D_ANSWERING, Do.GIVE_BACK_P),  # P answers after D began
    (P.D_ANSWERING, S.P_FAILED): (P.D_ANSWERING, Do.NOTE_P),  # P's fate no longer matters
    (P.D_ANSWERING, S.P_REFUSED): (P.FAILED, Do.FAIL),
    (P.D_ANSWERING, S.STREAM_OPENED): (P.D_ANSWERING, Do.OPEN_STREAM),
    (P.D_ANSWERING, S.D_CHUNK): (P.D_ANSWERING, Do.CHUNK),
    (P.D_ANSWERING, S.FAIL): (P.FAILED, Do.FAIL),
    # ---- failed: D asked again, another engine continues, or the failure is told (END)
    (P.FAILED, S.P_ENDED): (P.FAILED, Do.GIVE_BACK_P),
    (P.FAILED, S.P_FAILED): (P.FAILED, Do.NOTE_P),
    (P.FAILED, S.P_REFUSED): (P.FAILED, Do.ECHO),
    (P.FAILED, S.D_CHUNK): (P.FAILED, Do.NOTHING),  # one in hand when the failure came
    (P.FAILED, S.FAIL): (P.FAILED, Do.ECHO),
    (P.FAILED, S.RETRY): (P.OPEN, Do.D_COMPUTES),  # once, none of D's answer relayed
    (P.FAILED, S.MIGRATE): (P.OPEN, Do.MOVE_D),  # bounded by migration_limit
    # ---- the end: from every admitted phase (ok, a failure told, or the client gone) ...
    (P.AT_P, S.END): (P.DONE, Do.GIVE_BACK),  # the client went away while P computed
    (P.P_ANSWERS, S.END): (P.DONE, Do.GIVE_BACK),  # P's answer sent
    (P.TO_D, S.END): (P.DONE, Do.GIVE_BACK),  # the client went away before D was asked
    (P.OPEN, S.END): (P.DONE, Do.GIVE_BACK),
    (P.D_ANSWERING, S.END): (P.DONE, Do.GIVE_BACK),
    (P.FAILED_AT_P, S.END): (P.DONE, Do.GIVE_BACK),  # P's failure told
    (P.FAILED, S.END): (P.DONE, Do.GIVE_BACK),  # the failure told
    # ... and after it only echoes: P's leg in its grace, a late failure, a second end
    (P.DONE, S.P_ENDED): (P.DONE, Do.NOTHING),
    (P.DONE, S.P_FAILED): (P.DONE, Do.NOTHING),
    (P.DONE, S.P_REFUSED): (P.DONE, Do.NOTHING),
    (P.DONE, S.FAIL): (P.DONE, Do.NOTHING),
    (P.DONE, S.END): (P.DONE, Do.NOTHING),
}


def next_move(phase: Phase, event: Event) -> tuple[Phase, Do]:
    """Where ``event`` leads an exchange from ``phase``, and what the move does. Raises
    :class:`~pdactors.errors.IllegalTransition` for a pair the rules lack."""
    try:
        return TRANSITIONS[phase, event]
    except KeyError:
        raise IllegalTransition(f"exchange: {event.value} while {phase.value}") from None


#: The answer's placement header (and metric label) of each flow.
PLACEMENT: Final = {
    Flow.P_FIRST: "disaggregated",
    Flow.CONCURRENT: "disaggregated",
    Flow.LOCAL: "local",
    Flow.WHOLE_ON_P: "whole-on-p",
}
#: The event that admits a request in each flow.
START: Final = {
    Flow.P_FIRST: Event.START_P_FIRST,
    Flow.CONCURRENT: Event.START_CONCURRENT,
    Flow.LOCAL: Event.START_LOCAL,
    Flow.WHOLE_ON_P: Event.START_WHOLE_ON_P,
}
#: The flows whose D pulls the prompt's KV from P: a D whose KV did not come may be asked
#: again, computing the prompt itself.
PULLS_KV: Final = frozenset({Flow.P_FIRST, Flow.CONCURRENT})


def flow_for(placement: str, *, p_first: bool) -> Flow:
    """The flow of a request placed at ``placement`` (``disaggregated``, ``local``,
    ``whole-on-p``); a disaggregated one goes P-first when ``p_first`` (the operator's
    ``first_token`` is P's and the body is one the P-first flow carries)."""
    if placement == "whole-on-p":
        return Flow.WHOLE_ON_P
    if placement == "local":
        return Flow.LOCAL
    return Flow.P_FIRST if p_first else Flow.CONCURRENT
