"""The one place where an exchange record's effects are carried out: the engines' counts, the
metrics, what the placer learns, the legs' cancellation.

Every count an exchange holds is raised by :meth:`ExchangeEffects.admitted` and given back by
the record's end, which the same context manager reaches on every path out (a failure, a bug,
a cancellation): the raise and the ``finally`` that releases it have no checkpoint between
them. The calls to the engines (:class:`~pdactors.proxy._legs.Legs`) feed each event to the
record and its effects here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import trio

from pdactors.core.exchange import (
    Admit,
    CancelLegs,
    Effect,
    Ended,
    FirstChunk,
    Hold,
    Leg,
    Migrate,
    Release,
    SecondChunk,
    Step,
    Unhold,
)
from pdactors.core.placement import Placer
from pdactors.proxy._exchange import Exchange
from pdactors.proxy._openai import Failure
from pdactors.proxy._state import Backend, Metrics

__all__ = ["ExchangeEffects"]

log = logging.getLogger("pdactors.proxy")


class ExchangeEffects:
    """The bookkeeping of every exchange: counts, metrics, placer."""

    def __init__(self, metrics: Metrics, placer: Placer) -> None:
        self.metrics = metrics
        self.placer = placer

    def apply(self, ex: Exchange, effects: Sequence[Effect]) -> None:
        """Carry out ``effects`` of ``ex``'s record, in order. Not a checkpoint."""
        for effect in effects:
            match effect:
                case Admit(p=with_p):
                    if with_p:
                        ex.p.outstanding += 1
                    ex.d.outstanding += 1
                    self.metrics.in_flight.inc()
                case Hold(engine=leg, tokens=tokens):
                    self._queue(ex, ex.backend(leg), tokens, 1)
                case Unhold(engine=leg, tokens=tokens, tokens_ahead=ahead, seconds=seconds):
                    engine = ex.backend(leg)
                    self._queue(ex, engine, -tokens, -1)
                    if seconds is not None:
                        self.placer.first_token(engine.url, ahead, seconds)
                case Release(engine=leg):
                    engine = ex.backend(leg)
                    engine.outstanding -= 1
                    engine.released()
                case Migrate(to=to):
                    assert isinstance(to, Backend)
                    ex.d.outstanding -= 1
                    ex.d.released()
                    ex.d = to
                    to.outstanding += 1
                case CancelLegs():
                    ex.cancel_legs()
                case Ended(outcome=outcome, latency=latency):
                    self.metrics.in_flight.dec()
                    self.metrics.requests.labels(ex.endpoint.name, outcome).inc()
                    if latency is not None:
                        self.metrics.latency.labels(ex.p.url, ex.d.url).observe(latency)
                    if ex.span is not None:
                        ex.span.end(outcome, {"pdactors.placement": ex.placement})
                case FirstChunk(ttft=ttft):
                    self.metrics.ttft.labels(ex.p.url, ex.d.url).observe(ttft)
                    if log.isEnabledFor(logging.DEBUG):
                        _log_timeline(ex, ttft)
                case SecondChunk(since_arrival=since, caught_up=caught_up, tokens=tokens):
                    self.metrics.second_chunk.labels(ex.p.url, ex.d.url).observe(since)
                    if caught_up is not None:
                        self.placer.caught_up(ex.d.url, tokens, caught_up)
                case Step(seconds=seconds, gaps=gaps, per_chunk=per_chunk):
                    self.placer.steps(ex.d.url, seconds, gaps, per_chunk)

    @staticmethod
    def _queue(ex: Exchange, engine: Backend, tokens: int, requests: int) -> None:
        engine.waiting_tokens += tokens
        engine.prefills += requests
        if engine is not ex.d:  # D waits for this prompt's KV
            ex.d.incoming += requests

    @contextmanager
    def admitted(self, ex: Exchange, *, with_p: bool) -> Iterator[None]:
        """Raise ``ex``'s counts for the block's life; they are given back however it is left
        (an exchange not ended by then ends ``cancelled``)."""
        self.apply(ex, ex.state.admit(with_p=with_p))
        try:
            yield
        finally:
            self.end(ex, "cancelled")  # (nothing when it ended already)

    def prefill_sent(self, ex: Exchange, leg: Leg) -> None:
        """``ex``'s prompt goes to ``leg``'s engine now: it waits in its prefill queue."""
        engine = ex.backend(leg)
        ahead = engine.waiting_tokens + ex.state.prompt_tokens
        self.apply(ex, ex.state.prefill_sent(leg, trio.current_time(), ahead))

    def fail(self, ex: Exchange, failure: Failure) -> None:
        self.apply(ex, ex.state.fail(failure))

    def end(self, ex: Exchange, outcome: str) -> None:
        self.apply(ex, ex.state.end(outcome, trio.current_time()))


def _log_timeline(ex: Exchange, ttft: float) -> None:
    def ms(t: float | None) -> str:
        return "-" if t is None else f"{(t - ex.arrived) * 1e3:.1f}"

    log.debug(
        "proxy: request %s timeline ms: D answered %s, first chunk %.1f, P answered %s",
        ex.transfer_id, ms(ex.d_answered), ttft * 1e3, ms(ex.p_answered),
    )  # fmt: skip
