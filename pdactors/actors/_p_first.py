"""The proxy's P-first flow: P's token is the client's first, D continues after it.

One request: P is asked for one token (and its token ids); the moment it answers, a streamed
client gets that token; when it ends the answer (EOS, a stop string, or the client asked for
one token) the request is complete and no D is asked (P kept no KV: it frees it at once).
Otherwise D gets a completion of the prompt's ids and P's token (``first_token_from_p``: it
pulls the prompt's KV from P and computes P's token), and its answer follows P's token.
The bodies and answers: :mod:`pdactors.actors._bodies`. A P that fails before its token
is served by D alone (the client's body as it came; ``fall_back_to_d``), or with that off fails
the request as in the concurrent flow (an HTTP status); D failing after P's token was streamed
ends the stream with an error event.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import msgspec
import trio

from pdactors.actors import _bodies as ft
from pdactors.actors._engine_http import EngineError
from pdactors.actors._proxy_wire import COMPLETIONS, Exchange, Failure, Reply
from pdactors.messages import KVTransferParams

if TYPE_CHECKING:
    from pdactors.actors.proxy import Proxy

__all__ = ["complete_p_first"]

log = logging.getLogger("pdactors.proxy")


async def complete_p_first(proxy: Proxy, ex: Exchange, body: dict[str, Any], reply: Reply) -> None:
    """Serve ``ex`` P first; ends it (its counters and metrics) on every path."""
    try:
        await _serve(proxy, ex, body, reply)
    except BaseException:
        ex.p_scope.cancel()
        proxy._end(ex, "cancelled")
        raise


async def _serve(proxy: Proxy, ex: Exchange, body: dict[str, Any], reply: Reply) -> None:
    chat = ex.endpoint.chat
    p_body = msgspec.json.encode(ft.prefill_body(body, chat, ex.transfer_id))
    answer = await proxy._prefill_leg(ex, p_body)
    first = ft.read_first(answer, chat) if answer is not None else None
    if isinstance(first, str):
        message = f"prefill engine {ex.p.url}: {first}"
        ex.fail(Failure.of(502, message, "upstream_error", "prefill_error"))
    if (first is None or isinstance(first, str)) and proxy.may_fall_back(ex, reply):
        await proxy.fall_back_to_d(ex, body, reply)
        return
    if first is None or isinstance(first, str):
        assert ex.failure is not None
        log.warning("proxy: request %s failed: %s", ex.transfer_id, ex.failure.body[:300])
        proxy._end(ex, ex.failure.outcome)
        await reply.failure(ex.failure)
        return
    if ex.prompt_chars:  # a text prompt: its characters per token, for the placer
        proxy.placer.count.observe(ex.prompt_chars, len(first.prompt_ids))
    ex.prompt_tokens = len(first.prompt_ids)
    if ft.ends_at_p(first, body, chat):
        proxy.metrics.p_first.labels("ended_at_p").inc()
        proxy._end(ex, "ok")
        if ex.stream:
            await _start(reply, ex)
            await reply.chunk(ft.first_event(first, body, chat, last=True))
            proxy._first_chunk(ex)
            await reply.chunk(b"", more=False)
        else:
            await reply.whole(200, msgspec.json.encode(ft.ended_at_p(first, body)), ex.transfer_id)
        return
    proxy.metrics.p_first.labels("continued_on_d").inc()
    params = KVTransferParams(
        do_remote_prefill=True,
        remote_engine_id=ex.p_engine_id,
        remote_bootstrap_addr=ex.p.bootstrap_url,
        transfer_id=ex.transfer_id,
        first_token_from_p=True,
    )
    d_body = msgspec.json.encode(ft.decode_body(body, chat, first, params))
    if ex.stream:
        await _start(reply, ex)
        await reply.chunk(ft.first_event(first, body, chat, last=False))
        proxy._first_chunk(ex)
        ex.d_sent = trio.current_time()
        resp = await proxy._open_decode(ex, d_body, COMPLETIONS.path)
        if resp is None:
            await proxy._stream_failure(ex, reply)
            await reply.chunk(b"", more=False)
            proxy._end(ex, ex.failure.outcome if ex.failure else "decode_error")
            return
        stream = ft.ClientStream(first, chat) if ft.wants_events(body, chat) else None
        await proxy._relay(ex, resp, reply, transform=stream.feed if stream else None)
        return
    resp = await proxy._open_decode(ex, d_body, COMPLETIONS.path)
    if resp is None:
        assert ex.failure is not None
        proxy._end(ex, ex.failure.outcome)
        await reply.failure(ex.failure)
        return
    raw = await _read_whole(proxy, ex, resp)
    if raw is None:
        assert ex.failure is not None
        proxy._end(ex, ex.failure.outcome)
        await reply.failure(ex.failure)
        return
    try:
        merged = ft.merge_whole(first, msgspec.json.decode(raw), body, chat)
    except (msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
        message = f"decode engine {ex.d.url}: unreadable answer ({type(exc).__name__})"
        failure = Failure.of(502, message, "upstream_error", "decode_error")
        proxy._end(ex, failure.outcome)
        await reply.failure(failure)
        return
    proxy._end(ex, "ok")
    await reply.whole(200, merged, ex.transfer_id)


async def _start(reply: Reply, ex: Exchange) -> None:
    await reply.start(200, b"text/event-stream", ex.transfer_id, (b"cache-control", b"no-cache"))


async def _read_whole(proxy: Proxy, ex: Exchange, resp: Any) -> bytes | None:
    """D's whole answer, or None with ``ex.failure`` set."""
    try:
        with ex.decode_scope(), trio.move_on_at(ex.deadline) as timer:
            try:
                return bytes(await resp.read())
            except EngineError as exc:
                ex.fail(proxy._transport_failure(ex.d, exc))
        if timer.cancelled_caught and ex.failure is None:
            ex.fail(proxy._timeout_failure("D did not finish"))
        return None
    finally:
        await resp.aclose()
