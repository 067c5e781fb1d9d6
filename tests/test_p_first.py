"""The proxy's P-first flow (the default) against stand-in engines (tests/test_proxy.py's): the
client's first token is P's answer, D continues after it; real vLLM: tests/vllm/test_proxy_e2e.py.
"""

from __future__ import annotations

from typing import Any

import httpx
import msgspec
import pytest
import trio

from tests.test_proxy import (
    TIMEOUT,
    as_relayed,
    chat_body,
    completion_body,
    eventually,
    eventually_health,
    open_setup,
    total,
    wait_health,
)

#: The flow this file is about: P's token first, D continuing after it. The placement is
#: pinned (the shipped ``auto`` serves a short prompt to an idle D on D alone, P taking no
#: part); the tests that run with ``auto`` (the fall-backs, whole on P) pin nothing.
P_FIRST: dict[str, Any] = {"first_token": "p", "placement": "disaggregate"}


def completion_text(resp: httpx.Response, stream: bool) -> str:
    """A completion's text, streamed (its events' texts joined) or whole."""
    if stream:
        return "".join(e["choices"][0]["text"] for e in data_events(resp.text))
    return str(resp.json()["choices"][0]["text"])


def data_events(text: str) -> list[Any]:
    return [
        msgspec.json.decode(line.removeprefix("data: "))
        for line in text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


async def test_p_is_asked_first_then_d_continues_after_ps_token() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_setup(**P_FIRST) as s:
            resp = await s.client.post("/v1/completions", json=completion_body())
            assert resp.status_code == 200, resp.text
            answer = resp.json()
            assert answer["choices"][0]["text"] == "p0 says hid0 says hi"  # P's token, then D's
            assert answer["usage"] == {
                "prompt_tokens": 3,
                "completion_tokens": 2,
                "total_tokens": 5,
            }
            assert "token_ids" not in answer["choices"][0] and "kv_transfer_params" not in answer
            (p_body,) = s.p[0].received
            (d_body,) = s.d[0].received
            tid = p_body["kv_transfer_params"]["transfer_id"]
            assert p_body == {
                **completion_body(), "max_tokens": 1, "stream": False, "return_token_ids": True,
                "kv_transfer_params": {"do_remote_decode": True, "transfer_id": tid,
                                       "first_token_from_p": True},
            }  # fmt: skip
            assert d_body == {
                **completion_body(), "prompt": [1, 2, 3, 7], "max_tokens": 4,
                "return_token_ids": True,
                "kv_transfer_params": {
                    "do_remote_prefill": True, "remote_engine_id": "prefill-0",
                    "remote_bootstrap_addr": s.p[0].url, "transfer_id": tid,
                    "first_token_from_p": True,
                },
            }  # fmt: skip


async def test_ps_token_reaches_a_streaming_client_before_d_answers() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_setup(**P_FIRST) as s:
            s.d[0].hold = trio.Event()  # D has not answered
            body = completion_body(stream=True, stream_options={"include_usage": True})
            async with s.client.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                lines = resp.aiter_lines()
                first = msgspec.json.decode((await anext(lines)).removeprefix("data: "))
                assert first["choices"][0]["text"] == "p0 says hi"
                assert first["choices"][0]["finish_reason"] is None
                await eventually(lambda: bool(s.d[0].received))  # asked, not answered
                s.d[0].hold.set()
                rest = "\n".join([line async for line in lines])
            texts = [e["choices"][0]["text"] for e in data_events(rest) if e["choices"]]
            assert texts == ["d0-0", "d0-1", "d0-2"] and "data: [DONE]" in rest.splitlines()
            m = await s.metrics()
            assert m[total("completions", "ok")] == 1
            assert m[("pdactors_proxy_p_first_total", (("path", "continued_on_d"),))] == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_a_first_token_that_ends_the_answer_asks_no_d(stream: bool) -> None:
    """EOS or a stop string at P: P's answer is the client's, D is never asked (P frees the
    KV itself: first_token_from_p)."""
    with trio.fail_after(TIMEOUT):
        async with open_setup(**P_FIRST) as s:
            s.p[0].finish = "stop"
            resp = await s.client.post("/v1/completions", json=completion_body(stream=stream))
            assert resp.status_code == 200
            if stream:
                (event,) = data_events(resp.text)
                assert resp.text.endswith("data: [DONE]\n\n")
                choice = event["choices"][0]
            else:
                choice = resp.json()["choices"][0]
            assert (choice["text"], choice["finish_reason"]) == ("p0 says hi", "stop")
            assert s.d[0].received == []
            m = await s.metrics()
            assert m[("pdactors_proxy_p_first_total", (("path", "ended_at_p"),))] == 1


async def test_one_token_asked_is_a_plain_request_to_p() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_setup(**P_FIRST) as s:
            resp = await s.client.post("/v1/completions", json=completion_body(max_tokens=1))
            assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "p0 says hi"
            (p_body,) = s.p[0].received
            assert "kv_transfer_params" not in p_body  # P keeps no KV for a D
            assert s.d[0].received == []


@pytest.mark.parametrize("stream", [False, True])
async def test_a_p_failing_before_its_token_fails_the_request_and_asks_no_d(stream: bool) -> None:
    with trio.fail_after(TIMEOUT):
        async with open_setup(**P_FIRST, fall_back_to_d=False) as s:
            s.p[0].status = 500
            resp = await s.client.post("/v1/completions", json=completion_body(stream=stream))
            assert resp.status_code == 502 and s.p[0].url in resp.json()["error"]["message"]
            assert s.d[0].received == []


@pytest.mark.parametrize("stream", [False, True])
async def test_a_p_failing_before_its_token_leaves_the_request_to_d(stream: bool) -> None:
    """With ``fall_back_to_d`` (the proxy's default) P's 5xx is not the client's: D serves the
    request alone, as the client wrote it; counted and said in the answer's header. P's 4xx
    is the request's fault and passes through."""
    with trio.fail_after(TIMEOUT):
        async with open_setup(**P_FIRST, fall_back_to_d=True) as s:
            s.p[0].status = 500
            body = completion_body(stream=stream)
            resp = await s.client.post("/v1/completions", json=body)
            assert resp.status_code == 200
            assert resp.headers["x-pdactors-placement"] == "local"
            (d_body,) = s.d[0].received
            assert d_body == as_relayed(body)  # the client's: no transfer params
            assert completion_text(resp, stream).startswith("d0")
            m = await s.metrics()
            assert m[("pdactors_proxy_fallbacks_total", (("why", "prefill_failed"),))] == 1
            assert m[total("completions", "ok")] == 1
            health = (await s.client.get("/health")).json()
            assert (
                health["decode"][0]["waiting_tokens"] == 0 and health["decode"][0]["prefills"] == 0
            )
            s.p[0].status, s.p[0].error_body = 400, {"error": {"message": "no", "type": "x"}}
            resp = await s.client.post("/v1/completions", json=body)
            assert resp.status_code == 400 and len(s.d[0].received) == 1


async def test_with_no_p_in_rotation_d_serves_alone() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_setup() as s:
            s.p[0].healthy = False
            await eventually_health(s, lambda r: not r["prefill"][0]["up"])  # P out of rotation
            report = (await s.health())[1]
            assert report["status"] == "degraded" and "prefill" in report["reason"]
            resp = await s.client.post("/v1/completions", json=completion_body())
            assert resp.status_code == 200 and resp.headers["x-pdactors-placement"] == "local"
            assert s.p[0].received == [] and len(s.d[0].received) == 1
            m = await s.metrics()
            assert m[("pdactors_proxy_fallbacks_total", (("why", "no_prefill"),))] == 1
            placed = (("placement", "local"), ("reason", "no_prefill"))
            assert m[("pdactors_proxy_placement_total", placed)] == 1


async def test_d_failing_after_ps_token_ends_the_stream_with_an_error_event() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_setup(**P_FIRST, migration_limit=0) as s:  # not continued
            s.d[0].status = 503
            body = completion_body(stream=True)
            resp = await s.client.post("/v1/completions", json=body)
            assert resp.status_code == 200  # P's token was out before D failed
            first, error = data_events(resp.text)
            assert first["choices"][0]["text"] == "p0 says hi"
            assert error["error"]["code"] == 502 and s.d[0].url in error["error"]["message"]
            m = await s.metrics()
            assert m[total("completions", "decode_error")] == 1


async def test_a_client_gone_while_d_answers_cancels_d() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_setup(**P_FIRST) as s:
            s.d[0].hold = trio.Event()
            async with s.client.stream("POST", "/v1/completions", json=completion_body(
                stream=True)) as resp:  # fmt: skip
                await anext(resp.aiter_lines())  # P's token
                await eventually(lambda: bool(s.d[0].received))
            (tid,) = s.d[0].tids()
            await eventually(lambda: s.d[0].cancelled == [tid])


async def test_chat_goes_to_d_as_a_completion_of_the_chats_ids() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_setup(**P_FIRST) as s:
            resp = await s.client.post("/v1/chat/completions", json=chat_body(temperature=0))
            assert resp.status_code == 200
            assert resp.json()["choices"][0]["message"]["content"] == "p0 says hid0 says hi"
            (d_body,) = s.d[0].received
            assert "messages" not in d_body and d_body["prompt"] == [1, 2, 3, 7]
            assert d_body["max_tokens"] == 4 and d_body["temperature"] == 0
            body = chat_body(stream=True)
            resp = await s.client.post("/v1/chat/completions", json=body)
            events = data_events(resp.text)
            assert {e["object"] for e in events} == {"chat.completion.chunk"}
            text = "".join(e["choices"][0]["delta"]["content"] for e in events)
            assert text == "p0 says hid0-0d0-1d0-2"


async def test_requests_the_flow_cannot_carry_take_the_concurrent_flow() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_setup(**P_FIRST) as s:
            resp = await s.client.post("/v1/chat/completions", json=chat_body(tools=[]))
            assert resp.status_code == 200
            assert resp.json()["choices"][0]["message"]["content"] == "d0 says hi"
            (p_body,) = s.p[0].received
            assert "return_token_ids" not in p_body


@pytest.mark.parametrize("stream", [False, True])
async def test_local_placement_serves_each_request_on_d_alone(stream: bool) -> None:
    with trio.fail_after(TIMEOUT):
        async with open_setup(placement="local") as s:
            resp = await s.client.post("/v1/completions", json=completion_body(stream=stream))
            assert resp.status_code == 200
            assert s.p[0].received == []
            (d_body,) = s.d[0].received
            assert d_body == as_relayed(completion_body(stream=stream))  # the client's
            assert completion_text(resp, stream).startswith("d0")
            m = await s.metrics()
            assert (
                m[
                    (
                        "pdactors_proxy_placement_total",
                        (("placement", "local"), ("reason", "pinned")),
                    )
                ]
                == 1
            )
            assert m[total("completions", "ok")] == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_a_d_whose_kv_did_not_come_is_asked_again_for_the_same_continuation(
    stream: bool,
) -> None:
    """P died or hung after its token: D's pull fails and D answers vLLM's error before its
    first token. D is asked once more for the same continuation (the prompt's ids and P's
    token) without kv_transfer_params: the client's answer goes on after P's token, nothing
    repeated, nothing skipped."""
    with trio.fail_after(TIMEOUT):
        async with open_setup(**P_FIRST) as s:
            s.d[0].kv_fails = True
            resp = await s.client.post("/v1/completions", json=completion_body(stream=stream))
            assert resp.status_code == 200, resp.text
            kv_leg, retried = s.d[0].received
            assert retried == {k: v for k, v in kv_leg.items() if k != "kv_transfer_params"}
            assert retried["prompt"] == [1, 2, 3, 7]  # the prompt's ids and P's token
            if stream:
                texts = [e["choices"][0]["text"] for e in data_events(resp.text)]
                assert texts == ["p0 says hi", "d0-0", "d0-1", "d0-2"]
            else:
                assert resp.json()["choices"][0]["text"] == "p0 says hid0 says hi"
            m = await s.metrics()
            assert m[("pdactors_proxy_retries_total", (("reason", "decode_failed"),))] == 1
            assert m[total("completions", "ok")] == 1
            d = (await s.client.get("/health")).json()["decode"][0]
            assert (d["waiting_tokens"], d["prefills"], d["outstanding"]) == (0, 0, 0)


@pytest.mark.parametrize("stream", [False, True])
async def test_with_no_d_in_rotation_p_serves_whole(stream: bool) -> None:
    """The shipped defaults: D gone (here: its /health fails), P serves every request whole,
    as the client sent it (no transfer params), and the model list comes from P."""
    with trio.fail_after(TIMEOUT):
        async with open_setup() as s:
            s.d[0].healthy = False
            await eventually_health(s, lambda r: not r["decode"][0]["up"])  # D out of rotation
            body = completion_body(stream=stream)
            resp = await s.client.post("/v1/completions", json=body)
            assert resp.status_code == 200
            assert resp.headers["x-pdactors-placement"] == "whole-on-p"
            assert s.p[0].received == [as_relayed(body)] and s.d[0].received == []
            assert completion_text(resp, stream).startswith("p0")
            assert (await s.client.get("/v1/models")).status_code == 200
            m = await s.metrics()
            assert m[("pdactors_proxy_fallbacks_total", (("why", "no_decode"),))] == 1
            placed = (("placement", "whole-on-p"), ("reason", "no_decode"))
            assert m[("pdactors_proxy_placement_total", placed)] == 1
            assert m[total("completions", "ok")] == 1
            health = (await s.client.get("/health")).json()
            assert health["prefill"][0]["waiting_tokens"] == 0  # every count given back
            s.d[0].healthy = True
            await wait_health(s, 200)  # D is back (calibrated again as it came back)
            s.d[0].entered()
            assert len(s.d[0].probes) == 1
            resp = await s.client.post("/v1/completions", json=completion_body())
            assert resp.status_code == 200
            assert resp.headers["x-pdactors-placement"] != "whole-on-p"
            assert len(s.d[0].received) == 1


async def test_without_the_fall_back_to_p_no_d_is_a_503() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_setup(fall_back_to_p=False) as s:
            s.d[0].healthy = False
            await wait_health(s, 503)  # no D, and P may not serve alone: nothing can be served
            resp = await s.client.post("/v1/completions", json=completion_body())
            assert resp.status_code == 503 and "no decode engine" in resp.text
            assert s.p[0].received == []


async def test_whole_on_p_pinned_by_header_with_d_up() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_setup() as s:
            headers = {"x-pdactors-placement": "whole-on-p"}
            body = chat_body()
            resp = await s.client.post("/v1/chat/completions", json=body, headers=headers)
            assert resp.status_code == 200
            assert resp.headers["x-pdactors-placement"] == "whole-on-p"
            assert s.p[0].received == [body] and s.d[0].received == []
            m = await s.metrics()
            placed = (("placement", "whole-on-p"), ("reason", "pinned"))
            assert m[("pdactors_proxy_placement_total", placed)] == 1
            assert ("pdactors_proxy_fallbacks_total", (("why", "pinned"),)) not in m


async def test_whole_on_p_with_no_p_in_rotation_is_a_503_naming_p() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_setup() as s:
            s.p[0].healthy = False
            await eventually_health(s, lambda r: not r["prefill"][0]["up"])
            headers = {"x-pdactors-placement": "whole-on-p"}
            resp = await s.client.post("/v1/completions", json=completion_body(), headers=headers)
            assert resp.status_code == 503 and "no prefill engine" in resp.text
            assert s.p[0].received == [] and s.d[0].received == []
