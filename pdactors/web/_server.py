"""Serving a quart-trio app with hypercorn under trio, as the bootstrap and the proxy do.

Every HTTP door goes through :func:`serve_http`, which wraps the app so that an answer given
before the request's body was read (a refusal: 401, 408, 413, 429) closes the connection and
never leaves it wedged (:func:`ends_cleanly`), and runs hypercorn's connection handler itself
(:class:`~pdactors.web._connections.Connection`: writes bounded by the door's write timeout,
no racy half-close), each client held to the door's connections per client.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any, Final

import hypercorn.logging
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import (
    ASGIReceiveCallable,
    ASGIReceiveEvent,
    ASGISendCallable,
    ASGISendEvent,
    ConnectionState,
    LifespanState,
    Scope,
)
from hypercorn.utils import repr_socket_addr, wrap_app

from pdactors.errors import ConfigError
from pdactors.web._connections import Connection, ConnectionLimits, Doorman
from pdactors.web._refusals import RefusalLog

__all__ = ["CLOSING_STATUSES", "bind_listener", "ends_cleanly", "serve_http"]

#: Refusals that may come before the request's body was read: HTTP/1 answers with these
#: statuses say ``Connection: close`` and the connection is closed after them, so a body that
#: arrives late is never read as the next request.
CLOSING_STATUSES: Final = frozenset({401, 408, 413, 429})


class _QuietHypercornLogger(hypercorn.logging.Logger):  # type: ignore[misc]
    """Hypercorn's logger, with its INFO lines ("Running on ...") demoted to DEBUG."""

    async def info(self, message: str, *args: Any, **kwargs: Any) -> None:
        await self.debug(message, *args, **kwargs)


async def bind_listener(host: str, port: int, what: str) -> trio.socket.SocketType:
    """Bind ``host:port`` (0: any free port) before serving, so that a failure is a plain
    :class:`OSError` (with a note naming ``what``) rather than one inside a nursery."""
    family = trio.socket.AF_INET6 if ":" in host else trio.socket.AF_INET
    sock = trio.socket.socket(family, trio.socket.SOCK_STREAM)
    try:
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
        sock.setsockopt(trio.socket.IPPROTO_TCP, trio.socket.TCP_NODELAY, 1)
        await sock.bind((host, port))
    except BaseException as exc:
        sock.close()
        if isinstance(exc, OSError):
            exc.add_note(f"binding {what} to {host}:{port}")
        raise
    return sock


def ends_cleanly(app: Any) -> Callable[..., Any]:
    """``app`` (ASGI) with every HTTP answer ending cleanly, whatever the app read of the body.

    * An answer that starts before the app saw the end of the request's body first reads and
      drops what is left of it (at most :data:`_DRAIN_BYTES` in :data:`_DRAIN_PIECES`
      messages, for :data:`_DRAIN_SECONDS`), so
      that the connection can serve the next request and the client's late bytes do not reset
      it under the answer. An answer with a status in :data:`CLOSING_STATUSES`, or whose body
      is still not all in, says ``Connection: close`` (HTTP/1), and hypercorn closes the
      connection after it.
    * The answer's last message is handed to hypercorn shielded, with the request's remaining
      messages drained beside it. Hypercorn ends the exchange inside that call: it queues a
      disconnect for the app (a queue of 10 messages, which a body the app never read may
      have filled) and then closes the connection or readies it for the next request. Quart
      cancels its handler as soon as it sees that disconnect, which cut the close short: the
      connection neither answered again nor closed (issue 23, finding 7).
    """

    async def asgi(scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        http1 = scope["http_version"] in ("1.0", "1.1")  # HTTP/2 has no Connection header
        request = _Request(receive)

        async def send_cleanly(message: ASGISendEvent) -> None:
            if message["type"] == "http.response.start":
                if not request.ended.is_set():
                    await request.drain_rest()
                if http1 and (message["status"] in CLOSING_STATUSES or not request.ended.is_set()):
                    headers = [*message.get("headers", ()), (b"connection", b"close")]
                    message = {**message, "headers": headers}
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                with trio.CancelScope(shield=True):
                    if request.ended.is_set():  # the app read it all: the queue has room
                        await send(message)
                        return
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(request.drain_all)
                        await send(message)
                        nursery.cancel_scope.cancel()
                return
            await send(message)

        await app(scope, request.receive, send_cleanly)

    return asgi


#: What an answer given before the request's body was all in reads of it first, at most.
_DRAIN_BYTES: Final = 64 * 1024
_DRAIN_PIECES: Final = 256
_DRAIN_SECONDS: Final = 0.5


class _Request:
    """One request's ``receive``, noting when its body's end (or a disconnect) came."""

    def __init__(self, receive: ASGIReceiveCallable) -> None:
        self._receive = receive
        self.ended = trio.Event()

    async def receive(self) -> ASGIReceiveEvent:
        message = await self._receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            self.ended.set()
        return message

    async def drain_rest(self) -> None:
        """Read and drop the body until its end (whoever reads it), within the bounds."""
        with trio.move_on_after(_DRAIN_SECONDS):
            async with trio.open_nursery() as nursery:

                async def read() -> None:
                    drained = pieces = 0
                    while not self.ended.is_set() and drained <= _DRAIN_BYTES:
                        if pieces == _DRAIN_PIECES:  # each costs ~40 µs, whatever its size
                            break
                        message = await self.receive()
                        if message["type"] == "http.request":
                            drained += len(message.get("body", b""))
                        pieces += 1
                    nursery.cancel_scope.cancel()

                nursery.start_soon(read)
                await self.ended.wait()
                nursery.cancel_scope.cancel()

    async def drain_all(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass


def _reachable_url(bound: str) -> str:
    """``http://0.0.0.0:P`` → ``http://127.0.0.1:P`` (and ``[::]`` → ``[::1]``, and the same
    for ``https``): a URL to dial."""
    for scheme in ("http", "https"):
        for wildcard, loopback in (("0.0.0.0", "127.0.0.1"), ("[::]", "[::1]")):
            prefix = f"{scheme}://{wildcard}:"
            if bound.startswith(prefix):
                return f"{scheme}://{loopback}:{bound.removeprefix(prefix)}"
    return bound


async def serve_http(
    app: Any,
    sock: trio.socket.SocketType,
    *,
    errorlog: logging.Logger,
    announce: Callable[[str], None],
    certfile: str | None = None,
    keyfile: str | None = None,
    door: str = "the HTTP door",
    limits: ConnectionLimits | None = None,
    closed: Callable[[str], None] = lambda why: None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on the socket from :func:`bind_listener` until cancelled; ``announce`` and
    ``task_status`` get the bound URL (a wildcard host is reported as loopback).

    With ``certfile`` and ``keyfile`` (PEM), it serves HTTPS (hypercorn's TLS) and the URL is
    ``https://``. Hypercorn's messages go to ``errorlog`` (its INFO lines as DEBUG); no access
    log. A client's connection past ``limits.max_per_client`` is closed as it is accepted, a
    connection whose client takes no piece of its answer within ``limits.write_timeout`` is
    closed (:mod:`~pdactors.web._connections`; ``limits`` None: the shipped defaults): each
    logged on ``errorlog`` as ``door``'s, once per client per interval
    (:class:`~pdactors.web._refusals.RefusalLog`), and passed to ``closed``
    (``"max_connections_per_client"``, ``"write_timeout"``: the proxy counts them).
    """
    hconfig = HypercornConfig()
    if (certfile is None) != (keyfile is None):
        raise ConfigError("TLS needs both a certificate file and a key file")
    hconfig.certfile, hconfig.keyfile = certfile, keyfile
    hconfig.accesslog = None
    hconfig.errorlog = errorlog
    hconfig.logger_class = _QuietHypercornLogger
    wrapped = wrap_app(ends_cleanly(app), hconfig.wsgi_max_body_size, "asgi")
    # hypercorn.trio.serve, less what we do not use (workers, shutdown triggers, QUIC), with
    # the connection handler below.
    state: LifespanState = {}
    lifespan = Lifespan(wrapped, hconfig, state)
    with sock:  # closed when the server stops (the listener does not close it)
        sock.listen(hconfig.backlog)
        listener: trio.abc.Listener[Any] = trio.SocketListener(sock)
        if certfile is not None:
            tls = hconfig.create_ssl_context()
            assert tls is not None  # (it is None only without a certificate)
            listener = trio.SSLListener(listener, tls, https_compatible=True)
        bound = repr_socket_addr(sock.family, sock.getsockname())
        url = _reachable_url(f"{'https' if certfile else 'http'}://{bound}")
        async with trio.open_nursery() as nursery:
            await nursery.start(lifespan.handle_lifespan)
            await lifespan.wait_for_startup()
            handler = partial(
                Connection, wrapped, hconfig, WorkerContext(None), ConnectionState(state.copy())
            )
            refusals = RefusalLog(errorlog, door)
            doorman = Doorman(handler, limits or ConnectionLimits(), refusals, closed)
            nursery.start_soon(partial(trio.serve_listeners, doorman.serve, [listener]))
            announce(url)
            task_status.started(url)
