"""The OpenAI API as the proxy's clients speak it: its three generating endpoints (completions,
chat, responses), the rules a request body must keep before any engine sees it, and OpenAI's
error shape.

A body is refused (400, naming the field) when it is not a JSON object, nests deeper than
:data:`MAX_JSON_DEPTH`, lacks ``model`` or the endpoint's input, asks for more than
:data:`MAX_CHOICES` choices (prompts times ``n``, each an exchange of its own:
:mod:`pdactors.proxy._fan_out`), for ``n`` > 1 with greedy sampling or ``best_of`` > 1 (vLLM's
server does neither), sets the proxy's own ``kv_transfer_params``, or holds a field the proxy
reads in a shape vLLM's server refuses too (:func:`validate`): the proxy's code then reads only
the shapes it was written for.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

import msgspec
from quart import Response

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "MAX_CHOICES",
    "MAX_JSON_DEPTH",
    "MAX_TOKENS",
    "RESPONSES",
    "Endpoint",
    "Failure",
    "as_chat",
    "validate",
]


#: The deepest a request's JSON may nest (objects and arrays); deeper is refused with 400.
#: OpenAI bodies nest a few levels (tool schemas a few more).
MAX_JSON_DEPTH: Final = 64
#: The largest token count (``max_tokens``, ``min_tokens``) and token id a request may name;
#: above is a 400. vLLM's server refuses them too: no model's context is this long, and its
#: engine holds token ids in 32-bit integers.
MAX_TOKENS: Final = 2**31 - 1
#: The most choices a request may ask for: its prompts times ``n``. The proxy serves each
#: as an exchange of its own (a P and a D request), so this bounds what one body starts;
#: vLLM's server takes up to 1,024 prompts (``VLLM_MAX_COMPLETION_PROMPTS``).
MAX_CHOICES: Final = 1024
#: Below this ``temperature`` vLLM samples greedily, and refuses ``n`` > 1 (its
#: ``_SAMPLING_EPS``).
_GREEDY: Final = 1e-5


@dataclass(frozen=True)
class Endpoint:
    """One generating route: its metric label, path, input field, and whether it is chat."""

    name: str  # metric label
    path: str
    input_field: str
    chat: bool

    @property
    def responses(self) -> bool:
        """The Responses API (``input``, ``max_output_tokens``, its own stream of typed
        events): served in the concurrent flow only, its stream passed as the engine sends
        it (:func:`pdactors.proxy._bodies.applies`)."""
        return self.input_field == "input"


COMPLETIONS: Final = Endpoint("completions", "/v1/completions", "prompt", chat=False)
CHAT: Final = Endpoint("chat_completions", "/v1/chat/completions", "messages", chat=True)
RESPONSES: Final = Endpoint("responses", "/v1/responses", "input", chat=False)


def as_chat(body: dict[str, Any], endpoint: Endpoint) -> tuple[dict[str, Any], bool]:
    """``body`` as the placement and the prefix index read a prompt: a responses body as the
    chat it is templated into (its ``instructions`` first, a text ``input`` a user message,
    a list of input items the messages among them); with whether it now reads as chat."""
    if not endpoint.responses:
        return body, endpoint.chat
    given = body.get("input")
    items = [{"role": "user", "content": given}] if isinstance(given, str) else given or []
    messages = [i for i in items if isinstance(i, dict) and "role" in i]
    if isinstance(body.get("instructions"), str):
        messages.insert(0, {"role": "system", "content": body["instructions"]})
    return {"messages": messages}, True


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
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:
        for key, value in body.items():
            if isinstance(value, dict | list) and _deeper_than(value, MAX_JSON_DEPTH - 1):
                return f"{too_deep} (in `{key}`)"
    if not isinstance(body.get("model"), str):
        return "`model` is required (a string)"
    if body.get(endpoint.input_field) is None:
        return f"`{endpoint.input_field}` is required"
    if endpoint.responses:
        problem = _input_problem(body["input"])
    elif endpoint.chat:
        problem = _messages_problem(body["messages"])
    else:
        problem = _prompt_problem(body["prompt"])
    if problem is None and body.get("kv_transfer_params") is not None:
        problem = "`kv_transfer_params` is the PD proxy's to set: send the request without it"
    if problem is None:
        problem = (
            _responses_problem(body) if endpoint.responses else _fields_problem(body, endpoint.chat)
        )
    return problem or body


#: Fields that are true, false or null.
_FLAGS: Final = ("stream", "echo", "return_token_ids")
#: Counts of tokens, each with the least it may be (and :data:`MAX_TOKENS` the most).
_COUNTS: Final = {"max_tokens": 1, "max_completion_tokens": 1, "min_tokens": 0}


def _is_int(value: object) -> bool:
    return type(value) is int  # not a bool, which JSON's true would be


def _prompt_count(prompt: object) -> int:
    """How many prompts a (validated) completion's ``prompt`` holds: a list of texts or of
    token-id lists holds one each, a text or a list of token ids is one."""
    return len(prompt) if isinstance(prompt, list) and not _is_int(prompt[0]) else 1


def _prompt_problem(prompt: object) -> str | None:
    """What is wrong with a completion's ``prompt``: text or token ids, or a list of texts or
    of token-id lists (as vLLM takes them), at most :data:`MAX_CHOICES`."""
    if isinstance(prompt, str):
        return None
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return _count_problem(len(prompt), 1)
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        problems = (_ids_problem(p) for p in prompt)
        return _count_problem(len(prompt), 1) or next((p for p in problems if p), None)
    return _ids_problem(prompt)


def _count_problem(prompts: int, n: int) -> str | None:
    if prompts * n <= MAX_CHOICES:
        return None
    return (
        f"`prompt` holds {prompts} prompts and `n` is {n}: at most {MAX_CHOICES} choices "
        "(prompts times `n`) through the PD proxy"
    )


def _ids_problem(prompt: object) -> str | None:
    """What is wrong with one prompt of token ids."""
    if not isinstance(prompt, list) or not prompt or not all(_is_int(i) for i in prompt):
        return "`prompt` must be a string or a list of token ids, not empty"
    if not all(0 <= i <= MAX_TOKENS for i in prompt):
        return f"`prompt`'s token ids must be integers from 0 to {MAX_TOKENS}"
    return None


def _messages_problem(messages: object) -> str | None:
    """What is wrong with a chat's ``messages``: a list of objects, each with a string
    ``role`` and a ``content`` that is text, a list of parts or null."""
    if not isinstance(messages, list):
        return "`messages` must be a list of messages"
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return f"`messages` must hold objects with a string `role` (item {i} does not)"
        if not isinstance(message.get("content"), str | list | None):
            return (
                f"`messages`: a `content` must be a string, a list of parts or null (item {i}'s "
                "is not)"
            )
    return None


def _fields_problem(body: dict[str, Any], chat: bool) -> str | None:
    """What is wrong with the other fields the proxy reads."""
    n = 1 if body.get("n") is None else body["n"]
    if not _is_int(n) or not 1 <= n <= MAX_CHOICES:
        return f"`n` must be an integer from 1 to {MAX_CHOICES}"
    if not chat and (problem := _count_problem(_prompt_count(body["prompt"]), n)):
        return problem
    temperature = body.get("temperature")
    greedy = isinstance(temperature, int | float) and 0 <= temperature < _GREEDY
    if n > 1 and greedy and not isinstance(temperature, bool):
        return f"`n` must be 1 when using greedy sampling, got {n} (vLLM's rule)"
    best_of = body.get("best_of")
    if best_of is not None and (not _is_int(best_of) or best_of != 1):
        # vLLM 0.32's server has no best_of (its V1 engine dropped it: the field is ignored).
        return "`best_of` must be 1: neither vLLM's V1 engine nor the PD proxy implements it"
    for key in _FLAGS:
        if not isinstance(body.get(key), bool | None):
            return f"`{key}` must be true or false"
    for key, least in _COUNTS.items():
        value = body.get(key)
        if value is not None and (not _is_int(value) or not least <= value <= MAX_TOKENS):
            return f"`{key}` must be an integer from {least} to {MAX_TOKENS}"
    most = body.get("max_completion_tokens") if chat else None
    most = body.get("max_tokens") if most is None else most
    if most is not None and (body.get("min_tokens") or 0) > most:
        return f"`min_tokens` must be at most `max_tokens` ({most})"
    if problem := _temperature_problem(body):
        return problem
    logprobs = body.get("logprobs")
    if logprobs is not None and not (isinstance(logprobs, bool) if chat else _is_int(logprobs)):
        return f"`logprobs` must be {'true or false' if chat else 'an integer'}"
    return _stream_options_problem(body)


def _input_problem(given: object) -> str | None:
    """What is wrong with a Responses API body's ``input``: text, or a list of input items."""
    if isinstance(given, str) or (
        isinstance(given, list) and given and all(isinstance(i, dict) for i in given)
    ):
        return None
    return "`input` must be a string or a list of input items (objects), not empty"


def _responses_problem(body: dict[str, Any]) -> str | None:
    """What is wrong with a Responses API body's other fields the proxy reads or sets."""
    if body.get("n") is not None and not (_is_int(body["n"]) and body["n"] == 1):
        return "`n` must be 1: a response is one answer"
    for key in ("stream", "background", "store"):
        if not isinstance(body.get(key), bool | None):
            return f"`{key}` must be true or false"
    if body.get("background"):
        # A background response is stored on the engine that made it and polled there by
        # id; through the proxy its prefill and its decode are two engines' requests.
        return "`background` responses are not served through the PD proxy"
    most = body.get("max_output_tokens")
    if most is not None and (not _is_int(most) or not 1 <= most <= MAX_TOKENS):
        return f"`max_output_tokens` must be an integer from 1 to {MAX_TOKENS}"
    return _temperature_problem(body)


def _temperature_problem(body: dict[str, Any]) -> str | None:
    temperature = body.get("temperature")
    if temperature is not None and (
        not isinstance(temperature, int | float) or isinstance(temperature, bool) or temperature < 0
    ):
        return "`temperature` must be a number >= 0"
    return None


def _stream_options_problem(body: dict[str, Any]) -> str | None:
    options = body.get("stream_options")
    if options is None:
        return None
    if not isinstance(options, dict):
        return "`stream_options` must be an object"
    for key in ("include_usage", "continuous_usage_stats"):
        if not isinstance(options.get(key), bool | None):
            return f"`stream_options`: `{key}` must be true or false"
    if options and body.get("stream") is not True:  # as vLLM's server refuses it
        return "`stream_options` can only be given with `stream` true"
    return None


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
