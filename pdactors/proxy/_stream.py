"""The client's stream, event by event: an engine's SSE events made into the client's stream,
and what the client got so far, so that another engine can continue the request right after
it (a migration: :meth:`ClientStream.next_leg`). No IO.

An engine's leg of a stream comes in one of two shapes:

* *native*: the engine answers the client's own request (its chat or completion stream).
  The proxy asked it for its token ids too (vLLM's ``return_token_ids``: the prompt's on the
  first event, each event's own), and gives them to the client only if it asked for them
  (else they read ``null``, as a plain server writes them; chat events that only carried token
  ids are dropped, as a plain server never sends them);
* *continuing*: the engine answers a completion of the prompt's token ids and every token the
  client already got (P's token in the P-first flow; everything relayed, after a migration),
  re-framed as the client's stream: chat chunks for a chat, completion text offsets after the
  text already sent, ``usage`` counting the prompt once and every token the client got.

A request whose body the continuation cannot carry (``echo``, tools, response formats:
:func:`pdactors.proxy._bodies.applies`) passes as the engine sends it, untracked: another
engine can take it over only while none of it was relayed.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec

from pdactors.proxy._bodies import First, applies, continuation_body, max_tokens

__all__ = ["ClientStream"]

#: What an engine's event must have to be read (SSE data lines only; errors pass as they are).
_DATA: Final = b"data: "


class ClientStream:
    """One streamed request's events, from its engine legs to the client (see the module's
    doc). ``first``: P's answer, in the P-first flow (its token went to the client first)."""

    def __init__(self, body: dict[str, Any], chat: bool, first: First | None = None) -> None:
        self.body = body
        self.chat = chat
        self.tracked = applies(body, chat)
        self._wants_ids = bool(body.get("return_token_ids"))
        #: The prompt's token ids (from P's answer, or the engine's first event); None until
        #: known.
        self.prompt_ids: list[int] | None = None
        self.ids: list[int] = []  # every token the client got
        self.text = ""  # their text
        self.relayed = False  # some of an engine's answer reached the client
        self._head: dict[str, Any] = {}  # id, created, model: the client's stream's
        self._continuing = False
        self._before = (0, 0)  # the tokens and the text the client had when this leg began
        self._buffer = b""
        if first is not None:
            self.prompt_ids = list(first.prompt_ids)
            self.ids, self.text = [first.token_id], first.text
            a = first.answer
            self._head = {"id": a.get("id"), "created": a.get("created"), "model": a.get("model")}
            self._continue()

    def _continue(self) -> None:
        self._continuing = True
        self._before = (len(self.ids), len(self.text))
        self._buffer = b""  # a broken leg's partial event was never relayed

    def native_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """``body`` (the client's, maybe with ``kv_transfer_params``) for a native leg: with
        token ids asked for when the stream is tracked."""
        return {**body, "return_token_ids": True} if self.tracked else body

    def next_leg(self) -> tuple[dict[str, Any], bool] | None:
        """The body of the request another engine continues with now, and whether it is a
        completion (else the client's own request, sent on its route); None when it cannot
        continue without repeating or skipping what the client got (an untracked stream
        begun). From here on the stream is re-framed after what the client got."""
        if self.prompt_ids is not None and (self.relayed or self._continuing):
            done = len(self.ids)
            owed = max_tokens(self.body, self.chat)
            if owed is not None and done >= owed:
                return None  # every token was sent: only the engine's end was lost
            self._continue()
            ids = [*self.prompt_ids, *self.ids]
            return continuation_body(self.body, self.chat, ids, done), True
        if self.relayed:
            return None
        self._buffer = b""
        return self.native_body(self.body), False

    def feed(self, data: bytes) -> bytes:
        """The client's bytes for ``data`` (whole events only; a partial one waits)."""
        if not self.tracked:
            self.relayed = self.relayed or bool(data)
            return data
        self._buffer += data
        *events, self._buffer = self._buffer.split(b"\n\n")
        out = b"".join(self._event(e) for e in events if e.strip())
        self.relayed = self.relayed or bool(out)
        return out

    def _event(self, raw: bytes) -> bytes:
        if not raw.startswith(_DATA) or raw == b"data: [DONE]" or b'"error"' in raw[:16]:
            return raw + b"\n\n"
        try:
            event = msgspec.json.decode(raw[len(_DATA) :])
        except msgspec.DecodeError:
            return raw + b"\n\n"
        if not isinstance(event, dict):
            return raw + b"\n\n"
        choices = event.get("choices") or []
        self._learn(event, choices)
        if self._continuing:
            event = self._continued(event, choices)
        elif not self._wants_ids:
            if self.chat and choices and all(_only_ids(c) for c in choices):
                return b""  # an event a plain server does not send
            for holder in (event, *choices):
                for key in ("prompt_token_ids", "token_ids"):
                    if holder.get(key) is not None:
                        holder[key] = None
        return _DATA + msgspec.json.encode(event) + b"\n\n"

    def _learn(self, event: dict[str, Any], choices: list[dict[str, Any]]) -> None:
        """What the client gets from this event: token ids and text (and, on a native leg's
        first event, the prompt's ids and the stream's head)."""
        if not self._head:
            self._head = {k: event.get(k) for k in ("id", "created", "model")}
        for choice in choices:
            if self.prompt_ids is None:
                prompt = choice.get("prompt_token_ids") or event.get("prompt_token_ids")
                if isinstance(prompt, list):
                    self.prompt_ids = prompt
            self.ids += choice.get("token_ids") or []
            if self.chat and not self._continuing:
                self.text += (choice.get("delta") or {}).get("content") or ""
            else:
                self.text += choice.get("text") or ""

    def _continued(self, event: dict[str, Any], choices: list[dict[str, Any]]) -> dict[str, Any]:
        """A continuing leg's completion event as the client's: offsets and usage after what
        came before it, a chat chunk for a chat."""
        tokens_before, text_before = self._before
        usage = event.get("usage")
        if usage and self.prompt_ids is not None:
            prompt = len(self.prompt_ids)
            completion = tokens_before + usage.get("completion_tokens", 0)
            event["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion,
                              "total_tokens": prompt + completion}  # fmt: skip
        for choice in choices:
            if "prompt_token_ids" in choice:  # the leg's: the prompt and what came before
                choice["prompt_token_ids"] = None
            if not self._wants_ids and "token_ids" in choice:
                choice["token_ids"] = None
            lp = choice.get("logprobs")
            if isinstance(lp, dict) and lp.get("text_offset"):
                lp["text_offset"] = [o + text_before for o in lp["text_offset"]]
        if not self.chat:
            return event
        return {
            **self._head, "object": "chat.completion.chunk",
            "choices": [
                {"index": c.get("index", 0), "delta": {"content": c.get("text", "")},
                 "logprobs": None, "finish_reason": c.get("finish_reason"),
                 **({"token_ids": c["token_ids"]} if self._wants_ids else {})}
                for c in choices
            ],
            **({"usage": event["usage"]} if event.get("usage") else {}),
        }  # fmt: skip


def _only_ids(choice: dict[str, Any]) -> bool:
    """A chat event's choice that carries nothing but token ids (vLLM sends one when token
    ids were asked for and the text of the step is held back)."""
    return (
        choice.get("delta") == {}
        and bool(choice.get("token_ids"))
        and choice.get("finish_reason") is None
        and choice.get("logprobs") is None
    )
