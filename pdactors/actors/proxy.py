"""The proxy: an OpenAI-compatible front door for prefill/decode disaggregation.

:func:`serve_proxy` serves ``POST /v1/completions`` and ``POST /v1/chat/completions`` (quart-trio
on hypercorn). Each request goes to one prefill engine (P) and one decode engine (D) at once,
with upstream vLLM's ``kv_transfer_params``:

* P gets the client's body with ``max_tokens: 1`` (and ``max_completion_tokens: 1`` for chat),
  ``stream: false`` and ``{"do_remote_decode": true, "transfer_id": T}``;
* D gets the client's body with ``{"do_remote_prefill": true, "remote_engine_id": P's engine id,
  "remote_bootstrap_addr": P's bootstrap URL, "transfer_id": T}``.

Both calls start at once, as in upstream's example proxy, and D's answer reaches the client as
soon as D gives it: its headers when D's come, each SSE chunk as D sends it (nothing waits for
P's answer, which vLLM's API server sends after D may already have the KV). P's leg is watched
beside D's for the whole request: when one fails, the other is cancelled (closing its
connection, which makes vLLM abort the request). A failure before D's answer began is an HTTP
status (a 4xx passes through, anything else is a 502 naming the engine); once a stream has
begun it ends with an error event. D's answer complete, P's leg (if still running) gets a
moment to end (``_PREFILL_GRACE``, so that its connection is reused), then it is cancelled.
A client that goes away cancels both; a stream in which D reports an error event
counts as ``decode_error``.

Other routes: ``GET /v1/models`` (a healthy D's answer), ``GET /health`` (200 when at least one P
and one D are in rotation, else 503 with the reasons), ``GET /metrics`` (Prometheus text, one
registry per proxy).

A health loop checks every engine's ``GET /health`` and every P's bootstrap ``GET /query`` each
``health_interval``: an engine that fails leaves the rotation and comes back when it answers
again, and P's engine id (DP rank 0 of its bootstrap entry) is re-read every round, so a
restarted P is used under its new id (a bootstrap that gives no answer in time keeps a healthy
P in rotation under the id it had). A connection refused by an engine also takes it out at
once. Engine calls go through :mod:`pdactors.actors._engine_http` (h11); the completion routes
are served on raw ASGI, every other route by Quart.
"""

from __future__ import annotations

import logging
import ssl
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, Final, get_args

import httpx
import msgspec
import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, HTTPScope
from quart import Response

from pdactors.actors import _bodies
from pdactors.actors._auth import BearerCheck
from pdactors.actors._engine_http import ConnectFailed, EngineClient, EngineError, EngineResponse
from pdactors.actors._http import bind_listener, serve_http
from pdactors.actors._p_first import complete_p_first
from pdactors.actors._placement import EngineLoad, Placer, prompt_size
from pdactors.actors._proxy_app import make_app
from pdactors.actors._proxy_health import HealthWatch
from pdactors.actors._proxy_state import Backend, Metrics, Pool
from pdactors.actors._proxy_wire import (
    ClientGone,
    Endpoint,
    Exchange,
    Failure,
    Reply,
    cancel_on_disconnect,
    header,
    receive_body,
    validate,
)
from pdactors.actors._refusals import RefusalLog
from pdactors.bootstrap_client import BootstrapClient, tls_verify
from pdactors.config import Placement, ProxyConfig
from pdactors.errors import describe
from pdactors.messages import KVTransferParams

__all__ = ["serve_proxy"]

log = logging.getLogger("pdactors.proxy")
# Hypercorn's own messages go here rather than to "hypercorn.error" (see bootstrap.py).
_http_log = logging.getLogger("pdactors.proxy.http")

#: How long closing a connection to an engine may take (it is done shielded).
_CLOSE_TIMEOUT: Final = 2.0
#: How long P's leg may go on once the client's answer is complete, before it is cancelled.
_PREFILL_GRACE: Final = 0.25
#: How long a relay waits to hand a final error event to a slow client.
_LAST_EVENT_TIMEOUT: Final = 1.0
#: A request header that overrides ``--placement`` for that request (auto, disaggregate,
#: local); the answer's header of the same name says where its prompt was computed.
_PLACEMENT_HEADER: Final = b"x-pdactors-placement"
#: An SSE event in which an engine reports a failure of a stream it already answered 200 to.
_ERROR_EVENT: Final = b'data: {"error"'


class Proxy:
    """The proxy's state and request handling; :func:`serve_proxy` runs it."""

    def __init__(self, config: ProxyConfig, probe_http: httpx.AsyncClient) -> None:
        self.config = config
        self.probe_http = probe_http  # httpx, its own pool: request traffic never delays probes
        self.bootstrap = BootstrapClient(probe_http, config.bootstrap_token)
        self.refusals = RefusalLog(log, "the proxy")  # 4xx answers to clients
        self.auth = BearerCheck(config.api_key, "the proxy")  # refusals logged by the caller
        prefill = [Backend("prefill", p.url.rstrip("/"), p.bootstrap_url) for p in config.prefill]
        decode = [Backend("decode", url.rstrip("/")) for url in config.decode]
        self.prefill = Pool("prefill", prefill, config.routing)
        self.decode = Pool("decode", decode, config.routing)
        slots = trio.Semaphore(config.max_connections)
        verify = tls_verify(config.ca_file)
        tls = verify if isinstance(verify, ssl.SSLContext) else None  # None: the system's CAs
        timeout = config.connect_timeout
        self.engines = {
            b.url: EngineClient(b.url, connect_timeout=timeout, slots=slots, tls=tls)
            for b in (*prefill, *decode)
        }
        self.metrics = Metrics()
        self.placer = Placer(config.placement_stall_weight)
        #: Stands for P in a request D serves alone because no P is in rotation.
        self._no_prefill = Backend("prefill", "none")
        for b in (*prefill, *decode):
            self.metrics.backend_up.labels(b.role, b.url).set(0)
        pools = (self.prefill, self.decode)
        self.watch = HealthWatch(config, probe_http, self.bootstrap, pools, self.metrics)

    # ------------------------------------------------------------------ completions

    async def serve_completion(
        self,
        endpoint: Endpoint,
        scope: HTTPScope,
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
    ) -> None:
        """One completion request (raw ASGI). A client that goes away cancels it; a bug is
        logged with its traceback and answered 500 when nothing was sent yet. Refusals (401,
        408, 413, 400) are counted and logged once per client per interval."""
        reply = Reply(send)
        arrived = trio.current_time()
        peer = scope.get("client")
        client = peer[0] if peer else "unknown client"
        refused = self.auth.refusal(header(scope["headers"], b"authorization"), client)
        if refused is not None:  # before reading a byte of the body
            await self._refuse(endpoint, client, Failure.unauthorized(refused), reply)
            return
        try:
            raw = await receive_body(scope["headers"], receive, self.config)
        except ClientGone:
            return  # it went away before its body was in: nothing started, nobody to answer
        body = raw if isinstance(raw, Failure) else validate(raw, endpoint)
        if isinstance(body, Failure):
            await self._refuse(endpoint, client, body, reply)
            return
        asked = header(scope["headers"], _PLACEMENT_HEADER)
        pin = self.config.placement if asked is None else asked.strip().lower()
        if pin not in get_args(Placement):
            allowed = ", ".join(get_args(Placement))
            message = f"the {_PLACEMENT_HEADER.decode()} header must be one of {allowed}"
            no = Failure.of(400, message, "invalid_request_error", "invalid")
            await self._refuse(endpoint, client, no, reply)
            return
        try:
            async with trio.open_nursery() as nursery:
                watch = trio.CancelScope()
                nursery.start_soon(
                    cancel_on_disconnect, receive, nursery.cancel_scope, reply, watch
                )
                await self.complete(endpoint, scope, body, pin, reply, nursery, arrived)
                # Answered. P's leg, if still open, gets a moment to end (its connection is
                # then reused: cancelled, it is closed and the next request dials anew), then
                # it is cancelled; the client hanging up from now on changes nothing.
                watch.cancel()
                nursery.cancel_scope.deadline = trio.current_time() + _PREFILL_GRACE
        except Exception as exc:
            log.error("proxy: internal error on POST %s", endpoint.path, exc_info=exc)
            if not reply.started:
                message = f"internal error: {type(exc).__name__}"
                await reply.failure(Failure.of(500, message, "internal_error", ""))

    async def complete(
        self,
        endpoint: Endpoint,
        scope: HTTPScope,
        body: dict[str, Any],
        pin: str,
        reply: Reply,
        nursery: trio.Nursery,
        arrived: float,
    ) -> None:
        p, d = self.prefill.pick(), self.decode.pick()
        if d is None or (p is None and not self.config.fall_back_to_d):
            why = (self.decode if d is None else self.prefill).why_none()
            self.metrics.requests.labels(endpoint.name, "unavailable").inc()
            await reply.failure(Failure.of(503, why, "service_unavailable", "unavailable"))
            return
        if p is None:  # no P in rotation: D serves the request alone
            p = self._no_prefill
        tid = uuid.uuid4().hex
        headers = [(b"content-type", b"application/json"), (b"x-request-id", tid.encode())]
        headers += self._engine_auth(scope["headers"])
        dp_rank, p_engine_id = p.pick_dp()
        p_headers = headers
        if dp_rank is not None:  # vLLM's API server sends the request to that DP engine
            p_headers = [*headers, (b"x-data-parallel-rank", str(dp_rank).encode())]
        ex = Exchange(
            endpoint, body.get("stream") is True, p, d, tid,
            arrived, arrived + self.config.request_timeout, headers, p_headers, p_engine_id,
        )  # fmt: skip
        ex.placement = self._place(ex, body, pin)
        reply.headers.append((_PLACEMENT_HEADER, ex.placement.encode()))
        p.outstanding += 1
        d.outstanding += 1
        self.metrics.in_flight.inc()
        if ex.placement == "local":  # D prefills it itself: P takes no part
            self._release_prefill(ex)
            self._hold_prefill(ex, d)
            await self._answer_from_decode(ex, msgspec.json.encode(body), reply)
            return
        self._hold_prefill(ex, p)
        if self.config.first_token == "p" and _bodies.applies(body, endpoint.chat):
            await complete_p_first(self, ex, body, reply)
            return
        p_params = KVTransferParams(do_remote_decode=True, transfer_id=tid)
        d_params = KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id=p_engine_id,
            remote_bootstrap_addr=p.bootstrap_url,
            transfer_id=tid,
        )
        p_body, d_body = _bodies.concurrent_bodies(body, endpoint.chat, p_params, d_params)
        # P's leg runs beside D's for as long as the request does: it is cancelled when the
        # client's answer is complete (D no longer needs P) or when D fails.
        nursery.start_soon(self._prefill_leg, ex, p_body)
        await self._answer_from_decode(ex, d_body, reply)

    def _place(self, ex: Exchange, body: dict[str, Any], pinned: str) -> str:
        """Where ``ex``'s prompt is computed: ``pinned`` (the operator's ``--placement`` or
        the request's header), or for ``auto`` the placer's estimate (counted, and logged at
        DEBUG with the figures behind it)."""
        ids, ex.prompt_chars = prompt_size(body, ex.endpoint.chat)
        ex.prompt_tokens = self.placer.count.tokens((ids, ex.prompt_chars))
        if ex.p is self._no_prefill:
            self.metrics.placement.labels("local", "no_prefill").inc()
            self.metrics.fallbacks.labels("no_prefill").inc()
            return "local"
        if pinned != "auto":
            where = "local" if pinned == "local" else "disaggregated"
            self.metrics.placement.labels(where, "pinned").inc()
            return where
        p_load = EngineLoad(ex.p.waiting_tokens, 0)
        decoding = ex.d.outstanding - ex.d.prefills - ex.d.incoming
        d_load = EngineLoad(ex.d.waiting_tokens, decoding)
        decision = self.placer.decide(ex.prompt_tokens, ex.p.url, p_load, ex.d.url, d_load)
        self.metrics.placement.labels(decision.where, decision.reason).inc()
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "proxy: request %s placed %s (%s): ~%d prompt tokens, P waiting on %d, "
                "D waiting on %d and decoding %d; estimates local %.1f ms, disaggregated "
                "%.1f ms",
                ex.transfer_id, decision.where, decision.reason, decision.tokens,
                p_load.waiting_tokens, d_load.waiting_tokens, d_load.decoding,
                decision.local_ms, decision.disaggregated_ms,
            )  # fmt: skip
        return decision.where

    def may_fall_back(self, ex: Exchange, reply: Reply) -> bool:
        """Whether a P-first request whose P failed before its token can go to D alone: P's
        failure was P's (a 5xx, a broken connection, an unreadable answer; not the request's
        4xx), nothing reached the client yet, time is left, and the operator allows it."""
        failure = ex.failure
        return (
            self.config.fall_back_to_d
            and failure is not None
            and failure.outcome == "prefill_error"
            and failure.status >= 500
            and not reply.started
            and trio.current_time() < ex.deadline
        )

    async def fall_back_to_d(self, ex: Exchange, body: dict[str, Any], reply: Reply) -> None:
        """Serve ``ex`` on D alone (the client's body as it came), after P failed before its
        first token: counted, and logged once with why."""
        assert ex.failure is not None
        log.warning(
            "proxy: request %s: prefill engine failed before its first token (%s); decode "
            "engine %s serves it alone",
            ex.transfer_id, ex.failure.message[:300], ex.d.url,
        )  # fmt: skip
        self.metrics.fallbacks.labels("prefill_failed").inc()
        ex.failure, ex.d_scopes = None, []
        ex.placement = "local"
        reply.headers[:] = [(k, v) for k, v in reply.headers if k != _PLACEMENT_HEADER]
        reply.headers.append((_PLACEMENT_HEADER, b"local"))
        self._hold_prefill(ex, ex.d)
        await self._answer_from_decode(ex, msgspec.json.encode(body), reply)

    def _hold_prefill(self, ex: Exchange, engine: Backend) -> None:
        """``ex``'s prompt is sent to ``engine`` now: it waits in its prefill queue."""
        engine.waiting_tokens += ex.prompt_tokens
        engine.prefills += 1
        if engine is not ex.d:
            ex.d.incoming += 1
        ex.prefilling = engine
        ex.prefill_sent = trio.current_time()
        ex.tokens_ahead = engine.waiting_tokens

    def _prefill_done(self, ex: Exchange, *, answered: bool) -> None:
        """``ex``'s prompt left its engine's queue; ``answered``: with its first token now
        (what the placer learns from)."""
        engine, ex.prefilling = ex.prefilling, None
        if engine is None:
            return
        engine.waiting_tokens -= ex.prompt_tokens
        engine.prefills -= 1
        if engine is not ex.d:
            ex.d.incoming -= 1
        if answered:
            elapsed = trio.current_time() - ex.prefill_sent
            self.placer.first_token(engine.url, ex.tokens_ahead, elapsed)

    async def _answer_from_decode(self, ex: Exchange, body: bytes, reply: Reply) -> None:
        """Ask D with ``body`` and answer the client with D's answer, as it comes."""
        try:
            d_resp = await self._open_decode(ex, body)
        except BaseException:
            ex.p_scope.cancel()
            self._end(ex, "cancelled")
            raise
        if d_resp is None:  # a failure before D's answer began: an HTTP status
            assert ex.failure is not None
            log.warning("proxy: request %s failed: %s", ex.transfer_id, ex.failure.body[:300])
            self._end(ex, ex.failure.outcome)
            await reply.failure(ex.failure)
        elif not ex.stream:
            await self._whole_answer(ex, d_resp, reply)
        else:
            await self._relay(ex, d_resp, reply)

    async def _refuse(self, endpoint: Endpoint, client: str, no: Failure, reply: Reply) -> None:
        self.metrics.requests.labels(endpoint.name, no.outcome).inc()
        self.refusals.refused(client, no.status, no.message)
        await reply.failure(no)

    async def _prefill_leg(self, ex: Exchange, body: bytes) -> bytes | None:
        """P's whole answer; a failure (or no answer by the deadline) fails the request
        (and None is returned)."""
        failure: Failure | None = None
        answer: bytes | None = None
        with ex.p_scope, trio.move_on_at(ex.deadline) as timer:
            try:
                resp = await self.engines[ex.p.url].request(
                    "POST", ex.endpoint.path, body, ex.p_headers
                )
                answer = await resp.read()
            except EngineError as exc:
                failure = self._transport_failure(ex.p, exc)
            else:
                ex.p_answered = trio.current_time()
                self._prefill_done(ex, answered=resp.status == 200)
                if resp.status != 200:
                    failure = self._status_failure(ex.p, resp.status, answer)
            finally:
                self._prefill_done(ex, answered=False)
                self._release_prefill(ex)
        if timer.cancelled_caught:
            failure = self._timeout_failure("no answer from P")
        if failure is not None and not ex.ended:
            ex.fail(failure)
        return answer if failure is None and not timer.cancelled_caught else None

    async def _open_decode(
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
                        ex.fail(self._status_failure(ex.d, resp.status, answer))
                except EngineError as exc:
                    ex.fail(self._transport_failure(ex.d, exc))
            if timer.cancelled_caught and ex.failure is None:
                ex.fail(self._timeout_failure("no answer from D"))
            if ex.failure is not None:  # D's answer (if any) is of no use: close it
                if resp is not None:
                    await resp.aclose()
                return None
            ex.d_answered = trio.current_time()
            return resp
        except BaseException:
            if resp is not None:
                await resp.aclose()
            raise

    async def _whole_answer(self, ex: Exchange, resp: EngineResponse, reply: Reply) -> None:
        """Not streamed: D's whole body, unless P fails first."""
        body = b""
        try:
            with ex.decode_scope(), trio.move_on_at(ex.deadline) as timer:
                try:
                    body = await resp.read()
                except EngineError as exc:
                    ex.fail(self._transport_failure(ex.d, exc))
            if timer.cancelled_caught and ex.failure is None:
                ex.fail(self._timeout_failure("D did not finish"))
        except BaseException:
            self._end(ex, "cancelled")
            raise
        finally:
            await resp.aclose()
        if ex.failure is not None:
            log.warning("proxy: request %s failed: %s", ex.transfer_id, ex.failure.body[:300])
            self._end(ex, ex.failure.outcome)
            await reply.failure(ex.failure)
            return
        self._end(ex, "ok")
        await reply.whole(200, body, ex.transfer_id)

    async def _relay(
        self,
        ex: Exchange,
        resp: EngineResponse,
        reply: Reply,
        *,
        transform: Callable[[bytes], bytes] | None = None,
    ) -> None:
        """Hand D's streamed answer to the client as it comes (``transform``ed: P-first);
        owns ``resp``."""
        outcome = "cancelled"
        try:
            if not reply.started:
                await reply.start(
                    200, b"text/event-stream", ex.transfer_id, (b"cache-control", b"no-cache")
                )
            outcome = await self._forward(ex, resp, reply, transform)
            await reply.chunk(b"", more=False)
        finally:
            if outcome != "ok":  # else P's leg gets its moment (serve_completion)
                ex.p_scope.cancel()
            await resp.aclose()
            self._end(ex, outcome)

    async def _forward(
        self,
        ex: Exchange,
        resp: EngineResponse,
        reply: Reply,
        transform: Callable[[bytes], bytes] | None,
    ) -> str:
        first, outcome = True, "ok"
        with ex.decode_scope(), trio.move_on_at(ex.deadline):
            try:
                async for chunk in resp.chunks():
                    if first:
                        first = False
                        self._first_chunk(ex)
                    else:
                        now = trio.current_time()
                        if ex.last_chunk is not None:
                            self.placer.step(ex.d.url, now - ex.last_chunk)
                        ex.last_chunk = now
                    if _ERROR_EVENT in chunk:  # D reports a failure in a stream it began (200)
                        outcome = "decode_error"
                    data = transform(chunk) if transform is not None else chunk
                    if data:
                        await reply.chunk(data)
                return outcome
            except EngineError as exc:
                ex.fail(self._transport_failure(ex.d, exc))
        await self._stream_failure(ex, reply)
        assert ex.failure is not None
        return ex.failure.outcome

    async def _stream_failure(self, ex: Exchange, reply: Reply) -> None:
        """End a begun stream with the request's failure (or D's timeout) as an event."""
        if ex.failure is None:
            ex.fail(self._timeout_failure("D did not finish"))
        assert ex.failure is not None
        log.warning(
            "proxy: request %s failed mid-stream: %s", ex.transfer_id, ex.failure.body[:300]
        )
        with trio.move_on_after(_LAST_EVENT_TIMEOUT):
            await reply.chunk(ex.failure.sse_event())

    def _first_chunk(self, ex: Exchange) -> None:
        """The client's first chunk (TTFT), or D's first after P's token (P-first)."""
        now = trio.current_time()
        ex.last_chunk = now
        if ex.first_sent is not None:
            self.metrics.second_chunk.labels(ex.p.url, ex.d.url).observe(now - ex.arrived)
            if ex.d_sent is not None:
                self.placer.caught_up(ex.d.url, ex.prompt_tokens, now - ex.d_sent)
            return
        ex.first_sent = now
        if ex.prefilling is ex.d:  # local: D's first token
            self._prefill_done(ex, answered=True)
        self.metrics.ttft.labels(ex.p.url, ex.d.url).observe(now - ex.arrived)
        if log.isEnabledFor(logging.DEBUG):

            def ms(t: float | None) -> str:
                return "-" if t is None else f"{(t - ex.arrived) * 1e3:.1f}"

            log.debug(
                "proxy: request %s timeline ms: D answered %s, first chunk %s, P answered %s",
                ex.transfer_id, ms(ex.d_answered), ms(now), ms(ex.p_answered),
            )  # fmt: skip

    def _timeout_failure(self, what: str) -> Failure:
        message = f"{what} within the request timeout ({self.config.request_timeout:g} s)"
        return Failure.of(504, message, "timeout", "timeout")

    def _release_prefill(self, ex: Exchange) -> None:
        if not ex.prefill_released:
            ex.prefill_released = True
            ex.p.outstanding -= 1

    def _end(self, ex: Exchange, outcome: str) -> None:
        if ex.ended:
            return
        ex.ended = True
        self._prefill_done(ex, answered=False)
        self._release_prefill(ex)
        ex.d.outstanding -= 1
        self.metrics.in_flight.dec()
        self.metrics.requests.labels(ex.endpoint.name, outcome).inc()
        if outcome == "ok":
            elapsed = trio.current_time() - ex.arrived
            self.metrics.latency.labels(ex.p.url, ex.d.url).observe(elapsed)

    def _transport_failure(self, b: Backend, exc: EngineError | httpx.HTTPError) -> Failure:
        self.metrics.backend_errors.labels(b.role, b.url).inc()
        if isinstance(exc, ConnectFailed | httpx.ConnectError):  # gone: out of rotation now
            self.watch.set(b, f"connection failed: {describe(exc)}", None)
        message = f"{b.role} engine {b.url} failed: {describe(exc)}"
        return Failure.of(502, message, "upstream_error", f"{b.role}_error")

    def _status_failure(self, b: Backend, status: int, body: bytes) -> Failure:
        """A 4xx passes through (vLLM's own error body); anything else becomes a 502."""
        outcome = f"{b.role}_error"
        text = body[:500].decode(errors="replace")
        if 400 <= status < 500:  # the request's fault, not the engine's
            try:
                passed = msgspec.json.decode(body)
            except msgspec.DecodeError:
                passed = None
            if isinstance(passed, dict) and "error" in passed:
                return Failure(status, body, outcome)
            message = f"{b.role} engine {b.url}: {text}"
            return Failure.of(status, message, "invalid_request_error", outcome)
        self.metrics.backend_errors.labels(b.role, b.url).inc()
        message = f"{b.role} engine {b.url} answered HTTP {status}: {text}"
        return Failure.of(502, message, "upstream_error", outcome)

    # ------------------------------------------------------------------ models

    def _engine_auth(self, incoming: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """The ``Authorization`` header for the engines: their own key when configured, none
        when only the proxy has a key (it is the proxy's, not theirs), else the client's."""
        if self.config.engine_api_key:
            return [(b"authorization", f"Bearer {self.config.engine_api_key}".encode())]
        if self.config.api_key:
            return []
        return [(k, v) for k, v in incoming if k == b"authorization"]

    async def models(self, incoming: bytes | None = None) -> Response:
        d = next((b for b in self.decode.backends if b.up), None)
        if d is None:
            return Failure.of(503, self.decode.why_none(), "service_unavailable", "").response()
        with trio.move_on_after(self.config.health_timeout):
            try:
                auth = dict(self._engine_auth([(b"authorization", incoming)] if incoming else []))
                resp = await self.probe_http.get(f"{d.url}/v1/models", headers=auth)
            except httpx.HTTPError as exc:
                return self._transport_failure(d, exc).response()
            content_type = resp.headers.get("content-type", "application/json")
            return Response(resp.content, status=resp.status_code, content_type=content_type)
        message = (
            f"decode engine {d.url} sent no model list within {self.config.health_timeout:g} s"
        )
        return Failure.of(504, message, "timeout", "").response()


@asynccontextmanager
async def _open_http(
    timeouts: httpx.Timeout, limits: httpx.Limits, ca_file: str | None = None
) -> AsyncIterator[httpx.AsyncClient]:
    # Proxy settings in the environment are ignored: engines are always dialled directly.
    client = httpx.AsyncClient(
        trust_env=False, timeout=timeouts, limits=limits, verify=tls_verify(ca_file)
    )
    try:
        yield client
    finally:
        with trio.move_on_after(_CLOSE_TIMEOUT, shield=True):
            await client.aclose()


async def serve_proxy(
    config: ProxyConfig,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the OpenAI-compatible proxy in front of ``config``'s engines until cancelled.

    Binds ``config.host:config.port`` (port 0: a free port), starts the health loop, then
    reports the bound URL, e.g. ``"http://127.0.0.1:40123"``, through ``task_status.started``
    (a wildcard host is reported as loopback). Requests are refused with 503 until a P and a D
    have passed a health check (``GET /health`` answers 200 from then on). Engine failures
    become error answers to the requests they hit and take the engine out of rotation; they
    never stop the proxy.

    Usage: ``url = await nursery.start(serve_proxy, config)``.

    Raises :class:`OSError` if the address cannot be bound (before ``started``). Never returns
    normally.
    """
    probe_timeout = httpx.Timeout(config.health_timeout)
    probe_limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with _open_http(probe_timeout, probe_limits, config.ca_file) as probe_http:
        proxy = Proxy(config, probe_http)
        sock = await bind_listener(config.host, config.port, "the proxy")
        try:
            await _serve(proxy, sock, task_status)
        finally:
            for engine in proxy.engines.values():
                engine.close()


async def _serve(
    proxy: Proxy, sock: trio.socket.SocketType, task_status: trio.TaskStatus[str]
) -> None:
    config = proxy.config
    async with trio.open_nursery() as nursery:
        nursery.start_soon(proxy.watch.run)
        app = make_app(proxy)
        serve = partial(
            serve_http,
            app,
            sock,
            errorlog=_http_log,
            announce=lambda _: None,
            certfile=config.certfile,
            keyfile=config.keyfile,
        )
        url = await nursery.start(serve)  # announced below, with the backends
        prefill = ", ".join(f"{p.url} (bootstrap {p.bootstrap_url})" for p in config.prefill)
        log.info(
            "proxy: listening on %s; prefill %s; decode %s; %s routing",
            url, prefill, ", ".join(config.decode), config.routing,
        )  # fmt: skip
        task_status.started(url)
