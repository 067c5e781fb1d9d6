"""What the proxy's and the bootstrap's Quart apps share: JSON answers, the bearer-token gate
and the error handlers.

Each door keeps its own error *shape* (the proxy OpenAI's ``{"error": {...}}``, the bootstrap
upstream's ``{"error": "..."}``), passed in as functions; the rules are here once:

* routes in ``open_paths`` (health, metrics) pass without a token; any other needs the
  bearer token when one is configured (:class:`~pdactors.web._auth.BearerCheck`);
* an :class:`~werkzeug.exceptions.HTTPException` (404, 405, 408, 413, ...) is answered in the
  door's shape;
* any other exception is a bug: logged with its traceback, answered 500, and the server keeps
  going. Handling it here also keeps Quart from building its own logger (it would start a
  queue listener thread).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

import msgspec
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from pdactors.web._auth import BearerCheck

__all__ = ["client_address", "guard", "json_response"]


def json_response(
    body: object, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    """``body`` as a JSON answer (msgspec's encoder)."""
    return Response(
        msgspec.json.encode(body), status=status, content_type="application/json", headers=headers
    )


def client_address() -> str:
    """The current request's client, for refusal logs (Quart's request context)."""
    return request.remote_addr or "unknown client"


def guard(
    app: QuartTrio,
    *,
    check: BearerCheck,
    open_paths: Collection[str],
    unauthorized: Callable[[str, str], Response],
    http_error: Callable[[HTTPException, str], Response],
    internal_error: Callable[[str], Response],
    log: logging.Logger,
    who: str,
) -> None:
    """Install the bearer gate and the error handlers on ``app``.

    ``unauthorized(client, reason)`` answers a request without the token; ``http_error(exc,
    client)`` an HTTP error; ``internal_error(message)`` a bug (after it was logged on ``log``
    as ``"<who>: internal error on ..."``).
    """

    @app.before_request
    async def authenticate() -> Response | None:
        if request.path in open_paths:
            return None  # open: load balancers, health loops and Prometheus
        client = client_address()
        reason = check.refusal(request.headers.get("authorization"), client)
        return None if reason is None else unauthorized(client, reason)

    @app.errorhandler(HTTPException)
    async def on_http_error(exc: HTTPException) -> Response:
        return http_error(exc, client_address())

    @app.errorhandler(Exception)
    async def on_internal_error(exc: Exception) -> Response:
        log.error("%s: internal error on %s %r", who, request.method, request.path, exc_info=exc)
        return internal_error(f"internal error: {type(exc).__name__}")
