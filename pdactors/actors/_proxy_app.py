"""The proxy's HTTP face: the Quart app around the exchange (:mod:`pdactors.actors.proxy`).

Completions are served on raw ASGI (``ProxyApp.fast``, the hot path); the other routes
(``/v1/models``, ``/health``, ``/metrics``), the bearer check and the error shapes are
Quart's.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from pdactors.actors._proxy_wire import CHAT, COMPLETIONS, Failure, ProxyApp

if TYPE_CHECKING:
    from pdactors.actors.proxy import Proxy

__all__ = ["make_app"]

log = logging.getLogger("pdactors.proxy")


def _json(body: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status=status, content_type="application/json")


def make_app(proxy: Proxy) -> QuartTrio:
    app = ProxyApp(__name__, static_folder=None)
    app.config["MAX_CONTENT_LENGTH"] = proxy.config.max_body_bytes
    app.config["BODY_TIMEOUT"] = proxy.config.body_timeout  # (no route here reads a body)
    # Quart would silently cut a streamed answer after RESPONSE_TIMEOUT (60 s); the proxy
    # bounds each request itself, with an error the client can see.
    app.config["RESPONSE_TIMEOUT"] = None

    app.fast = {
        e.path: partial(proxy.serve_completion, e) for e in (COMPLETIONS, CHAT)
    }  # POST only; other methods on these paths reach Quart's routing (405)

    @app.route("/v1/completions", methods=["PUT"])
    @app.route("/v1/chat/completions", methods=["PUT"])
    async def completions_put() -> Response:  # never POST: served on raw ASGI (app.fast)
        return Failure.of(405, "use POST", "invalid_request_error", "").response()

    @app.before_request
    async def authenticate() -> Response | None:
        if request.path in ("/health", "/metrics"):
            return None  # open: load balancers and Prometheus
        client = request.remote_addr or "unknown client"
        refused = proxy.auth.refusal(request.headers.get("authorization"), client)
        if refused is None:
            return None
        proxy.refusals.refused(client, 401, refused)
        proxy.metrics.requests.labels(_endpoint(request.path), "unauthorized").inc()
        return Failure.unauthorized(refused).response()

    @app.get("/v1/models")
    async def models() -> Response:
        incoming = request.headers.get("authorization")
        return await proxy.models(incoming.encode("latin-1") if incoming else None)

    @app.get("/health")
    async def health() -> Response:
        status, report = proxy.watch.report()
        if proxy.config.placement == "auto":
            report["placement"] = proxy.placer.describe()
        return _json(report, status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(proxy.metrics.registry), content_type=CONTENT_TYPE_LATEST)

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        # 404, 405, 408, 413, ...: OpenAI's error shape.
        code = exc.code or 500
        proxy.refusals.refused(request.remote_addr or "unknown client", code, exc.name)
        proxy.metrics.requests.labels(_endpoint(request.path), "invalid").inc()
        return Failure.of(code, exc.description or exc.name, "invalid_request_error", "").response()

    @app.errorhandler(Exception)
    async def internal_error(exc: Exception) -> Response:
        # Handled here so that Quart never builds its own logger (it would start a queue
        # listener thread); the bug is logged with its traceback and the server keeps going.
        log.error("proxy: internal error on %s %r", request.method, request.path, exc_info=exc)
        message = f"internal error: {type(exc).__name__}"
        return Failure.of(500, message, "internal_error", "").response()

    return app


def _endpoint(path: str) -> str:
    """The metric label of a Quart route's path: a few known names, never the client's text."""
    return {"/v1/models": "models", COMPLETIONS.path: COMPLETIONS.name, CHAT.path: CHAT.name}.get(
        path, "other"
    )
