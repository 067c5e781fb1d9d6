"""The proxy's calls to its engines for one exchange — P's leg, D's answer whole or streamed.

Each call's events go to the exchange's record, whose effects :class:`~pdactors.proxy._effects.
ExchangeEffects` carries out (:class:`Legs` is one). A leg's failure becomes a
:class:`~pdactors.proxy._openai.Failure` worded by :mod:`~pdactors.proxy._engine_failures` (a
4xx passes through, anything else is a 502 naming the engine, no answer in time a 504) and is
fed to the record, whose first failure cancels both legs; D's leg that failed before any of its
answer was relayed may be asked once more (:mod:`~pdactors.proxy._retry`). A stream already
begun ends with an error event.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

import msgspec
import trio

from pdactors.core.placement import Placer
from pdactors.proxy._asgi import Reply
from pdactors.proxy._effects import ExchangeEffects
from pdactors.proxy._engine_failures import EngineFailures
from pdactors.proxy._engine_http import EngineClient, EngineError, EngineResponse
from pdactors.proxy._exchange import Exchange
from pdactors.proxy._health import HealthWatch
from pdactors.proxy._openai import COMPLETIONS, Failure
from pdactors.proxy._relay import relay_stream
from pdactors.proxy._retry import migration_target, retry_reason
from pdactors.proxy._state import Backend, Metrics
from pdactors.proxy._stream import ClientStream
from pdactors.proxy_config import ProxyConfig

__all__ = ["Legs"]

log = logging.getLogger("pdactors.proxy")

#: How long a relay waits to hand a final error event to a slow client.
_LAST_EVENT_TIMEOUT: Final = 1.0


class Legs(ExchangeEffects):
    """The engine calls of every exchange (and, as :class:`ExchangeEffects`, their bookkeeping:
    counts, metrics, placer)."""

    def __init__(
        self,
        config: ProxyConfig,
        engines: dict[str, EngineClient],
        metrics: Metrics,
        placer: Placer,
        watch: HealthWatch,
    ) -> None:
        super().__init__(metrics, placer)
        self.config = config
        self.engines = engines
        self.watch = watch
        self.failures = EngineFailures(config, metrics, watch)

    # ------------------------------------------------------------------ P's leg

    async def prefill_leg(
        self, ex: Exchange, body: bytes, *, beside_d: bool = False
    ) -> bytes | None:
        """P's whole answer, or None when P failed (or gave no answer by the deadline).

        The request depends on P (the P-first flow, ``beside_d`` false): P's failure fails
        it, and so does P judged failed by the health loop while the request waits (its leg
        is cut: :attr:`~pdactors.proxy._state.Backend.waiting_on`). D runs beside P
        (the concurrent flow): only P's 4xx (the request's own fault) fails the request; any
        other failure of P is noted and logged, and D's answer decides — a D that has the KV
        goes on, one whose KV did not come fails before its first token and is asked again
        computing the prompt itself; P's leg is never cut by P's health there."""
        failure: Failure | None = None
        answer: bytes | None = None
        answered = False
        cut = trio.CancelScope()  # P-first: cancelled if P is judged failed meanwhile
        with ex.p_scope, trio.move_on_at(ex.deadline) as timer, cut:
            try:
                with _waiting_on(ex.p, cut, depends=not beside_d):
                    resp = await self.engines[ex.p.url].request(
                        "POST", ex.endpoint.path, body, ex.p_headers
                    )
                    answer = await resp.read()
            except EngineError as exc:
                failure = self.failures.transport_failure(ex.p, exc)
            else:
                ex.p_answered = trio.current_time()
                answered = resp.status == 200
                if resp.status != 200:
                    failure = self.failures.status_failure(ex.p, resp.status, answer)
            finally:
                now = ex.p_answered if answered else trio.current_time()
                assert now is not None
                self.apply(ex, ex.state.prefill_ended(now, answered=answered))
        if cut.cancelled_caught:
            failure = self.failures.judged_failed(ex.p)
        elif timer.cancelled_caught:
            failure = self.failures.timeout_failure("no answer from P")
        if failure is None:
            return answer
        if beside_d and failure.status >= 500 and not ex.state.over:
            if ex.state.p_cause is None and ex.failure is None:
                log.warning(
                    "proxy: request %s: %s; decode engine %s goes on without it (its KV "
                    "decides: landed, it answers; else it is asked again computing the prompt "
                    "itself)",
                    ex.transfer_id, failure.message[:300], ex.d.url,
                )  # fmt: skip
            self.apply(ex, ex.state.prefill_failed(failure))
        else:
            self.fail(ex, failure)  # (after the answer ended: nothing)
        return None

    # ------------------------------------------------------------------ D's leg

    async def answer_from_decode(
        self,
        ex: Exchange,
        body: dict[str, Any],
        reply: Reply,
        *,
        d_body: bytes | None = None,
        local: bytes | None = None,
    ) -> None:
        """Ask D and answer the client with D's answer, as it comes (ends ``ex``): D gets
        ``d_body`` (default: the client's ``body``). ``local``: the same request with D
        computing the prompt itself, asked once when D's leg fails before any of its answer
        reached the client (its KV did not come: :meth:`retry`). A D that fails otherwise
        hands the request to another engine (:meth:`migrate`)."""
        if ex.stream:
            stream = ClientStream(body, ex.endpoint.chat)
            native = stream.native_body(body if d_body is None else msgspec.json.decode(d_body))
            if local is not None:
                local = msgspec.json.encode(stream.native_body(msgspec.json.decode(local)))
            await self.relay_decode(ex, msgspec.json.encode(native), reply, stream, local=local)
            return
        plain = msgspec.json.encode(body)
        raw = await self.decode_whole(ex, plain if d_body is None else d_body, local=local)
        if raw is None:
            await self.answer_failure(ex, reply)
            return
        self.end(ex, "ok")
        await reply.whole(200, raw, ex.transfer_id)

    async def answer_failure(self, ex: Exchange, reply: Reply) -> None:
        """End ``ex`` with its failure, answered as an HTTP status."""
        failure = ex.told()
        log.warning("proxy: request %s failed: %s", ex.transfer_id, failure.body[:500])
        self.end(ex, failure.outcome)
        await reply.failure(failure, ex.transfer_id)

    def retry(self, ex: Exchange, local: bytes | None) -> bool:
        """Whether D's failed leg is asked again now with ``local`` (D computing the prompt
        itself): :func:`retry_reason` says so. Counted and logged once with why; the
        record moves the prompt to D's queue."""
        why = retry_reason(ex, local, trio.current_time())
        if why is None:
            return False
        failure = ex.failure
        assert failure is not None
        log.warning(
            "proxy: request %s: %s; asked again with decode engine %s computing the prompt "
            "itself (%s)",
            ex.transfer_id, failure.message[:300], ex.d.url, why,
        )  # fmt: skip
        self.metrics.retries.labels(why).inc()
        ahead = ex.d.waiting_tokens + ex.state.prompt_tokens
        self.apply(ex, ex.state.retry(trio.current_time(), ahead))
        ex.d_scopes = []  # the first leg's, cancelled by its failure
        return True

    def migrate(self, ex: Exchange) -> bool:
        """Whether ``ex``'s failed decoding leg is handed to another engine now
        (:func:`migration_target` says which). Counted and logged (at WARNING the first
        time, then at INFO); the record moves D's count to it."""
        to = migration_target(ex, self.config, self.watch, trio.current_time())
        if to is None:
            return False
        failure = ex.failure
        assert failure is not None
        done = len(ex.state.migrated_after)
        log.log(
            logging.WARNING if done == 0 else logging.INFO,
            "proxy: request %s: %s; %s engine %s continues it (migration %d of at most %d)",
            ex.transfer_id, failure.message[:300], to.role, to.url, done + 1,
            self.config.migration_limit,
        )  # fmt: skip
        self.metrics.migrations.labels(to.role).inc()
        ex.failed_engines.add(ex.d.url)
        self.apply(ex, ex.state.migrate(to))
        ex.d_scopes = []  # the failed leg's, cancelled by its failure
        return True

    async def decode_whole(
        self, ex: Exchange, body: bytes, *, local: bytes | None = None, path: str | None = None
    ) -> bytes | None:
        """D's whole answer (not streamed) to ``body`` on ``path``, asked again with
        ``local`` once when D fails with its KV missing (:meth:`retry`), and handed to another
        engine with ``local`` (or ``body`` when D computed the prompt already) when D fails
        otherwise (:meth:`migrate`); None with ``ex.failure`` set."""
        attempt = body
        while True:
            engine, cut = ex.d, trio.CancelScope()
            raw = None
            with cut, _waiting_on(engine, cut):
                resp = await self.open_decode(ex, attempt, path)
                raw = None if resp is None else await self.read_whole(ex, resp)
            if cut.cancelled_caught and ex.failure is None:
                self.fail(ex, self.failures.judged_failed(engine))
            if raw is not None:
                return raw
            if self.retry(ex, local):
                assert local is not None
                attempt = local
            elif self.migrate(ex):
                attempt = local or body
            else:
                return None

    async def relay_decode(
        self,
        ex: Exchange,
        body: bytes,
        reply: Reply,
        stream: ClientStream,
        *,
        local: bytes | None = None,
        path: str | None = None,
    ) -> None:
        """Hand D's streamed answer to ``body`` to the client as it comes, made into the
        client's stream by ``stream``: asking D again with ``local`` once when its leg fails
        before any of its answer was relayed (:meth:`retry`), or another engine right after
        what the client got when D fails otherwise (:meth:`migrate`); a failure with nothing
        sent yet is answered as an HTTP status, one in a begun stream as its last event.
        Ends ``ex``."""
        outcome = "cancelled"
        try:
            attempt = body
            while True:
                relayed = await self._decode_leg(ex, attempt, path, reply, stream)
                if relayed is not None:
                    outcome = relayed
                    break
                if self.retry(ex, local):
                    assert local is not None
                    attempt = local
                    continue
                leg = stream.next_leg() if ex.failure is not None else None
                if leg is not None and self.migrate(ex):
                    next_body, completion = leg
                    attempt = msgspec.json.encode(next_body)
                    path = COMPLETIONS.path if completion else None
                    continue
                if not reply.started:
                    await self.answer_failure(ex, reply)
                    return
                await self.stream_failure(ex, reply)
                outcome = ex.told().outcome
                break
            await reply.chunk(b"", more=False)
        finally:
            self.end(ex, outcome)  # not ok: P's leg is cancelled now

    async def _decode_leg(
        self, ex: Exchange, body: bytes, path: str | None, reply: Reply, stream: ClientStream
    ) -> str | None:
        """One engine's streamed answer to ``body``, relayed (:func:`relay_stream`'s outcome), or
        None with ``ex.failure`` set: that engine failed, or was judged failed meanwhile (a
        stopped or hung engine sends nothing, breaks nothing: its verdict cuts the leg)."""
        engine, cut = ex.d, trio.CancelScope()
        resp: EngineResponse | None = None
        relayed = None
        try:
            with cut, _waiting_on(engine, cut):
                resp = await self.open_decode(ex, body, path)
                if resp is not None:
                    if not reply.started:
                        await reply.start(
                            200, b"text/event-stream", ex.transfer_id,
                            (b"cache-control", b"no-cache"),
                        )  # fmt: skip
                    relayed = await relay_stream(self, self.failures, ex, resp, reply, stream.feed)
        finally:
            if resp is not None:
                await resp.aclose()
        if cut.cancelled_caught and ex.failure is None:
            self.fail(ex, self.failures.judged_failed(engine))
        return relayed

    async def open_decode(
        self, ex: Exchange, body: bytes, path: str | None = None
    ) -> EngineResponse | None:
        """D's open answer (status 200) on ``path`` (default: the client's), or None with
        ``ex.failure`` set: D failed, P failed first, or nothing came by the deadline. The
        caller owns the answer."""
        resp: EngineResponse | None = None
        try:
            with ex.decode_scope(), trio.move_on_at(ex.deadline) as timer:
                try:
                    resp = await self.engines[ex.d.url].request(
                        "POST", path or ex.endpoint.path, body, ex.headers
                    )
                    if resp.status != 200:
                        answer = await resp.read()
                        self.fail(ex, self.failures.status_failure(ex.d, resp.status, answer))
                except EngineError as exc:
                    self.fail(ex, self.failures.transport_failure(ex.d, exc))
            if timer.cancelled_caught and ex.failure is None:
                self.fail(ex, self.failures.timeout_failure("no answer from D"))
            if ex.failure is not None:  # D's answer (if any) is of no use: close it
                if resp is not None:
                    await resp.aclose()
                return None
            ex.d_answered = trio.current_time()
            self.apply(ex, ex.state.d_answered())
            return resp
        except BaseException:
            if resp is not None:
                await resp.aclose()
            raise

    async def read_whole(self, ex: Exchange, resp: EngineResponse) -> bytes | None:
        """D's whole answer, or None with ``ex.failure`` set; closes ``resp``."""
        try:
            with ex.decode_scope(), trio.move_on_at(ex.deadline) as timer:
                try:
                    return await resp.read()
                except EngineError as exc:
                    self.fail(ex, self.failures.transport_failure(ex.d, exc))
            if timer.cancelled_caught and ex.failure is None:
                self.fail(ex, self.failures.timeout_failure("D did not finish"))
            return None
        finally:
            await resp.aclose()

    async def stream_failure(self, ex: Exchange, reply: Reply) -> None:
        """End a begun stream with the request's failure (or D's timeout) as an event."""
        if ex.failure is None:
            self.fail(ex, self.failures.timeout_failure("D did not finish"))
        failure = ex.told()
        log.warning("proxy: request %s failed mid-stream: %s", ex.transfer_id, failure.body[:500])
        with trio.move_on_after(_LAST_EVENT_TIMEOUT):
            await reply.chunk(failure.sse_event())


@contextmanager
def _waiting_on(b: Backend, cut: trio.CancelScope, *, depends: bool = True) -> Iterator[None]:
    """While ``b``'s answer is awaited by a request that ``depends`` on it, ``cut`` is in
    ``b``'s :attr:`~pdactors.proxy._state.Backend.waiting_on`, cancelled if ``b`` is judged
    failed meanwhile. It leaves before ``b``'s own failure (if any) is worded, so the verdict
    on a refused connection does not cut the request that met it."""
    if not depends:
        yield
        return
    b.waiting_on.add(cut)
    try:
        yield
    finally:
        b.waiting_on.discard(cut)
