"""Malformed bodies, as a new user's client sends them, at the proxy with its shipped defaults
(``open_setup``'s) in front of the stand-in engines of tests/test_proxy.py (issue 42, item 4).

Hypothesis builds a valid completion or chat body, then breaks it: wrong types and values for
each OpenAI field the proxy reads, random extra fields, and at the byte level what no JSON
encoder writes (``NaN``, ``Infinity``, numbers past any float, invalid UTF-8, lone surrogates,
duplicate keys, a non-object or truncated document, deep nesting). Each body goes to
``/v1/completions`` or ``/v1/chat/completions`` under each placement (the request's header), or
as it is to a forwarded route (``/tokenize``). What must hold:

* no 5xx, no stream cut short, and no bug of the proxy's logged (one after the answer was
  sent reaches no client): the stand-ins answer 200 to whatever reaches them, so a body the
  proxy lets through that vLLM would refuse is the engine's to answer, but the proxy's own
  code must read it;
* every 4xx in OpenAI's error shape, its message naming a field that was broken (or the
  JSON document, when that was);
* afterwards a good request is served and nothing is left counted: the in-flight gauge and
  each engine's outstanding requests, waiting tokens and prefills back at 0.

A sans-IO twin (:func:`test_every_accepted_body_is_read_by_the_proxys_own_code`) hands each
body :func:`~pdactors.proxy._openai.validate` accepts to the code that reads it, faster than
HTTP allows, so it runs many more. ``pytest --hypothesis-profile=fuzz-deep`` (tests/conftest.py)
runs both for thousands of examples.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Final

import httpx
import msgspec
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdactors.core.placement import prompt_size
from pdactors.core.prefixes import prefix_keys
from pdactors.proxy import _bodies
from pdactors.proxy._openai import CHAT, COMPLETIONS, Endpoint, validate
from pdactors.proxy._stream import ClientStream
from pdactors.wire import KVTransferParams
from tests.test_proxy import Setup, chat_body, completion_body, open_setup
from tests.test_proxy_routes import VllmRoutes

#: Examples per route over HTTP (kept under a minute in all), and for the sans-IO twin; a
#: profile with more (``--hypothesis-profile=fuzz-deep``) raises both.
HTTP_EXAMPLES: Final = max(600, settings().max_examples)
PURE_EXAMPLES: Final = max(1500, settings().max_examples)
#: What a 4xx for a broken document (not a broken field) says.
DOCUMENT_WORDS: Final = ("JSON", "body")
#: The request's placement header: most go to P and D (the P-first flow remakes the body
#: for each), none leaves it to the shipped ``auto``.
PLACEMENTS: Final = (None, "auto", "local", "whole-on-p", *["disaggregate"] * 4)
#: Hypothesis' settings for examples that each cost a request or a big body.
UNHURRIED: Final[dict[str, Any]] = {
    "deadline": None,
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}

# --------------------------------------------------------------------------- values

HUGE: Final = 10**30
_text = st.text(max_size=12)  # any unicode but lone surrogates (those go in as raw bytes)
_anything = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=8,
)
#: Numbers and their look-alikes: each count field gets these.
_numbers = st.sampled_from(
    [0, 1, 2, 3, -1, HUGE, -HUGE, 2**63, 2**64, 1.0, 1.5, 0.0, -0.5, 1e308, "5", "", True,
     False, None, [], [1], {}, {"value": 1}]
) | st.integers()  # fmt: skip
#: Booleans and their look-alikes.
_flags: st.SearchStrategy[Any] = st.sampled_from(
    [True, False, None, 0, 1, "true", "false", "", [], {}, 1.0]
)
_ids = st.lists(st.integers(), max_size=5)
_prompts = st.one_of(
    st.text(max_size=40),
    st.lists(st.text(max_size=8), max_size=3),
    _ids,
    st.lists(_ids, max_size=3),
    st.sampled_from([[], [[]], [""], [[], []], [-1], [HUGE], [1, "a"], [[1], "a"], [["a"]],
                     [{}], [None], [True], [1.5], {}, {"text": "hi"}, 0, True, ""]),
    st.integers(1, 80).map(lambda n: _nest(n, 7)),
    _anything,
)  # fmt: skip
_contents = st.one_of(
    st.text(max_size=12),
    st.none(),
    st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", 5])},
                              optional={"text": _anything}) | _anything,
        max_size=3,
    ),
    _anything,
)  # fmt: skip
_messages_item = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool", ""]) | _anything},
        optional={"content": _contents, "name": _anything, "tool_calls": _anything},
    ),
    _anything,
)
_messages = st.one_of(
    st.lists(_messages_item, max_size=3),
    st.sampled_from([[], "hi", {"role": "user", "content": "hi"}, [[]], [None], 5]),
    st.integers(1, 80).map(lambda n: _nest(n, {"role": "user", "content": "hi"})),
    _anything,
)
_stream_options = st.one_of(
    st.sampled_from([None, {}, "x", [], True, 1]),
    st.fixed_dictionaries({}, optional={"include_usage": _flags, "continuous_usage_stats": _flags}),
    _anything,
)
#: The fields the proxy reads, each with what a client might wrongly send.
FIELDS: Final[dict[str, st.SearchStrategy[Any]]] = {
    "model": st.one_of(_text, _anything),
    "prompt": _prompts,
    "messages": _messages,
    "max_tokens": _numbers,
    "max_completion_tokens": _numbers,
    "min_tokens": _numbers,
    "n": _numbers,
    "best_of": _numbers,
    "temperature": _numbers,
    "logprobs": _numbers | _flags,
    "top_logprobs": _numbers,
    "prompt_logprobs": _numbers,
    "stream": _flags,
    "echo": _flags,
    "return_token_ids": _flags,
    "stream_options": _stream_options,
    "suffix": _anything,
    "kv_transfer_params": _anything,
}


def _nest(depth: int, inner: Any) -> Any:
    for _ in range(depth):
        inner = [inner]
    return inner


# --------------------------------------------------------------------------- bodies


@st.composite
def broken_bodies(draw: st.DrawFn, chat: bool) -> tuple[dict[str, Any], set[str]]:
    """A valid body of the endpoint with a few fields broken and maybe random ones added;
    and the names of the fields changed (a 400 must name one of them)."""
    body = chat_body() if chat else completion_body()
    valid = {"stream": st.booleans(), "max_tokens": st.integers(1, 8)}
    body.update(draw(st.fixed_dictionaries({}, optional=valid)))
    names = draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=3, unique=True))
    broken = {name: draw(FIELDS[name]) for name in names}
    extra = draw(st.dictionaries(st.text(min_size=1, max_size=10), _anything, max_size=2))
    dropped = draw(st.sampled_from([None, None, None, "model", CHAT.input_field if chat else
                                    COMPLETIONS.input_field]))  # fmt: skip
    body = {**body, **broken, **extra}
    if dropped is not None:
        body.pop(dropped, None)
    return body, {*broken, *extra, *([dropped] if dropped else [])}


#: Byte-level breakage: each takes the encoded body and gives what a hand-rolled client sends.
_RAW: Final[dict[str, Callable[[bytes, str], bytes]]] = {
    "nan": lambda raw, key: raw[:-1] + f',"{key}":NaN}}'.encode(),
    "infinity": lambda raw, key: raw[:-1] + f',"{key}":-Infinity}}'.encode(),
    "out of float range": lambda raw, key: raw[:-1] + f',"{key}":1e400}}'.encode(),
    "5000 digits": lambda raw, key: raw[:-1] + f',"{key}":{"9" * 5000}}}'.encode(),
    "invalid UTF-8": lambda raw, key: raw[:-1] + f',"{key}":"a'.encode() + b'\xff\xfe"}',
    "lone surrogate": lambda raw, key: raw[:-1] + f',"{key}":"\\ud800"}}'.encode(),
    "duplicate key, broken last": lambda raw, key: raw[:-1] + f',"{key}":{{"x":[]}}}}'.encode(),
    "duplicate key, broken first": lambda raw, key: f'{{"{key}":[[]],'.encode() + raw[1:],
    "byte order mark": lambda raw, key: b"\xef\xbb\xbf" + raw,
    "truncated": lambda raw, key: raw[: len(raw) // 2],
    "trailing garbage": lambda raw, key: raw + b" {}",
    "empty": lambda raw, key: b"",
    "deep": lambda raw, key: raw[:-1] + f',"{key}":'.encode() + b"[" * 100 + b"]" * 100 + b"}",
}


@st.composite
def raw_bodies(draw: st.DrawFn, chat: bool) -> tuple[bytes, set[str]]:
    """A body's bytes: a broken body encoded, a non-object document, or a body broken at the
    byte level; and the names a 400 may give (the fields changed, or the document's words)."""
    kind = draw(st.sampled_from(["field"] * 6 + ["document", "bytes"]))
    if kind == "document":
        value = draw(_anything.filter(lambda v: not isinstance(v, dict)))
        return msgspec.json.encode(value), set(DOCUMENT_WORDS)
    body, culprits = draw(broken_bodies(chat))
    raw = msgspec.json.encode(body)
    if kind == "field":
        return raw, culprits
    how = draw(st.sampled_from(sorted(_RAW)))
    key = draw(st.sampled_from(sorted(FIELDS)))
    return _RAW[how](raw, key), {*culprits, key, *DOCUMENT_WORDS}


# --------------------------------------------------------------------------- over HTTP


def _names_a_culprit(message: str, culprits: set[str]) -> bool:
    return any(f"`{name}`" in message or (name in DOCUMENT_WORDS and name in message)
               for name in culprits)  # fmt: skip


def _check_refusal(resp: httpx.Response, culprits: set[str], what: object) -> None:
    """A 4xx in OpenAI's shape, naming one of ``culprits``."""
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, (what, resp.text)
    assert error["type"] == "invalid_request_error" and error["code"] == resp.status_code
    assert _names_a_culprit(error["message"], culprits), (what, error["message"], culprits)


def _fuzz_completions(url: str, endpoint: Endpoint, seen: list[int]) -> None:
    """Hypothesis' broken bodies at ``endpoint`` (from this worker thread), each under a
    placement of its own (the request's header; none: the shipped ``auto``)."""
    with httpx.Client(base_url=url, trust_env=False, timeout=10) as http:

        @settings(max_examples=HTTP_EXAMPLES, **UNHURRIED)
        @given(
            sent=raw_bodies(endpoint.chat),
            placement=st.sampled_from(PLACEMENTS),
        )
        def throw(sent: tuple[bytes, set[str]], placement: str | None) -> None:
            raw, culprits = sent
            headers = {"content-type": "application/json"}
            if placement is not None:
                headers["x-pdactors-placement"] = placement
            resp = http.post(endpoint.path, content=raw, headers=headers)
            seen.append(resp.status_code)
            what = (raw[:400], placement)
            assert resp.status_code < 500, (what, resp.text[:400])
            if resp.status_code >= 400:
                _check_refusal(resp, culprits, what)

        throw()


def _fuzz_forwarded(url: str, routes: VllmRoutes) -> None:
    """The same bodies at ``/tokenize``: they reach an engine byte for byte, its answer back."""
    with httpx.Client(base_url=url, trust_env=False, timeout=10) as http:

        @settings(max_examples=HTTP_EXAMPLES // 3, **UNHURRIED)
        @given(sent=raw_bodies(chat=False))
        def throw(sent: tuple[bytes, set[str]]) -> None:
            raw, _ = sent
            resp = http.post("/tokenize", content=raw, headers={"content-type": "text/x-any"})
            assert resp.status_code == 200, (raw[:400], resp.text[:400])
            assert routes.seen[-1].body == raw

        throw()


async def _nothing_left(s: Setup) -> None:
    """Every request ended and was counted out: the in-flight gauge, and each engine's counts
    on /health (P's leg may end a moment after its request: waited for, up to 5 s)."""
    counts = ("outstanding", "waiting_tokens", "prefills", "incoming")
    held: dict[str, int] = {}
    with trio.move_on_after(5):
        while True:
            _, report = await s.health()
            held = {
                f"{e['url']} {k}": e[k]
                for e in (*report["prefill"], *report["decode"])
                for k in counts
                if e.get(k, 0) != 0
            }
            held["in flight"] = int((await s.metrics())["pdactors_proxy_requests_in_flight", ()])
            if held == {"in flight": 0}:
                return
            await trio.sleep(0.02)
    assert held == {"in flight": 0}


@pytest.mark.timeout(120 + HTTP_EXAMPLES // 10)
async def test_malformed_bodies_are_refused_by_name_and_hurt_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Broken bodies at both completion routes and a forwarded one, through the shipped
    defaults: no 5xx, no bug logged, every 4xx OpenAI's and naming what is wrong, then a
    good request served and nothing left counted."""
    caplog.set_level(logging.WARNING, "pdactors.proxy")
    routes = VllmRoutes()
    async with open_setup(routes=routes) as s:
        for endpoint in (COMPLETIONS, CHAT):
            seen: list[int] = []
            await trio.to_thread.run_sync(_fuzz_completions, s.url, endpoint, seen)
            assert 200 in seen and 400 in seen  # some reached the engines, some were refused
        assert s.p[0].received and s.d[0].received  # P-first: P's leg, then D's
        await trio.to_thread.run_sync(_fuzz_forwarded, s.url, routes)
        bugs = [r.getMessage() for r in caplog.records if "internal error" in r.getMessage()]
        assert bugs == []
        for good in (completion_body(), chat_body(stream=True)):
            path = (CHAT if "messages" in good else COMPLETIONS).path
            resp = await s.client.post(path, json=good)
            assert resp.status_code == 200 and "error" not in resp.text, resp.text
            assert "says hi" in resp.text or "data: [DONE]" in resp.text, resp.text
        await _nothing_left(s)


#: Bodies the fuzz found (issue 42, item 4), each with the field its 400 names: before, the
#: first two were a 500 (the P-first flow's D body: ``min_tokens - 1``; the placer's prompt
#: size: ``for message in 5``), the third cut a stream after its 200 (P's token as the whole
#: answer: ``"x".get("include_usage")``), the rest reached the engines as if valid.
FOUND: Final[list[tuple[Endpoint, dict[str, Any], str]]] = [
    (COMPLETIONS, completion_body(min_tokens="3"), "min_tokens"),
    (COMPLETIONS, completion_body(min_tokens=[1]), "min_tokens"),
    (CHAT, chat_body(messages=5), "messages"),
    (COMPLETIONS, completion_body(max_tokens=1, stream=True, stream_options="x"), "stream_options"),
    (CHAT, chat_body(messages=[{"role": "user", "content": 5}]), "messages"),
    (COMPLETIONS, completion_body(n=True), "n"),
    (COMPLETIONS, completion_body(best_of=3), "best_of"),
    (COMPLETIONS, completion_body(prompt=[]), "prompt"),
    (COMPLETIONS, completion_body(prompt=[[]]), "prompt"),
    (COMPLETIONS, completion_body(prompt=[1, "a"]), "prompt"),
    (COMPLETIONS, completion_body(prompt=[-1]), "prompt"),
    (COMPLETIONS, completion_body(max_tokens=HUGE), "max_tokens"),
    (COMPLETIONS, completion_body(min_tokens=9), "min_tokens"),  # above max_tokens (5)
    (COMPLETIONS, completion_body(echo="yes"), "echo"),
    (COMPLETIONS, completion_body(temperature="0.5"), "temperature"),
    (CHAT, chat_body(logprobs=5), "logprobs"),
    (COMPLETIONS, completion_body(stream_options={"include_usage": True}), "stream_options"),
    (COMPLETIONS, completion_body(kv_transfer_params={"do_remote_prefill": True,
                                                      "remote_bootstrap_addr": "evil:1"}),
     "kv_transfer_params"),
]  # fmt: skip
#: Bodies at the edges of the same rules, which vLLM's server takes: they stay valid.
KEPT: Final[list[tuple[Endpoint, dict[str, Any]]]] = [
    (COMPLETIONS, completion_body(prompt="")),
    (COMPLETIONS, completion_body(prompt=[""])),
    (COMPLETIONS, completion_body(prompt=[0, 2**31 - 1])),
    (COMPLETIONS, completion_body(prompt=[[5]], n=1, best_of=1, min_tokens=0, echo=False)),
    (COMPLETIONS, completion_body(max_tokens=2**31 - 1, min_tokens=5, logprobs=0)),
    (COMPLETIONS, completion_body(stream=True, stream_options={"include_usage": True})),
    (COMPLETIONS, completion_body(stream_options={}, temperature=1.5, kv_transfer_params=None)),
    (CHAT, chat_body(messages=[])),
    (CHAT, chat_body(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                               {"role": "assistant", "content": None, "tool_calls": []}])),
    (CHAT, chat_body(logprobs=True, top_logprobs=2, max_completion_tokens=3, min_tokens=3)),
]  # fmt: skip


@pytest.mark.parametrize(("endpoint", "body", "field"), FOUND)
def test_what_the_fuzz_found_is_refused_by_name(
    endpoint: Endpoint, body: dict[str, Any], field: str
) -> None:
    answer = validate(msgspec.json.encode(body), endpoint)
    assert not isinstance(answer, dict)
    assert answer.status == 400 and f"`{field}`" in answer.message, answer.message


@pytest.mark.parametrize(("endpoint", "body"), KEPT)
def test_bodies_vllm_takes_stay_valid(endpoint: Endpoint, body: dict[str, Any]) -> None:
    assert validate(msgspec.json.encode(body), endpoint) == body


async def test_what_the_fuzz_found_reaches_no_engine() -> None:
    """Over HTTP, disaggregated (where the bodies crashed the proxy): 400s, no engine asked."""
    async with open_setup() as s:
        for endpoint, body, field in FOUND:
            headers = {"x-pdactors-placement": "disaggregate"}
            resp = await s.client.post(endpoint.path, json=body, headers=headers)
            assert resp.status_code == 400, (body, resp.text)
            _check_refusal(resp, {field}, body)
        assert s.p[0].received == s.d[0].received == []


# --------------------------------------------------------------------------- sans IO


def _first(chat: bool) -> _bodies.First:
    """P's answer as the stand-ins give it (P-first: its token ids asked for)."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "token_ids": [7],
                              "logprobs": None}  # fmt: skip
    if chat:
        choice["message"] = {"role": "assistant", "content": "p"}
    else:
        choice["text"] = "p"
    answer = {"id": "x", "created": 1, "model": "tiny", "choices": [choice],
              "prompt_token_ids": [1, 2, 3]}  # fmt: skip
    first = _bodies.read_first(msgspec.json.encode(answer), chat)
    assert isinstance(first, _bodies.First)
    return first


_D_ANSWER: Final = {"choices": [{"index": 0, "text": " d", "token_ids": [8], "finish_reason":
                                 "length"}], "usage": {"completion_tokens": 1}}  # fmt: skip
_D_EVENTS: Final = (
    b'data: {"id":"x","choices":[{"index":0,"text":" d","token_ids":[8],'
    b'"prompt_token_ids":[1,2,3]}]}\n\n'
    b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n'
    b"data: [DONE]\n\n"
)


def _read_by_the_proxy(body: dict[str, Any], chat: bool) -> None:
    """Every reading of an accepted body on the proxy's paths: the placer's and the prefix
    index's, each flow's engine bodies, P's token as the client's answer, the stream."""
    prompt_size(body, chat)
    prefix_keys(body, chat)
    p = KVTransferParams(do_remote_decode=True, transfer_id="t")
    d = KVTransferParams(do_remote_prefill=True, transfer_id="t")
    _bodies.concurrent_bodies(body, chat, p, d)
    _bodies.applies(body, chat)
    msgspec.json.encode(_bodies.prefill_body(body, chat, "t"))
    first = _first(chat)
    _bodies.ends_at_p(first, body, chat)
    for params in (d, None):
        msgspec.json.encode(_bodies.decode_body(body, chat, first, params))
    msgspec.json.encode(_bodies.ended_at_p(first, body))
    _bodies.merge_whole(first, _D_ANSWER, body, chat)
    for last in (True, False):
        _bodies.first_event(first, body, chat, last=last)
    for stream in (ClientStream(body, chat), ClientStream(body, chat, first)):
        msgspec.json.encode(stream.native_body(body))
        stream.feed(_D_EVENTS)
        leg = stream.next_leg()
        if leg is not None:
            msgspec.json.encode(leg[0])


@settings(max_examples=PURE_EXAMPLES, **UNHURRIED)
@given(chat=st.booleans(), data=st.data())
def test_every_accepted_body_is_read_by_the_proxys_own_code(
    chat: bool, data: st.DataObject
) -> None:
    """What :func:`validate` accepts, the proxy's code reads without an exception; what it
    refuses is a 400 naming a field that was broken."""
    endpoint = CHAT if chat else COMPLETIONS
    raw, culprits = data.draw(raw_bodies(chat))
    body = validate(raw, endpoint)
    if isinstance(body, dict):
        _read_by_the_proxy(body, chat)
        return
    assert body.status == 400
    error = msgspec.json.decode(body.body)["error"]
    assert _names_a_culprit(error["message"], culprits), (raw[:300], error, culprits)


def test_each_byte_level_breakage_is_a_400() -> None:
    """Each of the generator's byte-level breakages of a valid body is refused, but a broken
    value followed by a good one under the same key: the last counts (as in Python's and
    pydantic's parsers, vLLM's)."""
    raw = msgspec.json.encode(completion_body())
    for how, breakage in _RAW.items():
        answer = validate(breakage(raw, "max_tokens"), COMPLETIONS)
        if how == "duplicate key, broken first":
            assert isinstance(answer, dict) and answer["max_tokens"] == 5
        else:
            assert not isinstance(answer, dict) and answer.status == 400, how
