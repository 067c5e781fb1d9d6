"""The proxy's Quart app around :class:`~pdactors.proxy._completions.Proxy`.

Completions are served on raw ASGI (``ProxyApp.fast``, the hot path); the proxy's other routes
(``/v1/models``, ``/health``, ``/metrics``, the operator's ``/admin/...``:
:mod:`pdactors.proxy._admin`) are Quart's, behind the bearer gate and error
handlers shared with the bootstrap (:mod:`pdactors.web._app`), in OpenAI's error shape. A
``GET`` or ``POST`` on any other path is an engine's (``/tokenize``, ``/version``...): forwarded
on raw ASGI (``ProxyApp.forward``, :mod:`pdactors.proxy._forward`).
"""

from __future__ import annotations

import logging
from functools import partial

import httpx
import trio
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from pdactors.proxy._admin import add_admin_routes
from pdactors.proxy._asgi import ProxyApp
from pdactors.proxy._completions import Proxy
from pdactors.proxy._forward import serve_forwarded
from pdactors.proxy._openai import CHAT, COMPLETIONS, RESPONSES, Failure
from pdactors.web._app import guard, json_response

__all__ = ["make_app"]

log = logging.getLogger("pdactors.proxy")


def make_app(proxy: Proxy) -> QuartTrio:
    """The app serving ``proxy``'s routes."""
    app = ProxyApp(__name__, static_folder=None)
    app.config["MAX_CONTENT_LENGTH"] = proxy.config.max_body_bytes
    app.config["BODY_TIMEOUT"] = proxy.config.body_timeout  # (no route here reads a body)
    # Quart would silently cut a streamed answer after RESPONSE_TIMEOUT (60 s); the proxy
    # bounds each request itself, with an error the client can see.
    app.config["RESPONSE_TIMEOUT"] = None

    app.fast = {
        e.path: partial(proxy.serve_completion, e) for e in (COMPLETIONS, CHAT, RESPONSES)
    }  # POST only; other methods on these paths reach Quart's routing (405)

    def unauthorized(client: str, reason: str) -> Response:
        proxy.refusals.refused(client, 401, reason)
        proxy.metrics.requests.labels(_endpoint(request.path), "unauthorized").inc()
        return Failure.unauthorized(reason).response()

    def http_error(exc: HTTPException, client: str) -> Response:
        # 404, 405, 408, 413, ...: OpenAI's error shape.
        code = exc.code or 500
        proxy.refusals.refused(client, code, exc.name)
        proxy.metrics.requests.labels(_endpoint(request.path), "invalid").inc()
        return Failure.of(code, exc.description or exc.name, "invalid_request_error", "").response()

    guard(
        app,
        check=proxy.auth,
        open_paths=("/health", "/metrics"),
        unauthorized=unauthorized,
        http_error=http_error,
        internal_error=lambda message: Failure.of(500, message, "internal_error", "").response(),
        log=log,
        who="proxy",
    )

    @app.route("/v1/completions", methods=["PUT"])
    @app.route("/v1/chat/completions", methods=["PUT"])
    @app.route("/v1/responses", methods=["PUT"])
    async def completions_put() -> Response:  # never POST: served on raw ASGI (app.fast)
        return Failure.of(405, "use POST", "invalid_request_error", "").response()

    @app.get("/v1/models")
    async def models() -> Response:
        incoming = request.headers.get("authorization")
        return await _models(proxy, incoming.encode("latin-1") if incoming else None)

    @app.get("/health")
    async def health() -> Response:
        status, report = proxy.watch.report()
        if proxy.config.placement == "auto":
            report["placement"] = proxy.placer.describe()
        return json_response(report, status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(proxy.metrics.registry), content_type=CONTENT_TYPE_LATEST)

    add_admin_routes(app, proxy)

    # Every path no route above serves is an engine's (its own 404 passes through).
    app.own = frozenset(rule.rule for rule in app.url_map.iter_rules()) | app.fast.keys()
    app.forward = partial(serve_forwarded, proxy)
    return app


async def _models(proxy: Proxy, incoming: bytes | None) -> Response:
    """A healthy D's model list (its answer as it came), with the engines' authorization; a
    healthy P's while no D is (P then serves requests whole: ``fall_back_to_p``)."""
    d = next((b for b in proxy.decode.backends if b.up), None)
    if d is None and proxy.config.fall_back_to_p:
        d = next((b for b in proxy.prefill.backends if b.up), None)
    if d is None:
        return Failure.of(503, proxy.decode.why_none(), "service_unavailable", "").response()
    timeout = proxy.config.health_timeout
    with trio.move_on_after(timeout):
        try:
            auth = dict(proxy.engine_auth([(b"authorization", incoming)] if incoming else []))
            resp = await proxy.probe_http.get(f"{d.url}/v1/models", headers=auth)
        except httpx.HTTPError as exc:
            return proxy.legs.failures.transport_failure(d, exc).response()
        content_type = resp.headers.get("content-type", "application/json")
        return Response(resp.content, status=resp.status_code, content_type=content_type)
    message = f"{d.role} engine {d.url} sent no model list within {timeout:g} s"
    return Failure.of(504, message, "timeout", "").response()


def _endpoint(path: str) -> str:
    """The metric label of a Quart route's path: a few known names, never the client's text."""
    named = {e.path: e.name for e in (COMPLETIONS, CHAT, RESPONSES)}
    return {"/v1/models": "models", **named}.get(path, "other")
