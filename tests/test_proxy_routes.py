"""The routes the proxy forwards to an engine (pdactors/proxy/_forward.py): vLLM's
``/tokenize``, ``/detokenize``, ``/version``, ``/v1/embeddings``... against the stand-in
engines of tests/test_proxy.py, given a few of vLLM's other routes here (:class:`VllmRoutes`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial

import msgspec
import pytest
import trio
from quart import Response, request
from quart_trio import QuartTrio

from tests.test_proxy import (
    TIMEOUT,
    FakeEngine,
    eventually,
    eventually_health,
    eventually_metric,
    open_setup,
    total,
)

#: vLLM's /tokenize answer, spaced as no JSON encoder would: it must come back byte for byte.
TOKENS = b'{"count":2,  "max_model_len":2048,"tokens":[9906, 1917],"token_strs":null}'
VERSION = b'{"version":"0.32.0"}'
LORA_ADDED = b"Success: LoRA adapter 'sql' added successfully."  # vLLM's, as text/plain
SCORE_ERROR = b'{"error":{"message":"no score here","type":"BadRequestError","code":400}}'
EMBEDDING = {
    "object": "list",
    "model": "tiny",
    "data": [{"object": "embedding", "index": 0, "embedding": [0.5, -0.25]}],
    "usage": {"prompt_tokens": 1, "total_tokens": 1},
}


@dataclass(frozen=True)
class Seen:
    """One request as an engine got it."""

    engine: str
    method: str
    path: str
    query: bytes
    body: bytes
    content_type: str | None
    auth: str | None


@dataclass
class VllmRoutes:
    """A few of vLLM's other routes on each stand-in engine (``open_setup(routes=...)``); each
    request they get is noted in :attr:`seen`."""

    seen: list[Seen] = field(default_factory=list)
    hold: trio.Event | None = None  # /tokenize waits for it before answering
    cancelled: list[str] = field(default_factory=list)  # engines whose /tokenize was cancelled

    def __call__(self, app: QuartTrio, engine: FakeEngine) -> None:
        async def note() -> None:
            body = await request.get_data()
            assert isinstance(body, bytes)
            headers = request.headers
            self.seen.append(
                Seen(
                    engine.name, request.method, request.path, request.query_string, body,
                    headers.get("content-type"), headers.get("authorization"),
                )
            )  # fmt: skip

        @app.post("/tokenize")
        async def tokenize() -> Response:
            await note()
            try:
                if self.hold is not None:
                    await self.hold.wait()
            except trio.Cancelled:
                self.cancelled.append(engine.name)
                raise
            return Response(TOKENS, content_type="application/json")

        @app.post("/detokenize")
        async def detokenize() -> Response:
            await note()
            return Response(b'{"prompt":"hello world"}', content_type="application/json")

        @app.get("/version")
        async def version() -> Response:
            await note()
            return Response(VERSION, content_type="application/json")

        @app.post("/v1/embeddings")
        async def embeddings() -> Response:
            await note()
            return Response(msgspec.json.encode(EMBEDDING), content_type="application/json")

        @app.post("/v1/load_lora_adapter")
        async def load_lora() -> Response:
            await note()
            return Response(LORA_ADDED, content_type="text/plain; charset=utf-8")

        @app.post("/v1/score")
        async def score() -> Response:
            await note()
            return Response(SCORE_ERROR, status=400, content_type="application/json")

        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache() -> Response:
            await note()
            return Response(b"engine core is dead", status=500, content_type="text/plain")

        @app.get("/broken")
        async def broken() -> Response:  # the answer's body breaks off after its start
            await note()

            async def body() -> AsyncIterator[bytes]:
                yield b'{"partial": '
                raise RuntimeError("the engine broke mid-answer")

            return Response(body(), content_type="application/json")


def labels(m: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> set[str]:
    """The ``endpoint`` labels of the requests metric."""
    return {dict(key)["endpoint"] for name, key in m if name == "pdactors_proxy_requests_total"}


# --------------------------------------------------------------------------- as it came


async def test_tokenize_is_forwarded_as_it_came_and_answered_as_the_engine_did() -> None:
    routes = VllmRoutes()
    with trio.fail_after(TIMEOUT):
        async with open_setup(routes=routes) as s:
            body = b'{"model": "tiny",   "prompt": "hello world"}'
            headers = {"content-type": "application/json; charset=utf-8"}
            resp = await s.client.post("/tokenize", content=body, headers=headers)
            assert resp.status_code == 200, resp.text
            assert resp.content == TOKENS  # byte for byte
            assert resp.headers["content-type"] == "application/json"
            (seen,) = routes.seen
            assert seen == Seen("d0", "POST", "/tokenize", b"", body, headers["content-type"], None)
            assert s.p[0].received == s.d[0].received == []  # no completion was asked
            assert (await s.metrics())[total("tokenize", "ok")] == 1


async def test_version_a_query_string_and_each_engines_own_content_type() -> None:
    routes = VllmRoutes()
    with trio.fail_after(TIMEOUT):
        async with open_setup(routes=routes) as s:
            resp = await s.client.get("/version?verbose=1&path=%2Fa%20b")
            assert resp.status_code == 200 and resp.content == VERSION
            resp = await s.client.post("/v1/load_lora_adapter", json={"lora_name": "sql"})
            assert resp.status_code == 200 and resp.content == LORA_ADDED
            assert resp.headers["content-type"] == "text/plain; charset=utf-8"
            version, lora = routes.seen
            assert (version.method, version.path) == ("GET", "/version")
            assert version.query == b"verbose=1&path=%2Fa%20b"  # as the client wrote it
            assert version.body == b"" and lora.query == b""


async def test_the_engines_errors_pass_through_as_they_came() -> None:
    routes = VllmRoutes()
    with trio.fail_after(TIMEOUT):
        async with open_setup(routes=routes) as s:
            resp = await s.client.post("/v1/score", json={"model": "tiny"})
            assert resp.status_code == 400 and resp.content == SCORE_ERROR
            resp = await s.client.get("/v1/no/such/route")  # the engine's own 404
            assert resp.status_code == 404 and resp.text != "" and "error" not in resp.text
            resp = await s.client.post("/reset_prefix_cache")  # a 5xx too, counted as D's
            assert resp.status_code == 500 and resp.text == "engine core is dead"
            m = await s.metrics()
            assert m[total("other", "invalid")] == 2
            assert m[total("other", "decode_error")] == 1
            errors = "pdactors_proxy_backend_errors_total"
            assert m[errors, (("backend", s.d[0].url), ("role", "decode"))] == 1


async def test_forwarded_requests_take_turns_over_the_decodes() -> None:
    routes = VllmRoutes()
    with trio.fail_after(TIMEOUT):
        async with open_setup(1, 2, routes=routes) as s:
            for _ in range(4):
                assert (await s.client.get("/version")).status_code == 200
            assert [seen.engine for seen in routes.seen] == ["d0", "d1", "d0", "d1"]


async def test_the_metric_labels_forwarded_paths_with_a_fixed_few_names() -> None:
    routes = VllmRoutes()
    with trio.fail_after(TIMEOUT):
        async with open_setup(routes=routes) as s:
            await s.client.post("/tokenize", json={"prompt": "hi"})
            await s.client.post("/detokenize", json={"tokens": [1]})
            await s.client.get("/version")
            for path in ("/v1/embeddings", "/made/up/1", "/made/up/2", "/tokenize/x"):
                await s.client.post(path, json={})
            m = await s.metrics()
            assert labels(m) == {"tokenize", "detokenize", "version", "other"}
            assert m[total("detokenize", "ok")] == m[total("version", "ok")] == 1
            assert m[total("other", "ok")] == 1  # the embeddings
            assert m[total("other", "invalid")] == 3  # the engine's 404s


# --------------------------------------------------------------------------- keys and bounds


async def test_the_clients_key_is_checked_first_and_the_engines_get_theirs() -> None:
    routes = VllmRoutes()
    with trio.fail_after(TIMEOUT):
        async with open_setup(
            api_key="client-key", engine_api_key="engine-key", routes=routes
        ) as s:
            for headers in ({}, {"authorization": "Bearer wrong"}):
                resp = await s.client.post("/tokenize", json={"prompt": "hi"}, headers=headers)
                assert resp.status_code == 401
                assert resp.json()["error"]["code"] == "invalid_api_key"
                assert (await s.client.get("/version", headers=headers)).status_code == 401
            assert routes.seen == []  # nothing reached an engine
            good = {"authorization": "Bearer client-key"}
            resp = await s.client.post("/tokenize", json={"prompt": "hi"}, headers=good)
            assert resp.status_code == 200
            assert [seen.auth for seen in routes.seen] == ["Bearer engine-key"]
            m = await s.metrics()
            assert m[total("tokenize", "unauthorized")] == 2
            assert m[total("version", "unauthorized")] == 2


async def test_the_engines_authorization_follows_the_proxys_rule() -> None:
    routes = VllmRoutes()
    with trio.fail_after(TIMEOUT):
        headers = {"authorization": "Bearer the-clients"}
        async with open_setup(routes=routes) as s:  # no keys: the client's goes on
            assert (await s.client.get("/version", headers=headers)).status_code == 200
        async with open_setup(api_key="the-clients", routes=routes) as s:  # the proxy's only
            assert (await s.client.get("/version", headers=headers)).status_code == 200
        assert [seen.auth for seen in routes.seen] == ["Bearer the-clients", None]


async def test_a_body_over_the_limit_is_refused_before_any_engine_sees_it() -> None:
    routes = VllmRoutes()
    with trio.fail_after(TIMEOUT):
        async with open_setup(max_body_bytes=1000, routes=routes) as s:
            resp = await s.client.post("/tokenize", content=b"x" * 2000)
            assert resp.status_code == 413 and "error" in resp.json()
            resp = await s.client.post("/tokenize", content=b"x" * 1000)  # at the limit
            assert resp.status_code == 200
            assert [len(seen.body) for seen in routes.seen] == [1000]


# --------------------------------------------------------------------------- failures


async def test_an_answer_that_breaks_off_is_a_502_naming_the_engine() -> None:
    routes = VllmRoutes()
    with trio.fail_after(TIMEOUT):
        async with open_setup(routes=routes) as s:
            resp = await s.client.get("/broken")
            assert resp.status_code == 502
            message = resp.json()["error"]["message"]
            assert message.startswith(f"decode engine {s.d[0].url} failed: ")
            m = await s.metrics()
            assert m[total("other", "decode_error")] == 1
            errors = "pdactors_proxy_backend_errors_total"
            assert m[errors, (("backend", s.d[0].url), ("role", "decode"))] == 1


async def test_a_decode_gone_is_named_and_a_prefill_answers_in_its_place() -> None:
    routes = VllmRoutes()
    with trio.fail_after(TIMEOUT):
        async with open_setup(fall_back_to_p=False, routes=routes) as s:
            s.d[0].scope.cancel()  # D's server is gone
            resp = await s.client.get("/version")
            assert resp.status_code in (502, 503)  # refused, or out of rotation already
            assert s.d[0].url in resp.json()["error"]["message"]
            await eventually_health(s, lambda r: not r["decode"][0]["up"])
            resp = await s.client.get("/version")
            assert resp.status_code == 503
            message = resp.json()["error"]["message"]
            assert message.startswith("no decode engine is available") and s.d[0].url in message
            assert s.p[0].url not in message  # P is not asked without fall_back_to_p
        async with open_setup(routes=routes) as s:  # fall_back_to_p: a P instead
            s.d[0].healthy = False
            await eventually_health(s, lambda r: not r["decode"][0]["up"])
            resp = await s.client.get("/version")
            assert resp.status_code == 200 and routes.seen[-1].engine == "p0"
            s.p[0].healthy = False
            await eventually_health(s, lambda r: not r["prefill"][0]["up"])
            resp = await s.client.get("/version")
            assert resp.status_code == 503
            message = resp.json()["error"]["message"]
            assert s.d[0].url in message and s.p[0].url in message
        assert [seen.engine for seen in routes.seen] == ["p0"]


async def test_no_answer_in_the_request_timeout_is_a_504_and_the_call_is_closed() -> None:
    """The request timeout (1.5 s here), not the health probes' (1 s in open_setup)."""
    routes = VllmRoutes(hold=trio.Event())
    with trio.fail_after(TIMEOUT):
        async with open_setup(request_timeout=1.5, routes=routes) as s:
            start = trio.current_time()
            with trio.fail_after(5):
                resp = await s.client.post("/tokenize", json={"prompt": "hi"})
            assert trio.current_time() - start >= 1.5
            assert resp.status_code == 504
            message = resp.json()["error"]["message"]
            assert message == (
                f"decode engine {s.d[0].url} gave no answer within the request timeout (1.5 s)"
            )
            await eventually(lambda: routes.cancelled == ["d0"])
            assert (await s.metrics())[total("tokenize", "timeout")] == 1


async def test_a_client_that_goes_away_cancels_the_engines_call() -> None:
    routes = VllmRoutes(hold=trio.Event())
    with trio.fail_after(TIMEOUT):
        async with open_setup(routes=routes) as s:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(s.client.post, "/tokenize", content=b"{}"))
                await eventually(lambda: len(routes.seen) == 1)
                nursery.cancel_scope.cancel()  # the client hangs up
            await eventually(lambda: routes.cancelled == ["d0"])
            await eventually_metric(s, total("tokenize", "cancelled"), 1)


# --------------------------------------------------------------------------- clients


async def test_the_openai_client_gets_embeddings_through_the_proxy() -> None:
    openai = pytest.importorskip("openai")
    routes = VllmRoutes()
    with trio.fail_after(TIMEOUT):
        async with open_setup(api_key="sk-test", routes=routes) as s:

            def embed() -> list[float]:
                client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="sk-test", max_retries=0)
                with client:
                    answer = client.embeddings.create(model="tiny", input="hello")
                return list(answer.data[0].embedding)

            assert await trio.to_thread.run_sync(embed) == [0.5, -0.25]
            (seen,) = routes.seen
            assert msgspec.json.decode(seen.body)["input"] == "hello"
