"""One client request's exchange as the proxy's IO code holds it: its engines, its transfer id,
its deadline and headers, the cancel scopes of its legs, and its sans-IO record
(:class:`~pdactors.core.exchange.ExchangeState`: the phase, the first failure, the counts it
holds). The effects of the record are carried out by
:class:`pdactors.proxy._effects.ExchangeEffects`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio

from pdactors.core.exchange import ExchangeState, Leg
from pdactors.proxy._openai import Endpoint, Failure
from pdactors.proxy._state import Backend
from pdactors.proxy._tracing import RequestSpan

__all__ = ["Exchange"]


@dataclass(eq=False)
class Exchange:
    """One client request: where it goes, its transfer id, its deadline, its legs' scopes.

    ``p_scope`` bounds P's leg, :meth:`decode_scope` each part of D's (its head, then its
    body): the record's :class:`~pdactors.core.exchange.CancelLegs` cancels them all.
    """

    endpoint: Endpoint
    stream: bool
    p: Backend
    d: Backend
    transfer_id: str
    deadline: float
    headers: list[tuple[bytes, bytes]]
    p_headers: list[tuple[bytes, bytes]]  # with ``x-data-parallel-rank`` when P has DP ranks
    p_engine_id: str | None  # the engine id of the DP rank P's request goes to
    state: ExchangeState
    p_scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    d_scopes: list[trio.CancelScope] = field(default_factory=list)
    #: ``"disaggregated"``, ``"local"`` (D computes the prompt) or ``"whole-on-p"`` (a P
    #: serves it whole, as :attr:`d`).
    placement: str = "disaggregated"
    prompt_chars: int = 0  # a text prompt's characters (0 for token ids)
    #: When P answered and when D's headers came (trio clock), for the debug timeline.
    p_answered: float | None = None
    d_answered: float | None = None
    #: The request's span (:mod:`pdactors.proxy._tracing`), ended with the exchange.
    span: RequestSpan | None = None
    #: The engines whose decoding leg of this request failed: a migration never goes back to
    #: one of them.
    failed_engines: set[str] = field(default_factory=set)

    @property
    def arrived(self) -> float:
        return self.state.arrived

    @property
    def failure(self) -> Failure | None:
        """The first failure (the request's cause), while the record holds one."""
        cause = self.state.cause
        assert cause is None or isinstance(cause, Failure)
        return cause

    @property
    def earlier_failures(self) -> tuple[str, ...]:
        """What failed before the request's failure, as the client is told it: P beside D
        (the concurrent flow), D's first leg when D was asked again, and each engine that
        decoded before another continued."""
        p, d = self.state.p_cause, self.state.retried_after
        assert p is None or isinstance(p, Failure)
        assert d is None or isinstance(d, Failure)
        told: tuple[str, ...] = () if p is None else (p.message,)
        if d is not None:
            told += (f"{d.message}; asked again to compute the prompt itself, it failed too",)
        for moved in self.state.migrated_after:
            assert isinstance(moved, Failure)
            told += (f"{moved.message}; another engine continued",)
        return told

    def told(self) -> Failure:
        """The request's failure as the client gets it, naming what failed before it."""
        failure = self.failure
        assert failure is not None
        return failure.after(*self.earlier_failures)

    def backend(self, leg: Leg) -> Backend:
        return self.p if leg == "p" else self.d

    def decode_scope(self) -> trio.CancelScope:
        """A scope for the next part of D's leg: cancelled by a failure, even an earlier one."""
        scope = trio.CancelScope()
        if self.failure is not None:
            scope.cancel()
        self.d_scopes.append(scope)
        return scope

    def cancel_legs(self) -> None:
        self.p_scope.cancel()
        for scope in self.d_scopes:
            scope.cancel()
