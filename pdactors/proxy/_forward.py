"""The routes the proxy does not serve itself, forwarded to one engine: vLLM's ``/tokenize``,
``/detokenize``, ``/version``, ``/v1/embeddings``, ``/v1/score``, ``/pooling``,
``/v1/load_lora_adapter``... any ``GET`` or ``POST`` whose path is none of the proxy's own
(raw ASGI, :class:`~pdactors.proxy._asgi.ProxyApp`).

The client's key is checked first and its body bounded as a completion's
(:func:`~pdactors.proxy._asgi.receive_body`); the request then goes as it came (method, raw
path, query string, body, ``Content-Type``) with the engines' ``Authorization``
(:meth:`~pdactors.proxy._completions.Proxy.engine_auth`) to one engine in rotation: a D, else a
P when ``fall_back_to_p`` (as ``/v1/models``), picked by the pool's routing. The engine's
status, ``Content-Type`` and body come back as they are, the body read whole first (these
routes answer small JSON; a broken one is then still a 502). A failed call is a 502 naming the
engine (a refused connection also takes it out of rotation), none in rotation a 503 saying
why, no answer within ``request_timeout`` a 504: ``request_timeout`` rather than
``health_timeout`` because some of these routes run the model (embeddings, scores, pooling)
or load an adapter, queued behind the engine's other work like any request.
"""

from __future__ import annotations

import logging
import uuid
from typing import Final

import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, HTTPScope

from pdactors.proxy._asgi import ClientGone, Reply, cancel_on_disconnect, header, receive_body
from pdactors.proxy._completions import Proxy
from pdactors.proxy._engine_http import EngineError
from pdactors.proxy._openai import Failure
from pdactors.proxy._state import Backend

__all__ = ["forwarded_label", "serve_forwarded"]

log = logging.getLogger("pdactors.proxy")

#: The requests metric's ``endpoint`` label of a forwarded path: a fixed few, never the
#: client's text (each label value is a time series kept for the proxy's life).
_LABELS: Final = {"/tokenize": "tokenize", "/detokenize": "detokenize", "/version": "version"}


def forwarded_label(path: str) -> str:
    """The ``endpoint`` label of forwarded ``path``: its name for a known few, else ``other``."""
    return _LABELS.get(path, "other")


async def serve_forwarded(
    proxy: Proxy, scope: HTTPScope, receive: ASGIReceiveCallable, send: ASGISendCallable
) -> None:
    """One forwarded request (raw ASGI), counted in the requests metric. A client that goes
    away cancels the engine's call (its connection is closed); a bug is logged with its
    traceback and answered 500 when nothing was sent yet."""
    reply = Reply(send)
    label = forwarded_label(scope["path"])
    peer = scope.get("client")
    client = peer[0] if peer else "unknown client"
    refused = proxy.auth.refusal(header(scope["headers"], b"authorization"), client)
    if refused is not None:  # before reading a byte of the body
        await _refuse(proxy, label, client, Failure.unauthorized(refused), reply)
        return
    try:
        body = await receive_body(scope["headers"], receive, proxy.config)
    except ClientGone:
        return
    if isinstance(body, Failure):
        await _refuse(proxy, label, client, body, reply)
        return
    outcome = "cancelled"  # unless the answer is sent: the client went away first
    try:
        async with trio.open_nursery() as nursery:
            watch = trio.CancelScope()
            nursery.start_soon(cancel_on_disconnect, receive, nursery.cancel_scope, reply, watch)
            outcome = await _forward(proxy, scope, body, reply)
            watch.cancel()
    except Exception as exc:
        outcome = "internal_error"
        log.error("proxy: internal error on %s %r", scope["method"], scope["path"], exc_info=exc)
        if not reply.started:
            message = f"internal error: {type(exc).__name__}"
            await reply.failure(Failure.of(500, message, "internal_error", ""))
    proxy.metrics.requests.labels(label, outcome).inc()


async def _forward(proxy: Proxy, scope: HTTPScope, body: bytes, reply: Reply) -> str:
    """Send the request to an engine and its answer to the client; the outcome's label."""
    engine, why_none = _engine(proxy)
    if engine is None:
        await reply.failure(Failure.of(503, why_none, "service_unavailable", "unavailable"))
        return "unavailable"
    tid = uuid.uuid4().hex
    answer = await _call(proxy, engine, scope, body, tid)
    if isinstance(answer, Failure):
        await reply.failure(answer)
        return answer.outcome
    status, content_type, data = answer
    length = (b"content-length", str(len(data)).encode())
    await reply.start(status, content_type, tid, length)
    await reply.chunk(data, more=False)
    if status >= 500:  # passed on as it came, but the engine's failure all the same
        proxy.metrics.backend_errors.labels(engine.role, engine.url).inc()
        return f"{engine.role}_error"
    return "ok" if status < 400 else "invalid"


def _engine(proxy: Proxy) -> tuple[Backend | None, str]:
    """A D in rotation, else (``fall_back_to_p``) a P; None and why when there is none."""
    d = proxy.decode.pick()
    if d is not None or not proxy.config.fall_back_to_p:
        return d, proxy.decode.why_none()
    p = proxy.prefill.pick()
    return p, f"{proxy.decode.why_none()}; {proxy.prefill.why_none()}"


async def _call(
    proxy: Proxy, engine: Backend, scope: HTTPScope, body: bytes, tid: str
) -> tuple[int, bytes, bytes] | Failure:
    """The engine's status, ``Content-Type`` and whole body, within ``request_timeout``; or the
    failure to tell the client."""
    target = scope["raw_path"]
    if scope["query_string"]:
        target += b"?" + scope["query_string"]
    headers = [(b"x-request-id", tid.encode()), *proxy.engine_auth(scope["headers"])]
    content_type = header(scope["headers"], b"content-type")
    if content_type is not None:
        headers.append((b"content-type", content_type.encode("latin-1")))
    with trio.move_on_after(proxy.config.request_timeout):
        try:
            resp = await proxy.engines[engine.url].request(
                scope["method"], target.decode("latin-1"), body, headers
            )
            data = await resp.read()
        except EngineError as exc:
            return proxy.legs.failures.transport_failure(engine, exc)
        answered = header(resp.headers, b"content-type")
        return resp.status, (answered or "application/json").encode("latin-1"), data
    return proxy.legs.failures.timeout_failure(f"{engine.role} engine {engine.url} gave no answer")


async def _refuse(proxy: Proxy, label: str, client: str, no: Failure, reply: Reply) -> None:
    proxy.metrics.requests.labels(label, no.outcome).inc()
    proxy.refusals.refused(client, no.status, no.message)
    await reply.failure(no)
