"""The proxy: an OpenAI-compatible front door for prefill/decode disaggregation.

:func:`serve_proxy` serves ``POST /v1/completions`` and ``POST /v1/chat/completions`` (quart-trio
on hypercorn). Each request is routed to a prefill engine (P) and a decode engine (D), placed
(P computes the prompt, or D does: ``--placement``, ``auto`` by default) and served in one of
four flows, each a path through the exchange's transition table
(:mod:`pdactors.core.exchange_rules`), with upstream vLLM's ``kv_transfer_params``:

* **P-first** (the default, ``first_token = "p"``): P is asked for one token (its token ids
  returned). A streamed client gets that token at once; when it ends the answer (EOS, a stop
  string, one token asked) nothing else is asked. Otherwise D gets a completion of the
  prompt's ids and P's token with ``{"do_remote_prefill": true, "remote_engine_id": ...,
  "remote_bootstrap_addr": ..., "transfer_id": T, "first_token_from_p": true}``, pulls the
  prompt's KV from P and continues after P's token. A P that fails (or is judged failed by the
  health loop) before its token leaves the request to D alone (``fall_back_to_d``).
* **Concurrent** (``first_token = "d"``, or a body the P-first flow cannot carry): P gets the
  client's body with ``max_tokens: 1``, ``stream: false`` and ``{"do_remote_decode": true,
  "transfer_id": T}`` and D the client's body with the pull's params, both at once, as in
  upstream's example proxy. D's answer reaches the client as soon as D gives it (nothing waits
  for P's answer); P failing beside D is only noted (D's KV decides; P's 4xx, the request's
  own fault, fails it), D failing cancels P's leg (its connection closed: vLLM aborts it).
* **Local**: D alone computes the prompt (placed local, or no P in rotation, or none that
  answers with D's model).
* **Whole-on-P**: a P serves it whole in D's place (pinned, or no D in rotation:
  ``fall_back_to_p``).

In every flow D's answer is relayed as it comes: its headers when D's come, each SSE chunk as D
sends it. A D that fails before any of its answer reached the client, its KV missing, is asked
once more computing the prompt itself (a retry); one that fails otherwise (a 5xx, a broken
answer, an error event, judged failed by the health loop) hands the request to another engine,
which continues after what the client got (a migration, up to ``migration_limit``). What is
left is told to the client: before D's answer began an HTTP status (a 4xx passes through,
anything else is a 502 naming the engine, a 504 past ``request_timeout``), once a stream has
begun an error event. D's answer complete, P's leg (if still running) gets a moment to end
(``_PREFILL_GRACE``, so that its connection is reused), then it is cancelled. A client that
goes away cancels both (as does one that stops reading its answer, after ``write_timeout``:
:mod:`pdactors.web._connections`); a stream in which D reports an error event counts as
``decode_error``.

Other routes: ``GET /v1/models`` (a healthy D's answer), ``GET /health`` (200 ``ok`` with a P
and a D in rotation, 200 ``degraded`` while one role alone can serve, else 503 with the
reasons), ``GET /metrics`` (Prometheus text, one registry per proxy).
A ``GET`` or ``POST`` on any other path (vLLM's ``/tokenize``,
``/detokenize``, ``/version``, ``/v1/embeddings``...) is forwarded as it came to one engine in
rotation (a D, else a P with ``fall_back_to_p``) and its answer sent back as it came; a failed
call is a 502 naming the engine, none in rotation a 503 (:mod:`~pdactors.proxy._forward`).

A health loop checks every engine's ``GET /health`` and every P's bootstrap ``GET /query`` each
``health_interval``: an engine that fails leaves the rotation and comes back when it answers
again, and P's engine id (DP rank 0 of its bootstrap entry) is re-read every round, so a
restarted P is used under its new id (a bootstrap that gives no answer in time keeps a healthy
P in rotation under the id it had). A connection refused by an engine also takes it out at
once. A P judged failed itself (its ``/health``, a refused connection) has every P-first
request still waiting for its first token cut from it, served by D alone. Engine calls go
through :mod:`pdactors.proxy._engine_http` (h11); the completion routes and the forwarded ones
are served on raw ASGI, the proxy's other routes by Quart.

Where each step lives: the request's arrival, checks, routing and placement in
:mod:`~pdactors.proxy._completions`; its whole life — flow, phase, engines, failures, what the
client got, the counts it holds — in one sans-IO record, :mod:`pdactors.core.exchange` (its
table: :mod:`~pdactors.core.exchange_rules`; what follows a failure:
:mod:`~pdactors.core.exchange_next`), whose effects are carried out in
:mod:`~pdactors.proxy._effects` only; the flows performed in :mod:`~pdactors.proxy._flows`
(P-first: :mod:`~pdactors.proxy._p_first`; D's answer, retries and migrations:
:mod:`~pdactors.proxy._answer`); the calls to P and D in :mod:`~pdactors.proxy._legs` (what a
failed one tells the client in :mod:`~pdactors.proxy._engine_failures`, which engine continues
a migrated request in :mod:`~pdactors.proxy._retry`); the bodies in
:mod:`~pdactors.proxy._bodies`; the OpenAI body rules in :mod:`~pdactors.proxy._openai`; the
raw ASGI plumbing in :mod:`~pdactors.proxy._asgi`; the Quart routes in :mod:`~pdactors.proxy._app`;
the forwarded routes in :mod:`~pdactors.proxy._forward`; health in :mod:`~pdactors.proxy._health`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Final

import httpx
import trio

from pdactors._http_client import async_client
from pdactors.bootstrap_client import tls_verify
from pdactors.proxy._app import make_app
from pdactors.proxy._completions import Proxy
from pdactors.proxy._tracing import open_tracing
from pdactors.proxy_config import ProxyConfig
from pdactors.web._connections import ConnectionLimits
from pdactors.web._server import bind_listener, serve_http

__all__ = ["serve_proxy"]

log = logging.getLogger("pdactors.proxy")
# Hypercorn's own messages go here rather than to "hypercorn.error" (see bootstrap.py).
_http_log = logging.getLogger("pdactors.proxy.http")

#: How long closing a connection to an engine may take (it is done shielded).
_CLOSE_TIMEOUT: Final = 2.0


@asynccontextmanager
async def _open_http(
    timeouts: httpx.Timeout, limits: httpx.Limits, ca_file: str | None = None
) -> AsyncIterator[httpx.AsyncClient]:
    # Proxy settings in the environment are ignored: engines are always dialled directly.
    client = async_client(timeout=timeouts, limits=limits, verify=tls_verify(ca_file))
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
    (a wildcard host is reported as loopback). Requests are refused with 503 until an engine
    that may serve them has passed a health check (``GET /health`` answers 200 from then on).
    Engine failures become error answers to the requests they hit and take the engine out of
    rotation; they never stop the proxy.

    Usage: ``url = await nursery.start(serve_proxy, config)``.

    Raises :class:`OSError` if the address cannot be bound (before ``started``). Never returns
    normally.
    """
    probe_timeout = httpx.Timeout(config.health_timeout)
    probe_limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with (
        _open_http(probe_timeout, probe_limits, config.ca_file) as probe_http,
        open_tracing(config.otlp_traces_endpoint) as tracing,
    ):
        proxy = Proxy(config, probe_http, tracing)
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
        nursery.start_soon(proxy.releases.run)
        if proxy.feeds is not None:
            nursery.start_soon(proxy.feeds.run)
        app = make_app(proxy)
        serve = partial(
            serve_http,
            app,
            sock,
            errorlog=_http_log,
            announce=lambda _: None,
            certfile=config.certfile,
            keyfile=config.keyfile,
            door="the proxy",
            limits=ConnectionLimits(config.max_connections_per_client, config.write_timeout),
            closed=lambda why: proxy.metrics.connections_closed.labels(why).inc(),
        )
        url = await nursery.start(serve)  # announced below, with the backends
        prefill = ", ".join(f"{p.url} (bootstrap {p.bootstrap_url})" for p in config.prefill)
        both = ", ".join(f"{p.url} (bootstrap {p.bootstrap_url})" for p in config.engines)
        log.info(
            "proxy: listening on %s; prefill %s (%s); decode %s (%s)%s",
            url, prefill or "-", proxy.prefill.routing, ", ".join(config.decode) or "-",
            proxy.decode.routing, f"; every role {both}" if both else "",
        )  # fmt: skip
        task_status.started(url)
