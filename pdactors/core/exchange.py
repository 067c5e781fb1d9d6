"""One proxy request's exchange with its engines, as a sans-IO record: its whole life.

The proxy asks a prefill engine (P) and a decode engine (D) for each client request, or one
engine alone; how, is the request's flow (:class:`~pdactors.core.exchange_rules.Flow`:
P-first, concurrent, local, whole-on-P), chosen at admission and changed by a fall-back. This
record holds everything of the request's life: its flow and placement, its phase, its legs
(which engine is P, which decodes, which failed), its first failure and the failures before
it (P's beside D, D's before a retry, each engine's before a migration), what the client got
(the stream opened, P's token, D's chunks) and when, and what it holds — a count of
outstanding requests on P and on D, the request in flight, its prompt in one engine's
prefill queue — which must be given back exactly once, however it ends.

Each method is an event: it moves the record by the rules of
:mod:`pdactors.core.exchange_rules` (its phases, its events, the transition table) and returns
the effects the proxy's IO code carries out (:mod:`pdactors.core.exchange_effects`). What
comes after a failure — a fall-back, a retry, a migration, or the failure told to the client —
is decided from the record alone (:mod:`pdactors.core.exchange_next`). No IO, no clock: times
come from the caller.
"""

from __future__ import annotations

import math
from typing import Generic, Literal, TypeVar

from pdactors.core import exchange_effects as fx
from pdactors.core.exchange_answer import ClientAnswer
from pdactors.core.exchange_rules import (
    PLACEMENT,
    PULLS_KV,
    START,
    Do,
    Event,
    Flow,
    Phase,
    flow_for,
    next_move,
)
from pdactors.errors import IllegalTransition

__all__ = ["ExchangeState", "Flow", "Leg", "Phase", "flow_for"]

#: Which of the exchange's engines: P (prefill) or D (decode).
Leg = Literal["p", "d"]
#: The caller's handle of an engine (the proxy's ``Backend``; any object in tests).
E = TypeVar("E")


class ExchangeState(Generic[E]):
    """One exchange's whole life (see the module's doc and the rules).

    ``arrived``: when the client's request came (the caller's clock); ``p`` and ``d``: the
    engines it was routed to (``d`` decodes: a P serving it whole is ``d``); ``deadline``:
    when it must have ended; ``prompt_tokens``: the prompt's size, estimated until P says
    (``prompt_chars`` of a text prompt: the placer learns the ratio). Every method is
    synchronous, returns the effects to carry out in order, and raises
    :class:`~pdactors.errors.IllegalTransition` for an event its phase does not allow.
    """

    def __init__(
        self,
        arrived: float,
        p: E,
        d: E,
        *,
        deadline: float = math.inf,
        prompt_tokens: int = 0,
        prompt_chars: int = 0,
    ) -> None:
        self.phase = Phase.NEW
        self.flow: Flow | None = None  # set at admission; a fall-back makes it local
        self.placed_why = ""  # why it was placed where it was (the placement metric's reason)
        #: Why one engine serves a request meant for two (the fallbacks metric's), or None.
        self.fallback: str | None = None
        self.p, self.d = p, d  # the engines of its legs (d: the one decoding now)
        self.failed_engines: list[E] = []  # those whose decoding failed, in order
        self.arrived, self.deadline = arrived, deadline
        self.prompt_tokens, self.prompt_chars = prompt_tokens, prompt_chars
        self.cause: fx.Cause | None = None  # the first failure, while failed (or DONE after it)
        #: P's failure while D went on without it (the concurrent flow), kept for the message
        self.p_cause: fx.Cause | None = None
        #: the failure of D's first leg, when D was asked again (at most once)
        self.retried_after: fx.Cause | None = None
        #: the failure of each engine that decoded before another continued (migrations)
        self.migrated_after: list[fx.Cause] = []
        self.outcome: str | None = None  # set when DONE
        self._p_held = False  # P's outstanding count is raised
        #: P may keep the prompt's KV for D's pull (the concurrent flow from its start, the
        #: P-first flow once P's token did not end the answer): giving up D's leg frees it at
        #: P (:class:`~pdactors.core.exchange_effects.FreeAtP`)
        self._kv_at_p = False
        #: the prompt in a prefill queue: leg, engine, the D waiting, tokens, ahead, sent at
        self._held: tuple[Leg, E, E | None, int, int, float] | None = None
        self.answer = ClientAnswer(arrived)  # what the client got, and when
        #: when P answered and when D's answer began (the debug timeline)
        self.p_answered_at: float | None = None
        self.d_answered_at: float | None = None

    def _move(self, event: Event) -> Do:
        self.phase, do = next_move(self.phase, event)
        return do

    # ------------------------------------------------------------------ what it is

    @property
    def streaming(self) -> bool:
        """The client's stream began: a failure from now on is told as its last event."""
        return self.answer.streaming

    @property
    def over(self) -> bool:
        """DONE: the client's answer ended and every count was given back."""
        return self.phase is Phase.DONE

    @property
    def placement(self) -> str:
        """Where its prompt is computed, as the answer's header says: ``disaggregated``,
        ``local`` or ``whole-on-p`` (admitted only)."""
        assert self.flow is not None, "placed at admission"
        return PLACEMENT[self.flow]

    @property
    def prefilling(self) -> Leg | None:
        """The leg whose engine's prefill queue holds the prompt now, if any."""
        return None if self._held is None else self._held[0]

    @property
    def d_relayed(self) -> bool:
        """Some of D's answer reached the client (a chunk of its stream)."""
        return self.answer.d_chunks > 0

    @property
    def may_retry(self) -> bool:
        """FAILED, none of D's answer relayed, and D not asked again yet."""
        return self.phase is Phase.FAILED and not self.d_relayed and self.retried_after is None

    @property
    def tried(self) -> list[E]:
        """The engines that decoded it: those that failed, and the one decoding now (a
        migration goes to none of them)."""
        return [*self.failed_engines, self.d]

    # ------------------------------------------------------------------ admission, P's leg

    def start(
        self, flow: Flow, now: float, tokens_ahead: int, *, why: str, fallback: str | None = None
    ) -> list[fx.Effect]:
        """Admitted at ``now`` in ``flow``, placed for ``why`` (``fallback``: why one engine
        serves a request meant for two): the counts go up and the prompt goes to the engine
        that computes it (P, or D), where ``tokens_ahead`` prompt tokens (its own included)
        then wait."""
        do = self._move(START[flow])
        self.flow, self.placed_why, self.fallback = flow, why, fallback
        pair = do is Do.ADMIT_PAIR
        self._p_held = pair
        self._kv_at_p = flow is Flow.CONCURRENT
        effects: list[fx.Effect] = [fx.Placed(self.placement, why)]
        if fallback is not None:
            effects.append(fx.FellBack(fallback, None))
        effects.append(fx.Admit(self.p if pair else None, self.d))
        effects.append(self._hold("p" if pair else "d", now, tokens_ahead))
        return effects

    def p_ended(self, now: float, *, status: int | None) -> list[fx.Effect]:
        """P's leg ended at ``now`` with an answer of ``status`` (None: none came): P's queue
        (its first token's time learnt when it answered 200) and P's count are given back."""
        if self._move(Event.P_ENDED) is Do.NOTHING:
            return []
        if status is not None:
            self.p_answered_at = now
        effects: list[fx.Effect] = []
        if self.prefilling == "p":
            effects.append(self._unhold(now if status == 200 else None))
        if self._p_held:
            self._p_held = False
            effects.append(fx.Release(self.p))
        return effects

    def p_failed(self, cause: fx.Cause) -> list[fx.Effect]:
        """P's leg failed: a 4xx is the request's own fault (``P_REFUSED``), anything else P's
        (``P_FAILED``). P-first, before P's token, either fails the request; beside D (the
        concurrent flow) P's own failure is only noted: D's answer decides."""
        first = self.p_cause is None and self.cause is None
        do = self._move(Event.P_REFUSED if cause.status < 500 else Event.P_FAILED)
        if cause.status < 500:  # P refused the request: it computed nothing
            self._kv_at_p = False
        if do is Do.NOTE_P:
            if self.p_cause is not None:
                return []
            self.p_cause = cause
            return [fx.DGoesOn(cause)] if first else []
        return self._failed(do, cause)

    # ------------------------------------------------------------------ P-first

    def p_answer(self, tokens: int, *, ends: bool) -> list[fx.Effect]:
        """P-first: P's answer says the prompt is ``tokens`` tokens; its token ``ends`` the
        answer (P's is the client's), or D continues after it."""
        self._move(Event.ENDS_AT_P if ends else Event.GOES_ON)
        self._kv_at_p = not ends  # a token that ends the answer: P freed its KV at once
        effects: list[fx.Effect] = []
        if self.prompt_chars:  # a text prompt: its characters per token, for the placer
            effects.append(fx.PromptCounted(self.prompt_chars, tokens))
        self.prompt_tokens = tokens
        effects.append(fx.PFirstPath("ended_at_p" if ends else "continued_on_d"))
        return effects

    def stream_opened(self) -> list[fx.Effect]:
        """The client's stream began (status 200 sent): a failure from now on is told as its
        last event. Once."""
        if self.streaming:
            raise IllegalTransition("exchange: the client's stream opened twice")
        self._move(Event.STREAM_OPENED)
        self.answer.streaming = True
        return []

    def p_token_sent(self, now: float) -> list[fx.Effect]:
        """P-first: P's token went to the client at ``now``: its first chunk."""
        self._move(Event.P_TOKEN_SENT)
        return [self.answer.p_token(now)]

    def d_asked(self, now: float) -> list[fx.Effect]:
        """P-first: D was asked at ``now`` to continue after P's token (its catch-up, the
        pull and P's token, is learnt from its first chunk)."""
        self._move(Event.D_ASKED)
        self.answer.d_sent = now
        return []

    def fall_back(self, now: float, tokens_ahead: int) -> list[fx.Effect]:
        """P-first: P failed before its token (P's own failure, never its 4xx) and D now
        serves the request alone at ``now`` (``tokens_ahead`` prompt tokens waiting there):
        the flow becomes local."""
        cause = self.cause
        if self.phase is Phase.FAILED_AT_P and (cause is None or cause.status < 500):
            raise IllegalTransition("exchange: fall-back after P's 4xx")
        self._move(Event.FALL_BACK)
        assert cause is not None
        why = cause.fallback or "prefill_failed"
        self.cause, self.flow, self.fallback = None, Flow.LOCAL, why
        effects: list[fx.Effect] = [
            fx.FellBack(why, cause),
            fx.Placed(self.placement, None),
            fx.FreshLeg(),
        ]
        if why == "p_unhealthy":  # cut from P, whose engine may have finished the prompt
            self._kv_at_p = True
        effects += self._free_at_p()
        if self._held is not None:
            effects.append(self._unhold(None))
        effects.append(self._hold("d", now, tokens_ahead))
        return effects

    # ------------------------------------------------------------------ D's leg

    def d_answered(self, now: float) -> list[fx.Effect]:
        """D's answer began (status 200) at ``now``."""
        self._move(Event.D_ANSWERED)
        self.d_answered_at = now
        return []

    def d_chunk(self, now: float | None) -> list[fx.Effect]:
        """One chunk of D's stream went to the client; ``now`` is needed for D's first only
        (the others are only counted: D's step is learnt at the end from the stream's span,
        so no clock is read per chunk)."""
        if self._move(Event.D_CHUNK) is Do.NOTHING:
            return []
        first = self.answer.d_chunk(now, self.prompt_tokens)
        if first is None:
            return []
        if self.prefilling == "d":  # local (or retried): D's first token ends its prefill
            return [self._unhold(now), first]
        return [first]

    def fail(self, cause: fx.Cause) -> list[fx.Effect]:
        """D's leg failed: the first failure is the cause and cancels every leg; later ones
        are its echo; after the end, nothing."""
        return self._failed(self._move(Event.FAIL), cause)

    def _failed(self, do: Do, cause: fx.Cause) -> list[fx.Effect]:
        if do is Do.NOTHING:
            return []
        if do is Do.FAIL:
            self.cause = cause
        return [fx.CancelLegs()]

    # ------------------------------------------------------------------ after a failure

    def retry(self, now: float, tokens_ahead: int) -> list[fx.Effect]:
        """D's leg failed before any of its answer reached the client (its KV did not come):
        D is asked again at ``now``, computing the prompt itself (``tokens_ahead`` prompt
        tokens, its own included, then waiting there) — the failure is kept as
        ``retried_after`` and the prompt moves to D's prefill queue. Once per exchange, in a
        flow that pulled KV; raises :class:`~pdactors.errors.IllegalTransition` otherwise or
        when D's answer was relayed already."""
        if self.phase is Phase.FAILED and not self.may_retry:
            why = "D's answer relayed" if self.d_relayed else "retried already"
            raise IllegalTransition(f"exchange: retry while failed ({why})")
        if self.phase is Phase.FAILED and self.flow not in PULLS_KV:
            raise IllegalTransition("exchange: retry of a D that computed the prompt already")
        self._move(Event.RETRY)
        cause = self.cause
        assert cause is not None
        self.retried_after, self.cause = cause, None
        # D's second answer is no catch-up after a pull: not learnt as one
        self.answer.d_sent = None
        effects: list[fx.Effect] = [fx.Retried(cause.retry, cause), fx.FreshLeg()]
        effects += self._free_at_p()
        if self._held is not None:
            effects.append(self._unhold(None))
        effects.append(self._hold("d", now, tokens_ahead))
        return effects

    def migrate(self, to: E) -> list[fx.Effect]:
        """D's leg failed and ``to`` continues the request after what the client already got
        (its tokens are in ``to``'s prompt: no KV is pulled): the failure is kept in
        ``migrated_after``, the failed engine in ``failed_engines``, the prompt leaves any
        prefill queue, D's count moves to ``to``, which decodes from now on."""
        self._move(Event.MIGRATE)
        cause = self.cause
        assert cause is not None
        self.migrated_after.append(cause)
        self.cause = None
        frm, self.d = self.d, to
        self.failed_engines.append(frm)
        effects: list[fx.Effect] = self._free_at_p()
        if self._held is not None:
            effects.append(self._unhold(None))
        effects += [fx.Migrate(frm, to, len(self.migrated_after), cause), fx.FreshLeg()]
        return effects

    # ------------------------------------------------------------------ the end

    def end(self, outcome: str, now: float) -> list[fx.Effect]:
        """The client's answer ended at ``now`` as ``outcome`` (``"ok"``, a failure's, or
        ``"cancelled"``): every count still held is given back, once. An echo after the end
        changes nothing."""
        if self._move(Event.END) is Do.NOTHING:
            return []
        self.outcome = outcome
        effects: list[fx.Effect] = []
        if self._held is not None:
            effects.append(self._unhold(None))
        if self._p_held:  # (DONE is final: nothing is given back twice)
            effects.append(fx.Release(self.p))
        effects.append(fx.Release(self.d))
        if outcome != "ok":  # else P's leg gets its moment to end (its connection is reused)
            effects.append(fx.CancelLegs())
            effects += self._free_at_p()
        step = self.answer.step(now)
        if step is not None and outcome == "ok" and not self.migrated_after:  # one engine's
            effects.append(step)
        effects.append(fx.Ended(outcome, now - self.arrived if outcome == "ok" else None))
        return effects

    def _free_at_p(self) -> list[fx.Effect]:
        """D's leg is given up: P frees the KV it may keep for it (once)."""
        if not self._kv_at_p:
            return []
        self._kv_at_p = False
        return [fx.FreeAtP(self.p)]

    # ------------------------------------------------------------------ the prefill queues

    def _hold(self, leg: Leg, now: float, tokens_ahead: int) -> fx.Hold:
        engine, waiting = (self.p, self.d) if leg == "p" else (self.d, None)
        self._held = (leg, engine, waiting, self.prompt_tokens, tokens_ahead, now)
        return fx.Hold(engine, self.prompt_tokens, waiting)

    def _unhold(self, answered_at: float | None) -> fx.Unhold:
        assert self._held is not None
        _, engine, waiting, tokens, ahead, sent = self._held
        self._held = None
        seconds = None if answered_at is None else answered_at - sent
        return fx.Unhold(engine, tokens, waiting, ahead, seconds)
