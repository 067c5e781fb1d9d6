"""One proxy request's exchange with its engines, as a sans-IO record.

The proxy asks a prefill engine (P) and a decode engine (D) for each client request (or D
alone: placement ``local``, or a fall-back). What the exchange holds while it runs — a count
of outstanding requests on P and on D, the request in flight, its prompt in one engine's
prefill queue — must be given back exactly once, however it ends; and its first failure is
its cause, later ones only echoes. This record keeps that life: each method is an event,
moves the record by the rules of :mod:`pdactors.core.exchange_rules` (its phases, its events,
the transition table), and returns the effects the proxy's IO code carries out
(:class:`Admit`, :class:`Hold`, :class:`Unhold`, :class:`Release`, :class:`CancelLegs`,
:class:`Ended`, and what the metrics and the placer learn: :class:`FirstChunk`,
:class:`SecondChunk`, :class:`Step`). No IO, no clock: times come from the caller.

P's failure is the request's only when the request depends on P: in the P-first flow before
P's token (:meth:`ExchangeState.fail`, then perhaps a fall-back to D), or a 4xx (the request's
own fault). Where D runs beside P (the concurrent flow), P failing (:meth:`ExchangeState.
prefill_failed`) is only noted: it cancels nothing, D's answer decides — a D that has the KV
goes on, one whose pull failed answers an error before its first token and is retried
(:meth:`ExchangeState.retry`), and the note is named in any failure the client then gets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from pdactors.core.exchange_rules import Event, Phase, next_phase
from pdactors.errors import IllegalTransition

__all__ = [
    "Admit",
    "CancelLegs",
    "Cause",
    "Effect",
    "Ended",
    "ExchangeState",
    "FirstChunk",
    "Hold",
    "Leg",
    "Migrate",
    "Phase",
    "Release",
    "SecondChunk",
    "Step",
    "Unhold",
]

#: Which of the exchange's engines: P (prefill) or D (decode).
Leg = Literal["p", "d"]


class Cause(Protocol):
    """What a failure must say for the record: the metric outcome it counts as."""

    @property
    def outcome(self) -> str: ...


# --------------------------------------------------------------------------- effects


@dataclass(frozen=True)
class Admit:
    """Raise D's outstanding count, P's when ``p``, and the requests in flight."""

    p: bool


@dataclass(frozen=True)
class Hold:
    """The prompt (``tokens``) waits in ``engine``'s prefill queue (for P: D has one more
    request incoming)."""

    engine: Leg
    tokens: int


@dataclass(frozen=True)
class Unhold:
    """The prompt left ``engine``'s prefill queue (the :class:`Hold` undone); when it came
    back with its first token, ``seconds`` after it was sent with ``tokens_ahead`` waiting
    (what the placer learns), else ``seconds`` is None."""

    engine: Leg
    tokens: int
    tokens_ahead: int
    seconds: float | None


@dataclass(frozen=True)
class Release:
    """Lower ``engine``'s outstanding count."""

    engine: Leg


@dataclass(frozen=True)
class CancelLegs:
    """Cancel P's leg and every part of D's: the request failed or ended unanswered."""


@dataclass(frozen=True)
class Ended:
    """Count the request as ``outcome`` (and no longer in flight); ``latency``: from its
    arrival to its end, for a successful one."""

    outcome: str
    latency: float | None


@dataclass(frozen=True)
class FirstChunk:
    """The client's first chunk went out ``ttft`` seconds after the request arrived."""

    ttft: float


@dataclass(frozen=True)
class SecondChunk:
    """P-first: D's first chunk went out ``since_arrival`` seconds after the request arrived,
    ``caught_up`` seconds after D was asked (for ``tokens`` prompt tokens)."""

    since_arrival: float
    caught_up: float | None
    tokens: int


@dataclass(frozen=True)
class Step:
    """D's stream ended well after ``gaps`` gaps between its chunks, ``seconds`` each on
    average (D's decode step, as the client sees it); ``per_chunk``: the mean gap from the
    client's first chunk (P's token, where it went first) to the end, D's catch-up included
    (the time per output token the client got)."""

    seconds: float
    gaps: int
    per_chunk: float | None = None


@dataclass(frozen=True)
class Migrate:
    """D's outstanding count moves to ``to``, the engine that continues the request after
    what the client already got (the caller's handle for it: the record only passes it on)."""

    to: object


Effect = (
    Admit | Hold | Unhold | Release | CancelLegs | Ended | FirstChunk | SecondChunk | Step | Migrate
)


# --------------------------------------------------------------------------- the record


class ExchangeState:
    """One exchange's phase, its first failure, and what it holds (see the module's rules).

    ``arrived``: when the client's request came (the caller's clock). Every method is
    synchronous, returns the effects to carry out in order, and raises
    :class:`~pdactors.errors.IllegalTransition` for an event its phase does not allow.
    """

    def __init__(self, arrived: float, prompt_tokens: int = 0) -> None:
        self.phase = Phase.NEW
        self.arrived = arrived
        #: The prompt's tokens (estimated until P's answer says; P-first corrects it).
        self.prompt_tokens = prompt_tokens
        self.cause: Cause | None = None  # the first failure, while FAILED (or DONE after it)
        #: P's failure while D went on without it (the concurrent flow), kept for the message
        self.p_cause: Cause | None = None
        #: the failure of D's first leg, when D was asked again (at most once)
        self.retried_after: Cause | None = None
        #: the failure of each engine that decoded before another continued (migrations)
        self.migrated_after: list[Cause] = []
        self.outcome: str | None = None  # set when DONE
        self._p_held = False  # P's outstanding count is raised
        self._held: tuple[Leg, int, int, float] | None = None  # engine, tokens, ahead, sent
        self._d_chunks = 0
        self.first_sent: float | None = None  # when the client's first chunk went out
        self.d_sent: float | None = None  # P-first: when D was asked, after P's token
        self._d_first: float | None = None  # when D's first chunk went out

    def _move(self, event: Event) -> Phase:
        before, self.phase = self.phase, next_phase(self.phase, event)
        return before

    @property
    def over(self) -> bool:
        """DONE: the client's answer ended and every count was given back."""
        return self.phase is Phase.DONE

    @property
    def prefilling(self) -> Leg | None:
        """The engine whose prefill queue holds the prompt now, if any."""
        return None if self._held is None else self._held[0]

    def admit(self, *, with_p: bool) -> list[Effect]:
        """The request is taken on: D's count (and P's, ``with_p``) and in-flight go up."""
        self._move(Event.ADMIT)
        self._p_held = with_p
        return [Admit(with_p)]

    def prefill_sent(self, engine: Leg, now: float, tokens_ahead: int) -> list[Effect]:
        """The prompt went to ``engine`` (P, or D computing it itself) at ``now``, with
        ``tokens_ahead`` prompt tokens (its own included) then waiting there."""
        self._move(Event.PREFILL_SENT)
        if self._held is not None:
            raise IllegalTransition(f"exchange: prompt sent to {engine} while at {self._held[0]}")
        self._held = (engine, self.prompt_tokens, tokens_ahead, now)
        return [Hold(engine, self.prompt_tokens)]

    def prefill_ended(self, now: float, *, answered: bool) -> list[Effect]:
        """P's leg ended at ``now`` (``answered``: with its answer, status 200): P's queue
        and P's count are given back."""
        self._move(Event.PREFILL_ENDED)
        effects: list[Effect] = []
        if self.prefilling == "p":
            effects.append(self._unhold(now if answered else None))
        if self._p_held:
            self._p_held = False
            effects.append(Release("p"))
        return effects

    def p_token_sent(self, now: float) -> list[Effect]:
        """P-first: P's token went to the client at ``now``: its first chunk."""
        self._move(Event.P_TOKEN_SENT)
        self.first_sent = now
        return [FirstChunk(now - self.arrived)]

    def d_answered(self) -> list[Effect]:
        """D's answer began (status 200)."""
        self._move(Event.D_ANSWERED)
        return []

    def d_chunk(self, now: float | None) -> list[Effect]:
        """One chunk of D's stream went to the client; ``now`` is needed for D's first only
        (the others are only counted: D's step is learnt at the end from the stream's span,
        so no clock is read per chunk)."""
        if self._move(Event.D_CHUNK) is Phase.FAILED:
            return []
        self._d_chunks += 1
        if self._d_chunks > 1:
            return []
        if now is None:
            raise IllegalTransition("exchange: D's first chunk needs its time")
        self._d_first = now
        if self.first_sent is not None:  # P's token went first
            caught_up = None if self.d_sent is None else now - self.d_sent
            second: list[Effect] = [SecondChunk(now - self.arrived, caught_up, self.prompt_tokens)]
            if self.prefilling == "d":  # retried: D computed the prompt itself
                second.insert(0, self._unhold(now))
            return second
        self.first_sent = now
        effects: list[Effect] = [FirstChunk(now - self.arrived)]
        if self.prefilling == "d":  # local: D's first token ends its prefill
            effects.insert(0, self._unhold(now))
        return effects

    def fail(self, cause: Cause) -> list[Effect]:
        """A leg failed: the first failure is the cause and cancels both legs; later ones are
        its echo; after the end, nothing."""
        if self._move(Event.FAIL) is Phase.DONE:
            return []
        if self.cause is None:
            self.cause = cause
        return [CancelLegs()]

    def prefill_failed(self, cause: Cause) -> list[Effect]:
        """P's leg failed while D's runs beside it (the concurrent flow): noted (the first
        such failure), nothing cancelled: D's answer decides the request."""
        self._move(Event.P_FAILED)
        if self.p_cause is None:
            self.p_cause = cause
        return []

    @property
    def d_relayed(self) -> bool:
        """Some of D's answer reached the client (a chunk of its stream)."""
        return self._d_chunks > 0

    @property
    def may_retry(self) -> bool:
        """FAILED, none of D's answer relayed, and D not asked again yet."""
        return self.phase is Phase.FAILED and not self.d_relayed and self.retried_after is None

    def retry(self, now: float, tokens_ahead: int) -> list[Effect]:
        """D's leg failed before any of its answer reached the client (its KV did not come):
        D is asked again at ``now``, computing the prompt itself (``tokens_ahead`` prompt
        tokens, its own included, then waiting there) — the failure is kept as
        ``retried_after`` and the prompt moves to D's prefill queue. Once per exchange;
        raises :class:`~pdactors.errors.IllegalTransition` when D's answer was relayed
        already or D was asked again before."""
        if self.phase is Phase.FAILED and not self.may_retry:
            why = "D's answer relayed" if self.d_relayed else "retried already"
            raise IllegalTransition(f"exchange: retry while failed ({why})")
        self._move(Event.RETRY)
        self.retried_after, self.cause = self.cause, None
        self.d_sent = None  # D's second answer is no catch-up after a pull: not learnt as one
        effects: list[Effect] = []
        if self._held is not None:
            effects.append(self._unhold(None))
        self._held = ("d", self.prompt_tokens, tokens_ahead, now)
        effects.append(Hold("d", self.prompt_tokens))
        return effects

    def migrate(self, to: object) -> list[Effect]:
        """D's leg failed and ``to`` continues the request after what the client already got
        (its tokens are in ``to``'s prompt: no KV is pulled): the failure is kept in
        ``migrated_after``, the prompt leaves any prefill queue, D's count moves to ``to``.
        The caller bounds the attempts (``len(migrated_after)``)."""
        self._move(Event.MIGRATE)
        assert self.cause is not None
        self.migrated_after.append(self.cause)
        self.cause = None
        effects: list[Effect] = []
        if self._held is not None:
            effects.append(self._unhold(None))
        effects.append(Migrate(to))
        return effects

    def fall_back(self) -> list[Effect]:
        """P-first: P failed before its token and D now serves the request alone."""
        self._move(Event.FALL_BACK)
        self.cause = None
        self._d_chunks, self._d_first = 0, None
        return []

    def end(self, outcome: str, now: float) -> list[Effect]:
        """The client's answer ended at ``now`` as ``outcome`` (``"ok"``, a failure's, or
        ``"cancelled"``): every count still held is given back, once. An echo after the end
        changes nothing."""
        if self._move(Event.END) is Phase.DONE:
            return []
        self.outcome = outcome
        effects: list[Effect] = []
        if self._held is not None:
            effects.append(self._unhold(None))
        if self._p_held:
            self._p_held = False
            effects.append(Release("p"))
        effects.append(Release("d"))
        if outcome != "ok":  # else P's leg gets its moment to end (its connection is reused)
            effects.append(CancelLegs())
        learnt = outcome == "ok" and not self.migrated_after  # (one engine's stream only)
        if learnt and self._d_first is not None and self._d_chunks > 1:
            gaps = self._d_chunks - 1  # (a failed stream's last gap may be a stall: not learnt)
            first = self._d_first if self.first_sent is None else self.first_sent
            client_gaps = gaps + (first < self._d_first)  # P's token first: one gap more
            per_chunk = (now - first) / client_gaps
            effects.append(Step((now - self._d_first) / gaps, gaps, per_chunk))
        effects.append(Ended(outcome, now - self.arrived if outcome == "ok" else None))
        return effects

    def _unhold(self, answered_at: float | None) -> Unhold:
        assert self._held is not None
        engine, tokens, ahead, sent = self._held
        self._held = None
        return Unhold(engine, tokens, ahead, None if answered_at is None else answered_at - sent)
