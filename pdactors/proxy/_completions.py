"""The proxy's completion requests, from arrival to their engines: the client's key, its body
and its placement header checked, P and D picked, where the prompt is computed decided, and
the exchange's record (:mod:`pdactors.core.exchange`) admitted in its flow — P-first,
concurrent, local or whole-on-P — and served (:mod:`pdactors.proxy._flows`). A request for
several choices (a list of prompts, ``n`` > 1) is one exchange per choice, merged
(:mod:`pdactors.proxy._fan_out`).

:class:`Proxy` also holds the proxy's state (engines, pools, metrics, placer, health loop) for
:mod:`pdactors.proxy._app` and :func:`pdactors.proxy._serve.serve_proxy`.
"""

from __future__ import annotations

import logging
import ssl
import uuid
from collections.abc import Iterable
from functools import partial
from typing import Any, Final

import httpx
import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, HTTPScope

from pdactors.bootstrap_client import BootstrapClient, tls_verify
from pdactors.core.exchange import ExchangeState, flow_for
from pdactors.core.placement import EngineLoad, Placer, prompt_size
from pdactors.core.prefixes import prefix_keys
from pdactors.proxy import _bodies
from pdactors.proxy._answer import Answers
from pdactors.proxy._asgi import (
    ClientGone,
    Reply,
    cancel_on_disconnect,
    header,
    placing,
    receive_body,
)
from pdactors.proxy._calibrate import calibrate
from pdactors.proxy._effects import ExchangeEffects
from pdactors.proxy._engine_http import EngineClient
from pdactors.proxy._exchange import Exchange
from pdactors.proxy._fan_out import Lead, serve_fanned_out, split
from pdactors.proxy._flows import serve_flow
from pdactors.proxy._health import HealthWatch
from pdactors.proxy._kv_events import KvEventFeeds
from pdactors.proxy._kv_release import KvReleases
from pdactors.proxy._legs import Legs
from pdactors.proxy._openai import Endpoint, Failure, as_chat, validate
from pdactors.proxy._state import Backend, Metrics, Pool
from pdactors.proxy._tracing import RequestTracing
from pdactors.proxy_config import ProxyConfig
from pdactors.web._auth import BearerCheck
from pdactors.web._refusals import RefusalLog

__all__ = ["Proxy"]

log = logging.getLogger("pdactors.proxy")

#: The longest one calibration probe may take (a larger health_timeout wins).
_PROBE_TIMEOUT: Final = 10.0
#: How long P's leg may go on once the client's answer is complete, before it is cancelled.
_PREFILL_GRACE: Final = 0.25


def _decoding(b: Backend) -> int:
    """The requests ``b`` decodes, in its role: a P's count holds its legs until their token
    (prefills) and the requests it serves whole; a D's also those whose prompt is still at a
    P (incoming)."""
    return b.outstanding - b.prefills - b.incoming


def _engine_load(b: Backend) -> EngineLoad:
    """What the placer weighs of ``b``'s engine: in both its roles for an engine of every
    role (``kv_both``), whose prefills and decodes share one engine's steps."""
    halves = (b,) if b.twin is None else (b, b.twin)
    return EngineLoad(sum(h.waiting_tokens for h in halves), sum(map(_decoding, halves)), b.load)


class Proxy:
    """The proxy's state and its completion requests; :func:`~pdactors.proxy._serve.serve_proxy`
    runs it."""

    def __init__(
        self,
        config: ProxyConfig,
        probe_http: httpx.AsyncClient,
        tracing: RequestTracing | None = None,
    ) -> None:
        self.config = config
        self.tracing = tracing  # a span per request (None: tracing is off)
        self.probe_http = probe_http  # httpx, its own pool: request traffic never delays probes
        self.bootstrap = BootstrapClient(probe_http, config.bootstrap_token)
        self.refusals = RefusalLog(log, "the proxy")  # 4xx answers to clients
        self.auth = BearerCheck(config.api_key, "the proxy")  # refusals logged by the caller
        prefill = [Backend("prefill", p.url.rstrip("/"), p.bootstrap_url) for p in config.prefill]
        decode = [Backend("decode", url.rstrip("/")) for url in config.decode]
        for e in config.engines:  # kv_both: one engine in both pools, each half its twin's
            as_p, as_d = (
                Backend("prefill", e.url.rstrip("/"), e.bootstrap_url),
                Backend("decode", e.url.rstrip("/")),
            )
            as_p.twin, as_d.twin = as_d, as_p
            prefill.append(as_p)
            decode.append(as_d)
        self.prefill = Pool.of(config, "prefill", prefill, config.prefill_routing)
        self.decode = Pool.of(config, "decode", decode, config.decode_routing)
        self.metrics = Metrics()
        #: The engines' KV events, followed for prefix_aware pools (None: none is, or off).
        self.feeds = KvEventFeeds.of(config, probe_http, (self.prefill, self.decode), self.metrics)
        slots = trio.Semaphore(config.max_connections)
        verify = tls_verify(config.ca_file)
        tls = verify if isinstance(verify, ssl.SSLContext) else None  # None: the system's CAs
        timeout = config.connect_timeout
        self.engines = {
            b.url: EngineClient(b.url, connect_timeout=timeout, slots=slots, tls=tls)
            for b in (*prefill, *decode)
        }
        self.placer = Placer(config.placement_stall_weight, p_first=config.first_token == "p")
        #: Stands for P in a request D serves alone because no P is in rotation.
        self._no_prefill = Backend("prefill", "none")
        for b in (*prefill, *decode):
            self.metrics.backend_up.labels(b.role, b.url).set(0)
        pools = (self.prefill, self.decode)
        self.watch = HealthWatch(config, probe_http, self.bootstrap, pools, self.metrics)
        #: P's KV kept for pulls no D will make now: P is told to free it (its task: ``run``)
        self.releases = KvReleases(self.engines, self.metrics.kv_freed_at_p)
        self.effects = ExchangeEffects(config, self.metrics, self.placer, self.releases)
        self.legs = Legs(config, self.engines, self.effects, self.watch)
        self.answers = Answers(config, self.legs, self.effects, self.watch)
        if config.calibrate and config.placement == "auto":
            self.watch.entering = self._calibrate

    async def _calibrate(self, b: Backend) -> None:
        """Probe ``b`` before it enters the rotation; the placer learns from it. An engine of
        every role is probed once, as it enters as a P (the placer's models are the
        engine's, whatever its role)."""
        if b.twin is not None and b.role == "decode":
            return
        headers = {k.decode(): v.decode() for k, v in self.engine_auth(())}
        timeout = max(_PROBE_TIMEOUT, self.config.health_timeout)
        await calibrate(self.probe_http, b.url, headers, self.placer, timeout)

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
        placed = placing(scope["headers"], self.config)
        if isinstance(placed, Failure):
            await self._refuse(endpoint, client, placed, reply)
            return
        pin, slo = placed
        subs = split(body, endpoint.chat or endpoint.responses)
        try:
            async with trio.open_nursery() as nursery:
                watch = trio.CancelScope()
                nursery.start_soon(
                    cancel_on_disconnect, receive, nursery.cancel_scope, reply, watch
                )
                if subs is None:
                    await self._complete(endpoint, scope, body, (pin, slo), reply, nursery, arrived)
                else:
                    one = partial(self._serve_choice, endpoint, scope, (pin, slo), arrived)
                    stream = body.get("stream") is True
                    await serve_fanned_out(one, subs, body.get("n") or 1, stream, reply)
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

    async def _serve_choice(
        self,
        endpoint: Endpoint,
        scope: HTTPScope,
        placing: tuple[str, tuple[float, float]],
        arrived: float,
        body: dict[str, Any],
        reply: Reply,
        lead: Lead,
        first: bool,
    ) -> None:
        """One choice of a request for several, an exchange of its own answering ``reply``
        (:mod:`pdactors.proxy._fan_out`: the first choice of a prompt tells ``lead`` which P
        computes its prompt, the others follow it there); its P leg, if still open once it is
        answered, ends within the same grace as a request's."""
        pin, slo = placing
        if not first and lead.p is not None and pin == "auto":
            pin = "disaggregate"  # the prompt is in that P's cache: it computes the rest
        choice = (lead, first)
        async with trio.open_nursery() as nursery:
            await self._complete(endpoint, scope, body, (pin, slo), reply, nursery, arrived, choice)
            nursery.cancel_scope.deadline = trio.current_time() + _PREFILL_GRACE

    async def _complete(
        self,
        endpoint: Endpoint,
        scope: HTTPScope,
        body: dict[str, Any],
        placing: tuple[str, tuple[float, float]],
        reply: Reply,
        nursery: trio.Nursery,
        arrived: float,
        choice: tuple[Lead, bool] | None = None,
    ) -> None:
        pin, slo = placing
        lead, first = choice or (None, True)
        follow = lead.p if lead is not None and not first else None
        keyed = self.prefill.prefixes is not None or self.decode.prefixes is not None
        read = as_chat(body, endpoint)  # the prompt as the placement reads it
        prompt = prefix_keys(*read) if keyed else []
        token_ids = None
        if keyed and self.feeds is not None:  # for the engines' KV events
            auth = {k.decode(): v.decode() for k, v in self.engine_auth(scope["headers"])}
            token_ids = await self.feeds.prompt_ids(read, (self.decode, self.prefill), auth)
        d, d_why = self.decode.route(prompt, token_ids=token_ids)
        whole = self._why_whole_on_p(pin, d)
        if whole is not None:  # a P serves it whole, in D's place
            d, d_why = self.prefill.route(prompt, token_ids=token_ids)
        p, p_why = None, ""
        if d is not None and whole is None:  # another engine than D, with D's model
            pair = self.watch.pairs

            def pairs(b: Backend) -> bool:
                return b.url != d.url and pair.refusal(b, d) is None

            if follow is not None:  # the P whose cache holds the prompt, while it may serve
                p, p_why = self.prefill.route(prompt, lambda b: b.url == follow and pairs(b))
            if p is None:
                p, p_why = self.prefill.route(prompt, pairs, token_ids)
        alone = None if p is not None or whole is not None else self._why_alone(d)
        if d is None or (alone is not None and not self.config.fall_back_to_d):
            pool = self.decode if whole is None else self.prefill  # the role d was to have
            why = pool.why_none() if d is None else self._why_no_prefill(d)
            self.metrics.requests.labels(endpoint.name, "unavailable").inc()
            await reply.failure(Failure.of(503, why, "service_unavailable", "unavailable"))
            return
        self.metrics.routed.labels("decode" if whole is None else "prefill", d_why).inc()
        if p is None:  # no P in rotation, or none D may be paired with: D serves it alone
            p = self._no_prefill
        else:
            self.metrics.routed.labels("prefill", p_why).inc()
        tid = uuid.uuid4().hex
        headers = [(b"content-type", b"application/json"), (b"x-request-id", tid.encode())]
        headers += self.engine_auth(scope["headers"])
        span = None
        if self.tracing is not None:  # both engines' spans join this request's trace
            roles = {"pdactors.prefill": p.url, "pdactors.decode": d.url}
            span = self.tracing.start(endpoint.path, tid, scope["headers"], arrived, roles)
            headers.append((b"traceparent", span.traceparent))
        dp_rank, p_engine_id = p.pick_dp()
        p_headers = headers
        if dp_rank is not None:  # vLLM's API server sends the request to that DP engine
            p_headers = [*headers, (b"x-data-parallel-rank", str(dp_rank).encode())]
        ids, chars = prompt_size(*read)
        tokens = self.placer.count.tokens((ids, chars))
        where, why, fallback = self._place(p, d, tokens, tid, pin, (alone, whole), slo)
        serving = d
        if where == "whole-on-p" and whole is None:  # auto: P serves it whole, as D
            p, serving = self._no_prefill, p
        p_first = self.config.first_token == "p" and _bodies.applies(body, endpoint.chat)
        flow = flow_for(where, p_first=p_first)
        state = ExchangeState(
            arrived, p, serving, deadline=arrived + self.config.request_timeout,
            prompt_tokens=tokens, prompt_chars=chars,
        )  # fmt: skip
        stream = body.get("stream") is True
        model = body.get("model")
        ex = Exchange(
            endpoint, stream, tid, headers, p_headers, p_engine_id, state, reply, span=span,
            model=model if isinstance(model, str) else "",
        )  # fmt: skip
        if lead is not None and first:  # the prompt's other choices follow it to its P
            lead.done(p.url if where not in ("local", "whole-on-p") else None)
        # One engine serves it whole (D, or a P in D's place): the other takes no part.
        if where not in ("local", "whole-on-p"):  # P computes the prompt (and caches it)
            self.prefill.sent(p, prompt)
        (self.prefill if where == "whole-on-p" else self.decode).sent(serving, prompt)
        with self.effects.admitted(ex, flow, why=why, fallback=fallback):
            await serve_flow(self.answers, ex, body, nursery)

    def _why_whole_on_p(self, pin: str, d: Backend | None) -> str | None:
        """Why a P serves the request whole: the operator or the request pinned it
        (``pinned``), or no D is in rotation (``no_decode``, with ``fall_back_to_p``); None:
        it does not."""
        if pin == "whole-on-p":
            return "pinned"
        if d is None and self.config.fall_back_to_p and self.prefill.any_up:
            return "no_decode"
        return None

    def _why_alone(self, d: Backend | None) -> str:
        """Why a request for ``d`` got no P: none is in rotation but D itself, an engine of
        every role (``no_prefill``), or every other P in rotation answers with another model
        than D (``incompatible``)."""
        if d is None or not any(b.serving and b.url != d.url for b in self.prefill.backends):
            return "no_prefill"
        return "incompatible"

    def _why_no_prefill(self, d: Backend) -> str:
        """The 503's text for a request that got no P (without the fall-back to D)."""
        refused = [
            f"{b.url}: {found.reason('P')}"
            for b in self.prefill.backends
            if b.up and (found := self.watch.pairs.refusal(b, d)) is not None
        ]
        if not refused:
            return self.prefill.why_none()
        return (
            f"no prefill engine answers with decode engine {d.url}'s model ({'; '.join(refused)})"
        )

    def _place(
        self,
        p: Backend,
        d: Backend,
        tokens: int,
        tid: str,
        pinned: str,
        reasons: tuple[str | None, str | None],
        slo: tuple[float, float],
    ) -> tuple[str, str, str | None]:
        """Where a request of ``tokens`` prompt tokens routed to ``p`` and ``d`` has its prompt
        computed, why (the placement metric's reason), and why one engine serves a request
        meant for two (the fallbacks metric's, or None) — counted when it is admitted. On a P
        serving it whole (``whole``, of ``reasons``: why); on D when it has no P (``alone``:
        why; this wins over a pin: an incompatible P's token would be another model's); else
        ``pinned`` (the operator's ``--placement`` or the request's header), or for ``auto``
        the placer's estimate against the ``slo`` objectives, ``(TTFT, TPOT)`` in ms (logged
        at DEBUG with the figures behind it)."""
        alone, whole = reasons
        if whole is not None:
            return "whole-on-p", whole, None if whole == "pinned" else whole
        if alone is not None:
            return "local", alone, alone
        if pinned != "auto":
            return ("local" if pinned == "local" else "disaggregated"), "pinned", None
        p_load, d_load = _engine_load(p), _engine_load(d)
        ttft, tpot = slo
        decision = self.placer.decide(
            tokens, p.url, p_load, d.url, d_load,
            slo_tpot_ms=tpot or None, slo_ttft_ms=ttft or None, p_decodes=p.twin is not None,
        )  # fmt: skip
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "proxy: request %s placed %s (%s): ~%d prompt tokens, P waiting on %d, "
                "D waiting on %d and decoding %d; estimates local %.1f ms, disaggregated "
                "%.1f ms",
                tid, decision.where, decision.reason, decision.tokens,
                p_load.waiting_tokens, d_load.waiting_tokens, d_load.decoding,
                decision.local_ms, decision.disaggregated_ms,
            )  # fmt: skip
        return decision.where, decision.reason, None

    async def _refuse(self, endpoint: Endpoint, client: str, no: Failure, reply: Reply) -> None:
        self.metrics.requests.labels(endpoint.name, no.outcome).inc()
        self.refusals.refused(client, no.status, no.message)
        await reply.failure(no)

    def engine_auth(self, incoming: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """The ``Authorization`` header for the engines: their own key when configured, none
        when only the proxy has a key (it is the proxy's, not theirs), else the client's."""
        if self.config.engine_api_key:
            return [(b"authorization", f"Bearer {self.config.engine_api_key}".encode())]
        if self.config.api_key:
            return []
        return [(k, v) for k, v in incoming if k == b"authorization"]
