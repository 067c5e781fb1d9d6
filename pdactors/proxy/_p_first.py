"""The proxy's P-first flow: P's token is the client's first, D continues after it.

One request: P is asked for one token (and its token ids); the moment it answers, a streamed
client gets that token; when it ends the answer (EOS, a stop string, or the client asked for
one token) the request is complete and no D is asked (P kept no KV: it frees it at once).
Otherwise D gets a completion of the prompt's ids and P's token (``first_token_from_p``: it
pulls the prompt's KV from P and computes P's token), and its answer follows P's token.
The bodies and answers: :mod:`pdactors.proxy._bodies`. A request whose P fails before its
token is served by D alone (the client's body as it came; ``fall_back_to_d``), or with that off
fails as in the concurrent flow (an HTTP status); so is one still waiting for the token of a P
that the health loop judges failed meanwhile (a stopped P: its leg is cut, counted as
``p_unhealthy``; :mod:`pdactors.proxy._health`). A D whose KV did not come (P died or hung
after its token) fails before its first token: it is asked once more for the same
continuation without ``kv_transfer_params`` (it computes the prompt and P's token itself).
D failing otherwise after P's token was streamed ends the stream with an error event.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import trio

from pdactors.proxy import _bodies as ft
from pdactors.proxy._asgi import PLACEMENT_HEADER, Reply
from pdactors.proxy._exchange import Exchange
from pdactors.proxy._legs import Legs
from pdactors.proxy._openai import COMPLETIONS, Failure
from pdactors.proxy._stream import ClientStream
from pdactors.wire import KVTransferParams

__all__ = ["complete_p_first"]

log = logging.getLogger("pdactors.proxy")


async def complete_p_first(legs: Legs, ex: Exchange, body: dict[str, Any], reply: Reply) -> None:
    """Serve ``ex`` (admitted, its prompt sent to P) P first; ends it on every path but an
    exception (which the caller's :meth:`~pdactors.proxy._legs.Legs.admitted` ends)."""
    chat = ex.endpoint.chat
    p_body = msgspec.json.encode(ft.prefill_body(body, chat, ex.transfer_id))
    answer = await legs.prefill_leg(ex, p_body)
    first = ft.read_first(answer, chat) if answer is not None else None
    if isinstance(first, str):
        message = f"prefill engine {ex.p.url}: {first}"
        legs.fail(ex, Failure.of(502, message, "upstream_error", "prefill_error"))
    if first is None or isinstance(first, str):
        if _may_fall_back(legs, ex, reply):
            await _fall_back_to_d(legs, ex, body, reply)
        else:
            await legs.answer_failure(ex, reply)
        return
    if ex.prompt_chars:  # a text prompt: its characters per token, for the placer
        legs.placer.count.observe(ex.prompt_chars, len(first.prompt_ids))
    ex.state.prompt_tokens = len(first.prompt_ids)
    if ft.ends_at_p(first, body, chat):
        legs.metrics.p_first.labels("ended_at_p").inc()
        if ex.stream:
            await _start(reply, ex)
            await reply.chunk(ft.first_event(first, body, chat, last=True))
            legs.apply(ex, ex.state.p_token_sent(trio.current_time()))
            legs.end(ex, "ok")
            await reply.chunk(b"", more=False)
        else:
            legs.end(ex, "ok")
            await reply.whole(200, msgspec.json.encode(ft.ended_at_p(first, body)), ex.transfer_id)
        return
    legs.metrics.p_first.labels("continued_on_d").inc()
    params = KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id=ex.p_engine_id,
        remote_bootstrap_addr=ex.p.bootstrap_url,
        transfer_id=ex.transfer_id,
        first_token_from_p=True,
    )
    d_body = msgspec.json.encode(ft.decode_body(body, chat, first, params))
    # The same continuation with D computing the prompt itself: asked once if D's leg fails
    # with its KV missing before any of its answer reached the client (P died or hung after
    # its token), so the stream never repeats or skips a token.
    local = msgspec.json.encode(ft.decode_body(body, chat, first, None))
    if ex.stream:
        await _start(reply, ex)
        await reply.chunk(ft.first_event(first, body, chat, last=False))
        now = trio.current_time()
        legs.apply(ex, ex.state.p_token_sent(now))
        ex.state.d_sent = now
        stream = ClientStream(body, chat, first)
        await legs.relay_decode(ex, d_body, reply, stream, local=local, path=COMPLETIONS.path)
        return
    raw = await legs.decode_whole(ex, d_body, local=local, path=COMPLETIONS.path)
    if raw is None:
        await legs.answer_failure(ex, reply)
        return
    try:
        merged = ft.merge_whole(first, msgspec.json.decode(raw), body, chat)
    except (msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
        message = f"decode engine {ex.d.url}: unreadable answer ({type(exc).__name__})"
        failure = Failure.of(502, message, "upstream_error", "decode_error")
        legs.end(ex, failure.outcome)
        await reply.failure(failure, ex.transfer_id)
        return
    legs.end(ex, "ok")
    await reply.whole(200, merged, ex.transfer_id)


def _may_fall_back(legs: Legs, ex: Exchange, reply: Reply) -> bool:
    """Whether a P-first request whose P failed before its token can go to D alone: P's
    failure was P's (a 5xx, a broken connection, an unreadable answer; not the request's
    4xx), nothing reached the client yet, time is left, and the operator allows it."""
    failure = ex.failure
    return (
        legs.config.fall_back_to_d
        and failure is not None
        and failure.outcome == "prefill_error"
        and failure.status >= 500
        and not reply.started
        and trio.current_time() < ex.deadline
    )


async def _fall_back_to_d(legs: Legs, ex: Exchange, body: dict[str, Any], reply: Reply) -> None:
    """Serve ``ex`` on D alone (the client's body as it came), after P failed before its
    first token: counted, and logged once with why."""
    assert ex.failure is not None
    log.warning(
        "proxy: request %s: prefill engine failed before its first token (%s); decode "
        "engine %s serves it alone",
        ex.transfer_id, ex.failure.message[:300], ex.d.url,
    )  # fmt: skip
    legs.metrics.fallbacks.labels(ex.failure.fallback or "prefill_failed").inc()
    legs.apply(ex, ex.state.fall_back())
    ex.d_scopes = []
    ex.placement = "local"
    reply.headers[:] = [(k, v) for k, v in reply.headers if k != PLACEMENT_HEADER]
    reply.headers.append((PLACEMENT_HEADER, b"local"))
    legs.prefill_sent(ex, "d")
    await legs.answer_from_decode(ex, body, reply)


async def _start(reply: Reply, ex: Exchange) -> None:
    await reply.start(200, b"text/event-stream", ex.transfer_id, (b"cache-control", b"no-cache"))
