"""The proxy's raw ASGI plumbing for the completion routes and those forwarded to an engine
(Quart's request and response machinery cost ~1 ms of CPU per request:
bench/proxy_overhead.py): the app that routes them past Quart, reading a request's body within
its bounds, the client's reply, and watching for the client going away.

A body (a completion's, a forwarded request's) is refused before any work it could cause: from
its ``Content-Length`` when that is over the limit (413, nothing read), when more of it arrives
than the limit (413), when it takes longer than the body timeout to arrive (408), and when it
comes in too many small pieces (400). Refusals that leave a body unread close the connection
(:mod:`pdactors.web._server`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Final, get_args

import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, Scope
from quart_trio import QuartTrio

from pdactors.errors import PdError
from pdactors.proxy._openai import Failure
from pdactors.proxy_config import Placement, ProxyConfig

__all__ = [
    "MAX_SMALL_PIECES",
    "MIN_MEAN_PIECE",
    "PLACEMENT_HEADER",
    "SLO_HEADERS",
    "ClientGone",
    "ProxyApp",
    "Reply",
    "cancel_on_disconnect",
    "header",
    "placing",
    "receive_body",
]

#: A body that came in more pieces than this (ASGI messages: a chunk of a chunked body, or
#: what one read of the socket gave) must average at least :data:`MIN_MEAN_PIECE` bytes a
#: piece, else it is refused with 400: each piece costs the server ~40 µs whatever its size,
#: so a 16 MB body in 2-byte chunks would cost minutes of CPU.
MAX_SMALL_PIECES: Final = 1024
MIN_MEAN_PIECE: Final = 256
#: A request header that overrides ``--placement`` for that request (auto, disaggregate,
#: local); the answer's header of the same name says where its prompt was computed.
PLACEMENT_HEADER: Final = b"x-pdactors-placement"
#: A request's own objectives, in ms, for ``auto`` placement: time to first token, per token.
SLO_HEADERS: Final = (b"x-pdactors-slo-ttft-ms", b"x-pdactors-slo-tpot-ms")


class Reply:
    """The client's side of one completion request, over raw ASGI (hypercorn's ``send``)."""

    def __init__(self, send: ASGISendCallable) -> None:
        self._send = send
        self.started = False
        self.complete = False  # the answer's last byte was handed to hypercorn
        self.headers: list[tuple[bytes, bytes]] = []  # sent with the answer's headers

    async def start(
        self,
        status: int,
        content_type: bytes,
        tid: str,
        *extra: tuple[bytes, bytes],
    ) -> None:
        """Send the answer's headers (with :attr:`headers`; ``x-request-id`` when ``tid``)."""
        self.started = True
        headers = [(b"content-type", content_type)]
        if tid:
            headers.append((b"x-request-id", tid.encode()))
        headers += [*self.headers, *extra]
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def chunk(self, data: bytes, *, more: bool = True) -> None:
        """Send a piece of the answer's body (``more=False``: its last)."""
        self.complete = not more
        await self._send({"type": "http.response.body", "body": data, "more_body": more})

    async def whole(self, status: int, body: bytes, tid: str = "") -> None:
        """Send a whole JSON answer."""
        # With its length, hypercorn writes the body at once; chunked, the last chunk is a
        # write (and a wake-up of the client) of its own.
        length = (b"content-length", str(len(body)).encode())
        await self.start(status, b"application/json", tid, length)
        await self.chunk(body, more=False)

    async def failure(self, failure: Failure, tid: str = "") -> None:
        """Send ``failure`` as the whole answer (``tid``: the request's id, when it has one)."""
        await self.whole(failure.status, failure.body, tid)


class ClientGone(PdError):
    """The client disconnected before its request's body was in."""


async def receive_body(
    headers: Iterable[tuple[bytes, bytes]], receive: ASGIReceiveCallable, config: ProxyConfig
) -> bytes | Failure:
    """The request's body, or the refusal to answer: 413 when its ``Content-Length`` is over
    ``config.max_body_bytes`` (nothing read) or more than that arrives, 408 when it is not all
    in within ``config.body_timeout`` seconds, 400 when it comes in too many small pieces
    (:data:`MAX_SMALL_PIECES`). The body is gathered in one buffer, so the pieces it came in
    cost nothing once read. Raises :class:`ClientGone` when the client disconnects first."""
    limit, timeout = config.max_body_bytes, config.body_timeout
    length = header(headers, b"content-length")
    if length is not None and length.isascii() and length.isdigit():  # (h11 checked it)
        if len(length) > 20 or int(length) > limit:
            return _too_large(limit)
    with trio.move_on_after(timeout):
        return await _read_body(receive, limit)
    message = f"the body did not arrive within {timeout:g} s"
    return Failure.of(408, message, "invalid_request_error", "client_timeout")


def _too_large(limit: int) -> Failure:
    return Failure.of(
        413, f"the body is larger than {limit} bytes", "invalid_request_error", "invalid"
    )


async def _read_body(receive: ASGIReceiveCallable, limit: int) -> bytes | Failure:
    message = await receive()
    if message["type"] != "http.request":
        raise ClientGone
    first = message.get("body", b"")
    if not message.get("more_body", False):  # the common case: the body in one piece
        return first if len(first) <= limit else _too_large(limit)
    body, pieces = bytearray(first), 1
    while len(body) <= limit:
        if pieces > MAX_SMALL_PIECES and len(body) < pieces * MIN_MEAN_PIECE:
            why = (
                f"the body came in {pieces} pieces of {len(body) // pieces} bytes on average "
                f"(more than {MAX_SMALL_PIECES} must average {MIN_MEAN_PIECE} bytes or more)"
            )
            return Failure.of(400, why, "invalid_request_error", "invalid")
        message = await receive()
        if message["type"] != "http.request":
            raise ClientGone
        body += message.get("body", b"")
        pieces += 1
        if not message.get("more_body", False):
            return bytes(body) if len(body) <= limit else _too_large(limit)
    return _too_large(limit)


async def cancel_on_disconnect(
    receive: ASGIReceiveCallable, scope: trio.CancelScope, reply: Reply, watch: trio.CancelScope
) -> None:
    """The client went away before its answer was complete: cancel its request (P and D see
    their connections close). Watches until ``watch`` is cancelled."""
    with watch:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not reply.complete:  # (hypercorn reports a disconnect at every answer's end)
            scope.cancel()


class ProxyApp(QuartTrio):  # type: ignore[misc]
    """Quart for the proxy's own routes but the completions, which are served on raw ASGI:
    Quart's request and response machinery cost ~1 ms of CPU per request
    (bench/proxy_overhead.py). A ``GET`` or ``POST`` on any other path goes to ``forward``
    (raw ASGI too: an engine's route, :mod:`pdactors.proxy._forward`)."""

    fast: dict[str, Callable[..., Awaitable[None]]]
    forward: Callable[..., Awaitable[None]] | None = None
    own: frozenset[str] = frozenset()  # the paths served here (Quart's routes and ``fast``)

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] == "http" and scope["method"] in ("GET", "POST"):
            handler = self.fast.get(scope["path"]) if scope["method"] == "POST" else None
            if handler is None and scope["path"] not in self.own:
                handler = self.forward
            if handler is not None:
                await handler(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> str | None:
    """The first value of header ``name`` (lower case), or None."""
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


def placing(
    headers: Iterable[tuple[bytes, bytes]], config: ProxyConfig
) -> tuple[str, tuple[float, float]] | Failure:
    """A request's placement (its :data:`PLACEMENT_HEADER`, else ``config.placement``) and its
    ``(TTFT, TPOT)`` objectives in ms (its :data:`SLO_HEADERS`, each a number >= 0 where 0 is
    not weighed, else the operator's); a 400 naming the header for any other value."""
    asked = header(headers, PLACEMENT_HEADER)
    pin = config.placement if asked is None else asked.strip().lower()
    if pin not in get_args(Placement):
        allowed = ", ".join(get_args(Placement))
        message = f"the {PLACEMENT_HEADER.decode()} header must be one of {allowed}"
        return Failure.of(400, message, "invalid_request_error", "invalid")
    slo = [config.slo_ttft_ms, config.slo_tpot_ms]
    for i, name in enumerate(SLO_HEADERS):
        value = header(headers, name)
        if value is None:
            continue
        try:
            slo[i] = float(value)
        except ValueError:
            slo[i] = -1.0
        if not 0 <= slo[i] < float("inf"):
            message = f"the {name.decode()} header must be a number of ms >= 0"
            return Failure.of(400, message, "invalid_request_error", "invalid")
    return pin, (slo[0], slo[1])
