"""The proxy's OpenAI bodies and answers, P-first flow (pdactors.proxy._bodies): plain
synchronous tests on vLLM-shaped answers."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from pdactors.proxy import _bodies as b
from pdactors.proxy._stream import ClientStream
from pdactors.wire import KVTransferParams

PROMPT = [1, 17, 99, 5]


def p_answer(*, chat: bool = False, finish: str = "length", params: bool = True) -> bytes:
    """What vLLM answers P's request (``return_token_ids``), completion or chat."""
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "token_ids": [42],
                              "logprobs": None}  # fmt: skip
    if chat:
        choice["message"] = {"role": "assistant", "content": " fox"}
    else:
        choice |= {"text": " fox", "prompt_token_ids": PROMPT}
    answer: dict[str, Any] = {
        "id": "cmpl-t", "object": "chat.completion" if chat else "text_completion",
        "created": 7, "model": "tiny", "choices": [choice],
        "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
        "kv_transfer_params": {"do_remote_prefill": True} if params else None,
    }  # fmt: skip
    if chat:
        answer["prompt_token_ids"] = PROMPT
    return msgspec.json.encode(answer)


def first(**kw: Any) -> b.First:
    out = b.read_first(p_answer(**kw), kw.get("chat", False))
    assert isinstance(out, b.First)
    return out


def test_ps_request_asks_one_token_with_its_ids_and_keeps_the_kv_unless_one_is_all() -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}, "min_tokens": 3}  # fmt: skip
    p = b.prefill_body(body, False, "T")
    assert p["max_tokens"] == 1 and p["stream"] is False and p["return_token_ids"] is True
    assert "stream_options" not in p and p["min_tokens"] == 1
    assert p["kv_transfer_params"] == KVTransferParams(
        do_remote_decode=True, transfer_id="T", first_token_from_p=True
    )
    assert "kv_transfer_params" not in b.prefill_body({**body, "max_tokens": 1}, False, "T")
    chat = b.prefill_body({"model": "m", "messages": [], "max_completion_tokens": 9}, True, "T")
    assert chat["max_completion_tokens"] == chat["max_tokens"] == 1


def test_ds_request_is_the_prompt_and_ps_token_for_one_token_less() -> None:
    f = first()
    params = KVTransferParams(do_remote_prefill=True, transfer_id="T", first_token_from_p=True)
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 8, "min_tokens": 3, "stream": True}
    d = b.decode_body(body, False, f, params)
    assert d["prompt"] == [*PROMPT, 42] and d["max_tokens"] == 7 and d["min_tokens"] == 2
    assert d["stream"] is True and d["kv_transfer_params"] is params
    assert d["return_token_ids"] is True  # the proxy tracks what the client gets
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": 0,
            "max_completion_tokens": 5, "stream_options": {"include_usage": True}}  # fmt: skip
    d = b.decode_body(chat, True, f, params)
    want = {"model": "tiny", "temperature": 0, "prompt": [*PROMPT, 42], "max_tokens": 4,
            "stream_options": {"include_usage": True}, "kv_transfer_params": params,
            "return_token_ids": True}  # fmt: skip
    assert d == want


@pytest.mark.parametrize(
    ("body", "chat", "applies"),
    [
        ({"model": "m", "prompt": "x", "echo": True}, False, False),
        ({"model": "m", "prompt": "x", "logprobs": 2}, False, True),
        ({"model": "m", "messages": [], "temperature": 0.5, "seed": 1}, True, True),
        ({"model": "m", "messages": [], "tools": []}, True, False),
        ({"model": "m", "messages": [], "logprobs": True}, True, False),
    ],
)
def test_which_requests_go_p_first(body: dict[str, Any], chat: bool, applies: bool) -> None:
    assert b.applies(body, chat) is applies


def test_ps_answer_is_read_and_an_answer_without_token_ids_is_named() -> None:
    f = first()
    assert (f.prompt_ids, f.token_id, f.text) == (PROMPT, 42, " fox")
    assert not b.ends_at_p(f, {"max_tokens": 2}, False)
    assert b.ends_at_p(first(finish="stop"), {}, False)
    assert b.ends_at_p(f, {"max_tokens": 1}, False)
    assert b.ends_at_p(first(chat=True), {"max_completion_tokens": 1, "max_tokens": 5}, True)
    assert first(chat=True).text == " fox"
    bare = msgspec.json.encode({"choices": [{"text": "x", "finish_reason": "length"}]})
    assert "no token ids" in str(b.read_first(bare, False))
    assert "no token ids" in str(b.read_first(b"not json", False))


def test_a_whole_answer_is_ps_token_then_ds_with_usage_counting_what_the_client_got() -> None:
    d = {"choices": [{"index": 0, "text": " jumps", "finish_reason": "length",
                      "logprobs": None, "token_ids": [7, 8]}],
         "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}  # fmt: skip
    out = msgspec.json.decode(b.merge_whole(first(), d, {"prompt": "x"}, False))
    (choice,) = out["choices"]
    assert choice["text"] == " fox jumps" and choice["finish_reason"] == "length"
    assert "token_ids" not in choice and "prompt_token_ids" not in choice
    assert "kv_transfer_params" not in out
    assert out["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    asked = msgspec.json.decode(b.merge_whole(first(), d, {"return_token_ids": True}, False))
    assert asked["choices"][0]["token_ids"] == [42, 7, 8]
    chat = msgspec.json.decode(b.merge_whole(first(chat=True), d, {}, True))
    assert chat["choices"][0]["message"]["content"] == " fox jumps"


def test_logprobs_follow_ps_token_with_ds_offsets_after_its_text() -> None:
    p = {"tokens": [" fox"], "token_logprobs": [-0.5], "top_logprobs": [{" fox": -0.5}],
         "text_offset": [0]}  # fmt: skip
    d = {"tokens": [" j", "umps"], "token_logprobs": [-1.0, -2.0],
         "top_logprobs": [{" j": -1.0}, {"umps": -2.0}], "text_offset": [0, 2]}  # fmt: skip
    merged = b._merge_logprobs(p, d, " fox")
    assert merged["tokens"] == [" fox", " j", "umps"]
    assert merged["text_offset"] == [0, 4, 6]


def events(data: bytes) -> list[Any]:
    out = []
    for raw in data.split(b"\n\n"):
        if raw.startswith(b"data: ") and raw != b"data: [DONE]":
            out.append(msgspec.json.decode(raw[6:]))
    return out


def test_ps_token_as_the_first_event_and_as_the_whole_stream() -> None:
    f = first()
    (event,) = events(b.first_event(f, {}, False, last=False))
    assert event["choices"][0]["text"] == " fox" and event["choices"][0]["finish_reason"] is None
    body = {"stream_options": {"include_usage": True}}
    whole = b.first_event(first(finish="stop"), body, False, last=True)
    assert whole.endswith(b"data: [DONE]\n\n")
    token, usage = events(whole)
    assert token["choices"][0]["finish_reason"] == "stop"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 1
    (chat,) = events(b.first_event(first(chat=True), {}, True, last=False))
    assert chat["object"] == "chat.completion.chunk"
    assert chat["choices"][0]["delta"] == {"role": "assistant", "content": " fox"}


def test_ds_stream_is_reframed_event_by_event_whatever_its_chunks() -> None:
    def chunk(text: str, finish: str | None = None) -> bytes:
        event = {"id": "cmpl-d", "object": "text_completion", "created": 9, "model": "tiny",
                 "choices": [{"index": 0, "text": text, "finish_reason": finish,
                              "prompt_token_ids": [*PROMPT, 42]}]}  # fmt: skip
        return b"data: " + msgspec.json.encode(event) + b"\n\n"

    usage = {"id": "cmpl-d", "choices": [], "usage": {"prompt_tokens": 5,
             "completion_tokens": 2, "total_tokens": 7}}  # fmt: skip
    d = chunk(" j") + chunk("umps", "length") + b"data: " + msgspec.json.encode(usage)
    d += b"\n\ndata: [DONE]\n\n"
    chat = {"model": "tiny", "messages": [], "stream": True}
    stream = ClientStream(chat, True, first(chat=True))
    out = b"".join(stream.feed(d[i : i + 7]) for i in range(0, len(d), 7))
    assert out.endswith(b"data: [DONE]\n\n")
    one, two, last = events(out)
    assert one["object"] == "chat.completion.chunk" and one["id"] == "cmpl-t"
    assert one["choices"][0]["delta"] == {"content": " j"}
    assert two["choices"][0]["finish_reason"] == "length"
    assert last["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    body = {"model": "tiny", "prompt": "x", "stream": True}
    plain = ClientStream(body, False, first()).feed(chunk(" j"))
    (event,) = events(plain)
    assert event["choices"][0]["prompt_token_ids"] is None  # D's prompt: not the client's
