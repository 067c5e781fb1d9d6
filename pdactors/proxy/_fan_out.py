"""A request for several choices — a completion's list of prompts, ``n`` > 1 — served as one
exchange per choice and merged into the one answer a single vLLM server gives.

A PD transfer carries one prompt's KV to one D for one continuation; vLLM makes each prompt of
a list, and each of ``n`` choices, an engine request of its own. The proxy splits the body
(:func:`split`) into single-prompt ``n: 1`` bodies, prompt-major, and serves each on its own
per-request path (placement, either flow, retries, migration) concurrently, each answering a
:class:`~pdactors.proxy._asgi.Reply` of its own whose messages :func:`serve_fanned_out` turns
into the client's answer:

* whole: one answer with choice ``prompt_i * n + j`` at that index (vLLM's order), ``usage``
  summed with each prompt's tokens counted once (as vLLM counts them), ``id``, ``created``,
  ``model`` (and the response headers) the first choice's;
* streamed: the client's stream opens once every choice's has, so a choice refused with a
  status (a 4xx for one prompt) refuses the request, as vLLM refuses before it streams; then
  the choices' events reach the client as they come, each choice's ``index`` rewritten and
  the stream's ``id`` and ``created`` the first event's; their usage events become one merged
  usage event at the end, then one ``data: [DONE]``.

The first choice to fail fails the request: the others are cancelled, then the client gets its
status and body (before the client's stream opened), else its error event as the stream's last.

*One prefill for a prompt's ``n`` choices.* Its first choice is placed and routed first (a
:class:`Lead`); once it is given to a P, the others go disaggregated to the same P (unless the
request pinned another placement, or that P left the rotation), as a single vLLM server's
``n`` children share one engine: that engine computes the prompt once and each other choice
only the last, partial block its prefix cache cannot hold (measured on vLLM 0.32, a 500-token
prompt, ``n`` = 4, 128-token blocks: 848 prompt tokens computed by a single server and by P
through the proxy; 1,232 at two P without following the first). A first choice not given
to a P (placed on D alone, or served whole by a P) lets the others be placed on their own.
Each choice's KV still crosses to its D.

What differs from one vLLM server: choice ``j`` of a prompt is asked with ``seed + j`` (vLLM's
V1 engine seeds its ``n`` child requests the same way, vllm/v1/engine/parallel_sampling.py,
but draws them in one engine, batched).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec
import trio
from hypercorn.typing import ASGISendEvent

from pdactors.proxy._asgi import PLACEMENT_HEADER, Reply, header
from pdactors.proxy._openai import Failure

__all__ = ["Lead", "ServeOne", "serve_fanned_out", "split"]

#: Serves one single-choice body on the proxy's own path, answering its reply; with its prompt's
#: :class:`Lead` and whether it is the prompt's first choice (which tells the lead).
ServeOne = Callable[[dict[str, Any], Reply, "Lead", bool], Awaitable[None]]
_Message = tuple[int, dict[str, Any]]  # a choice's position and one of its reply's messages

_DATA: Final = b"data: "
_END: Final = b"\n\n"


@dataclass(eq=False)
class Lead:
    """What the first choice of a prompt asked ``n`` > 1 times tells the others: ``placed`` is
    set once it was given an engine (or ended); ``p``: the P that computes its prompt (None:
    none does), where the others follow it."""

    placed: trio.Event = field(default_factory=trio.Event)
    p: str | None = None

    def done(self, p: str | None = None) -> None:
        if not self.placed.is_set():
            self.p = p
            self.placed.set()


def split(body: dict[str, Any], chat: bool) -> list[dict[str, Any]] | None:
    """A (validated) request's choices as single-prompt ``n: 1`` bodies, prompt-major (choice
    ``prompt_i * n + j`` at that index; a ``seed`` is ``seed + j``), or None when it asks for
    one choice."""
    n = body.get("n") or 1
    prompt = None if chat else body["prompt"]
    several = isinstance(prompt, list) and isinstance(prompt[0], str | list)
    prompts = prompt if several else [prompt]
    assert isinstance(prompts, list)
    if len(prompts) == 1 and n == 1:
        return None
    seed = body.get("seed")
    subs = []
    for one in prompts:
        for j in range(n):
            sub = {**body}
            if "n" in sub:
                sub["n"] = 1
            if not chat:
                sub["prompt"] = one
            if type(seed) is int:  # (not a bool; a seed of another type is the engine's 400)
                sub["seed"] = seed + j
            subs.append(sub)
    return subs


async def serve_fanned_out(
    serve_one: ServeOne, subs: list[dict[str, Any]], n: int, stream: bool, reply: Reply
) -> None:
    """Serve ``subs`` (from :func:`split`, ``n`` choices a prompt) concurrently with
    ``serve_one`` and answer ``reply`` with their merged answer (see the module's doc).
    Returns once the answer is complete and every choice's exchange has ended."""
    merge = _Merge(reply, len(subs), n, stream)
    send, receive = trio.open_memory_channel[_Message](0)
    leads = [Lead() for _ in range(0, len(subs), n)]  # one per prompt
    async with trio.open_nursery() as nursery:
        async with send:
            for pos, sub in enumerate(subs):
                choice = (leads[pos // n], pos % n == 0)
                nursery.start_soon(_serve_choice, serve_one, pos, sub, choice, send.clone(), merge)
        async with receive:
            async for pos, message in receive:
                if await merge.take(pos, message):
                    break
            else:  # every choice's exchange ended, not every one answered
                raise RuntimeError("a choice's exchange ended without an answer")
        if merge.failed:
            nursery.cancel_scope.cancel()
        # Else each choice's P leg, if still open, ends within its own grace.
    await merge.fail()  # (once the others ended: the request's end is all of theirs)


async def _serve_choice(
    serve_one: ServeOne,
    pos: int,
    body: dict[str, Any],
    choice: tuple[Lead, bool],
    out: trio.MemorySendChannel[_Message],
    merge: _Merge,
) -> None:
    """One choice's exchange, its reply's messages handed to ``merge``; a stream's events wait
    until the client's stream is open. A prompt's choices after its first wait until it is
    placed."""
    status = 0

    async def send(event: ASGISendEvent) -> None:
        nonlocal status
        message: dict[str, Any] = dict(event)
        if message["type"] == "http.response.start":
            status = message["status"]
        elif merge.stream and status == 200:
            await merge.opened.wait()
        try:
            await out.send((pos, message))
        except trio.BrokenResourceError:
            pass  # the client's answer is complete: nothing more of this choice is read

    lead, first = choice
    async with out:
        if not first:
            await lead.placed.wait()
        try:
            await serve_one(body, Reply(send), lead, first)
        finally:
            lead.done()  # (the first ended: nothing more to wait for)


class _Merge:
    """The client's answer, made of its choices' replies' messages (no IO but ``reply``)."""

    def __init__(self, reply: Reply, count: int, n: int, stream: bool) -> None:
        self.reply = reply
        self.count = count
        self.n = n
        self.stream = stream
        self.opened = trio.Event()  # the client's stream is open: its choices' events pass
        self._failure: tuple[int, bytes] | None = None  # the failed choice, its last bytes
        self._status = [0] * count
        self._headers: list[list[tuple[bytes, bytes]]] = [[] for _ in range(count)]
        self._bodies = [bytearray() for _ in range(count)]  # whole answers; a stream's rest
        self._started = 0
        self._answered = 0
        self._head: dict[str, Any] = {}  # the client's stream's id and created
        self._usage: dict[int, dict[str, Any]] = {}  # each choice's stream's usage event

    @property
    def failed(self) -> bool:
        """A choice failed: the request fails with its failure (:meth:`fail`)."""
        return self._failure is not None

    async def take(self, pos: int, message: dict[str, Any]) -> bool:
        """Take a message of choice ``pos``'s reply; True once the client's answer is
        complete or a choice failed."""
        if message["type"] == "http.response.start":
            self._status[pos] = message["status"]
            self._headers[pos] = list(message.get("headers") or ())
            if self.stream and self._status[pos] == 200:
                self._started += 1
                if self._started == self.count:
                    await self._open()
            return False
        data, more = message.get("body", b""), message.get("more_body", False)
        if self._status[pos] != 200 or not self.stream:
            self._bodies[pos] += data
            if more:
                return False
            if self._status[pos] != 200:
                self._failure = (pos, bytes(self._bodies[pos]))
                return True
            self._answered += 1
            if self._answered == self.count:
                await self._answer_whole()
            return self._answered == self.count
        out, error = self._events(pos, data, more)
        if error:
            self._failure = (pos, out)
            return True
        if not more:
            self._answered += 1
        if self._answered == self.count:
            await self.reply.chunk(out + self._usage_event() + b"data: [DONE]\n\n", more=False)
            return True
        if out:
            await self.reply.chunk(out)
        return False

    def _use_head(self, pos: int) -> str:
        """Take choice ``pos``'s placement header for the client's answer; its request id."""
        headers = self._headers[pos]
        placement = header(headers, PLACEMENT_HEADER)
        if placement is not None:
            self.reply.headers.append((PLACEMENT_HEADER, placement.encode()))
        return header(headers, b"x-request-id") or ""

    async def _open(self) -> None:
        tid = self._use_head(0)
        await self.reply.start(200, b"text/event-stream", tid, (b"cache-control", b"no-cache"))
        self.opened.set()

    async def fail(self) -> None:
        """Answer with the failed choice's failure, if one failed: its status and body, or
        its stream's last events (the client's stream open)."""
        if self._failure is None:
            return
        pos, data = self._failure
        if self.opened.is_set():
            await self.reply.chunk(data, more=False)
            return
        tid = self._use_head(pos)
        await self.reply.whole(self._status[pos], data, tid)

    async def _answer_whole(self) -> None:
        try:
            answers = [msgspec.json.decode(b) for b in self._bodies]
            merged = {**answers[0]}
            merged["choices"] = [
                {**c, "index": pos} for pos, a in enumerate(answers) for c in a["choices"]
            ]
            usage = _merged_usage([a.get("usage") for a in answers], self.n)
        except (msgspec.DecodeError, KeyError, TypeError, AttributeError) as exc:
            message = f"an engine's answer to one of the request's choices: {type(exc).__name__}"
            no = Failure.of(502, message, "upstream_error", "decode_error")
            self._failure = (0, no.body)
            self._status[0] = no.status
            return
        if usage is not None:
            merged["usage"] = usage
        tid = self._use_head(0)
        await self.reply.whole(200, msgspec.json.encode(merged), tid)

    def _events(self, pos: int, data: bytes, more: bool) -> tuple[bytes, bool]:
        """Choice ``pos``'s complete events in ``data`` as the client's, and whether one was an
        error event (then the last of them)."""
        buffer = self._bodies[pos] + data
        *events, rest = bytes(buffer).split(_END)
        self._bodies[pos] = bytearray(rest)
        if not more and rest.strip():
            events.append(rest)  # a last event without its blank line
        out = bytearray()
        for raw in events:
            event = _decoded(raw)
            if event is None:  # not JSON data (a comment, a field of another name)
                if raw.strip() and raw != b"data: [DONE]":
                    out += raw + _END
                continue
            if "error" in event:
                out += raw + _END
                return bytes(out), True
            choices = event.get("choices")
            if choices == [] and isinstance(event.get("usage"), dict):
                self._usage[pos] = event  # merged into one at the end
                continue
            if not self._head:
                self._head = {k: event[k] for k in ("id", "created") if k in event}
            event.update((k, v) for k, v in self._head.items() if k in event)
            for choice in choices if isinstance(choices, list) else ():
                if isinstance(choice, dict):
                    choice["index"] = pos
            out += _DATA + msgspec.json.encode(event) + _END
        return bytes(out), False

    def _usage_event(self) -> bytes:
        """The choices' usage events as one (none when none came)."""
        if not self._usage:
            return b""
        first = self._usage[min(self._usage)]
        usages = [self._usage.get(pos, {}).get("usage") for pos in range(self.count)]
        event = {**first, **self._head, "usage": _merged_usage(usages, self.n)}
        return _DATA + msgspec.json.encode(event) + _END


def _decoded(raw: bytes) -> dict[str, Any] | None:
    if not raw.startswith(_DATA):
        return None
    try:
        event = msgspec.json.decode(raw[len(_DATA) :])
    except msgspec.DecodeError:
        return None
    return event if isinstance(event, dict) else None


def _merged_usage(usages: list[Any], n: int) -> dict[str, Any] | None:
    """The choices' ``usage`` as the request's (vLLM's sums): each prompt's tokens once (its
    first choice's), every choice's completion tokens; None when no choice had one."""
    had = [u for u in usages if isinstance(u, dict)]
    if not had:
        return None
    prompt = sum(u.get("prompt_tokens") or 0 for u in usages[::n] if isinstance(u, dict))
    completion = sum(u.get("completion_tokens") or 0 for u in had)
    total = prompt + completion
    return {**had[0], "prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": total}  # fmt: skip
