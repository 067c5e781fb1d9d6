"""A request whose decoding engine fails mid-answer goes on on another engine (issue 41).

The proxy runs its shipped defaults in front of counting engines: small real HTTP servers that
answer like vLLM (SSE events with the token ids vLLM returns under ``return_token_ids``, a
chat's role event first, ``usage``), whose greedy "model" is arithmetic: after a prompt whose
last id is ``k`` it generates ``k+1, k+2, …``, each token's text ``" t<id>"``. So a
continuation of the prompt and the tokens already sent is the same text a single engine
would have given, and a token repeated or skipped shows. An engine *dies* mid-stream (its
server stops: the connection breaks, later connections are refused) or sends vLLM's error
event; the client must see one stream, equal to a single engine's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import pytest
import trio
import trio.lowlevel
from quart import Response, request
from quart_trio import QuartTrio

from pdactors import PrefillBackend, ProxyConfig, serve_proxy
from pdactors.proxy._bodies import First
from pdactors.proxy._stream import ClientStream
from tests.test_proxy import Setup, eventually, serve_app

TIMEOUT = 10.0
PROMPT = [1, 2, 3]  # a text prompt's ids, as the counting engines tokenize any text


def tokens_after(prompt: list[int], n: int) -> list[int]:
    return [prompt[-1] + 1 + i for i in range(n)]


def text_of(ids: list[int]) -> str:
    return "".join(f" t{t}" for t in ids)


@dataclass(eq=False)
class Counting:
    """A counting engine; ``die_after``: its stream breaks (and the engine stops) after that
    many tokens; ``error_after``: vLLM's error event after that many instead."""

    name: str
    url: str = ""
    die_after: int | None = None
    error_after: int | None = None
    models_status: int = 200  # GET /v1/models answers this
    #: Stops (as SIGSTOP would) after this many tokens of its next stream: the stream waits,
    #: and so does its ``/health``, until the test ends.
    stop_after: int | None = None
    stopped: bool = False
    #: Its ``/health`` answers nothing from its next stream's token of this index on, while
    #: its streams flow on (a late answer on a slow, lossy network); ``token_pause``: seconds
    #: between its tokens.
    late_health_after: int | None = None
    health_late: bool = False
    token_pause: float = 0.0
    #: Its streams wait for ``resume`` before the token of this index (a slow engine).
    hold_at: int | None = None
    resume: trio.Event = field(default_factory=trio.Event)
    #: Seconds its streams wait before their first token (a slower engine); ``first_pauses``:
    #: those of its next streams, one each, before ``first_pause`` again.
    first_pause: float = 0.0
    first_pauses: list[float] = field(default_factory=list)
    held: int = 0  # streams waiting for ``resume`` now
    received: list[dict[str, Any]] = field(default_factory=list)
    #: Transfers the proxy told it to free the KV of (``release_transfer_ids``); those
    #: requests are not in ``received``.
    released: list[str] = field(default_factory=list)
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)


def _event(body: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


def counting_app(engine: Counting) -> QuartTrio:
    app = QuartTrio(f"counting-{engine.name}", static_folder=None)

    async def complete(chat: bool) -> Response:
        body = await request.get_json()
        release = (body.get("kv_transfer_params") or {}).get("release_transfer_ids")
        if release:  # the proxy's word to P, whose connector frees that KV
            engine.released += release
        else:
            engine.received.append(body)
        prompt = body["prompt"] if isinstance(body.get("prompt"), list) else PROMPT
        n = body.get("max_completion_tokens") or body["max_tokens"]
        ids = tokens_after(prompt, n)
        asked = bool(body.get("return_token_ids"))
        head = {"id": f"cmpl-{engine.name}", "created": 1, "model": body["model"]}
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n,
                 "total_tokens": len(prompt) + n}  # fmt: skip
        if not body.get("stream"):
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
            if chat:
                choice["message"] = {"role": "assistant", "content": text_of(ids)}
            else:
                choice["text"] = text_of(ids)
            out = {**head, "object": "chat.completion" if chat else "text_completion",
                   "choices": [choice], "usage": usage}  # fmt: skip
            if asked:
                choice["token_ids"] = ids
                (out if chat else choice)["prompt_token_ids"] = prompt
            if engine.die_after is not None:
                engine.scope.cancel()  # dies before answering
                await trio.sleep_forever()
            return Response(msgspec.json.encode(out), content_type="application/json")
        return Response(stream(chat, body, prompt, ids, asked, head, usage),
                        content_type="text/event-stream")  # fmt: skip

    async def stream(
        chat: bool, body: dict[str, Any], prompt: list[int], ids: list[int], asked: bool,
        head: dict[str, Any], usage: dict[str, int],
    ) -> AsyncIterator[bytes]:  # fmt: skip
        kind = "chat.completion.chunk" if chat else "text_completion"
        await trio.sleep(engine.first_pauses.pop(0) if engine.first_pauses else engine.first_pause)
        if chat:
            role = {"index": 0, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}  # fmt: skip
            yield _event({**head, "object": kind, "choices": [role],
                          "prompt_token_ids": prompt if asked else None})  # fmt: skip
        for i, t in enumerate(ids):
            if engine.die_after == i:
                engine.scope.cancel()  # the whole server goes: this connection breaks
                await trio.sleep_forever()
            if engine.hold_at == i and not engine.resume.is_set():
                engine.held += 1
                try:
                    await engine.resume.wait()
                finally:
                    engine.held -= 1
            if engine.stop_after == i:
                engine.stopped = True
                await trio.sleep_forever()
            engine.health_late = engine.health_late or engine.late_health_after == i
            await trio.sleep(engine.token_pause)
            if engine.error_after == i:
                error = {"error": {"message": "Internal server error", "code": 500}}
                yield _event(error)
                yield b"data: [DONE]\n\n"
                return
            finish = "length" if i == len(ids) - 1 else None
            token_ids = [t] if asked else None
            if chat:
                choice = {"index": 0, "delta": {"content": f" t{t}"}, "logprobs": None,
                          "finish_reason": finish, "token_ids": token_ids}  # fmt: skip
            else:
                first = asked and i == 0 and not chat
                choice = {"index": 0, "text": f" t{t}", "logprobs": None,
                          "finish_reason": finish, "stop_reason": None,
                          "prompt_token_ids": prompt if first else None,
                          "token_ids": token_ids}  # fmt: skip
            yield _event({**head, "object": kind, "choices": [choice]})
            await trio.lowlevel.checkpoint()
        if (body.get("stream_options") or {}).get("include_usage"):
            yield _event({**head, "object": kind, "choices": [], "usage": usage})
        yield b"data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await complete(chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await complete(chat=True)

    @app.get("/v1/models")
    async def models() -> Response:
        return Response(b'{"object":"list","data":[{"id":"tiny"}]}', engine.models_status)

    @app.get("/health")
    async def health() -> Response:
        if engine.stopped or engine.health_late:
            await trio.sleep_forever()
        return Response(b"", status=200)

    @app.get("/query")
    async def query() -> Response:
        entry = {"engine_id": f"engine-{engine.name}", "worker_addr": {"0": {"0": "tcp://x:1"}}}
        return Response(msgspec.json.encode({"0": entry}), content_type="application/json")

    return app


async def serve_counting(engine: Counting, *, task_status: trio.TaskStatus[str]) -> None:
    def bound(url: str) -> None:
        engine.url = url

    app = counting_app(engine)
    await serve_app(app, engine.scope, bound=bound, task_status=task_status)


@asynccontextmanager
async def open_counting(
    n_p: int = 1,
    n_d: int = 1,
    *,
    n_both: int = 0,
    models: int = 200,
    first_pause: tuple[float | list[float], ...] = (),
    **config: Any,
) -> AsyncIterator[Setup]:
    """Counting engines (``models``: what their ``GET /v1/models`` answers; ``n_both``: of
    every role, in :attr:`Setup.both`; ``first_pause``: each engine's
    :attr:`Counting.first_pause`, or its ``first_pauses`` when a list, P's, D's then the
    others', from the start) behind a proxy
    with its shipped defaults (but ``config``; calibration off unless asked: its probes would
    be among the requests the tests check the engines got, tests/test_calibration.py runs
    it)."""
    config.setdefault("calibrate", False)
    p = [Counting(f"p{i}", models_status=models) for i in range(n_p)]
    d = [Counting(f"d{i}", models_status=models) for i in range(n_d)]
    both = [Counting(f"e{i}", models_status=models) for i in range(n_both)]
    for engine, pause in zip(p + d + both, first_pause, strict=False):
        if isinstance(pause, list):
            engine.first_pauses = list(pause)
        else:
            engine.first_pause = pause
    async with trio.open_nursery() as nursery:
        for engine in p + d + both:
            await nursery.start(serve_counting, engine)
        proxy_config = ProxyConfig(
            prefill=tuple(PrefillBackend(e.url, e.url) for e in p),
            decode=tuple(e.url for e in d),
            engines=tuple(PrefillBackend(e.url, e.url) for e in both),
            health_interval=0.05,
            **config,
        )
        url = await nursery.start(serve_proxy, proxy_config)
        async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=TIMEOUT) as client:
            setup = Setup(p, d, url, client, both)  # type: ignore[arg-type]  # counting engines
            with trio.fail_after(5):  # every engine in rotation (calibrated, when asked)
                while not all(e["up"] for e in await _engines(client)):
                    await trio.sleep(0.02)
            yield setup
        nursery.cancel_scope.cancel()


async def _engines(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    """The proxy's engines as its ``GET /health`` lists them (none before it answers 200)."""
    resp = await client.get("/health")
    if resp.status_code != 200:
        return [{"up": False}]
    report = resp.json()
    return report["prefill"] + report["decode"]  # type: ignore[no-any-return]


def events(text: str) -> list[Any]:
    return [
        msgspec.json.decode(line.removeprefix("data: "))
        for line in text.split("\n\n")
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def streamed_text(resp: httpx.Response, chat: bool) -> str:
    out = ""
    for e in events(resp.text):
        assert "error" not in e, e
        for c in e["choices"]:
            out += (c["delta"].get("content") or "") if chat else c["text"]
    return out


def body_for(chat: bool, **extra: Any) -> dict[str, Any]:
    if chat:
        messages = [{"role": "user", "content": "hello"}]
        return {"model": "tiny", "messages": messages, "max_tokens": 6, **extra}
    return {"model": "tiny", "prompt": "hello", "max_tokens": 6, **extra}


ROUTES = {False: "/v1/completions", True: "/v1/chat/completions"}
SINGLE = text_of(tokens_after(PROMPT, 6))  # what one engine alone answers


async def migrations(s: Setup) -> dict[str, float]:
    m = await s.metrics()
    return {dict(k[1])["to"]: v for k, v in m.items() if k[0] == "pdactors_proxy_migrations_total"}


async def settled(s: Setup) -> None:
    """Every request's counts were given back: none in flight, no engine holding one."""
    m = await s.metrics()
    assert m[("pdactors_proxy_requests_in_flight", ())] == 0
    _, report = await s.health()
    for engine in report["prefill"] + report["decode"]:
        held = {k: engine.get(k, 0) for k in ("outstanding", "waiting_tokens", "prefills")}
        assert held == {"outstanding": 0, "waiting_tokens": 0, "prefills": 0}, engine
        assert engine.get("incoming", 0) == 0, engine


# --------------------------------------------------------------------------- through the proxy


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
@pytest.mark.parametrize("placement", ["disaggregate", "local"])
async def test_d_dying_mid_stream_hands_the_stream_to_p(chat: bool, placement: str) -> None:
    with trio.fail_after(TIMEOUT):
        async with open_counting() as s:
            s.d[0].die_after = 2  # D sends two of its tokens, then its server goes
            headers = {"x-pdactors-placement": placement}
            body = body_for(chat, stream=True, stream_options={"include_usage": True})
            resp = await s.client.post(ROUTES[chat], json=body, headers=headers)
            assert resp.status_code == 200
            assert streamed_text(resp, chat) == SINGLE  # no token repeated or skipped
            assert resp.text.count("data: [DONE]") == 1
            evs = events(resp.text)
            finish = [c["finish_reason"] for e in evs for c in e["choices"] if c["finish_reason"]]
            assert finish == ["length"]
            assert evs[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 6,
                                        "total_tokens": 9}  # fmt: skip
            assert all(e["choices"] == [] or "token_ids" not in e["choices"][0]
                       or e["choices"][0]["token_ids"] is None for e in evs)  # fmt: skip
            # P continued after what the client had: the prompt and every token so far.
            continued = s.p[0].received[-1]
            got = 3 if placement == "disaggregate" else 2  # P-first: P's token, then D's two
            assert continued["prompt"] == PROMPT + tokens_after(PROMPT, got)
            assert continued["max_tokens"] == 6 - got and "kv_transfer_params" not in continued
            assert await migrations(s) == {"prefill": 1.0}
            # P-first: P kept the prompt's KV for D, which D may not have pulled: P frees it
            if placement == "disaggregate":
                tid = s.p[0].received[0]["kv_transfer_params"]["transfer_id"]
                await eventually(lambda: s.p[0].released == [tid])
            else:
                assert s.p[0].released == []
            await settled(s)


async def test_d_dying_hands_the_stream_to_the_other_d_first() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_counting(n_d=2) as s:
            body = body_for(False, stream=True)
            headers = {"x-pdactors-placement": "local"}
            first = await s.client.post(ROUTES[False], json=body, headers=headers)
            dying = next(d for d in s.d if not d.received)  # round robin: the next D
            dying.die_after = 1
            resp = await s.client.post(ROUTES[False], json=body, headers=headers)
            assert streamed_text(first, False) == streamed_text(resp, False) == SINGLE
            other = next(d for d in s.d if d is not dying)
            assert other.received[-1]["prompt"] == PROMPT + tokens_after(PROMPT, 1)
            assert not s.p[0].received
            assert await migrations(s) == {"decode": 1.0}
            await settled(s)


@pytest.mark.parametrize("placement", ["disaggregate", "local"])
async def test_a_stopped_d_is_judged_failed_and_its_stream_goes_on_on_p(placement: str) -> None:
    """D stops mid-stream (no byte, no broken connection): its health verdict cuts the
    stream from it, and P continues it (not the request timeout)."""
    with trio.fail_after(TIMEOUT):
        async with open_counting(health_timeout=0.5) as s:  # (P must answer within it)
            s.d[0].stop_after = 2
            headers = {"x-pdactors-placement": placement}
            body = body_for(False, stream=True)
            resp = await s.client.post(ROUTES[False], json=body, headers=headers)
            assert streamed_text(resp, False) == SINGLE
            assert await migrations(s) == {"prefill": 1.0}
            _, report = await s.health()
            assert not report["decode"][0]["up"]
            await settled(s)


async def test_a_d_whose_health_answer_is_late_while_its_stream_flows_keeps_the_stream() -> None:
    """D's ``/health`` answers nothing for several health timeouts while its stream brings
    a token every 0.15 s (what a slow, lossy link does to one connection): D is alive, and
    its stream is not cut from it."""
    with trio.fail_after(TIMEOUT):
        async with open_counting(health_timeout=0.3) as s:
            d = s.d[0]
            d.late_health_after, d.token_pause = 1, 0.15
            body = body_for(False, stream=True)
            headers = {"x-pdactors-placement": "local"}
            resp = await s.client.post(ROUTES[False], json=body, headers=headers)
            assert streamed_text(resp, False) == SINGLE
            assert await migrations(s) == {}
            assert [len(e.received) for e in (*s.p, d)] == [0, 1]  # D alone served it
            await settled(s)


async def test_an_error_event_mid_stream_is_migrated_not_relayed() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_counting() as s:
            s.d[0].error_after = 3
            body = body_for(True, stream=True)
            resp = await s.client.post(ROUTES[True], json=body)
            assert streamed_text(resp, True) == SINGLE
            assert await migrations(s) == {"prefill": 1.0}
            await settled(s)


async def test_a_whole_answer_whose_d_dies_is_answered_by_another_engine() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_counting() as s:
            s.d[0].die_after = 0
            headers = {"x-pdactors-placement": "local"}
            resp = await s.client.post(ROUTES[False], json=body_for(False), headers=headers)
            assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == SINGLE
            assert await migrations(s) == {"prefill": 1.0}
            await settled(s)


async def test_with_migration_off_the_stream_ends_with_an_error_event() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_counting(migration_limit=0) as s:
            s.d[0].error_after = 2
            headers = {"x-pdactors-placement": "local"}
            resp = await s.client.post(
                ROUTES[False], json=body_for(False, stream=True), headers=headers
            )
            last = events(resp.text)[-1]
            assert s.d[0].url in last["error"]["message"]
            assert "mid-stream" in last["error"]["message"]
            assert await migrations(s) == {}
            await settled(s)


async def test_migrations_are_bounded_and_the_last_failure_names_every_engine() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_counting(n_d=2, migration_limit=1) as s:
            for d in s.d:
                d.error_after = 1
            s.p[0].error_after = 1
            headers = {"x-pdactors-placement": "local"}
            resp = await s.client.post(
                ROUTES[False], json=body_for(False, stream=True), headers=headers
            )
            evs = events(resp.text)
            assert "".join(c["text"] for e in evs[:-1] for c in e["choices"]) == text_of([4, 5])
            message = evs[-1]["error"]["message"]
            assert all(d.url in message for d in s.d)  # the first D's failure named too
            assert await migrations(s) == {"decode": 1.0}
            await settled(s)


# --------------------------------------------------------------------------- the stream record


def test_a_native_stream_tracks_ids_and_hides_them_from_a_client_that_did_not_ask() -> None:
    body = {"model": "m", "prompt": "x", "stream": True, "max_tokens": 4}
    stream = ClientStream(body, False)
    first = {"id": "c", "choices": [{"index": 0, "text": " a", "prompt_token_ids": [1, 2],
                                     "token_ids": [5]}]}  # fmt: skip
    out = stream.feed(_event(first)[:9]) + stream.feed(_event(first)[9:])
    (event,) = events(out.decode())
    assert event["choices"][0]["token_ids"] is None  # as a plain server writes it
    assert event["choices"][0]["prompt_token_ids"] is None
    assert (stream.prompt_ids, stream.ids, stream.text) == ([1, 2], [5], " a")
    leg = stream.next_leg()
    assert leg is not None
    cont, completion = leg
    assert completion and cont["prompt"] == [1, 2, 5] and cont["max_tokens"] == 3
    later = {"id": "d", "choices": [{"index": 0, "text": " b", "token_ids": [6],
                                     "prompt_token_ids": [1, 2, 5]}],
             "usage": {"prompt_tokens": 3, "completion_tokens": 1}}  # fmt: skip
    (event,) = events(stream.feed(_event(later)).decode())
    assert event["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    assert stream.ids == [5, 6]


def test_a_chat_event_that_carries_only_token_ids_is_dropped() -> None:
    stream = ClientStream({"model": "m", "messages": [], "stream": True}, True)
    only = {"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": None,
                                    "logprobs": None, "token_ids": [9]}]}  # fmt: skip
    assert stream.feed(_event(only)) == b"" and stream.ids == [9]


def test_an_untracked_stream_cannot_move_once_begun() -> None:
    body = {"model": "m", "prompt": "x", "stream": True, "echo": True}
    stream = ClientStream(body, False)
    assert stream.next_leg() == (body, False)  # nothing relayed: asked again as it came
    assert stream.feed(b"data: {}\n\n") == b"data: {}\n\n"
    assert stream.next_leg() is None


def test_every_token_sent_leaves_nothing_to_continue() -> None:
    body = {"model": "m", "prompt": "x", "stream": True, "max_tokens": 2}
    answer = {"choices": [{"text": " a", "token_ids": [7], "finish_reason": "length"}]}
    stream = ClientStream(body, False, First(answer, [1], 7, " a", "length", None))
    stream.feed(_event({"choices": [{"index": 0, "text": " b", "token_ids": [8]}]}))
    assert stream.next_leg() is None


async def test_a_migration_never_goes_back_to_an_engine_that_failed_the_request() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_counting(migration_limit=3) as s:
            s.d[0].error_after = s.p[0].error_after = 1
            headers = {"x-pdactors-placement": "local"}
            resp = await s.client.post(
                ROUTES[False], json=body_for(False, stream=True), headers=headers
            )
            message = events(resp.text)[-1]["error"]["message"]
            assert s.d[0].url in message and s.p[0].url in message
            assert await migrations(s) == {"prefill": 1.0}  # D -> P, never back to D
            assert len(s.d[0].received) == 1
            whole = await s.client.post(ROUTES[False], json=body_for(False), headers=headers)
            assert whole.status_code == 200  # (error_after is for streams)
            s.d[0].die_after = s.p[0].die_after = 0
            failed = await s.client.post(ROUTES[False], json=body_for(False), headers=headers)
            assert failed.status_code == 502 and failed.headers["x-request-id"]
            await settled(s)
