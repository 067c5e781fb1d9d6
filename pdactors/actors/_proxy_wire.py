"""The proxy's client side of the wire: OpenAI request bodies and error bodies, one request's
exchange state, and replies over raw ASGI (the completion routes skip Quart's machinery).

A completion's body is refused before any work it could cause: from its ``Content-Length``
when that is over the limit (413, nothing read), when more of it arrives than the limit (413),
when it takes longer than the body timeout to arrive (408), and when its JSON nests deeper than
:data:`MAX_JSON_DEPTH` (400). Refusals that leave a body unread close the connection
(:mod:`pdactors.actors._http`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec
import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, Scope
from quart import Response
from quart_trio import QuartTrio

from pdactors.actors._proxy_state import Backend
from pdactors.config import ProxyConfig

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "MAX_JSON_DEPTH",
    "ClientGone",
    "Endpoint",
    "Exchange",
    "Failure",
    "ProxyApp",
    "Reply",
    "cancel_on_disconnect",
    "header",
    "receive_body",
    "validate",
]


# --------------------------------------------------------------------------- requests

#: The deepest a request's JSON may nest (objects and arrays); deeper is refused with 400.
#: OpenAI bodies nest a few levels (tool schemas a few more).
MAX_JSON_DEPTH: Final = 64
#: A body that came in more pieces than this (ASGI messages: a chunk of a chunked body, or
#: what one read of the socket gave) must average at least :data:`MIN_MEAN_PIECE` bytes a
#: piece, else it is refused with 400: each piece costs the server ~40 µs whatever its size,
#: so a 16 MB body in 2-byte chunks would cost minutes of CPU.
MAX_SMALL_PIECES: Final = 1024
MIN_MEAN_PIECE: Final = 256


@dataclass(frozen=True)
class Endpoint:
    name: str  # metric label
    path: str
    input_field: str
    chat: bool


COMPLETIONS: Final = Endpoint("completions", "/v1/completions", "prompt", chat=False)
CHAT: Final = Endpoint("chat_completions", "/v1/chat/completions", "messages", chat=True)


@dataclass(frozen=True)
class Failure:
    """Why a request cannot be answered: an HTTP status, an OpenAI-shaped body, a metric label."""

    status: int
    body: bytes
    outcome: str
    message: str = ""  # for the log, when made by :meth:`of`

    @classmethod
    def of(
        cls, status: int, message: str, kind: str, outcome: str, code: int | str | None = None
    ) -> Failure:
        code = status if code is None else code
        error = {"message": message, "type": kind, "param": None, "code": code}  # OpenAI's keys
        return cls(status, msgspec.json.encode({"error": error}), outcome, message)

    @classmethod
    def unauthorized(cls, message: str) -> Failure:
        """OpenAI's answer to a missing or wrong API key."""
        return cls.of(401, message, "invalid_request_error", "unauthorized", "invalid_api_key")

    def response(self) -> Response:
        return Response(self.body, status=self.status, content_type="application/json")

    def sse_event(self) -> bytes:
        return b"data: " + self.body + b"\n\n"


def validate(raw: bytes, endpoint: Endpoint) -> dict[str, Any] | Failure:
    """The decoded body, or the 400 that says what is wrong with it."""
    problem = _problem(raw, endpoint)
    if isinstance(problem, str):
        return Failure.of(400, problem, "invalid_request_error", "invalid")
    return problem


def _problem(raw: bytes, endpoint: Endpoint) -> dict[str, Any] | str:
    too_deep = f"the body's JSON nests deeper than {MAX_JSON_DEPTH} levels"
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        return f"the body is not valid JSON: {exc}"
    except RecursionError:  # deeper than the interpreter's stack: far deeper than allowed
        return too_deep
    if not isinstance(body, dict):
        return "the body must be a JSON object"
    # Each nesting level needs a '[' or '{': a body with few of them cannot nest too deep
    # (the common case, checked at C speed); the others are walked.
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _deeper_than(body, MAX_JSON_DEPTH):
        return too_deep
    if not isinstance(body.get("model"), str):
        return "`model` is required (a string)"
    if body.get(endpoint.input_field) is None:
        return f"`{endpoint.input_field}` is required"
    if not isinstance(body.get("stream", False), bool | None):
        return "`stream` must be true or false"
    # vLLM turns each prompt of a list (and each of `n` choices) into an engine request of its
    # own with the request's one kv_transfer_params: they would share one transfer_id, and D
    # takes one pull per transfer. Refused here, by name, rather than failing on D.
    prompts = body.get("prompt")
    if isinstance(prompts, list) and len(prompts) > 1 and not isinstance(prompts[0], int):
        return (
            f"`prompt` holds {len(prompts)} prompts: send one request per prompt through the "
            "PD proxy (each prompt's KV is its own transfer)"
        )
    n = body.get("n")
    if n is not None and n != 1:
        return "`n` must be 1 through the PD proxy (each choice would need its own transfer)"
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (type(value) is not int or value < 1):
            return f"`{key}` must be a positive integer"
    return body


def _deeper_than(value: object, limit: int) -> bool:
    """Whether ``value`` nests dicts and lists deeper than ``limit`` (no recursion)."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        assert isinstance(children, Iterable)
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return False


@dataclass(eq=False)
class Exchange:
    """One client request: where it goes, its transfer id, its deadline, what it holds.

    ``p_scope`` bounds P's leg, :meth:`decode_scope` each part of D's (its head, then its
    body): the first failure of either cancels both.
    """

    endpoint: Endpoint
    stream: bool
    p: Backend
    d: Backend
    transfer_id: str
    arrived: float
    deadline: float
    headers: list[tuple[bytes, bytes]]
    p_headers: list[tuple[bytes, bytes]]  # with ``x-data-parallel-rank`` when P has DP ranks
    p_engine_id: str | None  # the engine id of the DP rank P's request goes to
    p_scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    d_scopes: list[trio.CancelScope] = field(default_factory=list)
    failure: Failure | None = None
    prefill_released: bool = False
    ended: bool = False
    #: When P answered and when D's headers came (trio clock), for the debug timeline.
    p_answered: float | None = None
    d_answered: float | None = None
    first_sent: float | None = None  # when the client's first chunk went out
    #: ``"disaggregated"`` or ``"local"`` (D computes the prompt), and the prompt's tokens
    #: (exact for token ids, else estimated: :mod:`pdactors.actors._placement`).
    placement: str = "disaggregated"
    prompt_tokens: int = 0
    prompt_chars: int = 0  # a text prompt's characters (0 for token ids)
    #: The engine computing the prompt while its first token is awaited (its
    #: ``waiting_tokens`` hold ``prompt_tokens``), when it was asked, and the prompt tokens
    #: waiting on it then (its own included).
    prefilling: Backend | None = None
    prefill_sent: float = 0.0
    tokens_ahead: int = 0
    d_sent: float | None = None  # P-first: when D's request went out
    last_chunk: float | None = None  # when D's latest chunk came

    def fail(self, failure: Failure) -> None:
        if self.failure is None:  # the first failure is the cause; later ones are its echo
            self.failure = failure
        self.p_scope.cancel()
        for scope in self.d_scopes:
            scope.cancel()

    def decode_scope(self) -> trio.CancelScope:
        """A scope for the next part of D's leg: cancelled by a failure, even an earlier one."""
        scope = trio.CancelScope()
        if self.failure is not None:
            scope.cancel()
        self.d_scopes.append(scope)
        return scope


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
        self.started = True
        headers = [
            (b"content-type", content_type),
            (b"x-request-id", tid.encode()),
            *self.headers,
            *extra,
        ]
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def chunk(self, data: bytes, *, more: bool = True) -> None:
        self.complete = not more
        await self._send({"type": "http.response.body", "body": data, "more_body": more})

    async def whole(self, status: int, body: bytes, tid: str = "") -> None:
        # With its length, hypercorn writes the body at once; chunked, the last chunk is a
        # write (and a wake-up of the client) of its own.
        length = (b"content-length", str(len(body)).encode())
        await self.start(status, b"application/json", tid, length)
        await self.chunk(body, more=False)

    async def failure(self, failure: Failure) -> None:
        await self.whole(failure.status, failure.body)


class ClientGone(Exception):
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
    """Quart for every route but the completions, which are served on raw ASGI: Quart's
    request and response machinery cost ~1 ms of CPU per request (bench/proxy_overhead.py)."""

    fast: dict[str, Callable[..., Awaitable[None]]]

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self.fast.get(scope["path"])
            if handler is not None:
                await handler(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None
