"""The proxy's calls to its engines for one exchange: P's leg, and one engine's leg of D's
answer, whole or streamed. Nothing else: what a call's outcome means is the record's
(:mod:`pdactors.core.exchange`), its effects are :class:`~pdactors.proxy._effects.
ExchangeEffects`' to carry out, and what follows a failed leg is the flow's
(:mod:`pdactors.proxy._flows`).

Each call feeds its events to the exchange's record and hands the effects back. A leg's
failure becomes a :class:`~pdactors.proxy._openai.Failure` worded by
:mod:`~pdactors.proxy._engine_failures` (a 4xx passes through, anything else is a 502 naming
the engine, no answer in time a 504) and is fed to the record, whose first failure cancels
every leg. A leg that waits on an engine the health loop judges failed meanwhile is cut from
it (:attr:`~pdactors.proxy._state.Backend.waiting_on`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import trio

from pdactors.core.exchange import Flow
from pdactors.proxy._effects import ExchangeEffects
from pdactors.proxy._engine_failures import EngineFailures
from pdactors.proxy._engine_http import EngineClient, EngineError, EngineResponse
from pdactors.proxy._exchange import Exchange
from pdactors.proxy._health import HealthWatch
from pdactors.proxy._openai import Failure
from pdactors.proxy._relay import relay_stream
from pdactors.proxy._state import Backend, Cut
from pdactors.proxy._stream import ClientStream
from pdactors.proxy_config import ProxyConfig

__all__ = ["Legs"]


class Legs:
    """The engine calls of every exchange."""

    def __init__(
        self,
        config: ProxyConfig,
        engines: dict[str, EngineClient],
        effects: ExchangeEffects,
        watch: HealthWatch,
    ) -> None:
        self.engines = engines
        self.effects = effects
        self.failures = EngineFailures(config, effects.metrics, watch)

    # ------------------------------------------------------------------ P's leg

    async def prefill_leg(self, ex: Exchange, body: bytes) -> bytes | None:
        """P's whole answer, or None when P failed (or gave no answer by the deadline): the
        failure goes to the record, which decides what it means — P-first, the request
        depends on P's token (it fails, then perhaps falls back to D); beside D (the
        concurrent flow) P's own failure is only noted and D's answer decides, while P's 4xx
        (the request's own fault) fails it. A P-first leg is cut when the health loop judges
        P failed meanwhile; a concurrent one never is (D's KV decides)."""
        failure: Failure | None = None
        answer: bytes | None = None
        status: int | None = None
        answered_at = 0.0
        cut = trio.CancelScope()  # P-first: cancelled if P is judged failed meanwhile
        depends = ex.state.flow is Flow.P_FIRST
        with ex.p_scope, trio.move_on_at(ex.deadline) as timer, cut:
            try:
                with _waiting_on(ex.p, cut, depends=depends):
                    resp = await self.engines[ex.p.url].request(
                        "POST", ex.endpoint.path, body, ex.p_headers
                    )
                    answer = await resp.read()
            except EngineError as exc:
                failure = self.failures.transport_failure(ex.p, exc)
            else:
                answered_at, status = trio.current_time(), resp.status
                if resp.status != 200:
                    failure = self.failures.status_failure(ex.p, resp.status, answer)
            finally:
                now = answered_at if status is not None else trio.current_time()
                self.effects.apply(ex, ex.state.p_ended(now, status=status))
        if cut.cancelled_caught:
            failure = self.failures.judged_failed(ex.p)
        elif timer.cancelled_caught:
            failure = self.failures.timeout_failure("no answer from P")
        if failure is None:
            return answer
        self.effects.apply(ex, ex.state.p_failed(failure))  # (after the answer ended: nothing)
        return None

    # ------------------------------------------------------------------ one engine's leg of D's

    async def whole_answer(self, ex: Exchange, body: bytes, path: str | None) -> bytes | None:
        """The decoding engine's whole answer (not streamed) to ``body`` on ``path``, or None
        with ``ex.failure`` set: it failed, or was judged failed meanwhile."""
        engine, cut = ex.d, trio.CancelScope()
        raw = None
        with cut, _waiting_on(engine, cut):
            resp = await self.open_decode(ex, body, path)
            raw = None if resp is None else await self.read_whole(ex, resp)
        if cut.cancelled_caught and ex.failure is None:
            self.effects.fail(ex, self.failures.judged_failed(engine))
        return raw

    async def streamed_answer(
        self, ex: Exchange, body: bytes, path: str | None, stream: ClientStream
    ) -> str | None:
        """The decoding engine's streamed answer to ``body``, relayed to the client
        (:func:`relay_stream`'s outcome; the client's stream opened first if it was not), or
        None with ``ex.failure`` set: that engine failed, or was judged failed meanwhile (a
        stopped or hung engine sends nothing, breaks nothing: its verdict cuts the leg)."""
        engine, cut = ex.d, _StreamCut()
        resp: EngineResponse | None = None
        relayed = None
        try:
            with cut.scope, _waiting_on(engine, cut):
                resp = await self.open_decode(ex, body, path)
                if resp is not None:
                    if not ex.state.streaming:
                        self.effects.apply(ex, ex.state.stream_opened())
                        await ex.reply.start(
                            200, b"text/event-stream", ex.transfer_id,
                            (b"cache-control", b"no-cache"),
                        )  # fmt: skip
                    relayed = await relay_stream(
                        self.effects, self.failures, ex, resp, stream.feed, cut.writing
                    )
        finally:
            if resp is not None:
                await resp.aclose()
        if cut.scope.cancelled_caught and ex.failure is None:
            self.effects.fail(ex, self.failures.judged_failed(engine))
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
                        failure = self.failures.status_failure(ex.d, resp.status, answer)
                        self.effects.fail(ex, failure)
                except EngineError as exc:
                    self.effects.fail(ex, self.failures.transport_failure(ex.d, exc))
            if timer.cancelled_caught and ex.failure is None:
                self.effects.fail(ex, self.failures.timeout_failure("no answer from D"))
            if ex.failure is not None:  # D's answer (if any) is of no use: close it
                if resp is not None:
                    await resp.aclose()
                return None
            self.effects.apply(ex, ex.state.d_answered(trio.current_time()))
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
                    self.effects.fail(ex, self.failures.transport_failure(ex.d, exc))
            if timer.cancelled_caught and ex.failure is None:
                self.effects.fail(ex, self.failures.timeout_failure("D did not finish"))
            return None
        finally:
            await resp.aclose()


class _StreamCut:
    """The cut of a streamed leg (an engine judged failed, or drained with ``migrate``), held
    off while the leg writes the client what its stream already counts as the client's
    (:meth:`writing`) and taken as the write ends: the next engine continues right after what
    the client got. Cut inside the write, those tokens were counted and never sent (a token
    missing from the text: found by bench/d_failover.py). Only the cut waits: the client gone,
    the deadline, a request whose other choice failed still cancel the write."""

    def __init__(self) -> None:
        self.scope = trio.CancelScope()
        self._writing = False
        self._owed = False

    def cancel(self) -> None:
        if self._writing:
            self._owed = True
        else:
            self.scope.cancel()

    @contextmanager
    def writing(self) -> Iterator[None]:
        self._writing = True
        try:
            yield
        finally:
            self._writing = False
            if self._owed:
                self.scope.cancel()


@contextmanager
def _waiting_on(b: Backend, cut: Cut, *, depends: bool = True) -> Iterator[None]:
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
