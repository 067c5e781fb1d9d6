"""The one place where an exchange record's effects are carried out: the engines' counts, the
metrics, what the placer learns, the operator's log lines, the answer's placement header, the
legs' cancel scopes.

Nothing else in the proxy changes an engine's counts for a request, or counts a request's
flow: the IO code feeds each event to the record (:mod:`pdactors.core.exchange`) and hands
what it returns to :meth:`ExchangeEffects.apply`. Every count an exchange holds is raised by
the record's admission in :meth:`ExchangeEffects.admitted` and given back by its end, which
the same context manager reaches on every path out (a failure, a bug, a cancellation): the
raise and the ``finally`` that releases it have no checkpoint between them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import trio

from pdactors.core.exchange import Flow
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
from pdactors.core.placement import Placer
from pdactors.proxy._asgi import PLACEMENT_HEADER
from pdactors.proxy._exchange import Exchange
from pdactors.proxy._kv_release import KvReleases
from pdactors.proxy._openai import Failure
from pdactors.proxy._state import Backend, Metrics
from pdactors.proxy_config import ProxyConfig

__all__ = ["ExchangeEffects"]

log = logging.getLogger("pdactors.proxy")


def _b(engine: object) -> Backend:
    assert isinstance(engine, Backend)
    return engine


class ExchangeEffects:
    """The bookkeeping of every exchange: counts, metrics, placer, logs, scopes."""

    def __init__(
        self, config: ProxyConfig, metrics: Metrics, placer: Placer, releases: KvReleases
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.placer = placer
        self.releases = releases

    def apply(self, ex: Exchange, effects: Sequence[Effect]) -> None:
        """Carry out ``effects`` of ``ex``'s record, in order. Not a checkpoint."""
        for effect in effects:
            self._one(ex, effect)

    def _one(self, ex: Exchange, effect: Effect) -> None:
        m = self.metrics
        match effect:
            case Admit(p=p, d=d):
                if p is not None:
                    _b(p).outstanding += 1
                _b(d).outstanding += 1
                m.in_flight.inc()
            case Hold(engine=engine, tokens=tokens, waiting=waiting):
                _queue(_b(engine), waiting, tokens, 1)
            case Unhold(engine=e, tokens=tokens, waiting=waiting, tokens_ahead=ahead, seconds=s):
                _queue(_b(e), waiting, -tokens, -1)
                if s is not None:
                    self.placer.first_token(_b(e).url, ahead, s)
            case Release(engine=engine):
                _b(engine).outstanding -= 1
                _b(engine).released()
            case Migrate(frm=frm, to=to, number=number, cause=cause):
                _b(frm).outstanding -= 1
                _b(frm).released()
                _b(to).outstanding += 1
                log.log(
                    logging.WARNING if number == 1 else logging.INFO,
                    "proxy: request %s: %s; %s engine %s continues it (migration %d of at "
                    "most %d)",
                    ex.transfer_id, cause.message[:300], _b(to).role, _b(to).url, number,
                    self.config.migration_limit,
                )  # fmt: skip
                m.migrations.labels(_b(to).role).inc()
            case Ended(outcome=outcome, latency=latency):
                m.in_flight.dec()
                m.requests.labels(ex.endpoint.name, outcome).inc()
                if latency is not None:
                    m.latency.labels(ex.p.url, ex.d.url).observe(latency)
                if ex.span is not None:
                    ex.span.end(outcome, {"pdactors.placement": ex.state.placement})
            case CancelLegs():
                ex.p_scope.cancel()
                for scope in ex.d_scopes:
                    scope.cancel()
            case FreshLeg():
                ex.d_scopes = []  # the failed leg's, cancelled by its failure
            case FreeAtP(engine=p):
                self.releases.free(_b(p).url, ex.p_headers, ex.model, ex.transfer_id)
            case Placed(placement=placement, why=why):
                if why is not None:
                    m.placement.labels(placement, why).inc()
                headers = ex.reply.headers
                headers[:] = [(k, v) for k, v in headers if k != PLACEMENT_HEADER]
                headers.append((PLACEMENT_HEADER, placement.encode()))
            case FellBack(why=why, cause=cause):
                if cause is not None:
                    log.warning(
                        "proxy: request %s: prefill engine failed before its first token "
                        "(%s); decode engine %s serves it alone",
                        ex.transfer_id, cause.message[:300], ex.d.url,
                    )  # fmt: skip
                m.fallbacks.labels(why).inc()
            case Retried(why=why, cause=cause):
                log.warning(
                    "proxy: request %s: %s; asked again with decode engine %s computing the "
                    "prompt itself (%s)",
                    ex.transfer_id, cause.message[:300], ex.d.url, why,
                )  # fmt: skip
                m.retries.labels(why).inc()
            case DGoesOn(cause=cause):
                log.warning(
                    "proxy: request %s: %s; decode engine %s goes on without it (its KV "
                    "decides: landed, it answers; else it is asked again computing the prompt "
                    "itself)",
                    ex.transfer_id, cause.message[:300], ex.d.url,
                )  # fmt: skip
            case PFirstPath(path=path):
                m.p_first.labels(path).inc()
            case PromptCounted(chars=chars, tokens=tokens):
                self.placer.count.observe(chars, tokens)
            case FirstChunk(ttft=ttft):
                m.ttft.labels(ex.p.url, ex.d.url).observe(ttft)
                if log.isEnabledFor(logging.DEBUG):
                    _log_timeline(ex, ttft)
            case SecondChunk(since_arrival=since, caught_up=caught_up, tokens=tokens):
                m.second_chunk.labels(ex.p.url, ex.d.url).observe(since)
                if caught_up is not None:
                    self.placer.caught_up(ex.d.url, tokens, caught_up)
            case Step(seconds=seconds, gaps=gaps, per_chunk=per_chunk):
                self.placer.steps(ex.d.url, seconds, gaps, per_chunk)

    @contextmanager
    def admitted(
        self, ex: Exchange, flow: Flow, *, why: str, fallback: str | None = None
    ) -> Iterator[None]:
        """Admit ``ex`` in ``flow`` (placed for ``why``; ``fallback``: why one engine serves
        it alone) and hold its counts for the block's life; they are given back however it is
        left (an exchange not ended by then ends ``cancelled``)."""
        at = ex.p if flow in (Flow.P_FIRST, Flow.CONCURRENT) else ex.d
        now = trio.current_time()
        self.apply(ex, ex.state.start(flow, now, self.ahead(ex, at), why=why, fallback=fallback))
        try:
            yield
        finally:
            self.end(ex, "cancelled")  # (nothing when it ended already)

    @staticmethod
    def ahead(ex: Exchange, engine: Backend) -> int:
        """The prompt tokens waiting at ``engine`` once ``ex``'s prompt is sent there."""
        return engine.waiting_tokens + ex.state.prompt_tokens

    def fail(self, ex: Exchange, failure: Failure) -> None:
        """D's leg failed with ``failure``."""
        self.apply(ex, ex.state.fail(failure))

    def end(self, ex: Exchange, outcome: str) -> None:
        self.apply(ex, ex.state.end(outcome, trio.current_time()))


def _queue(engine: Backend, waiting: object | None, tokens: int, requests: int) -> None:
    engine.waiting_tokens += tokens
    engine.prefills += requests
    if waiting is not None:  # that D waits for this prompt's KV
        _b(waiting).incoming += requests


def _log_timeline(ex: Exchange, ttft: float) -> None:
    def ms(t: float | None) -> str:
        return "-" if t is None else f"{(t - ex.state.arrived) * 1e3:.1f}"

    log.debug(
        "proxy: request %s timeline ms: D answered %s, first chunk %.1f, P answered %s",
        ex.transfer_id, ms(ex.state.d_answered_at), ttft * 1e3, ms(ex.state.p_answered_at),
    )  # fmt: skip
