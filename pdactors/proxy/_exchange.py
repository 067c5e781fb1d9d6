"""One client request's exchange as the proxy's IO code holds it: the handles its IO needs —
the request's endpoint and transfer id, the headers its engines get, the client's reply, the
cancel scopes of its legs, its span — beside its sans-IO record
(:class:`~pdactors.core.exchange.ExchangeState`), which holds everything of its life (flow,
phase, engines, failures, what the client got, the counts it holds). The record's effects are
carried out by :class:`pdactors.proxy._effects.ExchangeEffects`, and only there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio

from pdactors.core.exchange import ExchangeState
from pdactors.proxy._asgi import Reply
from pdactors.proxy._openai import Endpoint, Failure
from pdactors.proxy._state import Backend
from pdactors.proxy._tracing import RequestSpan

__all__ = ["Exchange"]


@dataclass(eq=False)
class Exchange:
    """One client request: its record, and the handles its IO uses.

    ``p_scope`` bounds P's leg, :meth:`decode_scope` each part of D's (its head, then its
    body): the record's :class:`~pdactors.core.exchange_effects.CancelLegs` cancels them all.
    """

    endpoint: Endpoint
    stream: bool
    transfer_id: str
    headers: list[tuple[bytes, bytes]]
    p_headers: list[tuple[bytes, bytes]]  # with ``x-data-parallel-rank`` when P has DP ranks
    p_engine_id: str | None  # the engine id of the DP rank P's request goes to
    state: ExchangeState[Backend]
    reply: Reply
    p_scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    d_scopes: list[trio.CancelScope] = field(default_factory=list)
    #: The request's span (:mod:`pdactors.proxy._tracing`), ended with the exchange.
    span: RequestSpan | None = None
    model: str = ""  # the model the client named ("": none)

    @property
    def p(self) -> Backend:
        """P's engine (a stand-in named ``none`` where the request has no P)."""
        return self.state.p

    @property
    def d(self) -> Backend:
        """The engine decoding the request now (a P, where one serves it whole)."""
        return self.state.d

    @property
    def deadline(self) -> float:
        return self.state.deadline

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
        told: tuple[str, ...] = () if p is None else (p.message,)
        if d is not None:
            told += (f"{d.message}; asked again to compute the prompt itself, it failed too",)
        for moved in self.state.migrated_after:
            told += (f"{moved.message}; another engine continued",)
        return told

    def told(self) -> Failure:
        """The request's failure as the client gets it, naming what failed before it."""
        failure = self.failure
        assert failure is not None
        return failure.after(*self.earlier_failures)

    def decode_scope(self) -> trio.CancelScope:
        """A scope for the next part of D's leg: cancelled by a failure, even an earlier one."""
        scope = trio.CancelScope()
        if self.failure is not None:
            scope.cancel()
        self.d_scopes.append(scope)
        return scope
