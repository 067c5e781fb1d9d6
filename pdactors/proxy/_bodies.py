"""The OpenAI bodies the proxy sends the engines and the answers it makes of theirs (no IO).

The concurrent flow (upstream's): P and D get the client's body at once, P for one token
(:func:`concurrent_bodies`). The P-first flow (the default): P answers the client's request
with one token (``max_tokens`` 1, its token ids returned: vLLM's ``return_token_ids``), and
that token is the client's first. D then continues after it: a completions request for the
prompt's token ids followed by P's token, with ``first_token_from_p`` in its
``kv_transfer_params``, so D pulls the KV of the prompt from P and computes P's token itself
(the step a single server makes for its second token). The client gets one answer: P's token,
then D's, with ``usage`` counting the prompt once and every token it got. Why this shape (and
not the token on the side channel): docs/architecture.md.

What the P-first flow does not carry (such requests take the concurrent flow, D computing the
first token): ``echo``, prompt logprobs, ``best_of``, and on chat anything that shapes the
assistant's message beyond plain text (tools, response formats, reasoning, logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import msgspec

from pdactors.wire import KVTransferParams

__all__ = [
    "First",
    "applies",
    "client_usage",
    "concurrent_bodies",
    "continuation_body",
    "decode_body",
    "ended_at_p",
    "ends_at_p",
    "first_event",
    "max_tokens",
    "merge_whole",
    "prefill_body",
    "read_first",
]

#: Completion fields that keep the P-first flow off (they change what the answer holds
#: beyond the generated text).
_COMPLETION_OFF: Final = frozenset({"echo", "prompt_logprobs", "best_of", "suffix"})
#: Chat fields D's completion request carries over as they are: sampling, stops, and how the
#: text is written. Any other chat field but those the proxy itself handles keeps the flow
#: off (tools, response formats, logprobs, templates: they need vLLM's chat serving on D).
_CHAT_CARRIED: Final = frozenset({
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "user", "priority", "cache_salt",
})  # fmt: skip
_CHAT_HANDLED: Final = frozenset({
    "model", "messages", "stream", "stream_options", "max_tokens", "max_completion_tokens",
    "min_tokens", "n", "kv_transfer_params", "add_generation_prompt", "chat_template_kwargs",
})  # fmt: skip
#: Fields of P's answer that the proxy asked for and the client did not (removed).
_ASKED: Final = ("prompt_token_ids", "token_ids")


def max_tokens(body: dict[str, Any], chat: bool) -> int | None:
    value = body.get("max_completion_tokens") if chat else None
    return value if value is not None else body.get("max_tokens")


def concurrent_bodies(
    body: dict[str, Any], chat: bool, p_params: KVTransferParams, d_params: KVTransferParams
) -> tuple[bytes, bytes]:
    """P's and D's requests in the concurrent flow: P the client's body for one token, whole;
    D the client's body. Each with its ``kv_transfer_params``. (A Responses API body — its
    ``input`` — counts ``max_output_tokens``, and P's one-token response is not stored.)"""
    if "input" in body:
        p_body = {**body, "max_output_tokens": 1, "stream": False, "store": False}
    else:
        p_body = {**body, "max_tokens": 1, "stream": False}
    if chat:
        p_body["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens"):  # vLLM refuses them with the above
        p_body.pop(key, None)
    p_body["kv_transfer_params"] = p_params
    d_body = {**body, "kv_transfer_params": d_params}
    return msgspec.json.encode(p_body), msgspec.json.encode(d_body)


def applies(body: dict[str, Any], chat: bool) -> bool:
    """Whether the request can take the P-first flow (see the module's doc): a completion
    continues as one, a chat as one of plain text; a Responses API body (no ``prompt``, its
    stream of typed events) does not."""
    if chat:
        return all(k in _CHAT_CARRIED or k in _CHAT_HANDLED for k in body)
    return "prompt" in body and not any(body.get(k) for k in _COMPLETION_OFF)


def prefill_body(body: dict[str, Any], chat: bool, transfer_id: str) -> dict[str, Any]:
    """P's request: the client's, for one token, whole, with its token ids; it keeps the KV
    for D unless the client asked for one token (then it is the whole answer)."""
    p_body = {**body, "max_tokens": 1, "stream": False, "return_token_ids": True}
    if chat:
        p_body["max_completion_tokens"] = 1
    p_body.pop("stream_options", None)
    if body.get("min_tokens"):
        p_body["min_tokens"] = 1
    if max_tokens(body, chat) != 1:
        params = KVTransferParams(
            do_remote_decode=True, transfer_id=transfer_id, first_token_from_p=True
        )
        p_body["kv_transfer_params"] = params
    return p_body


@dataclass(frozen=True)
class First:
    """P's answer, read: the prompt's token ids, P's token, its text and how P ended."""

    answer: dict[str, Any]
    prompt_ids: list[int]
    token_id: int
    text: str
    finish_reason: str | None
    logprobs: Any


def ends_at_p(first: First, body: dict[str, Any], chat: bool) -> bool:
    """P's token is the whole answer: EOS or a stop string, or the client asked for one
    token (then P was asked for no transfer)."""
    return first.finish_reason != "length" or max_tokens(body, chat) == 1


def read_first(raw: bytes, chat: bool) -> First | str:
    """P's whole answer, or what is wrong with it (an engine that did not return token ids)."""
    try:
        answer = msgspec.json.decode(raw)
        choice = answer["choices"][0]
        prompt_ids = choice.get("prompt_token_ids") or answer.get("prompt_token_ids")
        (token_id,) = choice["token_ids"]
        text = choice["message"]["content"] if chat else choice["text"]
    except (msgspec.DecodeError, KeyError, IndexError, TypeError, ValueError) as exc:
        return f"P's answer has no token ids of one token ({type(exc).__name__}: {exc})"
    if not isinstance(prompt_ids, list) or not isinstance(token_id, int):
        return "P's answer has no prompt token ids"
    return First(answer, prompt_ids, token_id, text or "", choice.get("finish_reason"),
                 choice.get("logprobs"))  # fmt: skip


def decode_body(
    body: dict[str, Any], chat: bool, first: First, params: KVTransferParams | None
) -> dict[str, Any]:
    """D's request: a completion of the prompt's ids and P's token, for the tokens the client
    asked for but one, streamed when the client's is; with ``params`` None, the same request
    for D computing the prompt itself (a retry: no KV to pull)."""
    return continuation_body(body, chat, [*first.prompt_ids, first.token_id], 1, params)


def continuation_body(
    body: dict[str, Any],
    chat: bool,
    ids: list[int],
    done: int,
    params: KVTransferParams | None = None,
) -> dict[str, Any]:
    """A completion request that continues the client's after ``done`` tokens it already got:
    its prompt is ``ids`` (the prompt's token ids, then those tokens), for the tokens still
    owed, with the client's sampling and stops, streamed when the client's is, its token ids
    asked for (the proxy tracks what the client gets: :mod:`pdactors.proxy._stream`)."""
    if chat:
        d_body = {k: v for k, v in body.items() if k in _CHAT_CARRIED}
        d_body["model"] = body["model"]
        if "stream" in body:
            d_body["stream"] = body["stream"]
        if "stream_options" in body:
            d_body["stream_options"] = body["stream_options"]
    else:
        d_body = {k: v for k, v in body.items() if k not in ("max_completion_tokens",)}
    d_body["prompt"] = ids
    d_body["return_token_ids"] = True
    left = max_tokens(body, chat)
    if left is not None:
        d_body["max_tokens"] = left - done
    if body.get("min_tokens"):
        d_body["min_tokens"] = max(0, body["min_tokens"] - done)
    if params is not None:
        d_body["kv_transfer_params"] = params
    return d_body


def client_usage(first: First, d_completion_tokens: int) -> dict[str, int]:
    """The prompt once (P's count), and P's token with D's."""
    prompt = len(first.prompt_ids)
    completion = 1 + d_completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip


def _strip(answer: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """P's answer without what the proxy asked for and the client did not."""
    out = {k: v for k, v in answer.items() if k != "kv_transfer_params"}
    if not body.get("return_token_ids"):
        out.pop("prompt_token_ids", None)
        out["choices"] = [
            {k: v for k, v in c.items() if k not in _ASKED} for c in answer.get("choices", [])
        ]
    return out


def ended_at_p(first: First, body: dict[str, Any]) -> dict[str, Any]:
    """The client's whole answer when P's token is all of it."""
    return _strip(first.answer, body)


def merge_whole(first: First, d_answer: dict[str, Any], body: dict[str, Any], chat: bool) -> bytes:
    """The client's whole answer: P's with D's text, finish and usage after P's token."""
    out = _strip(first.answer, body)
    (d_choice,) = d_answer["choices"]
    (choice,) = out["choices"]
    if chat:
        choice["message"] = {**choice["message"], "content": first.text + d_choice["text"]}
    else:
        choice["text"] = first.text + d_choice["text"]
        choice["logprobs"] = _merge_logprobs(first.logprobs, d_choice.get("logprobs"), first.text)
    choice["finish_reason"] = d_choice.get("finish_reason")
    choice["stop_reason"] = d_choice.get("stop_reason")
    if body.get("return_token_ids") and "token_ids" in choice:
        choice["token_ids"] = [first.token_id, *(d_choice.get("token_ids") or [])]
    d_tokens = (d_answer.get("usage") or {}).get("completion_tokens", 0)
    out["usage"] = client_usage(first, d_tokens)
    return msgspec.json.encode(out)


def _merge_logprobs(p: Any, d: Any, p_text: str) -> Any:
    """Completions logprobs: P's token's then D's, D's text offsets after P's text."""
    if not isinstance(p, dict) or not isinstance(d, dict):
        return p if d is None else d
    shift = len(p_text)
    return {
        "tokens": [*p.get("tokens", []), *d.get("tokens", [])],
        "token_logprobs": [*p.get("token_logprobs", []), *d.get("token_logprobs", [])],
        "top_logprobs": [*(p.get("top_logprobs") or []), *(d.get("top_logprobs") or [])],
        "text_offset": [*p.get("text_offset", []), *(o + shift for o in d.get("text_offset", []))],
    }


def first_event(first: First, body: dict[str, Any], chat: bool, *, last: bool) -> bytes:
    """The SSE event of P's token (with P's end when ``last``), in the client's stream's
    shape."""
    a = first.answer
    finish = first.finish_reason if last else None
    choice: dict[str, Any]
    if chat:
        delta = {"role": "assistant", "content": first.text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": first.text, "logprobs": first.logprobs,
                  "finish_reason": finish, "stop_reason": None}  # fmt: skip
        kind = "text_completion"
    if body.get("return_token_ids"):
        choice["token_ids"] = [first.token_id]
        if not chat:
            choice["prompt_token_ids"] = first.prompt_ids
    event = {"id": a.get("id"), "object": kind, "created": a.get("created"),
             "model": a.get("model"), "choices": [choice]}  # fmt: skip
    out = b"data: " + msgspec.json.encode(event) + b"\n\n"
    if last:
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {**event, "choices": [], "usage": client_usage(first, 0)}
            out += b"data: " + msgspec.json.encode(usage) + b"\n\n"
        out += b"data: [DONE]\n\n"
    return out
