"""The Responses API (``POST /v1/responses``) through the proxy, against the stand-in engines
of tests/test_proxy.py given vLLM's route here (:func:`responses_route`): disaggregated in
the concurrent flow (P computes the prompt for one token, D takes its KV and answers the
client's body), its stream of typed events passed as D sends it, a D whose KV did not come
asked again computing the prompt itself before the client saw any of it, and bodies the
proxy reads refused with a 400 naming the field.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import msgspec
import pytest
import trio
from quart import Response, request
from quart_trio import QuartTrio

from tests.test_proxy import TIMEOUT, FakeEngine, open_setup, total

DISAGGREGATE = {"x-pdactors-placement": "disaggregate"}


def body(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "input": "hello", "max_output_tokens": 5, "temperature": 0, **extra}


def event(kind: str, **data: Any) -> bytes:
    """One of vLLM's Responses API SSE events."""
    return f"event: {kind}\ndata: ".encode() + msgspec.json.encode({"type": kind, **data}) + b"\n\n"


def answer(engine: FakeEngine) -> dict[str, Any]:
    text = {"type": "output_text", "text": f"{engine.name} says hi", "annotations": []}
    message = {"type": "message", "role": "assistant", "content": [text], "status": "completed"}
    usage = {"input_tokens": 3, "output_tokens": 3, "total_tokens": 6}
    return {"id": f"resp_{engine.name}", "object": "response", "status": "completed",
            "output": [message], "usage": usage}  # fmt: skip


def stream_of(engine: FakeEngine) -> bytes:
    whole = answer(engine)
    begun = {**whole, "status": "in_progress", "output": []}
    deltas = [event("response.output_text.delta", delta=f" {engine.name}-{i}") for i in range(3)]
    return b"".join([
        event("response.created", response=begun),
        event("response.in_progress", response=begun),
        event("response.output_item.added", item={"type": "message"}),
        *deltas,
        event("response.completed", response=whole),
    ])  # fmt: skip


def responses_route(kv_failure: str, app: QuartTrio, engine: FakeEngine) -> None:
    """vLLM's ``/v1/responses`` on a stand-in: its whole answer or its stream of events. A
    request that pulls KV on an engine whose ``kv_fails`` fails as vLLM's would: a 500, or a
    stream that begins (created, in progress) and then ``kv_failure``: breaks off
    (``"broke"``) or sends the typed ``error`` event (``"event"``)."""

    @app.post("/v1/responses")
    async def responses() -> Response:
        got = await request.get_json()
        engine.received.append(got)
        pulls = bool((got.get("kv_transfer_params") or {}).get("do_remote_prefill"))
        failed = engine.kv_fails and pulls
        if not got.get("stream"):
            out = {"error": {"message": "Internal server error", "code": 500}} if failed else None
            encoded = msgspec.json.encode(out or answer(engine))
            return Response(encoded, status=500 if failed else 200, content_type="application/json")
        if failed:
            return Response(_failed_stream(kv_failure), content_type="text/event-stream")
        return Response(stream_of(engine), content_type="text/event-stream")


async def _failed_stream(kv_failure: str) -> AsyncIterator[bytes]:
    begun = {"id": "resp_x", "status": "in_progress", "output": []}
    yield event("response.created", response=begun)
    yield event("response.in_progress", response=begun)
    await trio.sleep(0.01)  # (its own chunk, as vLLM's engine step comes after them)
    if kv_failure == "broke":
        raise RuntimeError("the stream breaks off")
    yield event("error", code="InternalServerError", message="Internal server error", param=None)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_response_disaggregated_takes_the_concurrent_flow(stream: bool) -> None:
    """P gets the client's body for one output token, whole and not stored, keeping the KV
    for D; D gets the client's body with the transfer's parameters, and its answer (its
    events, byte for byte) is the client's."""
    routes = partial(responses_route, "broke")
    with trio.fail_after(TIMEOUT):
        async with open_setup(routes=routes) as s:
            asked = body(stream=stream)
            resp = await s.client.post("/v1/responses", json=asked, headers=DISAGGREGATE)
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-pdactors-placement"] == "disaggregated"
            if stream:
                assert resp.content == stream_of(s.d[0])
            else:
                assert resp.json() == answer(s.d[0])
            [p_body], [d_body] = s.p[0].received, s.d[0].received
            tid = p_body["kv_transfer_params"]["transfer_id"]
            assert p_body == {**asked, "max_output_tokens": 1, "stream": False, "store": False,
                              "kv_transfer_params": {"do_remote_decode": True,
                                                     "transfer_id": tid}}  # fmt: skip
            assert d_body.pop("kv_transfer_params") == {
                "do_remote_prefill": True, "remote_engine_id": "prefill-0",
                "remote_bootstrap_addr": s.p[0].url, "transfer_id": tid,
            }  # fmt: skip
            assert d_body == asked  # the client's own (no token ids asked: not continued)
            assert (await s.metrics())[total("responses", "ok")] == 1


@pytest.mark.parametrize("kv_failure", ["broke", "event"])
async def test_a_stream_whose_kv_did_not_come_is_asked_again_before_the_client_sees_it(
    kv_failure: str,
) -> None:
    """D's stream begins (created, in progress: no output yet) and then fails as a pull that
    failed makes it: D is asked again computing the prompt itself, and the client gets one
    stream — one ``response.created``, D's second answer."""
    with trio.fail_after(TIMEOUT):
        async with open_setup(routes=partial(responses_route, kv_failure)) as s:
            s.d[0].kv_fails = True
            asked = body(stream=True)
            resp = await s.client.post("/v1/responses", json=asked, headers=DISAGGREGATE)
            assert resp.status_code == 200, resp.text
            assert resp.content == stream_of(s.d[0])
            first, again = s.d[0].received
            assert "kv_transfer_params" in first and again == asked
            assert (await s.metrics())[total("responses", "ok")] == 1


async def test_with_the_defaults_a_short_response_goes_to_an_idle_d_as_the_client_wrote_it() -> (
    None
):
    with trio.fail_after(TIMEOUT):
        async with open_setup(routes=partial(responses_route, "broke")) as s:
            resp = await s.client.post("/v1/responses", json=body(stream=True))
            assert resp.status_code == 200, resp.text
            assert resp.content == stream_of(s.d[0])
            assert s.d[0].received == [body(stream=True)] and s.p[0].received == []


@pytest.mark.parametrize(
    ("bad", "names"),
    [
        ({"input": None}, "`input`"),
        ({"input": []}, "`input`"),
        ({"input": 7}, "`input`"),
        ({"max_output_tokens": 0}, "`max_output_tokens`"),
        ({"max_output_tokens": 10**30}, "`max_output_tokens`"),
        ({"stream": "yes"}, "`stream`"),
        ({"background": True}, "`background`"),
        ({"n": 2}, "`n`"),
        ({"temperature": -1}, "`temperature`"),
        ({"kv_transfer_params": {"do_remote_prefill": True}}, "`kv_transfer_params`"),
    ],
)
async def test_a_bad_response_body_is_a_400_naming_the_field_and_reaches_no_engine(
    bad: dict[str, Any], names: str
) -> None:
    with trio.fail_after(TIMEOUT):
        async with open_setup(routes=partial(responses_route, "broke")) as s:
            resp = await s.client.post("/v1/responses", json={**body(), **bad})
            assert resp.status_code == 400, resp.text
            assert names in resp.json()["error"]["message"]
            assert [e.received for e in s.p + s.d] == [[], []]
