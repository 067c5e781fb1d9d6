"""The OpenAI API as the proxy's clients speak it: its two completion endpoints, the rules a
request body must keep before any engine sees it, and OpenAI's error shape.

A body is refused (400) when it is not a JSON object, nests deeper than
:data:`MAX_JSON_DEPTH`, lacks ``model`` or the endpoint's input, or asks for what one PD
transfer cannot serve (several prompts, ``n`` > 1).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

import msgspec
from quart import Response

__all__ = ["CHAT", "COMPLETIONS", "MAX_JSON_DEPTH", "Endpoint", "Failure", "validate"]


#: The deepest a request's JSON may nest (objects and arrays); deeper is refused with 400.
#: OpenAI bodies nest a few levels (tool schemas a few more).
MAX_JSON_DEPTH: Final = 64


@dataclass(frozen=True)
class Endpoint:
    """One completion route: its metric label, path, input field, and whether it is chat."""

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
    #: Why D's leg may be asked again computing the prompt itself (the metric's reason:
    #: ``decode_failed``, ``decode_broke``), or "" when a second try cannot help.
    retry: str = ""
    #: P-first: why D may serve the request alone after this failure of P's before its first
    #: token (the fallbacks metric's ``why``), when not ``prefill_failed``: ``p_unhealthy``.
    fallback: str = ""

    @classmethod
    def of(
        cls,
        status: int,
        message: str,
        kind: str,
        outcome: str,
        code: int | str | None = None,
        *,
        retry: str = "",
        fallback: str = "",
    ) -> Failure:
        code = status if code is None else code
        error = {"message": message, "type": kind, "param": None, "code": code}  # OpenAI's keys
        body = msgspec.json.encode({"error": error})
        return cls(status, body, outcome, message, retry, fallback)

    def after(self, *earlier: str) -> Failure:
        """This failure as the client is told it: what failed ``earlier`` in the same
        request (P, D's first leg) said before it, in order. An engine's own 4xx body (no
        message of ours) passes as it came."""
        parts = [e for e in earlier if e]
        if not parts or not self.message:
            return self
        message = "; ".join([*parts, self.message])
        return Failure.of(self.status, message, "upstream_error", self.outcome)

    @classmethod
    def unauthorized(cls, message: str) -> Failure:
        """OpenAI's answer to a missing or wrong API key."""
        return cls.of(401, message, "invalid_request_error", "unauthorized", "invalid_api_key")

    def response(self) -> Response:
        """As a Quart answer (the routes Quart serves)."""
        return Response(self.body, status=self.status, content_type="application/json")

    def sse_event(self) -> bytes:
        """As the event that ends a stream already begun."""
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
