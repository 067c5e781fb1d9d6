"""A request for several choices — a list of prompts, ``n`` > 1 — is one exchange per choice,
merged into one answer as vLLM's server gives it (issue 42, item 1; pdactors/proxy/_fan_out.py).

Through the proxy's shipped defaults in front of the counting engines of tests/test_migration.py
(after a prompt ending in ``k`` they generate ``k+1, k+2, …``, each token's text ``" t<id>"``;
a text prompt counts as ``[1, 2, 3]``), so each choice's text is known by hand and equals what
a request for that prompt alone gets; vLLM's index (``prompt_i * n + j``), usage (each prompt's
tokens once) and stream (one ``[DONE]``, one usage event) are the oracle. The official
``openai`` client reads the merged answers.
"""

from __future__ import annotations

from typing import Any

import httpx
import msgspec
import openai
import pytest
import trio

from pdactors.proxy._asgi import Reply
from pdactors.proxy._fan_out import serve_fanned_out, split
from pdactors.proxy._openai import CHAT, COMPLETIONS, MAX_CHOICES, validate
from tests.test_migration import (
    PROMPT,
    ROUTES,
    TIMEOUT,
    Counting,
    events,
    open_counting,
    settled,
    text_of,
    tokens_after,
)
from tests.test_proxy import Setup, completion_body, eventually, eventually_metric, open_setup

PROMPTS = [[10], [20, 21], [30, 31, 32]]  # distinct answers: t11…, t22…, t33…
MAX = 6  # tokens a choice
HEADERS = {"x-pdactors-placement": "local"}  # D alone: choices go round robin over the Ds


def decoders(s: Setup) -> list[Counting]:
    return s.d  # type: ignore[return-value]  # open_counting's Setup holds counting engines


def answer_of(prompt: list[int] | str) -> str:
    """A prompt's text as one counting engine answers it (the hand-written oracle)."""
    return text_of(tokens_after(PROMPT if isinstance(prompt, str) else prompt, MAX))


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip


def streamed_choices(text: str, chat: bool = False) -> dict[int, str]:
    """Each choice's text in a stream, by index; asserts no error event."""
    out: dict[int, str] = {}
    for e in events(text):
        assert "error" not in e, e
        for c in e["choices"]:
            part = (c["delta"].get("content") or "") if chat else c["text"]
            out[c["index"]] = out.get(c["index"], "") + part
    return out


async def alone(s: Setup, prompt: Any) -> str:
    """What a request for ``prompt`` alone is answered through the proxy."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX}
    resp = await s.client.post(ROUTES[False], json=body)
    assert resp.status_code == 200, resp.text
    (choice,) = resp.json()["choices"]
    text: str = choice["text"]
    return text


# --------------------------------------------------------------------------- whole answers


@pytest.mark.parametrize("n_d", [1, 2])
async def test_a_list_of_prompts_is_one_answer_choice_by_prompt(n_d: int) -> None:
    with trio.fail_after(TIMEOUT):
        async with open_counting(n_d=n_d) as s:
            body = {"model": "tiny", "prompt": PROMPTS, "max_tokens": MAX}
            resp = await s.client.post(ROUTES[False], json=body)
            assert resp.status_code == 200, resp.text
            got = resp.json()
            assert [c["index"] for c in got["choices"]] == [0, 1, 2]
            texts = [c["text"] for c in got["choices"]]
            assert texts == [answer_of(p) for p in PROMPTS]
            assert texts == [await alone(s, p) for p in PROMPTS]
            assert got["usage"] == usage(1 + 2 + 3, 3 * MAX)
            assert got["object"] == "text_completion" and got["model"] == "tiny"
            assert resp.headers["x-pdactors-placement"] in ("disaggregated", "local")
            await settled(s)


async def test_n_choices_of_each_prompt_count_its_prompt_once_with_a_seed_each() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_counting() as s:
            prompts = ["hello", "bye"]  # texts: [1, 2, 3] each
            body = {"model": "tiny", "prompt": prompts, "n": 2, "seed": 7, "max_tokens": MAX}
            resp = await s.client.post(ROUTES[False], json=body)
            assert resp.status_code == 200, resp.text
            got = resp.json()
            assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]  # prompt_i * n + j
            assert [c["text"] for c in got["choices"]] == [answer_of("x")] * 4
            assert got["usage"] == usage(3 + 3, 4 * MAX)  # each prompt once, as vLLM counts
            # Choice j of a prompt was asked with seed + j (vLLM's children's seeds), n: 1
            # (auto placement: these short prompts computed on D).
            asked = sorted((b["prompt"], b["seed"], b["n"]) for b in s.d[0].received)
            assert asked == [("bye", 7, 1), ("bye", 8, 1), ("hello", 7, 1), ("hello", 8, 1)]
            await settled(s)


async def test_a_chats_n_choices() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_counting() as s:
            messages = [{"role": "user", "content": "hello"}]
            body = {"model": "tiny", "messages": messages, "n": 3, "max_tokens": MAX}
            resp = await s.client.post(ROUTES[True], json=body)
            assert resp.status_code == 200, resp.text
            got = resp.json()
            assert [c["index"] for c in got["choices"]] == [0, 1, 2]
            assert [c["message"]["content"] for c in got["choices"]] == [answer_of("x")] * 3
            assert got["usage"] == usage(3, 3 * MAX)
            assert got["object"] == "chat.completion"
            await settled(s)


# --------------------------------------------------------------------------- one prefill


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prompts_choices_follow_its_first_to_the_p_that_computes_its_prompt(
    stream: bool,
) -> None:
    """n = 3, every request disaggregated (the point is P's flow), two P in turn: the three
    choices' P legs all go to the P the first was given (whose engine then computes the
    prompt once, as a single server does for its children), not round robin."""
    with trio.fail_after(TIMEOUT):
        async with open_setup(2, 1, placement="disaggregate") as s, trio.open_nursery() as n:
            held = trio.Event()
            for p in s.p:
                p.hold = held
            body = {"model": "tiny", "prompt": "hello", "n": 3, "temperature": 1.0}
            body |= {"max_tokens": 4, "stream": stream}
            got: list[httpx.Response] = []

            async def ask() -> None:
                got.append(await s.client.post(ROUTES[False], json=body))

            n.start_soon(ask)
            # Together at one P while it computes (their engine shares the prompt's blocks).
            await eventually(lambda: max(len(p.received) for p in s.p) == 3)
            assert sorted(len(p.received) for p in s.p) == [0, 3]
            held.set()
            await eventually(lambda: bool(got))
            assert got[0].status_code == 200, got[0].text
            assert len(s.d[0].received) == 3
            if stream:
                indexes = {c["index"] for e in events(got[0].text) for c in e["choices"]}
            else:
                indexes = {c["index"] for c in got[0].json()["choices"]}
            assert indexes == {0, 1, 2}


async def test_a_first_choice_decoded_on_d_alone_holds_no_other_back() -> None:
    """The shipped defaults place these short prompts on D alone: no P computes the prompt,
    and every choice reaches D at once (each stream held there)."""
    with trio.fail_after(TIMEOUT):
        async with open_counting() as s, trio.open_nursery() as n:
            d = decoders(s)[0]
            d.hold_at = 1
            body = {"model": "tiny", "prompt": "hello", "n": 3, "temperature": 1.0}
            body |= {"max_tokens": MAX, "stream": True}

            async def ask() -> None:
                resp = await s.client.post(ROUTES[False], json=body)
                assert streamed_choices(resp.text) == dict.fromkeys(range(3), answer_of("x"))

            n.start_soon(ask)
            await eventually(lambda: d.held == 3)  # all three decoding on D together
            d.resume.set()


async def test_a_failing_choice_fails_the_whole_answer() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_counting(n_d=2, migration_limit=0) as s:
            decoders(s)[1].die_after = 0  # the second D's server goes as it answers
            body = {"model": "tiny", "prompt": PROMPTS, "n": 2, "max_tokens": MAX}
            resp = await s.client.post(ROUTES[False], json=body, headers=HEADERS)
            assert resp.status_code == 502, resp.text
            assert s.d[1].url in resp.json()["error"]["message"]
            assert s.d[0].received and s.d[1].received  # the choices went to both
            await settled(s)


# --------------------------------------------------------------------------- streams


@pytest.mark.parametrize("placement", ["auto", "local"])
async def test_a_stream_of_several_prompts_interleaves_their_choices(placement: str) -> None:
    with trio.fail_after(TIMEOUT):
        async with open_counting(n_d=2) as s:
            body = {"model": "tiny", "prompt": PROMPTS, "n": 2, "max_tokens": MAX,
                    "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
            headers = {"x-pdactors-placement": placement}
            resp = await s.client.post(ROUTES[False], json=body, headers=headers)
            assert resp.status_code == 200, resp.text
            assert resp.headers["content-type"].startswith("text/event-stream")
            want = {i * 2 + j: answer_of(p) for i, p in enumerate(PROMPTS) for j in range(2)}
            assert streamed_choices(resp.text) == want
            assert resp.text.count("data: [DONE]") == 1 and resp.text.endswith("[DONE]\n\n")
            evs = events(resp.text)
            usages = [e for e in evs if e.get("usage")]
            assert usages == [evs[-1]] and evs[-1]["choices"] == []
            assert evs[-1]["usage"] == usage(1 + 2 + 3, 6 * MAX)
            assert len({e["id"] for e in evs}) == 1  # one stream
            finished = [c["index"] for e in evs for c in e["choices"] if c["finish_reason"]]
            assert sorted(finished) == list(range(6))
            await settled(s)


async def test_a_chat_stream_of_n_choices() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_counting() as s:
            messages = [{"role": "user", "content": "hello"}]
            body = {"model": "tiny", "messages": messages, "n": 2, "max_tokens": MAX,
                    "stream": True}  # fmt: skip
            resp = await s.client.post(ROUTES[True], json=body)
            assert resp.status_code == 200, resp.text
            assert streamed_choices(resp.text, chat=True) == {0: answer_of("x"), 1: answer_of("x")}
            assert resp.text.count("data: [DONE]") == 1
            assert not [e for e in events(resp.text) if e.get("usage")]  # none asked for
            await settled(s)


async def test_an_error_in_one_choices_stream_ends_the_stream_and_cancels_the_others() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_counting(n_d=2, migration_limit=0) as s:
            d = decoders(s)
            d[0].hold_at = 2  # the first D's choices wait after two tokens, until cancelled
            d[1].error_after = 3  # vLLM's error event after three tokens
            body = {"model": "tiny", "prompt": PROMPTS[:2], "n": 2, "max_tokens": MAX,
                    "stream": True}  # fmt: skip
            resp = await s.client.post(ROUTES[False], json=body, headers=HEADERS)
            assert resp.status_code == 200
            evs = events(resp.text)
            assert s.d[1].url in evs[-1]["error"]["message"]
            assert "data: [DONE]" not in resp.text
            assert all("error" not in e for e in evs[:-1])
            await settled(s)  # the held choices were cancelled: the request ended
            assert not d[0].resume.is_set()


async def test_a_client_gone_mid_stream_cancels_every_choice() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_counting() as s:
            d = decoders(s)
            d[0].hold_at = 2  # every choice waits after two tokens
            body = {"model": "tiny", "prompt": PROMPTS[:2], "n": 2, "max_tokens": MAX,
                    "stream": True}  # fmt: skip
            async with s.client.stream("POST", ROUTES[False], json=body, headers=HEADERS) as resp:
                assert resp.status_code == 200
                await eventually(lambda: d[0].held == 4)  # every choice began, then waits
                first = await resp.aiter_bytes().__anext__()
                assert first.startswith(b"data: ")
            await eventually(lambda: d[0].held == 0)  # each choice's D leg was closed
            await eventually_metric(s, ("pdactors_proxy_requests_in_flight", ()), 0)
            await settled(s)


# --------------------------------------------------------------------------- sans HTTP


async def test_a_choice_refused_before_the_stream_opened_refuses_the_request() -> None:
    """One choice answers 400 while the others' streams have begun: the client gets that 400
    (as vLLM refuses a prompt before it streams), none of the others' events, and they are
    cancelled."""
    sent: list[dict[str, Any]] = []

    async def client(message: Any) -> None:
        sent.append(dict(message))

    cancelled = 0
    refusal = b'{"error": {"message": "prompt too long", "code": 400}}'

    async def serve_one(body: dict[str, Any], reply: Reply, *_: Any) -> None:
        nonlocal cancelled
        if body["prompt"] == "refused":
            await trio.testing.wait_all_tasks_blocked()  # the others' first events are out
            await reply.whole(400, refusal, "t1")
            return
        try:
            await reply.start(200, b"text/event-stream", "t0")
            await reply.chunk(b'data: {"id":"a","choices":[{"index":0,"text":"x"}]}\n\n')
            await trio.sleep_forever()
        except trio.Cancelled:
            cancelled += 1
            raise

    body = {"model": "m", "prompt": ["ok", "refused", "ok"], "stream": True}
    subs = split(body, chat=False)
    assert subs is not None
    with trio.fail_after(TIMEOUT):
        await serve_fanned_out(serve_one, subs, 1, True, Reply(client))
    assert [m.get("status") for m in sent] == [400, None]
    assert sent[1]["body"] == refusal and not sent[1]["more_body"]
    assert cancelled == 2


async def test_a_choice_refused_while_anothers_stream_waits_to_open_refuses_the_request() -> None:
    """Through the proxy and its relay: one choice's D streams (its first event waits for
    the client's stream to open), the other's D answers 400: the client gets the 400 and both
    choices end — the waiting write is cancelled with the request (not held past its end)."""
    with trio.fail_after(TIMEOUT):
        async with open_setup(n_d=2) as s:
            refusing = s.d[1]
            refusing.status, refusing.hold = 400, trio.Event()
            refusing.error_body = {"error": {"message": "no", "type": "BadRequestError",
                                             "code": 400}}  # fmt: skip
            body = {**completion_body(stream=True, n=2, temperature=1.0)}
            answers: list[httpx.Response] = []

            async def post() -> None:
                answers.append(await s.client.post(ROUTES[False], json=body, headers=HEADERS))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(post)
                await eventually(lambda: bool(s.d[0].received) and bool(refusing.received))
                await trio.testing.wait_all_tasks_blocked()  # the streaming choice waits
                refusing.hold.set()
            assert answers[0].status_code == 400, answers[0].text
            assert answers[0].json()["error"]["message"] == "no"
            metrics = await s.metrics()
            assert metrics[("pdactors_proxy_requests_in_flight", ())] == 0  # both ended


def test_split_is_prompt_major_with_a_seed_per_choice() -> None:
    body = {"model": "m", "prompt": [[1], [2]], "n": 2, "seed": 5, "max_tokens": 3}
    subs = split(body, chat=False)
    assert subs == [
        {**body, "prompt": [1], "n": 1, "seed": 5},
        {**body, "prompt": [1], "n": 1, "seed": 6},
        {**body, "prompt": [2], "n": 1, "seed": 5},
        {**body, "prompt": [2], "n": 1, "seed": 6},
    ]
    assert split({"model": "m", "prompt": ["a", "b"]}, chat=False) == [
        {"model": "m", "prompt": "a"},
        {"model": "m", "prompt": "b"},
    ]
    chat = {"model": "m", "messages": [], "n": 2}
    assert split(chat, chat=True) == [{**chat, "n": 1}] * 2
    for one in ({"prompt": "a"}, {"prompt": ["a"]}, {"prompt": [1, 2]}, {"prompt": [[1]], "n": 1}):
        assert split({"model": "m", **one}, chat=False) is None


VALID = [
    {"prompt": ["a", "", "b"]},
    {"prompt": [[1, 2], [3]], "n": 2, "temperature": 0.7},
    {"prompt": "a", "n": MAX_CHOICES},
    {"prompt": [[1]] * MAX_CHOICES},
    {"prompt": "a", "n": 2},  # the model's default temperature: the engine's to judge
]
REFUSED = [
    ({"prompt": [[1], "a"]}, "`prompt`"),  # texts or id lists, not both (vLLM's types)
    ({"prompt": [[1], []]}, "`prompt`"),
    ({"prompt": [[1], [-1]]}, "`prompt`"),
    ({"prompt": "a", "n": 0}, "`n`"),
    ({"prompt": "a", "n": MAX_CHOICES + 1}, "`n`"),
    ({"prompt": ["a", "b"], "n": MAX_CHOICES // 2 + 1}, "at most"),
    ({"prompt": ["a"] * (MAX_CHOICES + 1)}, "`prompt`"),
    ({"prompt": "a", "n": 2, "temperature": 0}, "greedy"),  # as vLLM refuses it
    ({"prompt": "a", "best_of": 2}, "`best_of`"),  # vLLM 0.32 has none
    ({"prompt": "a", "n": 2, "best_of": 2}, "`best_of`"),
]


@pytest.mark.parametrize("fields", VALID)
def test_lists_and_n_vllm_takes_are_valid(fields: dict[str, Any]) -> None:
    body = {"model": "m", **fields}
    assert validate(msgspec.json.encode(body), COMPLETIONS) == body


@pytest.mark.parametrize(("fields", "named"), REFUSED)
def test_what_no_single_server_serves_is_refused(fields: dict[str, Any], named: str) -> None:
    no = validate(msgspec.json.encode({"model": "m", **fields}), COMPLETIONS)
    assert not isinstance(no, dict) and no.status == 400 and named in no.message, no


def test_a_chats_n_is_checked_as_a_completions() -> None:
    body = {"model": "m", "messages": [], "n": 2, "temperature": 0}
    no = validate(msgspec.json.encode(body), CHAT)
    assert not isinstance(no, dict) and "greedy" in no.message
    body["temperature"] = 1
    assert validate(msgspec.json.encode(body), CHAT) == body


# --------------------------------------------------------------------------- the openai client


def _with_openai(url: str) -> None:
    with httpx.Client(trust_env=False) as http:
        client = openai.OpenAI(
            base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10,
            http_client=http,  # type: ignore[arg-type]  # (openai's stubs name its own httpx)
        )  # fmt: skip
        got = client.completions.create(model="tiny", prompt=PROMPTS[:2], n=2, max_tokens=MAX)
        assert [c.index for c in got.choices] == [0, 1, 2, 3]
        want = [answer_of(PROMPTS[0])] * 2 + [answer_of(PROMPTS[1])] * 2
        assert [c.text for c in got.choices] == want
        assert got.usage is not None and got.usage.prompt_tokens == 3
        assert got.usage.completion_tokens == 4 * MAX
        texts: dict[int, str] = {}
        used = []
        for chunk in client.completions.create(
            model="tiny", prompt=PROMPTS[:2], n=2, max_tokens=MAX, stream=True,
            stream_options={"include_usage": True},
        ):  # fmt: skip
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
            if chunk.usage is not None:
                used.append(chunk.usage.total_tokens)
        assert texts == dict(enumerate(want)) and used == [3 + 4 * MAX]
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=MAX
        )
        assert [c.message.content for c in chat.choices] == [answer_of("x")] * 2


async def test_the_openai_client_gets_the_merged_answers() -> None:
    with trio.fail_after(TIMEOUT):
        async with open_counting() as s:
            await trio.to_thread.run_sync(_with_openai, s.url)
            await settled(s)
